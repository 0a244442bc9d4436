"""A request's ``num_return_sequences`` share its prompt's prefill (``TargetVerifier.start(keep=)`` + ``fork``): a
forked sibling must be exactly the sequence its own prefill would have started — the same first token and
log-probability under its own sampling, the same cached K/V, the same verify steps after — and a fork that cannot
be one is refused before it takes a slot. (Through a real server: tests/serve/test_serving_server.py, num_return_sequences.)
"""

import pytest
import torch

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.steps import SLOTS_EXHAUSTED, TargetVerifier

PROMPT = [3 + (7 * i) % 200 for i in range(37)]


def sampled(seed: int) -> SamplingParams:
    """A sampling that looks at everything a start sets up: temperature, top-k, the penalties' counts, bad words'
    tails and the log-probabilities."""
    return SamplingParams(0.9, top_k=20, seed=seed, repetition_penalty=1.2, bad_words=((7,), (9, 11)), logprobs=True)


def verifier(tiny_models, sequences: int = 4) -> TargetVerifier:
    target, drafter = tiny_models["llama"]
    return TargetVerifier(target, drafter.spec.target_layer_ids, sequences, 256, 16)


def test_a_fork_starts_a_sibling_exactly_as_its_own_prefill_would(tiny_models):
    shared, alone = verifier(tiny_models), verifier(tiny_models)
    parent = shared.start(0, PROMPT, sampled(5), True, keep=2)
    first = alone.start(0, PROMPT, sampled(5), True)
    assert (parent.first_token, parent.logprobs) == (first.first_token, first.logprobs)
    assert torch.equal(parent.taps, first.taps)  # keep changes nothing for the parent
    forks = {seq: shared.fork(seq, 0, PROMPT, sampled(5 + seq)) for seq in (1, 2)}
    assert shared.forked == 2 and not shared.prefills  # both siblings forked: the kept state is gone
    n = len(PROMPT)
    for seq, got in forks.items():
        want = alone.start(seq, PROMPT, sampled(5 + seq), True)
        assert got.taps is None  # the prompt's taps are the parent's
        assert (got.first_token, got.logprobs) == (want.first_token, want.logprobs)
        mine, theirs = shared.slots.rows[seq], alone.slots.rows[seq]
        assert int(shared.cache.lengths[mine]) == int(alone.cache.lengths[theirs]) == n
        for a, b in ((shared.cache.k, alone.cache.k), (shared.cache.v, alone.cache.v)):
            assert torch.equal(a[:, mine, :n], b[:, theirs, :n])
        for block in ([got.first_token, 11, 12, 13], [40, 41]):  # two steps on: the same tokens, taps, values
            x, y = shared.verify([seq], [block], True)[0], alone.verify([seq], [block], True)[0]
            assert (x.emitted, x.logprobs) == (y.emitted, y.logprobs) and torch.equal(x.taps, y.taps)


def test_a_fork_that_cannot_be_one_is_refused_before_it_takes_a_slot(tiny_models):
    v = verifier(tiny_models, sequences=3)
    v.start(0, PROMPT, SamplingParams(), False, keep=1)
    with pytest.raises(ConfigError, match="differ from the prompt of sequence 0"):
        v.fork(1, 0, PROMPT[:-1], SamplingParams())
    with pytest.raises(ConfigError, match="fork_of=7: is not a live sequence started with keep_prefill"):
        v.fork(1, 7, PROMPT, SamplingParams())
    assert len(v.slots.rows) == 1
    v.fork(1, 0, PROMPT, SamplingParams())
    with pytest.raises(ConfigError, match="fork_of=0: is not a live sequence"):  # its one sibling has forked
        v.fork(2, 0, PROMPT, SamplingParams())
    v.start(2, PROMPT, SamplingParams(), False, keep=1)
    with pytest.raises(ConfigError, match=SLOTS_EXHAUSTED):  # the loop then waits and prefills after all
        v.fork(3, 2, PROMPT, SamplingParams())
    assert v.free(2) and not v.prefills  # a freed parent keeps nothing for its siblings
    with pytest.raises(ConfigError, match="fork_of=2: is not a live sequence"):
        v.fork(3, 2, PROMPT, SamplingParams())


