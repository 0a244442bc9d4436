"""The native step (``decode_step.cpp`` through ``compiled.NativeDecode``): the eager forward's outputs within float32
rounding on the tiny Llama and Qwen3 shapes and on the real model, rows of a batch bit for bit the rows stepped alone,
a verify step's tokens bit for bit the tokens decoded one at a time, chosen by measurement at first use, and
lossless decoding on the real model."""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import eager_reference
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.models import compiled, native, products
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder

pytestmark = pytest.mark.skipif(native.isa_flags() is None, reason="the CPU has no AVX2 with FMA")


def _filled(target: TargetModel, rows: int, lengths: list[int], seed: int = 0):
    """A cache of ``rows`` rows holding ``lengths`` committed tokens of a random prompt (eager prefill), room for 16
    more."""
    cache = target.new_cache(rows, max(lengths) + 16)
    ids = torch.randint(0, target.spec.vocab_size, (rows, max(lengths)), generator=torch.Generator().manual_seed(seed))
    if max(lengths):
        with torch.inference_mode(), compiled.forcing("off"):
            target(ids, cache)
    cache.commit(None, torch.tensor(lengths))
    return cache


def _step(target, setting, lengths, rows, ids, taps, form=None):
    """One decode step of ``ids`` at cache rows ``rows`` -> (hidden, taps, the cache)."""
    cache = _filled(target, len(lengths), lengths, seed=1)
    with torch.inference_mode(), compiled.forcing(setting, form):
        hidden, tapped = target(ids, cache, rows, tap_layers=taps)
    return hidden, tapped, cache


def _close(got, want, target):
    """Within what float32 rounding over the model's depth and widest reduction allows (not a machine's margin)."""
    s = target.spec
    tol = torch.finfo(torch.float32).eps * s.num_hidden_layers * max(s.hidden_size, s.intermediate_size) ** 0.5
    torch.testing.assert_close(got, want, atol=tol * 64, rtol=tol * 16)


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def tiny32(request, tiny_dirs):
    """A tiny random target in float32 (the Qwen3 one has per-head q/k norms)."""
    return TargetModel.from_pretrained(tiny_dirs[request.param][0], dtype=torch.float32)


@pytest.mark.parametrize("rows, lengths", [([0], [9]), ([0, 1, 2], [9, 3, 12]), ([2, 0], [5, 1, 7]), ([1], [0, 0])])
def test_the_native_step_is_the_eager_step(tiny32, rows, lengths):
    """Hidden states, taps and the K/V written at each row's next slot agree with the eager forward, for any cache
    rows (not only one run of them) and any cached length, an empty row included."""
    target = tiny32
    ids = torch.arange(len(rows))[:, None] + 5
    sel = torch.tensor(rows)
    taps = (0, target.spec.num_hidden_layers - 1)
    h0, t0, c0 = _step(target, "off", lengths, sel, ids, taps)
    h1, t1, c1 = _step(target, "on", lengths, sel, ids, taps, compiled.NATIVE)
    with compiled.forcing("on", compiled.NATIVE):
        assert target.decode_engine().steps  # it did run natively
    for got, want in ((h1, h0), (t1, t0), (c1.k, c0.k), (c1.v, c0.v)):
        _close(got, want, target)
    assert torch.equal(c1.lengths, c0.lengths)  # a step writes, it does not commit


def test_a_row_of_a_batch_step_is_the_row_stepped_alone(tiny32):
    """Every sum runs in a fixed order whatever the row count: a batch step's rows are bit for bit each row alone."""
    target = tiny32
    lengths = [9, 3, 12, 6]
    ids = torch.tensor([[5], [7], [9], [11]])
    hb, tb, cb = _step(target, "on", lengths, torch.arange(4), ids, (1,), compiled.NATIVE)
    for r in range(4):
        h, t, c = _step(target, "on", lengths, torch.tensor([r]), ids[r:r + 1], (1,), compiled.NATIVE)
        assert torch.equal(h[0], hb[r]) and torch.equal(t[0], tb[r])
        assert torch.equal(c.k[:, r], cb.k[:, r]) and torch.equal(c.v[:, r], cb.v[:, r])


