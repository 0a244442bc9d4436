"""perf/bench_serving.py against its own real Triton server on the real SmolLM2 pair: the paired c=1 comparison
returns the same tokens in-process and through both ensembles, its numbers are self-consistent, and every requested
concurrency has a throughput."""

import json

from conftest import run_script


def test_paired_c1_is_lossless_and_consistent(smollm2):
    run = run_script("perf/bench_serving.py", ["--prompts", "2", "--max-tokens", "6", "--concurrency", "1,2",
        "--rounds", "2", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    for model in ("dflash", "baseline"):
        pair = out["paired_c1"][model]
        assert pair["identical_tokens"] is True
        assert len(pair["round_ratios"]) == 2 and all(r > 0 for r in pair["round_ratios"])
        ratio = pair["triton_tokens_per_second"] / pair["in_process_tokens_per_second"]
        assert abs(ratio - pair["triton_over_in_process"]) < 0.01
        assert out["triton_over_in_process_c1"][model] == pair["triton_over_in_process"]
        assert set(out["triton"][model]) == {"1", "2"} and all(v > 0 for v in out["triton"][model].values())
        assert out["server_time_c1"][model]["target_verify"]["executions"] >= 2 * 2 * 2  # prefill + steps, 2 rounds
    assert out["server_time_c1"]["dflash"]["drafter"]["executions"] > 0
    assert "drafter" not in out["server_time_c1"]["baseline"]


def test_bad_models_exits_2():
    run = run_script("perf/bench_serving.py", ["--models", "dflash,nope"])
    assert run.returncode == 2 and "--models 'dflash,nope'" in run.stderr and "e.g. dflash,baseline" in run.stderr


def test_ngram_repository_verifies_prompt_lookup_through_triton(smollm2):
    """make-repo --ngram reaches the dflash loop inside the real server: fewer draft calls than verify steps, and the
    same tokens as in-process decoding."""
    prompts = 2
    run = run_script("perf/bench_serving.py", ["--prompts", str(prompts), "--max-tokens", "48", "--concurrency", "1",
        "--models", "dflash", "--block-size", "16", "--ngram", "--target", smollm2["target"], "--drafter",
        smollm2["drafter"], "--json"])
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout)
    assert out["ngram"] is True and out["paired_c1"]["dflash"]["identical_tokens"] is True
    server = out["server_time_c1"]["dflash"]
    steps = server["target_verify"]["executions"] - prompts  # one prefill per prompt
    assert 0 < server["drafter"]["executions"] < steps
