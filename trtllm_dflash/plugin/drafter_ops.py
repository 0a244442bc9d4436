"""``DrafterModel.inject`` and ``DrafterModel.draft`` rebuilt on the plugin ops: the runtime's drop-in kernel path.

Same arguments, same cache effects on committed entries, same outputs (to a stated tolerance; tests/test_plugin_drafter
compares them on tiny checkpoints). Differences, all invisible to the committed state:
- ``inject`` writes only each row's real tokens (not the padding) and does all layers' k_proj/v_proj in one GEMM.
- ``draft`` never writes the block's K/V into the cache (the reference writes scratch past ``lengths`` and ignores it).
"""

from __future__ import annotations

import torch

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.layers import KVCache
from trtllm_dflash.plugin import dispatch
from trtllm_dflash.plugin.dispatch import Impl
from trtllm_dflash.plugin.kv_inject import InjectWeights
from trtllm_dflash.plugin.ragged import RaggedBatch
from trtllm_dflash.specs import LayerType


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
    dispatch.kv_inject(flat, batch, start, row_ids, weights, drafter.rotary.cos, drafter.rotary.sin,
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
        o = dispatch.block_attention(
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
    impl: Impl,  # a resolved choice (``dispatch.resolve``): TRITON or TORCH
    static: bool = False,
) -> torch.Tensor:  # [b, B, hidden] final-normed
    """The draft forward on the path ``impl`` chose: ``draft`` above (the plugin's kernels) or the drafter's own torch
    code. The in-process decoder and the served ``BlockDrafter`` both draft through here."""
    if impl is Impl.TRITON:
        return draft(drafter, block_embeds, cache, rows, impl, static=static)
    return drafter.draft(block_embeds, cache, rows, static=static)
