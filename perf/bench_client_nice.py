#!/usr/bin/env python3
"""What a client sharing the server's cores costs the served answers on a CPU: the same question through one
Triton server, asked by a client process at niceness 0 and at niceness 19 in turns.

A deployed client runs on another machine; on the 2-core development VM the demo's and the benchmarks' clients run
beside the server, and a client thread that takes a core mid-forward stalls the step model's whole OpenMP team (as
the server's own I/O threads did: ``make-repo --io-nice``), or so we suspected in session 39. Measured with this
script: no difference beyond this VM's noise (perf/results/README.md, "reliability/"), so the demo's client keeps
the default priority.

    python perf/bench_client_nice.py --rounds 4 --answers 3 --out perf/results/reliability/client-nice-2.json

Prints JSON: per niceness every answer's tokens/s (each client process asks ``--answers`` times) and target_verify's
server time per execution over those answers (Triton's statistics), with their means.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


NICENESS = (0, 19)


def _ask(url: str, model: str, prompt: str, max_tokens: int, nice: int, answers: int) -> list[float]:
    """tokens/s of ``answers`` answers from one client process at niceness ``nice``."""
    code = ("import json, sys\n"
            "from trtllm_dflash.client.grpc import DFlashClient, GenerateParams\n"
            f"with DFlashClient({url!r}) as c:\n"
            f"    for _ in range({answers}):\n"
            f"        print(c.generate({model!r}, GenerateParams({prompt!r}, {max_tokens})).tokens_per_second)\n")
    root = str(Path(__file__).resolve().parents[1])
    r = subprocess.run(["nice", "-n", str(nice), sys.executable, "-c", code], capture_output=True, text=True,
                       check=True, stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": root})
    return [float(x) for x in r.stdout.split()]


def main(argv=None) -> int:
    from trtllm_dflash.perf.record import emit_json
    from trtllm_dflash.commands.demo import DEFAULT_PROMPT

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="dflash", choices=("dflash", "baseline"))
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4, help="client processes per niceness, in turns")
    p.add_argument("--answers", type=int, default=3, help="answers per client process")
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from bench_serving import server_times

    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    if args.target is None or args.drafter is None:
        from trtllm_dflash.assets import prepare_demo_assets

        assets = prepare_demo_assets()
        args.target, args.drafter = args.target or assets["target"], args.drafter or assets["drafter"]
    per = {n: {"tokens_per_second": [], "verify_ms": []} for n in NICENESS}
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(args.target, args.drafter, block_size="auto", max_seq_len=2048, max_sequences=4,
                                    ngram=True), Path(tmp) / "repo")
        with TritonServer(repo, log_path=Path(tmp) / "server.log") as server:
            _ask(server.grpc_url, args.model, "warm up", 16, 0, 1)
            for _ in range(args.rounds):
                for nice in NICENESS:
                    before = server_times(server.grpc_url)["target_verify"]
                    per[nice]["tokens_per_second"] += _ask(server.grpc_url, args.model, args.prompt,
                                                           args.max_tokens, nice, args.answers)
                    after = server_times(server.grpc_url)["target_verify"]
                    n = after["executions"] - before["executions"]
                    per[nice]["verify_ms"].append(round((after["compute_infer"] - before["compute_infer"]) / n, 2))
    for v in per.values():
        v["mean_tokens_per_second"] = round(statistics.mean(v["tokens_per_second"]), 2)
        v["mean_verify_ms"] = round(statistics.mean(v["verify_ms"]), 2)
    out = {"model": args.model, "max_tokens": args.max_tokens, "rounds": args.rounds, "answers": args.answers,
           "client_niceness": {str(n): v for n, v in per.items()}}
    out["nice19_over_nice0"] = round(out["client_niceness"]["19"]["mean_tokens_per_second"]
                                     / out["client_niceness"]["0"]["mean_tokens_per_second"], 3)
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
