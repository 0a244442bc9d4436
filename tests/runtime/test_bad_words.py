"""TensorRT-LLM's bad words (runtime.sampling.ban_words): its rule, every verify slot looking at the tokens a
one-token step would, and decoding with them lossless at every block size, in a tree and through the serving loop."""

import random

import pytest
import torch

from conftest import lossless_decoders, local_steps, make_tiny_pair, served_updates, tokens_before_slot
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import History, SamplingParams, ban_words


def banned(logits: torch.Tensor) -> list[list[int]]:
    return [[int(t) for t in (row == float("-inf")).nonzero().flatten()] for row in logits[0]]


def test_the_rule_is_tensorrt_llms():
    """banBadWords.cu: a one-token word always; a longer word's last token where the sequence so far (prompt
    included) ends in its other tokens, and not before there are that many tokens."""
    p = SamplingParams(bad_words=((3,), (5, 6), (1, 2, 4)))
    logits = torch.zeros(1, 1, 8)
    assert banned(ban_words(logits, [p], History.of([[9, 5]], 8, params=[p]))) == [[3, 6]]
    assert banned(ban_words(logits, [p], History.of([[1, 2]], 8, params=[p]))) == [[3, 4]]
    assert banned(ban_words(logits, [p], History.of([[2]], 8, params=[p]))) == [[3]]  # too short for (1, 2, 4)
    assert banned(ban_words(logits, [p], History.of([[6, 1]], 8, params=[p]))) == [[3]]
    assert ban_words(logits, [SamplingParams()], None) is logits  # no bad words: untouched, no history needed
    with pytest.raises(ConfigError, match=r"bad_words\[1\]=\[\]: must be one or more token ids"):
        SamplingParams(bad_words=((3,), ())).validate()


@pytest.mark.parametrize("parents", [None, (0, 0, 1, 1, 0, 4, 5)])
def test_every_slot_looks_at_what_a_one_token_step_would(parents):
    """Slot s of a chain (or node s of a tree) sees the sequence plus the step's tokens on the path to it, the
    slot's own included: exactly what a one-token step at that position sees once those tokens are emitted."""
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(9)]
    ids = torch.tensor([[seq[-1], 3, 4, 3, -1, 4, 3]])  # node 0 is the sequence's last token; -1: no token there
    p = SamplingParams(bad_words=((3, 4, 5), (4, 3), (2,)))
    logits = torch.randn(1, 7, 6)
    out = ban_words(logits, [p], History.of([seq], 6, ids, parents, [p]))
    for s in range(7):
        before = tokens_before_slot(seq, ids, parents, s)
        alone = ban_words(logits[:, s: s + 1], [p], History.of([before], 6, params=[p]))
        assert torch.equal(out[:, s], alone[:, 0]), s
    lazy = ban_words(logits[:, 2:5], [p], History.of([seq], 6, ids, parents, [p]), first=2)  # a CPU head's chunk
    assert torch.equal(lazy, out[:, 2:5])


def contains(tokens, word) -> bool:
    return any(tuple(tokens[i: i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoding_with_bad_words_is_lossless(tmp_path_factory, temperature):
    """Bad words taken from the plain answers (one token, and two and three tokens long) change them; autoregressive
    decoding with them is the reference, and oracle drafts (chain and tree), block 4 + lookup and auto + lookup give
    its tokens; no answer ends a bad word."""
    root = tmp_path_factory.mktemp("pair")
    t, d = make_tiny_pair(root, block_size=4, seed=5)
    target, drafter = load_pair(t, d, dtype=torch.float64)
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randrange(3, 9))) for _ in range(3)]
    plain = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(
        [Request(p, 20, SamplingParams(temperature, seed=7)) for p in prompts])]
    words = ((plain[0][3],), tuple(plain[1][5:7]), tuple(plain[2][2:5]))
    sampling = SamplingParams(temperature, seed=7, bad_words=words)
    reqs = [Request(p, 20, sampling) for p in prompts]
    ar = [r.token_ids for r in SpeculativeDecoder(target, None, 1).generate(reqs)]
    assert all(a != b for a, b in zip(ar, plain))
    for p, a in zip(prompts, ar):
        for w in words:  # no occurrence ends in the answer
            assert not contains(list(p[len(p) - len(w) + 1:]) + list(a), w) if len(w) > 1 else w[0] not in a
    for name, dec in lossless_decoders(target, drafter, prompts, ar).items():
        assert [r.token_ids for r in dec.generate(reqs)] == ar, name


@pytest.mark.parametrize("tree", [False, True])
def test_the_serving_loop_over_the_step_engines_is_lossless(tiny_dirs, tiny_models, tree):
    """The served path without Triton: target_verify's engine keeps each sequence's tokens from its start through
    every verify's returned tokens, chain or tree; the loop's answer is the in-process autoregressive one."""
    from trtllm_dflash.runtime.protocol import GenerateRequest

    target, verifier, steps, shape = local_steps(tiny_dirs, tiny_models, tree)
    for prompt in ([9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6]):
        plain = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32)])[0].token_ids
        sampling = SamplingParams(bad_words=(tuple(plain[4:6]), tuple(plain[10:13]), (plain[20],)))
        want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32, sampling)])[0].token_ids
        assert want != plain
        updates = served_updates(steps, GenerateRequest(tuple(prompt), 32, sampling, (), True), shape)
        assert updates[-1].tokens == list(want)
    assert not verifier.slots.rows
