"""KV injection for a ragged batch: committed tokens' target taps -> every drafter layer's context K/V in the cache.

Same math as ``DrafterModel.inject`` (dflash.md §1.3–1.4), restructured the way SGLang and vLLM do it (§2.3):

    C   = hidden_norm(fc(taps))                      [T, H]            one GEMM + RMSNorm, shared by all layers
    KV  = C @ W_kv.T                                 [T, L·2·n_kv·hd]  ONE GEMM for every layer's k_proj and v_proj
    K   = RoPE(k_norm_ℓ(KV[:, ℓ, 0]), pos)           per layer ℓ, at the tokens' absolute positions
    V   = KV[:, ℓ, 1]                                (no norm on V)
    cache.k[ℓ, row, pos], cache.v[ℓ, row, pos] = K, V

The last two lines are one Triton kernel (``triton_kernels.knorm_rope_store``), grid (tokens, layers). Token t of
sequence i sits at absolute position ``start_pos[i] + (t - cu_seqlens[i])`` of cache row ``rows[i]``. Nothing is
committed here: the caller advances ``KVCache.lengths`` (``KVCache.commit``), exactly as after ``DrafterModel.inject``.
Unlike ``DrafterModel.inject``, which pads to [b, T] and writes scratch past each row's committed tokens, only the real
tokens are written.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_dflash.errors import require
from trtllm_dflash.models.layers import widen
from trtllm_dflash.plugin.ragged import RaggedBatch


@dataclass(frozen=True, slots=True)
class InjectWeights:
    """The drafter weights KV injection reads, with every layer's k_proj/v_proj fused into one matrix."""

    fc: torch.Tensor  # [H, K·H]
    hidden_norm: torch.Tensor  # [H]
    kv: torch.Tensor  # [L·2·n_kv·hd, H]; row order (layer, k|v, kv_head, dim)
    k_norm: torch.Tensor  # [L, hd]
    eps: float  # rms_norm_eps of hidden_norm and k_norm
    num_kv_heads: int
    head_dim: int

    @property
    def num_layers(self) -> int:
        return self.k_norm.shape[0]

    @classmethod
    def from_drafter(cls, drafter) -> "InjectWeights":
        """Fuse a ``DrafterModel``'s weights (done once at load time; the copy costs L·2·n_kv·hd·H elements)."""
        spec = drafter.spec
        require(not spec.attention_bias, "drafter.attention_bias", True, "fused KV injection supports bias-free "
                "k_proj/v_proj only (every released DFlash drafter)", "use DrafterModel.inject instead")
        blocks = []
        for layer in drafter.layers:
            blocks += [layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight]  # each [n_kv·hd, H]
        return cls(
            fc=drafter.fc.weight.detach(),
            hidden_norm=drafter.hidden_norm.weight.detach(),
            kv=torch.cat(blocks, dim=0).detach().contiguous(),
            k_norm=torch.stack([layer.self_attn.k_norm.weight for layer in drafter.layers]).detach().contiguous(),
            eps=spec.rms_norm_eps,
            num_kv_heads=spec.num_key_value_heads,
            head_dim=spec.head_dim,
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """layers.RMSNorm as a function: x [..., d], weight [d] (broadcastable); statistics in fp32 (fp64 stays fp64)."""
    dtype = x.dtype
    xf = widen(x)
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotate_half RoPE (layers.Rotary.apply): x [..., hd] with cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def context_features(taps: torch.Tensor, w: InjectWeights) -> torch.Tensor:
    """taps [T, K·H] -> C = hidden_norm(fc(taps)) [T, H] in the weights' dtype."""
    return rms_norm(taps.to(w.fc.dtype) @ w.fc.T, w.hidden_norm, w.eps)


def check(taps, batch, start_pos, rows, w, k_cache, v_cache) -> None:
    require(taps.dim() == 2 and taps.shape[1] == w.fc.shape[1], "taps.shape", tuple(taps.shape),
            f"must be [num_tokens, {w.fc.shape[1]}] (num_taps * hidden)")
    require(start_pos.shape == (batch.num_seqs,) and rows.shape == (batch.num_seqs,), "start_pos/rows shape",
            (tuple(start_pos.shape), tuple(rows.shape)), f"must both be [num_seqs={batch.num_seqs}]")
    shape = (w.num_layers, k_cache.shape[1], k_cache.shape[2], w.num_kv_heads, w.head_dim)
    require(tuple(k_cache.shape) == shape and tuple(v_cache.shape) == shape, "k_cache.shape", tuple(k_cache.shape),
            f"must be {shape} (layers, rows, max_len, n_kv, head_dim)")


def kv_inject_reference(
    taps: torch.Tensor,  # [T, K·H] target taps of the committed tokens, flat over the batch
    batch: RaggedBatch,  # cu_seqlens [num_seqs + 1] over the T tokens
    start_pos: torch.Tensor,  # [num_seqs] int64: absolute position of each sequence's first new token
    rows: torch.Tensor,  # [num_seqs] int64: cache row of each sequence
    w: InjectWeights,
    cos: torch.Tensor,  # [max_positions, hd] rotary tables (layers.Rotary.cos)
    sin: torch.Tensor,  # [max_positions, hd]
    k_cache: torch.Tensor,  # [L, num_rows, max_len, n_kv, hd], written in place
    v_cache: torch.Tensor,  # [L, num_rows, max_len, n_kv, hd], written in place
) -> None:
    """Plain torch reference of ``triton_kernels.kv_inject_triton`` (and the CPU path)."""
    check(taps, batch, start_pos, rows, w, k_cache, v_cache)
    t = taps.shape[0]
    if t == 0:
        return
    L, n_kv, hd = w.num_layers, w.num_kv_heads, w.head_dim
    kv = (context_features(taps, w) @ w.kv.T).view(t, L, 2, n_kv, hd)  # [T, L, 2, n_kv, hd]
    seq = batch.token_seq_ids(t)  # [T]
    pos = start_pos.long()[seq] + batch.token_offsets(t)  # [T]
    row = rows.long()[seq]  # [T]
    k = rms_norm(kv[:, :, 0], w.k_norm[None, :, None, :], w.eps)  # [T, L, n_kv, hd]
    k = rotate(k, cos[pos][:, None, None, :], sin[pos][:, None, None, :])
    k_cache[:, row, pos] = k.transpose(0, 1).to(k_cache.dtype)  # [L, T, n_kv, hd]
    v_cache[:, row, pos] = kv[:, :, 1].transpose(0, 1).to(v_cache.dtype)
