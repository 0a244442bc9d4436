"""``trtllm-dflash generate``: run prompts through the speculative decoder in-process."""

from __future__ import annotations

import argparse
import json
import math
import sys

from dataclasses import replace

from trtllm_dflash.commands.common import (DTYPES, add_bias_argument, add_draft_vocab_argument, add_model_arguments, add_sampling_arguments,
                                           bias_words, make_decoder, resolve_mode)
from trtllm_dflash.errors import ConfigError, require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt (raw text)")
    src.add_argument("--prompts-file", help='JSONL file, one {"prompt": "..."} per line')
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the target's chat template")
    add_sampling_arguments(parser)
    parser.add_argument("--tree", action="store_true",
                        help="tree verify (greedy or sampled): the drafter's block, its runner-up tokens at the "
                             "first slots and prompt lookup's proposals (not under --no-ngram), also after its first "
                             "draft, checked in one target forward, the longest accepted path kept. More tokens per "
                             "step for a wider verify: pays where a verify costs about the same whatever its width (a "
                             "GPU at small batch), not on a CPU; with --block-size auto a step takes the tree only "
                             "where this device's cost model says it pays")
    parser.add_argument("--datastore", default="auto", metavar="FILE|auto|none",
                        help="with --tree: a retrieval datastore whose proposals (continuations of the context's "
                             "last tokens in a corpus of the target's own outputs) take half of the lookup chains; "
                             "auto (default): the drafter directory's datastore.dflash if it has one")
    add_draft_vocab_argument(parser)
    parser.add_argument("--batch-size", type=int, default=1, help="prompts decoded together (default 1)")
    parser.add_argument("--cuda-graphs", nargs="?", const=True, default="auto", choices=["auto", "off", "on"],
                        help="replay the verify and draft forwards as CUDA graphs (captured once per step shape; for "
                             "small models at small batch, whose steps are paced by kernel launches): auto (default) "
                             "on a CUDA device only, off, on (alone: the same) needs CUDA")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    parser.add_argument("--bad-word", action="append", default=[], metavar="TEXT",
                        help="text never generated, tokenized without special tokens (TensorRT-LLM's bad_words: a "
                             "one-token word is never chosen, a longer one's last token not after its others); "
                             "repeat for more")
    add_bias_argument(parser)
    parser.add_argument("--logprobs", action="store_true",
                        help="also report each token's log-probability (with --json; else their sum)")


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import Prompt, file_prompts
    from trtllm_dflash.runtime.decoder import Request, check_capacity
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import (IncrementalDetokenizer, encode_bias, encode_prompt, encode_words,
                                            load_tokenizer, stop_token_ids)

    require(args.batch_size >= 1, "--batch-size", args.batch_size, "must be >= 1")
    if args.prompt is not None:
        require(args.prompt.strip() != "", "--prompt", args.prompt, "must not be empty")
        prompts = [Prompt("prompt", args.prompt, args.chat)]
    else:
        prompts = file_prompts(args.prompts_file, args.chat)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed,
                              repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
                              frequency_penalty=args.frequency_penalty, logprobs=args.logprobs)
    sampling.validate("--")
    bias = bias_words(args.bias)
    require(args.max_new_tokens >= 1, "--max-new-tokens", args.max_new_tokens, "must be >= 1")
    require(0 <= args.min_new_tokens <= args.max_new_tokens, "--min-new-tokens", args.min_new_tokens,
            f"must be in [0, --max-new-tokens={args.max_new_tokens}]")

    target, drafter = load_pair(args.target, args.drafter, dtype=DTYPES[args.dtype], device=args.device,
                                draft_vocab=args.draft_vocab)
    decoder = make_decoder(target, drafter, resolve_mode(args, drafter), args.drafter, datastore=args.datastore,
                           cuda_graphs=args.cuda_graphs)
    tokenizer = load_tokenizer(args.target)
    sampling = replace(sampling, bad_words=encode_words(tokenizer, args.bad_word),
                       logit_bias=encode_bias(tokenizer, bias))
    stops = stop_token_ids(tokenizer, target.spec.eos_token_ids)
    requests = []
    for p in prompts:
        ids = encode_prompt(tokenizer, p.text, p.chat)
        if not ids:
            raise ConfigError("prompt", p.text, "encodes to no tokens", "pass non-empty text")
        requests.append(Request(tuple(ids), args.max_new_tokens, sampling, stops, args.min_new_tokens))
    check_capacity(decoder, requests)

    for start in range(0, len(requests), args.batch_size):
        chunk = requests[start : start + args.batch_size]
        stream = not args.json and len(chunk) == 1
        detok = IncrementalDetokenizer(tokenizer)
        on_tokens = (lambda _i, ids: print(detok.push(ids), end="", flush=True)) if stream else None
        results = decoder.generate(chunk, on_tokens)
        for k, res in enumerate(results):
            text = tokenizer.decode(res.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
            if args.json:
                print(json.dumps({
                    "prompt": prompts[start + k].text,
                    "text": text,
                    "token_ids": list(res.token_ids),
                    "acceptance_lengths": list(res.acceptance_lengths),
                    "mean_acceptance_length": round(res.mean_acceptance_length, 4),
                    "num_new_tokens": res.num_new_tokens,
                    "tokens_per_second": round(res.tokens_per_second, 3),
                    "ttft_ms": round(res.ttft_ms, 3),
                    "finish_reason": res.finish_reason,
                    "block_size": decoder.block_size_label,
                    **({"draft_lengths": list(res.draft_lengths)} if decoder.adaptive else {}),
                    **({"ngram": True, "lookup_steps": res.lookup_steps} if decoder.ngram else {}),
                    **({"logprobs": list(res.logprobs), "cum_log_prob": round(math.fsum(res.logprobs), 4)}
                       if args.logprobs else {}),
                }), flush=True)
            else:
                print(detok.flush() if stream else text, flush=True)
                print(f"[{res.num_new_tokens} tokens, {res.tokens_per_second:.1f} tok/s, mean acceptance length "
                      f"τ = {res.mean_acceptance_length:.2f}, block size {decoder.block_size_label}"
                      f"{f', {res.lookup_steps} prompt-lookup steps' if decoder.ngram else ''}"
                      f"{f', cumulative log-probability {math.fsum(res.logprobs):.3f}' if args.logprobs else ''}]",
                      file=sys.stderr)
    return 0
