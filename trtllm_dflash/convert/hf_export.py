"""``quantize --export-hf DIR``: the quantized target as a modelopt *unified Hugging Face checkpoint*, the format
TensorRT-LLM's PyTorch backend (and ``trtllm-serve``) loads directly (trtllm_triton.md §1.6 D), plus the way back.

Produced by ``modelopt.torch.export.export_hf_checkpoint`` (nvidia-modelopt 0.47.0, ``unified_export_hf.py``) from a
transformers model of the target holding the *unquantized* source weights, quantized with ``mtq.quantize(model,
mtq.<FP8|NVFP4>_DEFAULT_CFG [+ FP8_KV_CFG], forward_loop=None)`` and then given this package's calibration: every
input quantizer's amax is the one ``quantize`` measured, every weight quantizer's amax the group maximum ``quantize``
used (q/k/v share one, gate/up share one), and with an FP8 KV cache the K/V bmm quantizers get amax 448 (scale 1.0,
what the TensorRT-LLM checkpoint carries). So the HF export and the TensorRT-LLM checkpoint hold the same quantized
values; modelopt does the packing (FP8 cast; NVFP4 ``NVFP4QTensor``, which runs on CPU with given amax). The files:

  config.json            the target's HF config with ``quantization_config`` (quant_method "modelopt")
  hf_quant_config.json   {"producer": {"name": "modelopt", "version"}, "quantization": {"quant_algo",
                         "kv_cache_quant_algo", "exclude_modules", ...}}
  model.safetensors      <m>.weight (float8_e4m3fn, or uint8 packed E2M1 for NVFP4), <m>.weight_scale,
                         <m>.weight_scale_2 (NVFP4), <m>.input_scale; self_attn.{k,v}_proj.{k,v}_scale with FP8 KV
  tokenizer files        copied from the source target directory
  trtllm_dflash_export.json   which function / versions / calibration produced it

``load_hf_export`` reads such a directory back into a ``TargetModel`` (dequantized weights, emulated activations and
KV cache, ``emulate.py``) for numerical checks.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from importlib import metadata
from pathlib import Path

import torch

from trtllm_dflash import staging
from trtllm_dflash.convert import emulate, quant
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.models.weights import load_into, read_state_dict, write_json
from trtllm_dflash.specs import TargetSpec

log = logging.getLogger(__name__)

EXPORT_FUNCTION = "modelopt.torch.export.export_hf_checkpoint"
PROVENANCE = "trtllm_dflash_export.json"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "vocab.json", "merges.txt", "chat_template.jinja", "generation_config.json")


def _modelopt():
    try:
        import modelopt.torch.quantization as mtq
        from modelopt.torch.export import export_hf_checkpoint
    except ImportError as exc:
        raise ConfigError("export_hf", "set", f"needs nvidia-modelopt ({exc})",
                          "pip install nvidia-modelopt==0.47.0 requests") from exc
    return mtq, export_hf_checkpoint


def quant_config(recipe: str, kv_cache_fp8: bool) -> dict:
    """mtq.<FP8|NVFP4>_DEFAULT_CFG, plus mtq.FP8_KV_CFG's K/V bmm quantizers with an FP8 KV cache."""
    mtq, _ = _modelopt()
    cfg = copy.deepcopy(getattr(mtq, f"{recipe}_DEFAULT_CFG"))
    if kv_cache_fp8:
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        cfg["quant_cfg"] = cfg["quant_cfg"] + kv if isinstance(kv, list) else {**cfg["quant_cfg"], **kv}
    return cfg


