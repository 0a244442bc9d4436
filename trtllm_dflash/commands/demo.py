"""``trtllm-dflash demo``: the whole path on the embedded default model.

Prepares the demo assets, renders the Triton repository, starts a real Triton server, streams one chat answer from
the ``dflash`` ensemble over gRPC, then has the ``baseline`` ensemble (autoregressive, same models) and ``dflash``
answer the same question in turns until each has answered ``--repeats`` times (which goes first alternates), and
prints τ, the median speed of each (every answer's in ``runs``), the speed-up of the medians and whether every answer
equals the baseline's; then stops the server. ``--in-process`` skips Triton and runs the same comparison in this
process. Why medians: one request of 128 tokens takes a few seconds, and on a shared machine one busy second moves a
single request's speed-up far from its typical value; the median of alternating turns is robust to such a second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Callable

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trtllm_dflash.commands.common import add_ngram_argument, block_size_arg

    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question to ask (chat template applied)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--block-size", type=block_size_arg, default="auto",
                        help="'auto' (default: per step, as many drafts as pay off on this machine) or a fixed size")
    add_ngram_argument(parser)
    parser.add_argument("--repeats", type=int, default=3,
                        help="timed answers per model, taking turns; the speeds are their medians (default 3)")
    parser.add_argument("--in-process", action="store_true", help="run in this process instead of through Triton")


def timed_turns(dflash: Callable[[bool], object], baseline: Callable[[], object], repeats: int) -> tuple[list, list]:
    """``repeats`` answers of each, taking turns: pair i runs dflash first when i is even (the very first answer
    streams), baseline first when odd, so a slow stretch of the machine does not fall on one side only."""
    d_runs, a_runs = [], []
    for i in range(repeats):
        if i % 2 == 0:
            d_runs.append(dflash(i == 0))
            a_runs.append(baseline())
        else:
            a_runs.append(baseline())
            d_runs.append(dflash(False))
    return d_runs, a_runs


def _summary(block, ngram, d_runs, a_runs, trained, path):
    """d_runs / a_runs: the answers (objects with ``token_ids``, ``acceptance_lengths``, ``tokens_per_second``)."""
    taus = [t for d in d_runs for t in d.acceptance_lengths]
    d_tps = [d.tokens_per_second for d in d_runs]
    a_tps = [a.tokens_per_second for a in a_runs]
    d_med, a_med = statistics.median(d_tps), statistics.median(a_tps)
    reference = list(a_runs[0].token_ids)
    return {
        "path": path,
        "block_size": block,
        "ngram": ngram,
        "mean_acceptance_length": round(sum(taus) / len(taus), 3) if taus else None,
        "dflash_tokens_per_second": round(d_med, 2),
        "baseline_tokens_per_second": round(a_med, 2),
        "speedup": round(d_med / a_med, 3) if a_med else None,
        "lossless": all(list(r.token_ids) == reference for r in (*d_runs, *a_runs)),
        "num_new_tokens": len(d_runs[0].token_ids),
        "drafter_trained": trained,
        "repeats": len(d_runs),
        "runs": {"dflash_tokens_per_second": [round(t, 2) for t in d_tps],
                 "baseline_tokens_per_second": [round(t, 2) for t in a_tps],
                 # verify steps of each dflash answer (the same tokens each time): a slow answer that took as many
                 # steps as a fast one met a busy machine; one that took more drafted less (``auto``'s choice)
                 "dflash_steps": [len(d.acceptance_lengths) for d in d_runs]},
    }


def _in_process(args, assets, block, ngram) -> dict:
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import IncrementalDetokenizer, encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(assets["target"], assets["drafter"])
    tok = load_tokenizer(assets["target"])
    req = Request(tuple(encode_prompt(tok, args.prompt, chat=True)), args.max_new_tokens,
                  stop_token_ids=stop_token_ids(tok, target.spec.eos_token_ids))
    detok = IncrementalDetokenizer(tok)
    decoder = make_decoder(target, drafter, DecodeMode.from_flags(block, ngram), assets["drafter"])
    baseline = SpeculativeDecoder(target, None, 1)

    def dflash(stream: bool):
        out = decoder.generate([req], (lambda _i, ids: print(detok.push(ids), end="", flush=True)) if stream else None)
        if stream:
            print(detok.flush(), flush=True)
        return out[0]

    warm = Request(tuple(encode_prompt(tok, "warm up", chat=True)), 16, stop_token_ids=req.stop_token_ids)
    for dec in (baseline, decoder):  # as through Triton: first calls (and auto's calibration) stay out of the timing
        dec.generate([warm])
    d_runs, a_runs = timed_turns(dflash, lambda: baseline.generate([req])[0], args.repeats)
    summary = _summary(block, ngram, d_runs, a_runs, assets["drafter_trained"], "in-process")
    if decoder.adaptive:
        summary["adaptive"] = decoder.policy.telemetry.to_json()
    return summary


def _through_triton(args, assets, block, ngram) -> dict:
    from trtllm_dflash.assets import cache_dir
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    repo = make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=block, max_seq_len=2048,
                                max_sequences=4, ngram=ngram, trtllm_names=False),  # it asks dflash and baseline
                     cache_dir() / "demo-repo", force=True)
    log = cache_dir() / "demo-server.log"
    print(f"starting Triton on {repo} (log: {log}) ...", file=sys.stderr)
    with TritonServer(repo, log_path=log) as server, DFlashClient(server.grpc_url) as client:
        params = GenerateParams(args.prompt, args.max_new_tokens)
        for model in ("baseline", "dflash"):  # each step model's first call stays out of the timing
            client.generate(model, GenerateParams("warm up", 16))

        def dflash(stream: bool):
            if not stream:
                return client.generate("dflash", params)
            out = client.generate("dflash", params, on_chunk=lambda c: print(c.text, end="", flush=True))
            print(flush=True)
            print(f"(asking the baseline ensemble the same question; {args.repeats} timed answers each ...)",
                  file=sys.stderr)
            return out

        d_runs, a_runs = timed_turns(dflash, lambda: client.generate("baseline", params), args.repeats)
    summary = _summary(block, ngram, d_runs, a_runs, assets["drafter_trained"], f"triton grpc {server.grpc_url}")
    summary["ttft_ms"] = round(statistics.median(d.ttft_ms for d in d_runs), 1)
    return summary


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.commands.common import resolve_ngram
    from trtllm_dflash.errors import require

    require(args.repeats >= 1, "--repeats", args.repeats, "must be >= 1 (timed answers per model)",
            "e.g. --repeats 3")
    assets = prepare_demo_assets()
    block = args.block_size
    ngram = resolve_ngram(args.ngram, block)
    print(f"target  {assets['target']}\ndrafter {assets['drafter']}"
          f"{'' if assets['drafter_trained'] else '  (UNTRAINED random drafter: expect τ ≈ 1)'}\n", file=sys.stderr)
    print(f">>> {args.prompt}\n", file=sys.stderr)
    summary = (_in_process if args.in_process else _through_triton)(args, assets, block, ngram)
    print(json.dumps(summary))
    return 0 if summary["lossless"] else 1
