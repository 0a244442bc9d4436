"""Products with the runtime's weights, each run by the kernel measured fastest on the machine at hand.

A decode or verify step on a CPU is a few dozen products of a handful of rows with weights that do not fit in the
caches, so its time is the time to stream the weights once, and how close a kernel gets to that depends on the CPU,
the row count and the weight's shape. No threshold here is fixed: at the first product of a shape and a row bucket
on a machine, every candidate kernel is timed on random weights of that shape (enough copies to overflow the
last-level cache, so the timing streams from memory as the real step does) and the fastest is kept, cached on disk per
machine fingerprint (CPU model, threads, torch version) beside the cost model. ``trtllm-dflash tune`` measures a pair's
shapes ahead of time.

The candidates (float32 and bfloat16 on a CPU, inference only):

- ``linear``: ``F.linear`` (x · Wᵀ).
- ``weight-major``: W · xᵀ, at least two rows (one row alone would be a matrix-vector product).
- ``onednn``: oneDNN's matmul over a weight reordered once into its blocked layout
  (``torch.ops.mkldnn._reorder_linear_weight``, the prepacking inductor's freezing applies), kept beside the weight.
- ``packed`` (float32): this package's own kernel (``models.native``, built on the machine at hand) over a weight
  packed once in panels of 16 output features, kept beside the weight. It streams each weight once for up to a dozen
  rows, and an output rounds the same whatever the row count, so a verify row equals the same row decoded alone.

Every kernel computes the same product; results differ only in float rounding, as they already do between row counts.
Autograd, other devices and other dtypes run ``F.linear``. ``TRTLLM_DFLASH_CPU_GEMM=<kind>`` forces one kind
(``linear`` turns the choice off); ``auto`` (the default) measures.

Fused projections: ``project`` runs several products with one input (Q, K and V; gate and up) as one product over the
weights concatenated once (a derived copy beside the parameters: the checkpoint layout and the state dict are
unchanged), and splits the output into views.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

KINDS = ("linear", "weight-major", "onednn", "packed")
ENV = "TRTLLM_DFLASH_CPU_GEMM"
MAX_BUCKET = 1024  # rows beyond it use the choice made at it
TABLE_VERSION = 3  # raised when what a measurement times changes
_DTYPES = (torch.float32, torch.bfloat16)
_FLOP_BUDGET = 4e8  # floating-point work of one timed run, so a wide bucket's measurement stays short


GENERATION = 0  # raised when a table forgets its choices: every cached plan names the generation it was made in
_SETTING = os.environ.get(ENV, "auto")  # read once: an environment look-up per product costs more than a product
_FORCED = _SETTING if _SETTING in KINDS else None


def _check_setting() -> None:
    """A ``TRTLLM_DFLASH_CPU_GEMM`` that names no kind is refused at the first product (inside a command, whose
    errors exit 2 with this message), not at import."""
    if _SETTING != "auto" and _SETTING not in KINDS:
        from trtllm_dflash.errors import ConfigError

        raise ConfigError(ENV, _SETTING, f"is not one of auto, {', '.join(KINDS)}", "unset it or set one of those")


def forced_kind() -> str | None:
    """The kind ``TRTLLM_DFLASH_CPU_GEMM`` forces (read at import; ``forcing`` within a block), or None for
    ``auto``."""
    return _FORCED


@contextlib.contextmanager
def forcing(kind: str | None):
    """Within the block every product runs ``kind`` (None: the measured choice), whatever the environment says."""
    global _FORCED
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind {kind!r} is not one of {KINDS}")
    before, _FORCED = _FORCED, kind
    try:
        yield
    finally:
        _FORCED = before


PER_PRODUCT = "per-product"  # a step's choice: every product runs its own measured kind
_LOCAL = threading.local()  # the step kind of the forward this thread runs (``step_kind``)


@contextlib.contextmanager
def step_kind(kind: str | None):
    """Within the block, on this thread, every product runs ``kind`` (one of ``KINDS``): the kind measured fastest
    for a whole step (``step_choice``). ``PER_PRODUCT``: each product's own choice; None: as outside the block. A
    forced kind (``TRTLLM_DFLASH_CPU_GEMM``, ``forcing``) still wins."""
    if kind is None:  # nothing measured for this step: whatever an enclosing block says
        yield
        return
    before = getattr(_LOCAL, "kind", None)
    _LOCAL.kind = None if kind == PER_PRODUCT else kind
    try:
        yield
    finally:
        _LOCAL.kind = before


def step_entry(step: str, dtype: torch.dtype, rows: int) -> str:
    """The table's name for a whole step's choice: ``step`` names the model and pass (its shapes), ``rows`` the
    products' row count."""
    return f"step:{step}:{str(dtype).removeprefix('torch.')}:{bucket(rows)}"


