"""``trtllm-dflash demo``: prepare the demo assets, stream one chat answer with DFlash, then decode the same prompt
autoregressively (block size 1, same code path) and report τ, the speed-up and whether the outputs are identical."""

from __future__ import annotations

import argparse
import json
import sys

DEFAULT_PROMPT = "Write a Python function that returns the n-th Fibonacci number, with a docstring."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", default=DEFAULT_PROMPT, help="the question to ask (chat template applied)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens (default 128)")
    parser.add_argument("--block-size", type=int, default=None, help="default: the drafter's block size")


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import IncrementalDetokenizer, encode_prompt, load_tokenizer, stop_token_ids

    assets = prepare_demo_assets()
    target, drafter = load_pair(assets["target"], assets["drafter"])
    tokenizer = load_tokenizer(assets["target"])
    block = args.block_size or drafter.spec.block_size
    req = Request(tuple(encode_prompt(tokenizer, args.prompt, chat=True)), args.max_new_tokens,
                  stop_token_ids=stop_token_ids(tokenizer, target.spec.eos_token_ids))
    print(f"target  {assets['target']}\ndrafter {assets['drafter']}"
          f"{'' if assets['drafter_trained'] else '  (UNTRAINED random drafter: expect τ ≈ 1)'}\n", file=sys.stderr)
    print(f">>> {args.prompt}\n", file=sys.stderr)
    detok = IncrementalDetokenizer(tokenizer)
    dflash = SpeculativeDecoder(target, drafter, block).generate(
        [req], lambda _i, ids: print(detok.push(ids), end="", flush=True))[0]
    print(detok.flush(), flush=True)
    print("\n(decoding the same prompt autoregressively for comparison ...)", file=sys.stderr)
    ar = SpeculativeDecoder(target, None, 1).generate([req])[0]
    summary = {
        "block_size": block,
        "mean_acceptance_length": round(dflash.mean_acceptance_length, 3),
        "dflash_tokens_per_second": round(dflash.tokens_per_second, 2),
        "ar_tokens_per_second": round(ar.tokens_per_second, 2),
        "speedup": round(dflash.tokens_per_second / ar.tokens_per_second, 3) if ar.tokens_per_second else None,
        "lossless": dflash.token_ids == ar.token_ids,
        "num_new_tokens": dflash.num_new_tokens,
        "drafter_trained": assets["drafter_trained"],
    }
    print(json.dumps(summary))
    return 0 if summary["lossless"] else 1
