#!/usr/bin/env python3
"""CPU seconds per process of the Triton server's process group while one model serves c=1 requests.

    python perf/cpu_by_process.py baseline 6        # model, number of HumanEval prompts (48 tokens each)

Every python stub runs the server's bundled stub binary, so all rows are labelled "server"; the busiest row is
the model doing the work (target_verify for baseline). Session-3 run: perf/results/README.md.
"""
import os, sys, time, tempfile, json
from pathlib import Path
sys.path.insert(0, "perf")
from bench_serving import run_point
from trtllm_dflash.assets import prepare_demo_assets
from trtllm_dflash.datasets import load_prompts
from trtllm_dflash.serve.render import RepoConfig, make_repo
from trtllm_dflash.serve.server import TritonServer

def tree(pgid):
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit(): continue
        try:
            st = open(f"/proc/{p}/stat").read()
            fields = st[st.rindex(")") + 2:].split()
            if int(fields[2]) != pgid: continue
            cmd = open(f"/proc/{p}/cmdline").read().replace("\0", " ")
            name = "server" if "tritonserver" in cmd.split(" ")[0] else (cmd.split(" ")[1].split("/")[-2] if "stub" in cmd else cmd[:40])
            out[p] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            pass
    return out

a = prepare_demo_assets()
texts = [p.text for p in load_prompts("humaneval", int(sys.argv[2]))]
model = sys.argv[1]
with tempfile.TemporaryDirectory() as tmp:
    repo = make_repo(RepoConfig(a["target"], a["drafter"], block_size=16, max_seq_len=1024, max_sequences=4, **json.loads(sys.argv[3] if len(sys.argv) > 3 else "{}")), Path(tmp) / "repo")
    with TritonServer(repo) as s:
        run_point(s.grpc_url, model, texts[:1], 4, 1)
        before = tree(s.proc.pid); me0 = os.times()
        tps, wall = run_point(s.grpc_url, model, texts, 48, 1)
        after = tree(s.proc.pid); me1 = os.times()
        print(f"{model}: {tps:.2f} tok/s wall {wall:.1f}s client cpu {me1.user + me1.system - me0.user - me0.system:.1f}s")
        for p, (n, t) in sorted(after.items(), key=lambda kv: -(kv[1][1] - before.get(kv[0], ("", 0))[1])):
            print(f"  {n:40s} {t - before.get(p, ('', 0))[1]:7.1f} s cpu")
