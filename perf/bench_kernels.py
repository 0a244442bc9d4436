#!/usr/bin/env python3
"""Drafting kernels vs their torch references on CUDA: time, bytes moved, achieved bandwidth vs measured copy bandwidth.

    python perf/bench_kernels.py --json                       # Qwen3-8B drafter shapes, bf16
    python perf/bench_kernels.py --batches 1,8 --contexts 1024,8192 --json

For each (batch, context length): block_attention (B = block size queries per sequence over context + block, one
layer), kv_inject (B committed tokens per sequence: fc + hidden_norm + one fused K/V GEMM + the k_norm/RoPE/store
kernel), and acceptance (greedy argmax over the vocabulary for B slots per sequence; sampled inverse CDF). Bytes are
the compulsory traffic of each op (inputs read once, outputs written once); bandwidth fraction = bytes / time /
device-to-device copy bandwidth measured in the same process. Needs CUDA; exits with code 2 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="1,8,32", help="comma-separated sequence counts")
    p.add_argument("--contexts", default="512,4096,16384", help="comma-separated context lengths (tokens)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=50, help="timed iterations per point (after 5 warm-up)")
    p.add_argument("--json", action="store_true", help="print one JSON object only")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured.",
              file=sys.stderr)
        return 2
    from trtllm_dflash.plugin import accept as A
    from trtllm_dflash.plugin import block_attention as BA
    from trtllm_dflash.plugin import kv_inject as KI
    from trtllm_dflash.plugin import triton_kernels as TK
    from trtllm_dflash.plugin.ragged import RaggedBatch

    dev, dtype = torch.device("cuda"), getattr(torch, args.dtype)
    esize = torch.tensor([], dtype=dtype).element_size()
    H, K, L, NH, NKV, HD, VOCAB = 4096, 5, 5, 32, 8, 128, 151936  # Qwen3-8B-DFlash-b16 (dflash.md §1.6)
    B = args.block_size

    def timed(fn, iters=args.iters) -> float:  # ms per call
        for _ in range(5):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters

    buf = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # 256 MiB
    dst = torch.empty_like(buf)
    copy_gbps = 2 * buf.numel() / (timed(lambda: dst.copy_(buf), 20) * 1e-3) / 1e9  # read + write
    del buf, dst

    records = []

    def record(op, batch, ctx, impl, ms, nbytes):
        records.append(dict(op=op, batch=batch, context=ctx, impl=impl, ms=round(ms, 4), bytes=nbytes,
                            gbps=round(nbytes / (ms * 1e-3) / 1e9, 1),
                            bw_fraction=round(nbytes / (ms * 1e-3) / 1e9 / copy_gbps, 3)))

    g = torch.Generator(device=dev).manual_seed(0)
    for batch in [int(x) for x in args.batches.split(",")]:
        for ctx in [int(x) for x in args.contexts.split(",")]:
            rows = torch.arange(batch, device=dev)
            ctx_lens = torch.full((batch,), ctx, device=dev)
            # block attention, one layer
            kc = torch.randn(batch, ctx + B, NKV, HD, device=dev, generator=g).to(dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(batch * B, NH, HD, device=dev, generator=g).to(dtype)
            kb, vb = torch.randn(batch * B, NKV, HD, device=dev, generator=g).to(dtype), None
            vb = torch.randn_like(kb)
            qb = RaggedBatch.from_lengths([B] * batch, device=dev)
            nbytes = esize * (2 * batch * ctx * NKV * HD + 2 * q.numel() + 2 * kb.numel())
            for impl, fn in (("triton", TK.block_attention_triton), ("torch", BA.block_attention_reference)):
                record("block_attention", batch, ctx, impl,
                       timed(lambda: fn(q, kb, vb, kc, vc, qb, rows, ctx_lens), 10 if impl == "torch" else None),
                       nbytes)
            del kc, vc
            # kv_inject of B committed tokens per sequence into a cache of ctx + B slots
            w = KI.InjectWeights(
                fc=torch.randn(H, K * H, device=dev, generator=g).to(dtype) * 0.01,
                hidden_norm=torch.ones(H, device=dev, dtype=dtype),
                kv=torch.randn(L * 2 * NKV * HD, H, device=dev, generator=g).to(dtype) * 0.01,
                k_norm=torch.ones(L, HD, device=dev, dtype=dtype), eps=1e-6, num_kv_heads=NKV, head_dim=HD)
            cos = torch.randn(ctx + B, HD, device=dev).to(dtype)
            sin = torch.randn_like(cos)
            kcache = torch.zeros(L, batch, ctx + B, NKV, HD, device=dev, dtype=dtype)
            vcache = torch.zeros_like(kcache)
            taps = torch.randn(batch * B, K * H, device=dev, generator=g).to(dtype)
            start = torch.full((batch,), ctx, device=dev)
            weight_bytes = esize * (w.fc.numel() + w.kv.numel())
            act_bytes = esize * (taps.numel() + 2 * batch * B * L * 2 * NKV * HD)  # taps in, GEMM out, cache in/out
            for impl, fn in (("triton", TK.kv_inject_triton), ("torch", KI.kv_inject_reference)):
                record("kv_inject", batch, ctx, impl,
                       timed(lambda: fn(taps, qb, start, rows, w, cos, sin, kcache, vcache)),
                       weight_bytes + act_bytes)
            del kcache, vcache
        # acceptance does not depend on the context length
        logits = torch.randn(batch * B, VOCAB, device=dev, generator=g).to(dtype)
        drafts = torch.randint(0, VOCAB, (batch * (B - 1),), device=dev)
        cu = (torch.arange(batch + 1, device=dev) * (B - 1)).int()
        for impl, argmax, acc in (("triton", TK.greedy_samples_triton, TK.accept_triton),
                                  ("torch", A.greedy_samples_reference, A.accept_reference)):
            record("accept_greedy", batch, None, impl,
                   timed(lambda: acc(drafts, cu, argmax(logits), B - 1)), esize * logits.numel())
        probs = torch.softmax(logits.float(), -1)
        u = torch.rand(batch * B, device=dev)
        for impl, fn in (("triton", TK.inverse_cdf_triton), ("torch", A.inverse_cdf_reference)):
            record("inverse_cdf", batch, None, impl, timed(lambda: fn(probs, u)), 2 * 4 * probs.numel())

    out = dict(device=torch.cuda.get_device_name(), dtype=args.dtype, block_size=B, copy_gbps=round(copy_gbps, 1),
               records=records)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{out['device']}: copy {out['copy_gbps']} GB/s")
        for r in records:
            print(f"{r['op']:16s} b={r['batch']:<3d} ctx={str(r['context']):6s} {r['impl']:6s} {r['ms']:9.4f} ms "
                  f"{r['gbps']:8.1f} GB/s ({100 * r['bw_fraction']:.0f}% of copy)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
