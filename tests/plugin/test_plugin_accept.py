"""The acceptance rule with sampling is lossless, and the dispatch switch picks and forces implementations.

Distribution test (vLLM's statistical-test pattern): a toy target with prefix-dependent conditionals over a 4-token
vocabulary, fixed drafts d_1..d_3, and N sequences verified with independent uniforms. Every possible emitted
sequence (a accepted drafts, then the target's own token x) has an exact probability under losslessness:

    P(a, x) = Π_{i<a} p(d_{i+1} | d_1..d_i) · p(x | d_1..d_a),   with x ≠ d_{a+1} when a < 3

The empirical distribution must be within total variation TV_TOL of it, and clearly farther from a plausible wrong
rule (every slot sampled from the first slot's distribution).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton

import itertools  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from trtllm_dflash.plugin import accept as A  # noqa: E402
from trtllm_dflash.plugin import dispatch  # noqa: E402
from trtllm_dflash.plugin.dispatch import Impl  # noqa: E402
from trtllm_dflash.errors import ConfigError  # noqa: E402
from trtllm_dflash.runtime.sampling import SamplingParams, processed_probs  # noqa: E402

V = 4  # vocabulary
N = 20_000  # sequences
# E[TV] <= ½·sqrt(K/N) = 0.014 for K = 16 outcomes; 0.035 leaves 2.5x that, and the seed is fixed (no lottery)
TV_TOL = 0.035


def _conditional(prefix: tuple[int, ...]) -> torch.Tensor:
    """p(· | prefix) [V] float32: temperature 1.5 + top-k 3 over deterministic per-prefix logits."""
    seed = sum((t + 1) * 7 ** i for i, t in enumerate(prefix)) + 1000 * len(prefix)
    logits = torch.randn(1, V, generator=torch.Generator().manual_seed(seed)) * 2
    return processed_probs(logits, SamplingParams(temperature=1.5, top_k=3))[0]


def _greedy_chain(n: int) -> tuple[int, ...]:
    """Drafts d_1..d_n = the target's own argmax continuation, so every accepted length 0..n has real probability."""
    out: tuple[int, ...] = ()
    for _ in range(n):
        out += (int(_conditional(out).argmax()),)
    return out


DRAFTS = _greedy_chain(3)  # d_1..d_3


def _outcomes(slot_probs: list[torch.Tensor]) -> dict[tuple[int, int], float]:
    """Exact P(a, x) for the given per-slot distributions (slot i = p(· | d_1..d_i)), in float64."""
    slot_probs = [p.double() / p.double().sum() for p in slot_probs]
    out, reach = {}, 1.0
    for a in range(len(DRAFTS) + 1):
        for x in range(V):
            if a < len(DRAFTS) and x == DRAFTS[a]:
                continue
            out[(a, x)] = reach * float(slot_probs[a][x])
        if a < len(DRAFTS):
            reach *= float(slot_probs[a][DRAFTS[a]])
    return out


def _tv(p: dict, q: dict) -> float:
    return 0.5 * sum(abs(p.get(k, 0.0) - q.get(k, 0.0)) for k in set(p) | set(q))


