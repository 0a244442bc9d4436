#!/usr/bin/env python3
"""What verifying n tokens costs against one autoregressive step on this device, and what physics allows.

For n in --sizes, times the target's forward of n new tokens after a committed context plus its LM head over those n
rows (exactly a verify step; n = 1 is an autoregressive step), median of --repeats runs alternating the sizes. Beside
it, the floors: compute (2 · params · n multiply-adds at the measured GEMM rate of this device, same dtype and threads)
and memory (every weight read once at the measured copy bandwidth). The ratio verify(n) / step(1) the runtime gets is
then compared with the ratio of the floors: where measured ≫ floor, the runtime is the cause, not the machine.
``--trees K,...`` also times the decoder's tree verifies for K drafts per chain (``runtime.tree.tree_for``, with and
without the datastore's chain: their node count under the tree mask), and ``--batch 1,8`` repeats everything with
that many sequences verified together (a GPU lease reads how wide a verify may be before it costs more than a step).
``--head first`` takes the LM head over each row's first slot only: what a verify whose first draft is rejected
pays on a CPU, where the decoder's head runs lazily (``runtime.sampling.verify_samples``); the calibration of
``--block-size auto`` times verifies the same way. How ``perf/policy_replay.py``'s DEFAULT_COST and DEFAULT_CONTEXT_S
are measured, batch-16 costs over an empty cache and over 300 tokens of context (several contexts are timed
interleaved, as the sizes are: on a shared machine separate runs drift by more than the context's share):

    python perf/verify_cost.py --dtype float32 --threads 2 --batch 16,8,4,1 --sizes 1,2,4,8,16 --head first \
        --context 0,300 --repeats 12 --out perf/results/adaptive/2026-11-27-verify-cost/verify-cost-context.json

    python perf/verify_cost.py --dtype float32,bfloat16 --threads 1 --out perf/results/adaptive/verify-cost.json
    python perf/verify_cost.py --device cuda --dtype bfloat16 --sizes 1,16,32,64,128,256 --trees 15,7 --batch 1,8
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


from trtllm_dflash.runtime.cost import timed


def _sync(device: str):
    return torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def gemm_rate(dtype: torch.dtype, m: int = 256, k: int = 576, n: int = 1536, repeats: int = 20,
              device: str = "cpu") -> float:
    """FLOP/s of one [m, k] x [k, n] matmul, the shape of a verify's MLP projection."""
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    a @ b
    return 2 * m * k * n / min(timed(lambda: a @ b, _sync(device)) for _ in range(repeats))


