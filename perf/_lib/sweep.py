"""perf_analyzer sweeps over the served ``dflash`` / ``baseline`` ensembles; one ``PerfRecord`` line per point.

Per (block size, model, concurrency) point:
1. perf_analyzer ``-i grpc --streaming --concurrency-range C:C`` sends exactly ``requests`` requests
   (``--request-count``, ``--measurement-mode count_windows``: small CPU runs terminate) from an ``--input-data`` JSON
   of real prompts (chat template on), and writes ``--profile-export-file`` (per-request send and response times
   plus the response outputs).
2. Client metrics come from that export: tokens per response = growth of the cumulative ``output_ids`` output;
   TTFT, inter-token latency (response gap / tokens in the later response), request latency, tokens/s and
   requests/s over the span first send -> last response.
3. τ comes from the server's DFlash counters, read before and after the point (``metrics.LoopCounters``).

``serve=True`` renders a repository per block size from the demo assets and starts the server itself.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.hardware import cpu_model
from trtllm_dflash.perf.metrics import LoopCounters
from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.serve.settings import ModelSettings

from .record import PerfRecord, append_record

PROJECT = Path(__file__).resolve().parents[2]
BLS = {"dflash": "dflash", "baseline": "baseline"}  # entry model -> the model labelling its loop counters (itself)


@dataclass
class SweepConfig:
    out: str
    repo_url: str = "127.0.0.1:8001"
    metrics_url: str = ""  # default: http://<repo_url host>:8002/metrics
    models: tuple[str, ...] = ("dflash", "baseline")
    dataset: str = "humaneval"
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16)
    block_sizes: tuple[int | str, ...] = ()  # --serve only; default make-repo's: "auto"
    ngram: bool | None = None  # --serve only; default make-repo's: prompt lookup on (block sizes > 1)
    max_tokens: int = 128
    fixed_length: bool = False  # every answer exactly max_tokens long (min_tokens = max_tokens, as GenAI-Perf's
    # --output-tokens-mean-deterministic): the same work per request whatever the model would have said
    requests_per_point: int = 16  # raised to the concurrency when smaller
    num_prompts: int = 64  # prompts in the --input-data file (used round-robin)
    serve: bool = False
    max_seq_len: int = 2048  # --serve repository settings
    max_sequences: int = 32
    perf_analyzer: str = ""  # default: .cache/perf_analyzer/bin/perf_analyzer, else PATH
    timeout_s: float = 3600.0  # per point
    progress: bool = True
    extra: dict = field(default_factory=dict)  # recorded as-is in env (e.g. a label for the machine)

    def validate(self) -> None:
        def need(ok, flag, value, why):
            if not ok:
                raise ConfigError(flag, value, why)

        need(self.models and all(m in BLS for m in self.models), "--models", ",".join(self.models),
             f"must name some of {', '.join(BLS)}")
        need(self.concurrency and all(c >= 1 for c in self.concurrency), "--concurrency", self.concurrency,
             "must be integers >= 1")
        need(self.max_tokens >= 1, "--max-tokens", self.max_tokens, "must be >= 1")
        need(self.requests_per_point >= 1, "--requests-per-point", self.requests_per_point, "must be >= 1")
        need(self.serve or not self.block_sizes, "--block-sizes", self.block_sizes,
             "needs --serve (a running server has one block size)")


# ---- perf_analyzer -------------------------------------------------------------------------------------------------

def find_perf_analyzer(explicit: str = "") -> str:
    installed = PROJECT / ".cache" / "perf_analyzer" / "bin" / "perf_analyzer"
    for cand in (explicit, str(installed), shutil.which("perf_analyzer")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise ArtifactError("perf_analyzer", "not found", "run build_scripts/install_perf_analyzer.sh")


def perf_analyzer_version(exe: str) -> str:
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    text = (r.stdout + r.stderr).strip()
    if "Perf Analyzer Version" not in text:
        raise ArtifactError(exe, f"does not run: {text[-500:]}", "run build_scripts/install_perf_analyzer.sh")
    return text.splitlines()[-1]


def write_input_data(prompts, max_tokens: int, path: Path, fixed_length: bool = False) -> Path:
    """perf_analyzer's --input-data JSON: one object per request, used round-robin (trtllm_triton.md §5.3);
    ``fixed_length``: with min_tokens = max_tokens."""
    fixed = {"min_tokens": [max_tokens]} if fixed_length else {}
    data = [{"text_input": [p.text], "max_tokens": [max_tokens], "stream": [True], "apply_chat_template": [p.chat],
             **fixed} for p in prompts]
    path.write_text(json.dumps({"data": data}))
    return path


def pa_command(exe: str, model: str, url: str, input_data: Path, concurrency: int, requests: int,
               profile: Path) -> list[str]:
    return [exe, "-m", model, "-i", "grpc", "--streaming", "-u", url, "--input-data", str(input_data),
            "--shape", "text_input:1,1", "--concurrency-range", f"{concurrency}:{concurrency}",
            "--measurement-mode", "count_windows", "--measurement-request-count", str(requests),
            "--request-count", str(requests), "--max-trials", "1", "--profile-export-file", str(profile)]


def repo_relative(text: str) -> str:
    """Paths into this checkout made repository-relative (the repository root is two folders above this file)."""
    return text.replace(f"{Path(__file__).resolve().parents[2]}{os.sep}", "")


def portable(text: str) -> str:
    """What a sweep records (logs, records) with this checkout's paths repository-relative and the home directory as
    ~, so committed results name no machine's directories."""
    return repo_relative(text).replace(str(Path.home()), "~")


