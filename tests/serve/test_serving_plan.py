"""Concurrent sequences under --block-size auto: their steps decided together by the stepper, as the in-process
decoder decides for a batch, so every step is one verify call for all live rows."""

import asyncio

import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.runtime.cost import GRID, CostModel
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.local import BatchedLocalSteps
from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.runtime.stepper import Sequence, Stepper
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

PROMPTS = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6], [3, 4, 5, 6, 7, 8], [11, 12, 11, 12, 11, 12, 11]]


def _policy(ngram=True):
    """A CPU-like device: a verify costs in proportion to its width (all rows together), a draft pass a little."""
    return AdaptivePolicy(CostModel([1e-3 * (1 + n / 64) for n in GRID], [5e-4 * (1 + n / 64) for n in GRID],
                                    alpha=0.0), 16, [0.6] * 15, ngram=ngram)


def _run(steps, policy, prompts, max_tokens, sampling=None):
    """The prompts as concurrent sequences of one stepper (the served loop's shape) -> each one's final update."""
    finals = {}
    stepper = Stepper(steps, DecodeMode("auto", ngram=policy.ngram), policy)
    for i, prompt in enumerate(prompts):
        req = GenerateRequest(tuple(prompt), max_tokens, (sampling or {}).get(i, SamplingParams()), (), False)
        stepper.add(Sequence(100 + i, req, lambda u, i=i: finals.__setitem__(i, u)))
    asyncio.run(stepper.run())
    return [finals[i] for i in range(len(prompts))]


def _steps(tiny_dirs, tiny_models):
    target, drafter = tiny_models["qwen3"]
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, len(PROMPTS), 256, 16)
    drafts = BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0], torch.float64), len(PROMPTS), 256)
    return BatchedLocalSteps(verifier, KVInjector(drafter), drafts)


@pytest.mark.parametrize("ngram", [True, False])
def test_concurrent_auto_sequences_verify_together_and_stay_lossless(tiny_dirs, tiny_models, ngram):
    """Four concurrent sequences over batched step engines: decided together, every step is ONE verify call for all
    live sequences (padded to the step's common width) and the outputs are the target's greedy ones."""
    target, _ = tiny_models["qwen3"]
    want = greedy_reference(target, PROMPTS, 32)
    steps = _steps(tiny_dirs, tiny_models)
    finals = _run(steps, _policy(ngram), PROMPTS, 32)
    assert [u.tokens for u in finals] == [list(w) for w in want]
    verifies = [rows for kind, rows in steps.calls if kind == "verify"]
    plans = [rows for kind, rows in steps.calls if kind == "plan"]
    assert len(verifies) == len(plans) and sum(verifies) == sum(plans)  # one verify per planned step
    assert not ngram or max(t for u in finals for t in u.acceptance_lengths) > 1  # lookup's hits
    assert not steps.verifier.slots.rows and not steps.drafter.slots.rows


def test_a_sampled_sequence_among_joint_greedy_ones_is_autoregressive_sampling(tiny_dirs, tiny_models):
    """Padding to the common width never changes a sampled row: its output is autoregressive sampling with its seed."""
    target, _ = tiny_models["qwen3"]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(PROMPTS[1]), 24, sampling=sampling)])[0]
    greedy = greedy_reference(target, [PROMPTS[0], PROMPTS[2]], 24)
    steps = _steps(tiny_dirs, tiny_models)
    finals = _run(steps, _policy(), PROMPTS[:3], 24, sampling={1: sampling})
    assert finals[1].tokens == list(want.token_ids)
    assert [finals[0].tokens, finals[2].tokens] == [list(g) for g in greedy]


@pytest.mark.slow
def test_triton_concurrent_auto_streams_step_as_one_batch(smollm2, tmp_path):
    """A real Triton server on the real pair, --block-size auto with prompt lookup: four concurrent gRPC streams give
    the baseline's tokens, and every step decided together reaches target_verify as ONE batched call (no more verify
    calls than plan rounds; deciding alone had split a step's sequences by width), several sequences per call."""
    import threading

    pytest.importorskip("tritonclient.grpc")
    from trtllm_dflash.client.grpc import DFlashClient, GenerateParams
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.perf.health import step_batching
    from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
    from trtllm_dflash.serve.triton.server import TritonServer

    texts = [p.text for p in load_prompts("humaneval", 2)] + [p.text for p in load_prompts("mtbench", 2)]
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size="auto", ngram=True, max_seq_len=768,
                                max_sequences=6, trtllm_names=False), tmp_path / "repo")
    with TritonServer(repo, log_path=tmp_path / "server.log") as server:
        out = {}

        def one(model, i):
            with DFlashClient(server.grpc_url) as client:
                out[model, i] = client.generate(model, GenerateParams(texts[i], 32)).token_ids

        for model in ("dflash", "baseline"):
            threads = [threading.Thread(target=one, args=(model, i)) for i in range(len(texts))]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        batching = step_batching(server.metrics_url)["dflash"]
    assert all(out["dflash", i] == out["baseline", i] and out["dflash", i] for i in range(len(texts)))
    assert batching["plan"]["requests"] > 0 and batching["verify"]["requests"] <= batching["plan"]["requests"], batching
    assert batching["verify"]["rows_per_request"] > 1.5, batching  # starts are one prefill each: the first steps are
    # those of the sequences that started first


def test_a_step_is_observed_with_its_own_rows_contexts():
    """``observe_step`` prices a step by the contexts its rows attended over, not by whichever ``decide`` ran last:
    the curve learns the time beyond the context's share."""
    aware, blind = _policy(), _policy()
    for p in (aware, blind):
        p.cost.alpha, p.cost.context_row_s = 1.0, 1e-7
        p.decide([p.new_sequence() for _ in range(4)])  # another plan in between, over rows without context
    plain = aware.cost.verify(4)
    verify_s = 1.5 * plain + 4000 * 1e-7
    aware.observe_step([0] * 4, [0] * 4, 0.0, verify_s, 0.0, 0, context=4000)
    blind.observe_step([0] * 4, [0] * 4, 0.0, verify_s, 0.0, 0, context=0)  # a loop that did not say
    assert aware.cost.verify(4) == pytest.approx(1.5 * plain)
    assert blind.cost.verify(4) == pytest.approx(1.5 * plain + 4000 * 1e-7)