def test_a_verify_steps_tokens_are_the_tokens_decoded_one_at_a_time(tiny32):
    """A forward of several tokens per row through the native engine gives, bit for bit, the hidden states, taps and
    K/V of decoding the same tokens one at a time through it: verify and autoregressive decoding round alike."""
    target = tiny32
    lengths, s = [9, 4], 5
    ids = torch.arange(2 * s).view(2, s) + 3
    cache = _filled(target, 2, lengths, seed=2)
    stepped = _filled(target, 2, lengths, seed=2)
    with torch.inference_mode(), compiled.forcing("on", compiled.NATIVE):
        hidden, taps = target(ids, cache, tap_layers=(0, 2))
        for i in range(s):
            h, t = target(ids[:, i:i + 1], stepped, tap_layers=(0, 2))
            assert torch.equal(h[:, 0], hidden[:, i]) and torch.equal(t[:, 0], taps[:, i])
            stepped.commit(None, torch.ones(2, dtype=torch.long))
    assert torch.equal(cache.k, stepped.k) and torch.equal(cache.v, stepped.v)


def test_a_ragged_verify_step_computes_only_each_rows_tokens(tiny32):
    """With ``widths`` each row's real tokens go through the native engine, as the eager forward computes them, and
    the padding's hidden states and taps are zero."""
    target = tiny32
    lengths, widths = [6, 9, 3], torch.tensor([4, 1, 0])
    ids = torch.arange(12).view(3, 4) + 5
    outs = []
    for setting in ("off", "on"):
        cache = _filled(target, 3, lengths, seed=3)
        with torch.inference_mode(), compiled.forcing(setting, compiled.NATIVE):
            hidden, taps = target(ids, cache, tap_layers=(1,), widths=widths)
        outs.append((hidden, taps))
    keep = torch.arange(4)[None, :] < widths[:, None]
    for got, want in zip(outs[1], outs[0]):
        _close(got[keep], want[keep], target)
        assert not got[~keep].any()


def test_auto_measures_the_native_step_against_the_eager_one_once(tiny32, monkeypatch, tmp_path):
    """With nothing recorded by ``tune --compile``, the first decode step of a row bucket times the native step and
    the eager one and keeps the faster in the machine's table; the next step reads it."""
    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    target = tiny32
    timed = []
    real = TargetModel._time_native
    monkeypatch.setattr(TargetModel, "_time_native",
                        lambda self, tokens, verify=False: timed.append(tokens) or real(self, tokens, verify))
    with compiled.forcing("auto"):
        engine = target.decode_engine(3)
        again = target.decode_engine(4)
    entry = target.native_entry(3)
    table = products.table()
    assert timed == [3] and set(table.timings[entry]) == {compiled.NATIVE, "eager"}
    assert table.choices[entry] == min(table.timings[entry], key=table.timings[entry].get)
    assert (engine is not None) == (table.choices[entry] == compiled.NATIVE) and again is engine
    with compiled.forcing("auto"):
        verifying = target.verify_engine(12)
    entry = target.native_entry(12, verify=True)
    assert timed == [3, 12] and set(table.timings[entry]) == {compiled.NATIVE, "eager"}
    assert (verifying is not None) == (table.choices[entry] == compiled.NATIVE)


@pytest.fixture(scope="module")
def real_pair(smollm2):
    return load_pair(smollm2["target"], smollm2["drafter"])


@pytest.mark.slow
def test_the_native_step_matches_the_eager_one_on_the_real_model(real_pair):
    """On the real model at a long context, a decode step and a 16-token verify step: hidden states, taps and K/V
    within float32 rounding, and every token's greedy successor the same."""
    target, drafter = real_pair
    lengths = [41, 7, 300]
    ids = torch.tensor([[11], [12], [13]])
    sel = torch.tensor([2, 0, 1])
    taps = drafter.spec.target_layer_ids
    h0, t0, c0 = _step(target, "off", lengths, sel, ids, taps)
    h1, t1, c1 = _step(target, "on", lengths, sel, ids, taps, compiled.NATIVE)
    for got, want in ((h1, h0), (t1, t0), (c1.k, c0.k), (c1.v, c0.v)):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert torch.equal(target.logits(h1).argmax(-1), target.logits(h0).argmax(-1))
    verify_ids = torch.arange(48).view(3, 16) + 100
    h0, t0, c0 = _step(target, "off", lengths, sel, verify_ids, taps)
    h1, t1, c1 = _step(target, "on", lengths, sel, verify_ids, taps, compiled.NATIVE)
    for got, want in ((h1, h0), (t1, t0), (c1.k, c0.k), (c1.v, c0.v)):
        torch.testing.assert_close(got, want, atol=2e-3, rtol=1e-3)
    assert torch.equal(target.logits(h1).argmax(-1), target.logits(h0).argmax(-1))


