"""The ``config.json`` of the two TensorRT-LLM-format checkpoints this package writes, the concrete weight plans
(``weight_map.Entry`` lists) for a given spec and TP size, and the way back from a written config to our specs.

Target: a TensorRT-LLM 1.2.x checkpoint config (trtllm_triton.md §1.2; keys recorded with sources in
``tests/data/trtllm_1_2_1/checkpoint_contract.json``), architecture ``LlamaForCausalLM`` or ``Qwen3ForCausalLM``.

Drafter: architecture ``DFlashDrafterForTRTLLM``, ours; TensorRT-LLM 1.2.x has no DFlash in its engine path
(trtllm_triton.md §0.3). The config uses the same key vocabulary as a TRT-LLM decoder config where the meaning is the
same (``hidden_size``, ``head_size``, ``norm_epsilon``, ``rotary_base``, ``mapping``, ``quantization``, ...) and puts
the DFlash facts under ``dflash``: ``block_size``, ``mask_token_id``, ``target_layer_ids`` (output of decoder layer i,
HF ``hidden_states[i + 1]``), ``num_target_layers``, ``layer_types``, ``layer_causal``, ``sliding_window``.
``embedding_source`` / ``lm_head_source`` say that the drafter has neither: it embeds with the target's
``transformer.vocab_embedding.weight`` and projects with the target's ``lm_head.weight``. Weight names: see
``weight_map.DRAFTER_GLOBAL`` and ``weight_map.DRAFTER_LAYER`` (``drafter.context_proj``, ``drafter.context_norm``,
``drafter.ln_f``, ``drafter.layers.{i}.<TRT-LLM decoder-layer names>``).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.errors import ArtifactError, require
from trtllm_dflash.specs import DrafterSpec, LayerType, RopeSpec, TargetFamily, TargetSpec

DRAFTER_ARCHITECTURE = "DFlashDrafterForTRTLLM"
TARGET_ARCHITECTURES = {TargetFamily.LLAMA: "LlamaForCausalLM", TargetFamily.QWEN3: "Qwen3ForCausalLM"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _rotary_scaling(rope: RopeSpec) -> dict[str, Any] | None:
    """HF-style ``rope_scaling`` dict, which is what TRT-LLM's configs carry as ``rotary_scaling``."""
    if rope.kind == "default":
        return None
    out: dict[str, Any] = {"type": rope.kind, "rope_type": rope.kind, "factor": rope.factor}
    if rope.kind == "llama3":
        out |= {
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    return out


def mapping(tp: int) -> dict[str, Any]:
    # Mapping.to_dict() minus `rank`, for a TP-only layout (tensorrt_llm/mapping.py).
    return {"world_size": tp, "gpus_per_node": 8, "cp_size": 1, "tp_size": tp, "pp_size": 1,
            "moe_tp_size": tp, "moe_ep_size": 1}


def no_quantization() -> dict[str, Any]:
    # QuantConfig dataclass fields with their defaults (tensorrt_llm/models/modeling_utils.py).
    return {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128, "smoothquant_val": 0.5,
            "clamp_val": None, "use_meta_recipe": False, "has_zero_point": False, "pre_quant_scale": False,
            "exclude_modules": None}


def parallel_embedding(spec: TargetSpec, tp: int) -> bool:
    """Shard the embedding along the vocabulary when TP > 1 and the vocabulary divides evenly; replicate otherwise."""
    return tp > 1 and spec.vocab_size % tp == 0


def target_config(spec: TargetSpec, dtype: str, tp: int) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "architecture": TARGET_ARCHITECTURES[spec.family],
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_size": spec.head_dim,  # explicit: Qwen3's head_dim is not hidden / heads
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": spec.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": spec.max_position_embeddings,
        "rotary_embedding_dim": spec.head_dim,
        "rotary_base": spec.rope.theta,
        "rotary_scaling": _rotary_scaling(spec.rope),
        "qk_layernorm": spec.qk_norm,
        "use_parallel_embedding": parallel_embedding(spec, tp),
        "embedding_sharding_dim": 0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "mlp_bias": False,
        "attn_bias": spec.attention_bias,
        "mapping": mapping(tp),
        "quantization": no_quantization(),
    }
    if spec.family is TargetFamily.QWEN3:
        cfg["qwen_type"] = "qwen3"
    return cfg


