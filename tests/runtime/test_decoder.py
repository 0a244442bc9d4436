"""The speculative decoder on tiny random models: losslessness, ragged batches, stopping, sampling."""

import random

import pytest
import torch

from conftest import OracleDecoder, greedy_reference, make_tiny_pair
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams, accepted_lengths, processed_probs

BLOCK_SIZES = [1, 2, 4, 8, 16]


def prompts_for(seed, lengths=(5, 11, 2, 17)):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_greedy_is_lossless_with_the_real_drafter(tiny_models, family, block_size):
    target, drafter = tiny_models[family]
    prompts = prompts_for(block_size)
    ref = greedy_reference(target, prompts, 40)
    out = SpeculativeDecoder(target, drafter, block_size).generate([Request(tuple(p), 40) for p in prompts])
    assert [r.token_ids for r in out] == ref
    for r in out:
        assert all(1 <= t <= block_size for t in r.acceptance_lengths)
        assert r.num_new_tokens == 40 and r.finish_reason == "length"


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("block_size", BLOCK_SIZES[1:])
def test_greedy_is_lossless_across_every_accepted_length(tmp_path_factory, seed, block_size):
    """Oracle drafts (70% right) make the loop accept 0..B−1 drafts; output must still equal target greedy."""
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp(f"s{seed}"), "qwen3" if seed % 2 else "llama", seed=seed)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    prompts = prompts_for(seed + 10)
    ref = greedy_reference(target, prompts, 48)
    dec = OracleDecoder(target, drafter, block_size, prompts, ref, corrupt=0.3, seed=seed)
    out = dec.generate([Request(tuple(p), 48) for p in prompts])
    assert [r.token_ids for r in out] == ref
    taus = [t for r in out for t in r.acceptance_lengths]
    assert min(taus) >= 1 and max(taus) <= block_size
    assert max(taus) > 1, "the oracle should have produced accepted drafts"
    if block_size <= 4:
        assert max(taus) == block_size, "some step should accept the whole block"


def test_batch_gives_each_prompt_what_it_gives_alone(tiny_models):
    target, drafter = tiny_models["llama"]
    prompts = prompts_for(7, lengths=(3, 30, 9, 1, 14))
    ref = greedy_reference(target, prompts, 25)
    dec = OracleDecoder(target, drafter, 8, prompts, ref, corrupt=0.5, seed=3)
    reqs = [Request(tuple(p), n) for p, n in zip(prompts, (25, 7, 25, 12, 1))]  # different lengths finish apart
    batched = dec.generate(reqs)
    alone = [SpeculativeDecoder(target, drafter, 8).generate([r])[0] for r in reqs]
    assert [b.token_ids for b in batched] == [a.token_ids for a in alone]
    assert [len(b.token_ids) for b in batched] == [25, 7, 25, 12, 1]


def test_stop_tokens_end_sequences_independently(tiny_models):
    target, drafter = tiny_models["qwen3"]
    prompts = prompts_for(3, lengths=(6, 6))
    ref = greedy_reference(target, prompts, 30)
    stop = ref[0][9]  # the 10th greedy token of prompt 0 becomes a stop token
    out = SpeculativeDecoder(target, drafter, 4).generate([Request(tuple(p), 30, stop_token_ids=(stop,)) for p in prompts])
    assert out[0].token_ids == ref[0][: ref[0].index(stop)] and out[0].finish_reason == "stop"
    cut = ref[1].index(stop) if stop in ref[1] else 30
    assert out[1].token_ids == ref[1][:cut]


def test_streaming_callback_sees_exactly_the_output(tiny_models):
    target, drafter = tiny_models["llama"]
    seen = {0: [], 1: []}
    prompts = prompts_for(4, lengths=(4, 8))
    out = SpeculativeDecoder(target, drafter, 8).generate(
        [Request(tuple(p), 20) for p in prompts], lambda i, ids: seen[i].extend(ids))
    assert [tuple(seen[0]), tuple(seen[1])] == [out[0].token_ids, out[1].token_ids]


def test_bad_requests_and_block_sizes(tiny_models):
    target, drafter = tiny_models["llama"]
    dec = SpeculativeDecoder(target, drafter, 4)
    with pytest.raises(ConfigError, match="prompt='': must contain at least one token"):
        dec.generate([Request((), 5)])
    with pytest.raises(ConfigError, match="max_new_tokens=0: must be >= 1"):
        dec.generate([Request((1,), 0)])
    with pytest.raises(ConfigError, match="exceeds the target's context limit \\(512 tokens\\)"):
        dec.generate([Request((1,) * 500, 20)])
    with pytest.raises(ConfigError, match="block_size=17: must be <= the drafter's trained block_size \\(16\\)"):
        SpeculativeDecoder(target, drafter, 17)
    with pytest.raises(ConfigError, match="needs a drafter"):
        SpeculativeDecoder(target, None, 2)
    with pytest.raises(ConfigError, match="temperature=-1"):
        dec.generate([Request((1,), 5, SamplingParams(temperature=-1))])


def test_accepted_lengths_worked_example():
    drafts = torch.tensor([[7, 8, 9], [1, 2, 3], [4, 4, 4]])
    samples = torch.tensor([[7, 8, 5, 4], [1, 2, 3, 0], [0, 4, 4, 4]])
    assert accepted_lengths(drafts, samples).tolist() == [2, 3, 0]


