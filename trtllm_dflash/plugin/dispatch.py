"""Choosing between the Triton kernels and their torch references: one switch, explicit, testable.

``Impl.AUTO`` (the default) runs the kernels on CUDA tensors when Triton is importable and the torch references
otherwise (CPU). ``Impl.TRITON`` forces the kernels: on CPU that needs ``TRITON_INTERPRET=1`` set before Triton is
first imported (the tests do this). ``Impl.TORCH`` forces the references, e.g. to A/B a GPU run. Nothing falls back
silently: a forced choice that cannot run raises ``ConfigError`` saying how to fix it.
"""

from __future__ import annotations

import enum
import importlib.util
import os

import torch

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.plugin import accept as _accept
from trtllm_dflash.plugin import block_attention as _attn
from trtllm_dflash.plugin import kv_inject as _inject
from trtllm_dflash.plugin.accept import AcceptOutput
from trtllm_dflash.plugin.kv_inject import InjectWeights
from trtllm_dflash.plugin.ragged import RaggedBatch


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


def kv_inject(taps: torch.Tensor, batch: RaggedBatch, start_pos: torch.Tensor, rows: torch.Tensor, w: InjectWeights,
              cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              impl: Impl = Impl.AUTO) -> None:
    """See ``kv_inject.kv_inject_reference`` for shapes; writes k_cache/v_cache in place, commits nothing."""
    fn = _inject.kv_inject_triton if resolve(impl, taps.device) is Impl.TRITON else _inject.kv_inject_reference
    fn(taps, batch, start_pos, rows, w, cos, sin, k_cache, v_cache)


def block_attention(q, k_block, v_block, k_cache, v_cache, batch: RaggedBatch, rows, ctx_lens, causal=False,
                    window=None, sm_scale=None, impl: Impl = Impl.AUTO) -> torch.Tensor:
    """See ``block_attention.block_attention_reference`` for shapes."""
    if resolve(impl, q.device) is Impl.TRITON:
        fn = _attn.block_attention_triton
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
        samples = _accept.greedy_samples_triton(target_logits)
        return _accept.accept_triton(draft_ids, cu_num_drafts, samples, max_num_drafts)
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
        samples = _accept.inverse_cdf_triton(target_probs, uniforms)
        return _accept.accept_triton(draft_ids, cu_num_drafts, samples, max_num_drafts)
    samples = _accept.inverse_cdf_reference(target_probs, uniforms)
    return _accept.accept_reference(draft_ids, cu_num_drafts, samples, max_num_drafts)


def accept_samples(draft_ids, cu_num_drafts, target_ids, max_num_drafts, impl: Impl = Impl.AUTO) -> AcceptOutput:
    """Acceptance from target samples the caller already drew ([total_drafts + num_seqs] int64)."""
    fn = _accept.accept_triton if resolve(impl, target_ids.device) is Impl.TRITON else _accept.accept_reference
    return fn(draft_ids, cu_num_drafts, target_ids, max_num_drafts)
