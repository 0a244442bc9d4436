"""``quantize --export-hf``: modelopt's unified Hugging Face checkpoint of the target (what TensorRT-LLM's PyTorch
backend loads), written from our calibration: its files as modelopt writes them, and loaded back (dequantized,
activations emulated) it computes exactly what our TensorRT-LLM checkpoint computes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.convert import convert, load_trtllm_target
from trtllm_dflash.convert.loader import load_trtllm_target_state
from trtllm_dflash.errors import ArtifactError

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [("fp8", None), ("fp8", "fp8"), ("nvfp4", None)]


@pytest.fixture(scope="module")
def exported(tiny_dirs, tmp_path_factory):
    pytest.importorskip("modelopt.torch.export")
    from trtllm_dflash.convert.quantize import quantize

    t, d = tiny_dirs["llama"]
    root = tmp_path_factory.mktemp("hf")
    src = convert(t, d, root / "bf16")
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    out = {}
    for recipe, kv in CASES:
        name = f"{recipe}-{kv}"
        out[name] = (quantize(src, root / name, recipe, ids, kv_cache=kv, export_hf=root / f"{name}-hf"),
                     root / f"{name}-hf")
    return out


@pytest.mark.parametrize("recipe,kv", CASES)
def test_export_files_as_modelopt_writes_them(recipe, kv, exported):
    _, hf = exported[f"{recipe}-{kv}"]
    algo = recipe.upper()
    q = json.loads((hf / "hf_quant_config.json").read_text())
    assert q["producer"]["name"] == "modelopt" and q["producer"]["version"] == "0.47.0"
    assert q["quantization"]["quant_algo"] == algo
    assert q["quantization"]["kv_cache_quant_algo"] == (kv.upper() if kv else None)
    assert "lm_head" in q["quantization"]["exclude_modules"]
    cfg = json.loads((hf / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == algo
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["dtype"] == "bfloat16"
    prov = json.loads((hf / "trtllm_dflash_export.json").read_text())
    assert prov["function"] == "modelopt.torch.export.export_hf_checkpoint" and prov["nvidia-modelopt"] == "0.47.0"
    assert "calibration path" in prov["calibration"]
    t = load_file(str(hf / "model.safetensors"))
    p = "model.layers.0.self_attn."
    assert t[p + "q_proj.weight"].dtype == (torch.float8_e4m3fn if algo == "FP8" else torch.uint8)
    assert t[p + "q_proj.input_scale"].dtype == torch.float32 and t["model.norm.weight"].dtype == torch.bfloat16
    if algo == "NVFP4":
        assert t[p + "q_proj.weight_scale"].dtype == torch.float8_e4m3fn and p + "q_proj.weight_scale_2" in t
    assert (p + "k_proj.k_scale" in t) == (kv is not None)


@pytest.mark.parametrize("recipe,kv", CASES)
def test_export_loads_back_to_the_same_model_as_the_trtllm_checkpoint(recipe, kv, exported):
    from trtllm_dflash.convert.hf_export import dequantize_hf_state, load_hf_export

    ckpt, hf = exported[f"{recipe}-{kv}"]
    ours, _ = load_trtllm_target_state(ckpt / "target")
    theirs, scales, kv_scale = dequantize_hf_state(load_file(str(hf / "model.safetensors")), recipe.upper())
    for name, w in theirs.items():  # modelopt's packing of our amax == our packing, bit for bit
        assert torch.equal(w.float(), ours[name].float()), name
    ids = torch.randint(0, 256, (1, 14), generator=torch.Generator().manual_seed(1))
    a, b = load_trtllm_target(ckpt / "target"), load_hf_export(hf)
    assert b.quant_emulation.input_scales.keys() == a.quant_emulation.input_scales.keys()
    assert all(torch.equal(b.quant_emulation.input_scales[k], v) for k, v in a.quant_emulation.input_scales.items())
    assert b.quant_emulation.kv_cache_quant_algo == a.quant_emulation.kv_cache_quant_algo and kv_scale == 1.0
    la, lb = (m.logits(m(ids, m.new_cache(1, 14))[0]) for m in (a, b))
    assert torch.equal(la, lb)


def test_export_needs_the_recorded_hf_target(exported, tmp_path):
    from trtllm_dflash.convert.quantize import quantize

    ckpt, _ = exported["fp8-None"]
    src = ckpt.parent / "bf16"
    manifest = json.loads((src / "manifest.json").read_text())
    copy = tmp_path / "moved"
    copy.mkdir()
    for what in ("target", "drafter"):
        (copy / what).symlink_to(src / what)
    manifest["config"]["target_dir"] = str(tmp_path / "gone")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="--export-hf needs the Hugging Face target"):
        quantize(copy, tmp_path / "q", "fp8", torch.zeros(1, 4, dtype=torch.long), export_hf=tmp_path / "hf")
    assert not (tmp_path / "q").exists() and not (tmp_path / "hf").exists()
