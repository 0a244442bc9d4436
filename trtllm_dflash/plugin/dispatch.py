"""The drafting plugin as the runtime calls it: one switch between the Triton kernels and their torch references, and
``DrafterModel.inject`` / ``DrafterModel.draft`` rebuilt on the switched ops.

``Impl.AUTO`` (the default) runs the kernels on CUDA tensors when Triton is importable and the torch references
otherwise (CPU). ``Impl.TRITON`` forces the kernels: on CPU that needs ``TRITON_INTERPRET=1`` set before Triton is
first imported (the tests do this). ``Impl.TORCH`` forces the references, e.g. to A/B a GPU run. Nothing falls back
silently: a forced choice that cannot run raises ``ConfigError`` saying how to fix it.

``inject`` and ``draft`` take the same arguments as the drafter's own methods and have the same effect on committed
cache entries and the same outputs (to a stated tolerance; ``tests/plugin/test_plugin_drafter.py`` compares them on
tiny checkpoints). What differs is invisible to the committed state: ``inject`` writes only each row's real tokens (not
the padding) and runs every layer's k_proj/v_proj as one GEMM; ``draft`` never writes the block's K/V into the cache
(the drafter's own code writes scratch past ``lengths`` and ignores it).
"""

from __future__ import annotations

import enum
import importlib.util
import os

import torch

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.layers import KVCache
from trtllm_dflash.plugin import accept as _accept
from trtllm_dflash.plugin import block_attention as _attn
from trtllm_dflash.plugin import kv_inject as _inject
from trtllm_dflash.plugin.accept import AcceptOutput
from trtllm_dflash.plugin.kv_inject import InjectWeights
from trtllm_dflash.plugin.ragged import RaggedBatch
from trtllm_dflash.specs import LayerType


class Impl(enum.Enum):
    AUTO = "auto"
    TRITON = "triton"
    TORCH = "torch"


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def resolve(impl: Impl, device: torch.device) -> Impl:
    """AUTO -> TRITON on CUDA with Triton installed, else TORCH; a forced TRITON is checked for runnability."""
    device = torch.device(device)
    if impl is Impl.AUTO:
        return Impl.TRITON if device.type == "cuda" and triton_available() else Impl.TORCH
    if impl is Impl.TRITON:
        if not triton_available():
            raise ConfigError("impl", impl.value, "needs OpenAI Triton", "pip install 'trtllm-dflash[kernels]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("impl", impl.value, f"Triton kernels need CUDA tensors (got {device.type})",
                              "use Impl.TORCH, or set TRITON_INTERPRET=1 before importing triton to interpret them")
    return impl


def _kernels():
    """``triton_kernels`` (imports Triton): only a resolved TRITON choice reaches here."""
    from trtllm_dflash.plugin import triton_kernels

    return triton_kernels


def kv_inject(taps: torch.Tensor, batch: RaggedBatch, start_pos: torch.Tensor, rows: torch.Tensor, w: InjectWeights,
              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              impl: Impl = Impl.AUTO) -> None:
    """See ``kv_inject.kv_inject_reference`` for shapes; writes k_cache/v_cache in place, commits nothing."""
    fn = _kernels().kv_inject_triton if resolve(impl, taps.device) is Impl.TRITON else _inject.kv_inject_reference
    fn(taps, batch, start_pos, rows, w, cos, sin, k_cache, v_cache)


def block_attention(q, k_block, v_block, k_cache, v_cache, batch: RaggedBatch, rows, ctx_lens, causal=False,
                    window=None, sm_scale=None, impl: Impl = Impl.AUTO) -> torch.Tensor:
    """See ``block_attention.block_attention_reference`` for shapes."""
    if resolve(impl, q.device) is Impl.TRITON:
        fn = _kernels().block_attention_triton
    else:
        fn = _attn.block_attention_reference
    return fn(q, k_block, v_block, k_cache, v_cache, batch, rows, ctx_lens, causal, window, sm_scale)


def accept_greedy(
    draft_ids: torch.Tensor,  # [total_drafts] int64
    cu_num_drafts: torch.Tensor,  # [num_seqs + 1] int32
    target_logits: torch.Tensor,  # [total_drafts + num_seqs, V]
    max_num_drafts: int,
    impl: Impl = Impl.AUTO,
) -> AcceptOutput:
    if resolve(impl, target_logits.device) is Impl.TRITON:
        samples = _kernels().greedy_samples_triton(target_logits)
        return _kernels().accept_triton(draft_ids, cu_num_drafts, samples, max_num_drafts)
    samples = _accept.greedy_samples_reference(target_logits)
    return _accept.accept_reference(draft_ids, cu_num_drafts, samples, max_num_drafts)


def accept_sampled(
    draft_ids: torch.Tensor,  # [total_drafts] int64
    cu_num_drafts: torch.Tensor,  # [num_seqs + 1] int32
    target_probs: torch.Tensor,  # [total_drafts + num_seqs, V] processed probabilities (sampling.processed_probs)
    uniforms: torch.Tensor,  # [total_drafts + num_seqs] in [0, 1), one per target slot
    max_num_drafts: int,
    impl: Impl = Impl.AUTO,
) -> AcceptOutput:
    if resolve(impl, target_probs.device) is Impl.TRITON:
        samples = _kernels().inverse_cdf_triton(target_probs, uniforms)
        return _kernels().accept_triton(draft_ids, cu_num_drafts, samples, max_num_drafts)
    samples = _accept.inverse_cdf_reference(target_probs, uniforms)
    return _accept.accept_reference(draft_ids, cu_num_drafts, samples, max_num_drafts)


