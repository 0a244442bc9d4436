"""TensorRT-LLM's embedding bias (``SamplingParams.logit_bias``, ``runtime.sampling.add_bias``): added to the raw
logits before the occurrence penalties, the same at every verify slot as at a one-token step, so decoding with it is
lossless at every block size, in a tree and through the serving loop; and the entry models' word-level form
(``embedding_bias_words`` / ``embedding_bias_weights``) tokenized as TensorRT-LLM's preprocessing does."""

import random

import pytest
import torch

from conftest import lossless_decoders, local_steps, make_tiny_pair, served_updates
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import History, SamplingParams, add_bias, bias_pairs, penalize, target_samples


def test_the_bias_is_added_to_the_raw_logits_before_the_penalties():
    p = SamplingParams(logit_bias=bias_pairs([2, 5, 2], [1.5, -4.0, 0.5]), repetition_penalty=2.0)
    assert p.logit_bias == ((2, 2.0), (5, -4.0))  # an id listed twice: its weights summed
    logits = torch.tensor([[[0.0, 1.0, -1.0, 3.0, 0.0, 2.0]]])
    biased = add_bias(logits, [p])
    assert biased.tolist() == [[[0.0, 1.0, 1.0, 3.0, 0.0, -2.0]]] and logits[0, 0, 2] == -1.0  # a copy
    # token 2 and 5 seen before: the penalty divides the biased positive logit and multiplies the biased negative one
    got = penalize(biased, [p], History.of([[2, 5]], 6, params=[p]))
    assert got.tolist() == [[[0.0, 1.0, 0.5, 3.0, 0.0, -4.0]]]
    assert add_bias(logits, [SamplingParams()]) is logits
    # what target_samples chooses from: greedy picks the biased argmax
    assert target_samples(logits, [SamplingParams(logit_bias=((4, 10.0),))], [None]).tolist() == [[4]]
    with pytest.raises(ConfigError, match=r"logit_bias\[3\]=inf: must be a finite weight"):
        SamplingParams(logit_bias=((3, float("inf")),)).validate()
    with pytest.raises(ConfigError, match=r"logit_bias=\[4, 1\]: must be distinct token ids"):
        SamplingParams(logit_bias=((4, 1.0), (1, 1.0))).validate()


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoding_with_a_logit_bias_is_lossless(tmp_path_factory, temperature):
    """A bias that changes the answers (the plain answers' tokens pushed down, two others up); autoregressive decoding
    with it is the reference, and oracle drafts (chain and tree), block 4 + lookup and auto + lookup give its
    tokens."""
    root = tmp_path_factory.mktemp("pair")
    t, d = make_tiny_pair(root, block_size=4, seed=5)
    target, drafter = load_pair(t, d, dtype=torch.float64)
    rng = random.Random(3)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randrange(3, 9))) for _ in range(3)]
    plain = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(
        [Request(p, 20, SamplingParams(temperature, seed=7)) for p in prompts])]
    down = sorted({plain[0][2], plain[1][4], plain[2][6]})
    sampling = SamplingParams(temperature, seed=7, logit_bias=bias_pairs([*down, 17, 99], [-3.0] * len(down) + [2, 1]))
    reqs = [Request(p, 20, sampling) for p in prompts]
    ar = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(reqs)]
    assert all(a != b for a, b in zip(ar, plain))
    for name, dec in lossless_decoders(target, drafter, prompts, ar).items():
        assert [r.token_ids for r in dec.generate(reqs)] == ar, name


@pytest.mark.parametrize("tree", [False, True])
def test_the_serving_loop_over_the_step_engines_is_lossless(tiny_dirs, tiny_models, tree):
    """The served path without Triton (target_verify's engine, chain or tree): the loop's answer with a bias is the
    in-process autoregressive one; a bias on a token outside the vocabulary is refused by name, holding no slot."""
    from trtllm_dflash.runtime.protocol import GenerateRequest

    target, verifier, steps, shape = local_steps(tiny_dirs, tiny_models, tree)
    for prompt in ([9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6]):
        plain = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32)])[0].token_ids
        sampling = SamplingParams(logit_bias=bias_pairs([plain[3], plain[9], 40], [-2.5, -2.5, 1.5]))
        want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32, sampling)])[0].token_ids
        assert want != plain
        updates = served_updates(steps, GenerateRequest(tuple(prompt), 32, sampling, (), True), shape)
        assert updates[-1].tokens == list(want)
    with pytest.raises(ConfigError, match=r"logit_bias token id=300: must be in \[0, 256\)"):
        verifier.start(11, [1, 2, 3], SamplingParams(logit_bias=((300, 1.0),)), False)
    assert not verifier.slots.rows
