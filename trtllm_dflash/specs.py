"""Typed views of the two Hugging Face configs this project consumes: the target's and the DFlash drafter's.

Both are parsed once, at the edge, into frozen dataclasses; everything downstream reads fields, never dict keys.
Validation errors name the field, the value, the rule and the fix (``errors.ConfigError``).

Tap convention (dflash.md §1.2): ``target_layer_ids`` are 0-based decoder-layer indices and the tapped activation is
the **output of decoder layer i** (the residual stream after layer i, before the final norm), which is
``hidden_states[i + 1]`` in Hugging Face's ``output_hidden_states``. SGLang captures "before layer i+1", which is the
same tensor; an implementation that captured "before layer i" would be off by one and silently lose acceptance.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from trtllm_dflash.errors import ArtifactError, ConfigError, read_json, require

log = logging.getLogger(__name__)


class TargetFamily(enum.Enum):
    LLAMA = "llama"  # LlamaForCausalLM (SmolLM2, Llama-3.x)
    QWEN3 = "qwen3"  # Qwen3ForCausalLM: Llama layout plus per-head RMSNorm on q and k (QK-norm)


class LayerType(enum.Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """Rotary embedding parameters shared by target and drafter."""

    theta: float
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def inv_freq(self, head_dim: int) -> list[float]:
        """Per-pair inverse frequencies [head_dim / 2], after scaling."""
        base = [1.0 / (self.theta ** (2 * i / head_dim)) for i in range(head_dim // 2)]
        if self.kind == "default":
            return base
        if self.kind == "linear":
            return [f / self.factor for f in base]
        # llama3: long wavelengths are divided by `factor`, short ones kept, a smooth ramp in between.
        low_wavelen = self.original_max_position_embeddings / self.low_freq_factor
        high_wavelen = self.original_max_position_embeddings / self.high_freq_factor
        out = []
        for f in base:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / self.factor)
            else:
                smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor) / (
                    self.high_freq_factor - self.low_freq_factor
                )
                out.append((1 - smooth) * f / self.factor + smooth * f)
        return out


def _parse_rope(cfg: dict[str, Any], prefix: str) -> RopeSpec:
    # transformers < 5 writes `rope_theta` + `rope_scaling`; transformers 5 writes `rope_parameters`.
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    merged = {**scaling, **params}
    require(
        kind in ("default", "linear", "llama3"),
        f"{prefix}.rope_scaling.rope_type",
        kind,
        "supported rope types are default, linear and llama3",
        "use a checkpoint with one of those or add the scaling rule to specs.RopeSpec",
    )
    require(float(theta) > 0, f"{prefix}.rope_theta", theta, "must be > 0")
    return RopeSpec(
        theta=float(theta),
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def _int(cfg: dict[str, Any], key: str, prefix: str, minimum: int = 1, default: Any = None) -> int:
    """Read one integer field, validating type and lower bound (SGLang's parse_dflash_draft_config pattern)."""
    value = cfg.get(key, default)
    require(value is not None, f"{prefix}.{key}", value, "is required", f"add {key!r} to {prefix}'s config.json")
    fix = f"write the value the checkpoint was trained with as {key} in {prefix}'s config.json"
    require(isinstance(value, int) and not isinstance(value, bool), f"{prefix}.{key}", value, "must be an integer",
            fix)
    require(value >= minimum, f"{prefix}.{key}", value, f"must be >= {minimum}", fix)
    return value


def read_config_json(model_dir: str | Path, what: str) -> dict[str, Any]:
    if not Path(model_dir).is_dir():
        raise ArtifactError(model_dir, f"{what} directory does not exist", f"pass an existing {what} directory")
    return read_json(Path(model_dir) / "config.json",
                     f"the {what} directory must hold its Hugging Face config.json (restore it from the original)")


def build_target_layer_ids(num_target_layers: int, num_taps: int) -> tuple[int, ...]:
    """The default tap rule of z-lab/dflash (dflash.md §1.2).

    One tap: the middle layer. Otherwise ``num_taps`` indices spread evenly, with Python rounding, from layer 1 to
    layer ``num_target_layers - 3`` inclusive. Worked examples: (36, 5) -> (1, 9, 17, 25, 33); (32, 5) ->
    (1, 8, 15, 22, 29). Indices are "output of decoder layer i" (module docstring).
    """
    require(num_taps >= 1, "num_taps", num_taps, "must be >= 1")
    require(num_target_layers >= 4, "num_target_layers", num_target_layers, "must be >= 4 to place taps in 1..L-3")
    if num_taps == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    require(
        num_taps <= end - start + 1,
        "num_taps",
        num_taps,
        f"at most {end - start + 1} distinct taps fit in layers 1..{end}",
    )
    span = end - start
    return tuple(int(round(start + i * span / (num_taps - 1))) for i in range(num_taps))


# ----------------------------------------------------------------------------------------------------------------------
# Target


@dataclass(frozen=True, slots=True)
class TargetSpec:
    family: TargetFamily
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int  # tokens: the context limit
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    torch_dtype: str

    @property
    def qk_norm(self) -> bool:
        return self.family is TargetFamily.QWEN3

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], prefix: str = "target") -> "TargetSpec":
        archs = cfg.get("architectures") or []
        model_type = cfg.get("model_type")
        families = {"llama": TargetFamily.LLAMA, "qwen3": TargetFamily.QWEN3}
        require(
            model_type in families and not any("DFlash" in a for a in archs),
            f"{prefix}.model_type",
            model_type if model_type in families else f"{model_type} ({archs})",
            "the target must be a Llama or Qwen3 causal LM",
            "pass the target model directory as --target (a DFlash drafter goes to --drafter)",
        )
        hidden = _int(cfg, "hidden_size", prefix)
        heads = _int(cfg, "num_attention_heads", prefix)
        kv_heads = _int(cfg, "num_key_value_heads", prefix, default=heads)
        require(heads % kv_heads == 0, f"{prefix}.num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")
        head_dim = cfg.get("head_dim") or hidden // heads
        require(head_dim % 2 == 0, f"{prefix}.head_dim", head_dim, "must be even for RoPE")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        vocab = _int(cfg, "vocab_size", prefix)
        for i, e in enumerate(eos_ids):
            require(0 <= e < vocab, f"{prefix}.eos_token_id[{i}]", e, f"must be in [0, vocab_size={vocab})")
        return cls(
            family=families[model_type],
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size", prefix),
            num_hidden_layers=_int(cfg, "num_hidden_layers", prefix),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg, prefix),
            max_position_embeddings=_int(cfg, "max_position_embeddings", prefix, default=4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> "TargetSpec":
        return cls.from_hf_config(read_config_json(model_dir, "target"))


# ----------------------------------------------------------------------------------------------------------------------
# Drafter

# Keys of newer drafter families whose behaviour this runtime does not implement; refusing them beats drafting garbage.
_UNSUPPORTED_DFLASH_KEYS = (
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
    "output_multiplier",
    "final_logit_softcapping",
    "attention_sink_bias",
    "attention_value_scale",
)


MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")


@dataclass(frozen=True, slots=True)
class DSparkSpec:
    """What a DSpark drafter adds to the DFlash backbone (arXiv 2607.05147; speculators ``DSparkSpeculatorConfig``):
    a low-rank Markov logit bias conditioned on the token before each drafted position, and a confidence head
    estimating each position's acceptance probability."""

    markov_rank: int  # rank r of the bias W2 · W1[previous token]; 0: no Markov head
    markov_head_type: str  # "vanilla" | "gated" (gated by the slot's hidden state) | "rnn" (a state across the block)
    confidence_head: bool
    confidence_with_markov: bool  # the confidence head reads [hidden ; W1[previous token]], else the hidden alone


@dataclass(frozen=True, slots=True)
class DrafterSpec:
    """A DFlash drafter: Qwen3-style layers, no embedding, and no head unless ``draft_vocab_size`` is set. Read from
    a z-lab config (``architectures: ["DFlashDraftModel"]``) or a speculators one (``_from_speculators``)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    block_size: int  # tokens drafted per step, including the bonus slot
    num_target_layers: int | None  # layers of the target it was trained against; None: not recorded (speculators)
    mask_token_id: int  # id embedded (with the target's table) in slots 1..block_size-1
    target_layer_ids: tuple[int, ...]  # taps, "output of decoder layer i"
    layer_types: tuple[LayerType, ...]  # [num_hidden_layers]
    layer_causal: tuple[bool, ...]  # [num_hidden_layers]: causal inside the block (sliding layers by default)
    sliding_window: int | None  # tokens; applies to LayerType.SLIDING layers only
    attention_bias: bool
    vocab_size: int | None  # informational for z-lab drafters; the verifier's vocabulary for speculators ones
    # > 0: the drafter has its OWN LM head over a reduced draft vocabulary of this many ids, mapped to target ids by
    # its ``d2t`` table (speculators format, models/speculators.py); None: it drafts through the target's head
    draft_vocab_size: int | None = None
    # the Markov and confidence heads of a DSpark drafter (speculators format, models/dspark.py); None: plain DFlash
    dspark: DSparkSpec | None = None
    # True: slot 0 (the bonus) predicts the first draft and slot k the (k+1)-th (speculators' sample_from_anchor), so
    # a forward over n slots drafts n tokens and ``block_size`` (the verified block, bonus included) is the trained
    # block + 1; False: slot k predicts position ctx_len + k and slot 0 only carries the bonus (z-lab's DFlash)
    anchor_predicts: bool = False

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @property
    def trained_block_size(self) -> int:
        """Slots of the drafter's trained forward (its config's ``block_size``)."""
        return self.block_size - int(self.anchor_predicts)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], prefix: str = "drafter") -> "DrafterSpec":
        """A z-lab ``DFlashDraftModel`` config, or a vLLM ``speculators`` one (``speculators_model_type`` present;
        translated by ``_from_speculators``)."""
        if "speculators_model_type" in cfg:
            return _from_speculators(cfg, prefix)
        return cls._from_zlab(cfg, prefix)

    @classmethod
    def _from_zlab(cls, cfg: dict[str, Any], prefix: str, *, num_target_layers: int | None = -1,
                   draft_vocab_size: int | None = None) -> "DrafterSpec":
        """``num_target_layers`` -1: read from ``cfg`` (required there); None: not recorded, taps checked against
        the target in ``check_pair`` instead."""
        dcfg = _zlab_dflash_config(cfg, prefix)
        layers = _int(cfg, "num_hidden_layers", prefix)
        hidden = _int(cfg, "hidden_size", prefix)
        heads = _int(cfg, "num_attention_heads", prefix)
        kv_heads = _int(cfg, "num_key_value_heads", prefix, default=heads)
        require(heads % kv_heads == 0, f"{prefix}.num_key_value_heads", kv_heads, f"must divide num_attention_heads ({heads})")
        head_dim = cfg.get("head_dim") or hidden // heads
        # block_size sits at top level in the original drafters and under dflash_config in newer ones.
        block_size = _int({**cfg, **{k: v for k, v in dcfg.items() if k == "block_size"}}, "block_size", prefix)
        if num_target_layers == -1:
            num_target_layers = _int(cfg, "num_target_layers", prefix)
        mask_token_id = _int(dcfg, "mask_token_id", f"{prefix}.dflash_config", minimum=0)
        ids = _zlab_target_layer_ids(dcfg, prefix, num_target_layers, layers)
        attention = _ZlabAttention.parse(cfg, dcfg, prefix, layers)
        return cls(
            hidden_size=hidden,
            intermediate_size=_int(cfg, "intermediate_size", prefix),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_parse_rope(cfg, prefix),
            block_size=block_size,
            num_target_layers=num_target_layers,
            mask_token_id=mask_token_id,
            target_layer_ids=ids,
            layer_types=attention.types,
            layer_causal=attention.causal,
            sliding_window=attention.window if LayerType.SLIDING in attention.types else None,
            attention_bias=bool(cfg.get("attention_bias", False)),
            vocab_size=cfg.get("vocab_size"),
            draft_vocab_size=draft_vocab_size,
        )

    @classmethod
    def load(cls, model_dir: str | Path) -> "DrafterSpec":
        return cls.from_hf_config(read_config_json(model_dir, "drafter"))

    def to_hf_config(self, *, target: TargetSpec) -> dict[str, Any]:
        """The z-lab config.json for this drafter (used when writing checkpoints). The z-lab format has no own
        head, so a reduced-vocabulary drafter is refused (``models/speculators.py`` writes that format)."""
        require(
            self.draft_vocab_size is None,
            "drafter.draft_vocab_size",
            self.draft_vocab_size,
            "the z-lab format has no LM head of its own, so it cannot hold a reduced draft vocabulary",
            "keep the drafter in speculators format (trtllm-dflash export-drafter --to speculators writes it)",
        )
        require(self.dspark is None, "drafter.speculators_model_type", "dspark",
                "the z-lab format has no Markov or confidence head", "keep the DSpark drafter in speculators format")
        return {
            "architectures": ["DFlashDraftModel"],
            "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3",
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers or target.num_hidden_layers,
            "dflash_config": {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)},
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope.theta,
            "rope_scaling": None
            if self.rope.kind == "default"
            else {
                "rope_type": self.rope.kind,
                "factor": self.rope.factor,
                "low_freq_factor": self.rope.low_freq_factor,
                "high_freq_factor": self.rope.high_freq_factor,
                "original_max_position_embeddings": self.rope.original_max_position_embeddings,
            },
            "max_position_embeddings": target.max_position_embeddings,
            "layer_types": [t.value for t in self.layer_types],
            "sliding_window": self.sliding_window,
            "use_sliding_window": self.sliding_window is not None,
            "vocab_size": target.vocab_size,
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }


# The pieces of ``DrafterSpec._from_zlab``: the dflash_config object, the taps and the attention layout.


def _zlab_dflash_config(cfg: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The ``dflash_config`` object of a z-lab drafter config, after checking that the config is a
    ``DFlashDraftModel`` and that it names no field of a DFlash variant this runtime does not implement."""
    archs = cfg.get("architectures") or []
    require(
        "DFlashDraftModel" in archs,
        f"{prefix}.architectures",
        archs,
        'must contain "DFlashDraftModel" (a z-lab format DFlash drafter)',
        "pass a DFlash drafter directory as --drafter (the target goes to --target)",
    )
    dcfg = cfg.get("dflash_config") or {}
    require(isinstance(dcfg, dict), f"{prefix}.dflash_config", dcfg, "must be a JSON object")
    for key in _UNSUPPORTED_DFLASH_KEYS:
        value = dcfg.get(key, cfg.get(key))
        require(
            value in (None, False, 0),
            f"{prefix}.dflash_config.{key}",
            value,
            "belongs to a DFlash variant (DFlash2 / attention sinks) this runtime does not implement",
            "use a plain DFlash drafter",
        )
    return dcfg


