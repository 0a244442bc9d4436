#!/usr/bin/env python3
"""What a request's ``num_return_sequences`` saves by prefilling its prompt once: ``TargetVerifier.start`` (a
prefill, keeping the prompt's last hidden state for its siblings) against ``TargetVerifier.fork`` (a sibling's start:
the prompt's K/V copied, its first token drawn with its own sampling), per prompt length. Prints milliseconds (median
of --repeats), the time n sequences take to start both ways, and checks that each fork starts its sequence exactly as
its own prefill would (first token and log-probability, sampled with the sibling's seed).

    python perf/bench_shared_prefill.py --lengths 128,512,1024 --siblings 4 --out perf/results/shared-prefill/cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lengths", default="128,512,1024", help="comma list of prompt lengths (tokens)")
    p.add_argument("--siblings", type=int, default=4, help="num_return_sequences n (n - 1 forks per prefill)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.siblings < 2:
        p.error(f"--siblings={args.siblings}: must be at least 2 (one prefill, one fork); pass --siblings 4")
    lengths = [int(x) for x in args.lengths.split(",") if x]
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.perf.record import emit_json
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.steps import TargetVerifier

    torch.set_num_threads(args.threads)
    target = TargetModel.from_pretrained(args.target or prepare_demo_assets()["target"])
    layers = target.spec.num_hidden_layers
    taps, n = tuple(sorted({layers // 4, layers // 2, layers - 1})), args.siblings
    res = {"machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads",
           "command": "python perf/bench_shared_prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "siblings": n, "lengths": {}}

    def sampling(seed: int) -> SamplingParams:
        return SamplingParams(0.9, top_k=40, seed=seed, logprobs=True)

    for length in lengths:
        prompt = [3 + (7919 * i) % (target.spec.vocab_size - 3) for i in range(length)]
        shared = TargetVerifier(target, taps, n, length + 1, 16)
        alone = TargetVerifier(target, taps, 1, length + 1, 16)
        prefill_s, fork_s, same = [], [], True
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            shared.start(0, prompt, sampling(1), True, keep=n - 1)
            prefill_s.append(time.perf_counter() - t0)
            for k in range(1, n):
                t0 = time.perf_counter()
                got = shared.fork(k, 0, prompt, sampling(1 + k))
                fork_s.append(time.perf_counter() - t0)
                want = alone.start(k, prompt, sampling(1 + k), False)
                same &= (got.first_token, got.logprobs) == (want.first_token, want.logprobs)
                alone.free(k)
            for k in range(n):
                shared.free(k)
        pre, fork = statistics.median(prefill_s), statistics.median(fork_s)
        res["lengths"][str(length)] = {
            "prefill_ms": round(1000 * pre, 2), "fork_ms": round(1000 * fork, 2),
            "n_starts_prefilled_ms": round(1000 * n * pre, 1),
            "n_starts_shared_ms": round(1000 * (pre + (n - 1) * fork), 1),
            "speedup": round(n * pre / (pre + (n - 1) * fork), 2), "same_first_tokens": same}
        print(json.dumps({length: res["lengths"][str(length)]}), file=sys.stderr)
    emit_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
