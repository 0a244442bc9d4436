"""perf_analyzer sweeps. Fast: the profile-export summary on a hand-built export, the --input-data file, argument
checks. Slow, on one real server with the demo target (block size 8): the DFlash metric counters grow by exactly what
the responses of N known requests report; and a smoke sweep with the real perf_analyzer 2.60 (installed by
build_scripts/install_perf_analyzer.sh): two concurrency points, both ensembles, records complete and consistent."""

import json
import math
from pathlib import Path

import pytest

from _lib.record import PerfRecord, load_records
from _lib.sweep import SweepConfig, parse_args, summarize_profile, write_input_data
from conftest import install_perf_analyzer
from trtllm_dflash.datasets import Prompt
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.perf.metrics import LoopCounters

ROOT = Path(__file__).resolve().parents[2]
MS = 1_000_000  # ns


def _req(t0, times_ms, ids_lengths, taus):
    return {"timestamp": t0, "request_inputs": {"text_input": "x"},
            "response_timestamps": [t0 + t * MS for t in times_ms],
            "response_outputs": [{"output_ids": list(range(n)) if n != 1 else 0, "acceptance_lengths": a,
                                  "text_output": "t"} for n, a in zip(ids_lengths, taus)]}


def test_summarize_profile_counts_tokens_from_output_ids():
    t0 = 10 * 1000 * MS
    profile = {"experiments": [{"experiment": {"mode": "concurrency", "value": 2}, "requests": [
        # prefill token at 100 ms, then steps of tau 3 and 2; last response is an empty final one
        _req(t0, [100, 130, 150, 151], [1, 4, 6, 6], ["", 3, 2, ""]),
        _req(t0 + 50 * MS, [250, 260], [1, 2], ["", 1]),
    ]}]}
    s = summarize_profile(profile)
    assert (s["requests"], s["responses"], s["output_tokens"]) == (2, 5, 8)
    assert s["duration_s"] == pytest.approx(0.310)  # first send -> last response (50 + 260 ms)
    assert s["output_tokens_per_s"] == pytest.approx(8 / 0.310)
    assert s["ttft_ms_p50"] == pytest.approx(175.0)  # median of 100 and 250
    # ITL per response: 30/3, 20/2, 10/1
    assert s["itl_ms_p50"] == pytest.approx(10.0)
    assert s["latency_ms_p50"] == pytest.approx((151 + 260) / 2)
    assert (s["client_steps"], s["client_tau_mean"]) == (3, pytest.approx(2.0))


def test_summarize_profile_rejects_exports_without_tokens():
    profile = {"experiments": [{"requests": [{"timestamp": 0, "response_timestamps": [5], "response_outputs": [{}]}]}]}
    with pytest.raises(ValueError, match="no tokens"):
        summarize_profile(profile)


def test_input_data_json(tmp_path):
    path = write_input_data([Prompt("a", "hello", True), Prompt("b", "def f():", False)], 32, tmp_path / "in.json")
    data = json.loads(path.read_text())["data"]
    assert data[0] == {"text_input": ["hello"], "max_tokens": [32], "stream": [True], "apply_chat_template": [True]}
    assert data[1]["apply_chat_template"] == [False]
    fixed = json.loads(write_input_data([Prompt("a", "hi", True)], 8, tmp_path / "f.json", True).read_text())
    assert fixed["data"][0]["min_tokens"] == [8]


def test_arguments():
    cfg = parse_args(["--out", "x", "--concurrency", "1,4", "--models", "dflash", "--serve", "--block-sizes", "4,8"])
    assert (cfg.concurrency, cfg.models, cfg.block_sizes, cfg.serve) == ((1, 4), ("dflash",), (4, 8), True)
    assert cfg.ngram is None  # make-repo's default: prompt lookup on
    cfg = parse_args(["--out", "x", "--serve", "--block-sizes", "auto,16", "--no-ngram"])
    assert (cfg.block_sizes, cfg.ngram) == (("auto", 16), False)
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--block-sizes", "0"])
    with pytest.raises(ConfigError, match="--block-sizes"):
        SweepConfig(out="x", block_sizes=(4,)).validate()
    with pytest.raises(ConfigError, match="--models"):
        SweepConfig(out="x", models=("nope",)).validate()
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--concurrency", "1,a"])


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    pytest.importorskip("tritonclient.grpc")
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    root = tmp_path_factory.mktemp("perf")
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=512,
                                max_sequences=20, trtllm_names=False), root / "repo")
    with TritonServer(repo, log_path=root / "server.log") as s:
        yield s