# ---- the profile export --------------------------------------------------------------------------------------------

def _as_list(v) -> list:
    """perf_analyzer writes a 1-element tensor as a scalar and an empty one as ''."""
    if v is None or v == "":
        return []
    return list(v) if isinstance(v, list) else [v]


def _pct(xs, q) -> float:
    return float(np.percentile(xs, q)) if len(xs) else math.nan


def summarize_profile(profile: dict) -> dict:
    """Client metrics of the single experiment in a perf_analyzer profile export (times in ns there, ms here)."""
    (exp,) = profile["experiments"]
    ttft, itl, latency, taus = [], [], [], []
    responses = tokens = 0
    first_send, last_recv = math.inf, -math.inf
    for req in exp["requests"]:
        t0, stamps, outs = req["timestamp"], req["response_timestamps"], req.get("response_outputs", [])
        if len(outs) != len(stamps):
            raise ValueError(f"request at {t0}: {len(stamps)} response times but {len(outs)} response outputs")
        seen, prev_t, got = 0, None, 0
        for t, out in zip(stamps, outs):
            ids = _as_list(out.get("output_ids"))
            taus += [int(x) for x in _as_list(out.get("acceptance_lengths"))]
            new = len(ids) - seen
            if new <= 0:
                continue  # an empty (final) response
            seen = len(ids)
            responses += 1
            got += new
            if prev_t is None:
                ttft.append((t - t0) / 1e6)
            else:
                itl.append((t - prev_t) / 1e6 / new)
            prev_t = t
        if not got:
            raise ValueError(f"request at {t0} produced no tokens (is output_ids missing from the export?)")
        tokens += got
        latency.append((stamps[-1] - t0) / 1e6)
        first_send, last_recv = min(first_send, t0), max(last_recv, stamps[-1])
    n = len(exp["requests"])
    duration = (last_recv - first_send) / 1e9 if n else math.nan
    return {
        "requests": n, "responses": responses, "output_tokens": tokens, "duration_s": duration,
        "output_tokens_per_s": tokens / duration if n else math.nan,
        "requests_per_s": n / duration if n else math.nan,
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "itl_ms_p50": _pct(itl, 50), "itl_ms_p99": _pct(itl, 99),
        "latency_ms_p50": _pct(latency, 50), "latency_ms_p99": _pct(latency, 99),
        "client_steps": len(taus), "client_tau_mean": float(np.mean(taus)) if taus else math.nan,
    }


# ---- provenance ----------------------------------------------------------------------------------------------------

def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=PROJECT, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=PROJECT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine() -> dict:
    cpu = cpu_model()
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"platform": platform.platform(), "cpu": cpu, "cpus": os.cpu_count(), "gpu": gpu or "none",
            "hostname": platform.node()}


def environment(pa_version: str, server_version: str, extra: dict) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg):
        try:
            return version(pkg)
        except PackageNotFoundError:
            return None

    return {"perf_analyzer": pa_version, "triton_server": server_version, "tritonclient": ver("tritonclient"),
            "torch": ver("torch"), "trtllm_dflash": ver("trtllm-dflash"), "python": platform.python_version(),
            "git_commit": git_commit(), "machine": machine(), **extra}


def file_digest(path: str | Path) -> str:
    """sha256 (first 16 hex digits) of a drafter's weights, so a record names the exact drafter; '' if not local."""
    import hashlib

    f = Path(path) / "model.safetensors"
    if not f.is_file():
        return ""
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def server_info(url: str) -> dict:
    """Server version and the repository's block size / drafter directory, from the served model configs."""
    import tritonclient.grpc as grpcclient

    c = grpcclient.InferenceServerClient(url)
    meta = c.get_server_metadata(as_json=True)

    def params(model) -> ModelSettings:
        cfg = c.get_model_config(model, as_json=True)["config"]
        return ModelSettings.from_parameters({k: v.get("string_value", "") for k, v in cfg.get("parameters", {}).items()})

    bls, drafter = params("dflash_bls"), params("drafter")
    # bench_runtime's notation: "auto+ngram", "16+ngram", "16+tree" (runtime.mode.DecodeMode.label)
    mode = DecodeMode.from_flags(bls.block_size, bls.ngram and bls.block_size != 1, bls.tree)
    return {"server_version": meta.get("version", ""), "block_size": mode.label, "drafter_dir": drafter.drafter_dir}


