"""GenAI-Perf, NVIDIA's LLM benchmark client, against the served ``dflash`` and ``baseline`` models: one JSON line per
(model, concurrency) from GenAI-Perf's own export, then dflash / baseline at each concurrency.

GenAI-Perf is not a dependency of this project (it pulls pandas, pyarrow, plotly, ...; NVIDIA's ``-py3-sdk``
containers ship it); give its executable with ``--genai-perf`` or put it on PATH, with a ``perf_analyzer`` on PATH too
(``build_scripts/install_perf_analyzer.sh``: ``.cache/perf_analyzer/bin``). It talks to the models as it talks to
TensorRT-LLM's ensemble (``--backend tensorrtllm --endpoint-type kserve``), with fixed output lengths
(``--output-tokens-mean-deterministic``: our ``min_length``), synthetic raw prompts and its own tokenizer count.

    PATH=.cache/perf_analyzer/bin:$PATH python perf/genai_perf.py --serve --genai-perf /path/to/genai-perf \\
        --concurrency 1,4 --input-tokens 128 --output-tokens 64 --requests 8 --out perf/results/genai-perf/run
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

from _lib.record import emit_json
from trtllm_dflash.models.weights import write_json

METRICS = {"output_token_throughput": "avg", "request_throughput": "avg", "time_to_first_token": "p50",
           "inter_token_latency": "p50", "request_latency": "p50", "output_sequence_length": "avg",
           "input_sequence_length": "avg"}


def command(exe: str, model: str, url: str, tokenizer: str, concurrency: int, args) -> list[str]:
    return [exe, "profile", "-m", model, "--endpoint-type", "kserve", "--backend", "tensorrtllm", "--streaming",
            "-u", url, "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", str(args.input_tokens),
            "--synthetic-input-tokens-stddev", "0", "--output-tokens-mean", str(args.output_tokens),
            "--output-tokens-mean-deterministic", "--concurrency", str(concurrency),
            "--num-prompts", str(args.requests), "--request-count", str(args.requests),
            "--warmup-request-count", "1", "--random-seed", "0",
            "--artifact-dir", str(Path(args.out) / f"{model}-c{concurrency}")]


def summarize(export: dict) -> dict:
    """The headline numbers of GenAI-Perf's ``profile_export_genai_perf.json`` (its units: tokens/s, requests/s,
    ms, tokens)."""
    return {f"{name}_{stat}": round(float(export[name][stat]), 3) for name, stat in METRICS.items() if name in export}


def ratios(records: list[dict]) -> list[dict]:
    """dflash / baseline output tokens/s at each concurrency both were measured at."""
    by = {(r["model"], r["concurrency"]): r for r in records}
    return [{"concurrency": c, "dflash_over_baseline": round(by["dflash", c]["output_token_throughput_avg"]
                                                            / by["baseline", c]["output_token_throughput_avg"], 3)}
            for (m, c) in by if m == "dflash" and ("baseline", c) in by]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="127.0.0.1:8001", help="a running server's gRPC address (default %(default)s)")
    p.add_argument("--serve", action="store_true", help="render the demo repository and serve it for the run")
    p.add_argument("--genai-perf", default="", help="the genai-perf executable (default: the one on PATH)")
    p.add_argument("--tokenizer", default="", help="the target's directory (default: the demo target)")
    p.add_argument("--models", default="dflash,baseline")
    p.add_argument("--concurrency", default="1", help="comma-separated (default %(default)s)")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=8, help="measured requests per point (default %(default)s)")
    p.add_argument("--out", required=True, help="GenAI-Perf's artifact directories and summary.json go here")
    p.add_argument("--dry-run", action="store_true", help="print the genai-perf commands, run nothing")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    exe = args.genai_perf or shutil.which("genai-perf") or ""
    if not exe and not args.dry_run:
        print("error: --genai-perf: no genai-perf executable found; install it (pip install genai-perf==0.0.16, in "
              "an environment of its own) or run inside NVIDIA's -py3-sdk container", file=sys.stderr)
        return 2
    if not args.dry_run and not shutil.which("perf_analyzer"):
        print("error: perf_analyzer is not on PATH (GenAI-Perf runs it); bash build_scripts/install_perf_analyzer.sh, "
              "then PATH=$PWD/.cache/perf_analyzer/bin:$PATH", file=sys.stderr)
        return 2
    tokenizer = args.tokenizer
    server = nullcontext(None)
    if args.serve or not tokenizer:
        from trtllm_dflash.assets import prepare_demo_assets

        assets = prepare_demo_assets()
        tokenizer = tokenizer or assets["target"]
        if args.serve and not args.dry_run:
            from _lib.sweep import render_demo_repo
            from trtllm_dflash.serve.triton.server import TritonServer

            server = TritonServer(render_demo_repo(Path(args.out) / "repo", assets),
                                  log_path=Path(args.out) / "server.log")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    records = []
    with server as s:
        url = s.grpc_url if s is not None else args.url
        for c in (int(x) for x in args.concurrency.split(",")):
            for model in args.models.split(","):
                cmd = command(exe or "genai-perf", model, url, tokenizer, c, args)
                if args.dry_run:
                    print(" ".join(cmd))
                    continue
                done = subprocess.run(cmd, stdout=subprocess.DEVNULL)
                if done.returncode != 0:  # e.g. a model without an input GenAI-Perf sends: perf_analyzer says which
                    print(f"error: genai-perf exited {done.returncode} on {model} at concurrency {c} (its messages "
                          "are above)", file=sys.stderr)
                    return 1
                (export,) = (Path(args.out) / f"{model}-c{c}").rglob("profile_export_genai_perf.json")
                rec = {"model": model, "concurrency": c, **summarize(json.loads(export.read_text()))}
                records.append(rec)
                emit_json(rec)
    if records:
        summary = records + ratios(records)
        for r in summary[len(records):]:
            emit_json(r)
        write_json(summary, Path(args.out) / "summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
