"""Provenance for a converted checkpoint: input and output file hashes, tool versions and the git commit, written as
``OUT/manifest.json`` next to ``target/`` and ``drafter/`` (house_style.md §3.2: every stage records what it read, with
what, and what it wrote)."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST = "manifest.json"
FORMAT = "trtllm_dflash.checkpoint/1"
TRTLLM_CONTRACT = "1.2.1"  # the TensorRT-LLM checkpoint layout these files follow (tests/data/trtllm_1_2_1/)


def sha256_file(path: Path, chunk_bytes: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def hash_tree(root: Path) -> dict[str, str]:
    """relative path -> sha256 of every regular file under ``root`` (hidden files skipped), sorted."""
    root = Path(root)
    return {
        str(p.relative_to(root)): sha256_file(p)
        for p in sorted(root.rglob("*"))
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    }


def tool_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("trtllm-dflash", "torch", "safetensors", "numpy", "transformers", "nvidia-modelopt"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    if out["trtllm-dflash"] is None:
        from trtllm_dflash import __version__

        out["trtllm-dflash"] = __version__
    return out


def git_state() -> dict[str, Any] | None:
    """Commit and dirtiness of the checkout this package runs from; None outside a git checkout."""
    here = Path(__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def jsonable(obj: Any) -> Any:
    """Dataclasses, enums, tuples and paths -> plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj
