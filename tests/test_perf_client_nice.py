"""perf/bench_client_nice.py on the real SmolLM2 pair through a real Triton server: client processes at niceness 0
and 19 in turns, each answer's tokens/s and target_verify's time per execution recorded; ``--out`` holds what was
printed."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
pytest.importorskip("tritonclient.grpc")
SCRIPT = Path(__file__).parents[1] / "perf" / "bench_client_nice.py"


def test_both_niceness_levels_are_measured(smollm2, tmp_path):
    out = tmp_path / "nice.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "1", "--answers", "1", "--max-tokens", "8",
                        "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--out", str(out)],
                       capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    for nice in ("0", "19"):
        x = doc["client_niceness"][nice]
        assert len(x["tokens_per_second"]) == 1 and x["mean_tokens_per_second"] > 0 and x["verify_ms"][0] > 0
    assert doc["nice19_over_nice0"] > 0
