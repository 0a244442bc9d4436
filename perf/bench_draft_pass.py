#!/usr/bin/env python3
"""What one draft pass costs: the block ``[bonus, MASK × (B−1)]`` of every row through the drafter and its head, as
the decoder drafts (``SpeculativeDecoder.propose``: kernels, CUDA graphs and head as configured), per draft vocabulary.

    python perf/bench_draft_pass.py --rows 1,4,16 --draft-vocab full,auto --repeats 20 --threads 2

For every (draft vocabulary, rows) pair, times ``--repeats`` draft passes of a full block over ``--context`` cached
tokens a row, the pairs interleaved round by round so that a drifting machine hits them alike, and prints one JSON line
each: the median and the 10th / 90th percentiles in milliseconds, with the head's size (rows of the LM head read per
drafted slot: the target's vocabulary, or the draft vocabulary's). ``ratio_to_first`` compares each with the first
``--draft-vocab`` choice at the same rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--draft-vocab", default="full,auto", help="comma list of full, auto or files (default full,auto)")
    p.add_argument("--rows", default="1,4,16", help="comma list of rows drafted together (default 1,4,16)")
    p.add_argument("--context", type=int, default=256, help="cached drafter tokens per row (default 256)")
    p.add_argument("--repeats", type=int, default=20, help="timed passes per pair (default 20)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    args = p.parse_args(argv)
    try:
        args.row_list = [int(r) for r in args.rows.split(",")]
    except ValueError:
        p.error(f"--rows {args.rows!r}: a comma list of integers >= 1")
    if min(args.row_list) < 1 or args.repeats < 1 or args.context < 0:
        p.error("--rows and --repeats must be >= 1, --context >= 0")
    args.vocabs = list(dict.fromkeys(args.draft_vocab.split(",")))
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder

    if args.threads:
        torch.set_num_threads(args.threads)
    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    target = None
    decoders = {}
    for v in args.vocabs:
        t, d = load_pair(args.target, args.drafter, device=args.device, draft_vocab=v)
        target = target or t
        decoders[v] = SpeculativeDecoder(target, d, d.spec.block_size)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    bsz = next(iter(decoders.values())).block_size
    caches = {(v, r): dec.drafter.new_cache(r, args.context + bsz + 1) for v, dec in decoders.items()
              for r in args.row_list}
    for cache in caches.values():
        cache.lengths.fill_(args.context)  # the cached K/V's values do not change the time

    @torch.inference_mode()
    def once(v: str, rows: int) -> float:
        cache, dec = caches[v, rows], decoders[v]
        bonus = torch.zeros(rows, dtype=torch.long, device=args.device)
        sync()
        t0 = time.perf_counter()
        dec.propose(bonus, cache, None, cache.lengths, bsz - 1)
        sync()
        return (time.perf_counter() - t0) * 1e3

    pairs = [(v, r) for r in args.row_list for v in args.vocabs]
    for pair in pairs:  # warm-up: first-call allocations stay out of the timings
        once(*pair)
    times: dict[tuple[str, int], list[float]] = {p: [] for p in pairs}
    for i in tqdm(range(args.repeats), desc="draft passes", file=sys.stderr, disable=None):
        for pair in (pairs if i % 2 == 0 else pairs[::-1]):
            times[pair].append(once(*pair))
    medians = {p: statistics.median(ts) for p, ts in times.items()}
    for (v, rows), ts in times.items():
        head = decoders[v].drafter.draft_head
        q = statistics.quantiles(ts, n=10) if len(ts) > 1 else [ts[0]] * 9
        print(json.dumps({
            "draft_vocab": v, "rows": rows, "block_size": bsz, "context": args.context,
            "head_rows": head.draft_vocab_size if head is not None else target.spec.vocab_size,
            "median_ms": round(medians[v, rows], 3), "p10_ms": round(q[0], 3), "p90_ms": round(q[-1], 3),
            "ratio_to_first": round(medians[v, rows] / medians[args.vocabs[0], rows], 3),
            "repeats": len(ts), "threads": torch.get_num_threads(), "device": args.device,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}",
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
