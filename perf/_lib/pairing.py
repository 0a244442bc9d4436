"""Before/after comparisons of two checkouts of this repository: which commit a checkout is, the environment that
makes a process import a checkout's own package, and the summary of many paired speed ratios.

A pair is the same work run on both sides back to back, so a shared machine's drift over minutes hits both alike;
the summary is the geometric mean of the pairs' ratios with a 95 % t interval on their logarithms, which is what
resolves a few percent on a VM whose speed moves by tens of percent between runs.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
from pathlib import Path


def commit_of(checkout: str) -> str:
    """The short commit ``checkout`` has checked out ("unknown" outside git)."""
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=checkout, capture_output=True, text=True)
    return run.stdout.strip() or "unknown"


def checkout_env(checkout: str) -> dict[str, str]:
    """This process's environment with ``checkout`` first on the import path, so that a child process (and the
    children it starts, such as a Triton server's Python stubs) imports that checkout's ``trtllm_dflash``. The path is
    made absolute: the children run inside the checkout, where a relative one (``../before``) would point elsewhere."""
    return {**os.environ, "PYTHONPATH": str(Path(checkout).resolve())}


def ratio_summary(ratios: list[float]) -> dict:
    """Geometric mean of the paired speed ratios and its 95 % t interval, computed on the log ratios (``ci95`` is
    None with fewer than two pairs)."""
    from scipy import stats

    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    out = {"pairs": len(ratios), "call_ratios": [round(r, 4) for r in ratios],
           "geomean_ratio": round(math.exp(mean), 4), "ci95": None}
    if len(logs) > 1:
        half = stats.t.ppf(0.975, len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
        out["ci95"] = [round(math.exp(mean - half), 4), round(math.exp(mean + half), 4)]
    return out
