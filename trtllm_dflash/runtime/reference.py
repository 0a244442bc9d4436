"""A fixed-block DFlash loop in its plainest form: one greedy sequence, its own two caches, eager injection, no
batching, no policy, no fast path. It is the oracle the one loop (``runtime.stepper`` through ``runtime.decoder``) is
tested against: the same tokens (those of autoregressive decoding) and the same acceptance length at every step.
"""

from __future__ import annotations

from typing import Callable

import torch

from trtllm_dflash.models.drafter import DrafterModel, draft_block
from trtllm_dflash.models.target import TargetModel


@torch.inference_mode()
def reference_generate(target: TargetModel, drafter: DrafterModel | None, prompt_ids: list[int], max_new_tokens: int,
                       block_size: int, stop_token_ids: tuple[int, ...] = (),
                       propose: Callable[[list[int], list[int]], list[int]] | None = None
                       ) -> tuple[list[int], list[int]]:
    """Greedy DFlash decoding of one prompt -> (new tokens, stop token excluded; τ of every step after the first
    token). ``block_size`` 1: autoregressive decoding (``drafter`` unused). ``propose(tokens so far, the drafter's
    drafts)``: the drafts to verify instead (a test's oracle, to reach every accepted length)."""
    taps_at = drafter.spec.target_layer_ids if block_size > 1 else ()
    size = len(prompt_ids) + max_new_tokens + block_size
    tcache = target.new_cache(1, size)
    dcache = drafter.new_cache(1, size) if taps_at else None

    def verify(ids: list[int]) -> tuple[list[int], torch.Tensor | None]:
        """The target over ``ids`` at the next positions -> its greedy choice after each, and the taps."""
        hidden, taps = target(torch.tensor([ids], device=target.device), tcache, tap_layers=taps_at)
        return target.logits(hidden)[0].argmax(-1).tolist(), taps

    choice, taps = verify(list(prompt_ids))
    tcache.commit(None, torch.tensor([len(prompt_ids)]))
    tokens, taus = [choice[-1]], []
    while len(tokens) < max_new_tokens and not set(tokens) & set(stop_token_ids):
        drafts: list[int] = []
        if dcache is not None:  # the taps of the tokens committed last reach the drafter's context, then it drafts
            drafter.inject(taps, torch.tensor([taps.shape[1]]), dcache)
            drafts = draft_block(torch.tensor([tokens[-1]], device=target.device), block_size,
                                 drafter.spec.mask_token_id, target.embed, lambda e: drafter.draft(e, dcache),
                                 lambda h: target.logits(h.to(target.dtype)), own_head=drafter.draft_head,
                                 heads=drafter.dspark)[0].tolist()
            drafts = drafts if propose is None else propose(tokens, drafts)
        choice, taps = verify([tokens[-1], *drafts])
        accepted = next((i for i, (d, x) in enumerate(zip(drafts, choice)) if d != x), len(drafts))
        tcache.commit(None, torch.tensor([accepted + 1]))  # [bonus, d_1..d_a]; the rest of the block is scratch
        taps = None if taps is None else taps[:, : accepted + 1]
        tokens += choice[: accepted + 1]
        taus.append(accepted + 1)
    for i, t in enumerate(tokens):  # the first stop token ends the output, which excludes it
        if t in stop_token_ids:
            return tokens[:i], taus
    return tokens[:max_new_tokens], taus
