"""``--block-size auto``: per sequence and step, how many drafts to verify (k ∈ {0, 1, …, B−1}).

One policy for every loop (the in-process decoder and the serving loop over any step backend). It maximises expected
emitted tokens per second of the next step:

    tokens(k_1..k_b) = Σ_i (1 + E_i[a | k_i])            E_i[a | k] = Σ_{n=1..k} Π_{j≤n} p_i,j
    seconds          = verify(b · (K + 1)) + context + draft(m · (K + 1)) + overhead  (K = max k_i, m rows draft)
    context          = C · (α + β · (K + 1))                                          (C = Σ_i context tokens of row i)

- **Cost model** (``CostModel``): seconds of one verify forward and of one draft pass as piecewise-linear functions
  of the tokens they process (all rows together, so a batch pays the verify once per step), measured on the device
  by a short calibration, cached on disk keyed by device, dtype, threads and model, and pulled toward the step times
  actually observed. The verify curve is timed without context; attending over the rows' cached tokens adds α per
  row and β per verified token for each context token (``CostModel.context``, calibrated by timing the same shapes
  over an empty and a filled cache): without it a batch's K = 0 step, which reads all its rows' K/V, looked as cheap
  as one row's, and once observed at its true price the curve's flat segment above it made K = 1 look free.
- **Acceptance model** (``AcceptanceModel``, one per sequence): p_j = P(draft j accepted | drafts 1..j−1 were), from
  decayed success/failure counts plus a prior: the drafter's held-out per-slot accuracy from its training log,
  lowered to the workload's (``AdaptivePolicy.workload``: every sequence's drafter outcomes pooled) where that is
  less. The training log's accuracy (0.63 at slot 1 for the shipped drafter, on text like its training data) made
  every row of a batch draft its first steps on MT-Bench, where 16 rows' first outcomes say at once that it accepts
  far less; a new request to a server starts from what the drafter has been achieving on its traffic.
- **Decision** (``AdaptivePolicy.decide``): the loops verify a rectangular [b, K + 1] block (rows drafting fewer are
  padded), so a row either drafts K tokens or none; for each K the best set of drafting rows is a prefix of the rows
  sorted by expected gain. K = 0 is a plain autoregressive step with no draft pass. A row that stops drafting is
  re-probed (``probe_k`` drafts) now and then, so a good stretch of text is picked up again. A probe costs the
  batch one draft pass and a longer verify; the interval is at least what keeps that below ``probe_budget`` of the
  decoding time by the cost model (on the 2-core development CPU at 2 %: ~20 steps at batch 1, the cap at batch 16;
  on a GPU, where a probe is nearly free, ``probe_every``), and it doubles after every failed probe up to
  ``max_probe_every``. A row that never drafted (its acceptance is only the prior's guess) gets its first probe after
  ``probe_every``, if it has at least that interval's worth of tokens left (``SeqState.remaining``): at batch 16 on a
  CPU, where the first probe of every row costs about two plain steps, a 48-token reply would not earn it back.
- **Tree** (``tree_nodes`` > 0: ``--block-size auto --tree``): after ``decide`` has its best plan, ``choose_tree``
  compares it with a tree step for every row (``runtime.tree``: the drafter's block, its runner-ups and the lookup
  chains, ``tree_nodes`` tokens per row in one verify): expected tokens per second with each row's tree estimate (an
  average of what its tree steps accepted; before any, ``TREE_PRIOR_GAIN`` times its chain expectation) against the
  cost model's price of a verify that wide. Where a wide verify costs about a narrow one (a GPU at small batch) the
  tree wins; where it costs several steps (a CPU) the chain plan does, and a tree step is re-tried only as often as
  ``probe_budget`` allows.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from trtllm_dflash.hardware import cpu_model

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # tokens per forward at which costs are calibrated
MAX_STEP_RATIO = 2.0  # the most one observed step can move the cost model's estimate toward it (× or ÷)


def _interp(grid: Sequence[int], values: Sequence[float], n: float) -> tuple[float, int, float]:
    """Piecewise-linear value at n; also the left bracket index and the weight of the right point."""
    if n <= grid[0]:
        return values[0], 0, 0.0
    for i in range(len(grid) - 1):
        if n <= grid[i + 1]:
            w = (n - grid[i]) / (grid[i + 1] - grid[i])
            return values[i] * (1 - w) + values[i + 1] * w, i, w
    i = len(grid) - 2  # beyond the grid: extend the last segment's slope
    slope = (values[-1] - values[-2]) / (grid[-1] - grid[-2])
    return values[-1] + slope * (n - grid[-1]), i, 1.0


@dataclass
class CostModel:
    """Seconds of one step's parts as functions of the tokens processed (``GRID`` points, interpolated)."""

    verify_s: list[float]  # one target verify forward over n tokens (all rows), incl. sampling the first slot
    draft_s: list[float]  # one draft pass over n block slots (all drafting rows), incl. the head on its drafts
    overhead_s: float = 0.0  # per step, outside draft and verify (acceptance, KV injection, bookkeeping)
    key: dict = field(default_factory=dict)
    alpha: float = 0.2  # weight of one observed step time
    context_row_s: float = 0.0  # α: seconds a verify spends per row and per context token it attends over
    context_token_s: float = 0.0  # β: seconds per verified token and per context token of its row

    def context(self, n: float, rows: int, context: float) -> float:
        """Seconds a verify of n tokens over ``rows`` rows spends attending over ``context`` cached tokens (all
        rows together) beyond what the context-free curve says."""
        return context * (self.context_row_s + self.context_token_s * n / rows) if rows > 0 and context > 0 else 0.0

    def verify(self, n: float, rows: int = 1, context: float = 0.0) -> float:
        return _interp(GRID, self.verify_s, n)[0] + self.context(n, rows, context)

    def draft(self, n: float) -> float:
        return 0.0 if n <= 0 else _interp(GRID, self.draft_s, n)[0]

    def step(self, rows: int, k: int, drafting: int, draft_pass: bool = True, context: float = 0.0,
             verify_s: float | None = None) -> float:
        """Seconds of a step verifying k proposed tokens (k + 1 slots) for ``rows`` rows, ``drafting`` of which went
        through the draft pass; ``context``: the rows' cached tokens, all together. ``verify_s``: the verify's price
        if the caller already has it (``AdaptivePolicy.decide`` prices many plans with one verify)."""
        draft = self.draft(drafting * (k + 1)) if (k > 0 and drafting and draft_pass) else 0.0
        verify = self.verify(rows * (k + 1), rows, context) if verify_s is None else verify_s
        return verify + draft + self.overhead_s

    @staticmethod
    def _observe(values: list[float], n: float, seconds: float, alpha: float) -> None:
        predicted, i, w = _interp(GRID, values, n)
        if predicted <= 0 or seconds <= 0:
            return
        # scale the bracketing points toward the observation, by their weight; one step moves them at most by a
        # factor of MAX_STEP_RATIO (a served verify that queued behind other requests' prefills took seconds, and
        # one such step made every width look as dear as the widest: the policy then verified wide blocks always)
        ratio = min(max(seconds / predicted, 1 / MAX_STEP_RATIO), MAX_STEP_RATIO)
        values[i] *= 1 + alpha * (1 - w) * (ratio - 1)
        # every point above n moves by the estimate's change at n, keeping what each further token costs: a served
        # step's time includes a cost per call (the BLS round trip, the step barrier) that wider verifies pay too.
        # Moved only locally and then kept monotone, 16 concurrent sequences that observed only 16-token verifies
        # (135 ms served, 50 calibrated) raised the 32- and 64-token points to the same 135 ms: K = 3 for the
        # whole batch looked free, and the served loop verified prompt lookup's proposals at twice a plain step's
        # compute.
        shift = alpha * (ratio - 1) * predicted
        for j in range(i + 1, len(values)):
            values[j] += shift
        if ratio >= 1:  # more tokens never cost less: a slow narrow step raises the wider points
            for j in range(1, len(values)):
                values[j] = max(values[j], values[j - 1])
        else:  # and a fast wide step lowers the narrower ones
            for j in range(len(values) - 2, -1, -1):
                values[j] = min(values[j], values[j + 1])

    def observe(self, verify_tokens: int, verify_s: float, draft_tokens: int = 0, draft_s: float = 0.0,
                overhead_s: float | None = None, rows: int = 1, context: float = 0.0) -> None:
        """Pull the model toward one observed step (its verify over ``rows`` rows with ``context`` cached tokens: the
        curve learns the time beyond the context's share)."""
        ctx = self.context(verify_tokens, rows, context)
        self._observe(self.verify_s, verify_tokens, max(verify_s - ctx, 1e-3 * verify_s), self.alpha)  # > 0
        if draft_tokens > 0:
            self._observe(self.draft_s, draft_tokens, draft_s, self.alpha)
        if overhead_s is not None:
            self.overhead_s += self.alpha * (max(overhead_s, 0.0) - self.overhead_s)

    def to_json(self) -> dict:
        return {"key": self.key, "grid": list(GRID), "verify_s": self.verify_s, "draft_s": self.draft_s,
                "overhead_s": self.overhead_s, "context_row_s": self.context_row_s,
                "context_token_s": self.context_token_s}

    @classmethod
    def from_json(cls, doc: dict) -> CostModel:
        if doc.get("grid") != list(GRID) or len(doc["verify_s"]) != len(GRID) or len(doc["draft_s"]) != len(GRID):
            raise ValueError("cost cache has another grid")
        return cls([float(x) for x in doc["verify_s"]], [float(x) for x in doc["draft_s"]],
                   float(doc.get("overhead_s", 0.0)), dict(doc.get("key", {})),
                   context_row_s=float(doc.get("context_row_s", 0.0)),
                   context_token_s=float(doc.get("context_token_s", 0.0)))

    def save(self, path: Path) -> None:
        """Atomic write (a concurrent reader sees the old file or the new one)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)


def device_name(device) -> str:
    """The hardware behind a torch device: the GPU's name, or the CPU's model name."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


