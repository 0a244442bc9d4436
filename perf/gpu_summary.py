#!/usr/bin/env python3
"""Summarise the raw files a GPU lease returned (kept under perf/results/gpu/<date>-<device>/) as one JSON.

    python perf/gpu_summary.py perf/results/gpu/2026-11-26-h200 > perf/results/gpu/2026-11-26-h200/summary.json

Reads, per run N of the lease: ``runN-checks.json`` (gpu_session's correctness steps: env, kernel_tests, parity),
``runN-status.json`` (the drafter job's status.json: phase, timings, training log, its evaluation) and
``runN-timed.log`` (gpu_session's timed-steps log: the JSON lines perf/bench_runtime.py and the benches printed, and
the error of any that failed). Prints what each run showed: the device and versions, pass/fail verdicts, training
throughput and held-out τ, and every DFlash-vs-autoregressive line with its settings. Nothing is computed that the
files do not hold."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

KEEP = ("dataset", "num_prompts", "block_size", "batch_size", "max_new_tokens", "dtype", "ar_tokens_per_second",
        "dflash_tokens_per_second", "speedup", "mean_acceptance_length", "lossless", "mismatched_prompts")


def bench_lines(text: str) -> tuple[list[dict], list[str]]:
    """JSON result lines and the last line of each traceback in a gpu_session log."""
    lines, errors = [], []
    for line in text.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            lines.append({k: d[k] for k in KEEP if k in d} | {"dataset": Path(str(d.get("dataset"))).stem})
        elif re.match(r"^\w+(\.\w+)*(Error|Exception): ", line):
            errors.append(line)
    return lines, errors


def run_summary(folder: Path, n: int) -> dict:
    out: dict = {}
    checks = folder / f"run{n}-checks.json"
    if checks.is_file():
        out["checks"] = json.loads(checks.read_text())["steps"]
    status = folder / f"run{n}-status.json"
    if status.is_file():
        s = json.loads(status.read_text())
        job = {"phase": s.get("phase"), "error": s.get("error"), "timings_s": s.get("timings"),
               "num_sequences": s.get("num_sequences")}
        log = s.get("train_log") or {}
        recs = log.get("records") or []
        if recs:
            held = log.get("held_out") or [{"step": 0}]
            job["train"] = {"steps": max(recs[-1]["step"], held[-1]["step"]), "seconds_per_step": round(
                sum(r["seconds_per_step"] for r in recs) / len(recs), 3), "data": log.get("data"),
                "held_out_expected_tau": [(h["step"], h["expected_tau"]) for h in log.get("held_out", [])]}
        ev = s.get("eval") or {}
        job["eval"] = {name: [{k: r[k] for k in KEEP if k in r} | {"dataset": "humaneval (first prompts)"}
                              for r in rows] if isinstance(rows, list) else rows for name, rows in ev.items()}
        out["drafter_job"] = {k: v for k, v in job.items() if v not in (None, {}, [])}
    timed = folder / f"run{n}-timed.log"
    if timed.is_file():
        lines, errors = bench_lines(timed.read_text())
        out["timed"] = {"results": lines, "errors": errors}
    return out


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:])[0])
    runs = sorted({int(m.group(1)) for p in folder.iterdir() if (m := re.match(r"run(\d+)-", p.name))})
    summary = {"folder": str(folder), "runs": {f"run{n}": run_summary(folder, n) for n in runs}}
    env = next((r["checks"]["env"] for r in summary["runs"].values() if "env" in r.get("checks", {})), {})
    summary["device"] = {k: env.get(k) for k in ("device_name", "capability", "nvidia_smi", "torch", "triton", "cuda")}
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
