"""Casts only widen: float64 stays float64 through norms, attention and sampling, so the float64 oracle's "exact"
agreements hold whichever float32 kernels the CPU runs (Intel or AMD, AVX2 or AVX-512)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from trtllm_dflash.models.layers import RMSNorm, attention, widen
from trtllm_dflash.runtime.sampling import SamplingParams, processed_probs


@pytest.mark.parametrize("dtype, stats", [(torch.float64, torch.float64), (torch.float32, torch.float32),
                                          (torch.bfloat16, torch.float32), (torch.float16, torch.float32)])
def test_widen_never_narrows(dtype, stats):
    assert widen(torch.ones(2, dtype=dtype)).dtype == stats


def test_float64_paths_stay_float64():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, dtype=torch.float64, generator=g) * 1e3
    norm = RMSNorm(64, 1e-6).double()
    ref = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert norm(x).dtype == torch.float64
    torch.testing.assert_close(norm(x), ref, atol=0, rtol=1e-14)  # float32 statistics would be off by ~1e-7

    q, k, v = (torch.randn(1, 4, n, 16, dtype=torch.float64, generator=g) for n in (3, 7, 7))
    allowed = torch.ones(1, 3, 7, dtype=torch.bool)
    out = attention(q, k[:, :2], v[:, :2], allowed)  # GQA: 4 query heads on 2 KV heads
    ref = torch.softmax(q @ k[:, :2].repeat_interleave(2, 1).transpose(-1, -2) / 4.0, -1) @ v[:, :2].repeat_interleave(2, 1)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref.permute(0, 2, 1, 3).reshape(1, 3, 64), atol=1e-14, rtol=0)

    logits = torch.randn(2, 50, dtype=torch.float64, generator=g)
    assert processed_probs(logits, SamplingParams(temperature=0.7)).dtype == torch.float64


@pytest.mark.parametrize("s", [1, 5])
def test_attention_over_cache_views_equals_the_batched_path(s):
    """K/V read from the cache as views ([rows, max_len, kv, d] sliced to [b, kv, L, d]) go one KV head at a time
    (a batched matmul over (b, kv) would copy them whole every layer); the result equals the batched path's on the
    same values, with each query head on its own KV head as in HF's ``repeat_kv``."""
    g = torch.Generator().manual_seed(0)
    cache_k, cache_v = (torch.randn(3, 40, 2, 16, dtype=torch.float64, generator=g) for _ in range(2))
    k, v = cache_k[:, :25].transpose(1, 2), cache_v[:, :25].transpose(1, 2)  # views: (b, kv) do not merge
    assert k.stride(0) != k.shape[1] * k.stride(1)
    q = torch.randn(3, 6, s, 16, dtype=torch.float64, generator=g)
    allowed = torch.rand(3, s, 25, generator=g) > 0.3
    allowed[..., 0] = True
    out = attention(q, k, v, allowed)
    ref = attention(q, k.contiguous(), v.contiguous(), allowed)  # mergeable: the batched path
    torch.testing.assert_close(out, ref, atol=1e-14, rtol=0)
    scores = (q @ k.repeat_interleave(3, 1).transpose(-1, -2) / 4.0).masked_fill(~allowed[:, None], float("-inf"))
    want = torch.softmax(scores, -1) @ v.repeat_interleave(3, 1)
    torch.testing.assert_close(out, want.permute(0, 2, 1, 3).reshape(3, s, 96), atol=1e-14, rtol=0)


CROP = """
import json, sys, torch
from trtllm_dflash.checkpoints import load_pair
target = load_pair(sys.argv[1], sys.argv[2], dtype=torch.float64)[0]
g = torch.Generator().manual_seed(1)
prompt, block, nxt = (torch.randint(0, 256, (1, n), generator=g) for n in (12, 6, 3))
cache = target.new_cache(1, 64)
target(prompt, cache); cache.commit(None, torch.tensor([12]))
target(block, cache); cache.commit(None, torch.tensor([2]))
h_inc, _ = target(nxt, cache)
h_ref, _ = target(torch.cat([prompt, block[:, :2], nxt], dim=1), target.new_cache(1, 64))
print(json.dumps({"capability": torch.backends.cpu.get_cpu_capability(),
                  "crop_vs_recompute": (h_inc - h_ref[:, -3:]).abs().max().item(), "h": h_inc.flatten()[:64].tolist()}))
"""


