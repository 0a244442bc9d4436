#!/usr/bin/env python3
"""The step engine against the machine's floor: target forwards and draft passes timed beside the time it takes to
read their weights once.

    python perf/bench_floor.py --rows 1,2,4,8,16,32 --draft-rows 1,4,16 --threads 2 [--base ../before]

A decode step multiplies every weight it holds by a few rows, so it cannot be faster than reading those weights once
from memory. The floor is measured here, on the machine at hand, two ways: ``read_floor_ms``, the weights' bytes at
the bandwidth of the fastest streaming read of as many bytes (``torch.sum``), and ``linear_floor_ms``, ``F.linear``
over exactly the target's weights at one row, each the fastest any of the run's processes saw. ``of_floor`` is
``read_floor_ms`` over the step's time (1.0 would be the step reading its weights and nothing else).

Timed: the target's forward of ``R`` tokens of one sequence over ``--context`` cached tokens, with the taps the
drafter reads and the LM head over every token (a verify of R - 1 drafts; R = 1 is the autoregressive step), and one
draft pass (``SpeculativeDecoder.propose``: the block through the drafter and its head, over the shipped draft
vocabulary) of 1, 4 and 16 rows. Each is the fastest of ``--repeats`` after a warm-up, so the first use's kernel
measurements (``models.products``) stay out.

``--profile N`` also profiles each target forward and prints, per side and row count, the N operators with the most
self time per step (``part: profile``): where a step's time goes beside its products.

``--base DIR`` times a second checkout too (its package first on ``PYTHONPATH``, this script), the two sides one
after the other in fresh processes, alternating for ``--rounds`` rounds; each side keeps its fastest. One JSON line
per side, part and rows, then one summary line with the ratios (``ar_of_floor``, ``verify16_over_ar``, this side
against the base).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--rows", default="1,2,4,8,16,32", help="target tokens per forward (default 1,2,4,8,16,32)")
    p.add_argument("--draft-rows", default="1,4,16", help="rows drafted together (default 1,4,16; empty: none)")
    p.add_argument("--context", type=int, default=300, help="cached tokens per row (default 300)")
    p.add_argument("--repeats", type=int, default=10, help="timed runs per shape (default 10)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--base", default=None, help="a second checkout to time the same way (before / after)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds with --base (default 2)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile each --rows forward (torch.profiler over --repeats runs) and print its N "
                        "costliest operators by self time per step (default 0: no profile)")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child process's label
    args = p.parse_args(argv)
    try:
        args.row_list = [int(r) for r in args.rows.split(",") if r]
        args.draft_list = [int(r) for r in args.draft_rows.split(",") if r]
    except ValueError:
        p.error(f"--rows {args.rows!r} / --draft-rows {args.draft_rows!r}: comma lists of integers >= 1")
    if not args.row_list or min(args.row_list + args.draft_list) < 1 or args.repeats < 1 or args.context < 0:
        p.error("--rows needs at least one value; --rows, --draft-rows and --repeats must be >= 1, --context >= 0")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be >= 1")
    return args


def _best(fn, repeats: int) -> float:
    fn()  # warm-up: first-use kernel choices, allocations
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def _profile(fn, repeats: int, top: int) -> dict:
    """Where ``fn``'s time goes: torch.profiler over ``repeats`` calls -> the self time of every operator per call,
    and the ``top`` costliest (the profiler's own overhead inflates small operators)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(repeats):
            fn()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    per_step = lambda us: round(us / 1e3 / repeats, 3)  # noqa: E731 (microseconds over all runs -> ms per call)
    return {"self_ms_per_step": per_step(sum(e.self_cpu_time_total for e in events)),
            "top": [{"op": e.key, "self_ms_per_step": per_step(e.self_cpu_time_total),
                     "calls_per_step": round(e.count / repeats, 2)} for e in events[:top]]}


def _weights(module) -> list:
    """The weights a forward multiplies with (every 2-D parameter but embeddings, each storage once)."""
    seen, out = set(), []
    for name, p in module.named_parameters():
        if p.dim() == 2 and "embed" not in name and p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            out.append(p)
    return out


def measure(args) -> list[dict]:
    """This process's timings (its ``trtllm_dflash`` is whichever checkout ``PYTHONPATH`` names)."""
    import torch
    import torch.nn.functional as F

    import trtllm_dflash
    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder

    if args.threads:
        torch.set_num_threads(args.threads)
    target_dir, drafter_dir = pair_or_demo(args.target, args.drafter)
    target, drafter = load_pair(target_dir, drafter_dir, draft_vocab="auto")
    dec = SpeculativeDecoder(target, drafter, drafter.spec.block_size)
    weights = _weights(target.model.layers) + [target.lm_head.weight]
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    head = drafter.draft_head
    draft_head = head.lm_head.weight if head is not None else target.lm_head.weight  # the head a draft pass reads
    draft_weights = [w for w in _weights(drafter) if w is not draft_head] + [draft_head]
    draft_bytes = sum(w.numel() * w.element_size() for w in draft_weights)
    records = []
    with torch.inference_mode():
        buf = torch.ones(nbytes // 4)
        read_ms = _best(lambda: buf.sum(), args.repeats)
        del buf
        x1 = {w.shape[1]: torch.randn(1, w.shape[1]) for w in weights}
        linear_ms = _best(lambda: [F.linear(x1[w.shape[1]], w) for w in weights], args.repeats)
        gbps = nbytes / read_ms / 1e6
        checkout = Path(trtllm_dflash.__file__).resolve().parent.parent
        base = {"side": args.side, "package": os.path.relpath(checkout),
                "threads": torch.get_num_threads(), "context": args.context}
        cap = args.context + max(args.row_list) + 2 * drafter.spec.block_size
        tcache = target.new_cache(1, cap)
        taps = drafter.spec.target_layer_ids
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, target.spec.vocab_size, (1, args.context), generator=gen)
        target(prompt, tcache, tap_layers=taps)
        tcache.commit(None, torch.tensor([args.context]))
        for rows in args.row_list:
            ids = torch.randint(0, target.spec.vocab_size, (1, rows), generator=gen)

            def verify(ids=ids):
                hidden, _ = target(ids, tcache, tap_layers=taps)
                return target.logits(hidden)

            ms = _best(verify, args.repeats)
            if args.profile:
                where = _profile(verify, args.repeats, args.profile)
                records.append({**base, "part": "profile", "rows": rows, **where})
            floor = nbytes / gbps / 1e6
            records.append({**base, "part": "target", "rows": rows, "step_ms": round(ms, 2),
                            "read_floor_ms": round(floor, 2), "linear_floor_ms": round(linear_ms, 2),
                            "of_floor": round(floor / ms, 3), "weight_mb": round(nbytes / 1e6, 3),
                            "read_gbps": round(gbps, 2)})
        bsz = dec.block_size
        for rows in args.draft_list:
            cache = drafter.new_cache(rows, args.context + bsz + 1)
            cache.lengths.fill_(args.context)
            bonus = torch.zeros(rows, dtype=torch.long)
            ms = _best(lambda: dec.propose(bonus, cache, None, cache.lengths, bsz - 1), args.repeats)
            floor = draft_bytes / gbps / 1e6
            records.append({**base, "part": "draft", "rows": rows, "block_size": bsz, "step_ms": round(ms, 2),
                            "read_floor_ms": round(floor, 2), "of_floor": round(floor / ms, 3),
                            "weight_mb": round(draft_bytes / 1e6, 3), "read_gbps": round(gbps, 2)})
    return records


def _commit(root: Path) -> str:
    out = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (out.stdout.strip() or "unknown") + ("+dirty" if dirty else "")


def _child(args, side: str, root: Path, argv: list[str]) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep))
    cmd = [sys.executable, __file__, *argv, "--side", side]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.stderr.write(out.stderr)
        raise SystemExit(f"bench_floor: the {side} side ({root}) failed with exit code {out.returncode}")
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.side is not None:
        for record in measure(args):
            print(json.dumps(record))
        return 0
    from tqdm import tqdm

    from trtllm_dflash.hardware import cpu_model

    here = Path(__file__).resolve().parent.parent
    sides = [("this", here)]
    if args.base:
        sides.insert(0, ("base", Path(args.base).resolve()))
    child_argv = [a for a in argv if a != "--base" and a != args.base]
    best: dict[tuple, dict] = {}
    profiles: dict[tuple, dict] = {}  # (side, rows) -> the last round's profile
    rounds = args.rounds if args.base else 1
    for i in tqdm(range(rounds * len(sides)), desc="sides", file=sys.stderr, disable=None):
        side, root = (sides if (i // len(sides)) % 2 == 0 else sides[::-1])[i % len(sides)]
        for r in _child(args, side, root, child_argv):
            if r["part"] == "profile":
                profiles[side, r["rows"]] = r
                continue
            key = (side, r["part"], r["rows"])
            if key not in best or r["step_ms"] < best[key]["step_ms"]:
                best[key] = r
    # the floor is the machine's, not a side's: the fastest read any process saw, applied to every record
    gbps = max(r["read_gbps"] for r in best.values())
    linear_ms = min(r["linear_floor_ms"] for r in best.values() if "linear_floor_ms" in r)
    for r in best.values():
        r["read_gbps"] = gbps
        r["read_floor_ms"] = round(r["weight_mb"] / gbps, 2)
        r["of_floor"] = round(r["read_floor_ms"] / r["step_ms"], 3)
        if "linear_floor_ms" in r:
            r["linear_floor_ms"] = linear_ms
    stamp = {"cpu": cpu_model(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "machine": f"{platform.machine()} {os.cpu_count()} cpus"}
    commits = {side: _commit(root) for side, root in sides}
    for (side, part, rows), r in sorted(best.items()):
        print(json.dumps({**r, "commit": commits[side], **stamp}))
    for (side, rows), r in sorted(profiles.items()):
        print(json.dumps({**r, "commit": commits[side], **stamp}))
    summary = {"summary": True, **stamp, "commits": commits}
    for side, _ in sides:
        ar, v16 = best.get((side, "target", 1)), best.get((side, "target", 16))
        if ar:
            summary[f"{side}_ar_of_floor"] = ar["of_floor"]
            summary[f"{side}_ar_ms"] = ar["step_ms"]
        if ar and v16:
            summary[f"{side}_verify16_over_ar"] = round(v16["step_ms"] / ar["step_ms"], 3)
    if args.base:
        summary["this_over_base"] = {f"{part}@{rows}": round(r["step_ms"] / best[("base", part, rows)]["step_ms"], 3)
                                     for (side, part, rows), r in sorted(best.items())
                                     if side == "this" and ("base", part, rows) in best}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