def step_choice(step: str, dtype: torch.dtype, rows: int) -> str | None:
    """The kind ``tune`` measured fastest for a whole forward of this step and row bucket on this machine (a kind
    or ``PER_PRODUCT``), or None where it has not been measured: then each product runs its own choice.

    Products are chosen one shape at a time, each timed alone; inside a thirty-layer forward their ranking can
    differ (the kernels' threading, prefetching and cache state between products), and where kinds are close the
    per-product choices can mix into a slower step than any one kind. ``tune`` therefore times the forwards
    themselves under each kind and under the per-product choices, and keeps the fastest."""
    if _FORCED is not None or dtype not in _DTYPES:
        return None
    return table().choices.get(step_entry(step, dtype, rows))


def choose_step(step: str, dtype: torch.dtype, rows: int, forward: Callable[[], object], repeats: int = 5,
                calls: int = 2) -> str:
    """``step_choice`` for ``step`` at ``rows`` rows, measured now where the table has none: ``forward()`` (one whole
    step, its weights streamed from memory) timed under each kind and under the per-product choices, interleaved."""
    kinds = (PER_PRODUCT, *candidates(dtype))

    def under(kind: str) -> Callable[[], object]:
        def run_step():
            with step_kind(kind):
                return forward()
        return run_step

    return table().choose(step_entry(step, dtype, rows), lambda: fastest({k: under(k) for k in kinds}, repeats, calls))