# Raised when what a calibration times changes, so caches written before are calibrated again. 2: a draft pass of
# several rows takes one GEMM through the LM head instead of one per row (``draft_block``), a third less at 16 rows;
# and the context's coefficients (``calibrate_context``) are part of a calibration. 3: small float32 products on a
# CPU run weight-major (``models.layers.Linear``): a one-row verify ~40 % faster on the development VM.
CALIBRATION_VERSION = 3


def cost_key(device: str, dtype: str, threads: int, model: str) -> dict:
    return {"device": device, "dtype": dtype, "threads": threads, "model": model, "version": CALIBRATION_VERSION}


def cache_path(key: dict, root: Path | None = None) -> Path:
    from trtllm_dflash.assets import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return (root or cache_dir()) / "adaptive" / f"cost-{digest}.json"


def calibrate(measure_verify: Callable[[int], float], measure_draft: Callable[[int], float], max_tokens: int,
              repeats: int = 3) -> tuple[list[float], list[float]]:
    """Fastest of ``repeats`` runs of ``measure_*(n)`` (seconds) at each grid point up to ``max_tokens``, made
    non-decreasing in n (on a shared machine the minimum is the least disturbed run); beyond, linear extension."""
    top = max(i for i, n in enumerate(GRID) if n <= max(max_tokens, 2))
    out = []
    for measure in (measure_verify, measure_draft):
        measure(GRID[0])  # warm-up
        vals = []
        for n in GRID[: top + 1]:
            vals.append(max(min(measure(n) for _ in range(repeats)), vals[-1] if vals else 1e-6))
        for i in range(top + 1, len(GRID)):  # keep the last measured slope (at least proportional growth)
            slope = max((vals[-1] - vals[-2]) / (GRID[i - 1] - GRID[i - 2]), vals[-1] / GRID[i - 1])
            vals.append(vals[-1] + slope * (GRID[i] - GRID[i - 1]))
        out.append(vals)
    return out[0], out[1]


