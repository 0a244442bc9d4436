"""Two-branch verify: the drafter's block and prompt lookup's continuation checked in one target forward.

``--ngram`` verifies one proposal per step: prompt lookup's continuation where the context ends in a recurring n-gram,
else the drafter's block. The two are right in different places, so verifying both and keeping the longer accepted
prefix accepts more per step (replayed on the shipped drafter's greedy outputs, B = 16, 128 tokens: HumanEval τ 2.847
against ``--ngram``'s 2.640, MT-Bench 1.838 against 1.815; ``learning_curve.py eval``'s ``tree_tau``). The verify
input of a row with committed length L is

    slot      L     L+1 … L+K     L+K+1 … L+2K
    token     x     d_1 … d_K     l_1   … l_K          x: the last emitted token, d: drafts, l: lookup (−1 padded)
    position  L     L+1 … L+K     L+1   … L+K          (RoPE)

where d_i sees the cache, x and d_1..d_i, and l_j sees the cache, x and l_1..l_j, never a d: each branch's hidden
states are what a verify of that branch alone computes (up to the summation order of the masked attention), so the
step is as lossless as a one-branch verify. Greedy only: the acceptance of two branches under sampling needs a
different rule. Costs a verify of 2K + 1 tokens and a drafter pass at every step: worth it where a verify costs about
one decode step whatever its width (a GPU at small batch), not on a CPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepLayout:
    """Where a verify forward's tokens go when they are not one consecutive run: RoPE ``positions`` [b, S], cache
    ``slots`` [b, S] their K/V are written to, and the attention mask ``allowed`` [b, S, kv_len] over cache slots."""

    positions: torch.Tensor
    slots: torch.Tensor
    allowed: torch.Tensor


def two_branch_layout(lengths: torch.Tensor, k: int) -> StepLayout:
    """The layout of ``[x, d_1..d_K, l_1..l_K]`` for rows with committed ``lengths`` [b] (see the module docstring)."""
    dev = lengths.device
    q = torch.arange(2 * k + 1, device=dev)  # [S] index in the step
    offset = torch.where(q > k, q - k, q)  # [S] position offset from L: 0, 1..K, 1..K
    positions = lengths[:, None] + offset  # [b, S]
    slots = lengths[:, None] + q  # [b, S]
    kv_len = int(lengths.max()) + 2 * k + 1
    key = torch.arange(kv_len, device=dev)[None, None, :]  # [1, 1, kv]
    lo = lengths[:, None, None]  # [b, 1, 1]
    allowed = key <= slots[:, :, None]  # causal over the slots
    drafts_of_others = (q > k)[None, :, None] & (key > lo) & (key <= lo + k)  # a lookup query must not see d_1..d_K
    return StepLayout(positions, slots, allowed & ~drafts_of_others)


def _prefix(match: torch.Tensor) -> torch.Tensor:  # [b, K] bool -> [b] longest all-true prefix
    return match.long().cumprod(-1).sum(-1)


def two_branch_accept(
    preds: torch.Tensor,  # [b, 2K + 1] the target's greedy token after each slot
    drafts: torch.Tensor,  # [b, K] d_1..d_K
    lookups: torch.Tensor,  # [b, K] l_1..l_K, −1 where none (never matches)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each branch's accepted prefix, the longer one kept (the drafter's on a tie). Returns ``samples`` [b, K + 1]
    (the kept branch's accepted tokens, then the target's bonus token at index ``acc``), ``acc`` [b], ``from_lookup``
    [b] bool, and ``taken`` [b, K + 1]: the step indices of x and the kept branch's tokens (for its taps)."""
    k = drafts.shape[1]
    by_draft = preds[:, : k + 1]  # token after x, d_1, …, d_K
    by_lookup = torch.cat([preds[:, :1], preds[:, k + 1:]], dim=1)  # token after x, l_1, …, l_K
    acc_d = _prefix(drafts == by_draft[:, :k])
    acc_l = _prefix(lookups == by_lookup[:, :k])
    from_lookup = acc_l > acc_d
    samples = torch.where(from_lookup[:, None], by_lookup, by_draft)
    idx = torch.arange(k + 1, device=preds.device)
    taken = torch.where(from_lookup[:, None], torch.where(idx > 0, idx + k, idx), idx).expand(preds.shape[0], -1)
    return samples, torch.maximum(acc_d, acc_l), from_lookup, taken


def keep_lookup_branch(cache, rows: torch.Tensor | None, lengths: torch.Tensor, k: int, acc: torch.Tensor,
                       from_lookup: torch.Tensor) -> None:
    """Rows that kept the lookup branch: move its accepted tokens' K/V (slots L+K+1…) to where they are committed
    (slots L+1…), in every layer; the drafter's branch needs nothing (it is already there)."""
    for j in from_lookup.nonzero()[:, 0].tolist():
        n, start = int(acc[j]), int(lengths[j])
        if n == 0:
            continue
        r = j if rows is None else int(rows[j])
        src = slice(start + k + 1, start + k + 1 + n)
        cache.k[:, r, start + 1: start + 1 + n] = cache.k[:, r, src].clone()
        cache.v[:, r, start + 1: start + 1 + n] = cache.v[:, r, src].clone()