def _zlab_target_layer_ids(dcfg: dict[str, Any], prefix: str, num_target_layers: int | None,
                           layers: int) -> tuple[int, ...]:
    """The taps of a z-lab drafter: ``dflash_config.target_layer_ids``, or without them the layers
    ``build_target_layer_ids`` spreads over the target (which then needs ``num_target_layers``). Each must be a
    layer of the target where its depth is known."""
    raw_ids = dcfg.get("target_layer_ids")
    if raw_ids is None:
        require(num_target_layers is not None, f"{prefix}.dflash_config.target_layer_ids", raw_ids, "is required")
        ids = build_target_layer_ids(num_target_layers, layers)
    else:
        require(
            isinstance(raw_ids, list) and len(raw_ids) > 0,
            f"{prefix}.dflash_config.target_layer_ids",
            raw_ids,
            "must be a non-empty list of layer indices",
        )
        ids = tuple(raw_ids)
    for i, layer in enumerate(ids):
        require(
            isinstance(layer, int) and 0 <= layer < (num_target_layers or layer + 1),
            f"{prefix}.dflash_config.target_layer_ids[{i}]",
            layer,
            f"must be an integer in [0, num_target_layers={num_target_layers})",
        )
    return ids


@dataclass(frozen=True, slots=True)
class _ZlabAttention:
    """How a z-lab drafter's layers attend: each layer's type and causality, and the sliding window (validated only
    when a layer slides; ``DrafterSpec`` keeps it only then)."""

    types: tuple[LayerType, ...]
    window: Any
    causal: tuple[bool, ...]

    @classmethod
    def parse(cls, cfg: dict[str, Any], dcfg: dict[str, Any], prefix: str, layers: int) -> "_ZlabAttention":
        """``layer_types`` (all full attention when absent, all sliding under a bare ``use_swa``), the window from
        ``swa_window_size`` or ``sliding_window``, and causality by vLLM's rule."""
        raw_types = cfg.get("layer_types") or ["full_attention"] * layers
        require(len(raw_types) == layers, f"{prefix}.layer_types", raw_types, f"must have num_hidden_layers={layers} entries")
        try:
            types = tuple(LayerType(t) for t in raw_types)
        except ValueError:
            raise ConfigError(
                f"{prefix}.layer_types", raw_types, "entries must be 'full_attention' or 'sliding_attention'"
            ) from None
        if dcfg.get("use_swa") and LayerType.SLIDING not in types:
            # A use_swa flag without layer_types means every layer slides.
            types = tuple(LayerType.SLIDING for _ in range(layers))
        window = dcfg.get("swa_window_size") or cfg.get("sliding_window")
        if LayerType.SLIDING in types:
            require(
                isinstance(window, int) and window >= 1,
                f"{prefix}.sliding_window",
                window,
                "sliding_attention layers need a positive window",
            )
        # vLLM's rule: a layer is causal iff it slides, unless `is_causal` / `dflash_config.causal` says otherwise.
        override = dcfg.get("causal", cfg.get("is_causal"))
        causal = tuple(bool(override) if override is not None else t is LayerType.SLIDING for t in types)
        return cls(types, window, causal)


