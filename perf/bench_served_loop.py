#!/usr/bin/env python3
"""Triton's decode loop without Triton, against the in-process decoder: what the served path costs before transport.

The ``dflash_bls`` model runs ``runtime.loop.run_generation`` over the step models' engines (``runtime.steps``:
``TargetVerifier``, ``KVInjector``, ``BlockDrafter``). Here that loop runs over the same engines in this process
(``LocalSteps``), with the ``--block-size auto`` settings make-repo writes (``serve.triton.render.adaptive_settings``), next
to ``runtime.decoder`` with the settings ``trtllm-dflash generate`` uses; the two answer every prompt in turns (which
goes first alternates). Where their tokens/s or the drafts they choose to verify (k) differ, the cause is the loop or
its engines, not gRPC or the python backend. This comparison is how a served drafter LM head 2–4× slower than the
decoder's showed up: ``auto`` verified k = 0 on 76 % of the served demo's steps against 38 % in-process.

    python perf/bench_served_loop.py --max-new-tokens 128 --repeats 3
    python perf/bench_served_loop.py --dataset humaneval --limit 4 --max-new-tokens 64 --repeats 2 --out res.json

Prints JSON: per path the throughput over all answers, τ, each answer's tokens/s and the policy's telemetry (k
distribution, time split); ``loop_over_decoder``; ``identical_tokens`` (every answer equals the decoder's first answer
to its prompt; exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import time
from pathlib import Path


PATHS = ("decoder", "loop")


def _paths(target_dir, drafter_dir, ngram: bool, max_len: int):
    """{path: answer(prompt_ids, max_new_tokens) -> (tokens, seconds, taus)} and {path: its policy}."""
    import torch

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.decoder import Request
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import load_tokenizer, stop_token_ids
    from trtllm_dflash.serve.triton.bls import policy_from_settings
    from trtllm_dflash.runtime.loop import LocalSteps, run_generation
    from trtllm_dflash.runtime.protocol import GenerateRequest
    from trtllm_dflash.serve.triton.render import RepoConfig, adaptive_settings
    from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

    target, drafter = load_pair(target_dir, drafter_dir)
    stops = stop_token_ids(load_tokenizer(target_dir), target.spec.eos_token_ids)
    decoder = make_decoder(target, drafter, DecodeMode("auto", ngram=ngram), drafter_dir)
    doc = adaptive_settings(RepoConfig(target_dir, drafter_dir, block_size="auto", max_seq_len=max_len,
                                       max_sequences=1, ngram=ngram), drafter.spec)
    policy = policy_from_settings(doc)  # as the dflash_bls model loads it
    bsz = drafter.spec.block_size
    steps = LocalSteps(TargetVerifier(target, drafter.spec.target_layer_ids, 1, max_len, bsz), KVInjector(drafter),
                       BlockDrafter(drafter, TargetHead(target_dir, target.dtype, target.device), 1, max_len))
    seq_ids = itertools.count(1)

    def by_decoder(ids, n):
        t = time.perf_counter()
        out = decoder.generate([Request(tuple(ids), n, stop_token_ids=stops)])[0]
        return list(out.token_ids), time.perf_counter() - t, list(out.acceptance_lengths)

    def by_loop(ids, n):
        last = []

        async def on_update(update):
            last[:] = [update]

        # the stop tokens as one-token stop sequences, as preprocessing sends them (cut, as the decoder cuts them)
        req = GenerateRequest(tuple(ids), n, SamplingParams(), tuple((s,) for s in stops), False)
        t = time.perf_counter()
        with torch.inference_mode():
            asyncio.run(run_generation(steps, req, "auto", next(seq_ids), on_update, policy=policy, ngram=ngram))
        return list(last[0].tokens), time.perf_counter() - t, list(last[0].acceptance_lengths)

    return {"decoder": by_decoder, "loop": by_loop}, {"decoder": decoder.policy, "loop": policy}


def run(prompts: list[list[int]], answer, repeats: int, max_new_tokens: int, progress=None) -> dict:
    """Every prompt answered ``repeats`` times by each path, in turns (repeat r: the decoder first when r is even)."""
    runs = {p: [] for p in PATHS}  # (prompt index, tokens, seconds, taus)
    for r in range(repeats):
        for i, ids in enumerate(prompts):
            for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                tokens, seconds, taus = answer[path](ids, max_new_tokens)
                runs[path].append((i, tokens, seconds, taus))
                if progress:
                    progress.update(1)
    return runs


def summarize(runs: dict, policies: dict) -> dict:
    first = {}
    for i, tokens, _, _ in runs["decoder"]:
        first.setdefault(i, tokens)
    out: dict = {}
    for path in PATHS:
        tokens = sum(len(t) for _, t, _, _ in runs[path])
        seconds = sum(s for _, _, s, _ in runs[path])
        taus = [x for *_, ts in runs[path] for x in ts]
        out[path] = {"tokens_per_second": round(tokens / seconds, 2) if seconds else None,
                     "mean_acceptance_length": round(sum(taus) / len(taus), 3) if taus else None,
                     "answers_tokens_per_second": [round(len(t) / s, 2) for _, t, s, _ in runs[path] if s],
                     "adaptive": policies[path].telemetry.to_json()}
    d, lp = out["decoder"]["tokens_per_second"], out["loop"]["tokens_per_second"]
    out["loop_over_decoder"] = round(lp / d, 3) if d and lp else None
    out["identical_tokens"] = all(t == first[i] for path in PATHS for i, t, _, _ in runs[path])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=None, help="humaneval, mtbench or a JSONL file (default: the demo's question)")
    p.add_argument("--limit", type=int, default=4, help="prompts of --dataset (default 4)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="answers per prompt and path (default 3)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    p.add_argument("--no-ngram", action="store_true", help="without prompt lookup (default: with, as the demo)")
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    for name in ("limit", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if (args.target is None) != (args.drafter is None):
        p.error("--target and --drafter go together (neither: the demo pair)")
    import torch
    from tqdm import tqdm

    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

    torch.set_num_threads(args.threads)
    if args.target is None:
        from trtllm_dflash.assets import prepare_demo_assets

        assets = prepare_demo_assets()
        args.target, args.drafter = assets["target"], assets["drafter"]
    tok = load_tokenizer(args.target)
    if args.dataset:
        from trtllm_dflash.datasets import load_prompts

        prompts = [encode_prompt(tok, q.text, chat=q.chat) for q in load_prompts(args.dataset, args.limit)]
    else:
        from trtllm_dflash.commands.demo import DEFAULT_PROMPT

        prompts = [encode_prompt(tok, DEFAULT_PROMPT, chat=True)]
    max_len = max(len(x) for x in prompts) + args.max_new_tokens + 64
    answer, policies = _paths(args.target, args.drafter, not args.no_ngram, max_len)
    warm = encode_prompt(tok, "warm up", chat=True)
    for path in PATHS:  # first calls (and the decoder's calibration) stay out of the timing, as in the demo
        answer[path](warm, 16)
    with tqdm(total=args.repeats * len(prompts) * len(PATHS), desc="answers", file=sys.stderr) as bar:
        runs = run(prompts, answer, args.repeats, args.max_new_tokens, bar)
    out = {"dataset": args.dataset or "demo prompt", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "repeats": args.repeats, "threads": args.threads, "ngram": not args.no_ngram,
           "torch": torch.__version__, **summarize(runs, policies)}
    if args.out:
        from trtllm_dflash.models.weights import write_json

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(out, Path(args.out))
    print(json.dumps(out, indent=1))
    return 0 if out["identical_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
