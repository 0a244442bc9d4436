"""``--block-size auto``: per sequence and step, how many drafts to verify (k ∈ {0, 1, …, B−1}).

One policy for every loop (the in-process decoder and the serving loop over any step backend). It maximises expected
emitted tokens per second of the next step:

    tokens(k_1..k_b) = Σ_i (1 + E_i[a | k_i])            E_i[a | k] = Σ_{n=1..k} Π_{j≤n} p_i,j
    seconds          = verify(b · (K + 1)) + context + draft(m · (K + 1)) + overhead  (K = max k_i, m rows draft)
    context          = C · (α + β · (K + 1))                                          (C = Σ_i context tokens of row i)

- **Cost model** (``CostModel``, ``runtime.cost``): the seconds of a verify and of a draft pass by the tokens they
  process, calibrated on the device and pulled toward the step times observed.
- **Acceptance model** (``AcceptanceModel``, ``runtime.acceptance``, one per sequence): p_j from decayed counts
  plus a prior (the drafter's training log, lowered to the workload's acceptance where that is less; for a DSpark
  drafter with a confidence head, that head's per-position estimates on the sequence's latest block).
- **Decision** (``AdaptivePolicy.decide``): the loops verify a rectangular [b, K + 1] block (rows drafting fewer are
  padded), so a row either drafts K tokens or none; for each K the best set of drafting rows is a prefix of the rows
  sorted by expected gain. K = 0 is a plain autoregressive step with no draft pass. A row that stops drafting is
  re-probed (``probe_k`` drafts) now and then, so a good stretch of text is picked up again. A probe costs the
  batch one draft pass and a longer verify; the interval is at least what keeps that below ``probe_budget`` of the
  decoding time by the cost model (on a CPU, where a probe costs about a plain step, tens of steps at batch 1 and the
  cap at a large batch; on a GPU, where a probe is nearly free, ``probe_every``), and it doubles after every failed
  probe up to ``max_probe_every``. A row that never drafted (its acceptance is only the prior's guess) gets its first
  probe after ``probe_every``, if it has at least that interval's worth of tokens left (``SeqState.remaining``): at a
  large batch on a CPU, where the first probe of every row costs more than a plain step, a short reply would not earn
  it back.
- **Tree** (``tree_nodes`` > 0: ``--block-size auto --tree``): after ``decide`` has its best plan, ``choose_tree``
  compares it with a tree step for every row (``runtime.tree``: the drafter's block, its runner-ups and the lookup
  chains, ``tree_nodes`` tokens per row in one verify): expected tokens per second with each row's tree estimate (an
  average of what its tree steps accepted; before any, ``TREE_PRIOR_GAIN`` times its chain expectation) against the
  cost model's price of a verify that wide. Where a wide verify costs about a narrow one (a GPU at small batch) the
  tree wins; where it costs several steps (a CPU) the chain plan does, and a tree step is re-tried only as often as
  ``probe_budget`` allows.

The parts live in their own modules: ``runtime.cost`` (the cost model), ``runtime.acceptance`` (the acceptance model),
``runtime.lookup`` (prompt lookup, the proposer the policy weighs against the drafter) and ``runtime.telemetry``.
"""

from __future__ import annotations

import math
from typing import Sequence

from trtllm_dflash.runtime.acceptance import (CONFIDENCE_PRIOR_STRENGTH, LOOKUP_PRIOR_STRENGTH, NGRAM_PRIOR,
                                              NGRAM_PRIOR_STRENGTH, AcceptanceModel, SeqState)
from trtllm_dflash.runtime.cost import CostModel
from trtllm_dflash.runtime.telemetry import Telemetry


# A row's tree estimate before its first tree step: this many times the tokens its chain plan expects; between the
# ratios of the tree's replayed τ to ``--ngram``'s on HumanEval and on MT-Bench with the shipped drafter and datastore
# (perf/results/tree/2026-11-26-datastore/).
TREE_PRIOR_GAIN = 1.5
TREE_EMA = 0.3  # weight of a row's latest tree step in its estimate
# The workload's acceptance (``AdaptivePolicy.workload``): the training log's prior held as two observations, each
# observation (one sequence's step) decayed by 0.98, so it follows the last ~50 drafting steps of all sequences.
WORKLOAD_STRENGTH = 2.0
WORKLOAD_DECAY = 0.98