def copy_bandwidth(mib: int = 512, repeats: int = 5, device: str = "cpu") -> float:
    """Bytes/s read + written by one large tensor copy (each byte counted once: the read)."""
    src = torch.empty(mib * 2**20 // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), _sync(device)) for _ in range(repeats))
    return src.numel() * 4 / best


@torch.inference_mode()
def measure(target, sizes: list, contexts: list[int], repeats: int, batch: int = 1,
            first_head: bool = False) -> dict:
    """Median seconds of a verify per (context, size): an int n is n consecutive tokens (n = 1: an autoregressive
    step), a ``runtime.tree.Topology`` its nodes under the tree mask; ``batch`` sequences at a time over each of
    ``contexts`` committed tokens (interleaved); ``first_head``: the LM head over each row's first slot only."""
    widths = [s if isinstance(s, int) else s.size for s in sizes]
    dev = target.device
    vocab = target.spec.vocab_size
    caches = {}  # context -> (cache, its committed lengths)
    for context in contexts:
        cache = target.new_cache(batch, context + max(widths) + 1)
        if context:
            target(torch.randint(0, vocab, (batch, context), device=dev), cache)
        committed = torch.full((batch,), context, device=dev)
        cache.commit(None, committed)
        caches[context] = cache, committed
    sync = _sync(str(dev))
    plan = [(c, s, n) for c in contexts for s, n in zip(sizes, widths)]
    times: dict = {(c, s): [] for c, s, _ in plan}
    for r in range(repeats + 1):
        for c, s, n in (plan if r % 2 == 0 else reversed(plan)):
            cache, committed = caches[c]
            x = torch.randint(0, vocab, (batch, n), device=dev)
            layout = None if isinstance(s, int) else s.layout(committed)
            sync()
            t = time.perf_counter()
            hidden, _ = target(x, cache, layout=layout)
            target.logits(hidden[:, :1] if first_head else hidden)
            sync()
            dt = time.perf_counter() - t
            cache.crop(None, committed)  # the verify is rolled back: same context every time
            if r:
                times[c, s].append(dt)
    return {key: statistics.median(v) for key, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--dtype", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="1,2,3,4,8,16")
    p.add_argument("--context", default="256",
                   help="committed tokens before the verify; a comma list is timed interleaved, the first one "
                        "reported at the top (the others under ms_by_context)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--trees", default="",
                   help="comma list of K: also time the decoder's trees for K drafts per chain (with and without "
                        "the datastore's chain), e.g. 15,7")
    p.add_argument("--batch", default="1", help="comma list of sequences verified together (default 1)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cuda (default cpu)")
    p.add_argument("--head", choices=("all", "first"), default="all",
                   help="the LM head over every verified slot (default) or each row's first only")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.runtime.tree import tree_for

    torch.set_num_threads(args.threads)
    target_dir = args.target or prepare_demo_assets()["target"]
    sizes = [int(s) for s in args.sizes.split(",")]
    contexts = [int(c) for c in args.context.split(",")]
    if 1 not in sizes:
        sizes.insert(0, 1)  # the autoregressive step every ratio is against
    trees = {f"tree k={k}{' + datastore' if ds else ''}": tree_for(k, True, ds).topology
             for k in (int(x) for x in args.trees.split(",") if x) for ds in (False, True)}
    bandwidth = copy_bandwidth(device=args.device)
    res = {"machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads",
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "context": contexts[0], "head": args.head, "copy_bandwidth_gb_s": round(bandwidth / 1e9, 2),
           "dtypes": {}}
    for name in args.dtype.split(","):
        dtype = getattr(torch, name)
        target = TargetModel.from_pretrained(target_dir, dtype=dtype, device=args.device)
        params = sum(p.numel() for p in target.parameters())  # tied embedding/LM head counted once: it is read once
        rate = gemm_rate(dtype, device=args.device)
        size = torch.finfo(dtype).bits // 8
        per_batch = {}
        for batch in (int(b) for b in args.batch.split(",")):
            timed_all = measure(target, sizes + list(trees.values()), contexts, args.repeats, batch,
                                args.head == "first")
            got = {s: v for (c, s), v in timed_all.items() if c == contexts[0]}
            floor = {n: max(2 * params * n * batch / rate, params * size / bandwidth) for n in sizes}
            per_batch[batch] = {
                "ms": {n: round(got[n] * 1e3, 2) for n in sizes},
                "floor_ms": {n: round(floor[n] * 1e3, 2) for n in sizes},
                "ratio_to_step1": {n: round(got[n] / got[1], 3) for n in sizes},
                "floor_ratio_to_step1": {n: round(floor[n] / floor[1], 3) for n in sizes},
                "efficiency": {n: round(floor[n] / got[n], 3) for n in sizes},
                **({"trees": {label: {"nodes": t.size, "ms": round(got[t] * 1e3, 2),
                                      "ratio_to_step1": round(got[t] / got[1], 3)} for label, t in trees.items()}}
                   if trees else {}),
                **({"ms_by_context": {c: {n: round(timed_all[c, n] * 1e3, 2) for n in sizes} for c in contexts}}
                   if len(contexts) > 1 else {}),
            }
        # the first --batch at the top level (the document's shape before --batch), the others under "batch"
        first = int(args.batch.split(",")[0])
        res["dtypes"][name] = {"params": params, "gemm_gflop_s": round(rate / 1e9, 1), "batch_size": first,
                               **per_batch.pop(first), **({"batch": per_batch} if per_batch else {})}
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