# ---- the sweep -----------------------------------------------------------------------------------------------------

def run_point(cfg: SweepConfig, exe: str, url: str, metrics_url: str, model: str, concurrency: int,
              input_data: Path, out: Path, tag: str) -> dict:
    requests = max(cfg.requests_per_point, concurrency)
    profile = out / "profiles" / f"{tag}-{model}-c{concurrency}.json"
    profile.parent.mkdir(parents=True, exist_ok=True)
    cmd = pa_command(exe, model, url, input_data, concurrency, requests, profile)
    before = LoopCounters.read(metrics_url, BLS[model])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.timeout_s)
    after = LoopCounters.read(metrics_url, BLS[model])
    (profile.with_suffix(".log")).write_text(portable(" ".join(cmd) + "\n\n" + r.stdout + r.stderr))
    if r.returncode != 0 or not profile.is_file():
        raise RuntimeError(f"perf_analyzer failed (exit {r.returncode}) for {model} c={concurrency}:\n"
                           f"{(r.stdout + r.stderr)[-3000:]}")
    stats = summarize_profile(json.loads(profile.read_text()))
    d = after - before
    if d.requests != stats["requests"] or d.steps != stats["client_steps"]:
        warnings.warn(f"{model} c={concurrency}: the server counted {d.requests} requests / {d.steps} steps but "
                      f"perf_analyzer saw {stats['requests']} / {stats['client_steps']}: other clients are using the "
                      "server, so tau for this point is mixed with theirs")
    return {**stats, "draft_tokens": d.draft_tokens, "accepted_draft_tokens": d.accepted_draft_tokens,
            "steps": d.steps, "server_requests": d.requests, "tau_mean": d.mean_acceptance_length,
            "tau_hist": {str(t): n for t, n in d.by_tau.items()},
            "profile_export": str(profile.relative_to(out))}


def _sweep_server(cfg: SweepConfig, exe: str, pa_version: str, url: str, metrics_url: str, out: Path,
                  input_data: Path, tag: str, drafter_trained, bar, drafter_sha256: str = "") -> list[PerfRecord]:
    info = server_info(url)
    if not drafter_sha256 and info["drafter_dir"]:
        drafter_sha256 = file_digest(info["drafter_dir"])  # of a running server: hashed now, loaded earlier
    env = environment(pa_version, info["server_version"], {"drafter_sha256": drafter_sha256, **cfg.extra})
    records = []
    for model in cfg.models:
        for c in cfg.concurrency:
            if bar is not None:
                bar.set_description(f"{tag} {model} c={c}")
            point = run_point(cfg, exe, url, metrics_url, model, c, input_data, out, tag)
            rec = PerfRecord(model=model, dataset=cfg.dataset, block_size=info["block_size"], concurrency=c,
                             max_tokens=cfg.max_tokens, drafter_dir=portable(info["drafter_dir"]),
                             drafter_trained=drafter_trained, env=env,
                             timestamp=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), **point)
            append_record(out / "records.jsonl", rec)
            records.append(rec)
            if bar is not None:
                bar.update(1)
                bar.write(f"{tag} {model:8s} c={c:<3d} {rec.output_tokens_per_s:8.2f} tok/s  TTFT p50 "
                          f"{rec.ttft_ms_p50:9.1f} ms  ITL p50 {rec.itl_ms_p50:8.1f} ms  τ {rec.tau_mean:.2f}")
    return records