def calibrate_context(measure: Callable[[int, int, int], float], context: int = 512, rows: int = 16, width: int = 4,
                      repeats: int = 5) -> tuple[float, float]:
    """(α, β) of ``CostModel.context`` from ``measure(rows, width, context)`` (seconds of a verify of ``rows`` ×
    ``width`` tokens over ``context`` cached tokens a row): ``rows`` rows of one token and of ``width`` tokens, each
    over an empty cache and over ``context`` tokens, interleaved, the fastest of ``repeats``. Per context token the
    first pair differs by rows · (α + β), the second by rows · (α + width · β); a step's share that does not grow with
    its rows (~2 ms over 300 tokens here) cancels out of β. (One row of ``rows`` tokens as the second probe, the first
    version, put that share into β: 0.66–1.03 µs against 0.31 µs fitted over 20 shapes.)"""
    shapes = [(rows, 1, 0), (rows, 1, context), (rows, width, 0), (rows, width, context)]
    for shape in shapes:
        measure(*shape)  # warm-up
    best = {shape: math.inf for shape in shapes}
    for _ in range(repeats):
        for shape in shapes:
            best[shape] = min(best[shape], measure(*shape))
    narrow = (best[shapes[1]] - best[shapes[0]]) / context  # rows · (α + β)
    wide = (best[shapes[3]] - best[shapes[2]]) / context  # rows · (α + width · β)
    beta = max((wide - narrow) / (rows * (width - 1)), 0.0)
    return max(narrow / rows - beta, 0.0), beta


