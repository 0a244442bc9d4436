"""The GPU session's one command (perf/gpu_session.py), rehearsed on the CPU so a lent GPU's minutes go to running it,
not debugging it: every step runs, the prompt export the GPU machine depends on works, and the JSON says what a
reader of a GPU run needs (device, commit, parity verdicts, lossless benchmark lines).

The rehearsal runs a tiny random pair with SmolLM2's tokenizer and chat template (the prompts, template and datasets go
through the same code as on the GPU with the real pair): every step's command, flags and JSON are the same, the
forwards nearly free (the real pair would take minutes on 2 cores); the real pair's losslessness on the CPU
is the business of tests/models/test_smollm2.py."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import run_script, write_tiny_smol

SCRIPT = Path(__file__).parents[2] / "perf" / "gpu_session.py"


def tiny_smol_pair(root: Path, smollm2_target) -> tuple[Path, Path]:
    """A tiny random target with SmolLM2's tokenizer and a random one-layer drafter for it (its drafts are nearly
    never accepted: the drafting, injection and verify paths all run, each step accepting little)."""
    from trtllm_dflash.checkpoints import drafter_spec_for, random_drafter_state, write_drafter
    from trtllm_dflash.specs import TargetSpec

    target = write_tiny_smol(root / "target", smollm2_target)
    spec = TargetSpec.load(target)
    dspec = drafter_spec_for(spec, num_layers=1, block_size=16, mask_token_id=2)
    write_drafter(root / "drafter", dspec, spec, random_drafter_state(dspec, 0))
    return target, root / "drafter"


@pytest.mark.slow
def test_cpu_rehearsal_runs_every_step(smollm2, tmp_path):
    prompts, out = tmp_path / "prompts", tmp_path / "out"
    target, drafter = tiny_smol_pair(tmp_path / "pair", smollm2["target"])
    export = run_script("perf/gpu_session.py", ["--export-prompts", prompts])
    assert export.returncode == 0, export.stderr
    assert json.loads(export.stdout) == {"humaneval": 164, "mtbench": 80}
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), "--device", "cpu", "--prompts", str(prompts),
         "--target", str(target), "--drafter", str(drafter), "--limit", "2", "--max-new-tokens", "8",
         "--block-sizes", "16", "--commit", "rehearsal"],
        capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "gpu_session.json").read_text())["steps"]
    assert report["env"]["commit"] == "rehearsal" and report["env"]["device"] == "cpu"
    assert report["kernel_tests"]["exit"] == 0 and " passed" in report["kernel_tests"]["summary"]
    parity = report["parity"]
    assert parity["float64_device_equals_cpu"] and parity["float32_kernels_lossless"]
    assert parity["float32_torch_lossless"] and parity["real_float32_device_dflash_equals_cpu_ar"]
    assert parity["float64_device_tree_equals_cpu"] and parity["real_float32_device_tree_equals_cpu_ar"]
    assert "needs CUDA" in report["bench_kernels"]["skipped"] and "needs CUDA" in report["bench_gpu"]["bf16"]["skipped"]
    runs = report["dflash_vs_ar"]["runs"]
    assert [(r["dataset"], r["batch_size"]) for r in runs] == [("humaneval", 1), ("mtbench", 1), ("humaneval", 8),
                                                                ("mtbench", 8)]
    assert "partial" not in report["dflash_vs_ar"]
    for r in runs:
        (line,) = r["results"]
        assert r["exit"] == 0 and line["lossless"] and line["num_prompts"] == 2 and line["dtype"] == "float32"
    graphed = report["graphs"]["runs"]  # the graphs' static forwards rehearsed, then eager: both lossless
    assert [r["cuda_graphs"] for r in graphed] == ["rehearse", "off"] and all(r["exit"] == 0 for r in graphed)
    for r in graphed:
        assert [line["block_size"] for line in r["results"]] == [16, "16+ngram", "16+tree", "auto+ngram"]
        assert all(line["lossless"] and line["cuda_graphs"] == r["cuda_graphs"] for line in r["results"])
    assert all(line["graph_captures"] > 0 for line in graphed[0]["results"])
    assert json.loads(run.stdout.splitlines()[-1])["failed_steps"] == []


def test_unknown_step_exits_2(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path), "--steps", "env,warp"],
                         capture_output=True, text=True)
    assert run.returncode == 2 and "'warp'" in run.stderr and "choose from" in run.stderr
