"""Reading and writing Hugging Face safetensors checkpoints (single file or sharded with an index), with strict,
nanoGPT-style coverage checks: every expected tensor present with the right shape, nothing unexpected left over."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from trtllm_dflash.errors import ArtifactError

if TYPE_CHECKING:
    from trtllm_dflash.specs import DrafterSpec, TargetSpec

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def read_state_dict(model_dir: str | Path, names: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """All tensors of ``model_dir`` (``model.safetensors``, or the shards named by ``model.safetensors.index.json``);
    with ``names``, only those (read from their shards alone; a missing name is an ArtifactError naming it), so a
    process that needs two tensors of a large target does not hold the rest."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ArtifactError(index, f"malformed safetensors index ({exc})", "restore the checkpoint") from exc
        files = sorted(set(weight_map.values()))
    elif (model_dir / SINGLE).is_file():
        files = [SINGLE]
    else:
        raise ArtifactError(
            model_dir, f"no {SINGLE} or {INDEX}", "the directory must hold Hugging Face safetensors weights"
        )
    if names is not None and index.is_file():
        files = sorted({weight_map[n] for n in names if n in weight_map})
    state: dict[str, torch.Tensor] = {}
    for name in files:
        path = model_dir / name
        if not path.is_file():
            raise ArtifactError(path, "shard named in the index is missing", "re-download the checkpoint")
        try:
            if names is None:
                state.update(load_file(str(path)))
                continue
            with safe_open(str(path), framework="pt") as f:
                state.update({n: f.get_tensor(n) for n in names if n in f.keys()})
        except (SafetensorError, OSError, ValueError) as exc:
            raise ArtifactError(path, f"unreadable safetensors ({exc})", "re-download or re-create the file") from exc
    missing = [n for n in names or () if n not in state]
    if missing:
        raise ArtifactError(model_dir, f"no tensor {missing[0]!r} in the checkpoint", "pass the target's own directory")
    return state


def load_into(module: nn.Module, state: dict[str, torch.Tensor], source: str | Path, ignore: tuple[str, ...] = ()):
    """Copy ``state`` into ``module``'s parameters: strict names, strict shapes, dtype converted to the module's.

    ``ignore`` lists exact tensor names that may be present without a parameter (e.g. a tied ``lm_head.weight``).
    """
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params) - set(ignore))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected tensors (e.g. {unexpected[:3]})")
        raise ArtifactError(source, "weights do not match the config: " + "; ".join(parts), "check the checkpoint")
    with torch.no_grad():
        for name, p in params.items():
            t = state[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ArtifactError(
                    source, f"tensor {name} has shape {list(t.shape)}, the config implies {list(p.shape)}",
                    "check that config.json belongs to these weights",
                )
            p.copy_(t.to(p.dtype))


def write_state_dict(state: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``state`` to ``path`` atomically (temporary file in the same directory, then rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in state.items()}, tmp, metadata=metadata or {"format": "pt"})
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_json(obj, path: str | Path) -> None:
    """Write JSON atomically."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    os.replace(tmp, path)


def write_drafter(out_dir: str | Path, spec: DrafterSpec, target: TargetSpec, state: dict[str, torch.Tensor],
                  dtype: torch.dtype = torch.bfloat16, extra_config: dict | None = None) -> Path:
    """Write a z-lab-format drafter directory (config.json + model.safetensors), atomically as a whole."""
    from trtllm_dflash.staging import staged_output

    out_dir = Path(out_dir)
    with staged_output(out_dir, force=True) as tmp:
        cfg = spec.to_hf_config(target=target) | {"torch_dtype": str(dtype).removeprefix("torch.")}
        write_json(cfg | (extra_config or {}), tmp / "config.json")
        write_state_dict({k: v.to(dtype) for k, v in state.items()}, tmp / "model.safetensors")
    return out_dir
