#!/usr/bin/env python3
"""What verifying n tokens costs against one autoregressive step on this device, and what physics allows.

For n in --sizes, times the target's forward of n new tokens after a committed context plus its LM head over those n
rows (exactly a verify step; n = 1 is an autoregressive step), median of --repeats runs alternating the sizes. Beside
it, the floors: compute (2 · params · n multiply-adds at the measured GEMM rate of this device, same dtype and threads)
and memory (every weight read once at the measured copy bandwidth). The ratio verify(n) / step(1) the runtime gets is
then compared with the ratio of the floors: where measured ≫ floor, the runtime is the cause, not the machine.

    python perf/verify_cost.py --dtype float32,bfloat16 --threads 1 --out perf/results/adaptive/verify-cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trtllm_dflash.runtime.adaptive import timed  # noqa: E402  (after the path insert)


def gemm_rate(dtype: torch.dtype, m: int = 256, k: int = 576, n: int = 1536, repeats: int = 20) -> float:
    """FLOP/s of one [m, k] x [k, n] matmul, the shape of a verify's MLP projection."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    return 2 * m * k * n / min(timed(lambda: a @ b) for _ in range(repeats))


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """Bytes/s read + written by one large tensor copy (each byte counted once: the read)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src)) for _ in range(repeats))
    return src.numel() * 4 / best


@torch.inference_mode()
def measure(target, sizes: list[int], context: int, repeats: int) -> dict[int, float]:
    cache = target.new_cache(1, context + max(sizes) + 1)
    vocab = target.spec.vocab_size
    ids = torch.randint(0, vocab, (1, context))
    target(ids, cache)
    cache.commit(None, torch.tensor([context]))
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for r in range(repeats + 1):
        for n in sizes if r % 2 == 0 else reversed(sizes):
            x = torch.randint(0, vocab, (1, n))
            t = time.perf_counter()
            hidden, _ = target(x, cache)
            target.logits(hidden[0])
            dt = time.perf_counter() - t
            cache.crop(None, torch.tensor([context]))  # the verify is rolled back: same context every time
            if r:
                times[n].append(dt)
    return {n: statistics.median(v) for n, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="1,2,3,4,8,16")
    p.add_argument("--context", type=int, default=256, help="committed tokens before the verify")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models.target import TargetModel

    torch.set_num_threads(args.threads)
    target_dir = args.target or prepare_demo_assets()["target"]
    sizes = [int(s) for s in args.sizes.split(",")]
    bandwidth = copy_bandwidth()
    res = {"machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads",
           "context": args.context, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2), "dtypes": {}}
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        target = TargetModel.from_pretrained(target_dir, dtype=dtype)
        params = sum(p.numel() for p in target.parameters())  # tied embedding/LM head counted once: it is read once
        rate = gemm_rate(dtype)
        got = measure(target, sizes, args.context, args.repeats)
        size = torch.finfo(dtype).bits // 8
        floor = {n: max(2 * params * n / rate, params * size / bandwidth) for n in sizes}
        res["dtypes"][name] = {
            "params": params, "gemm_gflop_s": round(rate / 1e9, 1),
            "ms": {n: round(got[n] * 1e3, 2) for n in sizes},
            "floor_ms": {n: round(floor[n] * 1e3, 2) for n in sizes},
            "ratio_to_step1": {n: round(got[n] / got[1], 3) for n in sizes},
            "floor_ratio_to_step1": {n: round(floor[n] / floor[1], 3) for n in sizes},
            "efficiency": {n: round(floor[n] / got[n], 3) for n in sizes},
        }
        print(json.dumps({name: res["dtypes"][name]}), file=sys.stderr)
    text = json.dumps(res, indent=1) + "\n"
    print(text, end="")
    if args.out:
        tmp = f"{args.out}.tmp"
        Path(tmp).write_text(text)
        os.replace(tmp, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
