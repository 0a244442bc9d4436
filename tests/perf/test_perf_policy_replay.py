"""perf/policy_replay.py: the policy's prompt-lookup decisions replayed on known outputs under a cost model."""

import json

from conftest import run_script


def test_replay_on_repetitive_and_unrepeating_outputs(tmp_path):
    """Outputs that repeat their prompt verbatim: every variant decodes them in fewer steps than autoregressive
    decoding and faster by the cost model; outputs with nothing to look up: no proposal, the autoregressive time."""
    cycle = list(range(100, 120))
    rows = [{"prompt_ids": cycle * 2, "token_ids": (cycle * 3)[:40]} for _ in range(4)]
    path = tmp_path / "greedy.json"
    path.write_text(json.dumps(rows))
    run = run_script("perf/policy_replay.py", [str(path), "--batch-size", "4", "--max-new-tokens", "40"])
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    for name in ("history", "match", "match+weights"):
        assert out[name]["tokens"] == 4 * 40 and out[name]["steps"] < 40 and out[name]["speedup"] > 1.5, out
    plain = [{"prompt_ids": [1, 2, 3], "token_ids": list(range(200, 240))} for _ in range(4)]
    path.write_text(json.dumps(plain))
    out = json.loads(run_script("perf/policy_replay.py", [str(path), "--batch-size", "4"]).stdout)
    assert out["match"]["steps"] == 40 and out["match"]["speedup"] == 1.0 and out["match"]["tau"] == 1.0
    run = run_script("perf/policy_replay.py", [str(tmp_path / "nope.json")])
    assert run.returncode == 2 and "not a file" in run.stderr