# ----------------------------------------------------------------------------------------------------------------------
# Drafter, speculators format
#
# vLLM's ``speculators`` library (0.9.0, ``speculators/models/dflash/{config,core}.py``) writes a DFlash drafter as a
# ``DFlashSpeculatorConfig``: ``speculators_model_type: "dflash"``, the draft decoder's layer config nested under
# ``transformer_layer_config`` (the verifier's config with ``num_hidden_layers`` set to the draft depth, serialized
# with ``to_diff_dict``, so keys equal to the config class's defaults may be absent), ``draft_vocab_size``,
# ``block_size``, ``mask_token_id``, ``aux_hidden_state_layer_ids`` and ``speculators_config.verifier``. Its layer ids
# index Hugging Face's ``hidden_states`` directly (0 is the embedding output): speculators' own z-lab converter writes
# ``target_layer_id + 1`` and vLLM's ``update_dflash`` reads back ``aux_id - 1``, so ours are ``aux_id - 1``.

# Defaults of the layer-config classes speculators nests (transformers 5.19 ``Qwen3Config`` / ``LlamaConfig``), used
# only for keys ``to_diff_dict`` left out; every one filled in is logged. head_dim None: hidden_size // heads.
_LAYER_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 32768, "attention_bias": False},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6,
              "rope_theta": 10000.0, "max_position_embeddings": 2048, "attention_bias": False},
}

