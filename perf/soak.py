#!/usr/bin/env python3
"""A bounded soak of a real Triton server: normal, cancelled and malformed requests mixed at a fixed concurrency.

    python perf/soak.py --concurrency 32 --duration-s 600 --out perf/results/soak/c32-600s.json

Starts its own server on a freshly rendered repository (demo assets unless --target/--drafter). --concurrency client
threads each loop until --duration-s is up, drawing per request: a normal greedy request (dflash or baseline) whose
tokens must equal the in-process runtime's, a request cancelled by its client after its first response, or a
malformed one that must be refused with an error naming its field. Then it checks: every normal response correct,
no request hung (each has --request-timeout-s), every refusal named its field, the ``dflash_active_sequences``
gauges and both step models' slots back to 0, the server's memory (tritonserver + stubs, RSS) after the run not more
than --max-rss-growth-pct above the RSS after warm-up, and, once the server is stopped, no python stub left. Writes
one JSON object (atomically) and exits 1 when a check failed.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

PROMPTS = ["What is the capital of Italy?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain recursion in one sentence.", "def add(a, b):", "Translate 'good morning' to French.",
           "What is 7 times 8?", "Name a famous physicist."]
# malformed requests: (GenerateParams changes, the field the error must name)
BAD = [({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 1.5}, "top_p"),
       ({"prompt": ""}, "text_input"), ({"end_id": -1}, "end_id"), ({"top_k": -3}, "top_k"),
       ({"prompt": "word " * 600}, "prompt tokens + max_tokens"), ({"temperature": float("nan")}, "temperature")]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=60.0)
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per normal request")
    p.add_argument("--cancel-fraction", type=float, default=0.2)
    p.add_argument("--bad-fraction", type=float, default=0.1)
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="a request silent this long is hung")
    p.add_argument("--max-rss-growth-pct", type=float, default=10.0)
    p.add_argument("--max-sequences", type=int, default=32)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--target", default=None)
    p.add_argument("--drafter", default=None)
    p.add_argument("--out", default=None, help="JSON file (default: stdout only)")
    args = p.parse_args(argv)
    from trtllm_dflash.errors import require

    require(args.concurrency >= 1, "--concurrency", args.concurrency, "must be >= 1")
    require(args.duration_s > 0, "--duration-s", args.duration_s, "must be > 0")
    require(0 <= args.cancel_fraction + args.bad_fraction <= 1, "--cancel-fraction + --bad-fraction",
            args.cancel_fraction + args.bad_fraction, "must be in [0, 1]")
    return args


def oracle(target_dir, drafter_dir, max_tokens) -> dict[str, list[int]]:
    """prompt -> the in-process runtime's greedy tokens (the same for dflash and baseline: both are lossless)."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    target, _ = load_pair(target_dir, drafter_dir)
    tok = load_tokenizer(target_dir)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    dec = SpeculativeDecoder(target, None, 1)
    reqs = [Request(tuple(encode_prompt(tok, p, True)), max_tokens, stop_token_ids=stops) for p in PROMPTS]
    return {p: list(r.token_ids) for p, r in zip(PROMPTS, dec.generate(reqs))}


def _cancelled_request(url, model, params, timeout_s) -> str:
    """Submit on its own stream, wait for the first response, cancel: 'cancelled', or 'hung' if nothing came."""
    import tritonclient.grpc as grpcclient

    from trtllm_dflash.client.grpc import build_inputs

    first = threading.Event()
    c = grpcclient.InferenceServerClient(url)
    c.start_stream(callback=lambda result, error: first.set())
    c.async_stream_infer(model, build_inputs(params), enable_empty_final_response=True)
    ok = first.wait(timeout_s)
    c.stop_stream(cancel_requests=True)
    c.close()
    return "cancelled" if ok else "hung"


