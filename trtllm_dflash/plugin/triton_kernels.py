"""The OpenAI Triton kernels behind the drafting ops, their launchers, and the ops' kernel entry points.

The entry points at the end (``kv_inject_triton``, ``block_attention_triton``, ``accept_triton``, ...) take the op
modules' contracts (``kv_inject``, ``block_attention``, ``accept``: shapes, checks, torch references) and run the
kernels; ``dispatch`` chooses between them and the references. Importing this module imports Triton.

Conventions shared by every kernel:
- Arithmetic is fp32 whatever the storage dtype: values are upcast right after ``tl.load`` and cast to the output
  dtype at ``tl.store``. (It is also what makes the kernels testable on CPU: Triton 3.9's interpreter mishandles
  arithmetic and ``tl.dot`` on bf16 operands, while bf16 <-> fp32 conversion works.)
- ``tl.dot`` in block attention: fp32 operands with ``input_precision="ieee"`` when the inputs are fp32 or when running
  under ``TRITON_INTERPRET=1``; bf16/fp16 operands with fp32 accumulation otherwise (tensor cores, the usual
  FlashAttention numerics).
- Ragged batches: one program per (sequence, ...) reads its offsets from ``cu_*``; empty sequences exit at once.
- Argument order is (input pointers, int scalars, output pointers, constexprs): the order in which a TensorRT AOT
  plugin (``trt.py``) launches a kernel, so the same kernels serve both paths. Float parameters that are fixed per
  model (eps, softmax scale) are constexprs for the same reason: AOT plugins pass only integer extra arguments.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from trtllm_dflash.errors import require
from trtllm_dflash.plugin.accept import CDF_SCALE, PLACEHOLDER_TOKEN_ID, AcceptOutput, check_drafts
from trtllm_dflash.plugin.block_attention import check as check_attention
from trtllm_dflash.plugin.kv_inject import check as check_inject, context_features

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


# ---------------------------------------------------------------------------------------------------------------------
# KV injection: k_norm + RoPE + store into the drafter's context cache


@triton.jit
def _knorm_rope_store_kernel(
    kv_ptr,  # [T, L·2·NUM_KV·HEAD_DIM] fused GEMM output, row stride stride_kv_t
    row_ptr,  # [T] int64 cache row per token
    pos_ptr,  # [T] int64 absolute position per token
    knorm_ptr,  # [L, HEAD_DIM]
    cos_ptr,  # [P, HEAD_DIM]
    sin_ptr,  # [P, HEAD_DIM]
    num_tokens,
    stride_kv_t,
    stride_rope_p,
    stride_c_l, stride_c_r, stride_c_p, stride_c_h,
    kc_ptr,  # [L, R, max_len, NUM_KV, HEAD_DIM] cache (last dim contiguous); DENSE: [L, T, NUM_KV, HEAD_DIM]
    vc_ptr,  # same layout and strides as kc_ptr
    EPS: tl.constexpr,
    DENSE: tl.constexpr,  # store token t at [layer, t] (TensorRT op: outputs cannot alias the cache)
    NUM_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_T: tl.constexpr,  # tokens per program
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Grid (cdiv(T, BLOCK_T), L); tiles are [BLOCK_T tokens, BLOCK_KV heads, BLOCK_HALF dims of one RoPE half].

    Argument order is inputs, int scalars, outputs, constexprs: the order a TensorRT AOT plugin launches with.
    """
    layer = tl.program_id(1)
    t1 = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T]
    t_valid = t1 < num_tokens
    row = tl.load(row_ptr + t1, mask=t_valid, other=0)[:, None, None]  # [BLOCK_T, 1, 1]
    pos = tl.load(pos_ptr + t1, mask=t_valid, other=0)[:, None, None]
    t = t1[:, None, None]
    h = tl.arange(0, BLOCK_KV)[None, :, None]  # [1, BLOCK_KV, 1] kv head
    d = tl.arange(0, BLOCK_HALF)[None, None, :]  # [1, 1, BLOCK_HALF] dim within a half
    mask = (t < num_tokens) & (h < NUM_KV) & (d < HALF)
    k_base = kv_ptr + t * stride_kv_t + layer * 2 * NUM_KV * HEAD_DIM + h * HEAD_DIM
    k1 = tl.load(k_base + d, mask=mask, other=0.0).to(tl.float32)  # first half
    k2 = tl.load(k_base + HALF + d, mask=mask, other=0.0).to(tl.float32)  # second half
    inv_rms = 1.0 / tl.sqrt((tl.sum(k1 * k1, axis=2) + tl.sum(k2 * k2, axis=2)) / HEAD_DIM + EPS)  # [BT, BKV]
    w1 = tl.load(knorm_ptr + layer * HEAD_DIM + d, mask=d < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(knorm_ptr + layer * HEAD_DIM + HALF + d, mask=d < HALF, other=0.0).to(tl.float32)
    k1 = k1 * inv_rms[:, :, None] * w1
    k2 = k2 * inv_rms[:, :, None] * w2
    rmask = (t < num_tokens) & (d < HALF)
    cos1 = tl.load(cos_ptr + pos * stride_rope_p + d, mask=rmask, other=0.0).to(tl.float32)  # [BT, 1, BH]
    cos2 = tl.load(cos_ptr + pos * stride_rope_p + HALF + d, mask=rmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_rope_p + d, mask=rmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_rope_p + HALF + d, mask=rmask, other=0.0).to(tl.float32)
    r1 = k1 * cos1 - k2 * sin1  # rotate_half: [-x2, x1]
    r2 = k2 * cos2 + k1 * sin2
    if DENSE:
        dst = layer * stride_c_l + t * stride_c_p + h * stride_c_h
    else:
        dst = layer * stride_c_l + row * stride_c_r + pos * stride_c_p + h * stride_c_h
    out_ty = kc_ptr.dtype.element_ty
    tl.store(kc_ptr + dst + d, r1.to(out_ty), mask=mask)
    tl.store(kc_ptr + dst + HALF + d, r2.to(out_ty), mask=mask)
    v_base = k_base + NUM_KV * HEAD_DIM
    tl.store(vc_ptr + dst + d, tl.load(v_base + d, mask=mask, other=0.0).to(tl.float32).to(out_ty), mask=mask)
    tl.store(vc_ptr + dst + HALF + d, tl.load(v_base + HALF + d, mask=mask, other=0.0).to(tl.float32).to(out_ty),
             mask=mask)


def knorm_rope_store(kv, row, pos, k_norm, eps, cos, sin, k_cache, v_cache) -> None:
    """kv [T, L·2·n_kv·hd]; row, pos [T] int64; k_norm [L, hd]; cos/sin [P, hd]; caches [L, R, max_len, n_kv, hd]."""
    L, _, _, n_kv, hd = k_cache.shape
    assert kv.stride(1) == 1 and k_cache.stride(4) == 1 and k_cache.stride() == v_cache.stride()
    assert cos.stride(1) == 1 and cos.stride() == sin.stride() and k_norm.is_contiguous() and hd % 2 == 0
    t = kv.shape[0]
    block_kv, block_half = _pow2(n_kv), _pow2(hd // 2)
    block_t = max(1, min(_pow2(t), 4096 // (block_kv * block_half), 64))  # ~4K elements per tile
    _knorm_rope_store_kernel[(triton.cdiv(t, block_t), L)](
        kv, row.contiguous(), pos.contiguous(), k_norm, cos, sin, t, kv.stride(0), cos.stride(0),
        *k_cache.stride()[:4], k_cache, v_cache, EPS=float(eps), DENSE=False, NUM_KV=n_kv, HEAD_DIM=hd,
        HALF=hd // 2, BLOCK_T=block_t, BLOCK_KV=block_kv, BLOCK_HALF=block_half,
    )


def knorm_rope_dense(kv, pos, k_norm, eps, cos, sin, num_layers):
    """The TensorRT op's semantics (``trt.py`` ``dflash::kv_rope``): kv [T, L·2·n_kv·hd], pos [T] -> k, v [L, T, n_kv, hd]."""
    t = kv.shape[0]
    hd = k_norm.shape[1]
    n_kv = kv.shape[1] // (num_layers * 2 * hd)
    k = torch.empty(num_layers, t, n_kv, hd, dtype=kv.dtype, device=kv.device)
    v = torch.empty_like(k)
    block_kv, block_half = _pow2(n_kv), _pow2(hd // 2)
    block_t = max(1, min(_pow2(t), 4096 // (block_kv * block_half), 64))
    pos = pos.long().contiguous()
    _knorm_rope_store_kernel[(triton.cdiv(t, block_t), num_layers)](
        kv, pos, pos, k_norm, cos, sin, t, kv.stride(0), cos.stride(0), k.stride(0), 0, k.stride(1), k.stride(2),
        k, v, EPS=float(eps), DENSE=True, NUM_KV=n_kv, HEAD_DIM=hd, HALF=hd // 2, BLOCK_T=block_t,
        BLOCK_KV=block_kv, BLOCK_HALF=block_half,
    )
    return k, v


# ---------------------------------------------------------------------------------------------------------------------
# Block attention: B block queries over [cached context ; block], no mask by default


@triton.jit
def _block_attention_kernel(
    q_ptr,  # [Tq, NH, HEAD_DIM]
    kb_ptr,  # [Tq, NKV, HEAD_DIM] block keys
    vb_ptr,  # [Tq, NKV, HEAD_DIM] block values
    kc_ptr,  # [R, max_len, NKV, HEAD_DIM] one layer's context cache
    vc_ptr,  # same layout and strides as kc_ptr
    cu_q_ptr,  # [num_seqs + 1] int32
    rows_ptr,  # [num_seqs] int64
    ctx_ptr,  # [num_seqs] int64 context length (0 allowed)
    window,  # tokens; used only when USE_WINDOW
    stride_q_t, stride_q_h,
    stride_kb_t, stride_kb_h,
    stride_c_r, stride_c_p, stride_c_h,
    stride_o_t, stride_o_h,
    o_ptr,  # [Tq, NH, HEAD_DIM] output (last: inputs, int scalars, outputs is TensorRT's AOT launch order)
    SM_SCALE: tl.constexpr,  # fixed per model (head_dim ** -0.5); constexpr because AOT plugins pass ints only
    GROUP: tl.constexpr,  # NH // NKV
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,  # (query token, head in group) pairs per program
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_F32: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    mblk = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    if mblk * BLOCK_M < q_len * GROUP:
        ctx = tl.load(ctx_ptr + seq)
        row = tl.load(rows_ptr + seq)
        offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] flattened (token, head-in-group)
        m_valid = offs_m < q_len * GROUP
        tok = offs_m // GROUP
        head = kvh * GROUP + offs_m % GROUP
        d = tl.arange(0, BLOCK_D)
        d_valid = d < HEAD_DIM
        q = tl.load(q_ptr + (q_start + tok)[:, None] * stride_q_t + head[:, None] * stride_q_h + d[None, :],
                    mask=m_valid[:, None] & d_valid[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
        q = q.to(tl.float32) if DOT_F32 else q
        q_pos = ctx + tok  # [BLOCK_M] absolute positions
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked tile then contributes exp(-inf) = 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # 1) cached context keys at positions [lo, ctx): always before every query, so causality never bites here
        lo = 0
        if USE_WINDOW:
            first_q = ctx + (mblk * BLOCK_M) // GROUP
            lo = tl.maximum(first_q - window + 1, 0)
            lo = (lo // BLOCK_N) * BLOCK_N
        c_base = kc_ptr + row * stride_c_r + kvh * stride_c_h
        v_base = vc_ptr + row * stride_c_r + kvh * stride_c_h
        for start in range(lo, ctx, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            n_valid = offs_n < ctx
            kv_mask = n_valid[:, None] & d_valid[None, :]
            k = tl.load(c_base + offs_n[:, None] * stride_c_p + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(v_base + offs_n[:, None] * stride_c_p + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * SM_SCALE
            else:
                s = tl.dot(q, tl.trans(k)) * SM_SCALE  # [BLOCK_M, BLOCK_N]
            allowed = n_valid[None, :]
            if USE_WINDOW:
                allowed = allowed & (q_pos[:, None] - offs_n[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # 2) the block's own keys at positions ctx + j, j in [0, q_len): bidirectional unless CAUSAL
        b_base = kb_ptr + q_start * stride_kb_t + kvh * stride_kb_h
        vb_base = vb_ptr + q_start * stride_kb_t + kvh * stride_kb_h
        for start in range(0, q_len, BLOCK_N):
            offs_j = start + tl.arange(0, BLOCK_N)
            j_valid = offs_j < q_len
            kv_mask = j_valid[:, None] & d_valid[None, :]
            k = tl.load(b_base + offs_j[:, None] * stride_kb_t + d[None, :], mask=kv_mask, other=0.0)
            v = tl.load(vb_base + offs_j[:, None] * stride_kb_t + d[None, :], mask=kv_mask, other=0.0)
            if DOT_F32:
                s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee") * SM_SCALE
            else:
                s = tl.dot(q, tl.trans(k)) * SM_SCALE
            key_pos = ctx + offs_j
            allowed = j_valid[None, :]
            if CAUSAL:
                allowed = allowed & (key_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                allowed = allowed & (q_pos[:, None] - key_pos[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            p = tl.exp(s - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if DOT_F32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # valid rows see at least their own key, so l_i >= 1 there; padding rows (l_i == 0) are never stored
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_mask = m_valid[:, None] & d_valid[None, :]
        tl.store(o_ptr + (q_start + tok)[:, None] * stride_o_t + head[:, None] * stride_o_h + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=o_mask)


def block_attention(q, k_block, v_block, k_cache, v_cache, cu_seqlens_q, max_seqlen_q, rows, ctx_lens, sm_scale,
                    causal, window, out) -> None:
    """See ``block_attention.block_attention_reference`` for the contract; ``out`` [Tq, NH, hd] is written."""
    nh, hd = q.shape[1], q.shape[2]
    nkv = k_block.shape[1]
    group = nh // nkv
    assert q.stride(2) == 1 and k_block.stride(2) == 1 and k_cache.stride(3) == 1 and out.stride(2) == 1
    assert k_block.stride() == v_block.stride() and k_cache.stride() == v_cache.stride()
    dot_f32 = INTERPRET or q.dtype == torch.float32
    block_m = max(16, min(128, _pow2(max_seqlen_q * group)))
    block_n = 16 if hd > 64 or INTERPRET else 32
    grid = (rows.shape[0], nkv, triton.cdiv(max(max_seqlen_q * group, 1), block_m))
    _block_attention_kernel[grid](
        q, k_block, v_block, k_cache, v_cache, cu_seqlens_q, rows.long().contiguous(), ctx_lens.long().contiguous(),
        int(window or 0), q.stride(0), q.stride(1), k_block.stride(0), k_block.stride(1), *k_cache.stride()[:3],
        out.stride(0), out.stride(1), out, SM_SCALE=float(sm_scale), GROUP=group, HEAD_DIM=hd, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, _pow2(hd)),
        CAUSAL=bool(causal), USE_WINDOW=window is not None, DOT_F32=dot_f32,
    )


# ---------------------------------------------------------------------------------------------------------------------
# Target samples: greedy argmax and inverse-CDF sampling with supplied uniforms


@triton.jit
def _argmax_kernel(logits_ptr, V, stride_n, out_ptr, BLOCK_V: tl.constexpr):
    """One program per row; ties go to the lowest index (torch.argmax's documented rule)."""
    n = tl.program_id(0)
    best = float("-inf")
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + n * stride_n + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        chunk_idx = tl.min(tl.where(x == chunk_max, offs, V), axis=0)  # first index attaining the chunk max
        take = chunk_max > best  # strict: an equal later chunk does not win
        best_idx = tl.where(take, chunk_idx, best_idx)
        best = tl.where(take, chunk_max, best)
    tl.store(out_ptr + n, best_idx.to(tl.int64))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64."""
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    if logits.shape[0]:
        assert logits.stride(1) == 1
        _argmax_kernel[(logits.shape[0],)](logits, logits.shape[1], logits.stride(0), out,
                                           BLOCK_V=min(4096, _pow2(logits.shape[1])))
    return out


@triton.jit
def _inverse_cdf_kernel(probs_ptr, u_ptr, V, stride_n, out_ptr, SCALE: tl.constexpr, BLOCK_V: tl.constexpr):
    """Fixed-point inverse CDF: w_j = floor(p_j · SCALE) as int64; pick the first j with cumsum(w)_j > floor(u · Σw).

    Integer prefix sums are exact in any summation order, so this kernel and the torch reference agree bit for bit.
    """
    n = tl.program_id(0)
    total = tl.zeros([], tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(probs_ptr + n * stride_n + offs, mask=offs < V, other=0.0).to(tl.float32)
        total += tl.sum(tl.floor(p * SCALE).to(tl.int64), axis=0)
    u = tl.load(u_ptr + n).to(tl.float64)
    thr = tl.floor(u * total.to(tl.float64)).to(tl.int64)
    carry = tl.zeros([], tl.int64)
    found = tl.zeros([], tl.int64) + V
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        p = tl.load(probs_ptr + n * stride_n + offs, mask=offs < V, other=0.0).to(tl.float32)
        cum = carry + tl.cumsum(tl.floor(p * SCALE).to(tl.int64), axis=0)
        hit = tl.min(tl.where((cum > thr) & (offs < V), offs, V), axis=0).to(tl.int64)
        found = tl.minimum(found, hit)
        carry = tl.max(tl.where(offs < V, cum, 0), axis=0)
    tl.store(out_ptr + n, found)


def inverse_cdf_rows(probs: torch.Tensor, uniforms: torch.Tensor, scale: float) -> torch.Tensor:
    """probs [N, V] (rows sum to ~1), uniforms [N] in [0, 1) -> [N] int64."""
    out = torch.empty(probs.shape[0], dtype=torch.int64, device=probs.device)
    if probs.shape[0]:
        assert probs.stride(1) == 1
        _inverse_cdf_kernel[(probs.shape[0],)](probs, uniforms.contiguous(), probs.shape[1], probs.stride(0), out,
                                               SCALE=scale, BLOCK_V=min(4096, _pow2(probs.shape[1])))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance: longest matching prefix, bonus token, emitted tokens


@triton.jit
def _accept_kernel(
    draft_ptr,  # [total_drafts] int64
    cu_d_ptr,  # [num_seqs + 1] int32; sequence i's target samples start at cu_d[i] + i
    target_ptr,  # [total_drafts + num_seqs] int64
    width,
    acc_ptr,  # [num_seqs] int64 out: accepted length a
    bonus_ptr,  # [num_seqs] int64 out: x_a
    emitted_ptr,  # [num_seqs, width] int64 out: x_0..x_a then PLACEHOLDER
    PLACEHOLDER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    seq = tl.program_id(0)
    d0 = tl.load(cu_d_ptr + seq)
    n = tl.load(cu_d_ptr + seq + 1) - d0
    t0 = d0 + seq
    j = tl.arange(0, BLOCK)
    drafts = tl.load(draft_ptr + d0 + j, mask=j < n, other=-1)
    samples = tl.load(target_ptr + t0 + j, mask=j <= n, other=PLACEHOLDER)
    mismatch = (drafts != samples) | (j >= n)
    a = tl.min(tl.where(mismatch, j, BLOCK), axis=0)  # first mismatch; j == n is always one
    tl.store(acc_ptr + seq, a.to(tl.int64))
    tl.store(bonus_ptr + seq, tl.load(target_ptr + t0 + a))
    tl.store(emitted_ptr + seq * width + j, tl.where(j <= a, samples, PLACEHOLDER), mask=j < width)


def accept_rows(draft_ids, cu_num_drafts, target_ids, max_num_drafts, placeholder):
    """See ``accept.accept_reference``."""
    num_seqs = cu_num_drafts.shape[0] - 1
    dev = target_ids.device
    acc = torch.empty(num_seqs, dtype=torch.int64, device=dev)
    bonus = torch.empty(num_seqs, dtype=torch.int64, device=dev)
    emitted = torch.empty(num_seqs, max_num_drafts + 1, dtype=torch.int64, device=dev)
    if num_seqs:
        _accept_kernel[(num_seqs,)](draft_ids, cu_num_drafts, target_ids, max_num_drafts + 1, acc, bonus, emitted,
                                    PLACEHOLDER=placeholder, BLOCK=max(16, _pow2(max_num_drafts + 1)))
    return acc, bonus, emitted


# ---------------------------------------------------------------------------------------------------------------------
# The ops' kernel entry points: the op modules' contracts, checked, on the launchers above


def kv_inject_triton(taps, batch, start_pos, rows, w, cos, sin, k_cache, v_cache) -> None:
    """Same contract as ``kv_inject_reference``; k_norm + RoPE + cache store run as one Triton kernel."""
    check_inject(taps, batch, start_pos, rows, w, k_cache, v_cache)
    t = taps.shape[0]
    if t == 0:
        return
    kv = context_features(taps, w) @ w.kv.T  # [T, L·2·n_kv·hd]: the one fused GEMM
    seq = batch.token_seq_ids(t)  # [T]
    pos = start_pos.long()[seq] + batch.token_offsets(t)  # [T]
    row = rows.long()[seq]  # [T]
    knorm_rope_store(kv, row, pos, w.k_norm, w.eps, cos, sin, k_cache, v_cache)


def block_attention_triton(q, k_block, v_block, k_cache, v_cache, batch, rows, ctx_lens, causal=False, window=None,
                           sm_scale=None) -> torch.Tensor:
    """Same contract as ``block_attention_reference``; one Triton program per (sequence, kv head, query tile)."""
    check_attention(q, k_block, v_block, k_cache, v_cache, batch, rows, ctx_lens, window)
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(q.shape[2])
    block_attention(q, k_block, v_block, k_cache, v_cache, batch.cu_seqlens, batch.max_seqlen, rows, ctx_lens, scale,
                    causal, window, out)
    return out


def accept_triton(draft_ids, cu_num_drafts, target_ids, max_num_drafts) -> AcceptOutput:
    check_drafts(draft_ids, cu_num_drafts, target_ids.shape[0])
    acc, bonus, emitted = accept_rows(draft_ids.long().contiguous(), cu_num_drafts.int().contiguous(),
                                      target_ids.long().contiguous(), max_num_drafts, PLACEHOLDER_TOKEN_ID)
    return AcceptOutput(acc, bonus, emitted)


def greedy_samples_triton(logits: torch.Tensor) -> torch.Tensor:
    return argmax_rows(logits.contiguous())


def inverse_cdf_triton(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    require(uniforms.shape == probs.shape[:1], "uniforms.shape", tuple(uniforms.shape), f"must be [{probs.shape[0]}]")
    return inverse_cdf_rows(probs.contiguous(), uniforms, CDF_SCALE)
