"""perf/policy_replay.py: the policy's prompt-lookup decisions replayed on known outputs under a cost model."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "perf" / "policy_replay.py"


def test_replay_on_repetitive_and_unrepeating_outputs(tmp_path):
    """Outputs that repeat their prompt verbatim: every variant decodes them in fewer steps than autoregressive
    decoding and faster by the cost model; outputs with nothing to look up: no proposal, the autoregressive time."""
    cycle = list(range(100, 120))
    rows = [{"prompt_ids": cycle * 2, "token_ids": (cycle * 3)[:40]} for _ in range(4)]
    path = tmp_path / "greedy.json"
    path.write_text(json.dumps(rows))
    run = subprocess.run([sys.executable, str(SCRIPT), str(path), "--batch-size", "4", "--max-new-tokens", "40"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in ("history", "match", "match+weights"):
        assert out[name]["tokens"] == 4 * 40 and out[name]["steps"] < 40 and out[name]["speedup"] > 1.5, out
    plain = [{"prompt_ids": [1, 2, 3], "token_ids": list(range(200, 240))} for _ in range(4)]
    path.write_text(json.dumps(plain))
    out = json.loads(subprocess.run([sys.executable, str(SCRIPT), str(path), "--batch-size", "4"],
                                    capture_output=True, text=True).stdout)
    assert out["match"]["steps"] == 40 and out["match"]["speedup"] == 1.0 and out["match"]["tau"] == 1.0
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope.json")], capture_output=True, text=True)
    assert run.returncode == 2 and "not a file" in run.stderr
