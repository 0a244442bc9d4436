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


class RecordingSteps:
    """In-process step engines over one TargetVerifier (``LocalSteps``) that record which sequences prefilled."""

    def __new__(cls, v: TargetVerifier, drafter):
        from trtllm_dflash.runtime.local import LocalSteps
        from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead

        class Steps(LocalSteps):
            prefilled: list[int] = []

            async def start(self, seq_id, prompt_ids, sampling, want_taps, keep=0):
                self.prefilled.append(seq_id)
                return await super().start(seq_id, prompt_ids, sampling, want_taps, keep)

        steps = Steps(v, KVInjector(drafter), BlockDrafter(drafter, TargetHead.of(v.target), 4, 256))
        steps.prefilled = []
        return steps


def family(stepper, ids, samplings, max_tokens=6, cancelled=()):
    """One request's sequences added to ``stepper``: the first keeps its prefill for the others to fork."""
    from trtllm_dflash.runtime.protocol import GenerateRequest
    from trtllm_dflash.runtime.stepper import Sequence

    seqs, first = [], None
    for i, (seq_id, sampling) in enumerate(zip(ids, samplings)):
        req = GenerateRequest(tuple(PROMPT), max_tokens, sampling, (), True)
        seq = Sequence(seq_id, req, lambda u: None, (lambda: True) if i in cancelled else (lambda: False),
                       keep=len(ids) - 1 if first is None else 0, fork_of=first)
        first = first or seq
        seqs.append(stepper.add(seq))
    return seqs


def test_a_sibling_with_no_slot_to_fork_into_prefills_itself_and_the_first_does_not_wait_for_it(tiny_models):
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.stepper import Stepper, drive

    _, drafter = tiny_models["llama"]
    v = verifier(tiny_models, sequences=2)
    v.start(99, [5, 6, 7], SamplingParams(), False)  # another request holds the other slot
    steps = RecordingSteps(v, drafter)
    stepper = Stepper(steps, DecodeMode(4))
    seqs = family(stepper, [10, 11], [sampled(3), sampled(4)])
    drive(stepper.step())  # the first prefills and steps; its sibling found no slot to fork into
    assert seqs[0].started and len(seqs[0].tokens) > 1 and not seqs[1].started and steps.prefilled == [10]
    v.free(99)
    drive(stepper.run())
    assert steps.prefilled == [10, 11] and v.forked == 0
    want = verifier(tiny_models).start(11, PROMPT, sampled(4), True)
    assert seqs[1].tokens[0] == want.first_token and seqs[1].logprobs[:1] == want.logprobs
    # its perf metrics' times: scheduled when its own prefill got the slot, after the first sequence's first token
    assert 0 < seqs[0].scheduled_ns < seqs[0].first_token_ns < seqs[1].scheduled_ns < seqs[1].first_token_ns


def test_the_first_sequence_waits_for_its_siblings_forks_but_not_for_one_that_ended_before_its_start(tiny_models):
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.stepper import Stepper, drive

    _, drafter = tiny_models["llama"]
    v = verifier(tiny_models, sequences=3)
    steps = RecordingSteps(v, drafter)
    stepper = Stepper(steps, DecodeMode(4))
    seqs = family(stepper, [20, 21, 22], [sampled(1), sampled(2), sampled(3)], cancelled=(2,))
    taps = {}
    seqs[1].on_update = lambda u: taps.setdefault(21, seqs[1].pending[0])
    drive(stepper.step())  # sibling 1 forks before the first sequence's first step; sibling 2 ended before its start
    assert v.forked == 1 and steps.prefilled == [20]
    assert taps[21] is seqs[0].prompt_taps  # a fork reuses the first sequence's taps
    assert seqs[2].finish_reason == "cancelled" and not seqs[2].started
    drive(stepper.run())
    assert seqs[0].finish_reason == seqs[1].finish_reason == "length"
