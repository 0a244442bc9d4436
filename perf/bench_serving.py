#!/usr/bin/env python3
"""Through-Triton vs in-process throughput, and aggregate throughput under concurrency, for dflash and baseline.

    python perf/bench_serving.py --dataset humaneval --prompts 8 --max-tokens 64 --concurrency 1,4,16 --json

Starts its own server on a freshly rendered repository (demo assets unless --target/--drafter). The c=1 comparison is
paired: prompt by prompt, each prompt runs in-process (batch 1) and through the ensemble back to back, in alternating
order, for --rounds rounds, so both sides see the same load on a shared machine, and the two outputs are checked to be
the same tokens. Then each ensemble runs at the other concurrencies (a pool of C client threads over one gRPC stream
each). Prints one JSON object. With both ensembles, ``paired_triton_c1`` also runs them through Triton prompt by
prompt in alternating order (the paired dflash/baseline ratio at c=1; ``dflash_over_baseline`` compares points
measured one after the other).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path


def parse_args(argv=None):
    from trtllm_dflash.commands.common import block_size_arg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=8, help="prompts per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--models", default="dflash,baseline", help="ensembles to measure")
    p.add_argument("--block-size", type=block_size_arg, default=None,
                   help="an integer or 'auto' (default: the drafter's)")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--torch-threads", type=int, default=0, help="torch threads per step model (0: torch's default)")
    p.add_argument("--ngram", action="store_true",
                   help="dflash also verifies prompt lookup's proposals where the context repeats (make-repo --ngram)")
    p.add_argument("--tree", action="store_true",
                   help="dflash verifies a tree per step, with the drafter directory's datastore when it has one "
                        "(make-repo --tree; implies --ngram); in-process: the same tree")
    p.add_argument("--rounds", type=int, default=1, help="rounds of the paired c=1 comparison")
    p.add_argument("--io-nice", type=int, default=19, help="make-repo --io-nice (CPU: the I/O side's niceness)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    args.ngram = args.ngram or args.tree
    if not args.models or not set(args.models.split(",")) <= {"dflash", "baseline"}:
        p.error(f"--models {args.models!r}: a comma list of dflash and/or baseline, e.g. dflash,baseline")
    return args


def run_point(url, model, prompts, max_tokens, concurrency):
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams

    todo = list(prompts)
    lock = threading.Lock()
    tokens = [0]

    def worker():
        with DFlashClient(url) as client:
            while True:
                with lock:
                    if not todo:
                        return
                    prompt = todo.pop()
                done = client.generate(model, GenerateParams(prompt, max_tokens))
                with lock:
                    tokens[0] += len(done.token_ids)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return tokens[0] / (time.perf_counter() - t0), time.perf_counter() - t0


def in_process_decoders(target_dir, drafter_dir, block_size, ngram=False, tree=False):
    """The in-process reference: ``dflash`` and ``baseline`` decoders over one loaded pair, and ``encode(text, n)`` ->
    the ``Request`` fields the ensembles use too (chat template, greedy, the target's stop tokens)."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, drafter = load_pair(target_dir, drafter_dir)
    tok = load_tokenizer(target_dir)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)

    def encode(text, max_tokens):
        return tuple(encode_prompt(tok, text, True)), max_tokens, SamplingParams(), stops

    return {"dflash": make_decoder(target, drafter, DecodeMode.from_flags(block_size, ngram, tree), drafter_dir),
            "baseline": SpeculativeDecoder(target, None, 1)}, encode


def alternate(sides: dict, texts, rounds) -> tuple[list[dict], dict, bool]:
    """Every text through each side (``name -> fn(text) -> token ids``) back to back, the order alternating by prompt
    and round (so drifting load on a shared machine hits all sides alike). Returns the seconds per side of each
    round, the tokens per side, and whether the sides always gave the same tokens."""
    names = list(sides)
    tokens, round_secs, same = dict.fromkeys(names, 0), [], True
    for r in range(rounds):
        secs = dict.fromkeys(names, 0.0)
        for i, text in enumerate(texts):
            out = {}
            for name in (names if (i + r) % 2 == 0 else names[::-1]):
                t0 = time.perf_counter()
                out[name] = sides[name](text)
                secs[name] += time.perf_counter() - t0
                tokens[name] += len(out[name])
            same &= all(out[n] == out[names[0]] for n in names)
        round_secs.append(secs)
    return round_secs, tokens, same


