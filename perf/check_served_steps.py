#!/usr/bin/env python3
"""The Triton step engines (``runtime/steps.py``: ``target_verify``, ``kv_inject``, ``drafter``) on a device against
the CPU oracle, driven by the serving loop in-process (no Triton server: the engines are what the python-backend
models call, and they have never run on a GPU).

    python perf/check_served_steps.py --device cuda [--target DIR --drafter DIR] > served_steps.json

Concurrent sequences run through ``runtime.loop.run_generation`` over ``BatchedLocalSteps`` (the live sequences' calls
batched per step, as the BLS model batches them) with every engine on ``--device``: block size 16, ``auto`` with
prompt lookup, and the tree verify. Their tokens must equal target-only greedy decoding on the CPU: a tiny random pair
in float64 (exact on any device), and with ``--target``/``--drafter`` the real pair in float32 (two chat prompts).
Prints one JSON object (``ok``: every comparison equal); exit 1 if any differs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path


MODES = ("16", "auto+ngram", "16+tree")
TINY_PROMPTS = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
REAL_QUESTIONS = ["Write a Python function that returns the n-th Fibonacci number.",
                  "Name three differences between a list and a tuple in Python."]


def served(pair, target_dir, prompts: list[list[int]], tokens: int, mode: str) -> tuple[list[list[int]], float]:
    """Every prompt's tokens, the prompts decoded concurrently through step engines over ``pair`` (target and
    drafter, loaded on the device; ``target_dir``: where the drafter engine's embedding and head come from), and τ."""
    import torch

    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.tree import tree_for
    from trtllm_dflash.runtime.loop import BatchedLocalSteps, run_generation
    from trtllm_dflash.runtime.protocol import GenerateRequest
    from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

    target, drafter = pair
    bsz = drafter.spec.block_size
    tree = tree_for(bsz - 1) if mode.endswith("+tree") else None
    max_len = max(len(p) for p in prompts) + tokens + 8
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, len(prompts), max_len, bsz,
                              max_tree_nodes=tree.size if tree else 0)
    engines = BatchedLocalSteps(verifier, KVInjector(drafter),
                                BlockDrafter(drafter, TargetHead(target_dir, target.dtype, target.device), len(prompts),
                                             max_len))
    adaptive = mode.startswith("auto")
    # a fixed cost model: the plan (and so what is verified) must not depend on this machine's timings
    policy = AdaptivePolicy(CostModel([1e-3 * (1 + n / 64) for n in GRID], [5e-4 * (1 + n / 64) for n in GRID],
                                      alpha=0.0), bsz, [0.6] * (bsz - 1), ngram=True) if adaptive else None

    async def one(i: int, prompt: list[int]):
        last = []

        async def on_update(update):
            last[:] = [update]

        req = GenerateRequest(tuple(prompt), tokens, SamplingParams(), (), False)
        await run_generation(engines, req, "auto" if adaptive else bsz, 100 + i, on_update, policy=policy,
                             ngram=True, tree=tree)
        return last[0]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    with torch.inference_mode():
        finals = asyncio.run(main())
    taus = [t for u in finals for t in u.acceptance_lengths]
    return [list(u.tokens) for u in finals], sum(taus) / max(len(taus), 1)


def greedy(target, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Target-only greedy decoding (of the target on the CPU: the oracle), each prompt alone."""
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder

    dec = SpeculativeDecoder(target, None, 1)
    return [list(dec.generate([Request(tuple(p), tokens)])[0].token_ids) for p in prompts]


def compare(target_dir, drafter_dir, dtype, device, prompts, tokens) -> dict:
    import torch

    from trtllm_dflash.checkpoints import load_pair

    pair = load_pair(target_dir, drafter_dir, dtype=dtype, device=device)  # once: every mode's engines share it
    cpu_target = pair[0] if torch.device(device).type == "cpu" else load_pair(target_dir, None, dtype=dtype)[0]
    want = greedy(cpu_target, prompts, tokens)
    out = {}
    for mode in MODES:
        try:
            got, tau = served(pair, target_dir, prompts, tokens, mode)
            out[mode] = {"equal": got == want, "tau": round(tau, 3),
                         "differing_prompts": [i for i, (g, w) in enumerate(zip(got, want)) if g != w]}
        except Exception as exc:  # recorded: the other modes still run
            out[mode] = {"equal": False, "error": f"{type(exc).__name__}: {exc}"}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--target", help="the real target (HF directory); with --drafter: also check it in float32")
    p.add_argument("--drafter")
    p.add_argument("--tokens", type=int, default=24)
    args = p.parse_args(argv)
    import torch

    from trtllm_dflash.checkpoints import drafter_spec_for, random_drafter_state, write_drafter, write_tiny_target
    from trtllm_dflash.specs import TargetSpec

    report: dict = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device}
    with tempfile.TemporaryDirectory() as tmp:
        tdir, ddir = Path(tmp) / "target", Path(tmp) / "drafter"
        write_tiny_target(tdir, family="qwen3", seed=0, vocab_size=256)
        spec = TargetSpec.load(tdir)
        dspec = drafter_spec_for(spec, num_layers=2, block_size=16, mask_token_id=5)
        write_drafter(ddir, dspec, spec, random_drafter_state(dspec, 0))
        report["tiny_float64"] = compare(tdir, ddir, torch.float64, args.device, TINY_PROMPTS, args.tokens)
    if args.target and args.drafter:
        from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

        tok = load_tokenizer(args.target)
        prompts = [encode_prompt(tok, q, chat=True) for q in REAL_QUESTIONS]
        report["real_float32"] = compare(args.target, args.drafter, torch.float32, args.device, prompts, args.tokens)
    report["ok"] = all(r["equal"] for part in ("tiny_float64", "real_float32") for r in report.get(part, {}).values())
    print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
