"""Weight-name maps between Hugging Face / z-lab checkpoints and TensorRT-LLM checkpoints, as data, plus the one pair of
functions that shard a full tensor for a TP rank and merge the ranks back.

A ``Rule`` says: TRT-LLM tensor ``dst`` is the concatenation along dim 0 of the source tensors ``src`` (one source for
most tensors; q, k, v for the fused ``attention.qkv``), sharded across tensor-parallel ranks by ``shard``. Concatenating
several sources is done **per rank**: each source is split first, then rank r's pieces are concatenated, which is how
TRT-LLM fuses QKV (``split(q), split(k), split(v)`` then ``concat``; ``tensorrt_llm/models/qwen/convert.py``,
``llama/convert.py:split_qkv_tp``), so rank r's ``qkv`` is ``[q_r; k_r; v_r]``.

Name facts (trtllm_triton.md §1.3; recorded with sources in ``tests/data/trtllm_1_2_1/checkpoint_contract.json``):

- ``mlp.fc`` is HF ``gate_proj`` (the SiLU-activated branch) and ``mlp.gate`` is HF ``up_proj``: the naming swap of the
  TRT-LLM converters ("MLP hf up to trt gate").
- Qwen3's per-head QK-norm is ``attention.q_layernorm`` / ``attention.k_layernorm``.
- ``lm_head`` rows are zero-padded to a multiple of ``tp_size`` and split along the vocabulary.

Sharding (TRT-LLM's ``split_matrix_tp`` conventions): column-parallel linears (qkv, mlp.fc, mlp.gate) split dim 0,
row-parallel linears (attention.dense, mlp.proj) split dim 1, norms are replicated, the embedding is split along the
vocabulary when ``use_parallel_embedding`` is set (``embedding_sharding_dim`` 0) and replicated otherwise.

The drafter (our own ``DFlashDrafterForTRTLLM``, see ``checkpoint.py``) reuses the same decoder-layer rules under the
prefix ``drafter.layers.{i}.`` and adds its context projection; it has no embedding and no LM head (the target's).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from trtllm_dflash.errors import ArtifactError
from trtllm_dflash.specs import TargetFamily


class Shard(enum.Enum):
    REPLICATE = "replicate"  # every rank holds the full tensor
    COLUMN = "column"  # split dim 0 (output features); several sources are split then concatenated per rank
    ROW = "row"  # split dim 1 (input features)
    VOCAB = "vocab"  # zero-pad dim 0 to a multiple of tp, then split dim 0 (lm_head)
    EMBEDDING = "embedding"  # split dim 0 if use_parallel_embedding, else replicate


@dataclass(frozen=True, slots=True)
class Rule:
    dst: str  # TRT-LLM name; "{i}" stands for the decoder-layer index
    src: tuple[str, ...]  # source names, concatenated along dim 0 in this order (per rank)
    shard: Shard


def decoder_layer_rules(src: str, dst: str, *, qk_norm: bool) -> tuple[Rule, ...]:
    """Rules of one Llama-style decoder layer; ``src`` / ``dst`` are the layer prefixes with ``{i}``."""
    qkv = tuple(f"{src}self_attn.{p}_proj.weight" for p in "qkv")
    rules = [
        Rule(f"{dst}input_layernorm.weight", (f"{src}input_layernorm.weight",), Shard.REPLICATE),
        Rule(f"{dst}attention.qkv.weight", qkv, Shard.COLUMN),
        Rule(f"{dst}attention.dense.weight", (f"{src}self_attn.o_proj.weight",), Shard.ROW),
        Rule(f"{dst}post_layernorm.weight", (f"{src}post_attention_layernorm.weight",), Shard.REPLICATE),
        Rule(f"{dst}mlp.fc.weight", (f"{src}mlp.gate_proj.weight",), Shard.COLUMN),  # HF gate -> TRT fc
        Rule(f"{dst}mlp.gate.weight", (f"{src}mlp.up_proj.weight",), Shard.COLUMN),  # HF up -> TRT gate
        Rule(f"{dst}mlp.proj.weight", (f"{src}mlp.down_proj.weight",), Shard.ROW),
    ]
    if qk_norm:
        rules += [
            Rule(f"{dst}attention.q_layernorm.weight", (f"{src}self_attn.q_norm.weight",), Shard.REPLICATE),
            Rule(f"{dst}attention.k_layernorm.weight", (f"{src}self_attn.k_norm.weight",), Shard.REPLICATE),
        ]
    return tuple(rules)


_TARGET_GLOBAL = (
    Rule("transformer.vocab_embedding.weight", ("model.embed_tokens.weight",), Shard.EMBEDDING),
    Rule("transformer.ln_f.weight", ("model.norm.weight",), Shard.REPLICATE),
    Rule("lm_head.weight", ("lm_head.weight",), Shard.VOCAB),
)

# One table per target family: (global rules, per-layer rules). Qwen3 = the Llama layout plus QK-norm.
TARGET_MAPS: dict[TargetFamily, tuple[tuple[Rule, ...], tuple[Rule, ...]]] = {
    TargetFamily.LLAMA: (_TARGET_GLOBAL, decoder_layer_rules("model.layers.{i}.", "transformer.layers.{i}.",
                                                             qk_norm=False)),
    TargetFamily.QWEN3: (_TARGET_GLOBAL, decoder_layer_rules("model.layers.{i}.", "transformer.layers.{i}.",
                                                             qk_norm=True)),
}

# The z-lab drafter (dflash.md §1.8) -> DFlashDrafterForTRTLLM. Context projection and its norm are replicated: they
# run once per committed token on the full hidden size, before any TP-split layer.
DRAFTER_GLOBAL = (
    Rule("drafter.context_proj.weight", ("fc.weight",), Shard.REPLICATE),  # [hidden, num_taps * hidden]
    Rule("drafter.context_norm.weight", ("hidden_norm.weight",), Shard.REPLICATE),
    Rule("drafter.ln_f.weight", ("norm.weight",), Shard.REPLICATE),
)


DRAFTER_LAYER = decoder_layer_rules("layers.{i}.", "drafter.layers.{i}.", qk_norm=True)


@dataclass(frozen=True, slots=True)
class Entry:
    """One destination tensor of a concrete model: names resolved, full source shapes known."""

    dst: str
    src: tuple[str, ...]
    src_shapes: tuple[tuple[int, ...], ...]  # full (unsharded) shape of each source
    shard: Shard


def expand(global_rules, layer_rules, num_layers: int, shapes: dict[str, tuple[int, ...]], *,
           parallel_embedding: bool, aliases: dict[str, str] | None = None) -> list[Entry]:
    """Resolve ``{i}``, the embedding's shard and source shapes. ``shapes`` maps every expected source name to its
    full shape (from the spec); ``aliases`` maps a source name to the tensor that stands in for it (a tied lm_head)."""
    aliases = aliases or {}
    rules = list(global_rules) + [
        Rule(r.dst.format(i=i), tuple(s.format(i=i) for s in r.src), r.shard)
        for i in range(num_layers)
        for r in layer_rules
    ]
    entries = []
    for r in rules:
        shard = r.shard
        if shard is Shard.EMBEDDING:
            shard = Shard.COLUMN if parallel_embedding else Shard.REPLICATE
        src = tuple(aliases.get(s, s) for s in r.src)
        entries.append(Entry(r.dst, src, tuple(shapes[s] for s in r.src), shard))
    return entries


def check_coverage(entries: list[Entry], source_names, source: object, aliased: tuple[str, ...] = ()) -> None:
    """Every source tensor consumed exactly once (``aliased`` names may be consumed twice: a tied lm_head re-reads the
    embedding); every destination name unique. Raises ArtifactError naming the offenders."""
    counts: dict[str, int] = {}
    for e in entries:
        for s in e.src:
            counts[s] = counts.get(s, 0) + 1
    dsts = [e.dst for e in entries]
    dup_dst = sorted({d for d in dsts if dsts.count(d) > 1})
    missing = sorted(set(counts) - set(source_names))
    unused = sorted(set(source_names) - set(counts))
    twice = sorted(s for s, n in counts.items() if n > 1 and s not in aliased)
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {missing[:3]})")
    if unused:
        problems.append(f"{len(unused)} tensors no rule consumes (e.g. {unused[:3]})")
    if twice:
        problems.append(f"tensors consumed more than once: {twice[:3]}")
    if dup_dst:
        problems.append(f"duplicate destination names: {dup_dst[:3]}")
    if problems:
        raise ArtifactError(source, "weights do not match the config: " + "; ".join(problems),
                            "check that config.json belongs to these weights")


def padded_rows(rows: int, tp: int) -> int:
    return -(-rows // tp) * tp


def rank_shape(e: Entry, tp: int) -> tuple[int, ...]:
    """The shape rank r holds for ``e``, computed from the spec (never from the tensor being checked)."""
    first = e.src_shapes[0]
    if e.shard is Shard.REPLICATE:
        return first
    if e.shard is Shard.ROW:
        return (first[0], first[1] // tp)
    if e.shard is Shard.VOCAB:
        return (padded_rows(first[0], tp) // tp, *first[1:])
    return (sum(s[0] // tp for s in e.src_shapes), *first[1:])  # COLUMN


def shard(e: Entry, tensors: list[torch.Tensor], tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s piece of destination ``e`` from the full source tensors (in ``e.src`` order)."""
    if e.shard is Shard.REPLICATE:
        (t,) = tensors
        return t
    if e.shard is Shard.ROW:
        (t,) = tensors
        return t.chunk(tp, dim=1)[rank]
    if e.shard is Shard.VOCAB:
        (t,) = tensors
        pad = padded_rows(t.shape[0], tp) - t.shape[0]
        if pad:
            t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
        return t.chunk(tp, dim=0)[rank]
    return torch.cat([t.chunk(tp, dim=0)[rank] for t in tensors])  # COLUMN: split each, concat rank pieces


def merge(e: Entry, pieces: list[torch.Tensor], source: object) -> list[torch.Tensor]:
    """Inverse of ``shard``: the full source tensors (in ``e.src`` order) from every rank's piece."""
    tp = len(pieces)
    if e.shard is Shard.REPLICATE:
        for r, p in enumerate(pieces[1:], start=1):
            if not torch.equal(p, pieces[0]):
                raise ArtifactError(source, f"replicated tensor {e.dst} differs between rank0 and rank{r}",
                                    "re-run the conversion")
        return [pieces[0]]
    if e.shard is Shard.ROW:
        return [torch.cat(pieces, dim=1)]
    if e.shard is Shard.VOCAB:
        return [torch.cat(pieces, dim=0)[: e.src_shapes[0][0]]]
    sizes = [s[0] // tp for s in e.src_shapes]  # COLUMN: each rank piece is [src0_r; src1_r; ...]
    per_rank = [p.split(sizes, dim=0) for p in pieces]
    return [torch.cat([per_rank[r][j] for r in range(tp)]) for j in range(len(sizes))]