def paired_c1(url, model, decoder, encode, texts, max_tokens, rounds):
    """Tokens/s of ``decoder`` in-process and of ensemble ``model`` through Triton at c=1, prompt by prompt back to
    back in alternating order (``alternate``). Also returns the Triton-side wall time (for the server time split),
    the per-round ratios, and whether every Triton output equals the in-process tokens."""
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.runtime.decoder import Request

    with DFlashClient(url) as client:
        round_secs, tokens, same = alternate({
            "in_process": lambda text: list(decoder.generate([Request(*encode(text, max_tokens))])[0].token_ids),
            "triton": lambda text: list(client.generate(model, GenerateParams(text, max_tokens)).token_ids),
        }, texts, rounds)
    secs = {k: sum(r[k] for r in round_secs) for k in tokens}
    tps = {k: tokens[k] / secs[k] for k in secs}
    return {"in_process_tokens_per_second": round(tps["in_process"], 2),
            "triton_tokens_per_second": round(tps["triton"], 2),
            "triton_over_in_process": round(tps["triton"] / tps["in_process"], 3),
            # same tokens both sides: time ratio = tok/s ratio
            "round_ratios": [round(r["in_process"] / r["triton"], 3) for r in round_secs],
            "identical_tokens": same, "triton_seconds": secs["triton"]}


def paired_models_c1(url, texts, max_tokens, rounds, models=("dflash", "baseline")) -> dict:
    """Tokens/s of the two ensembles through Triton at c=1, prompt by prompt back to back in alternating order (the
    fair dflash/baseline ratio on a shared machine, where measuring one ensemble after the other is not)."""
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams

    with DFlashClient(url) as client:
        round_secs, tokens, same = alternate(
            {m: (lambda text, m=m: list(client.generate(m, GenerateParams(text, max_tokens)).token_ids))
             for m in models}, texts, rounds)
    secs = {m: sum(r[m] for r in round_secs) for m in models}
    tps = {m: tokens[m] / secs[m] for m in models}
    return {"tokens_per_second": {m: round(v, 2) for m, v in tps.items()},
            f"{models[0]}_over_{models[1]}": round(tps[models[0]] / tps[models[1]], 3),
            "round_ratios": [round(r[models[1]] / r[models[0]], 3) for r in round_secs],  # same tokens: time ratio
            "identical_tokens": same}


STEP_MODELS = ("target_verify", "kv_inject", "drafter", "dflash", "baseline", "dflash_bls", "baseline_bls", "preprocessing",
               "postprocessing")


def server_times(url) -> dict[str, dict[str, float]]:
    """Cumulative per-model executions and server-side times (ms) from Triton's statistics extension."""
    import tritonclient.grpc as grpcclient

    out = {}
    with grpcclient.InferenceServerClient(url) as client:
        for model in STEP_MODELS:
            s = client.get_inference_statistics(model, as_json=True)["model_stats"][0]
            inf = s["inference_stats"]
            ms = {k: int(inf.get(k, {}).get("ns", 0)) / 1e6 for k in ("queue", "compute_input", "compute_infer",
                                                                     "compute_output")}
            out[model] = {"executions": int(s.get("execution_count", 0)), **ms}
    return out


def time_split(before, after, wall_s: float) -> dict:
    """Where the wall time of a c=1 point went: server time per model (queue + compute) as a share of the wall time.
    The BLS model's compute spans the whole loop, so it is reported alone and not added to the step models."""
    split = {}
    for m in STEP_MODELS:
        d = {k: after[m][k] - before[m][k] for k in after[m]}
        if d["executions"]:
            busy = d["queue"] + d["compute_input"] + d["compute_infer"] + d["compute_output"]
            split[m] = {"executions": d["executions"], "ms_per_execution": round(busy / d["executions"], 2),
                        "share_of_wall": round(busy / (wall_s * 1e3), 3)}
    steps = [m for m in ("target_verify", "kv_inject", "drafter", "preprocessing", "postprocessing") if m in split]
    split["step_models_share_of_wall"] = round(sum(split[m]["share_of_wall"] for m in steps), 3)
    return split


