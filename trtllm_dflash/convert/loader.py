"""Loading converted checkpoints back into the PyTorch reference models: merge the TP ranks, un-fuse QKV, undo the
``mlp.fc``/``mlp.gate`` naming swap (all by running ``weight_map.merge`` over the same plan ``convert`` used), so a
round trip can be checked tensor by tensor and logit by logit. FP8 / NVFP4 checkpoints (``quantize``; the target, and
the drafter with ``--quantize-drafter``) are dequantized first (``quant.py``), and by default the loaded model also
emulates the quantized activations and the FP8 KV cache (``emulate.py``), so it computes what the engine would."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from trtllm_dflash.convert import configs, emulate, quant
from trtllm_dflash.convert import manifest as mf
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.errors import ArtifactError, read_json
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import SCRATCH_POSITIONS, TargetModel
from trtllm_dflash.models.weights import load_into
from trtllm_dflash.specs import TargetSpec


def read_config(ckpt_dir: Path) -> dict[str, Any]:
    return read_json(Path(ckpt_dir) / "config.json",
                     "pass a checkpoint directory written by `trtllm-dflash convert` (re-run it if the file is damaged)")


def read_ranks(ckpt_dir: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    ranks = []
    for r in range(tp):
        path = Path(ckpt_dir) / f"rank{r}.safetensors"
        if not path.is_file():
            raise ArtifactError(path, f"missing (mapping.tp_size={tp})", "re-run the conversion")
        try:
            ranks.append(load_file(str(path)))
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(path, f"unreadable safetensors ({exc})", "re-run the conversion") from exc
    return ranks


def dequantize_rank(tensors: dict[str, torch.Tensor], quant_algo: str | None, source: Path) -> dict[str, torch.Tensor]:
    """FP8 / NVFP4 rank tensors -> plain float32 weights under the unquantized names (scales consumed)."""
    if quant_algo is None:
        return {n: t for n, t in tensors.items() if not n.endswith("_cache_scaling_factor")}
    if quant_algo not in ("FP8", "NVFP4"):
        raise ArtifactError(source, f"quantization.quant_algo={quant_algo!r} cannot be loaded back",
                            "only FP8 and NVFP4 checkpoints written by this package are supported")
    # KV-cache scales describe the runtime cache, not weights.
    out = {n: t for n, t in tensors.items() if not n.endswith("_cache_scaling_factor")}
    for name in [n for n in tensors if n.endswith(".weights_scaling_factor")]:
        linear = name.removesuffix(".weights_scaling_factor")
        w, scale = out.pop(f"{linear}.weight"), out.pop(name)
        out.pop(f"{linear}.activation_scaling_factor", None)
        if quant_algo == "FP8":
            out[f"{linear}.weight"] = quant.fp8_dequantize(w, scale)
        else:
            out[f"{linear}.weight"] = quant.nvfp4_dequantize(w, scale, out.pop(f"{linear}.weights_scaling_factor_2"))
    return out


def merge_ranks(entries: list[wm.Entry], ranks: list[dict[str, torch.Tensor]], source: Path) -> dict[str, torch.Tensor]:
    """TRT-LLM per-rank tensors -> full source-named tensors. Strict: every rank holds exactly the planned names and
    shapes."""
    tp = len(ranks)
    planned = {e.dst for e in entries}
    for r, tensors in enumerate(ranks):
        missing, extra = sorted(planned - set(tensors)), sorted(set(tensors) - planned)
        if missing or extra:
            raise ArtifactError(source / f"rank{r}.safetensors",
                                f"tensor names do not match config.json (missing {missing[:3]}, "
                                f"unexpected {extra[:3]})",
                                "re-run the conversion")
    state: dict[str, torch.Tensor] = {}
    for e in entries:
        expected = wm.rank_shape(e, tp)
        for r, tensors in enumerate(ranks):
            if tuple(tensors[e.dst].shape) != expected:
                raise ArtifactError(source / f"rank{r}.safetensors", f"tensor {e.dst} has shape "
                                    f"{list(tensors[e.dst].shape)}, config.json implies {list(expected)}",
                                    "re-run the conversion")
        for name, full in zip(e.src, wm.merge(e, [t[e.dst] for t in ranks], source)):
            state.setdefault(name, full)
    return state


def _manifest_extras(ckpt_dir: Path) -> dict[str, Any]:
    """eos/bos ids are not part of a TRT-LLM config; the manifest next to the checkpoint records them."""
    path = Path(ckpt_dir).parent / mf.MANIFEST
    try:
        target = json.loads(path.read_text())["resolved"]["target"]
        return {"eos_token_ids": target.get("eos_token_ids", []), "bos_token_id": target.get("bos_token_id")}
    except (OSError, KeyError, TypeError, json.JSONDecodeError):
        return {}


def _read_target(ckpt_dir: Path):
    cfg = read_config(ckpt_dir)
    spec = configs.target_spec_from_config(cfg, ckpt_dir / "config.json", _manifest_extras(ckpt_dir))
    tp = configs.tp_size(cfg, ckpt_dir / "config.json")
    # The checkpoint always holds lm_head.weight, so the plan never aliases it to the embedding.
    entries = configs.target_entries(spec, tp, lm_head_from_embedding=False,
                                     use_parallel_embedding=bool(cfg.get("use_parallel_embedding")))
    quantization = cfg.get("quantization") or {}
    raw = read_ranks(ckpt_dir, tp)
    ranks = [dequantize_rank(t, quantization.get("quant_algo"), ckpt_dir) for t in raw]
    return merge_ranks(entries, ranks, ckpt_dir), spec, emulate.from_checkpoint(quantization, entries, raw[0])


def load_trtllm_target_state(ckpt_dir) -> tuple[dict[str, torch.Tensor], TargetSpec]:
    """Full HF-named tensors (dequantized to float32 if the checkpoint is quantized) and the spec."""
    state, spec, _ = _read_target(Path(ckpt_dir))
    return state, spec


def load_trtllm_target(ckpt_dir, dtype: torch.dtype = torch.float32, device="cpu",
                       emulate_quant: bool = True) -> TargetModel:
    """A TargetModel from ``OUT/target`` (any TP size). A quantized checkpoint's weights are dequantized; with
    ``emulate_quant`` (default) its activation quantization and FP8 KV cache are emulated too (``emulate.py``),
    without it the model runs the dequantized weights on unquantized activations (weight-only error)."""
    ckpt_dir = Path(ckpt_dir)
    state, spec, emulation = _read_target(ckpt_dir)
    model = TargetModel(spec, dtype=dtype, device=device)
    ignore = ("lm_head.weight",) if spec.tie_word_embeddings else ()
    load_into(model, state, ckpt_dir, ignore=ignore)
    if emulate_quant and emulation.active:
        emulate.install(model, emulation)
    return model.eval().requires_grad_(False)


def _read_drafter(ckpt_dir: Path):
    cfg = read_config(ckpt_dir)
    spec = configs.drafter_spec_from_config(cfg, ckpt_dir / "config.json")
    tp = configs.tp_size(cfg, ckpt_dir / "config.json")
    entries = configs.drafter_entries(spec)
    quantization = cfg.get("quantization") or {}
    raw = read_ranks(ckpt_dir, tp)
    ranks = [dequantize_rank(t, quantization.get("quant_algo"), ckpt_dir) for t in raw]
    return merge_ranks(entries, ranks, ckpt_dir), spec, cfg, emulate.from_checkpoint(quantization, entries, raw[0])


def load_trtllm_drafter_state(ckpt_dir):
    state, spec, cfg, _ = _read_drafter(Path(ckpt_dir))
    return state, spec, cfg


def load_trtllm_drafter(ckpt_dir, dtype: torch.dtype = torch.float32, device="cpu",
                        emulate_quant: bool = True) -> DrafterModel:
    """A DrafterModel (z-lab parameter names) from ``OUT/drafter`` (any TP size); a quantized drafter
    (``quantize --quantize-drafter``) is dequantized and, with ``emulate_quant``, its activations fake-quantized."""
    ckpt_dir = Path(ckpt_dir)
    state, spec, cfg, emulation = _read_drafter(ckpt_dir)
    model = DrafterModel(spec, dtype=dtype, device=device,
                         max_positions=int(cfg.get("max_position_embeddings", 4096)) + SCRATCH_POSITIONS)
    load_into(model, state, ckpt_dir)
    if emulate_quant and emulation.active:
        emulate.install(model, emulation)
    return model.eval().requires_grad_(False)