class AdaptivePolicy:
    """Chooses k per sequence and step from the cost model and each sequence's acceptance model."""

    def __init__(self, cost: CostModel, max_block_size: int, prior: Sequence[float] | None = None,
                 probe_every: int = 8, max_probe_every: int = 256, probe_k: int = 3, probe_budget: float = 0.02,
                 ngram: bool = False, tree_nodes: int = 0) -> None:
        self.cost, self.max_k = cost, max_block_size - 1
        self.prior = prior
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        self.probe_k = max(1, min(probe_k, self.max_k))
        self.probe_budget = probe_budget
        self.ngram = ngram  # also consider prompt-lookup continuations (free to propose)
        self.tree_nodes = tree_nodes  # > 0: a tree step of this many tokens per row is an option (choose_tree)
        self.tree_wait = 0  # steps since the last tree step
        self.last_rate = 0.0  # expected tokens per second of decide's latest plan
        self.context = 0  # the cached tokens of the rows of decide's latest step (all together): its verify's price
        # every sequence's drafter outcomes pooled: the prior of each sequence's own estimate (``drafter_expectation``)
        self.workload = AcceptanceModel(self.max_k, prior, WORKLOAD_STRENGTH, WORKLOAD_DECAY)
        self.telemetry = Telemetry()

    def new_sequence(self) -> SeqState:
        return SeqState(AcceptanceModel(self.max_k, self.prior),
                        AcceptanceModel(self.max_k, list(NGRAM_PRIOR), NGRAM_PRIOR_STRENGTH) if self.ngram else None,
                        probe_interval=self.probe_every)

    def decide(self, states: Sequence[SeqState], ngram_lens: Sequence[int] | None = None) -> list[int]:
        """k per row for the next step; sets each state's ``source``. A drafter row verifies the step's common K
        drafts (one draft pass for all of them), an n-gram row min(K, its continuation's length) tokens; the others
        verify none. ``ngram_lens``: the length of each row's prompt-lookup continuation (policy.ngram only)."""
        b = len(states)
        for s in states:
            s.source = None
        self.context = sum(s.context for s in states)
        if self.max_k <= 0 or b == 0:
            return [0] * b
        floor = self.min_probe_interval(b)
        due = [i for i, s in enumerate(states)
               if (s.idle_steps >= max(s.probe_interval, floor) if s.drafted
                   else s.idle_steps >= s.probe_interval and (s.remaining is None or s.remaining >= floor))]
        prior = self.drafter_prior()  # the same for every row: pooled once per step
        expected = [self.drafter_expectation(s, prior) for s in states]  # [row][k]
        lens = list(ngram_lens) if (self.ngram and ngram_lens is not None) else [0] * b
        free_exp = [self.lookup_expectation(s) if (s.ngram is not None and lens[i]) else None
                    for i, s in enumerate(states)]
        w = [s.weight for s in states]
        due_set = set(due)
        best_rate, best = sum(w) / self.cost.step(b, 0, 0, context=self.context), (0, [], [0.0] * b)
        # host work every step, which a CUDA-graphed step may not hide: the rows verifying a lookup are counted per
        # plan and listed for the best plan only (listed per plan, O(K · b³)), the verify's price is taken once per k,
        # and a row's expectations are remembered until its counts or the prior change (perf/results/policy/)
        for k in range(1, self.max_k + 1):
            free = [f[min(k, lens[i])] if f is not None else 0.0 for i, f in enumerate(free_exp)]
            extra = sorted((((expected[i][k] - free[i]) * w[i], i) for i in range(b)
                            if i not in due_set and expected[i][k] > free[i]), reverse=True)
            tokens = sum(w) + sum(f * wi for f, wi in zip(free, w))
            tokens += sum((expected[i][k] - free[i]) * w[i] for i in due)
            rows = list(due)
            looking = sum(1 for i in range(b) if i not in due_set and free[i] > 0)  # rows that would verify a lookup
            verify = self.cost.verify(b * (k + 1), b, self.context)  # the same for every plan of this k
            for m in range(len(extra) + 1):
                if m:
                    gain, i = extra[m - 1]
                    tokens += gain
                    rows.append(i)
                    looking -= free[i] > 0
                if not rows and not looking:
                    continue
                rate = tokens / self.cost.step(b, k, len(rows), bool(rows), self.context, verify_s=verify)
                if rate > best_rate:
                    best_rate, best = rate, (k, list(rows), free)
        k, rows, free = best
        drafting = set(rows)
        ngram_rows = [i for i in range(b) if i not in drafting and free[i] > 0]
        self.last_rate = best_rate
        if due and k == 0:  # nothing pays, but some rows are due a re-probe
            k, rows, ngram_rows = self.probe_k, due, []
        ks = [0] * b
        for i in rows:
            ks[i], states[i].source = k, "drafter"
        for i in ngram_rows:
            ks[i], states[i].source = min(k, lens[i]), "ngram"
        for i, s in enumerate(states):
            s.probing = s.source == "drafter" and i in due
        return ks

    def batch_weights(self, remaining: Sequence[int], context: float = 0.0, slack: int = 2) -> list[float]:
        """Weights of a static batch's rows (``SeqState.weight``) from the tokens each still has to make (``context``:
        the rows' cached tokens, all together): the batch takes as many steps as its furthest-behind row, so a token
        of a row within ``slack`` of the most remaining is worth a full token; a token of a row ahead only brings
        that row's leaving a step closer, and is worth ``row_share`` of one."""
        most = max(remaining, default=0)
        ahead = self.row_share(len(remaining), context)
        return [1.0 if r >= most - slack else ahead for r in remaining]

    def row_share(self, rows: int, context: float = 0.0) -> float:
        """What one row's leaving saves a plain step of ``rows`` rows, as a share of that step, by the cost model: on a
        CPU, where every row is compute, a small share at a large batch (``perf/policy_replay.py`` at a8cb761^ compares
        this with a guessed share); on a GPU, where a batch's plain step costs about one row's, about 0."""
        if rows <= 1:
            return 1.0
        full = self.cost.step(rows, 0, 0, context=context)
        less = self.cost.step(rows - 1, 0, 0, context=context * (rows - 1) / rows)
        return min(max((full - less) / full, 0.0), 1.0) if full > 0 else 0.0

    def drafter_prior(self) -> tuple[float, ...]:
        """Every sequence's prior for the drafter's blocks: the training log's accuracy, lowered where the workload's
        pooled outcomes say less (never raised: a few rows that accept everything would pull the rows that accept
        nothing back into every other step)."""
        return tuple(min(p, w) for p, w in zip(self.workload.prior, self.workload.probabilities()))

    def drafter_expectation(self, state: SeqState, prior: Sequence[float] | None = None) -> list[float]:
        """[k] = E[accepted | k drafts of the drafter's block verified]: the sequence's own outcomes over
        ``drafter_prior`` (``prior``: it, computed once for a step's rows), or over the confidence head's forecast
        for this sequence (``SeqState.forecast``, a DSpark drafter's) where it has one."""
        if state.forecast:
            return state.acceptance.expected_accepted_all(state.forecast, CONFIDENCE_PRIOR_STRENGTH, per_position=True)
        return state.acceptance.expected_accepted_all(self.drafter_prior() if prior is None else prior)

    def lookup_expectation(self, state: SeqState) -> list[float]:
        """[k] = E[accepted | k of this step's lookup tokens verified]: from the proposal's own features
        (``Lookup.prior``, held strongly) where the loop gave them, else from the sequence's lookup history."""
        lk = state.lookup
        if lk is None or not lk.tokens:
            return state.ngram.expected_accepted_all()
        return state.ngram.expected_accepted_all(lk.prior(self.max_k), LOOKUP_PRIOR_STRENGTH)

    def tree_step_cost(self, rows: int) -> float:
        """Seconds of a tree step: every row drafts a full block and verifies ``tree_nodes`` tokens."""
        cost = self.cost
        return cost.verify(rows * self.tree_nodes, rows, self.context) + cost.draft(rows * (self.max_k + 1)) + \
            cost.overhead_s

    def tree_probe_interval(self, rows: int) -> int:
        """Steps between tree steps taken only to refresh the rows' estimates, keeping their extra cost over a plain
        step within ``probe_budget`` of the decoding time."""
        plain = self.cost.step(rows, 0, 0, context=self.context)
        extra = max(self.tree_step_cost(rows) - plain, 0.0)
        return max(self.probe_every, min(self.max_probe_every, math.ceil(extra / (self.probe_budget * plain))))

    def choose_tree(self, states: Sequence[SeqState]) -> bool:
        """After ``decide``: whether this step is a tree step for every row instead of decide's plan — it promises
        more tokens per second, or a refresh of the rows' tree estimates is due. Marks the rows' source "tree"."""
        if self.tree_nodes <= 0 or not states:
            return False
        expected, prior = [], self.drafter_prior()
        for s in states:
            if s.tree is None:  # no tree step yet: a multiple of the best its chain proposals expect
                chain = self.drafter_expectation(s, prior)[self.max_k]
                if s.ngram is not None:
                    chain = max(chain, s.ngram.expected_accepted(self.max_k))
                expected.append(TREE_PRIOR_GAIN * (1 + chain) - 1)
            else:
                expected.append(s.tree)
        rate = sum(s.weight * (1 + e) for s, e in zip(states, expected)) / self.tree_step_cost(len(states))
        take = rate > self.last_rate or self.tree_wait >= self.tree_probe_interval(len(states))
        self.tree_wait = 0 if take else self.tree_wait + 1
        if take:
            for s in states:
                s.source, s.probing = "tree", False
        return take

    def observe_tree(self, state: SeqState, accepted: int) -> None:
        """One row's outcome of a tree step: ``accepted`` tokens past its bonus."""
        state.chosen.append(self.max_k)
        state.tree = accepted if state.tree is None else (1 - TREE_EMA) * state.tree + TREE_EMA * accepted

    def min_probe_interval(self, rows: int) -> int:
        """Steps between one row's probes that keep probing (one probe of each of ``rows`` rows, each adding a
        draft pass and a longer verify to a batch step) within ``probe_budget`` of the time of plain steps."""
        if self.probe_budget <= 0:
            return self.probe_every
        plain = self.cost.step(rows, 0, 0, context=self.context)
        extra = self.cost.step(rows, self.probe_k, 1, context=self.context) - plain
        return max(self.probe_every, min(self.max_probe_every, math.ceil(rows * extra / (self.probe_budget * plain))))

    def observe(self, state: SeqState, k: int, accepted: int) -> None:
        """One row's outcome: it verified k proposed tokens (from ``state.source``) and accepted ``accepted``."""
        state.chosen.append(k)
        if state.ngram is not None and state.source != "ngram":
            state.ngram.relax()  # unused, its estimate drifts back to the prior: a later stretch gets a try
        if state.source == "ngram":
            state.ngram.observe(k, accepted)
            self.telemetry.ngram_steps += 1
            self.telemetry.ngram_accepted += accepted
        if state.source != "drafter":
            state.idle_steps += 1
            return
        state.acceptance.observe(k, accepted)
        self.workload.observe(k, accepted)
        state.idle_steps = 0
        state.drafted += 1
        if state.probing:  # a failed re-probe backs off, a successful one resets the interval
            waited = max(state.probe_interval, self.min_probe_interval(1))
            state.probe_interval = min(2 * waited, self.max_probe_every) if accepted == 0 else self.probe_every
        state.probing = False

    def observe_step(self, ks: Sequence[int], accepted: Sequence[int], draft_s: float, verify_s: float,
                     overhead_s: float, drafting: int | None = None, verify_tokens: int | None = None,
                     context: float | None = None, timed: bool = True) -> None:
        """The whole step's timing (all rows), fed back into the cost model and the telemetry. ``drafting``: rows
        that went through the draft pass (default: every row with k > 0); ``verify_tokens``: the verify's width
        (default rows · (max k + 1); a tree step's rows · tree_nodes); ``context``: the rows' cached tokens, all
        together (default: those of the latest ``decide``); ``timed`` False: the times are not the step's own (it
        captured a CUDA graph), telemetry only."""
        rows, kmax = len(ks), max(ks, default=0)
        drafting = sum(1 for k in ks if k > 0) if drafting is None else drafting
        width = rows * (kmax + 1) if verify_tokens is None else verify_tokens
        if timed:
            self.cost.observe(width, verify_s, drafting * (kmax + 1) if kmax else 0, draft_s, overhead_s, rows,
                              self.context if context is None else context)
        t = self.telemetry
        t.tree_steps += int(verify_tokens is not None)  # only tree steps give their width
        t.steps += 1
        t.draft_s += draft_s
        t.verify_s += verify_s
        t.overhead_s += overhead_s
        t.record(ks, accepted)