class VerifierSteps:
    """The two start calls ``bls.RequestSteps`` makes (TritonSteps' ``wait_for_slot`` and ``_start``), answered
    in-process by one TargetVerifier as target_verify answers them: a refusal is a StepError, a full slot table makes
    ``wait_for_slot`` wait."""

    def __init__(self, v: TargetVerifier) -> None:
        from types import SimpleNamespace

        self.v, self.prefilled = v, []
        self.coalescer = SimpleNamespace(join=lambda: None)

    async def wait_for_slot(self, seq_id, prompt_ids, sampling, want_taps, is_cancelled, keep=0, attempts=None):
        import asyncio
        import time

        while True:
            try:
                if attempts is not None:
                    attempts.append(time.monotonic_ns())
                r = self.v.start(seq_id, prompt_ids, sampling, want_taps, keep=keep)
            except ConfigError as exc:
                if SLOTS_EXHAUSTED not in str(exc):
                    raise
                await asyncio.sleep(0.01)
                continue
            self.prefilled.append(seq_id)
            return r.first_token, r.taps, r.logprobs

    async def _start(self, seq_id, prompt_ids, sampling, want_taps, keep=0, fork_of=None):
        from trtllm_dflash.serve.triton.bls import StepError

        try:
            r = self.v.fork(seq_id, fork_of, prompt_ids, sampling)
        except ConfigError as exc:
            raise StepError(str(exc)) from exc
        return r.first_token, r.taps, r.logprobs


def test_a_sibling_with_no_slot_to_fork_into_prefills_itself_and_the_first_does_not_wait_for_it(tiny_models):
    import asyncio

    from trtllm_dflash.serve.triton.bls import RequestSteps, Siblings

    async def run():
        v = verifier(tiny_models, sequences=2)
        v.start(99, [5, 6, 7], SamplingParams(), False)  # another request holds the other slot
        steps = VerifierSteps(v)
        family = Siblings(2)
        seqs = [RequestSteps(steps, lambda: False, family, i) for i in range(2)]
        sibling = asyncio.ensure_future(seqs[1].start(11, PROMPT, sampled(4), True))
        first = await asyncio.wait_for(seqs[0].start(10, PROMPT, sampled(3), True), 5)  # its sibling found no slot
        assert not sibling.done() and steps.prefilled == [10]
        v.free(99)
        got = await asyncio.wait_for(sibling, 5)
        assert steps.prefilled == [10, 11] and v.forked == 0
        want = verifier(tiny_models).start(11, PROMPT, sampled(4), True)
        assert got[0] == want.first_token and got[2] == want.logprobs and torch.equal(got[1], want.taps)
        assert first[1] is not None
        # its perf metrics' times: scheduled when its own prefill got the slot, after the first sequence's first token
        assert 0 < seqs[0].scheduled_ns < seqs[0].first_token_ns < seqs[1].scheduled_ns < seqs[1].first_token_ns

    asyncio.run(run())


def test_the_first_sequence_waits_for_its_siblings_forks_but_not_for_one_that_ended_before_its_start(tiny_models):
    import asyncio

    from trtllm_dflash.serve.triton.bls import RequestSteps, Siblings

    async def run():
        v = verifier(tiny_models, sequences=3)
        steps, family = VerifierSteps(v), Siblings(3)
        seqs = [RequestSteps(steps, lambda: False, family, i) for i in range(3)]
        first = asyncio.ensure_future(seqs[0].start(20, PROMPT, sampled(1), True))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not first.done()  # sibling 1 and 2 still to fork: its rows must stay as they are
        forked = await asyncio.wait_for(seqs[1].start(21, PROMPT, sampled(2), True), 5)
        assert v.forked == 1 and not first.done()
        assert forked[1] is first_taps(family)  # a fork reuses the first sequence's taps
        family.started(2)  # sibling 2 failed before its start (as LoopModel's sequence reports when it ends)
        await asyncio.wait_for(first, 5)
        assert steps.prefilled == [20]

    def first_taps(family):
        return family.parent.result()[1]

    asyncio.run(run())
