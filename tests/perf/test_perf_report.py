"""The report renders from a recorded sweep (tests/data/sweep_sample: a real smoke sweep of perf/sweep.py) without
re-running anything: PNGs exist and are non-empty, the markdown table has one row per record with its numbers, and
the recorded numbers are what the recorded profile exports say."""

import json
import shutil
from pathlib import Path

import pytest

from _lib.record import load_records
from _lib.report import COLUMNS, PLOTS, speedups, write_report
from _lib.sweep import summarize_profile

SAMPLE = Path(__file__).parents[1] / "data" / "sweep_sample"


@pytest.fixture
def sweep(tmp_path):
    out = tmp_path / "sweep"
    shutil.copytree(SAMPLE, out, ignore=shutil.ignore_patterns("*.png", "report.md"))
    return out


def table(md: str) -> list[dict[str, str]]:
    lines = [line for line in md.splitlines() if line.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(header, (c.strip() for c in line.strip("|").split("|")))) for line in lines[1:]]


def test_report_renders_from_recorded_sweep(sweep):
    records = load_records(sweep / "records.jsonl")
    assert {r.model for r in records} == {"dflash", "baseline"} and len(records) >= 4
    md_path = write_report(sweep, "sample")
    for name in PLOTS:
        png = sweep / name
        assert png.is_file() and png.stat().st_size > 1000, name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = md_path.read_text()
    rows = table(md)
    assert list(rows[0]) == COLUMNS and len(rows) == len(records)
    sp = speedups(records)
    for row, r in zip(rows, records):
        point = (row["model"], row["dataset"], int(row["B"]), int(row["C"]))
        assert point == (r.model, r.dataset, r.block_size, r.concurrency)
        assert int(row["tokens"]) == r.output_tokens and int(row["requests"]) == r.requests
        assert float(row["tok/s"]) == pytest.approx(r.output_tokens_per_s, abs=0.006)
        assert float(row["τ"]) == pytest.approx(r.tau_mean, abs=0.006)
        if r.model == "dflash":
            assert float(row["speed-up"]) == pytest.approx(sp[(r.dataset, r.block_size, r.concurrency)], abs=0.006)
    assert "drafter:" in md and "perf_analyzer" in md and records[0].env["git_commit"] in md


def test_recorded_numbers_come_from_the_recorded_exports(sweep):
    for r in load_records(sweep / "records.jsonl"):
        s = summarize_profile(json.loads((sweep / r.profile_export).read_text()))
        assert s["output_tokens"] == r.output_tokens and s["responses"] == r.responses
        assert s["output_tokens_per_s"] == pytest.approx(r.output_tokens_per_s)
        assert s["client_tau_mean"] == pytest.approx(r.client_tau_mean, nan_ok=True)


def test_report_without_a_baseline(sweep):
    lines = (sweep / "records.jsonl").read_text().splitlines()
    (sweep / "records.jsonl").write_text("\n".join(line for line in lines if '"model": "dflash"' in line) + "\n")
    rows = table(write_report(sweep).read_text())
    assert [row["model"] for row in rows] == ["dflash"] * len(rows) and all(row["speed-up"] == "" for row in rows)
    assert all((sweep / name).stat().st_size > 1000 for name in PLOTS)

