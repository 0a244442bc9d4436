#!/usr/bin/env python3
"""Host time of the ``--block-size auto`` policy per decode step: ``AdaptivePolicy.decide`` and the observations, at
batch 1, 4 and 16, on a synthetic state (no model). On a CPU a step of SmolLM2 takes tens of milliseconds and this is
noise; once a GPU replays the step's forwards as CUDA graphs (``runtime.graphs``) a step may take a millisecond or
two, and the policy's Python runs on the host in series with it.

    python perf/bench_policy.py [--rows 1,4,16] [--repeats 500] > policy.json

Each row has drafted before (its acceptance from a few outcomes) and half the rows have a prompt-lookup proposal;
the cost model is shaped like a small model's (a verify of n tokens 1 + 0.02 n ms, a draft pass 0.3 + 0.015 n ms).
Each of ``--repeats`` steps decides, then observes every row's outcome (``observe``, ``observe_step``; a drafting row
accepts one draft), so the rows' estimates change as in decoding. Prints one JSON object: microseconds per ``decide``
and per step of observations, the median of ``--rounds`` rounds, and the latest plan's first four rows.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,16", help="comma list of batch sizes")
    p.add_argument("--repeats", type=int, default=500)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--max-block-size", type=int, default=16)
    args = p.parse_args(argv)
    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.lookup import Lookup
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    out = {"machine": f"{platform.machine()} {platform.python_version()}", "max_block_size": args.max_block_size,
           "repeats": args.repeats, "rounds": args.rounds, "rows": {}}
    for b in (int(x) for x in args.rows.split(",")):
        cost = CostModel([1e-3 * (1 + 0.02 * n) for n in GRID], [3e-4 * (1 + 0.05 * n) for n in GRID])  # its own
        policy = AdaptivePolicy(cost, args.max_block_size, prior=[0.6] * (args.max_block_size - 1), ngram=True)
        states = [policy.new_sequence() for _ in range(b)]
        lens = []
        for i, s in enumerate(states):
            s.context, s.remaining, s.drafted = 300, 100, 1
            for k, a in ((3, 2), (7, 1), (5, 5)):
                s.acceptance.observe(k, a)
            s.lookup = Lookup(list(range(args.max_block_size - 1)), match=3) if i % 2 == 0 else None
            lens.append(len(s.lookup.tokens) if s.lookup else 0)
        decide, observe = [], []
        for _ in range(args.rounds):  # steps: decide, then every row's outcome (a drafting row accepts one draft)
            spent = [0.0, 0.0]
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                ks = policy.decide(states, lens)
                t1 = time.perf_counter()
                for s, k in zip(states, ks):
                    policy.observe(s, k, min(k, 1))
                policy.observe_step(ks, [min(k, 1) for k in ks], 1e-3, 2e-3, 1e-4)
                spent[0] += t1 - t0
                spent[1] += time.perf_counter() - t1
            decide.append(spent[0] / args.repeats * 1e6)
            observe.append(spent[1] / args.repeats * 1e6)
        out["rows"][str(b)] = {"decide_us": round(statistics.median(decide), 1),
                               "observe_us": round(statistics.median(observe), 1), "plan": ks[:4]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
