#!/usr/bin/env python3
"""A benchmark before and after a change, paired in one run: the same perf script of two checkouts, alternating.

    git worktree add --detach /tmp/base HEAD~3
    python perf/paired.py --base /tmp/base --rounds 2 --metric dflash_tokens_per_second \\
        --metric ar_tokens_per_second --key dataset --key block_size --key batch_size \\
        -- bench_runtime.py --dataset humaneval --limit 8 --max-new-tokens 64 --block-size auto+ngram,16 --json

Each round runs ``perf/SCRIPT ARGS`` once from ``--base`` and once from ``--head`` (default: this checkout), the
order flipping every round so that a machine's drift hits both sides alike; each side imports its own package
(``PYTHONPATH`` set to its checkout, child processes such as a Triton server's stubs included). The script's
standard output is read as JSON (one object, or one per line); ``--key`` fields name a line, ``--metric`` paths
(dotted, e.g. ``points.0.tokens_per_second``) are compared. Prints one JSON record per line and metric: both
sides' values by round, their medians and ``ratio`` = head / base, with both commits. ``--out`` also writes every
run's raw output (JSON lines, atomically). Run it on a quiet machine: two benchmarks at once on a few cores slow
each other down many-fold.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="checkout of the commit before (e.g. a git worktree)")
    p.add_argument("--head", default=str(HERE), help="checkout of the commit after (default: this one)")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side (default 2)")
    p.add_argument("--metric", action="append", required=True, help="dotted path of a number to compare")
    p.add_argument("--key", action="append", default=[], help="field naming an output line (repeatable)")
    p.add_argument("--out", default=None, help="also write every run's output here (JSON lines)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT ARGS: a script in each side's perf/")
    args = p.parse_args(argv)
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.script:
        p.error("name the perf script to run after --, e.g. -- bench_runtime.py --json")
    for side in ("base", "head"):
        script = Path(getattr(args, side)) / "perf" / args.script[0]
        if not script.is_file():
            p.error(f"--{side} {getattr(args, side)!r}: has no perf/{args.script[0]}; pass a checkout of this repository")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be >= 1")
    return args


def run_side(checkout: str, script: list[str]) -> list[dict]:
    """The script's JSON output, run from ``checkout`` with its own package first on the import path."""
    from _lib.pairing import checkout_env

    env = checkout_env(checkout)
    run = subprocess.run([sys.executable, str(Path(checkout) / "perf" / script[0]), *script[1:]], cwd=checkout,
                         env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise SystemExit(f"paired: {checkout}/perf/{script[0]} exited {run.returncode}:\n{run.stderr[-3000:]}")
    text = run.stdout.strip()
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def lookup(doc, path: str):
    for part in path.split("."):
        doc = doc[int(part)] if isinstance(doc, list) else doc.get(part) if isinstance(doc, dict) else None
        if doc is None:
            return None
    return doc


def main(argv=None) -> int:
    from tqdm import tqdm

    from _lib.pairing import commit_of

    args = parse_args(argv)
    sides = {"base": args.base, "head": args.head}
    commits = {s: commit_of(c) for s, c in sides.items()}
    values: dict[tuple, dict[str, list[float]]] = {}
    raw = []
    order = ["base", "head"]
    with tqdm(total=2 * args.rounds, desc="paired runs", file=sys.stderr) as bar:
        for r in range(args.rounds):
            for side in order if r % 2 == 0 else order[::-1]:
                for line in run_side(sides[side], args.script):
                    raw.append({"side": side, "commit": commits[side], "round": r, "output": line})
                    name = tuple(str(line.get(k)) for k in args.key)
                    for metric in args.metric:
                        v = lookup(line, metric)
                        if isinstance(v, (int, float)):
                            values.setdefault((name, metric), {"base": [], "head": []})[side].append(float(v))
                bar.update(1)
    records = []
    for (name, metric), got in values.items():
        med = {s: statistics.median(v) if v else None for s, v in got.items()}
        records.append({**dict(zip(args.key, name)), "metric": metric, "base": got["base"], "head": got["head"],
                        "base_median": med["base"], "head_median": med["head"],
                        "ratio": round(med["head"] / med["base"], 4) if med["base"] and med["head"] else None,
                        "base_commit": commits["base"], "head_commit": commits["head"], "script": args.script})
    print("".join(json.dumps(r) + "\n" for r in records), end="")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.")
        with os.fdopen(fd, "w") as f:
            f.write("".join(json.dumps(r) + "\n" for r in raw))
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