def bucket(rows: int) -> int:
    """The row bucket a product of ``rows`` rows is chosen by: the next power of two, at most ``MAX_BUCKET``."""
    return min(1 << max(rows - 1, 0).bit_length(), MAX_BUCKET)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def last_level_cache_bytes() -> int:
    """The largest CPU cache's size from sysfs (the copies a measurement streams must overflow it); 64 MiB where it
    cannot be read."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        try:
            scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
            sizes.append(int(text.rstrip("KMG")) * scale)
        except (ValueError, OSError):
            continue
    return max(sizes) if sizes else 64 << 20


def prepare(kind: str, weight: torch.Tensor) -> torch.Tensor:
    """The form of ``weight`` that ``run(kind, ...)`` reads."""
    if kind == "onednn":
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
    if kind == "packed":
        from trtllm_dflash.models import native

        return native.pack(weight)
    return weight


def run(kind: str, x: torch.Tensor, prepared: torch.Tensor, bias: torch.Tensor | None,
        out_features: int | None = None) -> torch.Tensor:
    """x [m, in] times the weight (prepared for ``kind``) -> [m, out]. ``out_features``: the weight's rows, where
    ``packed`` padded them to whole panels (default: all of them)."""
    if kind == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, prepared, bias, "none", [], "")
    if kind == "packed":
        from trtllm_dflash.models import native

        out = native.packed_mm()(x, prepared)
        if out_features is not None and out_features != out.shape[1]:
            out = out[:, :out_features].contiguous()
        return out if bias is None else out.add_(bias)
    if kind == "weight-major":
        m = x.shape[0]
        if m < 2:
            x = torch.cat([x, x.new_zeros(2 - m, x.shape[1])])
        out = torch.mm(prepared, x.T)[:, :m].T.contiguous()
        return out if bias is None else out.add_(bias)
    return F.linear(x, prepared, bias)


def candidates(dtype: torch.dtype) -> tuple[str, ...]:
    forced = forced_kind()
    if forced is not None:
        return (forced,)
    return tuple(k for k in KINDS
                 if (k != "onednn" or onednn_available()) and (k != "packed" or packed_available(dtype)))


def packed_available(dtype: torch.dtype) -> bool:
    """Whether the ``packed`` kind runs here for ``dtype``: float32, with the kernel built for this machine."""
    from trtllm_dflash.models import native

    return dtype == torch.float32 and native.packed_mm() is not None


def measure(out_features: int, in_features: int, rows: int, dtype: torch.dtype, kinds: Sequence[str],
            repeats: int = 3) -> dict[str, float]:
    """Seconds of one product of ``rows`` rows with an [out, in] weight under each kind, the fastest of ``repeats``
    interleaved runs over enough distinct random weights to stream from memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = out_features * in_features * itemsize
    flops = 2.0 * out_features * in_features * max(rows, 1)
    copies = max(1, min(math.ceil(2 * last_level_cache_bytes() / nbytes), math.ceil(_FLOP_BUDGET / flops), 256))
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(out_features, in_features, generator=gen).to(dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    runs = {}
    with torch.inference_mode():
        for kind in kinds:
            try:
                forms = [prepare(kind, w) for w in weights]
                run(kind, x, forms[0], None)  # does this kind run here at all
            except (RuntimeError, NotImplementedError):
                continue
            runs[kind] = lambda kind=kind, forms=forms: [run(kind, x, w, None) for w in forms]
        return {kind: t / copies for kind, t in fastest(runs, repeats).items()}


def fastest(runs: dict[str, Callable[[], object]], repeats: int = 3, calls: int = 1) -> dict[str, float]:
    """Seconds of one call of each of ``runs``: after a warm-up, the fastest of ``repeats`` rounds of ``calls`` calls,
    the kinds interleaved round by round so that a drifting machine hits them alike."""
    best = {}
    with torch.inference_mode():
        for kind, fn in runs.items():
            fn()
            best[kind] = math.inf
        for _ in range(repeats):
            for kind, fn in runs.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn()
                best[kind] = min(best[kind], (time.perf_counter() - t0) / calls)
    return best


@functools.cache
def _cpu() -> str:
    from trtllm_dflash.hardware import cpu_model

    return cpu_model()


def fingerprint(threads: int | None = None) -> dict:
    """What a table's choices hold for: the CPU model, the thread count, torch's version and its oneDNN."""
    return {"cpu": _cpu(), "threads": torch.get_num_threads() if threads is None else threads,
            "torch": torch.__version__, "onednn": onednn_available(), "version": TABLE_VERSION}


class ProductTable:
    """The kind chosen for each (dtype, shape, row bucket) on one machine, measured on first use and kept in a JSON
    file keyed by ``fingerprint()`` (written atomically, merged with what other processes wrote meanwhile).

    ``epoch`` names the table's generation: made when the table is made, new when it forgets its choices or ``tune``
    records new ones (``renew``). What was measured through the table's kernels (the ``auto`` policy's cost model)
    is keyed by it, so it is measured again when the kernels it timed may have changed."""

    def __init__(self, path: Path | None, key: dict) -> None:
        self.path, self.key = path, key
        self.choices: dict[str, str] = {}
        self.timings: dict[str, dict[str, float]] = {}
        self.epoch: str | None = None
        self._file_epoch: str | None = None  # the epoch the file held when last read
        self._lock = threading.RLock()  # a whole step timed under it measures its products at first use
        self._read()
        self.epoch = self._file_epoch
        if self.epoch is None:
            try:
                self.renew()
            except OSError:  # a cache this process cannot write: the epoch lives in memory
                pass

    def renew(self) -> None:
        """A new epoch, written at once (the choices stay)."""
        with self._lock:
            self.epoch = secrets.token_hex(6)
            self._save(renewing=True)

    def forget(self) -> None:
        """Drop every choice, in memory and on disk, so that each is measured again at its next use."""
        with self._lock:
            self.choices.clear()
            self.timings.clear()
            if self.path is not None:
                self.path.unlink(missing_ok=True)
            self.epoch = secrets.token_hex(6)
            self._save(renewing=True)
        global GENERATION
        GENERATION += 1  # plans cached on weights and in layers.attention_kind are made again

    @staticmethod
    def entry(dtype: torch.dtype, out_features: int, in_features: int, rows: int) -> str:
        return f"{str(dtype).removeprefix('torch.')}:{out_features}x{in_features}:{bucket(rows)}"

    def _read(self) -> None:
        if self.path is None or not self.path.is_file():
            return
        try:
            doc = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return  # a foreign or torn file: measure again
        if doc.get("key") == self.key:
            self.choices.update({k: v for k, v in doc.get("choices", {}).items() if isinstance(v, str)})
            self.timings.update(doc.get("timings", {}))
            self._file_epoch = doc.get("epoch") if isinstance(doc.get("epoch"), str) else None

    def _save(self, renewing: bool = False) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        choices, timings = dict(self.choices), dict(self.timings)
        self._file_epoch = None
        self._read()  # keep what a concurrent process measured, and the epoch it made
        self.choices.update(choices)
        self.timings.update(timings)
        if not renewing and self._file_epoch is not None:
            self.epoch = self._file_epoch
        from trtllm_dflash.staging import write_atomic

        doc = {"key": self.key, "epoch": self.epoch, "choices": self.choices, "timings": self.timings}
        write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))

    def kind(self, dtype: torch.dtype, out_features: int, in_features: int, rows: int) -> str:
        forced = forced_kind()
        if forced is not None:
            return forced
        return self.choose(self.entry(dtype, out_features, in_features, rows),
                           lambda: measure(out_features, in_features, bucket(rows), dtype, candidates(dtype)))

    def choose(self, name: str, timings: Callable[[], dict[str, float]]) -> str:
        """The fastest kind for ``name``: from the table, else from ``timings()`` (seconds per kind), recorded."""
        found = self.choices.get(name)
        if found is not None:
            return found
        with self._lock:
            if name not in self.choices:
                measured = timings()
                self.timings[name] = {k: round(v, 9) for k, v in measured.items()}
                self.choices[name] = min(measured, key=measured.get)
                self._save()
        return self.choices[name]