# speculators model types that are not DFlash or DSpark, with what they are: refused by name rather than drafted as
# DFlash (their extra parts would be dropped silently).
_REFUSED_SPECULATORS_TYPES = {
    "dflash2": "DFlash2 adds a convolution and a candidate selector this runtime does not implement",
    "eagle3": "EAGLE-3 is an autoregressive drafter, not a DFlash block drafter",
    "peagle": "P-EAGLE is not a DFlash block drafter",
    "mtp": "MTP heads are not a DFlash block drafter",
    "xpress": "xpress is not a DFlash block drafter",
}


def _from_speculators(cfg: dict[str, Any], prefix: str) -> DrafterSpec:
    """A speculators ``DFlashSpeculatorConfig`` or ``DSparkSpeculatorConfig`` -> DrafterSpec (see the section
    comment for the conventions; DSpark's heads: ``_dspark_heads``)."""
    kind = _speculators_kind(cfg, prefix)
    layer, lprefix = _speculators_layer_config(cfg, prefix)
    anchor = _sample_from_anchor(cfg, prefix, kind)
    hidden = _int(layer, "hidden_size", lprefix)
    mask, aux = _speculators_taps(cfg, prefix, hidden)
    vocab = _int(layer, "vocab_size", lprefix)
    draft_vocab = _int(cfg, "draft_vocab_size", prefix, default=32000)  # DFlashSpeculatorConfig's default
    require(draft_vocab <= vocab, f"{prefix}.draft_vocab_size", draft_vocab,
            f"must be <= transformer_layer_config.vocab_size ({vocab})",
            "check that transformer_layer_config.vocab_size is the verifier's vocabulary")
    zlab = _speculators_as_zlab(cfg, prefix, layer, lprefix, mask, aux)
    spec = DrafterSpec._from_zlab(zlab, lprefix, num_target_layers=None,
                                  draft_vocab_size=None if draft_vocab == vocab else draft_vocab)
    if kind == "dflash":
        return spec
    # an anchor-predicting forward over the trained block drafts block_size tokens: one more verified slot
    return replace(spec, dspark=_dspark_heads(cfg, prefix), anchor_predicts=anchor,
                   block_size=spec.block_size + int(anchor))


