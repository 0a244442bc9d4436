"""The step engines in-process, as a stepper calls them (``runtime.stepper.StepEngines``).

``BatchedLocalSteps`` makes one engine call per step and kind for every row (one prefill, one injection, one draft
pass, one verify forward): what ``SpeculativeDecoder.generate`` runs, and what the Triton step models compute for a
loop model's batched request. ``LocalSteps`` calls the engines once per row, through one overridable method per
call (``start``, ``inject``, ``draft``, ``verify``, ``free``): a reference for other backends, and where tests put
chosen drafts or checks on a single call.

The engines are ``runtime.steps``' ``TargetVerifier`` (or an engine backend's verifier with the same calls),
``KVInjector`` and ``BlockDrafter``. None of their calls suspends, so a stepper over these runs without an event loop
(``stepper.drive``).
"""

from __future__ import annotations

import torch

from trtllm_dflash.models.layers import stack_padded
from trtllm_dflash.runtime.stepper import Start, Verified


class LocalSteps:
    """Step engines in-process, one engine call per row."""

    def __init__(self, verifier, injector, drafter) -> None:
        self.verifier, self.injector, self.drafter = verifier, injector, drafter
        self.calls: list[tuple[str, int]] = []  # (kind, rows) of each batch the stepper sent

    # -- one row ------------------------------------------------------------------------------------------------------

    async def start(self, seq_id, prompt_ids, sampling, want_taps, keep=0) -> tuple:
        family = {"keep": keep} if keep and self.verifier.forks else {}  # an engine backend prefills each sequence
        r = self.verifier.start(seq_id, prompt_ids, sampling, want_taps, **family)
        return r.first_token, r.taps, r.logprobs

    async def fork(self, seq_id, parent, prompt_ids, sampling) -> tuple:
        r = self.verifier.fork(seq_id, parent, prompt_ids, sampling)
        return r.first_token, r.taps, r.logprobs

    async def verify(self, seq_id, block, want_taps, parents=None) -> tuple:
        tree = () if parents is None else (parents,)
        return verified(self.verifier.verify([seq_id], [block], want_taps, *tree)[0])

    async def inject(self, taps, start):
        return self.injector(taps, start)

    async def draft(self, seq_id, k, v, bonus, block_size, top=1) -> list:
        return self.drafter.draft([seq_id], [k], [v], [bonus], block_size, top)[0].tolist()

    async def free(self, seq_id, drafter) -> None:
        self.verifier.free(seq_id)
        if drafter:
            self.drafter.free(seq_id)

    # -- the stepper's batches ------------------------------------------------------------------------------------

    async def batch_start(self, starts: list[Start]) -> list:
        self.calls.append(("start", len(starts)))
        return await self._each_start(starts)

    async def _each_start(self, starts: list[Start]) -> list:
        out = []
        for s in starts:
            try:
                if s.fork_of is not None:
                    out.append(await self.fork(s.seq_id, s.fork_of, s.prompt, s.sampling))
                else:
                    out.append(await self.start(s.seq_id, s.prompt, s.sampling, s.want_taps, s.keep))
            except Exception as exc:  # noqa: BLE001 - that row's start fails, the others' stand
                out.append(exc)
        return out

    async def batch_inject(self, taps: list, starts: list[int]) -> list[tuple]:
        self.calls.append(("inject", len(taps)))
        return [await self.inject(t, s) for t, s in zip(taps, starts)]

    async def batch_draft(self, seq_ids, ks, vs, bonuses, width, top=1) -> list:
        self.calls.append(("draft", len(seq_ids)))
        choices = {"top": top} if top > 1 else {}  # an override for chains alone need not take ``top``
        return [await self.draft(s, k, v, b, width, **choices) for s, k, v, b in zip(seq_ids, ks, vs, bonuses)]

    async def batch_verify(self, seq_ids, blocks, want_taps, parents=None) -> list[Verified]:
        self.calls.append(("verify", len(seq_ids)))
        tree = {} if parents is None else {"parents": parents}
        return [await self.verify(s, b, want_taps, **tree) for s, b in zip(seq_ids, blocks)]

    async def batch_free(self, seq_ids, drafter) -> None:
        for s in seq_ids:
            await self.free(s, drafter)

    def forecast(self, seq_id: int) -> list[float] | None:
        """The drafter's confidence estimates for the sequence's latest block (``BlockDrafter.forecast``)."""
        return self.drafter.forecast(seq_id) if self.drafter is not None else None

    def planned(self, rows: int) -> None:
        self.calls.append(("plan", rows))


class BatchedLocalSteps(LocalSteps):
    """Step engines in-process, one engine call per batch: the sequences starting together prefill in one forward,
    the drafting rows' taps are projected in one injection and drafted in one pass, and every row verifies in one
    forward."""

    async def batch_start(self, starts: list[Start]) -> list:
        """The plain prefills in one forward (all or none start); a prefill kept for siblings, and a fork, alone."""
        self.calls.append(("start", len(starts)))
        plain = [s for s in starts if s.fork_of is None and not s.keep]
        if len(plain) < 2 or len({s.want_taps for s in plain}) > 1:
            return await self._each_start(starts)
        try:
            started = self.verifier.start_many([s.seq_id for s in plain], [s.prompt for s in plain],
                                               [s.sampling for s in plain], plain[0].want_taps)
            results = [(r.first_token, r.taps, r.logprobs) for r in started]
        except Exception as exc:  # noqa: BLE001 - each of them ends with it
            results = [exc] * len(plain)
        by_seq = dict(zip([s.seq_id for s in plain], results))
        rest = [s for s in starts if s.seq_id not in by_seq]
        by_seq.update(zip([s.seq_id for s in rest], await self._each_start(rest)))
        return [by_seq[s.seq_id] for s in starts]

    async def batch_inject(self, taps: list, starts: list[int]) -> list[tuple]:
        self.calls.append(("inject", len(taps)))
        ks, vs = self.injector.rows(stack_padded(taps), torch.tensor(starts))
        return [(ks[j, :, : len(t)], vs[j, :, : len(t)]) for j, t in enumerate(taps)]

    async def batch_draft(self, seq_ids, ks, vs, bonuses, width, top=1) -> list:
        self.calls.append(("draft", len(seq_ids)))
        choices = (top,) if top > 1 else ()  # an engine backend's drafter drafts chains only
        return self.drafter.draft(seq_ids, ks, vs, bonuses, width, *choices).tolist()

    async def batch_verify(self, seq_ids, blocks, want_taps, parents=None) -> list[Verified]:
        self.calls.append(("verify", len(seq_ids)))
        tree = () if parents is None else (parents,)
        return [verified(r) for r in self.verifier.verify(seq_ids, blocks, want_taps, *tree)]


def verified(result) -> Verified:
    """A step engine's ``VerifyResult`` as the stepper takes it: (emitted, taps, logprobs, the kept tree path)."""
    return result.emitted, result.taps, result.logprobs, result.path
