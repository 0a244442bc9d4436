"""perf/bench_peers.py: this toolkit side by side with vLLM's DFlash (the peer in .peers/vllm, made by
build_scripts/peer_vllm.sh). Against the real peer where it is installed (every configuration decodes, ours are
lossless, vLLM's outputs equal ours, τ comes from vLLM's own counters); without it, the benchmark refuses by name."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import perf_script

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "perf" / "bench_peers.py"
PEER = ROOT / ".peers" / "vllm"
PEER_PROBLEM = perf_script("bench_peers").peer_problem(PEER)  # None where the peer is installed


@pytest.mark.parametrize("flags, script", [
    (["--peer-venv"], "bash build_scripts/peer_vllm.sh"),  # vLLM: in the default paths
    (["--paths", "in-process,server", "--llamacpp-dir"], "bash build_scripts/peer_llamacpp.sh"),
])
def test_refuses_without_the_peer_and_names_the_install_script(tmp_path, flags, script):
    run = subprocess.run([sys.executable, str(SCRIPT), *flags, str(tmp_path / "none"),
                          "--out-dir", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert script in run.stderr and str(tmp_path / "none") in run.stderr
    assert not (tmp_path / "out").exists()  # refused before writing anything


def test_bad_paths_exit_2():
    run = subprocess.run([sys.executable, str(SCRIPT), "--paths", "in-process,nope"], capture_output=True, text=True)
    assert run.returncode == 2 and "--paths 'in-process,nope'" in run.stderr


def test_bad_vllm_variants_and_modes_exit_2_naming_the_choices():
    for flag, value, choices in (("--vllm-variants", "eager,fast", "default, eager, nobind, gomp"),
                                 ("--vllm-modes", "ar,dflash-8", "ar and dflash-16")):
        run = subprocess.run([sys.executable, str(SCRIPT), flag, value], capture_output=True, text=True)
        assert run.returncode == 2 and f"{flag} {value!r}" in run.stderr and choices in run.stderr, run.stderr


def test_first_difference_names_prompt_index_and_tokens():
    bp = perf_script("bench_peers")
    assert bp.first_difference({"a": (1, 2, 3)}, {"a": (1, 2, 3)}) is None
    assert bp.first_difference({"a": (1, 2), "b": (5, 6, 7)}, {"a": (1, 2), "b": (5, 9)}) == {
        "prompt": "b", "index": 1, "this": 6, "reference": 9, "len_this": 3, "len_reference": 2}
    assert bp.first_difference({"a": (1, 2)}, {"a": (1, 2, 3)})["index"] == 2  # one output stops earlier


@pytest.mark.slow
@pytest.mark.skipif(PEER_PROBLEM is not None, reason=f"{PEER_PROBLEM}")
def test_against_the_real_vllm_peer(smollm2, tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--datasets", "humaneval", "--limit", "2", "--max-new-tokens", "12",
         "--concurrency", "1,2", "--threads", "2", "--target", smollm2["target"], "--drafter", smollm2["drafter"],
         "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "peers.jsonl").read_text().splitlines()]
    assert records == [json.loads(line) for line in run.stdout.splitlines()]
    assert (tmp_path / "peers.png").stat().st_size > 0
    got = {(r["system"], r["path"], r["mode"], r["concurrency"]) for r in records}
    want = {(s, p, m, c) for c in (1, 2) for s, p, m in [
        ("vllm", "offline", "ar"), ("vllm", "offline", "dflash-16"),
        *[("trtllm-dflash", p, m) for p in ("in-process", "triton") for m in ("ar", "dflash-16", "auto+ngram")]]}
    assert got == want
    for r in records:
        assert r["num_prompts"] == 2 and r["max_new_tokens"] == 12 and r["tokens_per_second"] > 0, r
        assert r["startup_s"] > 0 and r["version"], r
        assert (r["tau"] is None) == (r["mode"] == "ar"), r
        if r["tau"] is not None:
            assert 1 <= r["tau"] <= 16, r
        assert r["outputs_equal_ar"] is True, r  # greedy DFlash is lossless on both systems
        # float32 on both sides: the same greedy tokens (a near-tied argmax could flip one; first_difference says where)
        assert r["outputs_equal_other"] is True, r["first_difference"]
    # ours draft over the target's whole vocabulary, as vLLM does (the shipped draft_vocab.json left out)
    assert all(r["draft_vocab"] == "full" for r in records if r["system"] == "trtllm-dflash" and r["mode"] != "ar")
    vllm_dflash = [r for r in records if r["system"] == "vllm" and r["mode"] == "dflash-16"]
    assert all(r["num_drafts"] > 0 and r["num_draft_tokens"] == 15 * r["num_drafts"] for r in vllm_dflash)
    assert all(r["version"] == "0.32.0" for r in records if r["system"] == "vllm")


LLAMACPP = ROOT / ".peers" / "llamacpp"
LLAMACPP_PROBLEM = perf_script("bench_peers").llamacpp_problem(LLAMACPP)  # None where llama.cpp is built


def test_bad_llamacpp_modes_exit_2_naming_the_choices():
    run = subprocess.run([sys.executable, str(SCRIPT), "--llamacpp-modes", "ar,q8"], capture_output=True, text=True)
    assert run.returncode == 2 and "--llamacpp-modes 'ar,q8'" in run.stderr
    assert "ar, ar-q4_1, dflash-16" in run.stderr


def test_agreement_counts_tokens_before_each_first_difference():
    bp = perf_script("bench_peers")
    assert bp.agreement({"a": (1, 2, 3), "b": (4, 5)}, {"a": (1, 2, 3), "b": (4, 5)}) == 1.0
    assert bp.agreement({"a": (1, 9, 3), "b": (4, 5)}, {"a": (1, 2, 3), "b": (4, 5, 6)}) == round(3 / 6, 4)
    assert bp.agreement({}, {"a": (1,)}) == 0.0


@pytest.mark.slow
@pytest.mark.skipif(LLAMACPP_PROBLEM is not None, reason=f"{LLAMACPP_PROBLEM}")
def test_against_the_real_llamacpp_peer(smollm2, tmp_path):
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--datasets", "humaneval", "--limit", "2", "--max-new-tokens", "12",
         "--concurrency", "1,2", "--threads", "2", "--target", smollm2["target"], "--drafter", smollm2["drafter"],
         "--paths", "in-process,server", "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=1500)
    assert run.returncode == 0, run.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "peers.jsonl").read_text().splitlines()]
    assert (tmp_path / "peers.png").stat().st_size > 0
    got = {(r["system"], r["mode"], r["concurrency"]) for r in records}
    want = {(s, m, c) for c in (1, 2) for s, m in [
        ("llama.cpp", "ar"), ("llama.cpp", "ar-q4_1"), ("llama.cpp", "dflash-16"),
        *[("trtllm-dflash", m) for m in ("ar", "dflash-16", "auto+ngram")]]}
    assert got == want
    for r in records:
        assert r["tokens_per_second"] > 0 and r["startup_s"] > 0, r
        assert (r["tau"] is None) == r["mode"].startswith("ar"), r
        if r["system"] == "trtllm-dflash":
            assert r["outputs_equal_ar"] is True, r  # ours stay lossless
        else:
            assert r["version"] == "b11434" and r["weights"] == ("q4_1" if r["mode"] == "ar-q4_1" else "f32"), r
            assert r["other"] == "trtllm-dflash in-process ar" and 0 <= r["agreement_other"] <= 1, r
    llama_f32 = [r for r in records if r["system"] == "llama.cpp" and r["mode"] == "ar"]
    # the same float32 weights: the same greedy tokens but for a near-tied argmax (first_difference says where)
    assert all(r["agreement_other"] >= 0.9 for r in llama_f32), [r["first_difference"] for r in llama_f32]
    for r in records:
        if r["system"] == "llama.cpp" and r["mode"] == "dflash-16":
            assert 1 <= r["tau"] <= 16 and r["num_draft_tokens"] > 0, r
