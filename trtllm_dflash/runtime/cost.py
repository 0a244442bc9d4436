"""The cost model of ``--block-size auto``: what one verify forward and one draft pass cost on this device.

(``CostModel``): seconds of one verify forward and of one draft pass as piecewise-linear functions
of the tokens they process (all rows together, so a batch pays the verify once per step), measured on the device
by a short calibration, cached on disk keyed by device, dtype, threads and model, and pulled toward the step times
actually observed. The verify curve is timed without context; attending over the rows' cached tokens adds α per
row and β per verified token for each context token (``CostModel.context``, calibrated by timing the same shapes
over an empty and a filled cache): without it a batch's K = 0 step, which reads all its rows' K/V, would look as
cheap as one row's, and once observed at its true price the curve's flat segment above it would make K = 1 look free.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from trtllm_dflash.assets import cache_dir
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
        # factor of MAX_STEP_RATIO (a served verify that queues behind other requests' prefills takes many times its
        # own work, and one such step unbounded would make every width look as dear as the widest, so that the policy
        # verified wide blocks always)
        ratio = min(max(seconds / predicted, 1 / MAX_STEP_RATIO), MAX_STEP_RATIO)
        values[i] *= 1 + alpha * (1 - w) * (ratio - 1)
        # every point above n moves by the estimate's change at n, keeping what each further token costs: a served
        # step's time includes a cost per call (the BLS round trip, the step barrier) that wider verifies pay too.
        # Moved only locally and then kept monotone, observations of narrow served verifies only (a served step well
        # above its calibrated cost) would raise the wider points to that same time: a wider verify for the whole
        # batch would look free, and the served loop would verify prompt lookup's proposals at several times a plain
        # step's compute.
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
        from trtllm_dflash.staging import write_atomic

        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(self.to_json(), indent=1))


def device_name(device) -> str:
    """The hardware behind a torch device: the GPU's name, or the CPU's model name."""
    import torch

    if getattr(device, "type", str(device)) == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


# Raised when what a calibration times changes, so caches written before are calibrated again (it now times the
# kernels and attention ``models.products`` chooses per machine, with fused projections).
CALIBRATION_VERSION = 4


def cost_key(device: str, dtype: str, threads: int, model: str, kernels: str | None = None) -> dict:
    """What a calibration holds for. ``kernels``: the epoch of the CPU product table whose kernels it timed
    (``models.products.ProductTable.epoch``), so a table measured again, or tuned, is calibrated against anew."""
    key = {"device": device, "dtype": dtype, "threads": threads, "model": model, "version": CALIBRATION_VERSION}
    return key if kernels is None else {**key, "kernels": kernels}


def cache_path(key: dict, root: Path | None = None) -> Path:
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
    its rows cancels out of β. (One row of ``rows`` tokens as the second probe would put that share into β, which
    then disagrees with β fitted over many shapes.)"""
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
