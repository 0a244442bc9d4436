"""perf/tree_shapes.py on the real pair: every shape's walk covers the same outputs, the shapes' sizes are theirs, and
the JSON and PNG are written."""

import json

import pytest

from conftest import run_script


@pytest.mark.slow
def test_shapes_replayed_on_the_same_outputs(smollm2, tmp_path):
    out = tmp_path / "shapes.json"
    run = run_script("perf/tree_shapes.py", ["--datasets", "humaneval", "--limit", "2", "--references-limit", "2",
        "--max-new-tokens", "24", "--work", str(tmp_path / "work"), "--threads", "1", "--out", str(out)])
    assert run.returncode == 0, run.stderr[-2000:]
    res = json.loads(out.read_text())
    assert json.loads(run.stdout) == res and out.with_suffix(".png").stat().st_size > 0
    rows = res["datasets"]["humaneval"]
    assert rows["drafter"]["verify_tokens"] == rows["ngram"]["verify_tokens"] == 16
    assert rows["two-branch (drafter + lookup)"]["verify_tokens"] == 31
    assert rows["default, no grafts"]["verify_tokens"] == 86  # 71 + a second lookup chain of 15
    assert rows["default alternates, 1 lookup chain"]["verify_tokens"] == 71
    assert rows["default (TreeShape.for_block)"]["verify_tokens"] == 86 + 2 * 14  # both chains again after d_1
    assert rows["default, grafts at depths 1-2"]["verify_tokens"] == 86 + 2 * 14 + 2 * 13
    assert rows["default (TreeShape.for_block)"]["grafts"] == [1]
    # the shipped drafter directory's datastore takes a third lookup chain, grafted too
    assert rows["default + datastore, no grafts"]["verify_tokens"] == 101
    assert rows["default + datastore (TreeShape.for_block, datastore=True)"]["verify_tokens"] == 101 + 3 * 14
    assert res["datastore_tokens"] > 1_000_000
    # every walk covers the same 2 outputs of 24 tokens: after the prefill's token, 23 each, plus the bonus token past
    # the end where a walk's last step reaches it (train.audit.walk)
    emitted = {name: round(r["tau"] * r["steps"]) for name, r in rows.items()}
    assert set(emitted.values()) <= {46, 47, 48}, emitted
    assert all(r["tau"] >= 1 for r in rows.values())
