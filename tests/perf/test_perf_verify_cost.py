"""perf/verify_cost.py on a tiny random target: one JSON document with measured times, floors and ratios per size."""

from __future__ import annotations

import json

from tests.conftest import make_tiny_pair, run_script


def test_verify_cost_reports_ratios_and_floors(tmp_path):
    tdir, _ = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    out = tmp_path / "cost.json"
    r = run_script("perf/verify_cost.py", ["--target", str(tdir), "--dtype", "float32", "--sizes", "1,4", "--context",
                                           "8", "--repeats", "2", "--trees", "3", "--batch", "1,2", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc == json.loads(r.stdout)
    d = doc["dtypes"]["float32"]
    assert set(d["ms"]) == {"1", "4"} and all(v > 0 for v in d["ms"].values())
    assert d["ratio_to_step1"]["1"] == 1.0 and d["floor_ratio_to_step1"]["4"] >= 1.0
    assert doc["copy_bandwidth_gb_s"] > 0 and d["gemm_gflop_s"] > 0 and doc["device"] == "cpu"
    from trtllm_dflash.runtime.tree import tree_for

    for part in (d, d["batch"]["2"]):  # the decoder's trees for k = 3, under their tree mask, at batch 1 and 2
        assert {t["nodes"] for t in part["trees"].values()} == {tree_for(3).size, tree_for(3, True, True).size}
        assert all(t["ms"] > 0 and t["ratio_to_step1"] > 0 for t in part["trees"].values())


def test_verify_cost_over_an_empty_cache_with_the_first_slots_head(tmp_path):
    """``--context 0,6 --head first``: the calibration's kind of verify (a rejected first draft) over an empty cache
    and over 6 tokens, timed interleaved; the first context is the document's top level."""
    tdir, _ = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    r = run_script("perf/verify_cost.py", ["--target", str(tdir), "--dtype", "float32", "--sizes", "1,4", "--context",
                                           "0,6", "--head", "first", "--repeats", "2", "--batch", "3"])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    d = doc["dtypes"]["float32"]
    assert doc["head"] == "first" and doc["context"] == 0 and d["batch_size"] == 3
    assert set(d["ms"]) == {"1", "4"} and all(v > 0 for v in d["ms"].values())
    assert d["ms_by_context"]["0"] == d["ms"] and set(d["ms_by_context"]["6"]) == {"1", "4"}
