"""Activation / KV-cache quantization emulation (convert/emulate.py) and the FP8 weight arithmetic against modelopt:
fake quantization by hand, the hooks the emulating loader installs (where, and what they compute), the FP8 KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trtllm_dflash.convert import convert, emulate, load_trtllm_target, quant
from trtllm_dflash.convert.loader import load_trtllm_target_state

pytestmark = pytest.mark.usefixtures("one_thread")


def test_fp8_fake_quant_by_hand():
    # scale 0.5: x / s = 2, 3, 900 (saturates to 448), -0.3125 (e4m3 step at 0.3125 is 2^-5: exact), 2.3 -> 2.25
    x = torch.tensor([1.0, 1.5, 450.0, -0.15625, 1.15])
    got = quant.fp8_fake_quant(x, torch.tensor([0.5]))
    assert got.tolist() == [1.0, 1.5, 224.0, -0.15625, 1.125]
    assert quant.fp8_fake_quant(x.to(torch.bfloat16), 1.0).dtype == torch.bfloat16


def test_nvfp4_fake_quant_is_quantize_dequantize_per_row_block():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 32, generator=g)
    s = quant.nvfp4_global_scale(x.abs().amax())
    got = quant.nvfp4_fake_quant(x, s)
    flat = x.reshape(6, 32)
    assert got.shape == x.shape
    assert torch.equal(got.reshape(6, 32), quant.nvfp4_dequantize(*quant.nvfp4_quantize(flat, s), s))
    # beyond the calibrated range the block scale saturates at 448: values clip to 6 * 448 * global
    big = quant.nvfp4_fake_quant(torch.full((1, 16), 1e6), s)
    assert torch.allclose(big, torch.full((1, 16), 6 * 448 * float(s)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_weights_bit_exact_vs_modelopt_export(dtype):
    qu = pytest.importorskip("modelopt.torch.export.quant_utils")
    w = (torch.randn(64, 96, generator=torch.Generator().manual_seed(2)) * 0.05).to(dtype)
    amax = w.float().abs().amax()
    scale = (amax / 448).reshape(1)
    ref = qu.to_quantized_weight(w, (amax / 448).reshape(()), qu.QUANTIZATION_FP8)
    assert torch.equal(quant.fp8_quantize(w, scale).view(torch.uint8), ref.view(torch.uint8))


@pytest.fixture(scope="module")
def quantized(tiny_dirs, tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    from trtllm_dflash.convert.quantize import quantize

    t, d = tiny_dirs["llama"]
    root = tmp_path_factory.mktemp("emu")
    src = convert(t, d, root / "bf16", tp=2)
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return {"bf16": src, **{name: quantize(src, root / name, recipe, ids, kv_cache=kv)
                            for name, recipe, kv in (("fp8", "fp8", None), ("fp8-kv", "fp8", "fp8"),
                                                     ("nvfp4", "nvfp4", None))}}


@pytest.mark.parametrize("variant", ["fp8", "nvfp4"])
def test_emulating_loader_hooks_every_quantized_linear_and_nothing_else(variant, quantized):
    model = load_trtllm_target(quantized[variant] / "target")
    emu = model.quant_emulation
    assert emu.quant_algo == variant.upper() and emu.kv_cache_quant_algo is None
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert set(emu.input_scales) == linears - {"lm_head"}
    hooked = {n for n, m in model.named_modules() if m._forward_pre_hooks}
    assert hooked == set(emu.input_scales)
    # q, k, v read one input, so they carry one scale (the fused qkv's)
    layer = "model.layers.1.self_attn."
    assert emu.input_scales[layer + "q_proj"] == emu.input_scales[layer + "k_proj"] == emu.input_scales[layer + "v_proj"]
    # a hooked linear computes W_deq @ fake_quant(x) (its own product, without the hook: weight-major on a CPU)
    proj = model.get_submodule("model.layers.0.mlp.down_proj")
    x = torch.randn(3, proj.in_features, generator=torch.Generator().manual_seed(1))
    s = emu.input_scales["model.layers.0.mlp.down_proj"]
    fake = quant.fp8_fake_quant(x, s) if variant == "fp8" else quant.nvfp4_fake_quant(x, s)
    assert torch.equal(proj(x), proj.forward(fake))
    torch.testing.assert_close(proj(x), F.linear(fake, proj.weight))
    assert not torch.equal(fake, x)


def test_weight_only_loading_and_unquantized_checkpoints_install_nothing(quantized):
    plain = load_trtllm_target(quantized["fp8"] / "target", emulate_quant=False)
    bf16 = load_trtllm_target(quantized["bf16"] / "target")
    for m in (plain, bf16):
        assert not any(mod._forward_pre_hooks for mod in m.modules()) and not hasattr(m, "quant_emulation")
    state, _ = load_trtllm_target_state(quantized["fp8"] / "target")
    assert all(torch.equal(p, state[n].to(p.dtype)) for n, p in plain.state_dict().items() if n in state)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(5))
    emulated = load_trtllm_target(quantized["fp8"] / "target")

    def logits(m):
        return m.logits(m(ids, m.new_cache(1, 12))[0])

    assert not torch.equal(logits(emulated), logits(plain))  # activation quantization changes the result
    assert torch.equal(logits(emulated), logits(load_trtllm_target(quantized["fp8"] / "target")))  # deterministic


def test_fp8_kv_cache_emulation_rounds_every_write_through_e4m3(quantized):
    model = load_trtllm_target(quantized["fp8-kv"] / "target")
    assert model.quant_emulation.kv_cache_quant_algo == "FP8" and model.quant_emulation.kv_cache_scale == 1.0
    cache = model.new_cache(1, 10)
    assert isinstance(cache, emulate.FP8KVCache)
    model(torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(3)), cache)
    for t in (cache.k, cache.v):
        assert t.abs().sum() > 0
        assert torch.equal(t, t.to(torch.float8_e4m3fn).to(t.dtype))  # every stored value is an e4m3 value
    assert type(load_trtllm_target(quantized["fp8"] / "target").new_cache(1, 4)) is not emulate.FP8KVCache
