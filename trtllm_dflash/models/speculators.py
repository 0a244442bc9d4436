"""DFlash drafters in vLLM's ``speculators`` format: loading them as-is into ``DrafterModel``, and writing ours out.

The format (speculators 0.9.0 ``DFlashDraftModel.save_pretrained``, read off ``speculators/models/dflash/core.py``
and ``speculators/model.py``; config translation in ``specs._from_speculators``):

  config.json        ``speculators_model_type: "dflash"``, ``transformer_layer_config``, ``draft_vocab_size``,
                     ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` (= our target_layer_ids + 1),
                     ``speculators_config`` (algorithm, greedy proposal of block_size - 1 tokens, verifier path and
                     architectures). ``architectures`` is ``["DFlashDraftModel"]``, the z-lab name too, so the
                     format is told apart by ``speculators_model_type``.
  model.safetensors  the draft body under z-lab's names (``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.…``);
                     with a reduced draft vocabulary also ``lm_head.weight`` [draft_vocab, hidden] (the drafter's
                     own head, kept because it cannot be derived from the target's) and the buffers ``d2t``
                     [draft_vocab] int64 offsets and ``t2d`` [target_vocab] bool (``models/draft_vocab.py``).
                     Never saved: ``embed_tokens`` and ``verifier_lm_head`` / ``verifier_norm`` (rebuilt from the
                     verifier: the block is embedded with the TARGET's table, mask row included, exactly as for
                     z-lab drafters), and ``lm_head`` when the draft vocabulary is the full one (it is the
                     verifier's frozen head then).

So loading renames only the head (``lm_head.weight`` -> ``draft_head.lm_head.weight``) and turns d2t into
absolute ids; the body loads under its own names with the same strict checks as a z-lab drafter.

A DSpark drafter (``speculators_model_type: "dspark"``, ``DSparkDraftModel``) is the same layout plus its heads'
config fields (``markov_rank``, ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
``sample_from_anchor``; ``specs._dspark_heads``) and tensors (``markov_head.*``, ``confidence_head.*``), which load
under ``dspark.`` (``models/dspark.py``); the writer below writes them back the same way.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trtllm_dflash.errors import ConfigError, read_json, require
from trtllm_dflash.models.weights import load_into, read_state_dict, write_drafter, write_json, write_state_dict
from trtllm_dflash.specs import DrafterSpec, LayerType, TargetSpec

log = logging.getLogger(__name__)

FORMAT_VERSION = "0.9.0"  # the speculators release whose layout this module reads and writes
HEAD = "lm_head.weight"
D2T, T2D = "d2t", "t2d"
DSPARK_PREFIXES = ("markov_head.", "confidence_head.")
# verifier-owned tensors an older or hand-made checkpoint may still hold; the target's own are used instead
_VERIFIER_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")


def is_speculators_dir(model_dir: str | Path) -> bool:
    """True when ``model_dir/config.json`` is a speculators config (it names a ``speculators_model_type``)."""
    path = Path(model_dir) / "config.json"
    try:
        return "speculators_model_type" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


def split_state(state: dict[str, torch.Tensor], spec: DrafterSpec, source: object):
    """A speculators checkpoint's tensors -> (body under DrafterModel names, d2t or None, t2d or None).

    Refuses a reduced-vocabulary checkpoint without its head or its d2t table: drafting it through the target's
    head instead is the silent failure this format invites (``models/draft_vocab.py``)."""
    state = dict(state)
    for name in _VERIFIER_COPIES:
        if state.pop(name, None) is not None:
            log.info("%s: ignoring %s (the verifier's; the target's own is used)", source, name)
    for name in [n for n in state if n.startswith(DSPARK_PREFIXES)]:  # DSpark's heads (models/dspark.py)
        state["dspark." + name] = state.pop(name)
    head, d2t, t2d = state.pop(HEAD, None), state.pop(D2T, None), state.pop(T2D, None)
    if spec.draft_vocab_size is None:
        rows = d2t.numel() if d2t is not None else head.shape[0] if head is not None else spec.vocab_size
        require(rows == spec.vocab_size, "drafter.draft_vocab_size", spec.vocab_size,
                f"says the full vocabulary, but model.safetensors holds a draft vocabulary of {rows} ids "
                f"({D2T if d2t is not None else HEAD}); drafting through the target's head would drop it",
                f"set draft_vocab_size to {rows} in config.json")
        if head is not None:
            log.info("%s: ignoring %s: with the full vocabulary it is the verifier's frozen head, and the target's "
                     "is used", source, HEAD)
        return state, None, None
    n = spec.draft_vocab_size
    fix = ("add the draft vocabulary's tables to model.safetensors (speculators: load the d2t/t2d .npy files of "
           "its training data with DFlashDraftModel.from_pretrained(path, t2d=..., d2t=...) and save_pretrained), "
           "or use a drafter with draft_vocab_size equal to the target's vocab_size")
    if d2t is None:
        raise ConfigError("drafter.d2t", "absent from model.safetensors",
                          f"a drafter with draft_vocab_size={n} < vocab_size={spec.vocab_size} needs its "
                          "draft-to-target id map; without it the drafted ids cannot be verified", fix)
    if head is None:
        raise ConfigError(f"drafter.{HEAD}", "absent from model.safetensors",
                          f"a drafter with draft_vocab_size={n} keeps its own [{n}, hidden] LM head; the "
                          "target's head is a different matrix", "re-save the drafter with speculators' "
                          "save_pretrained, which keeps lm_head for a reduced vocabulary")
    state["draft_head.lm_head.weight"] = head
    return state, d2t, t2d


def load_into_drafter(model, model_dir: str | Path) -> None:
    """Load a speculators drafter directory into ``model`` (a ``DrafterModel`` built from the same spec)."""
    body, d2t, t2d = split_state(read_state_dict(model_dir), model.spec, model_dir)
    load_into(model, body, model_dir)
    if model.draft_head is not None:
        model.draft_head.load_map(d2t, t2d, model_dir)


# ----------------------------------------------------------------------------------------------------------------------
# Writing


def layer_config(spec: DrafterSpec, target: TargetSpec) -> dict[str, Any]:
    """The ``transformer_layer_config`` speculators would nest for this drafter (a Qwen3Config, every key written
    explicitly so no reader depends on a config class's defaults)."""
    rope: dict[str, Any] = {"rope_theta": spec.rope.theta, "rope_type": spec.rope.kind}
    if spec.rope.kind != "default":
        rope |= {"factor": spec.rope.factor}
    if spec.rope.kind == "llama3":
        rope |= {"low_freq_factor": spec.rope.low_freq_factor, "high_freq_factor": spec.rope.high_freq_factor,
                 "original_max_position_embeddings": spec.rope.original_max_position_embeddings}
    sliding = LayerType.SLIDING in spec.layer_types
    return {
        "model_type": "qwen3",
        "vocab_size": target.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": spec.attention_bias,
        "attention_dropout": 0.0,
        "layer_types": [t.value for t in spec.layer_types],
        "use_sliding_window": sliding,
        "sliding_window": spec.sliding_window,
        "tie_word_embeddings": False,
    }


def speculators_config(spec: DrafterSpec, target: TargetSpec, verifier: str, verifier_architectures: list[str],
                       dtype: torch.dtype) -> dict[str, Any]:
    """config.json of the speculators format (module docstring) for ``spec``; ``verifier`` is the target's path or
    hub id, which speculators loads the embeddings from."""
    sliding_causal = {c for c, t in zip(spec.layer_causal, spec.layer_types) if t is LayerType.SLIDING}
    full_causal = {c for c, t in zip(spec.layer_causal, spec.layer_types) if t is LayerType.FULL}
    if True in full_causal or len(sliding_causal) > 1:
        raise ConfigError("drafter.layer_causal", list(spec.layer_causal),
                          "speculators makes full-attention layers bidirectional and every sliding layer alike "
                          "(sliding_window_non_causal)", "write this drafter in the z-lab format instead")
    if sliding_causal == {True}:
        log.warning("causal sliding layers beside bidirectional full-attention ones are written with "
                    "sliding_window_non_causal false, which speculators reads as meant; vLLM 0.32 makes every layer "
                    "causal from it, so it drafts other tokens than this drafter was trained to")
    kind = "dflash" if spec.dspark is None else "dspark"
    cfg = {
        "architectures": ["DFlashDraftModel" if spec.dspark is None else "DSparkDraftModel"],
        "speculators_model_type": kind,
        "speculators_version": FORMAT_VERSION,
        "transformer_layer_config": layer_config(spec, target),
        "draft_vocab_size": spec.draft_vocab_size or target.vocab_size,
        "block_size": spec.trained_block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in spec.target_layer_ids],
        "mask_token_id": spec.mask_token_id,
        # speculators reads this flag for sliding layers only (its full-attention layers are always bidirectional);
        # vLLM 0.32 sets every layer's causality from it (``causal = not sliding_window_non_causal``), so a drafter
        # without sliding layers says true: a no-op for speculators, bidirectional blocks in vLLM
        "sliding_window_non_causal": sliding_causal in (set(), {False}),
        "sample_from_anchor": spec.anchor_predicts,
        "tie_word_embeddings": False,
        "dtype": str(dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": kind,
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": spec.block_size - 1,
                                  "accept_tolerance": 0.0, "verifier_accept_k": 1}],
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
    if spec.dspark is not None:  # DSparkSpeculatorConfig's fields (specs._dspark_heads reads them back)
        cfg |= {"markov_rank": spec.dspark.markov_rank, "markov_head_type": spec.dspark.markov_head_type,
                "enable_confidence_head": spec.dspark.confidence_head,
                "confidence_head_with_markov": spec.dspark.confidence_with_markov}
    return cfg


