"""``trtllm-dflash learning-curve`` (train/curve.py) end to end on a tiny random target with SmolLM2's tokenizer: regeneration shards with their
CPU cost, a training run whose every checkpoint is kept as a curve point, τ replayed against the real decoder, and
the JSON + PNG report."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import run_cli, write_tiny_smol
from trtllm_dflash.train import curve


@pytest.fixture(scope="module")
def tiny_smol(smollm2, tmp_path_factory):
    return write_tiny_smol(tmp_path_factory.mktemp("curve") / "tiny-smol", smollm2["target"])


def _run_curve(work, target, *args):
    return run_cli(["learning-curve", "--work", str(work), "--target", str(target), *args])


def _curve(work, target, *args):
    r = _run_curve(work, target, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_learning_curve_end_to_end(tiny_smol, tmp_path):
    pool = tmp_path / "pool.jsonl"
    rows = [{"id": f"code/x/f{i}", "prompt": f"Complete this Python function.\n```python\ndef f{i}(x):\n```",
             "chat": True} for i in range(8)]
    rows += [{"id": f"chat/x/p{i}", "prompt": f"Explain item number {i} of a list.", "chat": True} for i in range(8)]
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    work = tmp_path / "work"
    used = tmp_path / "training_prompts.jsonl"  # a drafter's prompts, none of them in this pool yet
    used.write_text(json.dumps({"id": "code/elsewhere/g", "prompt": "", "chat": True}) + "\n")
    regen = ("regen", "--pool", str(pool), "--num-prompts", "12", "--tokens", "60", "--max-new-tokens", "12",
             "--gen-batch-size", "4", "--dtype", "float32", "--exclude", str(used))
    out = json.loads(_curve(work, tiny_smol, *regen).splitlines()[-1])
    assert out["response_tokens"] >= 60 and out["cpu_s"] > 0
    cost = json.loads((work / "regen" / "cost-w0.json").read_text())
    assert all(s["response_tokens"] > 0 and s["cpu_s"] > 0 for s in cost["shards"].values())
    # a second call resumes: nothing is regenerated
    again = json.loads(_curve(work, tiny_smol, *regen).splitlines()[-1])
    assert again["shards"] == out["shards"] and again["cpu_s"] == out["cpu_s"]
    # the same file name and as many prompts, other contents (a shipped drafter's prompts grew): the sample changed
    # (code/x/f0 was in it), so it refuses rather than plan the remaining shards anew
    used.write_text(used.read_text() + json.dumps({"id": "code/x/f0", "prompt": "", "chat": True}) + "\n")
    r = _run_curve(work, tiny_smol, *regen)
    assert r.returncode != 0 and "other settings" in r.stderr and "--exclude" in r.stderr

    got = json.loads(_curve(work, tiny_smol, "prompts", "--pool", str(pool), "--num-prompts", "12", "--size", "60",
                            "--out", str(tmp_path / "used.jsonl")).splitlines()[-1])  # checked against the shards
    used = [json.loads(line) for line in (tmp_path / "used.jsonl").read_text().splitlines()]
    assert len(used) == got["prompts"] == sum(s["sequences"] for s in cost["shards"].values())
    assert {r["id"] for r in used} <= {r["id"] for r in rows}
    first = cost["shards"]["regen-00000.safetensors"]  # --skip as train's: the prompts of the later shards only
    later = json.loads(_curve(work, tiny_smol, "prompts", "--pool", str(pool), "--num-prompts", "12", "--size", "60",
                              "--skip", str(first["response_tokens"]), "--out", str(tmp_path / "later.jsonl")
                              ).splitlines()[-1])
    assert later["prompts"] == len(used) - first["sequences"]
    assert (tmp_path / "later.jsonl").read_text().splitlines() == \
        (tmp_path / "used.jsonl").read_text().splitlines()[first["sequences"]:]
    for w in ("0", "1"):  # taps ahead of training, one process per core
        _curve(work, tiny_smol, "taps", "--size", "60", "--tap-layers", "1", "3", "--workers", "2", "--worker", w)
    tapped = {p.name for p in (work / "regen-taps-bfloat16").glob("shard-*.safetensors")}
    assert tapped == {s.replace("regen-", "shard-") for s in cost["shards"]}  # every shard once, between the two
    _curve(work, tiny_smol, "train", "--size", "40", "--epochs", "2", "--ckpt-every", "2", "--samples-per-step", "2",
           "--num-layers", "1", "--tap-layers", "1", "3")
    kept = sorted((work / "drafters").iterdir())
    assert len(kept) >= 2
    pts = [json.loads((d / "curve_point.json").read_text()) for d in kept]
    assert all((d / "model.safetensors").is_file() for d in kept)
    by_step = sorted(pts, key=lambda p: p["step"])
    seen = [p["seen_response_tokens"] for p in by_step]
    assert seen == sorted(seen) and seen[-1] <= by_step[-1]["data_response_tokens"]

    last = str(kept[-1])
    # the drafter directory's retrieval datastore, from the same regen shards: eval adds the tree verify with it
    from trtllm_dflash.cli import main as cli

    assert cli(["datastore", "--from", str(work / "regen"), "--out", str(Path(last) / "datastore.dflash")]) == 0
    evargs = ("--limit", "2", "--max-new-tokens", "8", "--batch-size", "2")
    _curve(work, tiny_smol, "eval", "--drafters", last, *evargs)
    _curve(work, tiny_smol, "eval", "--drafters", last, *evargs, "--decode")
    ev = {m: json.loads(next((work / "eval").glob(f"{m}-*.json")).read_text()) for m in ("replay", "decode")}
    for ds in ("humaneval", "mtbench"):
        assert ev["decode"][ds]["lossless"]
        assert ev["replay"][ds]["tau"] == ev["decode"][ds]["tau"]
        assert ev["replay"][ds]["steps"] == ev["decode"][ds]["steps"]
        assert ev["replay"][ds]["ngram_tau"] == ev["decode"][ds]["ngram_tau"]  # prompt lookup where 2-grams recur
        assert ev["replay"][ds]["ngram_steps"] == ev["decode"][ds]["ngram_steps"]
        assert ev["replay"][ds]["tree_tau"] == ev["decode"][ds]["tree_tau"]  # runtime.tree, alternates and lookup
        assert ev["replay"][ds]["tree_steps"] == ev["decode"][ds]["tree_steps"]
        for key in ("tree_datastore_tau", "tree_datastore_steps"):  # runtime.datastore's proposals as well
            assert ev["replay"][ds][key] == ev["decode"][ds][key]
    assert ev["decode"]["datastore_tokens"] > 0
    # evaluated again: the kept result is printed (not silence); another drafter of the same name is refused, so the
    # kept file, named by the drafter's name, cannot pass for its result
    again = json.loads(_curve(work, tiny_smol, "eval", "--drafters", last, *evargs).splitlines()[-1])
    assert again["cached"] and {k: again[k] for k in ev["replay"]} == ev["replay"]
    twin = tmp_path / "twin" / Path(last).name
    shutil.copytree(last, twin)
    r = _run_curve(work, tiny_smol, "eval", "--drafters", str(twin), *evargs)
    assert r.returncode != 0 and repr(str(twin)) in r.stderr and "another --work" in r.stderr, r.stderr[-2000:]
    rep = json.loads(_curve(work, tiny_smol, "report", "--out", str(tmp_path / "rep"), "--limit", "2",
                            "--max-new-tokens", "8").splitlines()[-1])
    assert rep["points"] == 1
    doc = json.loads((tmp_path / "rep" / "curve.json").read_text())
    assert doc["points"][0]["humaneval"]["tau"] >= 1.0
    assert (tmp_path / "rep" / "curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # continued training from a kept drafter gets its own name and records where it started
    _curve(work, tiny_smol, "train", "--size", "40", "--epochs", "1", "--ckpt-every", "100", "--samples-per-step", "2",
           "--num-layers", "1", "--tap-layers", "1", "3", "--init", last, "--lr", "1e-4", "--autocast", "none")
    warm = [d for d in (work / "drafters").iterdir() if "-from-" in d.name]
    assert len(warm) == 1 and warm[0].name.startswith(f"regen-40-from-{Path(last).name}@")
    point = json.loads((warm[0] / "curve_point.json").read_text())
    assert point["init"] == last
    # float32 (the faster choice on a CPU without bf16 units) reaches the trainer and both records say so
    assert point["autocast"] == "none" and by_step[-1]["autocast"] == "bf16"
    assert json.loads((warm[0] / "training_config.json").read_text())["autocast"] == "none"
    # the objective's ablation, self-distillation to the regenerated shards' top-k, runs beside it under its own name
    _curve(work, tiny_smol, "train", "--size", "40", "--epochs", "1", "--ckpt-every", "100", "--samples-per-step", "2",
           "--num-layers", "1", "--tap-layers", "1", "3", "--init", last, "--lr", "1e-4", "--autocast", "none",
           "--loss-vocab", "full", "--distill", "0.5")
    distilled = [d for d in (work / "drafters").iterdir() if "-full-vocab-distill0.5@" in d.name]
    assert len(distilled) == 1 and distilled[0].name.startswith(f"regen-40-from-{Path(last).name}-full-vocab-")
    point = json.loads((distilled[0] / "curve_point.json").read_text())
    assert (point["loss_vocab"], point["distill"]) == ("full", 0.5)
    config = json.loads((distilled[0] / "training_config.json").read_text())
    assert (config["loss_vocab"], config["distill"]) == ("full", 0.5)


def test_regen_with_taps_leaves_the_taps_phase_nothing_to_do(tiny_smol, tmp_path):
    from trtllm_dflash.train.data import read_shard
    from trtllm_dflash.train.regen import read_regen_shard

    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"chat/x/p{i}", "prompt": f"Say {i} twice.", "chat": True}) + "\n"
                            for i in range(6)))
    work = tmp_path / "work"
    _curve(work, tiny_smol, "regen", "--pool", str(pool), "--num-prompts", "6", "--tokens", "30", "--max-new-tokens",
           "8", "--gen-batch-size", "3", "--dtype", "float32", "--taps", "--tap-layers", "1", "3")
    cost = json.loads((work / "regen" / "cost-w0.json").read_text())
    assert cost["shards"] and all(s["taps"] == [1, 3] for s in cost["shards"].values())
    tdir = work / "regen-taps-float32"
    made = {p.name: p.read_bytes() for p in tdir.glob("shard-*.safetensors")}
    assert set(made) == {s.replace("regen-", "shard-") for s in cost["shards"]}
    for name in cost["shards"]:
        regen, train = read_regen_shard(work / "regen" / name), read_shard(tdir / name.replace("regen-", "shard-"))
        assert [r.ids.tolist() for r in regen] == [s.ids.tolist() for s in train]
        assert all(s.taps.shape == (len(s.ids), 2 * 64) and not s.taps[-1].any() for s in train)
    tokens = sum(s["response_tokens"] for s in cost["shards"].values())
    _curve(work, tiny_smol, "taps", "--size", str(tokens), "--taps-dtype", "float32", "--tap-layers", "1", "3")
    assert {p.name: p.read_bytes() for p in tdir.glob("shard-*.safetensors")} == made  # found, not redone


def test_pool_sample_can_exclude_a_drafters_training_prompts(tmp_path):
    pool_prompts = curve.pool_prompts
    pool = tmp_path / "pool.jsonl"
    rows = [{"id": f"code/x/f{i}", "prompt": f"def f{i}(x):", "chat": True} for i in range(10)]
    rows += [{"id": f"chat/x/p{i}", "prompt": f"Explain {i}.", "chat": True} for i in range(10)]
    pool.write_text("".join(json.dumps(r) + "\n" for r in rows))
    used = tmp_path / "training_prompts.jsonl"
    gone = {"code/x/f1", "code/x/f7", "chat/x/p0", "chat/x/p5"}
    used.write_text("".join(json.dumps({"id": i, "prompt": "", "chat": True}) + "\n" for i in sorted(gone)))
    everything = pool_prompts(pool, 100, 0.5, 0, [str(used)])
    assert {r["id"] for r in everything} == {r["id"] for r in rows} - gone  # the rest, each once
    assert len(everything) == 16
    sample = pool_prompts(pool, 12, 0.5, 3, [str(used)])
    assert len(sample) == 12 and not {r["id"] for r in sample} & gone
    assert sample == pool_prompts(pool, 12, 0.5, 3, [str(used)])  # seeded
    assert pool_prompts(pool, 100, 0.5, 0) != everything  # nothing excluded without the file


def test_train_can_skip_the_shards_a_drafter_already_trained_on(tmp_path):
    prefix_shards = curve.prefix_shards
    # two workers' cost files, shards 0-4 of 10/20/30/40/50 tokens; shard 5 missing (not made yet), 6 made
    costs = {0: {}, 1: {}}
    for c, n in enumerate((10, 20, 30, 40, 50, None, 70)):
        if n:
            costs[c % 2][f"regen-{c:05d}.safetensors"] = {"response_tokens": n, "cpu_s": n / 10}
    for w, shards in costs.items():
        (tmp_path / f"cost-w{w}.json").write_text(json.dumps({"shards": shards}))
    paths, tokens, cpu = prefix_shards(tmp_path, 100)
    assert [p.name for p in paths] == [f"regen-{c:05d}.safetensors" for c in range(4)] and tokens == 100
    paths, tokens, cpu = prefix_shards(tmp_path, 150, skip=30)  # after shards 0-1: shards 2-4
    assert [p.name for p in paths] == [f"regen-{c:05d}.safetensors" for c in (2, 3, 4)]
    assert tokens == 120 and cpu == pytest.approx(12.0)
    with pytest.raises(SystemExit, match=r"--skip 35: .* shards end at 30 and 60"):
        prefix_shards(tmp_path, 150, skip=35)
    with pytest.raises(SystemExit, match=r"--skip 150: .* pass one of those"):  # nothing would be left
        prefix_shards(tmp_path, 150, skip=150)
    with pytest.raises(SystemExit, match=r"--size 200: .* holds only 150"):  # shard 6 is past the gap
        prefix_shards(tmp_path, 200)
