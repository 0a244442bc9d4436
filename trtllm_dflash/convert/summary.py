"""``inspect``: a JSON-able summary of a TensorRT-LLM-format checkpoint directory (``config.json`` +
``rank*.safetensors``), or of a whole ``convert`` output (``manifest.json`` + ``target/`` + ``drafter/``).

Per checkpoint: architecture, dtype, quantization algorithms (and ``exclude_modules``), TP size, per-rank file sizes,
tensor dtypes with counts, total bytes, and per-tensor stats (shape, dtype, bytes, min/max/mean/std over the raw values; for packed
quantized tensors those are statistics of the stored codes, not of the dequantized weights).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from trtllm_dflash.convert import manifest as mf
from trtllm_dflash.convert.loader import read_config
from trtllm_dflash.errors import ArtifactError


def _tensor_stats(t: torch.Tensor) -> dict[str, Any]:
    out: dict[str, Any] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                           "bytes": t.numel() * t.element_size()}
    if t.numel() == 0:
        return out
    x = t.to(torch.float32).to(torch.float64)  # float32 first: fp8 and uint8 codes convert to it directly
    out |= {"min": x.min().item(), "max": x.max().item(), "mean": x.mean().item(),
            "std": x.std().item() if x.numel() > 1 else 0.0}
    return out


def inspect_checkpoint(ckpt_dir: Path, stats: bool = True) -> dict[str, Any]:
    ckpt_dir = Path(ckpt_dir)
    cfg = read_config(ckpt_dir)
    mapping = cfg.get("mapping") or {}
    tp = int(mapping.get("tp_size", 1))
    quant = cfg.get("quantization") or {}
    ranks, dtypes, tensors = [], {}, {}
    for r in range(tp):
        path = ckpt_dir / f"rank{r}.safetensors"
        if not path.is_file():
            raise ArtifactError(path, f"missing (mapping.tp_size={tp})", "re-run the conversion")
        try:
            with safe_open(str(path), framework="pt") as f:
                names = list(f.keys())
                tensor_bytes = 0
                for name in names:
                    t = f.get_tensor(name)
                    key = str(t.dtype).removeprefix("torch.")
                    dtypes[key] = dtypes.get(key, 0) + 1
                    tensor_bytes += t.numel() * t.element_size()
                    if stats:
                        tensors[f"rank{r}/{name}"] = _tensor_stats(t)
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(path, f"unreadable safetensors ({exc})", "re-run the conversion") from exc
        ranks.append({"file": path.name, "file_bytes": path.stat().st_size, "num_tensors": len(names),
                      "tensor_bytes": tensor_bytes})
    out = {
        "path": str(ckpt_dir),
        "architecture": cfg.get("architecture"),
        "dtype": cfg.get("dtype"),
        "quant_algo": quant.get("quant_algo"),
        "kv_cache_quant_algo": quant.get("kv_cache_quant_algo"),
        "exclude_modules": quant.get("exclude_modules"),
        "tp_size": tp,
        "num_hidden_layers": cfg.get("num_hidden_layers"),
        "hidden_size": cfg.get("hidden_size"),
        "vocab_size": cfg.get("vocab_size"),
        "tensor_dtypes": dict(sorted(dtypes.items())),
        "total_file_bytes": sum(r["file_bytes"] for r in ranks),
        "ranks": ranks,
    }
    if "dflash" in cfg:
        out["dflash"] = cfg["dflash"]
    if stats:
        out["tensors"] = tensors
    return out


def inspect(ckpt_dir, stats: bool = True) -> dict[str, Any]:
    """Summary of a checkpoint directory, or of a convert output root (then keyed ``target`` / ``drafter``, plus the
    manifest's provenance)."""
    root = Path(ckpt_dir)
    if not root.is_dir():
        raise ArtifactError(root, "is not a directory", "pass a checkpoint directory or a `convert --out` directory")
    if (root / "config.json").is_file():
        return inspect_checkpoint(root, stats)
    if (root / mf.MANIFEST).is_file():
        try:
            manifest = json.loads((root / mf.MANIFEST).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ArtifactError(root / mf.MANIFEST, f"unreadable JSON ({exc})", "re-run the conversion") from exc
        parts = {what: inspect_checkpoint(root / what, stats) for what in ("target", "drafter") if (root / what).is_dir()}
        return {
            "path": str(root),
            "format": manifest.get("format"),
            "config": manifest.get("config"),
            "calibration": manifest.get("calibration"),
            "tools": manifest.get("tools"),
            "git": manifest.get("git"),
            # bytes on disk of the weight files (config.json files are not counted)
            "sizes": {**{f"{what}_bytes": s["total_file_bytes"] for what, s in parts.items()},
                      "total_bytes": sum(s["total_file_bytes"] for s in parts.values())},
            **parts,
        }
    raise ArtifactError(root, "holds neither config.json nor manifest.json",
                        "pass a checkpoint directory or a `convert --out` directory")
