"""perf/bench_shared_prefill.py on a tiny random target: each fork starts its sibling exactly as its own prefill
would, the JSON has every length, ``--out`` holds what was printed, and a bad --siblings is refused by name."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "perf" / "bench_shared_prefill.py"


def run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)


def test_forks_start_the_same_sequences_and_the_json_says_so(tiny_dirs, tmp_path):
    out = tmp_path / "res" / "shared.json"
    r = run("--target", str(tiny_dirs["llama"][0]), "--lengths", "8,40", "--siblings", "3", "--repeats", "2",
            "--threads", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc and doc["siblings"] == 3
    assert set(doc["lengths"]) == {"8", "40"}
    for row in doc["lengths"].values():
        assert row["same_first_tokens"] is True and row["prefill_ms"] > 0 and row["fork_ms"] > 0
        assert abs(row["n_starts_prefilled_ms"] - 3 * row["prefill_ms"]) < 0.1


def test_one_sibling_is_refused_by_name():
    r = run("--siblings", "1")
    assert r.returncode == 2 and "--siblings=1: must be at least 2" in r.stderr