def test_float64_cache_crop_exact_under_every_cpu_kernel_set(tiny_dirs):
    """ATEN_CPU_CAPABILITY picks torch's CPU kernels as a different processor would: the float64 cache-crop identity
    holds to 1e-10 (observed ~1e-15) under each, and the kernel sets agree with each other to 1e-12."""
    tdir, ddir = tiny_dirs["qwen3"]
    best = torch.backends.cpu.get_cpu_capability().lower()
    caps = ["default", "avx2"] + (["avx512"] if "avx512" in best else [])
    runs = []
    for cap in caps:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": cap}
        out = subprocess.run([sys.executable, "-c", CROP, str(tdir), str(ddir)], env=env, capture_output=True,
                             text=True, check=True, timeout=300)
        runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
    for cap, run in zip(caps, runs):
        assert run["crop_vs_recompute"] < 1e-10, (cap, run["crop_vs_recompute"])
    assert len({r["capability"] for r in runs}) == len(caps), [r["capability"] for r in runs]
    h0 = torch.tensor(runs[0]["h"], dtype=torch.float64)
    for cap, run in zip(caps[1:], runs[1:]):
        torch.testing.assert_close(torch.tensor(run["h"], dtype=torch.float64), h0, atol=1e-12, rtol=0, msg=cap)


