#!/usr/bin/env python3
"""Two checkouts' Triton servers side by side, compared call by call: the served before/after of a change.

    git worktree add --detach ../before ede48fc
    python perf/paired_served.py --base ../before --dataset humaneval --prompts 32 --max-tokens 64 \\
        --concurrency 1,8 --rounds 3 --repo-args "--block-size 16 --no-ngram" --head-repo-args "--draft-vocab full"

Each side renders its repository with its own ``trtllm-dflash make-repo`` and runs it with its own ``trtllm-dflash
serve`` (each process, the server's Python stubs included, imports that checkout's package). Both servers stay up
while the client alternates between them: a call is one prompt at concurrency 1, or C prompts sent at once over C
gRPC connections at concurrency C, and every call runs on both sides back to back, the order flipping from call to
call and round to round. So each pair is the same work a few seconds apart, and a shared machine's drift over
minutes (tens of percent on a small VM) cancels in the pair's ratio, where whole-run comparisons (``paired.py``)
resolve nothing smaller than that drift. The first call of every (model, concurrency) warms both sides and is not
counted. Only one side works at a time; the idle server's stubs wait without spinning.

Prints one JSON line per (model, concurrency): both sides' tokens/s over all counted calls, the per-call speed
ratios head / base (same tokens on both sides: the inverse ratio of their times), their geometric mean with its
95 % t interval, and whether both sides answered every call with the same tokens. ``--out`` writes every call's
record (JSON lines, atomically).
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SIDES = ("base", "head")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", required=True, help="checkout of the commit before (e.g. a git worktree)")
    p.add_argument("--head", default=str(HERE), help="checkout of the commit after (default: this one)")
    p.add_argument("--dataset", default="humaneval")
    p.add_argument("--prompts", type=int, default=16, help="prompts per round")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,8", help="comma list; a call at C sends C prompts at once")
    p.add_argument("--models", default="dflash,baseline", help="served ensembles to compare (comma list)")
    p.add_argument("--rounds", type=int, default=2, help="passes over the prompts (default 2)")
    p.add_argument("--target", default=None, help="target directory (default: the demo target)")
    p.add_argument("--drafter", default=None, help="drafter directory (default: the demo drafter)")
    p.add_argument("--repo-args", default="",
                   help="make-repo flags for both sides, e.g. '--block-size 16 --no-ngram' (one flag alone: "
                        "--repo-args=--no-ngram, or argparse takes it for an option of this script)")
    p.add_argument("--base-repo-args", default="", help="make-repo flags for the base side only")
    p.add_argument("--head-repo-args", default="", help="make-repo flags for the head side only")
    p.add_argument("--out", default=None, help="also write every call's record here (JSON lines)")
    args = p.parse_args(argv)
    for side in SIDES:
        if not (Path(getattr(args, side)) / "trtllm_dflash" / "cli.py").is_file():
            p.error(f"--{side} {getattr(args, side)!r}: not a checkout of this repository (no trtllm_dflash/cli.py)")
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        p.error(f"--concurrency {args.concurrency!r}: a comma list of positive integers, e.g. 1,8")
    if min(args.concurrency) < 1:
        p.error(f"--concurrency {args.concurrency}: every value must be >= 1")
    if args.prompts < max(args.concurrency):
        p.error(f"--prompts {args.prompts}: must be at least the largest --concurrency ({max(args.concurrency)})")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: must be >= 1")
    args.models = [m for m in args.models.split(",") if m]
    if not args.models or not set(args.models) <= {"dflash", "baseline"}:
        p.error(f"--models {','.join(args.models)!r}: a comma list of dflash and/or baseline")
    return args


def start_server(stack: ExitStack, checkout: str, repo_args: list[str], tmp: Path):
    """Render ``checkout``'s repository with its own make-repo and start its own ``serve`` on free ports (its shutdown
    registered on ``stack``); returns a function that waits until the server is ready and gives its gRPC address, so
    that both sides' servers load their models at the same time."""
    from _lib.pairing import checkout_env

    env, repo, log = checkout_env(checkout), tmp / "repo", tmp / "server.log"
    cli = [sys.executable, "-m", "trtllm_dflash"]
    made = subprocess.run([*cli, "make-repo", "--out", str(repo), *repo_args], cwd=checkout, env=env,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"paired_served: make-repo in {checkout} exited {made.returncode}:\n{made.stderr[-3000:]}")
    proc = subprocess.Popen([*cli, "serve", "--repo", str(repo), "--http-port", "0", "--grpc-port", "0",
                             "--metrics-port", "0", "--log", str(log)],
                            cwd=checkout, env=env, stdout=subprocess.PIPE, text=True)
    stack.callback(stop_server, proc)

    def ready() -> str:
        line = proc.stdout.readline()  # serve prints its addresses once every model is ready
        if not line.startswith("{"):
            tail = log.read_text()[-3000:] if log.exists() else ""
            raise SystemExit(f"paired_served: the server of {checkout} did not start (exit {proc.poll()}):\n{tail}")
        return json.loads(line)["grpc"]

    return ready


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()  # serve stops its server on SIGTERM
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def timed_call(clients, model: str, prompts: list[str], max_tokens: int) -> tuple[list[list[int]], float]:
    """``prompts`` sent at once, one per client connection; their token ids and the seconds until the last ends."""
    from trtllm_dflash.client.grpc import GenerateParams

    out: list = [None] * len(prompts)

    def one(i: int) -> None:
        try:
            out[i] = list(clients[i].generate(model, GenerateParams(prompts[i], max_tokens)).token_ids)
        except Exception as e:  # noqa: BLE001 - re-raised below in the calling thread
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    for o in out:
        if isinstance(o, Exception):
            raise o
    return out, seconds


