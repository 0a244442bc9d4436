"""Repetition, presence and frequency penalties (runtime.sampling.penalize): TensorRT-LLM's arithmetic, every verify
slot counting what a one-token step would, and decoding with them lossless at every block size and in a tree."""

import random

import pytest
import torch

from conftest import local_steps, lossless_decoders, make_tiny_pair, served_updates, tokens_before_slot
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import History, SamplingParams, penalize


def test_the_arithmetic_is_tensorrt_llms():
    """penaltyKernels.cu: occurrences over prompt and answer; repetition divides a positive logit and multiplies a
    negative one; presence once, frequency per occurrence; after temperature (so scaled by it here)."""
    logits = torch.tensor([[[2.0, -2.0, 1.0, 0.5]]])
    history = History.of([[0, 1, 1, 0, 1]], vocab=4)  # token 0 twice, token 1 three times, 2 and 3 never
    greedy = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(logits, [greedy], history)[0, 0]
    assert out.tolist() == pytest.approx([2.0 / 2 - 0.5 - 0.25 * 2, -2.0 * 2 - 0.5 - 0.25 * 3, 1.0, 0.5])
    sampled = SamplingParams(temperature=0.5, presence_penalty=0.5, frequency_penalty=0.25)
    out = penalize(logits, [sampled], history)[0, 0] / 0.5  # processed_probs divides by the temperature later
    assert out.tolist() == pytest.approx([2.0 / 0.5 - 0.5 - 0.5, -2.0 / 0.5 - 0.5 - 0.75, 2.0, 1.0])
    assert penalize(logits, [SamplingParams()], None) is logits  # nobody penalised: untouched, no history needed


@pytest.mark.parametrize("parents", [None, (0, 0, 1, 1, 0, 4, 5)])
def test_every_slot_counts_what_a_one_token_step_would(parents):
    """Slot s of a chain (or node s of a tree) counts the sequence plus the step's tokens on the path to it, exactly
    the history a one-token step at that position has once those tokens are emitted."""
    rng = random.Random(0)
    seq = [rng.randrange(12) for _ in range(9)]
    ids = torch.tensor([[seq[-1], 3, 3, 7, -1, 3, 3]])  # node 0 is the sequence's last token; -1: no token there
    logits = torch.randn(1, 7, 12)
    p = SamplingParams(repetition_penalty=1.7, presence_penalty=0.3, frequency_penalty=0.4)
    out = penalize(logits, [p], History.of([seq], 12, ids, parents))
    for s in range(7):
        before = tokens_before_slot(seq, ids, parents, s)
        alone = penalize(logits[:, s : s + 1], [p], History.of([before], 12))
        assert torch.equal(out[:, s], alone[:, 0]), s
    lazy = penalize(logits[:, 2:5], [p], History.of([seq], 12, ids, parents), first=2)  # a CPU head's chunk
    assert torch.equal(lazy, out[:, 2:5])


def test_bad_penalties_are_refused_by_name(tmp_path):
    t, d = make_tiny_pair(tmp_path, block_size=4)
    target, _ = load_pair(t, d, dtype=torch.float32)
    for bad, message in [(dict(repetition_penalty=0.0), "repetition_penalty=0.0: must be a finite number > 0"),
                         (dict(presence_penalty=float("inf")), "presence_penalty=inf: must be finite"),
                         (dict(frequency_penalty=float("nan")), "frequency_penalty=nan: must be finite")]:
        with pytest.raises(ConfigError, match=message):
            SpeculativeDecoder(target, None, 1).generate([Request((1, 2, 3), 4, SamplingParams(**bad))])


PENALTIES = [dict(repetition_penalty=1.5), dict(presence_penalty=1.0, frequency_penalty=0.7),
             dict(repetition_penalty=0.8, frequency_penalty=-0.3)]


@pytest.mark.parametrize("penalties", PENALTIES)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_penalised_decoding_is_lossless(tmp_path_factory, penalties, temperature):
    """Autoregressive decoding with the penalties is the reference; DFlash at block 4 with prompt lookup, ``auto``,
    and a tree verify give its tokens, with drafts that are the penalised answer (corrupted 30% of the time) and
    with the real drafter. The penalties do change the answer."""
    root = tmp_path_factory.mktemp("pair")
    t, d = make_tiny_pair(root, block_size=4, seed=5)
    target, drafter = load_pair(t, d, dtype=torch.float64)
    rng = random.Random(1)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randrange(3, 9))) for _ in range(3)]
    sampling = SamplingParams(temperature, seed=7, **penalties)
    reqs = [Request(p, 20, sampling) for p in prompts]
    ar = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(reqs)]
    plain = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(
        [Request(p, 20, SamplingParams(temperature, seed=7)) for p in prompts])]
    assert ar != plain
    for name, dec in lossless_decoders(target, drafter, prompts, ar).items():
        assert [r.token_ids for r in dec.generate(reqs)] == ar, name


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_serving_loop_over_the_step_engines_is_lossless(tiny_dirs, tiny_models, tree, temperature):
    """The served path without Triton: target_verify's engine keeps each sequence's occurrences from its start
    (prompt and first token) through every verify's returned tokens, chain or tree; the loop's answer is the
    in-process autoregressive one with the same penalties."""
    from trtllm_dflash.runtime.protocol import GenerateRequest

    target, verifier, steps, shape = local_steps(tiny_dirs, tiny_models, tree)
    sampling = SamplingParams(temperature, seed=3, repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)
    for prompt in ([9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6]):
        want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32, sampling)])[0].token_ids
        updates = served_updates(steps, GenerateRequest(tuple(prompt), 32, sampling, (), True), shape)
        assert updates[-1].tokens == list(want)
    assert not verifier.slots.rows
