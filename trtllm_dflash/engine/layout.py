"""Where the engine build finds things in a ``convert`` / ``quantize`` output, and the pure per-engine facts the model
classes need at build time (tap layers, borrowed weights, RoPE tables, input shape profiles).

Shared by ``engine/build.py`` (runs here) and ``engine/models/*.py`` (run only inside NVIDIA's TensorRT-LLM container,
loaded by ``trtllm-build --model_cls_file``), so everything the model classes compute without TensorRT is tested here.

Layout (``convert/checkpoint.py``): ``DIR/target`` and ``DIR/drafter`` are siblings; ``DIR/manifest.json`` records
their hashes. ``trtllm-build`` hands a model class only the directory it builds from, so the target class finds the
tap layers in the sibling drafter's config, and the drafter class finds the embedding / LM head it borrows in the
sibling target's rank files.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

from trtllm_dflash.engine.contract import TensorIO
from trtllm_dflash import errors
from trtllm_dflash.errors import ArtifactError, require

TARGET_DIR = "target"
DRAFTER_DIR = "drafter"
MANIFEST = "manifest.json"
# drafter engine parameter -> the drafter config key naming the target tensor it is loaded from
BORROWED = {"vocab_embedding.weight": "embedding_source", "lm_head.weight": "lm_head_source"}


def read_json(path: Path) -> dict[str, Any]:
    return errors.read_json(path, "pass a directory written by `trtllm-dflash convert`")


def sibling(ckpt_dir: str | Path, name: str) -> Path:
    return Path(ckpt_dir).resolve().parent / name


def tap_layer_ids(target_ckpt_dir: str | Path) -> tuple[int, ...]:
    """Target decoder layers whose outputs (HF ``hidden_states[i + 1]``) form the taps, from the sibling drafter."""
    cfg = read_json(sibling(target_ckpt_dir, DRAFTER_DIR) / "config.json")
    try:
        return tuple(int(i) for i in cfg["dflash"]["target_layer_ids"])
    except (KeyError, TypeError, ValueError):
        raise ArtifactError(sibling(target_ckpt_dir, DRAFTER_DIR), "config.json has no dflash.target_layer_ids",
                            "re-run `trtllm-dflash convert`") from None


def borrowed_tensors(drafter_cfg: dict[str, Any], source: object) -> dict[str, str]:
    """drafter engine parameter -> target checkpoint tensor name (``"target:<name>"`` in the drafter config)."""
    out = {}
    for param, key in BORROWED.items():
        where, _, name = str(drafter_cfg.get(key, "")).partition(":")
        require(where == TARGET_DIR and bool(name), f"{source}.{key}", drafter_cfg.get(key),
                "must be 'target:<tensor name>'", "re-run `trtllm-dflash convert`")
        out[param] = name
    return out


def rope_tables(inv_freq: list[float], max_positions: int):
    """cos, sin as float32 numpy [max_positions, head_dim] in the HF rotate_half layout (``models/layers.Rotary``)."""
    import numpy as np

    t = np.arange(max_positions, dtype=np.float64)[:, None]  # [P, 1]
    freqs = t * np.asarray(inv_freq, dtype=np.float64)[None, :]  # [P, hd/2]
    emb = np.concatenate([freqs, freqs], axis=-1)  # [P, hd]
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def qkv_rows(num_heads: int, num_kv_heads: int, head_dim: int) -> dict[str, tuple[int, int]]:
    """(first row, rows) of q, k, v in a fused ``attention.qkv.weight`` [(nh + 2·n_kv)·hd, hidden]."""
    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}


def input_profiles(ios: tuple[TensorIO, ...], dims: dict[str, int | tuple[int, int, int]]
                   ) -> dict[str, tuple[list[int], OrderedDict]]:
    """``Tensor(shape=..., dim_range=...)`` for each contract input: shape with -1 for dynamic dimensions, and
    symbolic dim -> [(min, opt, max)] (one optimization profile).

    ``dims`` maps every symbol of the contract shapes ("T", "n", "S", "K*H", ...) to a static size or a dynamic
    (min, opt, max) range. Worked example: taps ("T", "K*H") with T=(1, 4096, 8192), K*H=12288 ->
    ([-1, 12288], OrderedDict(T=[(1, 4096, 8192)], K*H=[(12288, 12288, 12288)])).
    """
    out = {}
    for io in ios:
        shape, ranges = [], OrderedDict()
        for sym in io.shape:
            require(sym in dims, f"{io.name}.shape", io.shape, f"symbol {sym!r} has no size",
                    "this is a bug in the engine contract")
            v = dims[sym]
            shape.append(-1 if isinstance(v, tuple) else int(v))
            ranges[sym] = [tuple(v) if isinstance(v, tuple) else (v, v, v)]
        out[io.name] = (shape, ranges)
    return out


def dynamic(max_value: int) -> tuple[int, int, int]:
    """(min, opt, max) for a dynamic dimension: opt at the middle of the range (TensorRT tunes for it)."""
    return (1, max(1, max_value // 2), max_value)


def engine_dims(*, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, taps_width: int,
                max_batch_size: int, max_seq_len: int, max_num_tokens: int) -> dict[str, int | tuple[int, int, int]]:
    """Sizes of every symbol in contract.py's shapes for the kv_inject and drafter engines (see contract.py for the
    symbols): T tokens per kv_inject call, n sequences and S context rows per drafter call are dynamic."""
    return {"T": dynamic(max_num_tokens), "K*H": taps_width, "L": num_layers, "n_kv": num_kv_heads, "hd": head_dim,
            "n": dynamic(max_batch_size), "B": block_size, "B-1": block_size - 1, "S": dynamic(max_seq_len)}
