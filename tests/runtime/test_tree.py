"""The tree verify (runtime.tree): layouts and acceptance by hand (the two-branch tree, one with alternates, lookup
chains and grafted chains), every path's forward equal to verifying that chain alone, and decoding lossless on tiny
random models with oracle proposals on every branch."""

import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from conftest import OracleDecoder, greedy_reference, make_tiny_pair, tree_policy
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime import stepper as loop_mod, steps as steps_mod
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tree import TreeShape, chain_table, commit_path, graft_chains, lookup_chains


def test_layout_keeps_each_branch_out_of_the_others_sight():
    lay = TreeShape(2).layout(torch.tensor([3, 5]))  # rows with 3 and 5 committed tokens; K = 2, no alternates
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
    shape = TreeShape(3)
    samples, acc, taken, best = shape.verify(preds, shape.tokens(torch.tensor([1, 2, 3]), drafts, lookups))
    # row 0: drafts accept 1, lookups 3 -> lookups, tokens 10 21 22 then the bonus after l3 (23)
    # row 1: drafts accept 3 (whole block) -> drafts, bonus after d3 (13); row 2: tie at 2 -> the drafter's branch
    assert acc.tolist() == [3, 3, 2] and shape.tables("cpu")["from_lookup"][best].tolist() == [True, False, False]
    assert samples[0].tolist() == [10, 21, 22, 23] and samples[1].tolist() == [10, 11, 12, 13]
    assert samples[2, :3].tolist() == [10, 11, 99]
    assert taken.tolist() == [[0, 4, 5, 6], [0, 1, 2, 3], [0, 1, 2, 2]]  # a path is padded with its last node


def test_alternates_fork_from_the_main_chain():
    shape = TreeShape(3, alternates=((1, 2), (2, 3)), lookup=False)
    # nodes: x | d1 d2 d3 (main) | a1 = rank 2 at slot 1, then d2 d3 | b2 = rank 3 at slot 2 (after d1), then d3
    assert shape.parents == [0, 0, 1, 2, 0, 4, 5, 1, 7] and shape.depths == [0, 1, 2, 3, 1, 2, 3, 2, 3]
    assert shape.size == 9 and shape.top == 3
    drafts = torch.tensor([[[11, 31, 41], [12, 32, 42], [13, 33, 43]]])  # [b, K, R]: slot-major, best first
    tokens = shape.tokens(torch.tensor([9]), drafts, None)
    assert tokens.tolist() == [[9, 11, 12, 13, 31, 12, 13, 42, 13]]
    lay = shape.layout(torch.tensor([2]))
    assert lay.positions.tolist() == [[2, 3, 4, 5, 3, 4, 5, 4, 5]] and lay.slots.tolist() == [list(range(2, 11))]
    seen = lay.allowed[0, :, 2:].int().tolist()  # the step's own slots (the 2 cached ones are always seen)
    assert seen[6] == [1, 0, 0, 0, 1, 1, 1, 0, 0]  # a1's d3 sees x, a1, its d2 and itself
    assert seen[8] == [1, 1, 0, 0, 0, 0, 0, 1, 1]  # b2's d3: x, d1, b2, itself
    assert lay.allowed[0, :, :2].all()
    # the target after each node; the drafter's rank-3 choice at slot 2 is right, then d3 is right too
    preds = torch.tensor([[11, 42, 0, 0, 0, 0, 0, 13, 77]])
    samples, acc, taken, _ = shape.verify(preds, tokens)
    assert acc.tolist() == [3] and taken.tolist() == [[0, 1, 7, 8]] and samples.tolist() == [[11, 42, 13, 77]]
    # the accepted path's K/V move to the committed slots; the main chain's would not move
    slots = torch.arange(12.0).view(1, 1, 12, 1, 1)  # [layers, rows, slots, heads, dim]: each slot holds its index
    cache = SimpleNamespace(k=slots.clone(), v=-slots)
    commit_path(cache, None, torch.tensor([2]), taken, acc)
    assert cache.k[0, 0, 2:6].flatten().tolist() == [2, 3, 9, 10] and cache.v[0, 0, 5].item() == -10


