"""perf/bench_stops.py on the real SmolLM2 tokenizer: both ways cut alike, the indexed check is the cheaper one, and
``--out`` holds what was printed."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "perf" / "bench_stops.py"


def test_indexed_stops_are_cheaper(smollm2, tmp_path):
    out = tmp_path / "stops.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--stops", "256", "--target", smollm2["target"], "--out",
                        str(out)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc and doc["same_cuts"] is True and doc["stops"] == 256
    assert doc["indexed_us_per_token"] < doc["every_stop_us_per_token"]
