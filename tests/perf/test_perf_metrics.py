"""The Prometheus parser and the DFlash counters. (The counters against a real server's responses are checked in
test_perf_sweep.py, which shares one server with the smoke sweep.)"""

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
