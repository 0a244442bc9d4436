#!/usr/bin/env python3
"""Aggregate throughput through Triton at concurrency C against the in-process runtime decoding the same C prompts
as one batch (the meaningful ceiling on a small CPU machine), paired and alternating.

    python perf/throughput_c16.py --concurrency 16 --max-tokens 64 --rounds 3 --out perf/results/reliability/c16.json

Each round runs both sides back to back in alternating order on the same C prompts (so drifting load on a shared
machine hits both alike): in-process, one ``generate`` call over all C requests; Triton, C client threads with one
prompt each over their own gRPC streams. Reports tokens/s of both per round, their ratio per round and overall, and
how many Triton outputs equal the in-process ones, and the step coalescer's sequence rows per step-model call over
the Triton runs. Starts its own server (demo assets unless --target/--drafter) and warms up every measured model
(2 texts × 16 tokens each, so `auto` has probed the drafter and every step model has run once); --no-coalesce,
--queue-delay-us, --torch-threads, --instances and --io-nice render it with those make-repo options (the cheap
knobs); --block-size auto and --ngram render and decode in-process with those; --tree renders `make-repo --tree`
(with the drafter directory's datastore) and decodes in-process with the same tree. With both entry models measured
it also reports dflash's Triton tokens/s over the baseline's, round by round (``triton_dflash_over_baseline``; the
models run one after the other, so on a shared machine load drift lands in it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path



def parse_args(argv=None):
    from trtllm_dflash.commands.common import block_size_arg

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--models", default="dflash,baseline")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--block-size", type=block_size_arg, default=8, help="an integer or 'auto' (default 8)")
    p.add_argument("--ngram", action="store_true",
                   help="dflash also verifies prompt lookup's proposals (make-repo --ngram; in-process the same)")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--no-coalesce", dest="coalesce", action="store_false")
    p.add_argument("--queue-delay-us", type=int, default=None)
    p.add_argument("--torch-threads", type=int, default=None)
    p.add_argument("--instances", type=int, default=None)
    p.add_argument("--io-nice", type=int, default=None)
    p.add_argument("--tree", action="store_true", help="dflash verifies the decoder's tree (make-repo --tree)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def triton_outputs(url, model, texts, max_tokens):
    """Every text on its own client thread and stream at once: (outputs in order, wall seconds)."""
    import threading

    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams

    out: list = [None] * len(texts)

    def one(i):
        with DFlashClient(url) as client:
            out[i] = client.generate(model, GenerateParams(texts[i], max_tokens)).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - t0


def main(argv=None) -> int:
    args = parse_args(argv)
    load = os.getloadavg()[0]
    from bench_serving import in_process_decoders

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.perf.health import step_batching
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.decoder import Request
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    if args.target is None:
        assets = prepare_demo_assets()
        args.target, args.drafter = assets["target"], args.drafter or assets["drafter"]
    texts = [p.text for p in load_prompts(args.dataset, args.concurrency)]
    ngram = args.ngram or args.tree
    decoders, encode = in_process_decoders(args.target, args.drafter, args.block_size, ngram, args.tree)
    result = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "dataset": args.dataset,
              "block_size": args.block_size, "ngram": ngram, "tree": args.tree, "rounds": args.rounds, "models": {}}
    knobs = {k: getattr(args, k) for k in ("coalesce", "queue_delay_us", "torch_threads", "instances", "io_nice")
             if getattr(args, k) is not None}
    result["repo_options"] = knobs
    if args.tree:
        from trtllm_dflash.commands.serving import repo_datastore

        knobs = {**knobs, "tree": True, "datastore": repo_datastore("auto", args.drafter, True)}
    knobs["ngram"] = ngram
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(args.target, args.drafter, block_size=args.block_size, max_seq_len=1024,
                                    max_sequences=args.concurrency + 2, **knobs), Path(tmp) / "repo")
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            for model in args.models.split(","):  # warm-up: every measured model and the step models behind it (16
                triton_outputs(server.grpc_url, model, texts[:2], 16)  # tokens: `auto` probes the drafter after 8)
            for model in args.models.split(","):
                dec = decoders[model]
                rounds, same = [], 0
                calls_before = step_batching(server.metrics_url).get(model, {})
                for r in range(args.rounds):
                    sides = {}
                    for side in (("in_process", "triton") if r % 2 == 0 else ("triton", "in_process")):
                        if side == "in_process":
                            t0 = time.perf_counter()
                            outs = [list(x.token_ids) for x in
                                    dec.generate([Request(*encode(t, args.max_tokens)) for t in texts])]
                            sides[side] = (outs, time.perf_counter() - t0)
                        else:
                            sides[side] = triton_outputs(server.grpc_url, model, texts, args.max_tokens)
                    same += sum(a == b for a, b in zip(sides["in_process"][0], sides["triton"][0]))
                    tps = {k: sum(map(len, o)) / s for k, (o, s) in sides.items()}
                    rounds.append({"in_process_tokens_per_second": round(tps["in_process"], 2),
                                   "triton_tokens_per_second": round(tps["triton"], 2),
                                   "triton_over_in_process": round(tps["triton"] / tps["in_process"], 3)})
                    print(json.dumps({model: {"round": r, **rounds[-1]}}), file=sys.stderr, flush=True)
                ratios = sorted(x["triton_over_in_process"] for x in rounds)
                calls = step_batching(server.metrics_url).get(model, {})
                rows_per_call = {}
                for step, c in calls.items():
                    b = calls_before.get(step, {})
                    n = c.get("requests", 0) - b.get("requests", 0)
                    rows_per_call[step] = round((c.get("rows", 0) - b.get("rows", 0)) / n, 2) if n else None
                mean = {k: statistics.mean(x[f"{k}_tokens_per_second"] for x in rounds) for k in ("triton", "in_process")}
                result["models"][model] = {"rounds": rounds, "median_ratio": round(statistics.median(ratios), 3),
                                           "mean_ratio": round(mean["triton"] / mean["in_process"], 3),  # of mean tok/s
                                           "identical_outputs": f"{same}/{args.rounds * len(texts)}",
                                           "triton_rows_per_step_call": rows_per_call}
                print(json.dumps({model: result["models"][model]}), file=sys.stderr, flush=True)
    sides = result["models"]
    if {"dflash", "baseline"} <= set(sides):  # the two entry models through Triton, round by round
        per_round = [d["triton_tokens_per_second"] / b["triton_tokens_per_second"]
                     for d, b in zip(sides["dflash"]["rounds"], sides["baseline"]["rounds"])]
        result["triton_dflash_over_baseline"] = {"median": round(statistics.median(per_round), 3),
                                                 "rounds": [round(x, 3) for x in per_round]}
    result["command"] = " ".join(["python", "perf/throughput_c16.py", *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, 1-min load average {load:.2f} at start"
    print(json.dumps(result, indent=2))
    if args.out:
        from trtllm_dflash.models.weights import write_json

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
