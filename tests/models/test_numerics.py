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


@pytest.mark.parametrize("threads", [1, 2])
def test_small_cpu_products_run_weight_major(threads, monkeypatch):
    """``layers.Linear``: a float32 product of a few rows on a CPU is W · xᵀ over the rows padded as
    ``weight_major_rows`` says (bit for bit), equal to ``F.linear`` up to rounding, in x's shape and contiguous; a
    larger one, float64 (the oracle), autograd and ``CPU_WEIGHT_MAJOR`` off are ``F.linear`` bit for bit."""
    import torch.nn.functional as F

    from trtllm_dflash.models import layers

    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    g = torch.Generator().manual_seed(0)
    lin = layers.Linear(48, 96, bias=True).requires_grad_(False)
    lin.weight.copy_(torch.randn(96, 48, generator=g))
    lin.bias.copy_(torch.randn(96, generator=g))
    limit = 4 if threads == 1 else 96
    for m in (1, 2, 3, 5, 8, 9, 15, 16, 17, 20, 21, limit, limit + 1):
        x = torch.randn(1, m, 48, generator=g)
        y = lin(x)
        assert y.shape == (1, m, 96) and y.is_contiguous()
        rows = layers.weight_major_rows(m, threads)
        if m <= limit and not 16 < m <= 20:  # 17 to 20 rows: F.linear is the faster there
            assert rows >= max(m, 2) and (rows == max(m, 2) if m <= 8 else rows % 8 == 0)
            padded = torch.cat([x[0], x.new_zeros(rows - m, 48)])
            assert torch.equal(y[0], torch.mm(lin.weight, padded.T)[:, :m].T + lin.bias)
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
        else:
            assert rows == 0 and torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert layers.weight_major_rows(0, threads) == 0 and lin(torch.zeros(0, 48)).shape == (0, 96)

    x = torch.randn(3, 48, generator=g)
    wide = layers.Linear(48, 96).double().requires_grad_(False)
    assert torch.equal(wide(x.double()), F.linear(x.double(), wide.weight, wide.bias))  # the float64 oracle
    trained = layers.Linear(48, 96)  # autograd keeps F.linear (and its gradients)
    out = trained(x)
    assert torch.equal(out, F.linear(x, trained.weight, trained.bias))
    out.sum().backward()
    assert trained.weight.grad is not None
    monkeypatch.setattr(layers, "CPU_WEIGHT_MAJOR", False)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))


def test_the_served_drafter_head_is_the_runtimes_product(tiny_dirs, monkeypatch):
    """The Triton drafter model's LM head (``runtime.steps.BlockDrafter.logits``) runs the product every other head of
    the runtime runs (``layers.linear``: weight-major for a few float32 rows), bit for bit; as x · Wᵀ it took 2–4× as
    long for 2–8 rows on the 2-core CPU and ``--block-size auto`` drafted half as often through Triton."""
    from types import SimpleNamespace

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import layers
    from trtllm_dflash.runtime.steps import BlockDrafter

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _, drafter = load_pair(*tiny_dirs["llama"], dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    head = torch.randn(4096, 576, generator=g)  # wide enough that the two products round differently
    served = BlockDrafter(drafter, SimpleNamespace(embed=head, lm_head=head), 2, 64)
    differs = 0
    for m in (1, 2, 3, 4, 8):
        h = torch.randn(1, m, 576, generator=g)
        got = served.logits(h)
        padded = torch.cat([h[0], h.new_zeros(max(m, 2) - m, 576)])
        assert torch.equal(got[0], torch.mm(head, padded.T)[:, :m].T)
        assert torch.equal(got, layers.linear(h, head))
        differs += not torch.equal(got, h @ head.T)
    assert differs, "x · Wᵀ rounds like the weight-major product here: the check above would not catch a regression"
