#!/usr/bin/env python3
"""CPU seconds per process of the Triton server's process group while one model serves c=1 requests.

    python perf/cpu_by_process.py baseline 6                 # model, number of HumanEval prompts (48 tokens each)
    GOMP_SPINCOUNT=5000 python perf/cpu_by_process.py baseline 6 --in-process

Each row is a process of the server's group (the server and its python-backend stubs) with the CPU time and the
voluntary context switches (a thread going to sleep) it had during the measured requests, busiest first; the busiest
is the model doing the work (target_verify for baseline). ``--in-process`` runs the same requests in this process
instead (no server), for the same two numbers. Runs: perf/results/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from bench_serving import in_process_decoders, run_point


def cpu_seconds(pgid: int) -> dict[int, tuple[str, float]]:
    """pid -> (model or program name, user + system CPU seconds) for every live process of process group ``pgid``."""
    out = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            if int(fields[2]) == pgid:
                args = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
                # a stub's first argument is its model's path inside the repository; the server is "tritonserver"
                label = next((a.split("/repo/", 1)[1] for a in args if "/repo/" in a), Path(args[0]).name)
                out[int(pid)] = (label, (int(fields[11]) + int(fields[12])) / tick)
        except (OSError, ValueError, IndexError):
            pass  # the process ended while we looked
    return out


def sleeps(pid: int | str) -> int:
    """Voluntary context switches over all threads of process ``pid`` so far."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        for line in Path(f"/proc/{pid}/task/{task}/status").read_text().splitlines():
            if line.startswith("voluntary_ctxt_switches:"):
                total += int(line.split()[1])
    return total


def in_process(model: str, texts: list[str], target: str, drafter: str) -> int:
    """The same c=1 requests through the in-process decoder: tokens/s, CPU seconds and sleeps of this process."""
    from trtllm_dflash.runtime.decoder import Request

    decoders, encode = in_process_decoders(target, drafter, 16)

    def run(text, n):
        return decoders[model].generate([Request(*encode(text, n))])[0]

    run(texts[0], 4)  # warm-up
    c0, s0, w0 = os.times(), sleeps("self"), time.perf_counter()
    n = sum(run(text, 48).num_new_tokens for text in texts)
    c1, s1, wall = os.times(), sleeps("self"), time.perf_counter() - w0
    print(f"{model} in-process: {n / wall:.2f} tok/s, wall {wall:.1f} s, "
          f"{c1.user + c1.system - c0.user - c0.system:.1f} CPU-s, {s1 - s0} sleeps")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="dflash | baseline")
    p.add_argument("prompts", type=int, help="number of HumanEval prompts")
    p.add_argument("--in-process", action="store_true", help="run the requests in this process, not through Triton")
    args = p.parse_args(argv)
    if args.model not in ("dflash", "baseline"):
        p.error(f"model {args.model!r}: dflash or baseline")
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    assets = prepare_demo_assets()
    texts = [q.text for q in load_prompts("humaneval", args.prompts)]
    if args.in_process:
        return in_process(args.model, texts, assets["target"], assets["drafter"])
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=16, max_seq_len=1024,
                                    max_sequences=4), Path(tmp) / "repo")
        with TritonServer(repo) as server:
            run_point(server.grpc_url, args.model, texts[:1], 4, 1)  # warm-up
            before, t0 = cpu_seconds(server.proc.pid), os.times()
            slept = {pid: sleeps(pid) for pid in before}
            tps, wall = run_point(server.grpc_url, args.model, texts, 48, 1)
            after, t1 = cpu_seconds(server.proc.pid), os.times()
            slept = {pid: sleeps(pid) - n for pid, n in slept.items()}
    client = t1.user + t1.system - t0.user - t0.system
    print(f"{args.model}: {tps:.2f} tok/s, wall {wall:.1f} s, client CPU {client:.1f} s")
    used = {pid: cpu - before.get(pid, ("", 0.0))[1] for pid, (_, cpu) in after.items()}
    for pid in sorted(used, key=used.get, reverse=True):
        print(f"  {used[pid]:7.1f} CPU-s  {slept.get(pid, 0):6d} sleeps  pid {pid}  {after[pid][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