@pytest.mark.parametrize("block", [1, 2, 3, 5, 8, 16])
def test_lazy_greedy_verify_equals_the_eager_rule(block):
    """verify_samples computes the LM head only for slots a row can still use; up to each row's bonus token it must
    agree with target_samples + accepted_lengths for every accepted length and batch size."""
    from trtllm_dflash.runtime.sampling import target_samples, verify_samples

    gen = torch.Generator().manual_seed(block)
    weight = torch.randn(8, 11, generator=gen)
    calls = []

    def head(h):
        calls.append(h.shape[0] * h.shape[1])
        return h @ weight

    for b in range(1, 7):
        hidden = torch.randn(b, block, 8, generator=gen)
        drafts = (hidden @ weight).argmax(-1)[:, :-1].clone()
        for r, k in enumerate(torch.randint(0, block, (b,), generator=gen).tolist()):  # row r accepts k drafts
            if k < block - 1:
                drafts[r, k] = (drafts[r, k] + 1) % 11
        params = [SamplingParams()] * b
        calls.clear()
        samples, acc = verify_samples(head, hidden, drafts, params, [None] * b)
        lazy_slots = sum(calls)
        ref = target_samples(hidden @ weight, params, [None] * b)
        assert acc.tolist() == accepted_lengths(drafts, ref).tolist()
        for r in range(b):
            assert samples[r, : acc[r] + 1].tolist() == ref[r, : acc[r] + 1].tolist()
        assert lazy_slots <= b * block
    hidden = torch.randn(2, block, 8, generator=gen)  # sampled rows: the eager path, the same RNG draws
    params = [SamplingParams(temperature=1.0, seed=3)] * 2
    samples, _ = verify_samples(head, hidden, torch.zeros(2, block - 1, dtype=torch.long), params,
                                [torch.Generator().manual_seed(3) for _ in range(2)])
    ref = target_samples(hidden @ weight, params, [torch.Generator().manual_seed(3) for _ in range(2)])
    assert torch.equal(samples, ref)


def test_top_k_top_p_filtering():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert processed_probs(logits, SamplingParams(1.0, top_k=2)).tolist()[0][2:] == [0.0, 0.0]
    p = processed_probs(logits, SamplingParams(1.0, top_p=0.8))  # keeps 0.5 + 0.3
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))


def test_sampling_is_seeded(tiny_models):
    target, drafter = tiny_models["qwen3"]
    req = Request(tuple(prompts_for(5)[0]), 30, SamplingParams(temperature=0.8, top_p=0.95, seed=11))
    a = SpeculativeDecoder(target, drafter, 8).generate([req])[0]
    b = SpeculativeDecoder(target, drafter, 8).generate([req])[0]
    c = SpeculativeDecoder(target, drafter, 8).generate([Request(req.prompt_ids, 30, SamplingParams(0.8, 0, 0.95, 12))])[0]
    assert a.token_ids == b.token_ids and a.token_ids != c.token_ids


def test_sampled_tokens_follow_the_target_distribution(tmp_path_factory):
    """Tiny vocabulary (8): the joint law of generated tokens 2 and 3 under speculative sampling (drafts often
    accepted, often rejected) must match the exact target law computed by enumeration."""
    tdir, ddir = make_tiny_pair(tmp_path_factory.mktemp("v8"), "llama", seed=5, vocab_size=8, block_size=4)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    params = dict(temperature=1.0, top_k=6)
    prompt = (3, 1, 4)

    def law(prefixes):  # [n, len] -> [n, 8] next-token probabilities
        h, _ = target(prefixes, target.new_cache(len(prefixes), 8))
        return processed_probs(target.logits(h[:, -1]), SamplingParams(**params)).double()

    p1 = law(torch.tensor([prompt]))[0]  # [8]
    seqs1 = torch.tensor([prompt + (a,) for a in range(8)])
    p2 = law(seqs1)  # [8, 8]: p(t2 | t1)
    seqs2 = torch.tensor([prompt + (a, b) for a in range(8) for b in range(8)])
    p3 = law(seqs2).view(8, 8, 8)  # p(t3 | t1, t2)
    exact = torch.einsum("a,ab,abc->bc", p1, p2, p3)  # joint of (t2, t3)

    n = 4000
    dec = OracleDecoder(target, drafter, 4, [prompt] * n, [[1, 2, 3]] * n, corrupt=0.5, seed=0)
    out = dec.generate([Request(prompt, 3, SamplingParams(**params, seed=s)) for s in range(n)])
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for r in out:
        counts[r.token_ids[1], r.token_ids[2]] += 1
    tv = 0.5 * (counts / n - exact).abs().sum().item()
    # Expected TV of an honest 4000-sample histogram over ≤48 live cells is ≈0.04; 0.08 leaves ~2x margin, while
    # a rule that emitted drafts without checking them would put mass on tokens 1-3 and miss by far more.
    assert tv < 0.08, f"total variation {tv:.3f}"
    assert any(t > 1 for r in out for t in r.acceptance_lengths)


def test_sliding_window_drafter_is_lossless(tmp_path):
    """A drafter with causal sliding layers (newer z-lab configs) runs through the same loop, still lossless."""
    import json

    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=9)
    cfg = json.loads((ddir / "config.json").read_text())
    cfg |= {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}
    (ddir / "config.json").write_text(json.dumps(cfg))
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)
    assert drafter.spec.layer_causal == (True, False)
    prompts = prompts_for(2)
    ref = greedy_reference(target, prompts, 30)
    out = OracleDecoder(target, drafter, 8, prompts, ref, seed=1).generate([Request(tuple(p), 30) for p in prompts])
    assert [r.token_ids for r in out] == ref