def _product_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on float32 rounding in x · Wᵀ: reduction length × eps × Σ|x||w|."""
    return x.shape[-1] * torch.finfo(x.dtype).eps * (x.abs().double() @ w.abs().double().T)


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_products_run_the_kernel_measured_fastest(threads, monkeypatch, tmp_path):
    """``layers.Linear``: a CPU inference product runs, bit for bit, the kind the machine's table chose for its shape
    and row bucket (``models.products``), equal to ``F.linear`` within float32's rounding for the reduction length, in
    x's shape; every candidate kind computes the same product; the choices are measured once and read back from
    disk; float64 (the oracle), autograd and ``TRTLLM_DFLASH_CPU_GEMM=linear`` are ``F.linear`` bit for bit."""
    import torch.nn.functional as F

    from trtllm_dflash.models import layers, products

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(0)
    lin = layers.Linear(48, 96, bias=True).requires_grad_(False)
    lin.weight.copy_(torch.randn(96, 48, generator=g))
    lin.bias.copy_(torch.randn(96, generator=g))
    with torch.inference_mode():
        for m in (1, 2, 3, 5, 8, 9, 16, 17, 33):
            x = torch.randn(1, m, 48, generator=g)
            y = lin(x)
            assert y.shape == (1, m, 96)
            kind = products.table().kind(torch.float32, 96, 48, m)
            assert kind in products.candidates(torch.float32)
            want = products.run(kind, x[0], products.prepare(kind, lin.weight), lin.bias)
            assert torch.equal(y[0], want), (m, kind)
            exact = F.linear(x.double(), lin.weight.double(), lin.bias.double())
            assert ((y.double() - exact).abs() <= _product_tolerance(x, lin.weight) + 1e-12).all(), (m, kind)
            for other in products.candidates(torch.float32):
                got = products.run(other, x[0], products.prepare(other, lin.weight), lin.bias)
                assert ((got.double() - exact[0]).abs() <= _product_tolerance(x[0], lin.weight) + 1e-12).all()
        assert lin(torch.zeros(0, 48)).shape == (0, 96)
    saved = products.table()
    assert saved.path.is_file() and saved.choices
    monkeypatch.setattr(products, "measure", lambda *a, **k: pytest.fail("a recorded choice was measured again"))
    again = products.ProductTable(saved.path, saved.key)
    assert again.choices == saved.choices
    assert all(again.kind(torch.float32, 96, 48, m) == saved.choices[again.entry(torch.float32, 96, 48, m)]
               for m in (1, 9, 33))

    x = torch.randn(3, 48, generator=g)
    wide = layers.Linear(48, 96).double().requires_grad_(False)
    assert torch.equal(wide(x.double()), F.linear(x.double(), wide.weight, wide.bias))  # the float64 oracle
    trained = layers.Linear(48, 96)  # autograd keeps F.linear (and its gradients)
    out = trained(x)
    assert torch.equal(out, F.linear(x, trained.weight, trained.bias))
    out.sum().backward()
    assert trained.weight.grad is not None
    with products.forcing("linear"):
        assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_fused_projections_equal_the_separate_ones(monkeypatch, tmp_path):
    """Q, K and V (gate and up) as one product over the concatenated weights: each output equals its own product
    within float32 rounding; the concatenation is made again when a weight changes in place; modules with hooks run
    their own forward (the hook sees it)."""
    import torch.nn.functional as F

    from trtllm_dflash.models import layers, products

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    g = torch.Generator().manual_seed(3)
    mods = [layers.Linear(64, n, bias=False).requires_grad_(False) for n in (64, 16, 16)]
    for mod in mods:
        mod.weight.copy_(torch.randn(mod.weight.shape, generator=g))
    with torch.inference_mode():
        for m in (1, 4, 16):
            x = torch.randn(2, m, 64, generator=g)
            outs = layers.fused(x, *mods)
            for out, mod in zip(outs, mods):
                exact = F.linear(x.double(), mod.weight.double())
                assert out.shape == (2, m, mod.weight.shape[0])
                assert ((out.double() - exact).abs() <= _product_tolerance(x, mod.weight) + 1e-12).all()
        mods[1].weight.mul_(2)
        x = torch.randn(1, 3, 64, generator=g)
        torch.testing.assert_close(layers.fused(x, *mods)[1], F.linear(x, mods[1].weight))
    seen = []
    handle = mods[0].register_forward_hook(lambda mod, i, o: seen.append(o.shape))
    with torch.inference_mode():
        layers.fused(x, *mods)
    handle.remove()
    assert seen == [(1, 3, 64)]


def test_products_take_weights_made_under_inference_mode(monkeypatch, tmp_path):
    """A model built inside ``torch.inference_mode`` holds inference tensors, which keep no version counter: its
    products run (fused and single) and equal ``F.linear`` within float32 rounding."""
    import torch.nn.functional as F

    from trtllm_dflash.models import layers, products

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    with torch.inference_mode():
        mods = [layers.Linear(64, n, bias=True) for n in (64, 16, 16)]
        x = torch.randn(1, 1, 64)
        for out, mod in zip(layers.fused(x, *mods), mods):
            exact = F.linear(x.double(), mod.weight.double(), mod.bias.double())
            assert ((out.double() - exact).abs() <= _product_tolerance(x, mod.weight) + 1e-6).all()
        torch.testing.assert_close(mods[0](x), F.linear(x, mods[0].weight, mods[0].bias))


def test_the_served_drafter_head_is_the_runtimes_product(tiny_dirs, monkeypatch):
    """The Triton drafter model's LM head (``runtime.steps.BlockDrafter.logits``) runs the product every other head of
    the runtime runs (``layers.linear``, the kernel the machine's table chose), bit for bit: with the weight-major
    kind forced, which rounds unlike x · Wᵀ, the served head rounds as it does."""
    from types import SimpleNamespace

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import layers, products
    from trtllm_dflash.runtime.steps import BlockDrafter

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _, drafter = load_pair(*tiny_dirs["llama"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    head = torch.randn(4096, 576, generator=g)  # wide enough that the two products round differently
    served = BlockDrafter(drafter, SimpleNamespace(embed=head, lm_head=head), 2, 64)
    differs = 0
    for m in (1, 2, 3, 4, 8):
        h = torch.randn(1, m, 576, generator=g)
        with products.forcing("weight-major"):
            got = served.logits(h)
            assert torch.equal(got, layers.linear(h, head))
        padded = torch.cat([h[0], h.new_zeros(max(m, 2) - m, 576)])
        assert torch.equal(got[0], torch.mm(head, padded.T)[:, :m].T)
        differs += not torch.equal(got, h @ head.T)
    assert differs, "x · Wᵀ rounds like the weight-major product here: the check above would not catch a regression"


def test_a_tables_epoch_names_the_kernels_a_calibration_timed(monkeypatch, tmp_path):
    """A product table has an epoch from its making, kept on disk and read back; ``renew`` (``tune`` recording new
    choices) and ``forget`` make a new one, which a process holding the older one takes at its next save instead of
    writing the old back; the ``auto`` policy's cost model is cached under it, so new kernels mean a new calibration."""
    from trtllm_dflash.models import products
    from trtllm_dflash.runtime import cost

    monkeypatch.setenv("TRTLLM_DFLASH_CACHE", str(tmp_path))
    monkeypatch.setattr(products, "_TABLES", {})
    table = products.table()
    first = table.epoch
    assert first and products.ProductTable(table.path, table.key).epoch == first
    other = products.ProductTable(table.path, table.key)
    table.renew()
    assert table.epoch != first and products.ProductTable(table.path, table.key).epoch == table.epoch
    other.choose("float32:8x8:1", lambda: {"linear": 1.0})  # an older holder saves a choice
    assert other.epoch == table.epoch == products.ProductTable(table.path, table.key).epoch
    renewed = table.epoch
    table.forget()
    assert table.epoch not in (first, renewed) and products.ProductTable(table.path, table.key).epoch == table.epoch
    keys = [cost.cost_key("cpu-x", "float32", 2, "m1", kernels) for kernels in (first, renewed)]
    assert cost.cache_path(keys[0], tmp_path) != cost.cache_path(keys[1], tmp_path)
    assert cost.cost_key("cuda-x", "float32", 2, "m1") == {"device": "cuda-x", "dtype": "float32", "threads": 2,
                                                         "model": "m1", "version": cost.CALIBRATION_VERSION}
