"""perf/bench_stops.py on the real SmolLM2 tokenizer: both ways cut alike, the indexed check is the cheaper one, and
``--out`` holds what was printed."""

import json

from conftest import run_script


def test_indexed_stops_are_cheaper(smollm2, tmp_path):
    out = tmp_path / "stops.json"
    r = run_script("perf/bench_stops.py", ["--stops", "256", "--target", smollm2["target"], "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc and doc["same_cuts"] is True and doc["stops"] == 256
    assert doc["indexed_us_per_token"] < doc["every_stop_us_per_token"]