def drafter_config(spec: DrafterSpec, target: TargetSpec, dtype: str, tp: int) -> dict[str, Any]:
    return {
        "architecture": DRAFTER_ARCHITECTURE,
        "dtype": dtype,
        "vocab_size": target.vocab_size,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_size": spec.head_dim,
        "intermediate_size": spec.intermediate_size,
        "hidden_act": "silu",
        "norm_epsilon": spec.rms_norm_eps,
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": target.max_position_embeddings,
        "rotary_base": spec.rope.theta,
        "rotary_scaling": _rotary_scaling(spec.rope),
        "qk_layernorm": True,
        "attn_bias": spec.attention_bias,
        "mapping": mapping(tp),
        "quantization": no_quantization(),
        "embedding_source": "target:transformer.vocab_embedding.weight",
        "lm_head_source": "target:lm_head.weight",
        "dflash": {
            "block_size": spec.block_size,
            "mask_token_id": spec.mask_token_id,
            "target_layer_ids": list(spec.target_layer_ids),
            "tap_convention": "output of target decoder layer i (HF hidden_states[i + 1])",
            "num_target_layers": spec.num_target_layers or target.num_hidden_layers,
            "context_proj_in_features": spec.num_taps * spec.hidden_size,
            "layer_types": [t.value for t in spec.layer_types],
            "layer_causal": list(spec.layer_causal),
            "sliding_window": spec.sliding_window,
        },
    }


def _rope_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    return {"rope_theta": cfg["rotary_base"], "rope_scaling": cfg.get("rotary_scaling")}


@contextlib.contextmanager
def _required_keys(source: Path):
    try:
        yield
    except (KeyError, TypeError, ValueError) as exc:
        raise ArtifactError(source, f"missing or malformed entry ({type(exc).__name__}: {exc})",
                            "re-run the conversion") from None


def tp_size(cfg: dict[str, Any], source: Path) -> int:
    with _required_keys(source):
        tp = cfg["mapping"]["tp_size"]
    require(isinstance(tp, int) and tp >= 1, f"{source}.mapping.tp_size", tp, "must be an integer >= 1")
    return tp


def target_spec_from_config(cfg: dict[str, Any], source: Path, extras: dict[str, Any] | None = None) -> TargetSpec:
    """Our ``TargetSpec`` from a written target ``config.json``; ``extras`` (from the manifest) add eos/bos ids."""
    families = {v: k for k, v in TARGET_ARCHITECTURES.items()}
    arch = cfg.get("architecture")
    if arch not in families:
        raise ArtifactError(source, f"architecture {arch!r} is not one of {sorted(families)}",
                            "pass a target checkpoint written by `trtllm-dflash convert`")
    extras = extras or {}
    with _required_keys(source):
        hf = {
            "model_type": families[arch].value,
            "architectures": [arch],
            "vocab_size": cfg["vocab_size"],
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_hidden_layers": cfg["num_hidden_layers"],
            "num_attention_heads": cfg["num_attention_heads"],
            "num_key_value_heads": cfg["num_key_value_heads"],
            "head_dim": cfg["head_size"],
            "rms_norm_eps": cfg["norm_epsilon"],
            "max_position_embeddings": cfg["max_position_embeddings"],
            "tie_word_embeddings": cfg.get("tie_word_embeddings", False),
            "attention_bias": cfg.get("attn_bias", False),
            "eos_token_id": list(extras.get("eos_token_ids", [])),
            "bos_token_id": extras.get("bos_token_id"),
            "torch_dtype": cfg["dtype"],
            **_rope_hf(cfg),
        }
    return TargetSpec.from_hf_config(hf, prefix=str(source))


