"""The acceptance model of ``--block-size auto``: how likely each draft slot is to be accepted, per sequence.

(``AcceptanceModel``, one per sequence): p_j = P(draft j accepted | drafts 1..j−1 were), from
decayed success/failure counts plus a prior: the drafter's held-out per-slot accuracy from its training log,
lowered to the workload's (``AdaptivePolicy.workload``: every sequence's drafter outcomes pooled) where that is
less. The training log's accuracy (on text like the drafter's training data) would have every row of a batch draft
its first steps on a workload where the drafter accepts far less, which the batch's first outcomes show at once; a new
request to a server starts from what the drafter has been achieving on its traffic.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from trtllm_dflash.runtime.lookup import Lookup


def prior_from_training_log(drafter_dir: str | Path | None, num_drafts: int) -> list[float] | None:
    """Per-slot held-out accuracy from the drafter's ``training_log.json`` (last evaluation), if it has one."""
    if drafter_dir is None:
        return None
    path = Path(drafter_dir) / "training_log.json"
    try:
        held = json.loads(path.read_text()).get("held_out") or []
        acc = [float(a) for a in held[-1]["accuracy"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError, AttributeError):
        return None
    return (acc + [acc[-1]] * num_drafts)[:num_drafts] if acc else None


DEFAULT_PRIOR = 0.3  # per-slot conditional acceptance without a training log
# Per-slot conditional acceptance of a prompt-lookup continuation (of a recurring 2- or 3-gram) before any
# observation: `perf/ngram_acceptance.py` (at 0620e3a) on 1,152 regenerated training responses of SmolLM2 (a sample of
# the training pool, artifacts/curve19/regen); other text (HumanEval's greedy outputs) accepts less, so …
NGRAM_PRIOR = (0.86, 0.91, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96, 0.96, 0.96, 0.96, 0.97, 0.97, 0.97, 0.97)
# … held lightly (half a pseudo-observation): a sequence's own lookups decide after a step or two, and a sequence
# whose lookups keep failing goes back to k = 0 (a strong prior would keep a floor under the decayed estimate)
NGRAM_PRIOR_STRENGTH = 0.5
# A proposal's own features predict it far better than the sequence's earlier lookups (``Lookup.prior``; the acceptance
# of one continuation says little about the next, which follows another match): with them the prior is held strongly,
# and the sequence's outcomes only move it after a run of surprises.
LOOKUP_PRIOR_STRENGTH = 8.0
# A DSpark confidence head's per-position estimates (trained against each position's acceptance rate, 1 − TV of the
# drafter's and the target's distributions) are a forecast of the row's own next block, like a lookup's features:
# held as strongly, so the row's decayed counts move them only after a run of surprises.
CONFIDENCE_PRIOR_STRENGTH = 8.0


def clip_prior(prior: Sequence[float]) -> list[float]:
    """A prior's probabilities kept within [0.02, 0.98], so observations can always move them."""
    return [min(max(p, 0.02), 0.98) for p in prior]


class AcceptanceModel:
    """p_j = P(draft j accepted | drafts before it were), j = 1..B−1, from decayed counts plus a prior."""

    def __init__(self, num_drafts: int, prior: Sequence[float] | None = None, strength: float = 2.0,
                 decay: float = 0.92) -> None:
        prior = list(prior) if prior else [DEFAULT_PRIOR] * num_drafts
        self.prior = clip_prior((prior + [prior[-1]] * num_drafts)[:num_drafts])
        self.strength, self.decay = strength, decay
        self.hits = [0.0] * num_drafts
        self.misses = [0.0] * num_drafts
        self._memo: tuple | None = None  # (prior, strength, expected_accepted_all's list) until the counts change

    def p(self, j: int) -> float:  # j: 0-based draft index
        return self.probabilities()[j]

    def probabilities(self, prior: Sequence[float] | None = None, strength: float | None = None,
                      per_position: bool = False) -> list[float]:
        """Posterior means. A position's prior is the larger of the drafter's prior and the estimate of the position
        before it, so a sequence that keeps accepting whole blocks expects the next position to be accepted too (and
        the decision lengthens its blocks quickly); the counts then correct it. ``prior``/``strength``: this
        proposal's own (``Lookup.prior``) instead of the model's. ``per_position``: ``prior`` is a forecast of each
        position (a confidence head's), taken as it is, not raised to the position before it."""
        n = len(self.prior)
        if prior is not None and len(prior) < n:  # a forecast of a shorter block: its last position's for the rest
            prior = [*prior, *[prior[-1]] * (n - len(prior))]
        base = self.prior if prior is None else clip_prior(prior)
        strength = self.strength if strength is None else strength
        out: list[float] = []
        for j in range(n):
            q = base[j] if j == 0 or per_position else max(base[j], out[-1])
            s, f = self.hits[j], self.misses[j]
            out.append((s + strength * q) / (s + f + strength))
        return out

    def expected_accepted_all(self, prior: Sequence[float] | None = None, strength: float | None = None,
                              per_position: bool = False) -> list[float]:
        """[k] = E[accepted drafts | k drafts verified], k = 0..B−1 (``prior``, ``strength``, ``per_position``:
        ``probabilities``). Kept until the counts change or another prior is asked for (a row that does not draft
        asks ``decide`` the same question every step): the list is shared, read it, do not modify it."""
        key = (None if prior is None else tuple(prior), strength, per_position)
        if self._memo is not None and self._memo[:3] == key:
            return self._memo[3]
        out, run = [0.0], 1.0
        for p in self.probabilities(prior, strength, per_position):
            run *= p
            out.append(out[-1] + run)
        self._memo = (*key, out)
        return out

    def expected_accepted(self, k: int) -> float:
        return self.expected_accepted_all()[k]

    def relax(self, factor: float = 0.98) -> None:
        """One step without an observation: the counts decay (slower than with one), so the estimate drifts back
        toward the prior over some tens of steps."""
        self._memo = None
        for j in range(len(self.hits)):
            self.hits[j] *= factor
            self.misses[j] *= factor

    def observe(self, k: int, accepted: int) -> None:
        """One verified step: k drafts, the first ``accepted`` of them accepted."""
        if k <= 0:
            return
        self._memo = None
        for j in range(len(self.hits)):
            self.hits[j] *= self.decay
            self.misses[j] *= self.decay
        for j in range(accepted):
            self.hits[j] += 1
        if accepted < k:
            self.misses[accepted] += 1


@dataclass
class SeqState:
    """What the policy keeps for one sequence."""

    acceptance: AcceptanceModel  # of the drafter's blocks
    ngram: AcceptanceModel | None = None  # of the prompt-lookup continuations (policy.ngram only)
    idle_steps: int = 0  # steps since this row last drafted
    probe_interval: int = 8
    probing: bool = False  # the current draft is a forced re-probe
    drafted: int = 0  # steps this row verified drafter blocks (before the first, its acceptance is the prior's guess)
    source: str | None = None  # this step's proposal: "drafter", "ngram", "tree" or None (k = 0)
    lookup: Lookup | None = None  # this step's prompt-lookup proposal (set by the loop before ``decide``)
    weight: float = 1.0  # what this row's tokens are worth to the batch (``batch_weights``; 1 when serving)
    context: int = 0  # tokens the row's next verify attends over (its committed length; set by the loop)
    remaining: int | None = None  # tokens the row may still emit (its length limit; set by the loop; None: no limit)
    tree: float | None = None  # average tokens accepted by this row's tree steps (exponential; None: none yet)
    # a DSpark drafter's confidence head on this row's latest block: p_j per draft position (set by the loop after
    # each draft; None: no confidence head), the prior of the row's next plan (``AdaptivePolicy.drafter_expectation``)
    forecast: list[float] | None = None
    chosen: list[int] = field(default_factory=list)  # k per step (telemetry)
