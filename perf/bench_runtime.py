#!/usr/bin/env python3
"""In-process benchmark of the speculative decoder: autoregressive (block size 1) vs DFlash on the same prompts.

Each prompt is decoded (greedy, or sampled with ``--temperature`` and one seed for every decoder) twice in this one
process: once by the baseline (the same loop with block size 1) and once with DFlash. The outputs must be
token-identical (``lossless``; sampled steps draw each position's token from that position's noise). Throughput is
new tokens over wall-clock time including prefill, summed over prompts.

    python perf/bench_runtime.py --dataset humaneval --limit 20 --block-size 16 --max-new-tokens 256 --json

``--block-size 16,8`` evaluates several block sizes against one autoregressive run (the baseline does not depend on
the block size, so it is decoded once per batch) and prints one JSON line per block size. ``auto`` may be one of them
(``--block-size auto,16,8,4``): its line says ``"block_size": "auto"`` and adds the policy's telemetry (distribution
of the chosen k, draft / verify / overhead seconds); ``auto+ngram`` also lets a step verify a prompt-lookup (n-gram)
continuation instead of the drafter's block, and ``16+ngram`` does so at a fixed block size wherever the context ends
in a recurring 2- or 3-gram (``lookup_steps`` counts those row-steps); ``16+tree`` verifies the drafter's block, its
runner-up tokens at the first slots and the lookup continuation side by side (``runtime.tree``;
``lookup_steps`` then counts the row-steps that kept the lookup's branch). Every batch
runs all decoders back to back (in reversed order on odd batches), so the ratios are paired even on a shared machine.

``--draft-vocab full,auto`` runs every DFlash mode once per draft vocabulary (``checkpoints.load_pair``: the target's
whole vocabulary, the drafter directory's ``draft_vocab.json``, or a file), labelled ``MODE@VOCAB`` on a line of its
own with ``draft_vocab_size`` and ``draft_vocab_coverage`` (the share of the autoregressive outputs' tokens the draft
vocabulary holds).

``--batch-size N`` decodes N prompts at a time in both modes (ragged batches; acceptance lengths and outputs do not
depend on the batch): the way to get τ and losslessness over a whole dataset on a slow machine. Its tokens/s and
speed-up are then *batched* numbers (labelled by ``batch_size`` in the JSON); the latency-bound speed-up that DFlash
is about is the batch-1 one.

Defaults to the demo target and drafter (``trtllm-dflash demo-assets``). Prints one JSON object per block size;
``--out FILE`` also writes them there (atomically, one per line).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import platform
import sys
import time
from dataclasses import replace


def parse_args(argv=None) -> argparse.Namespace:
    from trtllm_dflash.commands.common import add_penalty_arguments

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="humaneval", help="humaneval | mtbench | path to a JSONL file of {\"prompt\"}")
    p.add_argument("--limit", type=int, default=None, help="first N prompts only")
    p.add_argument("--block-size", default=None,
                   help="DFlash block size or 'auto', or a comma list (e.g. auto,16,8) sharing one AR run "
                        "(default: the drafter's)")
    p.add_argument("--max-block-size", type=int, default=None, help="longest block for auto (default: the drafter's)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0: every decoder samples with the same seed, and lossless means "
                        "token-identical to autoregressive sampling with it")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: 0 = off (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: 1.0 = off (default)")
    p.add_argument("--seed", type=int, default=0, help="with --temperature: every request's seed (default 0)")
    add_penalty_arguments(p, (1.0, 0.0, 0.0), " (default %(default)s: off)")
    p.add_argument("--logprobs", action="store_true",
                   help="every request also returns its tokens' log-probabilities (TensorRT-LLM's return_log_probs); "
                        "reports the largest difference between DFlash's and the autoregressive ones")
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--datastore", default="auto", metavar="FILE|auto|none",
                   help="N+tree's retrieval datastore (auto, default: the drafter directory's, if it has one)")
    p.add_argument("--draft-vocab", default="auto", metavar="CHOICE[,CHOICE]",
                   help="the drafter's draft vocabulary: auto (default: the drafter directory's draft_vocab.json if it "
                        "has one), full, or a file; a comma list runs every mode once per choice")
    p.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--device", default="cpu", help="torch device of both models, e.g. cuda (default cpu)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"],
                   help="weights and activations (default float32)")
    p.add_argument("--warmup-tokens", type=int, default=16,
                   help="untimed: every decoder first decodes the first batch for this many tokens, so CUDA's lazy "
                        "start-up and the kernels' JIT compilation stay out of the timings (0: none)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="exit 0 even when DFlash's outputs differ from autoregressive decoding (still reported as "
                        "\"lossless\": false): in bfloat16/float16 a multi-token verify rounds differently from "
                        "1-token steps, so near-tied argmaxes can flip; token identity holds in float32")
    p.add_argument("--cuda-graphs", default="off", choices=["off", "on", "rehearse"],
                   help="every decoder, the baseline included, replays its verify and draft forwards as CUDA graphs "
                        "(on: CUDA only; rehearse: the same static forwards without capture, any device; "
                        "runtime.graphs); tokens/s then leave out the time spent capturing, reported beside them "
                        "(graph_capture_s). Default off")
    p.add_argument("--json", action="store_true", help="print the JSON summary only (no progress text)")
    p.add_argument("--out", default=None, help="also write the JSON lines to this file (atomically)")
    args = p.parse_args(argv)
    from trtllm_dflash.runtime.mode import DecodeMode

    try:
        modes = [DecodeMode.parse(b, min_block=2) for b in args.block_size.split(",")] if args.block_size else []
        if len({m.label for m in modes}) < len(modes):
            raise ValueError
        args.modes = modes
    except ValueError:
        p.error(f"--block-size {args.block_size!r} must be 'auto' or an integer >= 2, each optionally with "
                "'+ngram' or '+tree', or a comma list of distinct ones, e.g. auto,16,16+ngram")
    if args.cuda_graphs == "on" and not args.device.startswith("cuda"):
        p.error(f"--cuda-graphs on needs --device cuda (got --device {args.device}); "
                "use --cuda-graphs rehearse to run the graphs' static forwards without capture")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    if args.threads:
        torch.set_num_threads(args.threads)
    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    vocabs = list(dict.fromkeys(args.draft_vocab.split(",")))
    target, drafter = load_pair(args.target, args.drafter, dtype=getattr(torch, args.dtype), device=args.device,
                                draft_vocab=vocabs[0])
    drafters = {vocabs[0]: drafter}  # one drafter per draft vocabulary (each with its head); one target for all
    for v in vocabs[1:]:
        drafters[v] = load_pair(args.target, args.drafter, dtype=getattr(torch, args.dtype), device=args.device,
                                draft_vocab=v)[1]
    tok = load_tokenizer(args.target)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    modes = [replace(m, max_block_size=args.max_block_size) if m.auto else m
             for m in args.modes or [DecodeMode(drafter.spec.block_size)]]
    runs = {(m.label if len(vocabs) == 1 else f"{m.label}@{v}"): (m, v) for m in modes for v in vocabs}
    blocks = list(runs)
    decoders = {"ar": SpeculativeDecoder(target, None, 1, cuda_graphs=args.cuda_graphs)}
    decoders.update({b: make_decoder(target, drafters[v], m, drafter_dir=args.drafter, datastore=args.datastore,
                                     cuda_graphs=args.cuda_graphs) for b, (m, v) in runs.items()})
    vocab_ids = {v: None if d.draft_head is None else set(d.draft_head.draft_to_target.tolist())
                 for v, d in drafters.items()}
    covered = collections.Counter()  # draft vocabulary -> autoregressive output tokens it holds
    prompts = load_prompts(args.dataset, args.limit)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logprobs=args.logprobs)
    sampling.validate("--")

    ms, tokens, capture_ms = collections.Counter(), collections.Counter(), collections.Counter()
    taus: dict[int | str, list[int]] = {b: [] for b in blocks}
    lookups: collections.Counter = collections.Counter()
    lookup_ms: collections.Counter = collections.Counter()
    mismatches: dict[int | str, list[str]] = {b: [] for b in blocks}
    logprob_diff: dict[int | str, float] = dict.fromkeys(blocks, 0.0)  # largest |DFlash − AR| of a token's
    batches = [prompts[i:i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    if args.warmup_tokens > 0 and batches:
        warm = [Request(tuple(encode_prompt(tok, p.text, p.chat)), args.warmup_tokens, sampling, stops)
                for p in batches[0]]
        for dec in decoders.values():
            dec.generate(warm)
            if dec.adaptive:  # its report covers the measured prompts only
                dec.policy.telemetry = type(dec.policy.telemetry)()
    bar = tqdm(total=len(prompts), desc=f"{args.dataset} B={args.block_size or blocks[0]} batch={args.batch_size}",
               file=sys.stderr, disable=None)
    for bi, batch in enumerate(batches):
        reqs = [Request(tuple(encode_prompt(tok, p.text, p.chat)), args.max_new_tokens, sampling, stops)
                for p in batch]
        outs = {}
        order = list(decoders.items())  # forward on even batches, reversed on odd: a drifting load hits both ends
        for name, dec in (order if bi % 2 == 0 else order[::-1]):
            captured = dec.graphs.capture_s if dec.graphs is not None else 0.0
            t0 = time.perf_counter()
            outs[name] = dec.generate(reqs)
            ms[name] += (time.perf_counter() - t0) * 1e3
            if dec.graphs is not None:  # steady state: a graph is captured once per step shape, then replayed
                capture_ms[name] += (dec.graphs.capture_s - captured) * 1e3
                ms[name] -= (dec.graphs.capture_s - captured) * 1e3
            tokens[name] += sum(r.num_new_tokens for r in outs[name])
        for v, ids in vocab_ids.items():
            covered[v] += sum(t in ids for a in outs["ar"] for t in a.token_ids) if ids is not None else 0
        for b in blocks:
            for p, a, d in zip(batch, outs["ar"], outs[b]):
                taus[b].extend(d.acceptance_lengths)
                lookups[b] += d.lookup_steps
                lookup_ms[b] += d.lookup_ms
                if a.token_ids != d.token_ids:
                    mismatches[b].append(p.id)
                elif args.logprobs:
                    logprob_diff[b] = max([logprob_diff[b], *(abs(x - y) for x, y in zip(a.logprobs, d.logprobs))])
        bar.update(len(batch))
    bar.close()

    ar_tps = tokens["ar"] / (ms["ar"] / 1e3)
    lines = []
    for b in blocks:
        df_tps = tokens[b] / (ms[b] / 1e3)
        hist = collections.Counter(taus[b])
        dec = decoders[b]
        lines.append({
            "dataset": args.dataset,
            "num_prompts": len(prompts),
            "block_size": runs[b][0].label,
            **({"run": b} if len(vocabs) > 1 else {}),
            "draft_vocab": runs[b][1],
            "draft_vocab_size": len(vocab_ids[runs[b][1]]) if vocab_ids[runs[b][1]] is not None else None,
            **({"draft_vocab_coverage": round(covered[runs[b][1]] / max(tokens["ar"], 1), 5)}
               if vocab_ids[runs[b][1]] is not None else {}),
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            **({"sampling": {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
                             "seed": args.seed}} if not sampling.greedy else {}),
            "ar_tokens_per_second": round(ar_tps, 3),
            "dflash_tokens_per_second": round(df_tps, 3),
            "speedup": round(df_tps / ar_tps, 3),
            "mean_acceptance_length": round(sum(taus[b]) / len(taus[b]), 3) if taus[b] else None,
            "acceptance_histogram": {str(k): hist[k] for k in range(1, dec.block_size + 1)},
            "lossless": not mismatches[b],
            "mismatched_prompts": mismatches[b],
            "num_new_tokens": tokens[b],
            **({"logprobs": True, "max_abs_logprob_diff": float(f"{logprob_diff[b]:.3g}")} if args.logprobs else {}),
            **({"max_block_size": dec.block_size, "adaptive": dec.policy.telemetry.to_json()} if dec.adaptive else {}),
            **({"lookup_steps": lookups[b]} if dec.ngram and not dec.adaptive else {}),
            **({"tree_nodes": dec.tree.size, "tree_lookup": dec.tree.lookup, "tree_grafts": list(dec.tree.grafts),
                # host time per step making the lookup chains' proposals (on a GPU: between the draft and the verify)
                "tree_lookup_ms_per_step": round(lookup_ms[b] / max(len(taus[b]), 1), 3)} if dec.tree else {}),
            **({"datastore_tokens": dec.datastore.num_tokens} if dec.tree and dec.datastore else {}),
            "target": os.path.basename(os.path.normpath(args.target)),
            "drafter": os.path.basename(os.path.normpath(args.drafter)),
            "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                       f"{torch.get_num_threads()} threads",
            "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "dtype": args.dtype,
            "cuda_graphs": args.cuda_graphs,
            # with graphs, tokens/s leave out the time spent capturing (reported here, baseline and DFlash)
            **({"graph_captures": dec.graphs.captures, "graph_capture_s": round(capture_ms[b] / 1e3, 3),
                "ar_graph_capture_s": round(capture_ms["ar"] / 1e3, 3)} if dec.graphs is not None else {}),
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        })
    text = "".join(json.dumps(line) + "\n" for line in lines)
    print(text, end="")
    if args.out:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, args.out)
    return 0 if args.allow_mismatch or all(line["lossless"] for line in lines) else 1


if __name__ == "__main__":
    sys.exit(main())
