#!/usr/bin/env python3
"""Per-step dispatch cost of autoregressive vs DFlash decoding: how many torch operators a step issues, and in which
part of the step (the GPU is launch-bound at batch 1: on an H200, SmolLM2-135M decoded at ~50 tokens/s, ~20 ms a
token, for a model whose weights stream in well under 0.1 ms), measured where no GPU is needed.

    python perf/bench_overhead.py [--layers 30] [--hidden 64] [--tokens 64] [--threads 1] > overhead.json

A tiny random target with SmolLM2's depth (30 layers, hidden 64: compute is negligible, so time per step is the
framework's per-operator cost, as on a GPU at batch 1) and a 3-layer drafter; one prompt, greedy. For each decoder
(``ar``, B = 16, B = 16 with prompt lookup, the tree verify) it reports decode steps, milliseconds per step (median of ``--repeats``;
``--device cuda`` times the same on a GPU, where it measures what a launch costs there), and per step the operators issued in total and without view/reshape operators (those launch no
kernel on a GPU), split by phase: target forward, drafter forward + head (draft), KV injection, acceptance
(verify_samples; the tree's acceptance and K/V move) and the decoder's own loop. Operator counts do not depend on the machine; milliseconds do.

``--cuda-graphs on`` (CUDA) decodes with the verify and draft forwards replayed as CUDA graphs (``runtime.graphs``):
the operators counted are then those the host still issues one by one (a graph's replay is not an operator), and the
milliseconds what a step costs with them; ``rehearse`` runs the graphs' static forwards without capture (any device)."""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VIEWS = {"view", "unsqueeze", "slice", "select", "transpose", "reshape", "expand", "permute", "t", "alias",
         "_unsafe_view", "squeeze", "detach", "narrow", "split", "as_strided", "unbind", "lift_fresh", "resolve_conj",
         "resolve_neg"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cuda: the same counts and the real per-step time on a GPU")
    p.add_argument("--cuda-graphs", default="off", choices=["off", "on", "rehearse"],
                   help="replay the verify and draft forwards as CUDA graphs (on: CUDA only; default off)")
    args = p.parse_args(argv)
    if args.cuda_graphs == "on" and not args.device.startswith("cuda"):
        p.error(f"--cuda-graphs on needs --device cuda (got {args.device}); --cuda-graphs rehearse runs anywhere")
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from trtllm_dflash.checkpoints import (drafter_spec_for, load_pair, random_drafter_state, write_drafter,
                                           write_tiny_target)
    from trtllm_dflash.runtime import steps as dec_mod  # the step engines every decoder runs
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.tree import TreeShape
    from trtllm_dflash.specs import TargetSpec

    from trtllm_dflash.models import products

    torch.set_num_threads(args.threads)
    phase = ["loop"]

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops, self.launches = collections.Counter(), collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            self.ops[phase[0]] += 1
            # no kernel: views, and operators that hand back their input (a cast to the dtype it already has)
            if name not in VIEWS and not (args and out is args[0] and not name.endswith("_")):
                self.launches[phase[0]] += 1
            return out

    def labelled(fn, label):
        def run(*a, **kw):
            before, phase[0] = phase[0], label
            try:
                return fn(*a, **kw)
            finally:
                phase[0] = before
        return run

    # the counts stand for a GPU's launches: the CPU's measured kernels (a row padded and a transposed result made
    # contiguous for weight-major products, SDPA or not: models.products) are not what a GPU runs, so F.linear
    with tempfile.TemporaryDirectory() as tmp, products.forcing("linear"):
        tdir, ddir = Path(tmp) / "target", Path(tmp) / "drafter"
        write_tiny_target(tdir, num_layers=args.layers, hidden_size=args.hidden)
        tspec = TargetSpec.load(tdir)
        spec = drafter_spec_for(tspec, num_layers=3, block_size=16, mask_token_id=16)
        write_drafter(ddir, spec, tspec, random_drafter_state(spec, 0))
        target, drafter = load_pair(tdir, ddir, device=args.device)
    target.forward = labelled(target.forward, "target")
    saved = dec_mod.verify_samples, dec_mod.draft_block, dec_mod.commit_path, TreeShape.verify
    dec_mod.verify_samples, dec_mod.draft_block = labelled(saved[0], "accept"), labelled(saved[1], "draft")
    dec_mod.commit_path, TreeShape.verify = labelled(saved[2], "accept"), labelled(saved[3], "accept")
    reqs = [Request(tuple(range(20, 60)), args.tokens)]
    out = {"layers": args.layers, "hidden": args.hidden, "tokens": args.tokens, "threads": args.threads,
           "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
           "torch": torch.__version__, "cuda_graphs": args.cuda_graphs, "decoders": {}}
    try:
        graphs = {"cuda_graphs": args.cuda_graphs}
        for name, dec in (("ar", SpeculativeDecoder(target, None, 1, **graphs)),
                          ("16", SpeculativeDecoder(target, drafter, 16, **graphs)),
                          ("16+ngram", SpeculativeDecoder(target, drafter, 16, ngram=True, **graphs)),
                          ("16+tree", SpeculativeDecoder(target, drafter, 16, tree=True, **graphs))):
            if dec.injector is not None:
                dec.injector.rows = labelled(dec.injector.rows, "inject")
            res = dec.generate(reqs)[0]  # warm-up
            steps = len(res.acceptance_lengths) or res.num_new_tokens
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                dec.generate(reqs)  # ends in a host read of the last tokens, so the device has finished
                times.append((time.perf_counter() - t0) * 1e3 / steps)
            with Count() as c:
                dec.generate(reqs)
            out["decoders"][name] = {
                "steps": steps, "ms_per_step": round(statistics.median(times), 3),
                "ops_per_step": round(sum(c.ops.values()) / steps, 1),
                "launching_ops_per_step": round(sum(c.launches.values()) / steps, 1),
                "launching_ops_by_phase": {k: round(v / steps, 1) for k, v in sorted(c.launches.items())},
            }
    finally:
        dec_mod.verify_samples, dec_mod.draft_block, dec_mod.commit_path, TreeShape.verify = saved
    ar = out["decoders"]["ar"]
    for d in out["decoders"].values():
        d["step_cost_vs_ar"] = {"ms": round(d["ms_per_step"] / ar["ms_per_step"], 3),
                                "launching_ops": round(d["launching_ops_per_step"] / ar["launching_ops_per_step"], 3)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
