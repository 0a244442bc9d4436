#!/usr/bin/env python3
"""CPU seconds per process of the Triton server's process group while one model serves c=1 requests.

    python perf/cpu_by_process.py baseline 6        # model, number of HumanEval prompts (48 tokens each)

Each row is a process of the server's group (the server and its python-backend stubs) with the CPU time it used
during the measured requests, busiest first; the busiest is the model doing the work (target_verify for baseline).
Session-3 run: perf/results/README.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import run_point  # noqa: E402


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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", help="dflash | baseline")
    p.add_argument("prompts", type=int, help="number of HumanEval prompts")
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.serve.render import RepoConfig, make_repo
    from trtllm_dflash.serve.server import TritonServer

    assets = prepare_demo_assets()
    texts = [q.text for q in load_prompts("humaneval", args.prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        repo = make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=16, max_seq_len=1024,
                                    max_sequences=4), Path(tmp) / "repo")
        with TritonServer(repo) as server:
            run_point(server.grpc_url, args.model, texts[:1], 4, 1)  # warm-up
            before, t0 = cpu_seconds(server.proc.pid), os.times()
            tps, wall = run_point(server.grpc_url, args.model, texts, 48, 1)
            after, t1 = cpu_seconds(server.proc.pid), os.times()
    client = t1.user + t1.system - t0.user - t0.system
    print(f"{args.model}: {tps:.2f} tok/s, wall {wall:.1f} s, client CPU {client:.1f} s")
    used = {pid: cpu - before.get(pid, ("", 0.0))[1] for pid, (_, cpu) in after.items()}
    for pid in sorted(used, key=used.get, reverse=True):
        print(f"  {used[pid]:7.1f} CPU-s  pid {pid}  {after[pid][0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
