"""perf/paired_served.py: two real Triton servers, each rendered and run by its checkout's own CLI, compared call by
call on the real SmolLM2 pair; bad arguments are refused before any server starts."""

import json
import math
from pathlib import Path

from conftest import run_script

ROOT = str(Path(__file__).resolve().parents[2])


def test_pairs_every_call_on_both_servers(smollm2, tmp_path):
    raw = tmp_path / "calls.jsonl"
    # the two sides differ in their make-repo flags: the block sizes are lossless alike, so the tokens still match
    run = run_script("perf/paired_served.py", ["--base", ROOT, "--head", ROOT, "--prompts", "2", "--max-tokens", "8",
        "--concurrency", "1,2", "--models", "dflash", "--rounds", "1", "--target", smollm2["target"],
        "--drafter", smollm2["drafter"], "--repo-args=--no-ngram", "--base-repo-args=--block-size 4",
        "--head-repo-args=--block-size 16", "--out", str(raw)])
    assert run.returncode == 0, run.stderr[-3000:]
    records = {r["concurrency"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert set(records) == {1, 2}
    assert records[1]["pairs"] == 2 and records[2]["pairs"] == 1  # one prompt per call at c=1, both at once at c=2
    assert records[2]["ci95"] is None  # one pair has no interval
    lo, hi = records[1]["ci95"]
    assert lo <= records[1]["geomean_ratio"] <= hi
    for rec in records.values():
        assert rec["identical_tokens"] is True and rec["model"] == "dflash"
        assert rec["base_commit"] == rec["head_commit"] and rec["base_repo_args"] == "--block-size 4"
        logs = [math.log(r) for r in rec["call_ratios"]]
        assert abs(math.exp(sum(logs) / len(logs)) - rec["geomean_ratio"]) < 1e-3
        assert rec["base_tokens_per_second"] > 0 and rec["head_tokens_per_second"] > 0
    calls = [json.loads(line) for line in raw.read_text().splitlines()]
    assert [(c["concurrency"], c["call"]) for c in calls] == [(1, 0), (1, 1), (2, 0)]
    for c in calls:
        assert c["identical_tokens"] and c["base_tokens"] == c["head_tokens"] == 8 * c["concurrency"]
        assert c["base_seconds"] > 0 and c["head_seconds"] > 0


def test_refuses_bad_arguments_naming_them(tmp_path):
    run = run_script("perf/paired_served.py", ["--base", str(tmp_path)])
    assert run.returncode == 2 and f"--base {str(tmp_path)!r}: not a checkout" in run.stderr
    run = run_script("perf/paired_served.py", ["--base", ROOT, "--prompts", "4", "--concurrency", "1,8"])
    assert run.returncode == 2 and "--prompts 4: must be at least the largest --concurrency (8)" in run.stderr
    run = run_script("perf/paired_served.py", ["--base", ROOT, "--models", "dflash,tree"])
    assert run.returncode == 2 and "--models 'dflash,tree'" in run.stderr
