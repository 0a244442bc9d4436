#!/usr/bin/env python3
"""vLLM's offline ``LLM`` API as a worker process for perf/bench_peers.py. Runs inside the peer's own environment
(``.peers/vllm``, made by build_scripts/peer_vllm.sh): vLLM cannot be imported into this project's .venv, so this file
imports nothing from trtllm_dflash.

    .peers/vllm/bin/python perf/peers/vllm_offline.py --target DIR [--drafter DIR --num-speculative-tokens 15]

Builds one engine (autoregressive, or DFlash with ``speculative_config={"method": "dflash", ...}``), prints one JSON
line ``{"ready": true, "version", "startup_s", ...}`` on stdout, then answers every JSON line on stdin:

    {"prompt_token_ids": [[...], ...], "max_new_tokens": 64, "stop_token_ids": [2], "concurrency": 1}

with ``{"token_ids": [[...], ...], "seconds", "num_drafts", "num_draft_tokens", "num_accepted_tokens"}``: greedy
outputs of the given (already chat-templated) prompts, the wall time of generating them, and the change of vLLM's
``vllm:spec_decode_*`` counters over the request (``LLM.get_metrics``). ``concurrency`` 1 generates the prompts one
at a time; C > 1 hands them to the engine together (it batches up to ``--max-num-seqs`` of them). vLLM's own log goes
to stderr. EOF on stdin ends it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}


def spec_counters(llm) -> dict[str, int]:
    """The engine's speculative-decoding counters so far (summed over engines); zeros without a drafter."""
    totals = dict.fromkeys(SPEC_COUNTERS.values(), 0)
    for metric in llm.get_metrics():
        if metric.name in SPEC_COUNTERS:
            totals[SPEC_COUNTERS[metric.name]] += int(metric.value)
    return totals


def protocol_stream():
    """The real stdout for the JSON lines, with file descriptor 1 pointed at stderr from here on: vLLM, its engine
    processes (which inherit fd 1) and the libraries they load print to stdout too, which would break the protocol."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return out


def emit(out, obj: dict) -> None:
    out.write(json.dumps(obj) + "\n")
    out.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True, help="the target's Hugging Face directory")
    p.add_argument("--drafter", default=None, help="a DFlash drafter directory (default: autoregressive)")
    p.add_argument("--num-speculative-tokens", type=int, default=15, help="draft tokens per step (block size - 1)")
    p.add_argument("--dtype", default="float32", help="weights and activations (default float32, as ours on CPU)")
    p.add_argument("--max-num-seqs", type=int, default=8, help="sequences the engine batches (default 8)")
    p.add_argument("--max-model-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM's eager mode: no torch.compile graphs")
    args = p.parse_args(argv)
    out = protocol_stream()

    t0 = time.perf_counter()
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = None
    if args.drafter:
        spec = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    llm = LLM(model=args.target, speculative_config=spec, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, seed=0, disable_log_stats=False, enforce_eager=args.enforce_eager)
    emit(out, {"ready": True, "version": vllm.__version__, "torch": torch.__version__,
          "startup_s": round(time.perf_counter() - t0, 2), "torch_threads": torch.get_num_threads()})

    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=req["max_new_tokens"],
                                stop_token_ids=req.get("stop_token_ids") or None)
        prompts = [TokensPrompt(prompt_token_ids=ids) for ids in req["prompt_token_ids"]]
        before = spec_counters(llm)
        start = time.perf_counter()
        if req.get("concurrency", 1) == 1:
            outs = [llm.generate([prompt], params, use_tqdm=False)[0] for prompt in prompts]
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        after = spec_counters(llm)
        emit(out, {"token_ids": [list(o.outputs[0].token_ids) for o in outs], "seconds": round(seconds, 4),
              **{k: after[k] - before[k] for k in after}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
