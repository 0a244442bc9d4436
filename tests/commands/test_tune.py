"""``trtllm-dflash tune``: the kernel table filled for a pair ahead of serving, read back without measuring again."""

import json

import pytest

from conftest import run_cli
from trtllm_dflash.models import compiled, layers, products


def test_tune_fills_the_table_that_the_runtime_then_reads(tiny_dirs, tmp_path, monkeypatch):
    """Every product and attention shape of the pair's target widths and draft passes is measured once, written to
    the machine's table in the cache, and a second run measures nothing."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    target, drafter = tiny_dirs["llama"]
    args = ["tune", "--target", str(target), "--drafter", str(drafter), "--threads", "1", "--max-tokens", "8",
            "--max-rows", "2"]
    r = run_cli(args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    (first,) = out["tables"]
    assert first["threads"] == 1 and first["measured"] == first["choices"] > 0
    doc = json.loads(open(first["table"]).read())
    assert doc["key"]["threads"] == 1 and len(doc["choices"]) == first["choices"]
    assert any(name.startswith("attention:") for name in doc["choices"])
    assert all(set(times) >= {doc["choices"][name]} for name, times in doc["timings"].items())
    monkeypatch.setattr(products, "_TABLES", {})
    again = json.loads(run_cli(args).stdout)["tables"][0]
    assert again["measured"] == 0 and again["choices"] == first["choices"]


@pytest.mark.parametrize("flag, value, field", [("--threads", "0", "--threads"), ("--threads", "two", "--threads"),
                                                ("--max-tokens", "0", "--max-tokens")])
def test_tune_refuses_bad_input_by_name(tiny_dirs, flag, value, field):
    target, drafter = tiny_dirs["llama"]
    r = run_cli(["tune", "--target", str(target), "--drafter", str(drafter), flag, value])
    assert r.returncode == 2 and field in r.stderr and value in r.stderr, r.stderr


def test_an_unknown_kernel_setting_is_refused_by_name(tiny_dirs, monkeypatch):
    """``TRTLLM_DFLASH_CPU_GEMM`` naming no kernel fails the command with exit 2 and the fix (read at import: a fresh
    process)."""
    target, drafter = tiny_dirs["llama"]
    monkeypatch.setenv(products.ENV, "fast")
    r = run_cli(["tune", "--target", str(target), "--drafter", str(drafter), "--max-tokens", "2", "--max-rows", "1"],
                fresh=True)
    assert r.returncode == 2, r.stderr
    assert "TRTLLM_DFLASH_CPU_GEMM='fast'" in r.stderr and "unset it" in r.stderr


def test_refresh_measures_every_choice_again(tiny_dirs, tmp_path, monkeypatch):
    """``--refresh`` replaces what the file holds (a table filled on a busy machine keeps wrong choices otherwise):
    choices planted in the file are measured again, none survives."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    monkeypatch.setattr(layers, "_ATTENTION_PLANS", {})  # attention choices other tests made in this process
    target, drafter = tiny_dirs["llama"]
    args = ["tune", "--target", str(target), "--drafter", str(drafter), "--threads", "1", "--max-tokens", "4",
            "--max-rows", "2"]
    first = json.loads(run_cli(args).stdout)["tables"][0]
    path = first["table"]
    doc = json.loads(open(path).read())
    doc["timings"] = {name: {"planted": 1.0} for name in doc["choices"]}
    open(path, "w").write(json.dumps(doc))
    monkeypatch.setattr(products, "_TABLES", {})
    again = json.loads(run_cli([*args, "--refresh"]).stdout)["tables"][0]
    assert again["measured"] == again["choices"] == first["choices"]
    redone = json.loads(open(path).read())
    assert set(redone["choices"]) == set(doc["choices"])
    assert not any("planted" in times for times in redone["timings"].values())


def test_tune_compile_records_the_faster_decode_step(tiny_dirs, tmp_path, monkeypatch):
    """``--compile`` compiles the target's decode step in each product form and each variant a process meets (into
    the cache's inductor folder), times them and the native step against the eager step and records the fastest,
    which ``auto`` then runs."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    target, drafter = tiny_dirs["llama"]
    r = run_cli(["tune", "--target", str(target), "--drafter", str(drafter), "--threads", "1", "--max-tokens", "2",
                 "--max-rows", "2", "--compile"], fresh=True)
    assert r.returncode == 0, r.stderr
    (table,) = json.loads(r.stdout)["tables"]
    step = table["compiled_step"]
    assert set(step["choices"]) == set(step["step_ms"]) == {"1", "2"}  # --max-rows 2: buckets 1 and 2
    forms = compiled.forms()  # weight-major and linear, and packed where this machine builds its kernel
    engines = compiled.engines()  # those compiled, and the native step where this machine builds it
    for rows, ms in step["step_ms"].items():
        assert set(ms) == {*engines, "eager"} and step["choices"][rows] == min(ms, key=ms.get)
    assert {form: len(s) for form, s in step["first_step_seconds"].items()} == {form: 4 for form in forms}
    doc = json.loads(open(table["table"]).read())
    entries = {name.rsplit(":", 1)[1]: doc["choices"][name] for name in doc["choices"] if name.startswith("compiled:")}
    assert entries == step["choices"]
    assert any((tmp_path / "inductor").iterdir())