def drafter_spec_from_config(cfg: dict[str, Any], source: Path) -> DrafterSpec:
    if cfg.get("architecture") != DRAFTER_ARCHITECTURE:
        raise ArtifactError(source, f"architecture {cfg.get('architecture')!r} is not {DRAFTER_ARCHITECTURE!r}",
                            "pass a drafter checkpoint written by `trtllm-dflash convert`")
    with _required_keys(source):
        d = cfg["dflash"]
        types = [LayerType(t) for t in d["layer_types"]]
        default_causal = [t is LayerType.SLIDING for t in types]
        dcfg: dict[str, Any] = {"mask_token_id": d["mask_token_id"], "target_layer_ids": d["target_layer_ids"]}
        if list(d["layer_causal"]) != default_causal:
            require(len(set(d["layer_causal"])) == 1, f"{source}.dflash.layer_causal", d["layer_causal"],
                    "a non-default causality must be the same for every layer")
            dcfg["causal"] = d["layer_causal"][0]
        hf = {
            "architectures": ["DFlashDraftModel"],
            "block_size": d["block_size"],
            "num_target_layers": d["num_target_layers"],
            "dflash_config": dcfg,
            "hidden_size": cfg["hidden_size"],
            "intermediate_size": cfg["intermediate_size"],
            "num_hidden_layers": cfg["num_hidden_layers"],
            "num_attention_heads": cfg["num_attention_heads"],
            "num_key_value_heads": cfg["num_key_value_heads"],
            "head_dim": cfg["head_size"],
            "rms_norm_eps": cfg["norm_epsilon"],
            "layer_types": d["layer_types"],
            "sliding_window": d["sliding_window"],
            "attention_bias": cfg.get("attn_bias", False),
            "vocab_size": cfg.get("vocab_size"),
            **_rope_hf(cfg),
        }
    return DrafterSpec.from_hf_config(hf, prefix=str(source))


# ----------------------------------------------------------------------------------------------------------------------
# Weight plans


def target_source_shapes(spec: TargetSpec) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> full shape, read off our TargetModel built on the meta device (no memory)."""
    from trtllm_dflash.models.target import TargetBody

    with torch.device("meta"):
        body = TargetBody(spec)
    shapes = {f"model.{n}": tuple(p.shape) for n, p in body.named_parameters()}
    shapes["lm_head.weight"] = (spec.vocab_size, spec.hidden_size)
    return shapes


def drafter_source_shapes(spec: DrafterSpec) -> dict[str, tuple[int, ...]]:
    from trtllm_dflash.models.drafter import DrafterModel

    with torch.device("meta"):
        model = DrafterModel(spec, device="meta", max_positions=1)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def target_entries(spec: TargetSpec, tp: int, lm_head_from_embedding: bool,
                   use_parallel_embedding: bool | None = None) -> list[wm.Entry]:
    """The target's plan. ``lm_head_from_embedding``: a tied checkpoint without its own ``lm_head.weight``; the
    embedding then also feeds ``lm_head.weight`` (written explicitly, as TRT-LLM's Qwen converter does).
    ``use_parallel_embedding``: as recorded in a written config (default: this package's choice)."""
    if use_parallel_embedding is None:
        use_parallel_embedding = parallel_embedding(spec, tp)
    aliases = {"lm_head.weight": "model.embed_tokens.weight"} if lm_head_from_embedding else {}
    return wm.expand(*wm.TARGET_MAPS[spec.family], spec.num_hidden_layers, target_source_shapes(spec),
                     parallel_embedding=use_parallel_embedding, aliases=aliases)


def drafter_entries(spec: DrafterSpec) -> list[wm.Entry]:
    return wm.expand(wm.DRAFTER_GLOBAL, wm.DRAFTER_LAYER, spec.num_hidden_layers,
                     drafter_source_shapes(spec), parallel_embedding=False)
