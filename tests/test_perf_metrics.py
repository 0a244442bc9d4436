"""The Prometheus parser and the DFlash counters (fast), and the counters against the responses of a real server
(slow): after N known requests the proposed/accepted/step counters grow by exactly what the responses report."""

import math

import pytest

from trtllm_dflash.perf.metrics import LoopCounters, parse_prometheus

TEXT = """\
# HELP dflash_draft_tokens_total Draft tokens proposed to the target
# TYPE dflash_draft_tokens_total counter
dflash_draft_tokens_total{model="dflash_bls"} 406
dflash_draft_tokens_total{model="baseline_bls"} 0
dflash_accepted_draft_tokens_total{model="dflash_bls"} 2
dflash_steps_total{model="dflash_bls"} 58
dflash_requests_total{model="dflash_bls"} 4
dflash_acceptance_length_total{model="dflash_bls",tau="2"} 2
dflash_acceptance_length_total{model="dflash_bls",tau="1"} 56
dflash_acceptance_length_total{model="baseline_bls",tau="1"} 7
nv_gpu_utilization{gpu_uuid="GPU-x"} NaN
nv_inference_count{model="dflash_bls",version="1"} 4 1700000000000
odd{path="a \\"quoted\\" name"} 1e3
"""


def test_parse_prometheus_lines():
    s = parse_prometheus(TEXT)
    assert s[("dflash_steps_total", frozenset({("model", "dflash_bls")}))] == 58
    assert s[("nv_inference_count", frozenset({("model", "dflash_bls"), ("version", "1")}))] == 4  # timestamp ignored
    assert math.isnan(s[("nv_gpu_utilization", frozenset({("gpu_uuid", "GPU-x")}))])
    assert s[("odd", frozenset({("path", 'a "quoted" name')}))] == 1000.0
    with pytest.raises(ValueError, match="not a Prometheus sample"):
        parse_prometheus("this is not { a sample")


def test_counters_delta_and_tau():
    after = LoopCounters.from_samples(parse_prometheus(TEXT), "dflash_bls")
    assert (after.draft_tokens, after.accepted_draft_tokens, after.steps, after.requests) == (406, 2, 58, 4)
    assert after.by_tau == {1: 56, 2: 2}
    assert after.mean_acceptance_length == pytest.approx(60 / 58)
    before = LoopCounters(6, 0, 1, 0, {1: 1})
    d = after - before
    assert (d.draft_tokens, d.steps, d.by_tau) == (400, 57, {1: 55, 2: 2})
    assert sum(t * n for t, n in d.by_tau.items()) == d.accepted_draft_tokens + d.steps
    assert math.isnan(LoopCounters().mean_acceptance_length)
    assert LoopCounters.from_samples(parse_prometheus(TEXT), "baseline_bls").by_tau == {1: 7}


@pytest.mark.slow
def test_server_counters_equal_the_response_sums(smollm2, tmp_path):
    pytest.importorskip("tritonclient.grpc")
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.serve.render import RepoConfig, make_repo
    from trtllm_dflash.serve.server import TritonServer

    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=512,
                                max_sequences=20), tmp_path / "repo")
    prompts = [("Write a haiku about rain.", 12), ("def add(a, b):", 16), ("List three prime numbers.", 10)]
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        for model, bls in (("dflash", "dflash_bls"), ("baseline", "baseline_bls")):
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