def vocab_tables(draft_to_target: torch.Tensor, target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute ids [n] (ascending) -> (d2t offsets [n] int64, t2d mask [target_vocab_size] bool)."""
    ids = draft_to_target.to(torch.long).cpu()
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(ids.numel()), t2d


def write_speculators_drafter(out_dir: str | Path, model, target: TargetSpec, verifier: str | Path,
                              dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write ``model`` (a DrafterModel) as a speculators DFlash (or DSpark) checkpoint that speculators' own
    ``DFlashDraftModel.from_pretrained`` (``DSparkDraftModel``'s) reads. ``verifier``: the target directory (its
    config.json gives the architectures) or a hub id. A drafter that drafts over a draft vocabulary (its own head, or
    rows of the target's head chosen by ``--draft-vocab``) is written as a reduced-vocabulary drafter: its head, the
    ``d2t`` / ``t2d`` tables and ``draft_vocab_size``, so every reader drafts over the same ids."""
    from trtllm_dflash.staging import staged_output

    spec: DrafterSpec = model.spec
    if model.draft_head is not None:  # its own head, or one derived from the target's rows (``--draft-vocab``)
        spec = replace(spec, draft_vocab_size=model.draft_head.draft_vocab_size)
    vpath = Path(verifier)
    archs = (read_json(vpath / "config.json", "pass the target directory").get("architectures") or []) \
        if vpath.is_dir() else []
    state = {k.removeprefix("dspark."): v.detach().to(dtype) for k, v in model.state_dict().items()
             if not k.startswith("draft_head.")}
    if model.draft_head is not None:
        state[HEAD] = model.draft_head.lm_head.weight.detach().to(dtype)
        state[D2T], state[T2D] = vocab_tables(model.draft_head.draft_to_target, target.vocab_size)
    out_dir = Path(out_dir)
    with staged_output(out_dir, force=True) as tmp:
        write_json(speculators_config(spec, target, str(verifier), archs, dtype), tmp / "config.json")
        write_state_dict(state, tmp / "model.safetensors")
    return out_dir


def write_zlab_copy(model_dir: str | Path, out_dir: str | Path, target: TargetSpec,
                    dtype: torch.dtype = torch.bfloat16) -> Path:
    """A full-vocabulary speculators drafter rewritten in the z-lab layout (``DFlashDraftModel`` config with
    ``dflash_config``), for consumers that read only that layout (TensorRT-LLM's DFlash loader). A reduced
    vocabulary is refused by ``DrafterSpec.to_hf_config``: the z-lab layout has no head to carry it."""
    spec = DrafterSpec.load(model_dir)
    body, _, _ = split_state(read_state_dict(model_dir), spec, model_dir)
    spec.to_hf_config(target=target)  # refuses a reduced vocabulary before anything is written
    return write_drafter(out_dir, spec, target, body, dtype=dtype)
