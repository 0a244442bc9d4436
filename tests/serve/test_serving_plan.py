"""Concurrent sequences under --block-size auto: their steps decided together (loop.plan_together), as the in-process
decoder decides for a batch, so the coalescer sends one verify per step instead of one per distinct width."""

import asyncio

import pytest
import torch

from conftest import greedy_reference
from trtllm_dflash.runtime.cost import GRID, CostModel
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.loop import BatchedLocalSteps, StepReport, plan_together, run_generation
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.runtime.steps import BlockDrafter, KVInjector, TargetHead, TargetVerifier

PROMPTS = [[9, 8, 7, 9, 8, 7, 9, 8], [5, 6, 7, 8, 5, 6], [3, 4, 5, 6, 7, 8], [11, 12, 11, 12, 11, 12, 11]]


def _policy(ngram=True):
    """A CPU-like device: a verify costs in proportion to its width (all rows together), a draft pass a little."""
    return AdaptivePolicy(CostModel([1e-3 * (1 + n / 64) for n in GRID], [5e-4 * (1 + n / 64) for n in GRID],
                                    alpha=0.0), 16, [0.6] * 15, ngram=ngram)


def test_plan_together_gives_every_row_the_common_width_and_observes_the_step_once():
    policy = _policy()
    states = [policy.new_sequence() for _ in range(4)]
    lens = [0, 5, 0, 15]
    plans = plan_together(policy, None, [(s, n, None) for s, n in zip(states, lens)])
    ks = [k for k, _, _ in plans]
    assert {w for _, w, _ in plans} == {max(ks)} and not any(t for _, _, t in plans)
    assert ks == policy.decide([policy.new_sequence() for _ in range(4)], lens)  # decide over all rows at once
    assert policy.telemetry.steps == 0  # nothing to observe before the first step
    # the sequences that did not draft waited at the barrier for the drafting ones: their "verify" took longer
    reports = [StepReport(3, 1, 0.012, 0.02, 0.001, True, False), StepReport(3, 0, 0.01, 0.021, 0.001, True, False),
               StepReport(0, 0, 0.0, 0.032, 0.001, False, False), None]  # the last sequence just started
    plan_together(policy, None, [(s, 0, r) for s, r in zip(states, reports)])
    t = policy.telemetry
    assert t.steps == 1 and t.verify_s == pytest.approx(0.02) and t.draft_s == pytest.approx(0.01)


def _run(steps, policy, prompts, max_tokens, sampling=None):
    async def one(i, prompt):
        updates = []

        async def on_update(u):
            updates.append(u)

        req = GenerateRequest(tuple(prompt), max_tokens, (sampling or {}).get(i, SamplingParams()), (), False)
        await run_generation(steps, req, "auto", 100 + i, on_update, policy=policy, ngram=policy.ngram)
        return updates[-1]

    async def main():
        return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))

    return asyncio.run(main())


def _steps(tiny_dirs, tiny_models, joint):
    target, drafter = tiny_models["qwen3"]
    verifier = TargetVerifier(target, drafter.spec.target_layer_ids, len(PROMPTS), 256, 16)
    drafts = BlockDrafter(drafter, TargetHead(tiny_dirs["qwen3"][0], torch.float64), len(PROMPTS), 256)
    return BatchedLocalSteps(verifier, KVInjector(drafter), drafts, joint=joint)


@pytest.mark.parametrize("ngram", [True, False])
def test_concurrent_auto_sequences_verify_together_and_stay_lossless(tiny_dirs, tiny_models, ngram):
    """Four concurrent sequences over batched step engines: decided together, every step is ONE verify call for all
    live sequences (padded to the step's common width) and the outputs are the target's greedy ones; decided one by
    one (the loop before), the same outputs from more verify calls."""
    target, _ = tiny_models["qwen3"]
    want = greedy_reference(target, PROMPTS, 32)
    counts = {}
    for joint in (True, False):
        steps = _steps(tiny_dirs, tiny_models, joint)
        finals = _run(steps, _policy(ngram), PROMPTS, 32)
        assert [u.tokens for u in finals] == [list(w) for w in want], joint
        verifies = [rows for kind, rows in steps.calls if kind == "verify"]
        counts[joint] = len(verifies)
        if joint:
            plans = [rows for kind, rows in steps.calls if kind == "plan"]
            assert len(verifies) == len(plans) and sum(verifies) == sum(plans)  # one verify per planned step
            assert not ngram or max(t for u in finals for t in u.acceptance_lengths) > 1  # lookup's hits
        assert not steps.verifier.slots.rows and not steps.drafter.slots.rows
    assert counts[True] <= counts[False]


def test_a_sampled_sequence_among_joint_greedy_ones_is_autoregressive_sampling(tiny_dirs, tiny_models):
    """Padding to the common width never changes a sampled row: its output is autoregressive sampling with its seed."""
    target, _ = tiny_models["qwen3"]
    sampling = SamplingParams(temperature=0.9, top_p=0.95, seed=3)
    want = SpeculativeDecoder(target, None, 1).generate([Request(tuple(PROMPTS[1]), 24, sampling=sampling)])[0]
    greedy = greedy_reference(target, [PROMPTS[0], PROMPTS[2]], 24)
    steps = _steps(tiny_dirs, tiny_models, True)
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
    """``observe_steps`` prices a step by the contexts its reports carry, not by whichever ``decide`` ran last (served
    sequences that plan alone interleave): the curve learns the time beyond the context's share."""
    from dataclasses import replace

    from trtllm_dflash.runtime.loop import observe_steps

    aware, blind = _policy(), _policy()
    for p in (aware, blind):
        p.cost.alpha, p.cost.context_row_s = 1.0, 1e-7
        p.decide([p.new_sequence() for _ in range(4)])  # another plan in between, over rows without context
    plain = aware.cost.verify(4)
    reports = [StepReport(0, 0, 0.0, 1.5 * plain + 4000 * 1e-7, 0.0, False, False, 1000) for _ in range(4)]
    observe_steps(aware, None, reports)
    observe_steps(blind, None, [replace(r, context=0) for r in reports])  # a loop that did not say
    assert aware.cost.verify(4) == pytest.approx(1.5 * plain)
    assert blind.cost.verify(4) == pytest.approx(1.5 * plain + 4000 * 1e-7)