def test_lookup_chains_each_fork_from_x():
    shape = TreeShape(2, lookup=2)
    # nodes: x | d1 d2 | first chain l1 l2 | second chain m1 m2
    assert shape.parents == [0, 0, 1, 0, 3, 0, 5] and shape.depths == [0, 1, 2, 1, 2, 1, 2]
    drafts, lookups = torch.tensor([[11, 12]]), torch.tensor([[[21, 22], [31, -1]]])  # [b, K], [b, C, K]
    tokens = shape.tokens(torch.tensor([9]), drafts, lookups)
    assert tokens.tolist() == [[9, 11, 12, 21, 22, 31, -1]]
    assert shape.tokens(torch.tensor([9]), drafts, None)[0, 3:].tolist() == [-1] * 4
    seen = shape.layout(torch.tensor([0])).allowed[0].int().tolist()
    assert seen[6] == [1, 0, 0, 0, 0, 1, 1] and seen[4] == [1, 0, 0, 1, 1, 0, 0]
    preds = torch.tensor([[31, 0, 0, 0, 0, 32, 0]])  # the second chain's m1 is right, then the bonus 32
    samples, acc, taken, best = shape.verify(preds, tokens)
    assert acc.tolist() == [1] and taken[0, :2].tolist() == [0, 5] and samples[0, :2].tolist() == [31, 32]
    assert shape.tables("cpu")["from_lookup"][best].tolist() == [True]
    assert TreeShape(2, lookup=True).lookup == 1 and TreeShape(2, lookup=False).size == 3
    with pytest.raises(ValueError, match="lookup chains"):
        TreeShape(2, lookup=-1)


def test_lookup_chains_propose_the_continuations_of_several_earlier_occurrences():
    shape = TreeShape(3, lookup=3)
    #          0  1  2  3  4  5  6  7  8  9 10 11
    context = [5, 1, 2, 7, 8, 1, 2, 6, 6, 9, 2, 1, 2]
    # the last 2-gram (1 2) occurred at 5 and 1 (latest first), then the 1-gram (2) at 10 (its continuation 1 2
    # is new); the 4- and 3-grams never recur
    assert lookup_chains(shape, context) == [[6, 6, 9], [7, 8, 1], [1, 2]]
    assert lookup_chains(dataclasses.replace(shape, lookup=1), context) == [[6, 6, 9]]
    assert lookup_chains(dataclasses.replace(shape, lookup=0), context) == []


def test_grafted_chains_fork_from_the_main_chain():
    shape = TreeShape(3, lookup=1, grafts=(1,))
    # nodes: x | d1 d2 d3 | l1 l2 l3 (from x) | g2 g3: the graft's chain after d1, at depths 2 and 3
    assert shape.parents == [0, 0, 1, 2, 0, 4, 5, 1, 7] and shape.depths == [0, 1, 2, 3, 1, 2, 3, 2, 3]
    assert shape.num_chains == 2 and shape.from_lookup == [False] * 4 + [True] * 5
    drafts = torch.tensor([[11, 12, 13]])
    lookups = chain_table(shape, [([[21, 22, 23]], [[32, 33]])])  # [b, C, K]: the graft's chain from column 0
    assert lookups.tolist() == [[[21, 22, 23], [32, 33, -1]]]
    tokens = shape.tokens(torch.tensor([9]), drafts, lookups)
    assert tokens.tolist() == [[9, 11, 12, 13, 21, 22, 23, 32, 33]]
    seen = shape.layout(torch.tensor([0])).allowed[0].int().tolist()
    assert seen[8] == [1, 1, 0, 0, 0, 0, 0, 1, 1]  # g3 sees x, d1, g2 and itself
    preds = torch.tensor([[11, 32, 0, 0, 0, 0, 0, 33, 40]])  # d1 right, d2 wrong, the graft right: d1 g2 g3 + 40
    samples, acc, taken, _ = shape.verify(preds, tokens)
    assert acc.tolist() == [3] and taken.tolist() == [[0, 1, 7, 8]] and samples.tolist() == [[11, 32, 33, 40]]
    # no grafts without lookup chains; a graft needs a depth inside the chain
    assert TreeShape(3, lookup=0, grafts=(1,)).grafts == () and TreeShape.for_block(1).grafts == ()
    for bad in ((0,), (3,), (1, 1)):
        with pytest.raises(ValueError, match="grafts"):
            TreeShape(3, grafts=bad)


