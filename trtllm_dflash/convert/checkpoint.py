"""``convert``: a Hugging Face target plus a z-lab DFlash drafter -> one artifact directory

    OUT/
      target/   config.json + rank{r}.safetensors   TensorRT-LLM 1.2.x checkpoint (LlamaForCausalLM / Qwen3ForCausalLM)
      drafter/  config.json + rank{r}.safetensors   DFlashDrafterForTRTLLM (configs.py documents it)
      manifest.json                                 input/output sha256, resolved config, tool versions, git commit

Everything is validated before anything is written (specs, the target/drafter pair, TP divisibility, every source
tensor's presence and shape, full coverage of the weight maps). The output is assembled in a temporary directory next
to OUT and renamed into place at the end, so OUT is either complete or absent; an existing OUT is refused unless
``force``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from trtllm_dflash.convert import configs
from trtllm_dflash.convert import manifest as mf
from trtllm_dflash import staging
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.errors import ArtifactError, require
from trtllm_dflash.models import speculators
from trtllm_dflash.models.weights import read_state_dict, write_json, write_state_dict
from trtllm_dflash.specs import DrafterSpec, TargetSpec, check_pair

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ConvertConfig:
    target_dir: Path
    drafter_dir: Path
    out_dir: Path
    dtype: str = "bfloat16"  # dtype of every written tensor: bfloat16 | float16 | float32
    tp: int = 1  # tensor-parallel ranks = rank files per checkpoint
    force: bool = False  # replace an existing out_dir

    def validate(self) -> None:
        require(self.dtype in configs.DTYPES, "dtype", self.dtype, f"must be one of {sorted(configs.DTYPES)}",
                "pass --dtype bfloat16 or --dtype float16")
        require(isinstance(self.tp, int) and not isinstance(self.tp, bool) and self.tp >= 1, "tp", self.tp,
                "must be an integer >= 1")


@dataclass(frozen=True, slots=True)
class CheckpointArtifact:
    """What ``convert`` produced (the handoff to the build stage)."""

    root: Path
    target_dir: Path
    drafter_dir: Path
    manifest_path: Path
    tp: int
    dtype: str


def check_tp(target: TargetSpec, drafter: DrafterSpec, tp: int) -> None:
    """TP must split heads, KV heads and the MLP evenly for both models (KV heads are not duplicated)."""
    fix = "choose a --tp that divides it"
    for name, spec in (("target", target), ("drafter", drafter)):
        for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(spec, key)
            require(value % tp == 0, "tp", tp, f"must divide {name}.{key} ({value})", fix)


def _check_sources(entries: list[wm.Entry], state: dict[str, torch.Tensor], source: Path, aliased=()) -> None:
    wm.check_coverage(entries, state.keys(), source, aliased)
    for e in entries:
        for name, shape in zip(e.src, e.src_shapes):
            t = state[name]
            if tuple(t.shape) != shape:
                raise ArtifactError(source, f"tensor {name} has shape {list(t.shape)}, the config implies "
                                    f"{list(shape)}", "check that config.json belongs to these weights")
            if not t.is_floating_point():
                raise ArtifactError(source, f"tensor {name} has dtype {t.dtype}, expected a floating-point tensor",
                                    "convert from an unquantized checkpoint")


def _write_ranks(entries: list[wm.Entry], state: dict[str, torch.Tensor], tp: int, dtype: torch.dtype,
                 out: Path, what: str) -> None:
    for rank in tqdm(range(tp), desc=f"{what} ranks", unit="rank", disable=None):
        tensors, seen = {}, set()
        for e in entries:
            piece = wm.shard(e, [state[s] for s in e.src], tp, rank).to(dtype).contiguous()
            if piece.data_ptr() in seen:  # a tied lm_head at TP 1 is the embedding itself: safetensors wants a copy
                piece = piece.clone()
            seen.add(piece.data_ptr())
            expected = wm.rank_shape(e, tp)
            # An internal invariant, not an input problem: the plan and the sharding must agree.
            assert tuple(piece.shape) == expected, (e.dst, tuple(piece.shape), expected)
            tensors[e.dst] = piece
        write_state_dict(tensors, out / f"rank{rank}.safetensors")


def convert(target_dir, drafter_dir, out_dir, dtype: str = "bfloat16", tp: int = 1, force: bool = False) -> Path:
    """Convert; returns OUT. Raises ConfigError / ArtifactError (one line: field or path, value, rule, fix) on bad
    input, having written nothing."""
    return run_convert(ConvertConfig(Path(target_dir), Path(drafter_dir), Path(out_dir), dtype, tp, force)).root


def run_convert(cfg: ConvertConfig) -> CheckpointArtifact:
    cfg.validate()
    out = cfg.out_dir
    staging.refuse_existing(out, cfg.force)
    target, drafter = TargetSpec.load(cfg.target_dir), DrafterSpec.load(cfg.drafter_dir)
    check_pair(target, drafter)
    for name, spec in (("target", target), ("drafter", drafter)):
        require(not spec.attention_bias, f"{name}.attention_bias", True,
                "attention biases are not supported (the reference models have no o_proj bias; "
                "TRT-LLM's Qwen3 has none)",
                "use a checkpoint with attention_bias false")
    require(drafter.draft_vocab_size is None, "drafter.draft_vocab_size", drafter.draft_vocab_size,
            "the TensorRT-LLM drafter graph drafts through the target's LM head (lm_head_source); a drafter with "
            "its own reduced-vocabulary head and d2t map is not converted",
            "run it in the in-process runtime (trtllm-dflash generate), or use a full-vocabulary drafter")
    require(drafter.dspark is None, "drafter.speculators_model_type", "dspark",
            "the TensorRT-LLM drafter graph has no Markov or confidence head; converting the backbone alone would "
            "draft other tokens than the drafter was trained to",
            "run it in the in-process runtime or --backend torch, or serve it with TensorRT-LLM's own DSpark "
            "(make-repo --backend trtllm-pytorch, DSparkDecodingConfig)")
    check_tp(target, drafter, cfg.tp)

    t0 = time.perf_counter()
    tstate, dstate = read_state_dict(cfg.target_dir), read_state_dict(cfg.drafter_dir)
    if speculators.is_speculators_dir(cfg.drafter_dir):  # body under z-lab names; verifier copies dropped
        dstate, _, _ = speculators.split_state(dstate, drafter, cfg.drafter_dir)
    tied_alias = target.tie_word_embeddings and "lm_head.weight" not in tstate
    t_entries = configs.target_entries(target, cfg.tp, lm_head_from_embedding=tied_alias)
    d_entries = configs.drafter_entries(drafter)
    _check_sources(t_entries, tstate, cfg.target_dir, aliased=("model.embed_tokens.weight",) if tied_alias else ())
    _check_sources(d_entries, dstate, cfg.drafter_dir)
    inputs = {"target": mf.hash_tree(cfg.target_dir), "drafter": mf.hash_tree(cfg.drafter_dir)}

    with staging.staged_output(out, cfg.force) as tmp:
        torch_dtype = configs.DTYPES[cfg.dtype]
        for what, spec_cfg, entries, state in (
            ("target", configs.target_config(target, cfg.dtype, cfg.tp), t_entries, tstate),
            ("drafter", configs.drafter_config(drafter, target, cfg.dtype, cfg.tp), d_entries, dstate),
        ):
            (tmp / what).mkdir()
            write_json(spec_cfg, tmp / what / "config.json")
            _write_ranks(entries, state, cfg.tp, torch_dtype, tmp / what, what)
        manifest = {
            "format": mf.FORMAT,
            "trtllm_checkpoint_contract": mf.TRTLLM_CONTRACT,
            "config": mf.jsonable(cfg) | {"target_dir": str(cfg.target_dir.resolve()),
                                          "drafter_dir": str(cfg.drafter_dir.resolve())},
            "resolved": {"target": mf.jsonable(target), "drafter": mf.jsonable(drafter)},
            "inputs": inputs,
            "outputs": {what: mf.hash_tree(tmp / what) for what in ("target", "drafter")},
            "tools": mf.tool_versions(),
            "git": mf.git_state(),
            "created_unix_s": round(time.time()),
        }
        write_json(manifest, tmp / mf.MANIFEST)
    log.info("converted %s + %s -> %s (tp=%d, %s) in %.1f s", cfg.target_dir, cfg.drafter_dir, out, cfg.tp,
             cfg.dtype, time.perf_counter() - t0)
    return CheckpointArtifact(out, out / "target", out / "drafter", out / mf.MANIFEST, cfg.tp, cfg.dtype)
