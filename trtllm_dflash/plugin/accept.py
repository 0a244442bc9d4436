"""The DFlash acceptance rule on a ragged batch: accepted length, bonus token and emitted tokens.

Vocabulary as in ``runtime/sampling.py``: sequence i proposes n_i drafts d_1..d_{n_i} and the target verifies n_i + 1
slots, yielding target samples x_0..x_{n_i}. The accepted length a is the longest prefix with d_{j+1} == x_j; the
emitted tokens are x_0..x_a, the last of which (x_a) is the bonus. Lossless at any temperature because every emitted
token is a target sample (dflash.md §2.2; arXiv 2211.17192 with a one-hot proposal).

Ragged layout (vLLM ``SpecDecodeMetadata``): drafts are flat [total_drafts] with ``cu_num_drafts`` [num_seqs + 1];
sequence i's target slots are rows ``cu_num_drafts[i] + i + [0, n_i]`` of the flat [total_drafts + num_seqs] target
tensors. Worked example, n = [2, 0, 1]: cu_num_drafts = [0, 2, 2, 3]; target slots 0–2 (seq 0), 3 (seq 1), 4–5 (seq 2).

Target samples come from either
- greedy: argmax of the target logits (ties -> lowest index, like ``torch.argmax``), or
- sampling: an inverse CDF of the processed probabilities (``sampling.processed_probs``) with caller-supplied uniforms
  u ∈ [0, 1). The CDF is taken in fixed point (w_j = floor(p_j · 2^40), an int64) so kernel and reference agree
  bit for bit regardless of summation order; the quantisation moves at most vocab · 2^-40 of probability mass
  (< 2e-7 for a 151,936-token vocabulary), far below anything a sample can detect.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trtllm_dflash.errors import require

PLACEHOLDER_TOKEN_ID = -1  # fills emitted_ids past each sequence's a + 1 tokens
CDF_SCALE = float(2**40)  # fixed-point scale of the inverse CDF (see the module docstring)


@dataclass(frozen=True, slots=True)
class AcceptOutput:
    accepted_lengths: torch.Tensor  # [num_seqs] int64: a ∈ [0, n_i]; τ = a + 1
    bonus_ids: torch.Tensor  # [num_seqs] int64: x_a, the next step's first block token
    emitted_ids: torch.Tensor  # [num_seqs, max_num_drafts + 1] int64: x_0..x_a then PLACEHOLDER_TOKEN_ID

    @classmethod
    def make_dummy(cls, emitted: list[list[int]], width: int) -> "AcceptOutput":
        """Test builder from each sequence's emitted tokens, e.g. ``make_dummy([[7, 8, 5], [3]], 4)``."""
        out = torch.full((len(emitted), width), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
        for i, toks in enumerate(emitted):
            out[i, : len(toks)] = torch.tensor(toks)
        return cls(torch.tensor([len(t) - 1 for t in emitted]), torch.tensor([t[-1] for t in emitted]), out)


def check_drafts(draft_ids, cu_num_drafts, num_target_rows) -> None:
    require(draft_ids.dim() == 1 and cu_num_drafts.dim() == 1, "draft_ids/cu_num_drafts ndim",
            (draft_ids.dim(), cu_num_drafts.dim()), "must both be 1-D (flat drafts, cumulative offsets)")
    num_seqs = cu_num_drafts.shape[0] - 1
    require(num_target_rows == draft_ids.shape[0] + num_seqs, "target rows", num_target_rows,
            f"must be total_drafts + num_seqs = {draft_ids.shape[0] + num_seqs}")


def greedy_samples_reference(logits: torch.Tensor) -> torch.Tensor:
    """logits [N, V] -> [N] int64 argmax."""
    return logits.argmax(-1)


def inverse_cdf_reference(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [N, V], uniforms [N] in [0, 1) -> [N] int64: first j with cumsum(w)_j > floor(u · Σw)."""
    w = torch.floor(probs.float() * CDF_SCALE).long()  # [N, V]
    cum = w.cumsum(-1)  # [N, V], exact
    thr = torch.floor(uniforms.double() * cum[:, -1].double()).long()  # [N]
    return (cum > thr[:, None]).long().argmax(-1)  # first index where the CDF passes the threshold


def accept_reference(
    draft_ids: torch.Tensor,  # [total_drafts] int64 d_1..d_{n_i} of every sequence, flat
    cu_num_drafts: torch.Tensor,  # [num_seqs + 1] int32 offsets into draft_ids
    target_ids: torch.Tensor,  # [total_drafts + num_seqs] int64 x_0..x_{n_i} of every sequence, flat
    max_num_drafts: int,  # host int >= every n_i; width of emitted_ids is max_num_drafts + 1
) -> AcceptOutput:
    check_drafts(draft_ids, cu_num_drafts, target_ids.shape[0])
    cu = cu_num_drafts.tolist()
    num_seqs = len(cu) - 1
    acc = torch.zeros(num_seqs, dtype=torch.long, device=target_ids.device)
    emitted = torch.full((num_seqs, max_num_drafts + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long,
                         device=target_ids.device)
    for i in range(num_seqs):
        d = draft_ids[cu[i]: cu[i + 1]]  # [n]
        x = target_ids[cu[i] + i: cu[i + 1] + i + 1]  # [n + 1]
        a = int((d == x[:-1]).long().cumprod(0).sum())
        acc[i] = a
        emitted[i, : a + 1] = x[: a + 1]
    bonus = emitted.gather(1, acc[:, None])[:, 0]
    return AcceptOutput(acc, bonus, emitted)
