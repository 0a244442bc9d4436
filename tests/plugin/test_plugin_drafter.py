"""The plugin path reproduces the runtime's drafter: kv_inject + block_attention == DrafterModel.inject + draft.

Tiny random checkpoints are written by the project's own writers and loaded with ``load_pair``. Each scenario runs
ragged injections (rows commit different numbers of tokens, some 0) and then a draft, once through ``DrafterModel``
and once through ``plugin.dispatch`` with the torch references and with the Triton kernels (CPU interpreter).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import pytest  # noqa: E402
import torch  # noqa: E402

from trtllm_dflash.checkpoints import (  # noqa: E402
    drafter_spec_for, load_pair, random_drafter_state, write_drafter, write_tiny_target,
)
from trtllm_dflash.plugin import dispatch  # noqa: E402
from trtllm_dflash.plugin import kv_inject as KI  # noqa: E402
from trtllm_dflash.plugin import triton_kernels as TK  # noqa: E402
from trtllm_dflash.plugin.dispatch import Impl  # noqa: E402
from trtllm_dflash.plugin.ragged import RaggedBatch  # noqa: E402
from trtllm_dflash.specs import TargetSpec  # noqa: E402

# fp32 models: fused vs per-layer GEMMs and tiled attention change summation order only
TOL = dict(atol=1e-4, rtol=1e-4)

PAIRS = {
    # name: (target kwargs, drafter extra config)
    "qwen3-gqa2": (dict(family="qwen3", hidden_size=64, num_heads=4, num_kv_heads=2), None),
    "llama-gqa4": (dict(family="llama", hidden_size=128, num_heads=8, num_kv_heads=2), None),
    # a sliding (causal, window 5) layer followed by a full one, like the Qwen3.5/3.6 drafters
    "qwen3-swa": (dict(family="qwen3", hidden_size=64, num_heads=4, num_kv_heads=1),
                  {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5}),
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin-pairs")
    out = {}
    for name, (tkw, extra) in PAIRS.items():
        tdir, ddir = root / f"{name}-target", root / f"{name}-drafter"
        write_tiny_target(tdir, seed=3, vocab_size=128, num_layers=6, **tkw)
        spec = TargetSpec.load(tdir)
        dspec = drafter_spec_for(spec, num_layers=2, block_size=16, mask_token_id=5)
        write_drafter(ddir, dspec, spec, random_drafter_state(dspec, seed=4), dtype=torch.float32,
                      extra_config=extra)
        out[name] = load_pair(tdir, ddir, dtype=torch.float32)
    return out


def _committed(cache, layer_rows_lens):
    """Committed K/V entries only (the rest is scratch by the KVCache contract)."""
    return [(cache.k[:, r, :n].clone(), cache.v[:, r, :n].clone()) for r, n in layer_rows_lens]


def _scenario(target, drafter, block_size, impl):
    """Prefill 3 of 4 rows with ragged prompts, inject one ragged verify step, then draft rows [2, 0, 3]."""
    g = torch.Generator().manual_seed(11)
    spec = drafter.spec
    kh = spec.num_taps * spec.hidden_size
    cache = drafter.new_cache(num_rows=4, max_len=64)
    inject = drafter.inject if impl is None else (
        lambda taps, n, c, rows=None: dispatch.inject(drafter, weights, taps, n, c, rows, impl))
    draft = drafter.draft if impl is None else (lambda e, c, rows=None: dispatch.draft(drafter, e, c, rows, impl))
    weights = KI.InjectWeights.from_drafter(drafter)
    # prefill: real target taps of ragged prompts (row 1 empty)
    ids = torch.randint(6, target.spec.vocab_size, (4, 9), generator=g)
    tcache = target.new_cache(4, 64)
    _, taps = target(ids, tcache, tap_layers=spec.target_layer_ids)  # [4, 9, K·H]
    inject(taps, torch.tensor([9, 0, 4, 7]), cache)
    # a verify step on a subset of rows, committing 3, 0 and 1 tokens
    rows = torch.tensor([3, 1, 0])
    inject(torch.randn(3, 3, kh, generator=g), torch.tensor([3, 0, 1]), cache, rows)
    block = torch.full((3, block_size), spec.mask_token_id)
    block[:, 0] = torch.tensor([7, 8, 9])
    out = draft(target.embed(block), cache, torch.tensor([2, 0, 3]))  # row 1's context stays empty: not drafted
    lens = cache.lengths.tolist()
    return out, lens, _committed(cache, enumerate(lens))


@pytest.mark.parametrize("name,block_size", [(name, 16) for name in sorted(PAIRS)] + [("qwen3-gqa2", 1)])
def test_drafter_ops_match_drafter_model(pairs, name, block_size):
    target, drafter = pairs[name]
    ref_out, ref_lens, ref_kv = _scenario(target, drafter, block_size, impl=None)
    assert ref_lens == [10, 0, 4, 10]
    for impl in (Impl.TORCH, Impl.TRITON):
        out, lens, kv = _scenario(target, drafter, block_size, impl=impl)
        assert lens == ref_lens
        for (k, v), (rk, rv) in zip(kv, ref_kv):
            torch.testing.assert_close(k, rk, **TOL)
            torch.testing.assert_close(v, rv, **TOL)
        torch.testing.assert_close(out, ref_out, **TOL)


def test_draft_with_empty_context(pairs):
    """A row whose context is empty (never injected) drafts from the block alone, identically."""
    target, drafter = pairs["qwen3-gqa2"]
    block = torch.full((2, 16), drafter.spec.mask_token_id)
    block[:, 0] = torch.tensor([3, 4])
    ref = drafter.draft(target.embed(block), drafter.new_cache(2, 32))
    for impl in (Impl.TORCH, Impl.TRITON):
        out = dispatch.draft(drafter, target.embed(block), drafter.new_cache(2, 32), impl=impl)
        torch.testing.assert_close(out, ref, **TOL)


def test_flat_kv_inject_equals_context_kv(pairs):
    """The ragged op alone against the model's per-layer math, read back from the cache (rows out of order)."""
    _, drafter = pairs["llama-gqa4"]
    spec = drafter.spec
    g = torch.Generator().manual_seed(2)
    lens, starts, rows = [5, 0, 2], torch.tensor([3, 0, 11]), torch.tensor([2, 0, 1])
    batch = RaggedBatch.make_dummy(lens)
    taps = torch.randn(batch.num_tokens, spec.num_taps * spec.hidden_size, generator=g)
    w = KI.InjectWeights.from_drafter(drafter)
    for fn in (KI.kv_inject_reference, TK.kv_inject_triton):
        cache = drafter.new_cache(3, 32)
        fn(taps, batch, starts, rows, w, drafter.rotary.cos, drafter.rotary.sin, cache.k, cache.v)
        for i, (n, s, r) in enumerate(zip(lens, starts.tolist(), rows.tolist())):
            if n == 0:
                continue
            lo = int(batch.cu_seqlens[i])
            c = drafter.hidden_norm(drafter.fc(taps[lo: lo + n]))[None]  # [1, n, H]
            pos = torch.arange(s, s + n)[None]
            for li, layer in enumerate(drafter.layers):
                k, v = layer.self_attn.context_kv(c, drafter.rotary.at(pos))  # [1, n, n_kv, hd]
                torch.testing.assert_close(cache.k[li, r, s: s + n], k[0], **TOL)
                torch.testing.assert_close(cache.v[li, r, s: s + n], v[0], **TOL)