_TABLES: dict[tuple[str, int], ProductTable] = {}


def table_path(key: dict) -> Path:
    from trtllm_dflash.staging import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cache_dir() / "products" / f"products-{digest}.json"


def table() -> ProductTable:
    """This machine's table at the current thread count, for the current model cache (one per process each)."""
    from trtllm_dflash.staging import cache_dir

    name = (str(cache_dir()), torch.get_num_threads())
    found = _TABLES.get(name)
    if found is None:
        key = fingerprint(name[1])
        found = _TABLES[name] = ProductTable(table_path(key), key)
    return found


def eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a product of ``x`` with ``weight`` goes through the table (a CPU inference product in a float dtype
    the candidates take); else it runs ``F.linear``."""
    return (_FORCED != "linear" and x.device.type == "cpu" and weight.device.type == "cpu"
            and x.dtype == weight.dtype and x.dtype in _DTYPES
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def stamp(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> tuple:
    """What tells a derived copy of these parameters stale: their identities and in-place versions (an inference
    tensor, made under torch.inference_mode, keeps no version counter: its identity stamps it)."""
    parts = [*weights, *(b for b in biases if b is not None)]
    return tuple([(id(p), -1 if p.is_inference() else p._version) for p in parts])


def _form(kind: str, weights: Sequence[torch.Tensor], stamped: tuple) -> torch.Tensor:
    """The weights joined along their outputs in ``kind``'s form, kept beside the first until the stamp changes."""
    forms = weights[0].__dict__.setdefault("_trtllm_dflash_forms", {})
    key = (kind if kind in ("onednn", "packed") else "plain", len(weights))  # linear and weight-major share one
    form = forms.get(key)
    if form is None or form[0] != stamped:
        plain = weights[0].detach() if len(weights) == 1 else torch.cat([w.detach() for w in weights])
        form = forms[key] = (stamped, prepare(kind, plain))
    return form[1]


def _joined_bias(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    if all(b is None for b in biases):
        return None
    return torch.cat([b.detach() if b is not None else w.new_zeros(w.shape[0]) for b, w in zip(biases, weights)])


def joined(weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None] | None = None,
           kind: str = "linear") -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weights joined along their outputs in ``kind``'s form, their biases joined or None): the copy ``project``
    reads for that kind, for code that runs its own products over it (``models.compiled``)."""
    biases = biases if biases is not None else (None,) * len(weights)
    return _form(kind, weights, stamp(weights, biases)), _joined_bias(weights, biases)


def _plan(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None], rows: int):
    """(kind, prepared weight, bias) of a product of ``rows`` rows with ``weights`` concatenated: cached on the first
    weight per (forced kind, threads, row bucket, its dtype and storage) until a weight or bias changes (identity or
    in-place version), so a step's products pay a dictionary look-up each, not a table query."""
    stamped = stamp(weights, biases)
    plans = weights[0].__dict__.setdefault("_trtllm_dflash_plans", {})
    step = getattr(_LOCAL, "kind", None)
    name = (_FORCED, step, GENERATION, torch.get_num_threads(), bucket(rows), len(weights), weights[0].dtype,
            weights[0].data_ptr())
    found = plans.get(name)
    if found is not None and found[0] == stamped:
        return found[1]
    _check_setting()
    out_features = sum(w.shape[0] for w in weights)
    kind = step if step is not None and _FORCED is None else table().kind(x.dtype, out_features, x.shape[-1], rows)
    plan = (kind, _form(kind, weights, stamped), _joined_bias(weights, biases), [w.shape[0] for w in weights],
            out_features)
    plans[name] = (stamped, plan)
    return plan


def project(x: torch.Tensor, weights: Sequence[torch.Tensor],
            biases: Sequence[torch.Tensor | None] | None = None) -> tuple[torch.Tensor, ...]:
    """``tuple(F.linear(x, w, b) for w, b in zip(weights, biases))``, as one product over the weights concatenated
    where the table runs it (CPU inference), the outputs views into its result."""
    biases = biases if biases is not None else (None,) * len(weights)
    if not all(eligible(x, w) for w in weights) or x.numel() == 0:
        return tuple(F.linear(x, w, b) for w, b in zip(weights, biases))
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    kind, prepared, bias, sizes, out_features = _plan(x, weights, biases, flat.shape[0])
    out = run(kind, flat, prepared, bias, out_features).view(*x.shape[:-1], out_features)
    return tuple(out.split_with_sizes(sizes, -1)) if len(sizes) > 1 else (out,)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` by the kernel the table chose for this shape and row count."""
    return project(x, (weight,), (bias,))[0]