def loop_metrics(url) -> dict:
    """The dflash loop's chosen-k counts and time split from the server's metrics endpoint."""
    from trtllm_dflash.perf.metrics import fetch_metrics, parse_prometheus

    samples = parse_prometheus(fetch_metrics(url))
    ks, secs = {}, {}
    for (name, labels), value in samples.items():
        lab = dict(labels)
        if lab.get("model") != "dflash":  # the entry model runs the loop (the label of user requests)
            continue
        if name == "dflash_chosen_draft_length_total" and value:
            ks[lab["k"]] = int(value)
        elif name == "dflash_step_seconds_total":
            secs[lab["part"]] = round(value, 3)
    return {"k_distribution": dict(sorted(ks.items(), key=lambda kv: int(kv[0]))), "step_seconds": secs}


def main(argv=None) -> int:
    args = parse_args(argv)
    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.decoder import Request
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer, server_command
    from trtllm_dflash.specs import DrafterSpec

    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    block = args.block_size or DrafterSpec.load(args.drafter).block_size
    conc = [int(c) for c in args.concurrency.split(",")]
    texts = [p.text for p in load_prompts(args.dataset, args.prompts)]

    decoders, encode = in_process_decoders(args.target, args.drafter, block, args.ngram, args.tree)
    decoders = {m: decoders[m] for m in args.models.split(",")}

    results = {"dataset": args.dataset, "prompts": len(texts), "max_tokens": args.max_tokens, "block_size": block,
               "ngram": args.ngram, "tree": args.tree,
               "rounds": args.rounds, "torch_threads": args.torch_threads, "io_nice": args.io_nice,
               "in_process_tokens_per_second": {},
               "triton": {}, "paired_c1": {}}
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(args.target, args.drafter, block_size=block, max_seq_len=1024, ngram=args.ngram,
                                    max_sequences=max(conc) + 2, torch_threads=args.torch_threads,
                                    io_nice=args.io_nice, tree=args.tree,
                                    trtllm_names=False),  # dflash and baseline only: no idle TRT-LLM-name stubs
                         Path(tmp) / "repo")
        env = server_command(repo, 0, 0, 0).env  # what the server's step-model processes will inherit
        results["server_openmp_env"] = {k: env[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
                                        if k in env}
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            warm = "baseline" if "baseline" in decoders else next(iter(decoders))
            run_point(server.grpc_url, warm, texts[:1], 4, 1)  # warm-up
            decoders[warm].generate([Request(*encode(texts[0], 4))])
            results["server_time_c1"] = {}
            for model, dec in decoders.items():
                results["triton"][model] = {}
                before = server_times(server.grpc_url)
                pair = paired_c1(server.grpc_url, model, dec, encode, texts, args.max_tokens, args.rounds)
                results["server_time_c1"][model] = time_split(before, server_times(server.grpc_url),
                                                              pair.pop("triton_seconds"))
                results["paired_c1"][model] = pair
                results["in_process_tokens_per_second"][model] = pair["in_process_tokens_per_second"]
                results["triton"][model]["1"] = pair["triton_tokens_per_second"]
                for c in (c for c in conc if c != 1):
                    tps, _ = run_point(server.grpc_url, model, texts, args.max_tokens, c)
                    results["triton"][model][str(c)] = round(tps, 2)
            if {"dflash", "baseline"} <= set(decoders):
                results["paired_triton_c1"] = paired_models_c1(server.grpc_url, texts, args.max_tokens, args.rounds)
            results["dflash_bls_metrics"] = loop_metrics(server.metrics_url)
    del decoders
    results["triton_over_in_process_c1"] = {m: p["triton_over_in_process"] for m, p in results["paired_c1"].items()}
    if {"dflash", "baseline"} <= set(results["triton"]):
        tri = results["triton"]
        results["dflash_over_baseline"] = {c: round(tri["dflash"][c] / tri["baseline"][c], 3) for c in tri["dflash"]}
    results["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