def export_hf(hf_dir: Path, state: dict[str, torch.Tensor], amax: dict[str, tuple[torch.Tensor, torch.Tensor]],
              recipe: str, kv_cache_fp8: bool, dtype: torch.dtype, out_dir: Path, force: bool,
              provenance: dict) -> Path:
    """Write the unified HF checkpoint of the target into ``out_dir``.

    hf_dir: the source HF target directory (config.json, tokenizer); state: the unquantized HF-named weights;
    amax: linear module name (e.g. ``model.layers.0.self_attn.q_proj``) -> (weight amax, input amax), fp32 [];
    recipe: "FP8" | "NVFP4"; dtype: the checkpoint dtype of the unquantized tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    mtq, export_hf_checkpoint = _modelopt()
    out_dir = Path(out_dir)
    staging.refuse_existing(out_dir, force)
    try:
        hf_cfg = AutoConfig.from_pretrained(str(hf_dir))
    except (OSError, ValueError) as exc:
        raise ArtifactError(hf_dir, f"no usable Hugging Face config ({exc})",
                            "keep the source target directory that `convert --target` read") from exc
    if not getattr(hf_cfg, "architectures", None):  # modelopt's export reads it
        hf_cfg.architectures = [type(AutoModelForCausalLM.from_config(hf_cfg)).__name__]
    # In the checkpoint dtype, as modelopt's own flow loads it: export_hf_checkpoint writes unquantized tensors in the
    # model's dtype and quantizes weight.to(dtype) (so FP8 divides in bf16, like quant.fp8_quantize).
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
    missing, unexpected = model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and hf_cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise ArtifactError(hf_dir, f"its config does not match the checkpoint (missing {missing[:3]}, unexpected "
                            f"{unexpected[:3]})", "pass the target directory the checkpoint was converted from")

    with torch.no_grad():
        mtq.quantize(model, quant_config(recipe, kv_cache_fp8), None)  # quantizers only: amax comes next
        seen = set()
        for name, module in model.named_modules():
            wq, iq = getattr(module, "weight_quantizer", None), getattr(module, "input_quantizer", None)
            if wq is not None and wq.is_enabled:
                if name not in amax:
                    raise ArtifactError(hf_dir, f"modelopt quantizes {name}, which quantize did not calibrate",
                                        "report this: the recipe and the exclusions disagree")
                wq.amax = amax[name][0].float().clone()
                iq.amax = amax[name][1].float().clone()
                seen.add(name)
            for kv in ("k_bmm_quantizer", "v_bmm_quantizer"):
                q = getattr(module, kv, None)
                if q is not None and q.is_enabled:
                    q.amax = torch.tensor(quant.FP8_MAX)  # scale 1.0: the TensorRT-LLM checkpoint's kv scale
        if seen != set(amax):
            raise ArtifactError(hf_dir, f"modelopt left {sorted(set(amax) - seen)[:3]} unquantized",
                                "report this: the recipe and the exclusions disagree")

    with staging.staged_output(out_dir, force) as tmp:
        export_hf_checkpoint(model, dtype=dtype, export_dir=tmp)
        for name in _TOKENIZER_FILES:
            if (Path(hf_dir) / name).is_file():
                shutil.copy2(Path(hf_dir) / name, tmp / name)
        write_json({"function": EXPORT_FUNCTION, "nvidia-modelopt": metadata.version("nvidia-modelopt"),
                    "transformers": metadata.version("transformers"), "recipe": recipe,
                    "kv_cache": "FP8" if kv_cache_fp8 else None, **provenance}, tmp / PROVENANCE)
    log.info("exported the %s target as a unified HF checkpoint -> %s", recipe, out_dir)
    return out_dir


def read_hf_quant_config(export_dir: Path) -> dict:
    path = Path(export_dir) / "hf_quant_config.json"
    try:
        return json.loads(path.read_text())["quantization"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ArtifactError(path, f"missing or malformed ({exc})", "pass a directory written by --export-hf") from exc


def dequantize_hf_state(tensors: dict[str, torch.Tensor], quant_algo: str):
    """Unified-HF tensors -> (float32 weights under plain HF names, input scales per module, max K/V scale)."""
    out = dict(tensors)
    scales: dict[str, torch.Tensor] = {}
    kv = [float(out.pop(n)) for n in tensors if n.endswith((".k_scale", ".v_scale"))]
    kv_scale = max(kv) if kv else 1.0
    for name in [n for n in tensors if n.endswith(".weight_scale")]:
        m = name.removesuffix(".weight_scale")
        w, s = out.pop(f"{m}.weight"), out.pop(name)
        if quant_algo == "FP8":
            out[f"{m}.weight"] = quant.fp8_dequantize(w, s)
        elif quant_algo == "NVFP4":
            out[f"{m}.weight"] = quant.nvfp4_dequantize(w, s, out.pop(f"{m}.weight_scale_2"))
        else:
            raise ArtifactError(m, f"quant_algo {quant_algo!r} cannot be loaded back", "use FP8 or NVFP4")
        if f"{m}.input_scale" in out:
            scales[m] = out.pop(f"{m}.input_scale").float().reshape(())
    return out, scales, kv_scale


def load_hf_export(export_dir, dtype: torch.dtype = torch.float32, device="cpu", emulate_quant: bool = True):
    """A TargetModel from an ``--export-hf`` directory: weights dequantized, activations and an FP8 KV cache emulated
    (``emulate_quant``)."""
    export_dir = Path(export_dir)
    q = read_hf_quant_config(export_dir)
    state, scales, kv_scale = dequantize_hf_state(read_state_dict(export_dir), q.get("quant_algo"))
    spec = TargetSpec.load(export_dir)
    model = TargetModel(spec, dtype=dtype, device=device)
    tied = spec.tie_word_embeddings
    load_into(model, {k: v for k, v in state.items() if not (tied and k == "lm_head.weight")}, export_dir,
              ignore=("lm_head.weight",) if tied else ())
    if emulate_quant:
        kv = q.get("kv_cache_quant_algo")
        emulate.install(model, emulate.QuantEmulation(q.get("quant_algo"), scales, kv, kv_scale))
    return model.eval().requires_grad_(False)