def _speculators_kind(cfg: dict[str, Any], prefix: str) -> str:
    """The config's ``speculators_model_type``, "dflash" or "dspark"; other types are refused, by name where known,
    and so is a config carrying fields of heads its type does not load (a mislabelled DSpark / DFlash2 checkpoint)."""
    kind = cfg.get("speculators_model_type")
    require(
        kind not in _REFUSED_SPECULATORS_TYPES,
        f"{prefix}.speculators_model_type",
        kind,
        _REFUSED_SPECULATORS_TYPES.get(kind, ""),
        "use a plain DFlash or a DSpark drafter (speculators_model_type \"dflash\" or \"dspark\")",
    )
    require(
        kind in ("dflash", "dspark"),
        f"{prefix}.speculators_model_type",
        kind,
        'is not a speculators model type this runtime knows; "dflash" and "dspark" are supported',
        "use a speculators DFlash / DSpark drafter or a z-lab DFlashDraftModel",
    )
    if kind == "dflash":
        # a DSpark/DFlash2 checkpoint mislabelled "dflash" (or hand-edited) still carries its heads' fields or names
        for key in ("markov_rank", "enable_confidence_head", "conv_kernel_size", "selector_rank"):
            require(cfg.get(key) in (None, 0, False), f"{prefix}.{key}", cfg.get(key),
                    "belongs to DSpark / DFlash2 heads, which a \"dflash\" config does not load",
                    "set speculators_model_type to the drafter's own type (\"dspark\" for a Markov / confidence "
                    "head), or re-save it with speculators' save_pretrained")
        archs = [a for a in cfg.get("architectures") or [] if "DSpark" in a or "DFlash2" in a]
        require(not archs, f"{prefix}.architectures", archs, "names a DSpark / DFlash2 model class",
                "set speculators_model_type to the drafter's own type, or use a plain DFlash drafter")
    else:
        for key in ("conv_kernel_size", "selector_rank"):
            require(cfg.get(key) in (None, 0), f"{prefix}.{key}", cfg.get(key),
                    "belongs to DFlash2, which this runtime does not implement", "use a DSpark or DFlash drafter")
    return kind


