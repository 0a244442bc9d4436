#!/usr/bin/env python3
"""PNG of acceptance-length (τ) histograms from ``perf/bench_runtime.py`` JSON lines; never re-runs anything.

    python perf/plot_acceptance.py perf/results/drafter-cpu/step800-*-full.json --out perf/results/drafter-cpu/tau_hist.png

One series per (dataset, block size, drafter) line; the y axis is the fraction of verify steps that accepted τ tokens
(τ counts the bonus token, so τ = 1 means the first draft token was rejected).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def load_lines(paths: list[str]) -> list[dict]:
    lines = []
    for path in paths:
        for n, text in enumerate(Path(path).read_text().splitlines(), 1):
            if text.strip():
                doc = json.loads(text)
                if "acceptance_histogram" not in doc:
                    raise ValueError(f"{path}:{n} has no acceptance_histogram: not a bench_runtime.py line")
                lines.append(doc)
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="+", help="bench_runtime.py JSON output files")
    p.add_argument("--out", required=True, help="PNG path (written atomically)")
    p.add_argument("--title", default="Acceptance lengths, in-process, greedy")
    args = p.parse_args(argv)
    try:
        lines = load_lines(args.files)
    except (OSError, ValueError) as e:
        print(f"plot_acceptance: error: {e}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trtllm_dflash.perf.report import draw_tau_hist, save_png

    hist = {f"{d['dataset']} ({d['num_prompts']}) B={d['block_size']} {d['drafter']}":
            {int(t): n for t, n in d["acceptance_histogram"].items()} for d in lines}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    draw_tau_hist(ax, hist, args.title)
    print(save_png(fig, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
