"""perf/bench_runtime.py on the real SmolLM2 pair: several block sizes (``auto`` among them) share one autoregressive
run, each line is lossless and self-consistent, ``--out`` holds exactly what was printed, and a bad ``--block-size`` exits 2."""

import json

from trtllm_dflash.runtime.tree import TreeShape

from conftest import run_script


def test_two_block_sizes_share_the_ar_run(smollm2, tmp_path):
    out = tmp_path / "bench.json"
    run = run_script("perf/bench_runtime.py", ["--dataset", "humaneval", "--limit", "2", "--batch-size", "2",
        "--block-size", "auto,8,8+ngram,8+tree,auto+tree", "--max-new-tokens", "12", "--threads", "1",
        "--warmup-tokens", "0", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--json", "--out",
        str(out)])
    assert run.returncode == 0, run.stderr
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    assert out.read_text() == run.stdout
    assert [x["block_size"] for x in lines] == ["auto", 8, "8+ngram", "8+tree", "auto+tree"]
    # auto with the tree as an option: the tree of its longest block, its tree steps counted
    assert lines[4]["tree_nodes"] == TreeShape.for_block(15, datastore=True).size
    assert lines[4]["adaptive"]["tree_steps"] <= lines[4]["adaptive"]["steps"]
    assert len({x["ar_tokens_per_second"] for x in lines}) == 1  # one AR run for all
    assert "lookup_steps" in lines[2] and "lookup_steps" not in lines[1]
    # the tree with lookup chains, and the shipped drafter directory's datastore proposing in one of them
    assert lines[3]["tree_nodes"] == TreeShape.for_block(7, datastore=True).size and lines[3]["tree_lookup"] == 3
    assert lines[3]["datastore_tokens"] > 1_000_000
    assert lines[3]["tree_grafts"] == [1] and lines[3]["tree_lookup_ms_per_step"] > 0  # the host's share, timed
    for x in lines:
        assert x["lossless"] and x["mismatched_prompts"] == [] and x["num_prompts"] == 2
        hist = {int(k): n for k, n in x["acceptance_histogram"].items()}
        longest = x.get("max_block_size") or int(str(x["block_size"]).removesuffix("+ngram").removesuffix("+tree"))
        assert sorted(hist) == list(range(1, longest + 1))
        steps = sum(hist.values())
        assert abs(sum(k * n for k, n in hist.items()) / steps - x["mean_acceptance_length"]) < 1e-3
        assert 1 <= x["mean_acceptance_length"] <= longest and x["num_new_tokens"] <= 2 * 12
    auto = lines[0]["adaptive"]
    steps = sum(lines[0]["acceptance_histogram"].values())
    assert lines[0]["max_block_size"] == 16 and sum(auto["k_distribution"].values()) == steps
    # auto["steps"] counts batched steps, the histogram rows·steps: each step verifies one or both of the 2 rows
    assert steps / 2 <= auto["steps"] <= steps and auto["time_split"]["verify_s"] > 0
    assert all(0 <= int(k) <= 15 for k in auto["k_distribution"])


def test_bad_block_size_exits_2(tmp_path):
    for bad in ("16,x", "1+ngram", "16,16"):
        run = run_script("perf/bench_runtime.py", ["--block-size", bad])
        assert run.returncode == 2 and f"--block-size '{bad}'" in run.stderr and "e.g. auto,16,16+ngram" in run.stderr


def test_allow_mismatch_reports_identity_without_failing(smollm2):
    """bfloat16 (the GPU session's dtype): token identity with autoregressive decoding is reported, not required,
    under --allow-mismatch (a multi-token verify rounds differently from 1-token steps); the exit code is 0 either way."""
    run = run_script("perf/bench_runtime.py", ["--dataset", "humaneval", "--limit", "1", "--block-size", "16",
        "--max-new-tokens", "24", "--threads", "1", "--warmup-tokens", "0", "--dtype", "bfloat16", "--allow-mismatch",
        "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--json"])
    assert run.returncode == 0, run.stderr
    (line,) = [json.loads(x) for x in run.stdout.splitlines()]
    assert line["dtype"] == "bfloat16" and isinstance(line["lossless"], bool)
    assert line["lossless"] == (line["mismatched_prompts"] == [])


def test_sampled_decoders_are_token_identical_to_sampled_autoregressive(smollm2):
    """--temperature: every decoder samples with the same seed; the chain, prompt lookup and the tree must give the
    autoregressive sampled tokens (each position's token drawn from that position's noise); --logprobs: and their
    log-probabilities, to float rounding."""
    run = run_script("perf/bench_runtime.py", ["--dataset", "mtbench", "--limit", "2", "--batch-size", "2",
        "--block-size", "8,8+ngram,8+tree", "--max-new-tokens", "16", "--threads", "1", "--warmup-tokens", "0",
        "--temperature", "0.8", "--top-p", "0.95", "--seed", "5", "--logprobs", "--target", smollm2["target"],
        "--drafter", smollm2["drafter"], "--json"])
    assert run.returncode == 0, run.stderr
    lines = [json.loads(x) for x in run.stdout.splitlines()]
    assert [x["block_size"] for x in lines] == [8, "8+ngram", "8+tree"]
    for x in lines:
        assert x["lossless"] and x["sampling"] == {"temperature": 0.8, "top_k": 0, "top_p": 0.95, "seed": 5}
        assert x["logprobs"] and 0 <= x["max_abs_logprob_diff"] < 2e-4
