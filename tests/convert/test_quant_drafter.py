"""``quantize --quantize-drafter``: the drafter's dense / MLP linears quantized with the target's recipe, its fused QKV
(the K/V projections of KV injection) and context projection left unquantized; the loader round trip; the default
(drafter copied unchanged)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.convert import convert, load_trtllm_drafter, quant
from trtllm_dflash.convert.loader import load_trtllm_drafter_state
from trtllm_dflash.convert.quantize import DRAFTER_EXCLUDE_MODULES, DRAFTER_QUANTIZED_LINEARS
from trtllm_dflash.models.drafter import DrafterModel

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def out(tiny_dirs, tmp_path_factory):
    pytest.importorskip("modelopt.torch.quantization")
    from trtllm_dflash.convert.quantize import quantize

    t, d = tiny_dirs["qwen3"]
    root = tmp_path_factory.mktemp("qd")
    src = convert(t, d, root / "bf16", tp=2)
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    return {"bf16": src, "plain": quantize(src, root / "plain", "fp8", ids),
            **{r: quantize(src, root / r, r, ids, quantize_drafter=True) for r in ("fp8", "nvfp4")}}


def test_default_copies_the_drafter_unchanged(out):
    for f in ("config.json", "rank0.safetensors", "rank1.safetensors"):
        assert (out["plain"] / "drafter" / f).read_bytes() == (out["bf16"] / "drafter" / f).read_bytes()


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_drafter_layout_and_exclusions(recipe, out):
    cfg = json.loads((out[recipe] / "drafter" / "config.json").read_text())
    assert cfg["quantization"]["quant_algo"] == recipe.upper()
    assert cfg["quantization"]["exclude_modules"] == DRAFTER_EXCLUDE_MODULES
    assert cfg["quantization"]["kv_cache_quant_algo"] is None  # the drafter's context cache stays in bf16
    for r in range(2):
        q = load_file(str(out[recipe] / "drafter" / f"rank{r}.safetensors"))
        src = load_file(str(out["bf16"] / "drafter" / f"rank{r}.safetensors"))
        for name, t in src.items():
            linear = name.removesuffix(".weight")
            if linear.endswith(DRAFTER_QUANTIZED_LINEARS):
                w = q[name]
                assert w.dtype == (torch.float8_e4m3fn if recipe == "fp8" else torch.uint8), name
                assert f"{linear}.activation_scaling_factor" in q
            else:  # qkv (K/V projections), context_proj, norms: bit-identical, no scales
                assert torch.equal(q[name], t), name
                assert not [n for n in q if n.startswith(linear + ".") and n != name], name
        assert any(n.endswith("attention.qkv.weight") for n in src) and "drafter.context_proj.weight" in src


@pytest.mark.parametrize("recipe", ["fp8", "nvfp4"])
def test_drafter_round_trip(recipe, out, tiny_dirs):
    state, _, _ = load_trtllm_drafter_state(out[recipe] / "drafter")
    ref = DrafterModel.from_pretrained(tiny_dirs["qwen3"][1], dtype=torch.bfloat16).state_dict()
    q0 = load_file(str(out[recipe] / "drafter" / "rank0.safetensors"))
    for name, t in ref.items():
        if name.endswith(("o_proj.weight", "mlp.down_proj.weight")):  # quantized: dequantize(quantize(bf16))
            i = name.split(".")[1]
            linear = f"drafter.layers.{i}." + ("attention.dense" if "o_proj" in name else "mlp.proj")
            if recipe == "fp8":
                s = q0[f"{linear}.weights_scaling_factor"]
                expected = quant.fp8_dequantize(quant.fp8_quantize(t, s), s)
            else:
                s = q0[f"{linear}.weights_scaling_factor_2"]
                expected = quant.nvfp4_dequantize(*quant.nvfp4_quantize(t, s), s)
            assert torch.equal(state[name], expected), name
        elif "mlp" not in name:  # fc, q/k/v, norms come back exactly
            assert torch.equal(state[name], t), name
    model = load_trtllm_drafter(out[recipe] / "drafter")
    hooked = {n.split(".", 2)[-1] for n in model.quant_emulation.input_scales}
    assert hooked == {"self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}
    # the quantized drafter still drafts: context injection + one block, finite output
    taps = torch.randn(1, 5, model.spec.num_taps * model.spec.hidden_size)
    cache = model.new_cache(1, 5 + model.spec.block_size)
    model.inject(taps, torch.tensor([5]), cache)
    assert torch.isfinite(model.draft(torch.randn(1, model.spec.block_size, model.spec.hidden_size), cache)).all()