def test_grafted_chains_are_proposed_after_the_main_chains_drafts():
    shape = TreeShape(3, lookup=2, grafts=(1, 2))
    context = [5, 1, 2, 7, 8, 9, 5]
    assert lookup_chains(shape, context) == [[1, 2, 7]]  # the 1-gram (5) once
    # after d1 = 1 the 2-gram (5 1) recurs: its continuation, 2 tokens (k − 1), then the 1-gram (1)'s is the same;
    # after d1 d2 = 1 8 the 1-gram (8) recurs: 1 token (k − 2). Two entries per graft, [] where there are fewer
    assert graft_chains(shape, context, [1, 8, 4]) == [[2, 7], [], [9], []]
    table = chain_table(shape, [(lookup_chains(shape, context), graft_chains(shape, context, [1, 8, 4]))])
    assert table.tolist() == [[[1, 2, 7], [-1] * 3, [2, 7, -1], [-1] * 3, [9, -1, -1], [-1] * 3]]
    # the chain from x already holds 2 7 after d1 = 1: the graft does not propose it again
    assert graft_chains(shape, context, [1, 8, 4], own=[[1, 2, 7]]) == [[], [], [9], []]
    # ... and the next proposal takes its place: after 5 1 here, 2 7 (the latest) and then 3 3
    context = [5, 1, 3, 3, 0, 5, 1, 2, 7, 4, 5]
    assert lookup_chains(shape, context)[0] == [1, 2, 7]
    assert graft_chains(shape, context, [1, 9, 9], own=[[1, 2, 7]])[:2] == [[3, 3], []]


@pytest.mark.parametrize("shape", [TreeShape(4), TreeShape(4, alternates=((1, 2), (2, 2), (1, 3)), alternate_len=2),
                                   TreeShape(4, alternates=((1, 2),), lookup=3),
                                   TreeShape(4, alternates=((1, 2),), lookup=2, grafts=(1, 2))],
                         ids=["two-branch", "alternates", "lookup-chains", "grafts"])