def paired_calls(clients, model: str, chunks: list[list[str]], rounds: int, max_tokens: int, bar) -> list[dict]:
    """Every chunk of every round on both sides back to back, the order flipping from call to call and round to round,
    after one warm-up call per side that is not counted; one record per call (each side's seconds and tokens, and
    whether their tokens were the same)."""
    for side in SIDES:
        timed_call(clients[side], model, chunks[0], max_tokens)
    out = []
    for r in range(rounds):
        for i, chunk in enumerate(chunks):
            got = {}
            for side in SIDES if (r + i) % 2 == 0 else SIDES[::-1]:
                got[side] = timed_call(clients[side], model, chunk, max_tokens)
                bar.update()
            out.append({"round": r, "call": i, **{f"{s}_seconds": got[s][1] for s in SIDES},
                        **{f"{s}_tokens": sum(map(len, got[s][0])) for s in SIDES},
                        "identical_tokens": got["base"][0] == got["head"][0]})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    from tqdm import tqdm

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.client.grpc import DFlashClient
    from trtllm_dflash.datasets import load_prompts
    from _lib.pairing import commit_of, ratio_summary
    from trtllm_dflash.staging import write_atomic

    target, drafter = pair_or_demo(args.target, args.drafter)
    texts = [p.text for p in load_prompts(args.dataset, args.prompts)]
    checkouts = {s: getattr(args, s) for s in SIDES}
    commits = {s: commit_of(c) for s, c in checkouts.items()}
    common = ["--target", str(target), "--drafter", str(drafter), "--no-trtllm-names",
              "--max-sequences", str(max(args.concurrency) + 2), *shlex.split(args.repo_args)]
    records, calls = [], []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
        waits = {}
        for side in SIDES:
            (Path(tmp) / side).mkdir()
            side_args = [*common, *shlex.split(getattr(args, f"{side}_repo_args"))]
            print(f"paired_served: starting the {side} server ({commits[side]})", file=sys.stderr, flush=True)
            waits[side] = start_server(stack, checkouts[side], side_args, Path(tmp) / side)
        urls = {side: wait() for side, wait in waits.items()}
        clients = {s: [stack.enter_context(DFlashClient(urls[s])) for _ in range(max(args.concurrency))]
                   for s in SIDES}
        chunks = {c: [texts[i:i + c] for i in range(0, len(texts) - c + 1, c)] for c in args.concurrency}
        total = sum(len(ch) for ch in chunks.values()) * args.rounds * len(args.models) * 2
        bar = tqdm(total=total, desc="paired calls", file=sys.stderr)
        for model in args.models:
            for c in args.concurrency:
                got = paired_calls(clients, model, chunks[c], args.rounds, args.max_tokens, bar)
                calls += [{"model": model, "concurrency": c, **call} for call in got]
                total_s = {s: sum(g[f"{s}_seconds"] for g in got) for s in SIDES}
                ratios = [(g["head_tokens"] / g["head_seconds"]) / (g["base_tokens"] / g["base_seconds"]) for g in got]
                records.append({"model": model, "concurrency": c, "dataset": args.dataset, "prompts": len(texts),
                                "max_tokens": args.max_tokens, "rounds": args.rounds,
                                **{f"{s}_tokens_per_second": round(sum(g[f"{s}_tokens"] for g in got) / total_s[s], 3)
                                   for s in SIDES},
                                **ratio_summary(ratios), "identical_tokens": all(g["identical_tokens"] for g in got),
                                "base_commit": commits["base"], "head_commit": commits["head"],
                                "repo_args": args.repo_args, "base_repo_args": args.base_repo_args,
                                "head_repo_args": args.head_repo_args})
        bar.close()
    print("".join(json.dumps(r) + "\n" for r in records), end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        rounded = [{k: round(v, 4) if k.endswith("_seconds") else v for k, v in r.items()} for r in calls]
        write_atomic(Path(args.out), "".join(json.dumps(r) + "\n" for r in rounded))
    return 0


if __name__ == "__main__":
    sys.exit(main())