def _speculators_layer_config(cfg: dict[str, Any], prefix: str) -> tuple[dict[str, Any], str]:
    """A copy of the config's ``transformer_layer_config`` with the layer class's defaults filled in where
    ``to_diff_dict`` left them out (logged) and a per-layer-type rope flattened to the sliding one, after checking the
    layer is one this drafter implements (SwiGLU, no attention bias); returns it with its field prefix."""
    layer = cfg.get("transformer_layer_config")
    require(isinstance(layer, dict), f"{prefix}.transformer_layer_config", layer, "must be a JSON object",
            "re-save the drafter with speculators' save_pretrained")
    lprefix = f"{prefix}.transformer_layer_config"
    layer_type = layer.get("model_type", "qwen3")  # speculators' validator builds a Qwen3Config without one
    require(
        layer_type in _LAYER_CONFIG_DEFAULTS,
        f"{lprefix}.model_type",
        layer_type,
        f"must be one of {sorted(_LAYER_CONFIG_DEFAULTS)} (the layer configs whose defaults this loader knows)",
        "write every layer field explicitly, or add the class's defaults to specs._LAYER_CONFIG_DEFAULTS",
    )
    filled = {}
    layer = dict(layer)
    for key, default in _LAYER_CONFIG_DEFAULTS[layer_type].items():
        rope_given = key == "rope_theta" and ("rope_parameters" in layer or "rope_scaling" in layer)
        if key not in layer and not rope_given and default is not None:
            layer[key] = filled[key] = default
    if filled:
        log.info("%s: filled %s defaults absent from the config (to_diff_dict omits them): %s", lprefix,
                 layer_type, filled)
    require(layer.get("hidden_act", "silu") == "silu", f"{lprefix}.hidden_act", layer.get("hidden_act"),
            "the drafter's MLP is SwiGLU (silu)", "use a drafter with hidden_act silu")
    rope = layer.get("rope_parameters")
    if isinstance(rope, dict) and "sliding_attention" in rope:
        # per-layer-type rope (Laguna-style verifiers): speculators' flatten_rope_parameters uses the sliding one
        layer["rope_parameters"] = rope["sliding_attention"]
    require(not layer.get("attention_bias", False), f"{lprefix}.attention_bias", layer.get("attention_bias"),
            "speculators gives o_proj a bias too when set; this runtime's drafter has none",
            "use a drafter trained with attention_bias false")
    return layer, lprefix