def test_each_path_computes_what_verifying_it_alone_computes(tmp_path, shape):
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=4)
    target, _ = load_pair(tdir, ddir, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 256, (2, 9), generator=g)
    k = shape.k
    x, look = torch.randint(3, 256, (2, 1), generator=g), torch.randint(3, 256, (2, shape.num_chains, k), generator=g)
    drafts = torch.randint(3, 256, (2, k, shape.top), generator=g)

    def prefilled():
        cache = target.new_cache(2, 48)
        target(prompts, cache)
        cache.commit(None, torch.tensor([9, 9]))
        return cache

    cache = prefilled()
    tokens = shape.tokens(x[:, 0], drafts, look)
    both, taps = target(tokens, cache, tap_layers=(0, 1), layout=shape.layout(cache.lengths.clone()))
    leaves = [n for n in range(shape.size) if n not in shape.parents[1:]]
    assert len(leaves) == 1 + len(shape.alternates) + shape.num_chains
    for leaf in leaves:
        path = shape.paths[leaf][: shape.depths[leaf] + 1]
        alone, alone_taps = target(tokens[:, path], prefilled(), tap_layers=(0, 1))
        torch.testing.assert_close(both[:, path], alone, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(taps[:, path], alone_taps, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("block_size", [4, 16])
def test_tree_decoding_is_lossless(tmp_path_factory, monkeypatch, seed, block_size, temperature):
    """Every branch gets oracle proposals (the target's own continuation — greedy, or sampled autoregressively with
    the requests' seed — each token wrong with probability 0.4, drawn independently; a wrong first choice has the
    right token among the runner-ups half the time), so any branch, or none, is the longest; the output must be the
    target's autoregressive output, token for token."""
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp(f"t{seed}"), "llama" if seed else "qwen3", seed=seed)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (6, 13, 3)]
    sampling = SamplingParams(temperature, top_p=0.95, seed=seed + 7)
    ar = SpeculativeDecoder(target, None, 1)
    ref = [ar.generate([Request(tuple(p), 40, sampling=sampling)])[0].token_ids for p in prompts]
    by_context = {tuple(p): r for p, r in zip(prompts, ref)}

    def oracle_chains(shape, context, datastore=None):  # each of the shape's lookup chains proposed with probability 0.7
        for p, r in by_context.items():
            if tuple(context[: len(p)]) == p and tuple(context[len(p):]) == tuple(r[: len(context) - len(p)]):
                truth = list(r[len(context) - len(p): len(context) - len(p) + shape.k])
                return [[t if rng.random() > 0.4 else (t + 1) % 256 for t in truth]
                        for _ in range(shape.lookup) if rng.random() < 0.7]
        raise AssertionError(f"lookup asked for a context that is not a prefix of the greedy output: {context}")

    def oracle_grafts(shape, context, main, datastore=None, own=()):  # right after right drafts, noise after wrong ones
        out = []
        for d in shape.grafts:
            chains = oracle_chains(TreeShape(shape.k - d, lookup=shape.lookup), list(context) + main[:d]) \
                if truthful(list(context) + main[:d]) else [[7] * (shape.k - d)]
            out += chains + [[] for _ in range(shape.lookup - len(chains))]
        return out

    def truthful(context):
        return any(tuple(context[: len(p)]) == p and tuple(context[len(p):]) == tuple(r[: len(context) - len(p)])
                   for p, r in by_context.items())

    kept_nodes = []  # the kept path's nodes of every row and step

    def recording_commit(cache, rows, lengths, taken, acc):
        kept_nodes.extend(taken[j, 1: int(acc[j]) + 1].tolist() for j in range(len(acc)))
        return commit_path(cache, rows, lengths, taken, acc)

    monkeypatch.setattr(loop_mod, "lookup_chains", oracle_chains)
    monkeypatch.setattr(loop_mod, "graft_chains", oracle_grafts)
    monkeypatch.setattr(steps_mod, "commit_path", recording_commit)
    shape = dataclasses.replace(TreeShape.for_block(block_size - 1), lookup=3)
    dec = OracleDecoder(target, drafter, block_size, prompts, ref, corrupt=0.4, seed=seed, tree=shape)
    lookup_nodes = {n for n, is_lookup in enumerate(dec.tree.from_lookup) if is_lookup}
    first_chain = {n for n in lookup_nodes if shape.nodes[n][2][2] == 0}
    grafted = {n for n in lookup_nodes if shape.nodes[n][2][2] >= shape.lookup}
    assert shape.grafts and grafted
    out = dec.generate([Request(tuple(p), 40, sampling=sampling) for p in prompts])
    assert [r.token_ids for r in out] == ref
    taus = [t for r in out for t in r.acceptance_lengths]
    assert max(taus) <= block_size and sum(r.lookup_steps for r in out) > 0
    assert sum(r.lookup_steps for r in out) < len(taus), "some steps should keep the drafter's branch"
    alternate_wins = [p for p in kept_nodes if p and max(p) > dec.tree.k and not lookup_nodes & set(p)]
    assert alternate_wins, "some steps should keep an alternate"
    assert [p for p in kept_nodes if set(p) & (lookup_nodes - first_chain - grafted)], "some should keep a later chain"
    assert [p for p in kept_nodes if set(p) & grafted], "some steps should keep a grafted chain"