def test_sampled_acceptance_is_lossless():
    slot_probs = [_conditional(DRAFTS[:i]) for i in range(len(DRAFTS) + 1)]  # slot i conditioned on d_1..d_i
    n_slots = len(DRAFTS) + 1
    probs = torch.stack(slot_probs).float().repeat(N, 1)  # [N·4, V]
    draft_ids = torch.tensor(DRAFTS).repeat(N)  # [N·3]
    cu = torch.arange(N + 1, dtype=torch.int32) * len(DRAFTS)  # [N + 1]
    uniforms = torch.rand(N * n_slots, generator=torch.Generator().manual_seed(0))
    out = dispatch.accept_sampled(draft_ids, cu, probs, uniforms, len(DRAFTS), impl=Impl.TORCH)

    counts: dict[tuple[int, int], float] = {}
    for a, x in zip(out.accepted_lengths.tolist(), out.bonus_ids.tolist()):
        counts[(a, x)] = counts.get((a, x), 0) + 1 / N
    exact = _outcomes(slot_probs)
    assert abs(sum(exact.values()) - 1) < 1e-9
    assert min(exact[(a, x)] for a in range(4) for x in range(V) if (a, x) in exact and slot_probs[a][x] > 0) > 1e-3
    tv = _tv(counts, exact)
    wrong = _tv(counts, _outcomes([slot_probs[0]] * n_slots))  # slot misalignment bug: every slot from p(·|∅)
    assert tv < TV_TOL, f"TV to the target's distribution {tv:.4f} >= {TV_TOL}"
    assert wrong > 3 * TV_TOL, f"negative control too close ({wrong:.4f}): the test cannot tell rules apart"
    # emitted tokens are the accepted drafts then the bonus
    for row, a in itertools.islice(enumerate(out.accepted_lengths.tolist()), 200):
        assert out.emitted_ids[row, :a].tolist() == list(DRAFTS[:a])

    # the kernels draw bit-identical samples from the same uniforms (a slice keeps the interpreter quick)
    m = 96
    sub = dispatch.accept_sampled(draft_ids[: m * 3], cu[: m + 1], probs[: m * n_slots], uniforms[: m * n_slots],
                                  len(DRAFTS), impl=Impl.TRITON)
    assert torch.equal(sub.accepted_lengths, out.accepted_lengths[:m])
    assert torch.equal(sub.emitted_ids, out.emitted_ids[:m])


def test_inverse_cdf_samples_follow_probs():
    """Plain sampling check: 50k draws from one distribution land within TV 0.01 of it."""
    p = torch.tensor([0.5, 0.25, 0.125, 0.0625, 0.0625, 0.0])
    u = torch.rand(50_000, generator=torch.Generator().manual_seed(1))
    x = A.inverse_cdf_reference(p.repeat(50_000, 1), u)
    emp = torch.bincount(x, minlength=6).double() / 50_000
    assert emp[5] == 0  # zero-probability tokens are never drawn
    assert 0.5 * (emp - p.double()).abs().sum() < 0.01  # E[TV] <= ½·sqrt(6/50k) = 0.0055


def test_greedy_dispatch_paths_agree():
    g = torch.Generator().manual_seed(4)
    num_drafts = [3, 0, 15, 1]
    cu = torch.tensor([0, 3, 3, 18, 19], dtype=torch.int32)
    logits = torch.randn(19 + 4, 50, generator=g)
    draft_ids = torch.randint(0, 50, (19,), generator=g)
    # make some drafts match so accepted lengths > 0 occur
    target = logits.argmax(-1)
    for i, n in enumerate(num_drafts):
        k = min(n, 2)
        draft_ids[cu[i]: cu[i] + k] = target[cu[i] + i: cu[i] + i + k]
    ref = dispatch.accept_greedy(draft_ids, cu, logits, 15, impl=Impl.TORCH)
    out = dispatch.accept_greedy(draft_ids, cu, logits, 15, impl=Impl.TRITON)
    assert ref.accepted_lengths.tolist() == [2, 0, 2, 1]
    assert torch.equal(out.accepted_lengths, ref.accepted_lengths) and torch.equal(out.emitted_ids, ref.emitted_ids)
    same = dispatch.accept_samples(draft_ids, cu, target, 15, impl=Impl.TRITON)
    assert torch.equal(same.bonus_ids, ref.bonus_ids)


def test_resolve_rules(monkeypatch):
    assert dispatch.resolve(Impl.AUTO, torch.device("cpu")) is Impl.TORCH
    assert dispatch.resolve(Impl.TORCH, torch.device("cuda")) is Impl.TORCH
    assert dispatch.resolve(Impl.AUTO, torch.device("cuda")) is Impl.TRITON  # triton is installed here
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET=1"):
        dispatch.resolve(Impl.TRITON, torch.device("cpu"))
    monkeypatch.setattr(dispatch, "triton_available", lambda: False)
    assert dispatch.resolve(Impl.AUTO, torch.device("cuda")) is Impl.TORCH
    with pytest.raises(ConfigError, match="needs OpenAI Triton"):
        dispatch.resolve(Impl.TRITON, torch.device("cuda"))


def test_shape_errors_name_the_field():
    with pytest.raises(ConfigError, match="target rows"):
        A.accept_reference(torch.zeros(3, dtype=torch.long), torch.tensor([0, 3], dtype=torch.int32),
                           torch.zeros(3, dtype=torch.long), 3)
