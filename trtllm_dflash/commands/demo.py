"""``trtllm-dflash demo``: the whole path on the embedded default model.

Prepares the demo assets, renders the Triton repository, starts a real Triton server, streams one chat answer from
the ``dflash`` ensemble over gRPC, asks the ``baseline`` ensemble (autoregressive, same models) the same question, and
prints τ, both speeds, the speed-up and whether the outputs are identical; then stops the server.
``--in-process`` skips Triton and runs the same comparison in this process.
"""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from trtllm_dflash.commands.common import add_ngram_argument, block_size_arg

    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question to ask (chat template applied)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--block-size", type=block_size_arg, default="auto",
                        help="'auto' (default: per step, as many drafts as pay off on this machine) or a fixed size")
    add_ngram_argument(parser)
    parser.add_argument("--in-process", action="store_true", help="run in this process instead of through Triton")


def _summary(block, ngram, dflash_ids, ar_ids, taus, dflash_tps, ar_tps, trained, path):
    return {
        "path": path,
        "block_size": block,
        "ngram": ngram,
        "mean_acceptance_length": round(sum(taus) / len(taus), 3) if taus else None,
        "dflash_tokens_per_second": round(dflash_tps, 2),
        "baseline_tokens_per_second": round(ar_tps, 2),
        "speedup": round(dflash_tps / ar_tps, 3) if ar_tps else None,
        "lossless": list(dflash_ids) == list(ar_ids),
        "num_new_tokens": len(dflash_ids),
        "drafter_trained": trained,
    }


def _in_process(args, assets, block, ngram) -> dict:
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import IncrementalDetokenizer, encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(assets["target"], assets["drafter"])
    tok = load_tokenizer(assets["target"])
    req = Request(tuple(encode_prompt(tok, args.prompt, chat=True)), args.max_new_tokens,
                  stop_token_ids=stop_token_ids(tok, target.spec.eos_token_ids))
    detok = IncrementalDetokenizer(tok)
    decoder = make_decoder(target, drafter, block, assets["drafter"], ngram=ngram)
    d = decoder.generate([req], lambda _i, ids: print(detok.push(ids), end="", flush=True))[0]
    print(detok.flush(), flush=True)
    a = SpeculativeDecoder(target, None, 1).generate([req])[0]
    summary = _summary(block, ngram, d.token_ids, a.token_ids, d.acceptance_lengths, d.tokens_per_second,
                       a.tokens_per_second, assets["drafter_trained"], "in-process")
    if decoder.adaptive:
        summary["adaptive"] = decoder.policy.telemetry.to_json()
    return summary


def _through_triton(args, assets, block, ngram) -> dict:
    from trtllm_dflash.assets import cache_dir
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.serve.render import RepoConfig, make_repo
    from trtllm_dflash.serve.server import TritonServer

    repo = make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=block, max_seq_len=2048,
                                max_sequences=4, ngram=ngram), cache_dir() / "demo-repo", force=True)
    log = cache_dir() / "demo-server.log"
    print(f"starting Triton on {repo} (log: {log}) ...", file=sys.stderr)
    with TritonServer(repo, log_path=log) as server, DFlashClient(server.grpc_url) as client:
        params = GenerateParams(args.prompt, args.max_new_tokens)
        for model in ("baseline", "dflash"):  # each step model's first call stays out of the timing
            client.generate(model, GenerateParams("warm up", 16))
        d = client.generate("dflash", params, on_chunk=lambda c: print(c.text, end="", flush=True))
        print(flush=True)
        print("(asking the baseline ensemble the same question ...)", file=sys.stderr)
        a = client.generate("baseline", params)
    summary = _summary(block, ngram, d.token_ids, a.token_ids, d.acceptance_lengths, d.tokens_per_second,
                       a.tokens_per_second, assets["drafter_trained"], f"triton grpc {server.grpc_url}")
    summary["ttft_ms"] = round(d.ttft_ms, 1)
    return summary


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.commands.common import resolve_ngram

    assets = prepare_demo_assets()
    block = args.block_size
    ngram = resolve_ngram(args.ngram, block)
    print(f"target  {assets['target']}\ndrafter {assets['drafter']}"
          f"{'' if assets['drafter_trained'] else '  (UNTRAINED random drafter: expect τ ≈ 1)'}\n", file=sys.stderr)
    print(f">>> {args.prompt}\n", file=sys.stderr)
    summary = (_in_process if args.in_process else _through_triton)(args, assets, block, ngram)
    print(json.dumps(summary))
    return 0 if summary["lossless"] else 1
