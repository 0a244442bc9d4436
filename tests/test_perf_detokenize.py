"""perf/bench_detokenize.py on the real SmolLM2 tokenizer: both ways give the whole text; the request's own
detokenizer costs the same at every answer length, the stateless delta grows with it; ``--out`` holds what was
printed."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "perf" / "bench_detokenize.py"


def test_incremental_deltas_do_not_grow_with_the_answer(smollm2, tmp_path):
    out = tmp_path / "res" / "detok.json"
    r = subprocess.run([sys.executable, str(SCRIPT), "--target", smollm2["target"], "--repeats", "9", "--out",
                        str(out)], capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc and doc["identical_text"] is True
    rows = {row["tokens"]: row for row in doc["per_delta"]}
    assert {128, 512, 2000} <= set(rows)
    assert rows[2000]["text_delta_ms"] > 4 * rows[128]["text_delta_ms"]  # decodes everything so far
    assert rows[2000]["incremental_ms"] < rows[2000]["text_delta_ms"] / 10