def test_tree_needs_a_drafted_block_and_samples_as_autoregressive_decoding(tiny_models):
    """Sampled, the tree's output is the autoregressive sampled output with the same seed (each node's sample comes
    from its position's noise), whatever the batch."""
    target, drafter = tiny_models["llama"]
    with pytest.raises(ConfigError, match="needs a block size >= 2"):
        SpeculativeDecoder(target, None, 1, tree=True)
    dec = SpeculativeDecoder(target, drafter, 8, tree=True)
    assert dec.ngram
    reqs = [Request((5, 6, 7, 5, 6, 7, 5), 32, sampling=SamplingParams(temperature=t, top_k=k, seed=s))
            for t, k, s in ((0.8, 0, 1), (1.2, 20, 2), (0.0, 0, 0))]
    ar = SpeculativeDecoder(target, None, 1)
    want = [ar.generate([r])[0].token_ids for r in reqs]
    assert [r.token_ids for r in dec.generate(reqs)] == want
    assert [dec.generate([r])[0].token_ids for r in reqs] == want


def test_tree_without_lookup_and_a_shape_for_another_block_size(tiny_models):
    """``generate --tree --no-ngram``'s tree (no lookup chain) is lossless and never keeps a lookup path; a shape
    built for another block size is refused."""
    from trtllm_dflash.commands.common import make_decoder
    from trtllm_dflash.runtime.mode import DecodeMode

    target, drafter = tiny_models["llama"]
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11]]
    ref = greedy_reference(target, prompts, 24)
    dec = make_decoder(target, drafter, DecodeMode(8, ngram=False, tree=True))
    assert dec.tree == dataclasses.replace(TreeShape.for_block(7), lookup=False)
    out = dec.generate([Request(tuple(p), 24) for p in prompts])
    assert [r.token_ids for r in out] == ref and sum(r.lookup_steps for r in out) == 0 and not dec.ngram
    with pytest.raises(ConfigError, match="k = block_size − 1 = 7"):
        SpeculativeDecoder(target, drafter, 8, tree=TreeShape.for_block(15))


def test_auto_takes_the_tree_where_a_wide_verify_is_cheap():
    """choose_tree: with a flat verify cost the tree's expected tokens win; where cost grows with the width the chain
    plan wins, and a tree step is re-tried only after the probe interval the budget allows."""
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    shape = TreeShape.for_block(15, datastore=True)
    flat = tree_policy(True, shape)
    states = [flat.new_sequence() for _ in range(2)]
    flat.decide(states, [0, 0])
    assert flat.choose_tree(states) and all(s.source == "tree" for s in states)
    steep = tree_policy(False, shape)
    states = [steep.new_sequence()]
    interval = steep.tree_probe_interval(1)
    assert interval == steep.max_probe_every  # a 143-token verify costs 143 steps: as rarely as allowed
    taken = []
    for _ in range(interval + 1):
        steep.decide(states, [0])
        taken.append(steep.choose_tree(states))
    assert taken == [False] * interval + [True]
    for s in states:
        steep.observe_tree(s, 4)
    assert states[0].tree == 4 and states[0].chosen == [15]
    assert AdaptivePolicy(flat.cost, 16).choose_tree(states) is False  # no tree on the policy: never


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_auto_with_a_tree_is_lossless_and_follows_the_cost(tiny_models, flat, temperature):
    """--block-size auto --tree: steps mix tree and chain steps as the cost model says (mostly tree where a wide
    verify is cheap, mostly not where it is not), and the output is the autoregressive one, greedy or sampled."""
    target, drafter = tiny_models["qwen3"]
    shape = TreeShape.for_block(15)
    policy = tree_policy(flat, shape)
    sampling = SamplingParams(temperature, seed=3)
    prompts = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8]]
    reqs = [Request(tuple(p), 40, sampling=sampling) for p in prompts]
    ar = SpeculativeDecoder(target, None, 1)
    want = [ar.generate([r])[0].token_ids for r in reqs]
    # drafts worth verifying (the known output, 30 % of tokens wrong; runner-ups sometimes right), so the choice
    # between a tree step and the chain plan is down to the cost
    dec = OracleDecoder(target, drafter, "auto", prompts, want, corrupt=0.3, policy=policy, ngram=True, tree=shape)
    out = dec.generate(reqs)
    assert [r.token_ids for r in out] == want
    t = policy.telemetry
    assert (t.tree_steps > t.steps / 2) if flat else (t.tree_steps < t.steps / 2)
