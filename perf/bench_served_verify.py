#!/usr/bin/env python3
"""One served verify step (``serve.steps.TargetVerifier.verify``, what the Triton ``target_verify`` model runs):
--rows live sequences with prompts of 150, 160, ... tokens, each verifying one token, the batch in a shuffled order
as requests arrive. Prints the median milliseconds as JSON.

    python perf/bench_served_verify.py --rows 16 --threads 2
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--max-sequences", type=int, default=32, help="the cache's slots (make-repo --max-sequences)")
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.serve.steps import TargetVerifier

    torch.set_num_threads(args.threads)
    assets = prepare_demo_assets()
    target, drafter = load_pair(assets["target"], assets["drafter"])
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, args.max_sequences, 2048, 16)
    g = torch.Generator().manual_seed(0)
    for seq in range(args.rows):
        verifier.start(seq, torch.randint(0, 1000, (150 + 10 * seq,), generator=g).tolist(), SamplingParams(), True)
    times = []
    for step in range(args.steps):
        seqs = list(range(args.rows))
        random.Random(step).shuffle(seqs)
        t0 = time.perf_counter()
        verifier.verify(seqs, [[5] for _ in seqs], True)
        times.append(time.perf_counter() - t0)
    print(json.dumps({"rows": args.rows, "threads": args.threads, "median_ms": round(statistics.median(times) * 1e3, 1),
                      "command": "python perf/bench_served_verify.py " + " ".join(sys.argv[1:] if argv is None
                                                                               else argv)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