def load_or_calibrate(key: dict, measure_verify, measure_draft, max_tokens: int, root: Path | None = None,
                      refresh: bool = False, check: int = 0, measure_context=None) -> CostModel:
    """The cached cost model for ``key``, or a fresh calibration (then cached). ``check`` > 0: spot-check a cached
    model with that many runs of the smallest verify and draft (``rescale_to_spot_check``). ``measure_context``:
    ``calibrate_context``'s measure (without it verifies are priced as if over an empty cache)."""
    path = cache_path(key, root)
    if path.is_file() and not refresh:
        try:
            model = CostModel.from_json(json.loads(path.read_text()))
            if model.key == key:
                if check > 0:
                    rescale_to_spot_check(model, measure_verify, measure_draft, check)
                return model
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            pass  # stale or foreign file: calibrate again
    verify_s, draft_s = calibrate(measure_verify, measure_draft, max_tokens)
    model = CostModel(verify_s, draft_s, key=key)
    if measure_context is not None:
        model.context_row_s, model.context_token_s = calibrate_context(measure_context)
    model.save(path)
    return model


def rescale_to_spot_check(model: CostModel, measure_verify, measure_draft, repeats: int = 3,
                          tolerance: float = 1.5) -> None:
    """A cache calibrated while the machine was busier (or quieter) than now has the right shape but the wrong
    scale, which step observations correct only at the sizes actually run (so a stale cache would keep the untried
    block sizes looking too dear or too cheap). Measure one 1-token verify and one 2-slot draft (fastest of
    ``repeats``); a curve off by more than ``tolerance``× is scaled as a whole (in memory; the cache keeps the
    calibration)."""
    for values, measure, n in ((model.verify_s, measure_verify, GRID[0]), (model.draft_s, measure_draft, GRID[1])):
        measure(n)  # warm-up
        ratio = min(measure(n) for _ in range(repeats)) / _interp(GRID, values, n)[0]
        if not 1 / tolerance <= ratio <= tolerance:
            values[:] = [v * ratio for v in values]
            if values is model.verify_s:
                model.context_row_s *= ratio
                model.context_token_s *= ratio