def _sample_from_anchor(cfg: dict[str, Any], prefix: str, kind: str) -> bool:
    """The config's ``sample_from_anchor`` (by default true for DSpark, DeepSpec's convention, and false for
    DFlash); only a DSpark drafter may predict from the anchor."""
    # DSparkSpeculatorConfig's default is True (DeepSpec's convention), DFlashSpeculatorConfig's False
    anchor = cfg.get("sample_from_anchor")
    anchor = kind == "dspark" if anchor is None else anchor
    require(isinstance(anchor, bool), f"{prefix}.sample_from_anchor", anchor, "must be true or false",
            "write a JSON boolean (true / false) in config.json")
    require(not anchor or kind == "dspark", f"{prefix}.sample_from_anchor", anchor,
            "an anchor-predicting DFlash drafter is not loaded (speculators itself warns that inference engines may "
            "not support it; TensorRT-LLM's DFlash route reads slot k as position k)",
            "use a drafter trained with sample_from_anchor false (the speculators DFlash default)")
    return anchor


def _speculators_taps(cfg: dict[str, Any], prefix: str, hidden: int) -> tuple[int, list[int]]:
    """What the drafter reads from its target: its ``mask_token_id`` and its ``aux_hidden_state_layer_ids`` (each
    the output of target layer id - 1), after checking the taps are as wide as the drafter (``hidden``)."""
    target_hidden = cfg.get("target_hidden_size")
    require(target_hidden in (None, hidden), f"{prefix}.target_hidden_size", target_hidden,
            f"must equal transformer_layer_config.hidden_size ({hidden}): fc reads taps of the drafter's width",
            "use a drafter whose hidden size equals its target's")
    mask = cfg.get("mask_token_id")
    require(mask is not None, f"{prefix}.mask_token_id", mask, "is required (the id embedded in slots 1..B-1)",
            "set mask_token_id to the id the drafter was trained with (speculators' --mask-token-id)")
    mask = _int(cfg, "mask_token_id", prefix, minimum=0)
    aux = cfg.get("aux_hidden_state_layer_ids")
    require(isinstance(aux, list) and len(aux) > 0, f"{prefix}.aux_hidden_state_layer_ids", aux,
            "must be a non-empty list of target layer ids", "set the layer ids the drafter was trained with")
    for i, a in enumerate(aux):
        require(isinstance(a, int) and a >= 1, f"{prefix}.aux_hidden_state_layer_ids[{i}]", a,
                "must be an integer >= 1 (id i is the output of target decoder layer i-1; 0, the embedding "
                "output, is not a tap this runtime captures)",
                "use a drafter trained on decoder-layer outputs (speculators' default ids are >= 2)")
    return mask, aux


def _speculators_as_zlab(cfg: dict[str, Any], prefix: str, layer: dict[str, Any], lprefix: str, mask: int,
                         aux: list[int]) -> dict[str, Any]:
    """The z-lab config ``DrafterSpec._from_zlab`` reads for this speculators drafter: its layer config plus the
    block size, the mask id, the taps as decoder-layer indices (``aux - 1``) and the layer types. Sliding layers
    warn: speculators bounds their window differently."""
    # layer_types absent: speculators builds every layer as full attention; sliding layers are causal unless
    # sliding_window_non_causal (its anchor-block mask), the same rule as our layer_causal
    num_layers = _int(layer, "num_hidden_layers", lprefix)
    types = layer.get("layer_types") or ["full_attention"] * num_layers
    zlab = {
        **layer,
        "architectures": ["DFlashDraftModel"],
        "block_size": _int(cfg, "block_size", prefix, default=8),
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": [a - 1 for a in aux]},
        "layer_types": types,
    }
    if "sliding_attention" in types and cfg.get("sliding_window_non_causal"):
        zlab["dflash_config"]["causal"] = False
    if "sliding_attention" in types:
        log.warning("%s: sliding layers: speculators bounds the context window at the block's anchor, this runtime "
                    "at each query, so drafts can differ once the context exceeds sliding_window=%s",
                    prefix, layer.get("sliding_window"))
    return zlab


