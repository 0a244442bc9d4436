"""Block attention for the drafter: each sequence's B block queries attend to its cached context plus the block.

DFlash draft layers (dflash.md §1.4–1.5) take queries from the block only and keys/values from
``[cached context ; block]``. Full-attention layers use **no mask**: every block query sees every context key and every
block key, later block positions included. Sliding layers optionally restrict keys to ``q_pos - k_pos < window`` and
may be causal inside the block (``specs.DrafterSpec.layer_causal``), matching ``DrafterModel.draft``.

Positions: sequence i's context occupies cache slots [0, ctx_lens[i]) of row ``rows[i]``; its block query/key j sits at
absolute position ``ctx_lens[i] + j``. Queries are flat and ragged (``cu_seqlens_q``): sequences may have different
block lengths, including 0. The block's K/V come in as tensors and are never written to the cache (the reference's
crop, for free). Q and K arrive already q_norm/k_norm-ed and rotated.
"""

from __future__ import annotations

import math

import torch

from trtllm_dflash.errors import require
from trtllm_dflash.models.layers import widen
from trtllm_dflash.plugin.ragged import RaggedBatch


def check(q, k_block, v_block, k_cache, v_cache, batch, rows, ctx_lens, window) -> None:
    require(q.dim() == 3 and k_block.dim() == 3, "q/k_block ndim", (q.dim(), k_block.dim()),
            "must be [tokens, heads, head_dim]")
    nh, nkv = q.shape[1], k_block.shape[1]
    require(nh % nkv == 0, "num_heads/num_kv_heads", (nh, nkv), "num_heads must be a multiple of num_kv_heads")
    require(k_block.shape == v_block.shape and k_block.shape[0] == q.shape[0] and k_block.shape[2] == q.shape[2],
            "k_block.shape", tuple(k_block.shape), f"must be [{q.shape[0]}, num_kv_heads, {q.shape[2]}] like v_block")
    require(k_cache.dim() == 4 and k_cache.shape[2:] == k_block.shape[1:] and k_cache.shape == v_cache.shape,
            "k_cache.shape", tuple(k_cache.shape), "must be [num_rows, max_len, num_kv_heads, head_dim] like v_cache")
    require(rows.shape == (batch.num_seqs,) and ctx_lens.shape == (batch.num_seqs,), "rows/ctx_lens shape",
            (tuple(rows.shape), tuple(ctx_lens.shape)), f"must both be [num_seqs={batch.num_seqs}]")
    require(window is None or window >= 1, "window", window, "must be >= 1 tokens or None")


def block_attention_reference(
    q: torch.Tensor,  # [Tq, num_heads, hd] block queries, flat over sequences
    k_block: torch.Tensor,  # [Tq, num_kv_heads, hd] the block's own keys
    v_block: torch.Tensor,  # [Tq, num_kv_heads, hd]
    k_cache: torch.Tensor,  # [num_rows, max_len, num_kv_heads, hd] one layer's context cache
    v_cache: torch.Tensor,  # [num_rows, max_len, num_kv_heads, hd]
    batch: RaggedBatch,  # cu_seqlens over the Tq block tokens
    rows: torch.Tensor,  # [num_seqs] cache row of each sequence
    ctx_lens: torch.Tensor,  # [num_seqs] committed context tokens of each sequence (0 allowed)
    causal: bool = False,  # block key j visible to block query i only if j <= i
    window: int | None = None,  # keys with q_pos - k_pos >= window are hidden; None = unlimited
    sm_scale: float | None = None,  # default head_dim ** -0.5 (the drafter's)
) -> torch.Tensor:  # [Tq, num_heads, hd]
    """Plain torch reference (one sequence at a time, fp32 math): the CPU path and the kernels' oracle."""
    check(q, k_block, v_block, k_cache, v_cache, batch, rows, ctx_lens, window)
    nh, hd = q.shape[1], q.shape[2]
    group = nh // k_block.shape[1]
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(hd)
    out = torch.empty_like(q)
    cu = batch.cu_seqlens.tolist()
    for i, (row, ctx) in enumerate(zip(rows.tolist(), ctx_lens.tolist())):
        lo, hi = cu[i], cu[i + 1]
        if hi == lo:
            continue
        k = widen(torch.cat([k_cache[row, :ctx], k_block[lo:hi]]))  # [ctx + n, n_kv, hd]
        v = widen(torch.cat([v_cache[row, :ctx], v_block[lo:hi]]))
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # [ctx + n, nh, hd]
        q_pos = ctx + torch.arange(hi - lo, device=q.device)[:, None]  # [n, 1]
        k_pos = torch.arange(ctx + hi - lo, device=q.device)[None, :]  # [1, ctx + n]
        allowed = torch.ones(hi - lo, ctx + hi - lo, dtype=torch.bool, device=q.device)  # [n, ctx + n]
        if causal:
            allowed &= k_pos <= q_pos
        if window is not None:
            allowed &= q_pos - k_pos < window
        s = torch.einsum("qhd,khd->hqk", widen(q[lo:hi]), k) * scale  # [nh, n, ctx + n]
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
        out[lo:hi] = torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)
    return out
