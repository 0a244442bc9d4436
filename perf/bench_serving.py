#!/usr/bin/env python3
"""Through-Triton vs in-process throughput, and aggregate throughput under concurrency, for dflash and baseline.

    python perf/bench_serving.py --dataset humaneval --prompts 8 --max-tokens 64 --concurrency 1,4,16 --json

Starts its own server on a freshly rendered repository (demo assets unless --target/--drafter), runs each prompt
in-process (batch 1) for the c=1 reference, then through the ``dflash`` and ``baseline`` ensembles at each
concurrency (a pool of C client threads over one gRPC stream each). Prints one JSON object.
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=8, help="prompts per point")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


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


STEP_MODELS = ("target_verify", "kv_inject", "drafter", "dflash_bls", "baseline_bls", "preprocessing", "postprocessing")


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


def main(argv=None) -> int:
    args = parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.serve.render import RepoConfig, make_repo
    from trtllm_dflash.serve.server import TritonServer, server_command
    from trtllm_dflash.specs import DrafterSpec

    if args.target is None:
        assets = prepare_demo_assets()
        args.target, args.drafter = assets["target"], args.drafter or assets["drafter"]
    block = args.block_size or DrafterSpec.load(args.drafter).block_size
    conc = [int(c) for c in args.concurrency.split(",")]
    texts = [p.text for p in load_prompts(args.dataset, args.prompts)]

    target, drafter = load_pair(args.target, args.drafter)
    tok = load_tokenizer(args.target)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    in_process = {}
    for name, dec in (("dflash", SpeculativeDecoder(target, drafter, block)), ("baseline", SpeculativeDecoder(target, None, 1))):
        n, t0 = 0, time.perf_counter()
        for text in texts:
            r = dec.generate([Request(tuple(encode_prompt(tok, text, True)), args.max_tokens, stop_token_ids=stops)])[0]
            n += r.num_new_tokens
        in_process[name] = n / (time.perf_counter() - t0)
    del target, drafter

    results = {"dataset": args.dataset, "prompts": len(texts), "max_tokens": args.max_tokens, "block_size": block,
               "in_process_tokens_per_second": {k: round(v, 2) for k, v in in_process.items()}, "triton": {}}
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(args.target, args.drafter, block_size=block, max_seq_len=1024,
                                    max_sequences=max(conc) + 2), Path(tmp) / "repo")
        env = server_command(repo, 0, 0, 0).env  # what the server's step-model processes will inherit
        results["server_openmp_env"] = {k: env[k] for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")
                                        if k in env}
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            run_point(server.grpc_url, "baseline", texts[:1], 4, 1)  # warm-up
            results["server_time_c1"] = {}
            for model in ("dflash", "baseline"):
                results["triton"][model] = {}
                for c in conc:
                    before = server_times(server.grpc_url)
                    tps, wall = run_point(server.grpc_url, model, texts, args.max_tokens, c)
                    results["triton"][model][str(c)] = round(tps, 2)
                    if c == 1:
                        results["server_time_c1"][model] = time_split(before, server_times(server.grpc_url), wall)
    tri1 = results["triton"]
    results["triton_over_in_process_c1"] = {m: round(tri1[m]["1"] / in_process[m], 3) for m in tri1 if "1" in tri1[m]}
    results["machine"] = f"{platform.machine()} {os.cpu_count()} cpus"
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
