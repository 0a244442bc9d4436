"""FP8 / NVFP4: the numerics (bit-exact against modelopt's NVFP4 packing), the quantized checkpoint's layout against
what modelopt 0.47.0 writes (tests/data/trtllm_1_2_1/quantized_checkpoint.json), and the dequantizing loader."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.convert import convert, quant
from trtllm_dflash.convert.loader import load_trtllm_target_state
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models.weights import read_state_dict

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_1_2_1" / "quantized_checkpoint.json").read_text())
DTYPE_NAMES = {"float8_e4m3fn": torch.float8_e4m3fn, "float32": torch.float32, "uint8": torch.uint8}
pytestmark = pytest.mark.usefixtures("one_thread")


def test_e2m1_rounding_by_hand():
    # grid 0, .5, 1, 1.5, 2, 3, 4, 6 (codes 0..7); ties go to the even code; saturate at 6; bit 3 = negative input
    x = torch.tensor([0.0, 0.2, 0.25, 0.3, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -1e-4, -1.75, -6.0])
    assert quant.e2m1_codes(x).tolist() == [0, 0, 0, 1, 2, 2, 4, 4, 6, 6, 7, 8, 12, 15]


def test_nvfp4_round_trip_within_half_a_step():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    g = quant.nvfp4_global_scale(w.abs().amax())
    packed, block = quant.nvfp4_quantize(w, g)
    assert packed.shape == (8, 32) and packed.dtype == torch.uint8
    assert block.shape == (8, 4) and block.dtype == torch.float8_e4m3fn
    err = (quant.nvfp4_dequantize(packed, block, g) - w).abs()
    step = (block.float() * g).repeat_interleave(16, dim=1)  # grid spacing is at most 2 scale units (4 -> 6)
    assert torch.all(err <= step + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_nvfp4_packing_bit_exact_vs_modelopt(dtype):
    nvfp4 = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    g = torch.Generator().manual_seed(1)
    w = torch.randn(48, 128, generator=g)
    w[0, :16] = 0  # all-zero block: scale 1
    w[1, 16:32] = 1e-30  # tiny block: scale clamped to 2^-9
    w[2] *= 1e3  # a row that dominates the global scale
    w[3, :32] = torch.randn(32, generator=g) * 1e-3
    w = w.to(dtype)
    ref_g = nvfp4.NVFP4QTensor.get_weights_scaling_factor_2(w)
    ref_q, ref_block, _ = nvfp4.NVFP4QTensor.quantize(w, 16, weights_scaling_factor_2=ref_g)
    g_ = quant.nvfp4_global_scale(w.float().abs().amax())
    packed, block = quant.nvfp4_quantize(w, g_)
    assert torch.equal(g_, ref_g.float().reshape(()))
    assert torch.equal(packed, ref_q._quantized_data)
    assert torch.equal(block.view(torch.uint8), ref_block.view(torch.uint8))


def test_e2m1_ties_bit_exact_vs_modelopt():
    nvfp4 = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    # With unit scales the values reach the rounding step unchanged, so every tie is exercised exactly.
    vals = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 0.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0])
    w = vals.repeat(4, 1)  # [4, 16]
    ref_q, _, _ = nvfp4.NVFP4QTensor.quantize(w, 16, weights_scaling_factor=torch.ones(4, 1).to(torch.float8_e4m3fn),
                                              weights_scaling_factor_2=torch.tensor(1.0))
    codes = quant.e2m1_codes(w)
    assert torch.equal(codes[:, 0::2] | (codes[:, 1::2] << 4), ref_q._quantized_data)


@pytest.fixture(scope="module")
def converted(tiny_dirs, tmp_path_factory):
    t, d = tiny_dirs["qwen3"]
    return convert(t, d, tmp_path_factory.mktemp("q") / "bf16", dtype="bfloat16", tp=2)


@pytest.fixture(scope="module")
def quantized(converted):
    pytest.importorskip("modelopt.torch.quantization")
    from trtllm_dflash.convert.quantize import quantize

    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    return {r: quantize(converted, converted.parent / r, r, ids) for r in ("fp8", "nvfp4")}


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_quantized_layout_matches_modelopt(recipe, quantized, converted):
    algo = recipe.upper()
    facts = FACTS[algo]
    cfg = json.loads((quantized[recipe] / "target" / "config.json").read_text())
    for key, value in facts["quantization"].items():
        assert cfg["quantization"][key] == value, key
    for r in range(2):
        q = load_file(str(quantized[recipe] / "target" / f"rank{r}.safetensors"))
        src = load_file(str(converted / "target" / f"rank{r}.safetensors"))
        for name, t in src.items():
            linear = name.removesuffix(".weight")
            if not linear.endswith(tuple(FACTS["quantized_linears"])):
                assert torch.equal(q[name], t), name  # embedding, norms, lm_head: untouched
                continue
            out_f, in_f = t.shape
            for suffix, fact in facts["tensors"].items():
                got = q[f"{linear}.{suffix}"]
                assert got.dtype == DTYPE_NAMES[fact["dtype"]], (linear, suffix)
                if isinstance(fact["shape"], list):
                    assert list(got.shape) == fact["shape"], (linear, suffix)
            if algo == "NVFP4":
                assert q[f"{linear}.weight"].shape == (out_f, in_f // 2)
                assert q[f"{linear}.weights_scaling_factor"].shape == (out_f, in_f // 16)
            else:
                assert q[f"{linear}.weight"].shape == (out_f, in_f)
        assert set(q) == set(src) | {f"{n.removesuffix('.weight')}.{s}" for n in src
                                      if n.removesuffix(".weight").endswith(tuple(FACTS["quantized_linears"]))
                                      for s in facts["tensors"] if s != "weight"}
    if algo == "NVFP4":
        q0 = load_file(str(quantized[recipe] / "target" / "rank0.safetensors"))
        for name, shape in facts["observed_tp2_rank0_shapes"].items():
            assert list(q0[f"transformer.layers.1.{name}"].shape) == shape, name


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_scales_and_dequantizing_loader(recipe, quantized, tiny_dirs):
    hf = read_state_dict(tiny_dirs["qwen3"][0])
    bf16 = {k: v.to(torch.bfloat16) for k, v in hf.items()}  # what the bf16 conversion holds
    q = [load_file(str(quantized[recipe] / "target" / f"rank{r}.safetensors")) for r in range(2)]
    layer = "transformer.layers.0."
    qkv_amax = torch.stack([bf16[f"model.layers.0.self_attn.{p}_proj.weight"].float().abs().amax()
                            for p in "qkv"]).amax()
    mlp_amax = torch.maximum(bf16["model.layers.0.mlp.gate_proj.weight"].float().abs().amax(),
                             bf16["model.layers.0.mlp.up_proj.weight"].float().abs().amax())
    key = "weights_scaling_factor" if recipe == "fp8" else "weights_scaling_factor_2"
    denom = 448.0 if recipe == "fp8" else 6.0 * 448.0
    for r in range(2):  # scales are per full tensor, the same on every rank
        qkv_scale = q[r][f"{layer}attention.qkv.{key}"]
        assert torch.equal(qkv_scale, (qkv_amax / denom).reshape(qkv_scale.shape))
        assert torch.equal(q[r][f"{layer}mlp.fc.{key}"], q[r][f"{layer}mlp.gate.{key}"])
        assert torch.equal(q[r][f"{layer}mlp.fc.{key}"].reshape(()), (mlp_amax / denom).reshape(()))
        assert torch.equal(q[r][f"{layer}mlp.fc.activation_scaling_factor"],
                           q[r][f"{layer}mlp.gate.activation_scaling_factor"])
        for name, t in q[r].items():
            if name.endswith("activation_scaling_factor"):
                assert torch.isfinite(t).all() and (t > 0).all(), name
    # Loading back dequantizes every rank and merges: equal to quantize->dequantize of the full bf16 tensor.
    state, _ = load_trtllm_target_state(quantized[recipe] / "target")
    w = bf16["model.layers.0.mlp.down_proj.weight"]
    scale = q[0][f"{layer}mlp.proj.{key}"]
    if recipe == "fp8":
        expected = quant.fp8_dequantize(quant.fp8_quantize(w, scale), scale)
    else:
        expected = quant.nvfp4_dequantize(*quant.nvfp4_quantize(w, scale), scale)
    assert torch.equal(state["model.layers.0.mlp.down_proj.weight"], expected)
    assert torch.equal(state["model.embed_tokens.weight"], bf16["model.embed_tokens.weight"])


def test_fp8_kv_cache(converted):
    pytest.importorskip("modelopt.torch.quantization")
    from trtllm_dflash.convert.quantize import quantize

    facts = FACTS["FP8_KV_CACHE"]
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(3))
    out = quantize(converted, converted.parent / "nvfp4-kv", "nvfp4", ids, kv_cache="fp8")
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["quantization"]["kv_cache_quant_algo"] == facts["quantization"]["kv_cache_quant_algo"]
    assert cfg["quantization"]["quant_algo"] == "NVFP4"
    for r in range(2):
        tensors = load_file(str(out / "target" / f"rank{r}.safetensors"))
        for layer in range(6):
            for suffix, fact in facts["tensors_per_layer"].items():
                t = tensors[f"transformer.layers.{layer}.{suffix}"]
                assert t.dtype == DTYPE_NAMES[fact["dtype"]] and list(t.shape) == fact["shape"]
                assert t.item() == fact["value"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["calibration"]["kv_amax_per_layer"]) == 6
    assert all(0 < a < 448 for a in manifest["calibration"]["kv_amax_per_layer"])
    state, _ = load_trtllm_target_state(out / "target")  # cache scales are not weights: dropped on load
    assert not [n for n in state if "cache_scaling" in n]


def test_quantize_refuses_bad_inputs(quantized, converted):
    from trtllm_dflash.convert.quantize import quantize

    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ConfigError, match="already quantized"):
        quantize(quantized["fp8"], converted.parent / "again", "fp8", ids)
    with pytest.raises(ConfigError, match="recipe='int3'"):
        quantize(converted, converted.parent / "x", "int3", ids)
    with pytest.raises(ConfigError, match="kv_cache='int8'"):
        quantize(converted, converted.parent / "x", "fp8", ids, kv_cache="int8")
    with pytest.raises(ConfigError, match="calib_ids"):
        quantize(converted, converted.parent / "x", "fp8", torch.zeros(4))
    assert not (converted.parent / "again").exists() and not (converted.parent / "x").exists()
