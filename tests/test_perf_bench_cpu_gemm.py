"""perf/bench_cpu_gemm.py on a tiny random pair: both parts timed both ways, one JSON document, bad options refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import make_tiny_pair

REPO = Path(__file__).resolve().parents[1]


def run(args):
    return subprocess.run([sys.executable, str(REPO / "perf" / "bench_cpu_gemm.py"), *args], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)})


def test_bench_cpu_gemm_times_both_ways(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=0, block_size=4)
    out = tmp_path / "res" / "gemm.json"
    r = run(["--target", str(tdir), "--drafter", str(ddir), "--threads", "1", "--rows", "1,3", "--repeats", "1",
             "--context", "8", "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(out.read_text())
    assert doc == json.loads(r.stdout) and doc["threads"] == 1
    assert {k.split(" rows=")[1] for k in doc["products"]} == {"1", "3"}
    assert any(k.startswith("lm_head ") for k in doc["products"])
    assert {"verify 1x1", "verify 16x4", "draft 1x4", "draft 16x16", "served draft 1x4",
            "served draft 16x4"} <= set(doc["forwards"])
    for v in [*doc["products"].values(), *doc["forwards"].values()]:
        assert v["linear_ms"] > 0 and v["weight_major_ms"] > 0 and v["ratio"] > 0


def test_bench_cpu_gemm_refuses_bad_options():
    r = run(["--parts", "products,gpu"])
    assert r.returncode == 2 and "--parts 'gpu'" in r.stderr
    r = run(["--rows", "1,x"])
    assert r.returncode == 2 and "--rows '1,x'" in r.stderr
