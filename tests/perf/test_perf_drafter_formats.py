"""perf/drafter_formats.py: each broken drafter through the real CLI, its exit code and error line recorded; the
verdict fails a case that is not refused, or refused under another field."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from _lib.speculators_parity import NO_PEER, PEER_PYTHON
from conftest import repo_script

SCRIPT = Path(__file__).parents[2] / "perf" / "drafter_formats.py"
pytestmark = pytest.mark.slow


def _run(*args, timeout=600):
    done = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout)
    return done, [json.loads(line) for line in done.stdout.splitlines()]


def test_records_each_refusal_through_the_cli(smollm2, tmp_path):
    cases = ["control-reduced-generate", "dspark-field-on-dflash", "no-vocab-maps",
             "full-vocab-config-reduced-weights", "trtllm-pytorch-reduced"]
    done, lines = _run("refusals", "--target", smollm2["target"], "--drafter", smollm2["drafter"],
                       "--cases", ",".join(cases), "--jsonl", str(tmp_path / "out.jsonl"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert [x["case"] for x in lines] == cases and all(x["passed"] for x in lines)
    assert (tmp_path / "out.jsonl").read_text().splitlines() == done.stdout.splitlines()
    control, *refused = lines
    assert control["exit_code"] == 0 and control["message"] is None
    for x in refused:
        assert x["exit_code"] == 2 and x["message"].startswith("trtllm-dflash ")
        assert f"error: {x['expected_field']}=" in x["message"]
        assert str(tmp_path) not in x["message"] and "/tmp/" not in x["command"]  # placeholders, not this run's paths
    assert "WORK/bases/reduced" in refused[-1]["command"] and "--backend trtllm-pytorch" in refused[-1]["command"]


def test_a_case_not_refused_or_refused_under_another_field_fails():
    module = repo_script("perf/drafter_formats.py")
    case = next(c for c in module.CASES if c.name == "no-vocab-maps")
    assert module.verdict(case, 2, "trtllm-dflash generate: error: drafter.d2t='absent from model.safetensors': x")
    assert not module.verdict(case, 0, "[4 tokens, 33.7 tok/s]")
    assert not module.verdict(case, 2, "trtllm-dflash generate: error: drafter.lm_head.weight='absent': x")
    control = next(c for c in module.CASES if c.field is None)
    assert module.verdict(control, 0, "") and not module.verdict(control, 2, "error")


def test_an_unknown_case_is_refused_naming_the_choices():
    done, _ = _run("refusals", "--cases", "no-such-case", timeout=60)
    assert done.returncode == 2 and "no-such-case" in done.stderr and "control-full-generate" in done.stderr


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_parity_of_the_shipped_drafter_with_speculators(smollm2):
    done, lines = _run("parity", "--target", smollm2["target"], "--drafter", smollm2["drafter"],
                       "--cases", "shipped-drafter")
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = lines
    assert line["draft_vocab"] == 8192 and line["tokens_equal"] and line["max_logit_diff"] < 1e-3, line
