"""Log-probabilities of the returned tokens (TensorRT-LLM's ``return_log_probs``: ``runtime.sampling.chosen_logprobs``):
the arithmetic, and every decoder kind and the serving loop returning what one teacher-forced forward of the target
over the answer gives, token for token, with the answer itself unchanged."""

import math
import random

import pytest
import torch

from conftest import local_steps, lossless_decoders, make_tiny_pair, served_updates
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import History, SamplingParams, chosen_logprobs, penalize


def test_the_log_probability_is_the_processed_distributions_before_truncation():
    """log softmax of the processed logits at the row's temperature (1 when greedy); top-k / top-p do not
    renormalise it (TensorRT-LLM's cum_log_probs, OpenAI's logprobs); a banned (−inf) token has no mass."""
    logits = torch.tensor([[[2.0, 1.0, 0.0, float("-inf")]], [[2.0, 1.0, 0.0, -1.0]]])
    tokens = torch.tensor([[0], [2]])
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.5, top_k=1)
    out = chosen_logprobs(logits, [greedy, hot], tokens)
    z0 = math.log(math.exp(2) + math.exp(1) + 1)
    z1 = math.log(math.exp(4) + math.exp(2) + 1 + math.exp(-2))
    assert out[:, 0].tolist() == pytest.approx([2 - z0, 0 - z1])
    assert out.dtype == torch.float32


def teacher_forced(target, prompt, answer, sampling: SamplingParams) -> list[float]:
    """The reference: one forward over prompt + answer; at each answer position the target's logits with the
    penalties of the tokens before it, at the sampling's temperature, log-softmaxed."""
    ids = torch.tensor([list(prompt) + list(answer)])
    with torch.inference_mode():
        hidden, _ = target(ids, target.new_cache(1, ids.shape[1] + 1))
        logits = target.logits(hidden)[:, len(prompt) - 1: -1]  # [1, T, V]: position p predicts token p + 1
    out = []
    for s, tok in enumerate(answer):
        x = penalize(logits[:, s: s + 1], [sampling],
                     History.of([list(prompt) + list(answer[:s])], target.spec.vocab_size))[0, 0].double()
        out.append(float(torch.log_softmax(x / (1.0 if sampling.greedy else sampling.temperature), -1)[tok]))
    return out


SAMPLINGS = [dict(), dict(temperature=0.9, seed=7, top_k=20), dict(repetition_penalty=1.4, frequency_penalty=0.3)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "sampled", "penalised"])
def test_every_decoder_returns_the_teacher_forced_log_probabilities(tmp_path_factory, sampling):
    """Autoregressive, oracle drafts through every accepted length (chain and tree), block 4 + prompt lookup and
    auto + prompt lookup: the same tokens as ever, and each token's log-probability equal to the teacher-forced one;
    a request that does not ask gets none (and costs nothing)."""
    root = tmp_path_factory.mktemp("pair")
    t, d = make_tiny_pair(root, block_size=4, seed=5)
    target, drafter = load_pair(t, d, dtype=torch.float64)
    rng = random.Random(2)
    prompts = [tuple(rng.randrange(256) for _ in range(rng.randrange(3, 9))) for _ in range(3)]
    asks = SamplingParams(**sampling, logprobs=True)
    reqs = [Request(p, 20, asks) for p in prompts]
    ar = SpeculativeDecoder(target, None, 1).generate(reqs)
    answers = [r.token_ids for r in ar]
    for p, r in zip(prompts, ar):
        assert len(r.logprobs) == len(r.token_ids) == 20
        assert r.logprobs == pytest.approx(teacher_forced(target, p, r.token_ids, asks), abs=1e-9)
    for name, dec in lossless_decoders(target, drafter, prompts, answers).items():
        got = dec.generate(reqs)
        assert [r.token_ids for r in got] == answers, name
        for g, r in zip(got, ar):
            assert g.logprobs == pytest.approx(r.logprobs, abs=1e-9), name
    plain = SpeculativeDecoder(target, drafter, 4).generate([Request(p, 20, SamplingParams(**sampling))
                                                              for p in prompts])
    assert [r.token_ids for r in plain] == answers and all(r.logprobs == () for r in plain)


def test_a_stop_token_takes_its_log_probability_with_it(tiny_models):
    target, drafter = tiny_models["llama"]
    prompt = (9, 8, 7, 6, 5)
    full = SpeculativeDecoder(target, None, 1).generate([Request(prompt, 12, SamplingParams(logprobs=True))])[0]
    stop = full.token_ids[5]
    cut = SpeculativeDecoder(target, drafter, 4).generate(
        [Request(prompt, 12, SamplingParams(logprobs=True), stop_token_ids=(stop,))])[0]
    n = full.token_ids.index(stop)
    assert cut.token_ids == full.token_ids[:n] and cut.logprobs == pytest.approx(full.logprobs[:n], abs=1e-5)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_the_serving_loop_returns_them_with_the_tokens(tiny_dirs, tiny_models, tree, temperature):
    """The served path without Triton: target_verify's engine returns each start's and verify's log-probabilities
    (chain or tree), the loop keeps them aligned with the tokens it reports, a stop sequence cuts both."""
    from trtllm_dflash.runtime.protocol import GenerateRequest

    target, verifier, steps, shape = local_steps(tiny_dirs, tiny_models, tree)
    sampling = SamplingParams(temperature, seed=3, logprobs=True)
    for prompt, stop in (([9, 8, 7, 9, 8, 7, 9, 8], False), ([5, 6, 7, 8, 5, 6], True)):
        want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(prompt), 32, sampling)])[0]
        stops = (tuple(want.token_ids[20:22]),) if stop else ()
        updates = served_updates(steps, GenerateRequest(tuple(prompt), 32, sampling, stops, True), shape)
        n = 20 if stop else 32
        assert updates[-1].tokens == list(want.token_ids[:n])
        assert updates[-1].logprobs == pytest.approx(want.logprobs[:n], abs=1e-5)
        assert all(len(u.logprobs) == len(u.tokens) for u in updates)
    assert not verifier.slots.rows