def run_soak(server, expected: dict[str, list[int]], concurrency: int, duration_s: float, max_tokens: int,
             cancel_fraction: float = 0.2, bad_fraction: float = 0.1, request_timeout_s: float = 300.0,
             seed: int = 0) -> dict:
    """The mixed load against a running TritonServer, and the checks that need it running (not the stub leak)."""
    from dataclasses import replace

    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams, ServerError
    from trtllm_dflash.perf.health import rss_mib, stub_processes, wait_until_idle

    def server_rss() -> float:
        return rss_mib([server.proc.pid, *stub_processes(server.repo)])

    with DFlashClient(server.grpc_url) as warm:  # warm-up: every prompt once through both entry points
        for p in PROMPTS:
            for model in ("dflash", "baseline"):
                warm.generate(model, GenerateParams(p, max_tokens))
    rss_before = server_rss()
    stubs_before = sorted(stub_processes(server.repo).values())
    counts: Counter = Counter()
    failures: list[dict] = []
    tokens = [0]
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s

    def worker(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        with DFlashClient(server.grpc_url) as client:
            while time.monotonic() < deadline:
                model = rng.choice(("dflash", "baseline"))
                prompt = rng.choice(PROMPTS)
                params = GenerateParams(prompt, max_tokens)
                r = rng.random()
                try:
                    if r < cancel_fraction:
                        outcome = _cancelled_request(server.grpc_url, model, replace(params, max_tokens=200),
                                                     request_timeout_s)
                        kind = outcome
                    elif r < cancel_fraction + bad_fraction:
                        change, field = rng.choice(BAD)
                        try:
                            client.generate(model, replace(params, **change), timeout_s=request_timeout_s)
                            kind, detail = "bad_accepted", change
                        except ServerError as exc:
                            kind = "bad_refused" if field in str(exc) else "bad_unnamed"
                            detail = str(exc)
                    else:
                        done = client.generate(model, params, timeout_s=request_timeout_s)
                        kind = "correct" if done.token_ids == expected[prompt] else "wrong"
                        detail = {"prompt": prompt, "model": model, "got": done.token_ids}
                        with lock:
                            tokens[0] += len(done.token_ids)
                except Exception as exc:  # noqa: BLE001 - a timeout (queue.Empty) is a hung request
                    kind, detail = ("hung" if type(exc).__name__ == "Empty" else "error"), repr(exc)
                with lock:
                    counts[kind] += 1
                    if kind not in ("correct", "cancelled", "bad_refused"):
                        failures.append({"kind": kind, "detail": str(detail)[:300]})

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(duration_s + 2 * request_timeout_s)
    wall = time.monotonic() - t0
    idle_s = wait_until_idle(server.grpc_url, server.metrics_url, ("dflash", "baseline"), timeout_s=60)
    rss_after = server_rss()
    return {
        "concurrency": concurrency, "duration_s": duration_s, "wall_s": round(wall, 1), "max_tokens": max_tokens,
        "requests": dict(counts), "total_requests": sum(counts.values()),
        "normal_tokens_per_second": round(tokens[0] / wall, 2),
        "threads_still_running": sum(t.is_alive() for t in threads),
        "idle_after_s": None if idle_s is None else round(idle_s, 2),
        "rss_mib_after_warmup": round(rss_before, 1), "rss_mib_after_run": round(rss_after, 1),
        "rss_growth_pct": round(100 * (rss_after - rss_before) / rss_before, 2),
        "stubs_before": stubs_before, "stubs_after": sorted(stub_processes(server.repo).values()),
        "failures": failures[:20],
    }


def verdict(result: dict, max_rss_growth_pct: float) -> dict[str, bool]:
    req = result["requests"]
    return {
        "all_normal_correct": req.get("wrong", 0) == 0 and req.get("correct", 0) > 0,
        "no_hung_requests": req.get("hung", 0) == 0 and result["threads_still_running"] == 0,
        "no_errors": req.get("error", 0) == 0,
        "bad_requests_refused_naming_field": req.get("bad_accepted", 0) == 0 and req.get("bad_unnamed", 0) == 0,
        "active_sequences_back_to_0": result["idle_after_s"] is not None,
        "memory_not_growing": result["rss_growth_pct"] <= max_rss_growth_pct,
        "no_stub_lost_or_added": result["stubs_before"] == result["stubs_after"],
        **({"no_stub_left_after_stop": result["stubs_left_after_stop"] == 0}
           if "stubs_left_after_stop" in result else {}),
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import platform

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.perf.health import stub_processes
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    assets = prepare_demo_assets() if not (args.target and args.drafter) else {"target": args.target,
                                                                                  "drafter": args.drafter}
    expected = oracle(assets["target"], assets["drafter"], args.max_tokens)
    with tempfile.TemporaryDirectory(prefix="dflash-soak-") as tmp:
        repo = make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=args.block_size,
                                    max_seq_len=512, max_sequences=args.max_sequences,
                                    max_queue=4 * args.concurrency), Path(tmp) / "repo")
        server = TritonServer(repo, log_path=Path(tmp) / "server.log").start()
        try:
            result = run_soak(server, expected, args.concurrency, args.duration_s, args.max_tokens,
                              args.cancel_fraction, args.bad_fraction, args.request_timeout_s, args.seed)
        finally:
            server.stop()
        t0 = time.monotonic()
        while stub_processes(repo) and time.monotonic() - t0 < 5:
            time.sleep(0.1)
        result["stubs_left_after_stop"] = len(stub_processes(repo))
    result["checks"] = verdict(result, args.max_rss_growth_pct)
    result["ok"] = all(result["checks"].values())
    result["command"] = " ".join(["python", "perf/soak.py", *(argv if argv is not None else sys.argv[1:])])
    result["machine"] = {"cpus": __import__("os").cpu_count(), "platform": platform.platform(),
                         "note": "shared 2-core VM (other engineers' jobs running)"}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        from trtllm_dflash.models.weights import write_json

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(result, args.out)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
