"""CUDA graphs for the decode loop (``runtime.graphs``), rehearsed on the CPU: the static forwards a graph captures
decode what the dynamic ones do, read nothing back to the host, and are captured once per shape and cache."""

import pytest
import torch

from conftest import OracleDecoder, greedy_reference, make_tiny_pair
from test_decoder import prompts_for
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models.drafter import draft_block
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.graphs import CACHE_BUCKET, MAX_CACHES, StepGraphs

MODES = [(1, {}), (16, {}), (8, {"ngram": True}), ("auto", {"ngram": True}), (16, {"tree": True})]


@pytest.mark.parametrize("block_size,kw", MODES, ids=["ar", "b16", "b8+ngram", "auto+ngram", "b16+tree"])
def test_rehearsed_graphs_decode_what_eager_decoding_does(tiny_models, block_size, kw):
    """Ragged prompts finishing apart (the step's rows change): the same tokens and acceptance lengths as the dynamic
    forwards; a second identical ``generate`` reuses the pooled caches and captures nothing new."""
    target, drafter = tiny_models["qwen3"]
    prompts = prompts_for(3, lengths=(5, 23, 9))
    reqs = [Request(tuple(p), n) for p, n in zip(prompts, (30, 11, 22))]
    ref = SpeculativeDecoder(target, drafter if block_size != 1 else None, block_size, **kw).generate(reqs)
    dec = SpeculativeDecoder(target, drafter if block_size != 1 else None, block_size, cuda_graphs="rehearse", **kw)
    out = dec.generate(reqs)
    assert [r.token_ids for r in out] == [r.token_ids for r in ref]
    if block_size != "auto":  # auto's plan follows measured step times
        assert [r.acceptance_lengths for r in out] == [r.acceptance_lengths for r in ref]
    captured = dec.graphs.captures
    assert captured > 0
    again = dec.generate(reqs)
    assert [r.token_ids for r in again] == [r.token_ids for r in ref]
    if block_size != "auto":
        assert dec.graphs.captures == captured, "the second call should replay the first call's steps"


@pytest.mark.parametrize("block_size", [4, 16])
def test_rehearsed_graphs_are_lossless_across_every_accepted_length(tmp_path_factory, block_size):
    """Oracle drafts (60 % right) through the graphed draft and verify: every accepted length, target greedy."""
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp("graphs"), "llama", seed=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    prompts = prompts_for(21)
    ref = greedy_reference(target, prompts, 40)
    dec = OracleDecoder(target, drafter, block_size, prompts, ref, corrupt=0.4, seed=2, cuda_graphs="rehearse")
    out = dec.generate([Request(tuple(p), 40) for p in prompts])
    assert [r.token_ids for r in out] == ref
    taus = [t for r in out for t in r.acceptance_lengths]
    assert max(taus) > 2 and min(taus) == 1


def _traced(fn, *args):
    """``fn(*args)`` traced whole by TorchDynamo (no compiler: the eager backend): it raises where ``fn`` reads a
    tensor's value on the host or makes a shape depend on one — what a CUDA graph cannot capture."""
    return torch.compile(fn, backend="eager", fullgraph=True, dynamic=False)(*args)


# the tree's index tables come from an lru_cache, which Dynamo traces through (a captured step finds them cached)
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a .functools.lru_cache")
def test_static_forwards_read_nothing_back_to_the_host(tiny_models):
    """The verify, the draft and the tree verify a graph captures trace as one graph; the dynamic verify does not (its attention length
    is read from the cache), so the check can fail. float64: the CPU's float32 products pick their kernel from the
    machine's measured table (``models.products``), a host decision a GPU never makes."""
    torch._dynamo.reset()
    target, drafter = tiny_models["llama"]
    dec = SpeculativeDecoder(target, drafter, 8)
    tcache, dcache = target.new_cache(2, 128), drafter.new_cache(2, 128)
    tcache.lengths[:] = dcache.lengths[:] = torch.tensor([5, 9])
    ids = torch.tensor([[7, 8, 9, 10], [11, 12, 13, 14]])
    with torch.inference_mode():
        hidden, taps = _traced(lambda x: target(x, tcache, None, tap_layers=dec.taps, static=True), ids)
        ref_hidden, ref_taps = target(ids, tcache, None, tap_layers=dec.taps)
        torch.testing.assert_close(hidden, ref_hidden)
        torch.testing.assert_close(taps, ref_taps)
        bonus = torch.tensor([3, 4])
        drafts = _traced(lambda b: draft_block(b, 8, dec.mask_token_id, target.embed,
                                               lambda e: dec._draft(e, dcache, None, static=True), target.logits),
                         bonus)
        assert torch.equal(drafts, dec.propose(bonus, dcache, None, dcache.lengths, 7))
        tree = SpeculativeDecoder(target, drafter, 8, tree=True).tree
        nodes = torch.arange(2 * tree.size).view(2, tree.size) % 200 + 3
        ref_hidden, _ = target(nodes, tcache, None, tap_layers=dec.taps, layout=tree.layout(tcache.lengths))
        # dynamo runs the lru-cached ``_tables`` body, which reads these cached properties: computed here, as a
        # captured graph's first eager step does (after test_tree.py the cache answered for an equal topology, so
        # this object's were still unset and dynamo failed on cached_property's lock)
        tree.topology.paths, tree.topology.depths
        hidden, _ = _traced(lambda x: target(x, tcache, None, tap_layers=dec.taps,
                                             layout=tree.layout(tcache.lengths, tcache.max_len)), nodes)
        torch.testing.assert_close(hidden, ref_hidden)
        torch._dynamo.reset()
        with pytest.raises(Exception, match="data-dependent|Data-dependent|guard"):
            _traced(lambda x: target(x, tcache, None, tap_layers=dec.taps), ids)
    torch._dynamo.reset()


