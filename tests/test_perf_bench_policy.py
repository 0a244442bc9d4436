"""perf/bench_policy.py: the auto policy's host time per step, as JSON."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "perf" / "bench_policy.py"


def test_prints_decide_and_observe_times_per_batch_size():
    run = subprocess.run([sys.executable, str(SCRIPT), "--rows", "1,3", "--repeats", "5", "--rounds", "2"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert set(out["rows"]) == {"1", "3"}
    for b, row in out["rows"].items():
        assert row["decide_us"] > 0 and row["observe_us"] > 0 and len(row["plan"]) == min(int(b), 4)
