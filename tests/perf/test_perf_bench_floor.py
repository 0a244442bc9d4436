"""perf/bench_floor.py on a tiny random pair: every target width and draft pass against one floor, before and after."""

from __future__ import annotations

import json
import os

from tests.conftest import make_tiny_pair, run_script


def test_bench_floor_times_both_sides_against_one_floor(tmp_path):
    """With ``--base`` this checkout stands for both sides: each side's records, one floor for all of them, the
    checkouts named relative to the working directory, and a summary with the ratios."""
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    r = run_script("perf/bench_floor.py", ["--target", str(tdir), "--drafter", str(ddir), "--rows", "1,2",
                                           "--draft-rows", "1", "--context", "8", "--repeats", "1", "--threads", "1",
                                           "--base", here, "--rounds", "1"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    records, summary = lines[:-1], lines[-1]
    assert {(x["side"], x["part"], x["rows"]) for x in records} == {
        (side, part, rows) for side in ("base", "this") for part, rows in (("target", 1), ("target", 2), ("draft", 1))}
    assert len({x["read_gbps"] for x in records}) == 1 and all(x["step_ms"] > 0 < x["of_floor"] for x in records)
    assert not any(os.path.isabs(x["package"]) for x in records)
    assert summary["summary"] and set(summary["this_over_base"]) == {"target@1", "target@2", "draft@1"}


def test_bench_floor_profiles_where_a_steps_time_goes(tmp_path):
    """``--profile N``: one record per target width with the operators' self time per step, the N costliest first,
    beside the timed records."""
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    r = run_script("perf/bench_floor.py", ["--target", str(tdir), "--drafter", str(ddir), "--rows", "1,2",
                                           "--draft-rows", "", "--context", "8", "--repeats", "2", "--threads", "1",
                                           "--profile", "3"])
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [json.loads(line) for line in r.stdout.splitlines()]
    profiles = [x for x in lines if x.get("part") == "profile"]
    assert [x["rows"] for x in profiles] == [1, 2]
    for x in profiles:
        costs = [op["self_ms_per_step"] for op in x["top"]]
        assert len(costs) == 3 and costs == sorted(costs, reverse=True) and 0 < sum(costs) <= x["self_ms_per_step"]
        assert all(op["op"] and op["calls_per_step"] > 0 for op in x["top"])
    assert {x["part"] for x in lines[:-1]} == {"target", "profile"} and lines[-1]["summary"]
