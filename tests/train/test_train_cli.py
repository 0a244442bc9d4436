"""``trtllm-dflash train-drafter`` end to end on a tiny target with SmolLM2's tokenizer: prompts → taps → train →
export → evaluate in one command, a bad flag refused with exit code 2, and the evaluation written to eval.json."""

import json

import pytest

from conftest import run_cli, write_tiny_smol


@pytest.mark.slow
def test_train_drafter_runs_every_stage_and_evaluates(smollm2, tmp_path):
    target = write_tiny_smol(tmp_path / "tiny-smol", smollm2["target"])
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Tell me fact number {i} about rivers.", "chat": True}) + "\n"
                            for i in range(6)))
    out, work = tmp_path / "drafter", tmp_path / "work"
    common = ["train-drafter", "--target", str(target), "--out", str(out), "--work-dir", str(work), "--data",
              str(data), "--steps", "2", "--ckpt-every", "2", "--samples-per-step", "2", "--max-new-tokens", "16",
              "--gen-batch-size", "6", "--block-size", "4", "--num-layers", "1"]
    bad = run_cli([*common, "--eval-limit", "-1"])
    assert bad.returncode == 2 and "--eval-limit" in bad.stderr and not out.exists()
    r = run_cli([*common, "--eval-limit", "2", "--eval-max-new-tokens", "8"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").is_file() and (out / "config.json").is_file()
    report = json.loads((work / "eval.json").read_text())
    assert report["block_size"] == 4 and set(report["datasets"]) == {"humaneval", "mtbench"}
    for row in report["datasets"].values():
        assert row["prompts"] == 2 and row["lossless"] is True  # the drafter's answers are the target's
        assert row["mean_acceptance_length"] >= 1.0 and row["ar_tokens_per_second"] > 0


@pytest.mark.slow
def test_train_drafter_keeps_the_targets_top_k_so_tv_trains_through_the_cli(smollm2, tmp_path):
    """The taps stage stores the target's top-k next-token logits beside the taps, so ``--tv`` (and ``--distill``)
    train from the command's own regeneration instead of failing at the first step for want of them."""
    from trtllm_dflash.train.data import TAPS_TOP_K, read_shard

    target = write_tiny_smol(tmp_path / "tiny-smol", smollm2["target"])
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Name river number {i}.", "chat": True}) + "\n" for i in range(4)))
    out, work = tmp_path / "drafter", tmp_path / "work"
    r = run_cli(["train-drafter", "--target", str(target), "--out", str(out), "--work-dir", str(work), "--data",
                 str(data), "--steps", "2", "--ckpt-every", "2", "--samples-per-step", "2", "--max-new-tokens", "12",
                 "--gen-batch-size", "4", "--block-size", "4", "--num-layers", "1", "--loss-vocab", "full",
                 "--tv", "0.5", "--eval-limit", "0"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "model.safetensors").is_file()
    samples = [s for p in sorted((work / "taps").glob("shard-*.safetensors")) for s in read_shard(p)]
    assert samples and all(s.topk_ids is not None and s.topk_ids.shape[1] == TAPS_TOP_K for s in samples)
    for s in samples:  # row j predicts token j + 1: over the response, the top-1 is the greedy token that follows
        response = slice(s.prompt_len - 1, len(s.ids) - 1)
        assert s.topk_ids[response, 0].tolist() == s.ids[s.prompt_len:].tolist()
