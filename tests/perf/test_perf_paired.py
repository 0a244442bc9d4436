"""perf/paired.py: two checkouts' runs of one perf script, alternated and compared metric by metric."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "perf" / "paired.py"


def checkout(root: Path, value: float) -> Path:
    """A checkout whose perf/speed.py prints two lines, and appends which side ran to a shared log."""
    (root / "perf").mkdir(parents=True)
    (root / "perf" / "speed.py").write_text(
        "import json, os, sys\n"
        f"open(sys.argv[1], 'a').write(os.path.basename(os.environ['PYTHONPATH']) + '\\n')\n"
        f"print(json.dumps({{'mode': 'a', 'tps': {value}, 'nested': {{'x': [1, {value * 2}]}}}}))\n"
        f"print(json.dumps({{'mode': 'b', 'tps': {value + 1}}}))\n")
    return root


def test_alternates_the_sides_and_compares_each_line_and_metric(tmp_path):
    base, head = checkout(tmp_path / "base", 10.0), checkout(tmp_path / "head", 12.0)
    log, raw = tmp_path / "order.log", tmp_path / "raw.jsonl"
    run = subprocess.run([sys.executable, str(SCRIPT), "--base", str(base), "--head", str(head), "--rounds", "3",
                          "--metric", "tps", "--metric", "nested.x.1", "--key", "mode", "--out", str(raw),
                          "--", "speed.py", str(log)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert log.read_text().split() == ["base", "head", "head", "base", "base", "head"]  # the order flips each round
    records = {(r["mode"], r["metric"]): r for r in map(json.loads, run.stdout.splitlines())}
    assert set(records) == {("a", "tps"), ("a", "nested.x.1"), ("b", "tps")}  # line b has no nested.x
    assert records["a", "tps"]["base"] == [10.0] * 3 and records["a", "tps"]["ratio"] == 1.2
    assert records["b", "tps"]["ratio"] == round(13 / 11, 4)
    assert records["a", "nested.x.1"]["head_median"] == 24.0
    assert len(raw.read_text().splitlines()) == 12  # 2 sides x 3 rounds x 2 lines


def test_refuses_a_checkout_without_the_script(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--base", str(tmp_path), "--metric", "tps", "--",
                          "speed.py"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "has no perf/speed.py" in run.stderr