def timed(fn: Callable[[], object], sync: Callable[[], None] = lambda: None) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance


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
# observation: `perf/ngram_acceptance.py` on 1,152 regenerated training responses of SmolLM2 (session 19's pool sample,
# 193k positions, 78 % with a proposal); on the 164 HumanEval greedy outputs the same script gives 0.73, 0.82, 0.87 …
NGRAM_PRIOR = (0.86, 0.91, 0.93, 0.94, 0.95, 0.95, 0.96, 0.96, 0.96, 0.96, 0.96, 0.97, 0.97, 0.97, 0.97)
# … held lightly (half a pseudo-observation): a sequence's own lookups decide after a step or two, and a sequence
# whose lookups keep failing goes back to k = 0 (a strong prior would keep a floor under the decayed estimate)
NGRAM_PRIOR_STRENGTH = 0.5
# A proposal's own features predict it far better than the sequence's earlier lookups (``Lookup.prior``; the acceptance
# of one continuation says little about the next, which follows another match): with them the prior is held strongly,
# and the sequence's outcomes only move it after a run of surprises.
LOOKUP_PRIOR_STRENGTH = 8.0
# P(first token accepted) by match length (bins: ≤ 2, 3, 4–5, 6–9, 10–19, ≥ 20 tokens), when the n-gram's latest two
# earlier occurrences agree on the next token or it has one (row 0) and when they disagree (row 1); later slots'
# conditional acceptance by match length. `perf/ngram_acceptance.py --by-match` on greedy outputs (128 tokens) of 325
# training pool prompts (every 200th of the shipped drafter's training prompts; 18k positions with a proposal); on
# HumanEval's and MT-Bench's greedy outputs the same predictor's log-loss per verified slot is 0.42 / 0.47 where the
# sequence's own history with ``NGRAM_PRIOR`` gets 0.56 / 0.59.
LOOKUP_MATCH_BINS = (2, 3, 5, 9, 19)
LOOKUP_FIRST = ((0.63, 0.77, 0.85, 0.90, 0.93, 0.97), (0.17, 0.16, 0.24, 0.36, 0.54, 0.77))
LOOKUP_NEXT = (0.81, 0.84, 0.88, 0.91, 0.94, 0.97)


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

    def probabilities(self, prior: Sequence[float] | None = None, strength: float | None = None) -> list[float]:
        """Posterior means. A position's prior is the larger of the drafter's prior and the estimate of the position
        before it, so a sequence that keeps accepting whole blocks expects the next position to be accepted too (and
        the decision lengthens its blocks quickly); the counts then correct it. ``prior``/``strength``: this
        proposal's own (``Lookup.prior``) instead of the model's."""
        base = self.prior if prior is None else clip_prior(prior)
        strength = self.strength if strength is None else strength
        out: list[float] = []
        for j in range(len(self.prior)):
            q = base[j] if j == 0 else max(base[j], out[-1])
            s, f = self.hits[j], self.misses[j]
            out.append((s + strength * q) / (s + f + strength))
        return out

    def expected_accepted_all(self, prior: Sequence[float] | None = None,
                              strength: float | None = None) -> list[float]:
        """[k] = E[accepted drafts | k drafts verified], k = 0..B−1 (``prior``, ``strength``: ``probabilities``).
        Kept until the counts change or another prior is asked for (a row that does not draft asks ``decide`` the
        same question every step): the list is shared, read it, do not modify it."""
        key = (None if prior is None else tuple(prior), strength)
        if self._memo is not None and self._memo[:2] == key:
            return self._memo[2]
        out, run = [0.0], 1.0
        for p in self.probabilities(prior, strength):
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


# ---------------------------------------------------------------------------------------------------------------------
# Decision


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
    chosen: list[int] = field(default_factory=list)  # k per step (telemetry)


LOOKUP_MIN_N = 2  # the decoder's prompt lookup proposes the continuation of a recurring 2- or 3-gram, not a 1-gram


def held(proposal: list[int], chains: Sequence[list[int]]) -> bool:
    """Whether one of ``chains`` already starts with ``proposal`` (verifying it again would add nothing)."""
    return any(chain[: len(proposal)] == proposal for chain in chains)


def ngram_candidates(context: Sequence[int], max_len: int, max_candidates: int, max_n: int = 3, min_n: int = 1,
                     per_n: int = 1) -> list[list[int]]:
    """Prompt lookup's proposals, best first: for n = max_n down to min_n, the tokens that followed each of the
    ``per_n`` latest earlier occurrences of the context's last n tokens (at most ``max_len`` of them), skipping one
    that an earlier proposal already starts with; at most ``max_candidates``, [] if no such suffix recurs."""
    size, found = len(context), []
    for n in range(min(max_n, size - 1), max(min_n, 1) - 1, -1):
        tail, taken = list(context[size - n:]), 0
        for start in range(size - n - 1, -1, -1):
            if context[start] == tail[0] and list(context[start:start + n]) == tail:
                cont = list(context[start + n:start + n + max_len])  # never empty: start + n < size
                if not held(cont, found):
                    found.append(cont)
                    taken += 1
                if len(found) == max_candidates:
                    return found
                if taken == per_n:
                    break
    return found


