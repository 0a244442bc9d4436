"""perf/ngram_acceptance.py: per-slot conditional acceptance of prompt lookup's proposals, counted by hand."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "perf" / "ngram_acceptance.py"


def test_counts_by_hand(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    from ngram_acceptance import acceptance

    # prompt 1 2 3, output 1 2 3 9: at the output's "1" the tail "3 1" never occurred before; at "1 2" (at 0) the
    # proposal is 3 1 2: slot 1 right (3), slot 2 wrong (9 follows); at "1 2 3" the proposal 1 2 3 is wrong at once
    res = acceptance([([1, 2, 3, 1, 2, 3, 9], 3)], block_size=5)
    assert res["positions"] == 3 and res["with_proposal"] == round(2 / 3, 4)
    assert res["reached"] == [2, 1, 0, 0] and res["conditional_acceptance"] == [0.5, 0.0, None, None]
    greedy = tmp_path / "greedy.json"
    greedy.write_text(json.dumps([{"prompt_ids": [1, 2, 3], "token_ids": [1, 2, 3, 9]}]))
    run = subprocess.run([sys.executable, str(SCRIPT), str(greedy), "--block-size", "5"], capture_output=True,
                         text=True)
    assert run.returncode == 0 and json.loads(run.stdout)["reached"] == [2, 1, 0, 0]
    run = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path / "nope")], capture_output=True, text=True)
    assert run.returncode == 2 and "does not exist" in run.stderr
