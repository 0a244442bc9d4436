"""perf/genai_perf.py: the GenAI-Perf commands it runs, the numbers it reads from GenAI-Perf's export (a recorded run
against a real server, perf/results/genai-perf/), and GenAI-Perf's recorded request against our entry's inputs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trtllm_dflash.serve.triton.render import RepoConfig, make_repo

from conftest import pbtxt_inputs, perf_script

ROOT = Path(__file__).parents[2]
SCRIPT = ROOT / "perf" / "genai_perf.py"
RUN = ROOT / "perf" / "results" / "genai-perf" / "2026-11-28-auto-ngram"


@pytest.fixture(scope="module")
def gp():
    return perf_script("genai_perf")


def test_summary_and_ratios_come_from_genai_perfs_export(gp):
    export = json.loads((RUN / "dflash-c1.genai_perf.json").read_text())
    s = gp.summarize(export)
    assert s["output_token_throughput_avg"] == round(export["output_token_throughput"]["avg"], 3)
    assert s["time_to_first_token_p50"] == round(export["time_to_first_token"]["p50"], 3)
    assert s["output_sequence_length_avg"] > 60  # min_length held the answers near the asked 64 (GenAI-Perf's count)
    recorded = json.loads((RUN / "summary.json").read_text())
    records = [r for r in recorded if "model" in r]
    assert gp.ratios(records) == [r for r in recorded if "model" not in r]
    for r in records:
        assert gp.summarize(json.loads((RUN / f"{r['model']}-c{r['concurrency']}.genai_perf.json").read_text())) == \
            {k: v for k, v in r.items() if k not in ("model", "concurrency")}


def test_genai_perfs_request_is_what_the_entry_declares(tiny_dirs, tmp_path):
    """Every input of GenAI-Perf 0.0.16's recorded requests (--backend tensorrtllm, streaming, deterministic output
    length) is an input of the rendered dflash model, with the dtype of the value GenAI-Perf sends."""
    t, d = tiny_dirs["llama"]
    repo = make_repo(RepoConfig(str(t), str(d), block_size=4, max_seq_len=128), tmp_path / "repo")
    declared = pbtxt_inputs((repo / "dflash" / "config.pbtxt").read_text())
    kinds = {str: "TYPE_STRING", bool: "TYPE_BOOL", int: "TYPE_INT32"}
    data = json.loads((RUN / "dflash-c1.inputs.json").read_text())["data"]
    assert data and {"min_length", "exclude_input_in_output", "stream"} <= set(data[0])
    for request in data:
        for name, value in request.items():
            if name != "model":  # GenAI-Perf's own field, not an input
                assert declared[name][0] == kinds[type(value[0])], name


def test_dry_run_prints_one_fixed_length_command_per_point_and_a_missing_tool_is_named(tmp_path):
    args = [sys.executable, str(SCRIPT), "--tokenizer", "/tok", "--concurrency", "1,4", "--out", str(tmp_path / "o")]
    r = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and all("--backend tensorrtllm" in x and "--output-tokens-mean-deterministic" in x
                                   for x in lines)
    assert [x.split(" -m ")[1].split()[0] for x in lines] == ["dflash", "baseline", "dflash", "baseline"]
    env = {**os.environ, "PATH": str(Path(sys.executable).parent)}  # no genai-perf there
    r = subprocess.run(args, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env)
    assert r.returncode == 2 and "--genai-perf: no genai-perf executable found" in r.stderr