def ngram_continuation(context: Sequence[int], max_len: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
    (n = max_n down to min_n), at most ``max_len`` of them; [] if no such suffix recurs."""
    return ngram_lookup(context, max_len, max_n, min_n).tokens


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup's proposal for one sequence, with what predicts whether the target will accept it."""

    tokens: list[int]  # what followed the latest earlier occurrence of the context's last n tokens
    match: int = 0  # tokens before the proposal that equal the context's end (the n-gram, extended backwards)
    split: bool = False  # the n-gram's two latest earlier occurrences were followed by different tokens

    def prior(self, num_drafts: int) -> list[float]:
        """P(slot j accepted | slots before it were), j = 1..num_drafts, for this match (``LOOKUP_FIRST``)."""
        b = lookup_bin(self.match)
        return [LOOKUP_FIRST[int(self.split)][b]] + [LOOKUP_NEXT[b]] * (num_drafts - 1)


def lookup_bin(match: int) -> int:
    """The index of a match length's bin in ``LOOKUP_FIRST`` / ``LOOKUP_NEXT`` (``LOOKUP_MATCH_BINS`` upper bounds)."""
    return next((i for i, top in enumerate(LOOKUP_MATCH_BINS) if match <= top), len(LOOKUP_MATCH_BINS))


MAX_MATCH = 32  # a match is extended backwards at most this far (the last bin of LOOKUP_MATCH_BINS starts at 20)


def ngram_lookup(context: Sequence[int], max_len: int, max_n: int = 3, min_n: int = 1) -> Lookup:
    """``ngram_continuation`` with its ``Lookup`` features: how far back the matched occurrence agrees with the
    context's end, and whether the n-gram's previous occurrence was followed by another token (host scans)."""
    size = len(context)
    for n in range(min(max_n, size - 1), max(min_n, 1) - 1, -1):
        tail = list(context[size - n:])
        latest = None
        for start in range(size - n - 1, -1, -1):
            if context[start] == tail[0] and list(context[start:start + n]) == tail:
                if latest is not None:
                    return Lookup(tokens, match, context[start + n] != tokens[0])
                latest, tokens = start, list(context[start + n:start + n + max_len])  # never empty: start + n < size
                match = n
                while match < MAX_MATCH and start - (match - n) > 0 and \
                        context[start - (match - n) - 1] == context[size - match - 1]:
                    match += 1
        if latest is not None:
            return Lookup(tokens, match)
    return Lookup([])


@dataclass
class Telemetry:
    """Where the time went and what was chosen, over a run (JSON results and Triton metrics)."""

    k_counts: dict[int, int] = field(default_factory=dict)  # chosen k -> rows·steps
    steps: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    overhead_s: float = 0.0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: steps whose draft j+1 was accepted
    ngram_steps: int = 0  # rows·steps that verified a prompt-lookup continuation
    ngram_accepted: int = 0  # tokens accepted from those
    tree_steps: int = 0  # steps that verified the tree (policy.tree_nodes > 0)

    def record(self, ks: Sequence[int], accepted: Sequence[int]) -> None:
        for k, a in zip(ks, accepted):
            self.k_counts[k] = self.k_counts.get(k, 0) + 1
            self.num_draft_tokens += k
            self.num_accepted_tokens += a
            if a > len(self.accepted_per_pos):
                self.accepted_per_pos += [0] * (a - len(self.accepted_per_pos))
            for j in range(a):
                self.accepted_per_pos[j] += 1

    def to_json(self) -> dict:
        total = self.draft_s + self.verify_s + self.overhead_s
        return {
            "k_distribution": {str(k): n for k, n in sorted(self.k_counts.items())},
            "steps": self.steps,
            "time_split": {"draft_s": round(self.draft_s, 4), "verify_s": round(self.verify_s, 4),
                           "overhead_s": round(self.overhead_s, 4),
                           "draft_fraction": round(self.draft_s / total, 4) if total else 0.0},
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "num_accepted_tokens_per_pos": self.accepted_per_pos,
            "ngram_steps": self.ngram_steps,
            "ngram_accepted_tokens": self.ngram_accepted,
            "tree_steps": self.tree_steps,
        }


# A row's tree estimate before its first tree step: this many times the tokens its chain plan expects. The tree's
# replayed τ over ``--ngram``'s with the shipped drafter and datastore (B = 16, all 164 HumanEval / 80 MT-Bench
# prompts; perf/results/tree/s25/): 4.32 / 2.64 = 1.64 and 2.52 / 1.82 = 1.38.
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
        # and a row's expectations are remembered until its counts or the prior change (perf/bench_policy.py,
        # perf/results/policy/: 0.58-0.59 -> 0.24-0.25 ms a step at b = 16, 66 -> 59-60 µs at b = 1)
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
        """What one row's leaving saves a plain step of ``rows`` rows, as a share of that step, by the cost model: on
        the 2-core CPU ~0.03 at batch 16 (a row adds ~1.5 ms to a ~75 ms step; session 29 guessed 0.25, and
        ``perf/policy_replay.py`` replays HumanEval at batch 16 1.064 -> 1.076 x autoregressive with this), on a
        GPU, where a batch's plain step costs about one row's, about 0."""
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
        ``drafter_prior`` (``prior``: it, computed once for a step's rows)."""
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