def run_sweep(cfg: SweepConfig) -> list[PerfRecord]:
    from trtllm_dflash.datasets import load_prompts

    cfg.validate()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    exe = find_perf_analyzer(cfg.perf_analyzer)
    pa_version = perf_analyzer_version(exe)
    prompts = load_prompts(cfg.dataset, limit=cfg.num_prompts)
    input_data = write_input_data(prompts, cfg.max_tokens, out / f"input_data-{Path(cfg.dataset).stem}.json",
                                  cfg.fixed_length)
    points = len(cfg.models) * len(cfg.concurrency) * max(1, len(cfg.block_sizes))
    bar = None
    if cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=points, unit="point", file=sys.stderr)
    try:
        if not cfg.serve:
            host = cfg.repo_url.rsplit(":", 1)[0]
            metrics_url = cfg.metrics_url or f"http://{host}:8002/metrics"
            return _sweep_server(cfg, exe, pa_version, cfg.repo_url, metrics_url, out, input_data, "served", None, bar)
        from trtllm_dflash.assets import prepare_demo_assets
        from trtllm_dflash.serve.triton.server import TritonServer

        assets = prepare_demo_assets()
        block_sizes = cfg.block_sizes or ("auto",)  # make-repo's default, not a fixed block 16
        records = []
        for b in block_sizes:
            repo = render_demo_repo(out / "repos" / f"b{b}", assets, b, cfg.ngram, max_seq_len=cfg.max_seq_len,
                                    max_sequences=cfg.max_sequences)
            if bar is not None:
                bar.set_description(f"b{b}: starting the server")
            digest = file_digest(assets["drafter"])  # before the server loads it
            log = out / f"server-b{b}.log"
            with TritonServer(repo, log_path=log) as server:
                records += _sweep_server(cfg, exe, pa_version, server.grpc_url, server.metrics_url, out, input_data,
                                         f"b{b}", assets["drafter_trained"], bar, digest)
            log.write_text(portable(log.read_text(errors="replace")))
        return records
    finally:
        if bar is not None:
            bar.close()


def render_demo_repo(out: Path, assets: dict, block_size: int | str = "auto", ngram: bool | None = None,
                     **settings) -> Path:
    """The demo pair's repository (``prepare_demo_assets()``) rendered into ``out`` as make-repo renders it by default:
    block size auto, prompt lookup on wherever it applies; ``settings``: other ``RepoConfig`` fields."""
    from trtllm_dflash.commands.common import resolve_ngram
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo

    return make_repo(RepoConfig(assets["target"], assets["drafter"], block_size=block_size,
                                ngram=resolve_ngram(ngram, block_size), **settings), out, force=True)


def _ints(s: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers") from None


def _blocks(s: str) -> tuple[int | str, ...]:
    from trtllm_dflash.commands.common import block_size_arg

    try:
        return tuple(block_size_arg(x) for x in s.split(",") if x.strip())
    except (ValueError, argparse.ArgumentTypeError):
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers or auto") from None


def parse_args(argv=None) -> SweepConfig:
    p = argparse.ArgumentParser(prog="perf/sweep.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--repo-url", default="127.0.0.1:8001", help="gRPC address of a running server (without --serve)")
    p.add_argument("--metrics-url", default="", help="default http://<host of --repo-url>:8002/metrics")
    p.add_argument("--models", default="dflash,baseline", type=lambda s: tuple(x for x in s.split(",") if x))
    p.add_argument("--dataset", default="humaneval", help="humaneval | mtbench | a JSONL file of {\"prompt\": ...}")
    p.add_argument("--concurrency", default="1,2,4,8,16", type=_ints)
    p.add_argument("--block-sizes", default="", type=_blocks,
                   help="with --serve: one server per block size (integers or auto; default auto, as make-repo)")
    p.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                   help="with --serve: prompt lookup in the dflash loop (default on, as make-repo)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--fixed-length", action="store_true",
                   help="every answer exactly --max-tokens long (min_tokens: the stop tokens held back until then)")
    p.add_argument("--requests-per-point", type=int, default=16, help="raised to the concurrency when smaller")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=2048, help="with --serve")
    p.add_argument("--max-sequences", type=int, default=32, help="with --serve")
    p.add_argument("--perf-analyzer", default="", help="default .cache/perf_analyzer/bin/perf_analyzer, else PATH")
    p.add_argument("--label", default="", help="free text recorded in every record's env (e.g. the machine)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", required=True, help="sweep directory; records are appended to OUT/records.jsonl")
    p.add_argument("--serve", action="store_true",
                   help="render the demo repository and start the server, once per block size")
    a = p.parse_args(argv)
    return SweepConfig(out=a.out, repo_url=a.repo_url, metrics_url=a.metrics_url, models=a.models, dataset=a.dataset,
                       concurrency=a.concurrency, block_sizes=a.block_sizes, ngram=a.ngram, max_tokens=a.max_tokens,
                       fixed_length=a.fixed_length,
                       requests_per_point=a.requests_per_point, num_prompts=a.num_prompts, serve=a.serve,
                       max_seq_len=a.max_seq_len, max_sequences=a.max_sequences, perf_analyzer=a.perf_analyzer,
                       progress=not a.no_progress, extra={**({"label": a.label} if a.label else {}),
                                                          **({"fixed_length": True} if a.fixed_length else {})})


def main(argv=None) -> int:
    cfg = parse_args(argv)
    records = run_sweep(cfg)
    print(f"{len(records)} records appended to {Path(cfg.out) / 'records.jsonl'}")
    return 0
