#!/usr/bin/env python3
"""PNG of the shipped drafter's τ, drafter by drafter, against the regenerated data it has been trained on so far.

    python perf/plot_shipped.py perf/results/drafter-curve/full-sets/shipped.json \\
        --out perf/results/drafter-curve/full-sets/shipped.png

The manifest lists every shipped drafter in order: ``{"shipped_in": "<label>", "new_tokens": 419304,
"evals": ["replay-....json", ...]}``, where ``shipped_in`` is a label of when it shipped (each point's annotation),
``new_tokens`` counts the regenerated response tokens its training added to the data of the drafters before it (0 for a
resumed run) and ``evals`` names ``trtllm-dflash learning-curve eval`` outputs next to the manifest. τ and prompt lookup's τ are
read from those files, never typed in; the x axis is the cumulative sum of ``new_tokens``. Prints the plotted points
as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATASETS = {"humaneval": "HumanEval", "mtbench": "MT-Bench"}
GOALS = {"humaneval": 4.0, "mtbench": 2.5}  # issue 15's goals at B = 16
SIZES = {"humaneval": 164, "mtbench": 80}  # prompts in each set (MT-Bench: first turns); an eval takes the first limit


def load_points(manifest: Path) -> list[dict]:
    """One point per shipped drafter: label, cumulative tokens, and per dataset τ, prompt-lookup τ, prompts."""
    rows = json.loads(manifest.read_text())
    points, total, block = [], 0, None
    for i, row in enumerate(rows):
        where = f"{manifest}: row {i} ({row.get('shipped_in', '?')})"
        for key in ("shipped_in", "new_tokens", "evals"):
            if key not in row:
                raise ValueError(f"{where} has no {key!r}; every row needs shipped_in, new_tokens and evals")
        total += int(row["new_tokens"])
        point = {"shipped_in": row["shipped_in"], "tokens": total}
        for name in row["evals"]:
            path = manifest.parent / name
            if not path.is_file():
                raise ValueError(f"{where}: evals names {name!r}, which is not a file next to the manifest")
            doc = json.loads(path.read_text())
            if block is not None and doc.get("block_size") != block:
                raise ValueError(f"{where}: {name} has block_size {doc.get('block_size')}, the rows before {block}; "
                                 "plot one block size at a time")
            block = doc.get("block_size")
            for ds in DATASETS:
                if ds in doc:
                    point[ds] = {"tau": doc[ds]["tau"], "prompt_lookup_tau": doc[ds]["prompt_lookup_tau"],
                                 "prompts": min(doc["limit"], SIZES[ds])}
        missing = [ds for ds in DATASETS if ds not in point]
        if missing:
            raise ValueError(f"{where}: its evals hold no {' or '.join(missing)} result; name the eval files of both")
        points.append(point)
    if not points:
        raise ValueError(f"{manifest} lists no drafter")
    return points


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("manifest", type=Path, help="shipped.json (see above)")
    p.add_argument("--out", required=True, help="PNG path (written atomically)")
    args = p.parse_args(argv)
    try:
        points = load_points(args.manifest)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"plot_shipped: error: {e}", file=sys.stderr)
        return 2
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trtllm_dflash.perf.report import save_png

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = [pt["tokens"] / 1e6 for pt in points]
    for ds, color in zip(DATASETS, ("tab:blue", "tab:orange")):
        ax.plot(xs, [pt[ds]["tau"] for pt in points], "o-", color=color,
                label=f"{DATASETS[ds]} ({points[-1][ds]['prompts']} prompts)")
        ax.axhline(points[-1][ds]["prompt_lookup_tau"], color=color, ls="--", lw=1,
                   label=f"{DATASETS[ds]}: prompt lookup, no training")
    for x, pt in zip(xs, points):
        ax.annotate(pt["shipped_in"].split(" (")[0], (x, pt["humaneval"]["tau"]),
                    textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
    ax.set_xlabel("regenerated response tokens in the shipped drafter's training data (millions, cumulative)")
    ax.set_ylabel("τ at B = 16, 128 tokens")
    ax.set_title("The shipped SmolLM2 drafter, session by session (goals: " +
                 ", ".join(f"{DATASETS[ds]} {g}" for ds, g in GOALS.items()) + ")")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, 0.93))
    save_png(fig, args.out)
    print(json.dumps({"out": args.out, "points": points}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