@pytest.mark.slow
def test_decoding_with_the_native_step_is_lossless_on_the_real_model(real_pair, smollm2):
    """Autoregressive decoding (one row and a batch of three) and fixed-block DFlash through the runtime, the native
    engine on (decode and verify steps), emit the tokens of eager autoregressive decoding."""
    target, drafter = real_pair
    prompts, want = eager_reference(target, smollm2["target"])
    with compiled.forcing("on", compiled.NATIVE):
        engine = target.decode_engine()
        for block_size, batch in ((1, prompts[:1]), (1, prompts), (16, prompts)):
            before = engine.steps
            got = SpeculativeDecoder(target, drafter if block_size > 1 else None, block_size).generate(
                [Request(tuple(p), 40) for p in batch])
            assert [g.token_ids for g in got] == want[:len(batch)], block_size
            if block_size == 1:
                assert engine.steps - before >= 39


_PROBE = """
import json, sys, torch
from pathlib import Path
from trtllm_dflash.models import native
isa, out = json.loads(sys.argv[1]), Path(sys.argv[2])
torch.ops.load_library(str(native.build(isa, out.with_suffix(".so"))))
g = torch.Generator().manual_seed(7)
h, d, heads, kv, inner, layers = 48, 32, 4, 2, 40, 2
r = lambda *shape: torch.randn(*shape, generator=g)
flat = []
for _ in range(layers):
    flat += [r(h), r(h), native.pack(r((heads + 2 * kv) * d, h)), r((heads + 2 * kv) * d), native.pack(r(h, heads * d)),
             r(d), r(d), native.pack(r(2 * inner, h)), native.pack(r(h, inner))]
ck, cv = r(layers, 3, 90, kv, d), r(layers, 3, 90, kv, d)
rows, at = torch.tensor([2, 2, 2, 0]), torch.tensor([70, 71, 72, 5])
outs = torch.ops.trtllm_dflash_cpu.decode_step(r(4, h), r(4, d), r(4, d), flat, ck, cv, rows, at, r(h), heads, kv, 1e-6)
torch.save((outs, ck, cv), out)
"""


@pytest.mark.skipif("-mavx512f" not in (native.isa_flags() or []), reason="needs a CPU with AVX-512 and AVX2")
def test_the_avx2_build_steps_with_the_avx512_builds_bits(tmp_path):
    """Two layers with biases and q/k norms, a verify run of three tokens beside a decode row, attention over more
    than one chunk: the AVX2 build gives the AVX-512 build's outputs and cache writes bit for bit."""
    results = []
    for name, isa in (("avx512", native.isa_flags()), ("avx2", ["-mavx2", "-mfma"])):
        out = tmp_path / f"{name}.pt"
        subprocess.run([sys.executable, "-c", _PROBE, json.dumps(isa), str(out)], check=True, timeout=300)
        results.append(torch.load(out))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_without_a_compiler_the_target_steps_eagerly(tmp_path, tiny_dirs):
    """No compiler (``CXX`` names none) on a fresh cache: the native engine is not offered, and a decode step under
    ``auto`` runs the eager forward."""
    code = ("import sys, torch\nfrom trtllm_dflash.models import compiled\n"
            "from trtllm_dflash.models.target import TargetModel\n"
            "assert compiled.NATIVE not in compiled.engines(), compiled.engines()\n"
            "t = TargetModel.from_pretrained(sys.argv[1])\ncache = t.new_cache(1, 8)\n"
            "with torch.inference_mode():\n"
            "    assert t.decode_engine() is None and t.verify_engine(4) is None\n"
            "    t(torch.tensor([[3]]), cache)\n")
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), TRTLLM_DFLASH_CACHE=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", code, str(tiny_dirs["llama"][0])], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
