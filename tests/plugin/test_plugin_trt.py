"""TensorRT plugin contracts (plain functions), the dense kv_rope semantics, and AOT compilation to PTX on CPU.

``tensorrt`` itself is not installed here, so ``register`` is exercised only for its import error; the GPU/TensorRT
path is untested in this environment.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from trtllm_dflash.errors import ConfigError  # noqa: E402
from trtllm_dflash.plugin import kv_inject as KI  # noqa: E402
from trtllm_dflash.plugin import trt  # noqa: E402
from trtllm_dflash.plugin.ragged import RaggedBatch  # noqa: E402

KV = trt.KvRopeConfig(num_layers=5, num_kv_heads=8, head_dim=128, eps=1e-6)  # the Qwen3-8B drafter
ATTN = trt.BlockAttentionConfig(num_heads=32, num_kv_heads=8, head_dim=128, max_q_len=16)


def test_kv_rope_contract():
    assert trt.kv_rope_output_shapes((7, 5 * 2 * 8 * 128), KV) == ((5, 7, 8, 128), (5, 7, 8, 128))
    assert trt.kv_rope_output_dtypes("bfloat16", "int64", "bfloat16", "float32") == ("bfloat16", "bfloat16")
    with pytest.raises(ConfigError, match="kv.shape"):
        trt.kv_rope_output_shapes((7, 100), KV)
    with pytest.raises(ConfigError, match="pos.dtype"):
        trt.kv_rope_output_dtypes("bfloat16", "float32", "bfloat16", "bfloat16")
    with pytest.raises(ConfigError, match="head_dim"):
        trt.kv_rope_output_shapes((1, 5 * 2 * 8 * 7), trt.KvRopeConfig(5, 8, 7, 1e-6))
    grid, block_t = trt.kv_rope_grid(100, KV)
    assert block_t == 8 and grid == (13, 5, 1)  # 4096 // (8 heads · 64 half-dims) = 8 tokens per program


def test_block_attention_contract():
    assert trt.block_attention_output_shape((48, 32, 128), (48, 8, 128), (4, 2048, 8, 128), ATTN) == (48, 32, 128)
    assert trt.block_attention_output_dtype("bfloat16", "bfloat16", "bfloat16", "int32") == "bfloat16"
    with pytest.raises(ConfigError, match="k_block/k_cache dtype"):
        trt.block_attention_output_dtype("bfloat16", "bfloat16", "float8", "int32")  # no FP8 KV in this kernel
    with pytest.raises(ConfigError, match="k_block.shape"):
        trt.block_attention_output_shape((48, 32, 128), (48, 4, 128), (4, 2048, 8, 128), ATTN)
    with pytest.raises(ConfigError, match="num_heads"):
        trt.BlockAttentionConfig(num_heads=6, num_kv_heads=4, head_dim=64, max_q_len=16).validate()
    # 16 queries x GQA 4 = 64 (token, head) rows -> one 64-row tile per (sequence, kv head)
    assert trt.block_attention_tiles(ATTN) == dict(BLOCK_M=64, BLOCK_N=16, BLOCK_D=128)
    assert trt.block_attention_grid(3, ATTN) == (3, 8, 1)


def test_accept_contract():
    assert trt.accept_output_shapes((45,), (4,), (48,), 15) == ((3,), (3,), (3, 16))
    assert trt.accept_output_shapes((0,), (1,), (0,), 15) == ((0,), (0,), (0, 16))  # empty batch
    assert trt.accept_output_dtypes("int64", "int32", "int64") == ("int64",) * 3
    with pytest.raises(ConfigError, match="target_ids.shape"):
        trt.accept_output_shapes((45,), (4,), (45,), 15)


def test_kv_rope_dense_kernel_matches_cache_semantics():
    """The TensorRT op writes dense [L, T, n_kv, hd]; scattered into cache slots it equals kv_inject's result."""
    from trtllm_dflash.plugin import triton_kernels

    g = torch.Generator().manual_seed(0)
    L, n_kv, hd, h = 2, 2, 16, 32
    w = KI.InjectWeights(fc=torch.randn(h, 2 * h, generator=g) * 0.2, hidden_norm=torch.ones(h),
                         kv=torch.randn(L * 2 * n_kv * hd, h, generator=g) * 0.2,
                         k_norm=1 + 0.1 * torch.randn(L, hd, generator=g), eps=1e-6, num_kv_heads=n_kv, head_dim=hd)
    taps = torch.randn(6, 2 * h, generator=g)
    batch, start, rows = RaggedBatch.make_dummy([4, 2]), torch.tensor([3, 0]), torch.tensor([1, 0])
    ang = torch.outer(torch.arange(32).float(), 1.0 / 10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    kc, vc = torch.zeros(L, 2, 32, n_kv, hd), torch.zeros(L, 2, 32, n_kv, hd)
    KI.kv_inject_reference(taps, batch, start, rows, w, cos, sin, kc, vc)
    pos = torch.tensor([3, 4, 5, 6, 0, 1])
    kv = KI.context_features(taps, w) @ w.kv.T
    k, v = triton_kernels.knorm_rope_dense(kv, pos, w.k_norm, w.eps, cos, sin, L)
    tok_rows = torch.tensor([1, 1, 1, 1, 0, 0])
    torch.testing.assert_close(k, kc[:, tok_rows, pos], atol=2e-5, rtol=2e-5)  # fp32, summation order only
    torch.testing.assert_close(v, vc[:, tok_rows, pos], atol=2e-5, rtol=2e-5)


def test_register_needs_tensorrt():
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="TensorRT >= 10.7"):
            trt.register(KV, ATTN, 15)
    else:
        pytest.skip("tensorrt is installed: registration is exercised by the GPU tier")


_COMPILE_ALL = """
import json
from trtllm_dflash.plugin import trt
out = {}
for op, cfg, dtype in [("kv_rope", trt.KvRopeConfig(5, 8, 128, 1e-6), "bfloat16"),
                       ("block_attention", trt.BlockAttentionConfig(32, 8, 128, 16), "bfloat16"),
                       ("block_attention", trt.BlockAttentionConfig(32, 4, 128, 16, causal=True, window=2048),
                        "float16"),
                       ("accept", 15, "int64")]:
    k = trt.compile_ptx(op, cfg, dtype, arch=90)
    out[f"{op}-{dtype}"] = [k.name, k.num_warps, k.shared_mem, ".entry " + k.name in k.ptx, ".target sm_90" in k.ptx]
print(json.dumps(out))
"""


def test_aot_compile_to_ptx_on_cpu():
    """Every TensorRT op's kernel compiles to sm_90 PTX with Triton alone (separate process: no interpreter)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    res = subprocess.run([sys.executable, "-c", _COMPILE_ALL], capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(out) == {"kv_rope-bfloat16", "block_attention-bfloat16", "block_attention-float16", "accept-int64"}
    for name, num_warps, shared, has_entry, has_target in out.values():
        assert has_entry and has_target and num_warps >= 1 and shared >= 0, name