# DSparkSpeculatorConfig's defaults (speculators 0.9.0 ``models/dspark/config.py``), for a config that omits a field
_DSPARK_DEFAULTS = {"markov_rank": 256, "markov_head_type": "vanilla", "enable_confidence_head": True,
                    "confidence_head_with_markov": True}


def _dspark_heads(cfg: dict[str, Any], prefix: str) -> DSparkSpec:
    """The Markov and confidence heads of a speculators DSpark config (``models/dspark.py`` implements them)."""
    filled = {k: v for k, v in _DSPARK_DEFAULTS.items() if k not in cfg}
    if filled:
        log.info("%s: DSpark fields absent from the config, DSparkSpeculatorConfig's defaults used: %s", prefix, filled)
    c = {**_DSPARK_DEFAULTS, **cfg}
    rank = _int(c, "markov_rank", prefix, minimum=0)
    head_type = c["markov_head_type"]
    require(head_type in MARKOV_HEAD_TYPES, f"{prefix}.markov_head_type", head_type,
            f"must be one of {list(MARKOV_HEAD_TYPES)} (the Markov heads speculators 0.9.0 defines and this runtime "
            "implements)", "use a drafter trained with --markov-head-type vanilla, gated or rnn")
    for key in ("enable_confidence_head", "confidence_head_with_markov"):
        require(isinstance(c[key], bool), f"{prefix}.{key}", c[key], "must be true or false",
                "write a JSON boolean (true / false) in config.json")
    with_markov = c["enable_confidence_head"] and c["confidence_head_with_markov"]
    require(not with_markov or rank > 0, f"{prefix}.confidence_head_with_markov", True,
            "needs a Markov head (markov_rank > 0): the confidence head reads its previous-token embedding",
            "set confidence_head_with_markov false for a drafter trained with markov_rank 0")
    return DSparkSpec(markov_rank=rank, markov_head_type=head_type, confidence_head=c["enable_confidence_head"],
                      confidence_with_markov=with_markov)


def check_pair(target: TargetSpec, drafter: DrafterSpec) -> None:
    """Cross-checks between a target and its drafter (the drafter reads the target's embedding, head and taps)."""
    require(
        drafter.hidden_size == target.hidden_size,
        "drafter.hidden_size",
        drafter.hidden_size,
        f"must equal the target's hidden_size ({target.hidden_size}): the drafter reads the target's embeddings "
        "and feeds its LM head",
        "use the drafter trained for this target",
    )
    require(
        drafter.num_target_layers in (None, target.num_hidden_layers),
        "drafter.num_target_layers",
        drafter.num_target_layers,
        f"must equal the target's num_hidden_layers ({target.num_hidden_layers})",
        "use the drafter trained for this target",
    )
    for i, layer in enumerate(drafter.target_layer_ids):
        require(
            layer < target.num_hidden_layers,
            f"drafter.dflash_config.target_layer_ids[{i}]",
            layer,
            f"is out of range for a target with {target.num_hidden_layers} layers",
            "check that --target matches the drafter's training target",
        )
    if drafter.draft_vocab_size is not None:
        require(
            drafter.vocab_size == target.vocab_size,
            "drafter.transformer_layer_config.vocab_size",
            drafter.vocab_size,
            f"must equal the target's vocab_size ({target.vocab_size}): the drafter's d2t table maps into the "
            "vocabulary it was trained against",
            "use the drafter trained for this target",
        )
    require(
        drafter.mask_token_id < target.vocab_size,
        "drafter.dflash_config.mask_token_id",
        drafter.mask_token_id,
        f"must be < the target's vocab_size ({target.vocab_size}) so the target embedding has a row for it",
        "set dflash_config.mask_token_id to an id of the target's vocabulary",
    )