@pytest.mark.slow
def test_server_counters_equal_the_response_sums(server):
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams

    prompts = [("Write a haiku about rain.", 12), ("def add(a, b):", 16), ("List three prime numbers.", 10)]
    for model, bls in (("dflash", "dflash"), ("baseline", "baseline")):  # the entry models count their loop
        before = LoopCounters.read(server.metrics_url, bls)
        draft = accepted = 0
        taus = []
        with DFlashClient(server.grpc_url) as client:
            for prompt, n in prompts:
                done = client.generate(model, GenerateParams(prompt, n))
                draft += sum(c.num_draft_tokens for c in done.chunks)
                accepted += sum(c.num_accepted_draft_tokens for c in done.chunks)
                taus += done.acceptance_lengths
        d = LoopCounters.read(server.metrics_url, bls) - before
        assert d.requests == len(prompts), model
        assert (d.draft_tokens, d.accepted_draft_tokens, d.steps) == (draft, accepted, len(taus)), model
        assert d.by_tau == {t: taus.count(t) for t in d.by_tau} and sum(d.by_tau.values()) == len(taus)
        assert all(1 <= t <= (8 if model == "dflash" else 1) for t in taus)
        if model == "baseline":
            assert draft == accepted == 0 and set(taus) == {1}


@pytest.mark.slow
def test_smoke_sweep_with_the_real_perf_analyzer(server, tmp_path):
    """The sweep against the running server (--serve, which starts its own, is what perf/results used)."""
    from _lib.sweep import main

    exe = install_perf_analyzer()
    out = tmp_path / "sweep"
    assert main(["--repo-url", server.grpc_url, "--metrics-url", server.metrics_url, "--models", "dflash,baseline",
                 "--dataset", "humaneval", "--concurrency", "1,2", "--max-tokens", "8", "--requests-per-point", "2",
                 "--num-prompts", "4", "--perf-analyzer", exe, "--no-progress", "--fixed-length",
                 "--out", str(out)]) == 0
    records = load_records(out / "records.jsonl")
    points = [(r.model, r.concurrency) for r in records]
    assert points == [("dflash", 1), ("dflash", 2), ("baseline", 1), ("baseline", 2)]
    for r in records:
        assert r.block_size == 8 and r.env["fixed_length"] is True
        check_record(r, out)
        assert r.output_tokens == r.requests * r.max_tokens  # --fixed-length: min_tokens = max_tokens
    assert records[0].env["perf_analyzer"].startswith("Perf Analyzer Version")
    assert records[0].env["triton_server"] and records[0].env["git_commit"] and records[0].env["drafter_sha256"]


def check_record(r: PerfRecord, out: Path) -> None:
    """Complete and self-consistent: the export's tokens, the responses and the server's counters agree."""
    assert r.requests == max(2, r.concurrency) and r.server_requests == r.requests
    assert r.output_tokens_per_s > 0 and r.requests_per_s > 0 and r.duration_s > 0
    assert r.output_tokens_per_s == pytest.approx(r.output_tokens / r.duration_s)
    for name in ("ttft_ms_p50", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "latency_ms_p50", "latency_ms_p99"):
        assert getattr(r, name) > 0 and not math.isnan(getattr(r, name)), name
    assert r.ttft_ms_p50 <= r.ttft_ms_p99 and r.itl_ms_p50 <= r.itl_ms_p99
    assert r.requests <= r.output_tokens <= r.requests * r.max_tokens
    # every streamed response is one verify step after the prefill token; a step emits tau tokens (a stop token
    # may end a step early, so tokens <= prefill tokens + sum of tau)
    assert r.responses == r.requests + r.steps == r.requests + r.client_steps
    assert r.output_tokens <= r.requests + r.steps * r.tau_mean + 1e-6
    assert r.tau_mean == pytest.approx(r.client_tau_mean)
    assert sum(r.tau_hist.values()) == r.steps
    assert sum(int(t) * n for t, n in r.tau_hist.items()) == r.accepted_draft_tokens + r.steps
    bound = r.block_size if r.model == "dflash" else 1
    assert 1 <= r.tau_mean <= bound
    assert all(n == 0 for t, n in r.tau_hist.items() if not 1 <= int(t) <= bound)
    if r.model == "baseline":
        assert r.draft_tokens == r.accepted_draft_tokens == 0
    else:
        assert r.draft_tokens == r.steps * (r.block_size - 1)
    assert (out / r.profile_export).is_file()


def test_recorded_paths_name_no_machines_directories():
    """Logs and records keep this checkout's paths repository-relative and the home directory as ~."""
    from _lib.sweep import PROJECT, portable

    assert portable(f"{PROJECT}/.cache/perf_analyzer/bin/perf_analyzer -m x {Path.home()}/.cache/t") == \
        ".cache/perf_analyzer/bin/perf_analyzer -m x ~/.cache/t"