def accept_samples(draft_ids, cu_num_drafts, target_ids, max_num_drafts, impl: Impl = Impl.AUTO) -> AcceptOutput:
    """Acceptance from target samples the caller already drew ([total_drafts + num_seqs] int64)."""
    fn = _kernels().accept_triton if resolve(impl, target_ids.device) is Impl.TRITON else _accept.accept_reference
    return fn(draft_ids, cu_num_drafts, target_ids, max_num_drafts)


# -- the drafter on the plugin ops --------------------------------------------------------------------------------------


def _rows(cache: KVCache, rows: torch.Tensor | None, b: int) -> torch.Tensor:  # [b] int64
    return torch.arange(b, device=cache.k.device) if rows is None else rows.long()


def inject(
    drafter: DrafterModel,
    weights: InjectWeights,  # InjectWeights.from_drafter(drafter), built once
    taps: torch.Tensor,  # [b, T, num_taps * hidden], padded per row like DrafterModel.inject's
    num_tokens: torch.Tensor,  # [b] real tokens per row
    cache: KVCache,
    rows: torch.Tensor | None = None,  # [b] cache rows; None = all rows in order
    impl: Impl = Impl.AUTO,
) -> None:
    """Drop-in for ``drafter.inject``: appends every layer's context K/V and commits ``num_tokens``."""
    b, t, _ = taps.shape
    row_ids = _rows(cache, rows, b)
    start = cache.lengths[row_ids]  # [b]
    if b and int((start + num_tokens).max()) > cache.max_len:
        raise ConfigError("sequence length", int((start + num_tokens).max()),
                          f"exceeds the cache capacity ({cache.max_len} tokens)", "lower max_new_tokens or the prompt length")
    keep = torch.arange(t, device=taps.device)[None, :] < num_tokens[:, None]  # [b, T]
    flat = taps[keep]  # [sum(num_tokens), K·H]: padded -> ragged
    batch = RaggedBatch.from_lengths(num_tokens.to(torch.int32))
    kv_inject(flat, batch, start, row_ids, weights, drafter.rotary.cos, drafter.rotary.sin,
                       cache.k, cache.v, impl)
    cache.commit(rows, num_tokens)


def draft(
    drafter: DrafterModel,
    block_embeds: torch.Tensor,  # [b, B, hidden] target embeddings of [bonus, MASK × (B−1)]
    cache: KVCache,
    rows: torch.Tensor | None = None,  # [b]
    impl: Impl = Impl.AUTO,
    static: bool = False,  # nothing read back to the host (``DrafterModel.draft``'s): the caller checks capacity
) -> torch.Tensor:  # [b, B, hidden] final-normed, like DrafterModel.draft
    """Drop-in for ``drafter.draft``: the per-layer attention is ``block_attention``; the cache is only read."""
    spec = drafter.spec
    b, bs, _ = block_embeds.shape
    row_ids = _rows(cache, rows, b)
    positions = cache.step_positions(rows, bs, check=not static)  # [b, B]; checks capacity unless static
    ctx_lens = cache.lengths[row_ids]  # [b]
    # every row's block is bs tokens: offsets made on the device (a host list copied in could not be graph-captured)
    cu = torch.arange(b + 1, dtype=torch.int32, device=block_embeds.device) * bs
    batch = RaggedBatch(cu, bs if b else 0)
    x = block_embeds.to(drafter.dtype)
    rope = drafter.rotary.at(positions)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        q, k, v = attn.block_qkv(layer.input_layernorm(x), rope)
        sliding = spec.sliding_window is not None and spec.layer_types[i] is LayerType.SLIDING
        o = block_attention(
            q.reshape(b * bs, attn.num_heads, attn.head_dim),
            k.reshape(b * bs, attn.num_kv_heads, attn.head_dim).contiguous(),
            v.reshape(b * bs, attn.num_kv_heads, attn.head_dim).contiguous(),
            cache.k[i], cache.v[i], batch, row_ids, ctx_lens,
            causal=spec.layer_causal[i], window=spec.sliding_window if sliding else None, impl=impl,
        )  # [b·B, nh, hd]
        x = x + attn.o_proj(o.reshape(b, bs, attn.num_heads * attn.head_dim))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def draft_pass(
    drafter: DrafterModel,
    block_embeds: torch.Tensor,  # [b, B, hidden]
    cache: KVCache,
    rows: torch.Tensor | None,
    impl: Impl,  # a resolved choice (``resolve``): TRITON or TORCH
    static: bool = False,
) -> torch.Tensor:  # [b, B, hidden] final-normed
    """The draft forward on the path ``impl`` chose: ``draft`` above (the plugin's kernels) or the drafter's own torch
    code. The in-process decoder and the served ``BlockDrafter`` both draft through here."""
    if impl is Impl.TRITON:
        return draft(drafter, block_embeds, cache, rows, impl, static=static)
    return drafter.draft(block_embeds, cache, rows, static=static)
