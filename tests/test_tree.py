"""The two-branch verify (runtime.tree): layout and acceptance by hand, each branch's forward equal to verifying it
alone, and decoding lossless on tiny random models with oracle proposals on both branches."""

import random

import pytest
import torch

from conftest import OracleDecoder, greedy_reference, make_tiny_pair
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime import decoder as decoder_mod
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tree import two_branch_accept, two_branch_layout


def test_layout_keeps_each_branch_out_of_the_others_sight():
    lay = two_branch_layout(torch.tensor([3, 5]), 2)  # rows with 3 and 5 committed tokens; K = 2
    # step index:        x  d1 d2 l1 l2
    assert lay.positions.tolist() == [[3, 4, 5, 4, 5], [5, 6, 7, 6, 7]]
    assert lay.slots.tolist() == [[3, 4, 5, 6, 7], [5, 6, 7, 8, 9]]
    seen = lay.allowed[0].int().tolist()  # row 0 (L = 3) over slots 0..9 (kv_len = max L + 2K + 1)
    assert seen == [[1, 1, 1, 1, 0, 0, 0, 0, 0, 0],   # x: cache + itself
                    [1, 1, 1, 1, 1, 0, 0, 0, 0, 0],   # d1: + d1
                    [1, 1, 1, 1, 1, 1, 0, 0, 0, 0],   # d2: + d1, d2
                    [1, 1, 1, 1, 0, 0, 1, 0, 0, 0],   # l1: cache, x, l1, never the drafts
                    [1, 1, 1, 1, 0, 0, 1, 1, 0, 0]]   # l2: + l1, l2
    assert lay.allowed[1, 4].int().tolist() == [1] * 6 + [0, 0, 1, 1]


def test_accept_keeps_the_longer_branch_and_its_bonus():
    # K = 3; preds: the target's token after x, d1, d2, d3, l1, l2, l3
    preds = torch.tensor([[10, 11, 12, 13, 21, 22, 23],
                          [10, 11, 12, 13, 20, 22, 23],
                          [10, 11, 99, 13, 11, 12, 23]])
    drafts = torch.tensor([[10, 7, 7], [10, 11, 12], [10, 11, 12]])
    lookups = torch.tensor([[10, 21, 22], [10, 20, -1], [10, 11, 7]])
    samples, acc, from_lookup, taken = two_branch_accept(preds, drafts, lookups)
    # row 0: drafts accept 1, lookups 3 -> lookups, tokens 10 21 22 then the bonus after l3 (23)
    # row 1: drafts accept 3 (whole block) -> drafts, bonus after d3 (13); row 2: tie at 2 -> the drafter's branch
    assert acc.tolist() == [3, 3, 2] and from_lookup.tolist() == [True, False, False]
    assert samples[0].tolist() == [10, 21, 22, 23] and samples[1].tolist() == [10, 11, 12, 13]
    assert samples[2, :3].tolist() == [10, 11, 99]
    assert taken.tolist() == [[0, 4, 5, 6], [0, 1, 2, 3], [0, 1, 2, 3]]


def test_each_branch_computes_what_verifying_it_alone_computes(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4)
    target, _ = load_pair(tdir, ddir, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 256, (2, 9), generator=g)
    k = 4
    x, d, look = (torch.randint(3, 256, (2, n), generator=g) for n in (1, k, k))

    def prefilled():
        cache = target.new_cache(2, 32)
        target(prompts, cache)
        cache.commit(None, torch.tensor([9, 9]))
        return cache

    cache = prefilled()
    both, taps = target(torch.cat([x, d, look], 1), cache, tap_layers=(0, 1),
                        layout=two_branch_layout(cache.lengths.clone(), k))
    for branch, cols in ((d, slice(0, k + 1)), (look, [0, *range(k + 1, 2 * k + 1)])):
        alone, alone_taps = target(torch.cat([x, branch], 1), prefilled(), tap_layers=(0, 1))
        torch.testing.assert_close(both[:, cols], alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(taps[:, cols], alone_taps, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size", [4, 16])
def test_two_branch_decoding_is_lossless(tmp_path_factory, monkeypatch, seed, block_size):
    """Both branches get oracle proposals (the greedy continuation, each token wrong with probability 0.4, drawn
    independently), so either branch, or neither, is the longer one; the output must be the target's greedy."""
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp(f"t{seed}"), "llama" if seed else "qwen3", seed=seed)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (6, 13, 3)]
    ref = greedy_reference(target, prompts, 40)
    by_context = {tuple(p): r for p, r in zip(prompts, ref)}

    def oracle_lookup(context, max_len, **_):
        for p, r in by_context.items():
            if tuple(context[: len(p)]) == p and tuple(context[len(p):]) == tuple(r[: len(context) - len(p)]):
                truth = list(r[len(context) - len(p): len(context) - len(p) + max_len])
                return [t if rng.random() > 0.4 else (t + 1) % 256 for t in truth] if rng.random() < 0.7 else []
        raise AssertionError(f"lookup asked for a context that is not a prefix of the greedy output: {context}")

    monkeypatch.setattr(decoder_mod, "ngram_continuation", oracle_lookup)
    dec = OracleDecoder(target, drafter, block_size, prompts, ref, corrupt=0.4, seed=seed, tree=True)
    out = dec.generate([Request(tuple(p), 40) for p in prompts])
    assert [r.token_ids for r in out] == ref
    taus = [t for r in out for t in r.acceptance_lengths]
    assert max(taus) <= block_size and sum(r.lookup_steps for r in out) > 0
    assert sum(r.lookup_steps for r in out) < len(taus), "some steps should keep the drafter's branch"


def test_two_branch_needs_a_fixed_block_and_greedy_requests(tiny_models):
    target, drafter = tiny_models["llama"]
    with pytest.raises(ConfigError, match="fixed block size"):
        SpeculativeDecoder(target, drafter, "auto", tree=True)
    dec = SpeculativeDecoder(target, drafter, 8, tree=True)
    assert dec.ngram
    with pytest.raises(ConfigError, match="greedy only"):
        dec.generate([Request((5, 6, 7), 4, sampling=SamplingParams(temperature=0.8, seed=1))])
