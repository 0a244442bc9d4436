#!/usr/bin/env python3
"""One served verify step (``runtime.steps.TargetVerifier.verify``, what the Triton ``target_verify`` model runs):
--rows live sequences with prompts of 150, 160, ... tokens, each verifying one token, the batch in a shuffled order
as requests arrive. With ``--width K`` the step's block is K + 1 tokens wide and only ``--drafting`` rows fill it;
the others are padded with −1, which the verify skips (``runtime.steps.real_width``), or, with
``--compute-padding``, carry a token as every slot did before (the cost of a padded step then). Prints the median
milliseconds as JSON.

    python perf/bench_served_verify.py --rows 16 --threads 2
    python perf/bench_served_verify.py --rows 16 --threads 2 --width 8 --drafting 2 [--compute-padding]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

import torch



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-sequences", type=int, default=32, help="the cache's slots (make-repo --max-sequences)")
    p.add_argument("--width", type=int, default=0, help="drafts per block (the step's common width K)")
    p.add_argument("--drafting", type=int, default=None, help="rows with K drafts (default all); the rest padding")
    p.add_argument("--compute-padding", action="store_true", help="pad with a token instead of -1 (computed)")
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.steps import TargetVerifier

    torch.set_num_threads(args.threads)
    assets = prepare_demo_assets()
    target, drafter = load_pair(assets["target"], assets["drafter"])
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, args.max_sequences, 2048, 16)
    g = torch.Generator().manual_seed(0)
    for seq in range(args.rows):
        verifier.start(seq, torch.randint(0, 1000, (150 + 10 * seq,), generator=g).tolist(), SamplingParams(), True)
    drafting = args.rows if args.drafting is None else args.drafting
    pad = 5 if args.compute_padding else -1
    times = []
    for step in range(args.steps):
        seqs = list(range(args.rows))
        random.Random(step).shuffle(seqs)
        blocks = [[5] + [5 if seq < drafting else pad] * args.width for seq in seqs]
        t0 = time.perf_counter()
        verifier.verify(seqs, blocks, True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"rows": args.rows, "threads": args.threads, "width": args.width, "drafting": drafting,
                      "compute_padding": args.compute_padding, "median_ms": round(statistics.median(times) * 1e3, 1),
                      "command": "python perf/bench_served_verify.py " + " ".join(sys.argv[1:] if argv is None
                                                                               else argv)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