def test_pooled_caches_are_bucketed_emptied_and_evicted_with_their_graphs(tiny_models):
    target, _ = tiny_models["llama"]
    graphs = StepGraphs("rehearse")
    first = graphs.cache("target", target.new_cache, 2, 10)
    assert first.max_len == CACHE_BUCKET and first.num_rows == 2
    first.lengths.fill_(7)
    assert graphs.cache("target", target.new_cache, 2, CACHE_BUCKET - 1) is first
    assert int(first.lengths.sum()) == 0, "a pooled cache comes back empty"
    ids = torch.zeros(2, 1, dtype=torch.long)
    with torch.inference_mode():
        graphs.run(("verify", id(first)), first, lambda x: target(x, first, static=True), ids)
    assert len(graphs.steps) == 1
    for n in range(MAX_CACHES):  # other sizes push the least recently used cache, and its graph, out
        graphs.cache("target", target.new_cache, 3 + n, 10)
    assert all(c is not first for c in graphs.caches.values()) and not graphs.steps


def test_graphs_are_on_by_default_on_cuda_only():
    """``auto``, the default of the decoder, the step engines, ``generate`` and ``make-repo``: CUDA graphs on a CUDA
    device (where batch-1 steps are paced by kernel launches), none on a CPU, and no error either way."""
    from trtllm_dflash.serve.settings import ModelSettings
    from trtllm_dflash.serve.triton.render import RepoConfig

    assert StepGraphs.for_device(torch.device("cpu"), "auto") is None
    assert StepGraphs.for_device(torch.device("cuda"), "auto").mode == "cuda"  # constructing touches no GPU
    assert StepGraphs.for_device(torch.device("cpu"), "rehearse").mode == "rehearse"
    assert ModelSettings().cuda_graphs == "auto"
    assert RepoConfig.__dataclass_fields__["cuda_graphs"].default == "auto"


def test_cuda_graphs_need_cuda(tiny_models):
    target, drafter = tiny_models["llama"]
    with pytest.raises(ConfigError, match="cuda_graphs"):
        SpeculativeDecoder(target, drafter, 8, cuda_graphs=True)
    assert SpeculativeDecoder(target, drafter, 8).graphs is None


@pytest.mark.slow
def test_rehearsed_graphs_are_lossless_on_the_real_model(smollm2):
    """SmolLM2 in float32: DFlash through the static forwards (attention over every cache slot) emits what eager
    autoregressive decoding does."""
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    prompts = [encode_prompt(tok, q, chat=True) for q in ("Write a Python function that reverses a string.",
                                                          "Name three uses of a hash map.")]
    reqs = [Request(tuple(p), 24) for p in prompts]
    ref = [SpeculativeDecoder(target, None, 1).generate([r])[0].token_ids for r in reqs]
    for block_size, kw in ((1, {}), (16, {"ngram": True})):
        dec = SpeculativeDecoder(target, drafter if block_size > 1 else None, block_size, cuda_graphs="rehearse",
                                 **kw)
        assert [r.token_ids for r in dec.generate(reqs)] == ref


def test_a_step_that_captured_a_graph_teaches_the_cost_model_nothing():
    """A capture (warm-up runs and recording, tens of ms on a GPU) inside a step is not what that step costs."""
    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    policy = AdaptivePolicy(CostModel([1e-3] * len(GRID), [1e-3] * len(GRID)), 8)
    before = (list(policy.cost.verify_s), list(policy.cost.draft_s), policy.cost.overhead_s)
    policy.observe_step([3], [1], 0.05, 0.05, 0.01, timed=False)
    assert (policy.cost.verify_s, policy.cost.draft_s, policy.cost.overhead_s) == before
    assert policy.telemetry.steps == 1 and policy.telemetry.num_accepted_tokens == 1
    policy.observe_step([3], [1], 0.05, 0.05, 0.01)
    assert policy.cost.verify_s != before[0]
