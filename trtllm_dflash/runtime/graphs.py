"""CUDA graphs for the decode loop's fixed-shape forwards (``SpeculativeDecoder(cuda_graphs=True)``).

On a GPU a small model's eager step is paced by launching its kernels (over a thousand per forward) one by one from
Python, not by reading its weights from HBM (``docs/gpu.md`` has the measurement), and a DFlash step pays that for
the verify and again for the draft. A CUDA graph records a forward's kernels once and replays them with one
launch.

What a graph needs, and how the runtime provides it:
- **Fixed shapes and addresses.** A graph is captured per step shape (rows, tokens, all of the cache's rows or a
  selection of them) and per cache; its inputs (tokens, the selected rows' indices) are copied into the graph's own
  buffers before each replay and its outputs copied out after it (a clone: the next replay overwrites them). The
  decoder keeps its caches between ``generate`` calls (``StepGraphs.cache``, capacities rounded up to
  ``CACHE_BUCKET``), so the graphs captured for the first requests serve the later ones.
- **No host reads inside.** ``TargetModel.forward(static=True)``, ``DrafterModel.draft(static=True)`` and the plugin
  draft read no value back to the host: positions come from the cache's lengths on the device, and attention runs over
  all ``max_len`` slots of the cache with the uncommitted ones masked (a few hundred extra keys: free on a GPU, and the
  same keys a dynamic step masks). The decoder sized the cache, so the capacity check a dynamic step makes is its.
- **Warm-up before capture** on the side stream the capture then uses (CUDA's rule; it also compiles the Triton
  drafting kernels). Warm-up and capture write K/V only into the cache's scratch slots (past ``lengths``), which no
  committed state reads.

``mode``: ``"cuda"`` captures and replays; ``"rehearse"`` (any device; CI on the CPU) runs the same static forward
through the same input and output buffers on every call instead of replaying, so everything but the capture itself
is exercised where no GPU is (it computes a verify's padding, which the CPU's eager verify skips: a test mode, not a
CPU speed-up); ``"off"``: ``run`` calls the function directly. The step engines' graphs (``runtime/steps.py``, in
process and behind the Triton step models) cover the target's step forward (autoregressive, verify, tree verify) and
the draft pass; the prefill, the acceptance and the KV injection run eagerly.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Hashable

import torch

from trtllm_dflash.models.layers import KVCache

MODES = ("cuda", "rehearse", "off")
CACHE_BUCKET = 256  # a pooled cache's capacity: the tokens asked for rounded up to this (fewer distinct graphs)
MAX_CACHES = 4  # pooled caches per model; the least recently used goes, with its graphs
WARMUP_RUNS = 2


@dataclass
class _Step:
    inputs: tuple[torch.Tensor, ...]  # the graph's input buffers
    outputs: tuple[torch.Tensor | None, ...]  # its output buffers (None: an output the function did not produce)
    graph: "torch.cuda.CUDAGraph | None"  # None in "rehearse" mode
    fn: Callable[..., object]
    cache: KVCache  # held, so the cache (whose addresses the graph baked in) outlives the graph


def _as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class StepGraphs:
    """Captured step forwards, keyed by the caller (shape, cache, rows), and the caches they were captured over."""

    def __init__(self, mode: str = "cuda") -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        self.mode = mode
        self.steps: dict[Hashable, _Step] = {}
        self.caches: OrderedDict[tuple, KVCache] = OrderedDict()
        self.captures = 0  # graphs captured (or, rehearsing, step buffers made): telemetry and tests
        self.capture_s = 0.0  # seconds spent warming up and capturing (a benchmark's steady state excludes them)

    @classmethod
    def for_device(cls, device: torch.device, requested: "bool | str | StepGraphs") -> "StepGraphs | None":
        """``requested``: "auto" (the default everywhere: graphs on a CUDA device, none elsewhere), True or "on"
        (graphs on CUDA; an error elsewhere, where there is nothing to capture), "rehearse", or False / "off" (None:
        no graphs) — a ``--cuda-graphs`` choice passes as it is; a StepGraphs (one shared by the step engines of one
        decoder) is returned as it is."""
        if isinstance(requested, StepGraphs):
            return requested
        if requested == "auto":
            requested = "on" if torch.device(device).type == "cuda" else "off"
        if not requested or requested == "off":
            return None
        if requested == "rehearse":
            return cls("rehearse")
        if torch.device(device).type != "cuda":
            from trtllm_dflash.errors import ConfigError

            raise ConfigError("cuda_graphs", requested, f"needs a CUDA device, not {device}",
                              "use --device cuda, or drop --cuda-graphs")
        return cls("cuda")

    def cache(self, owner: str, make: Callable[[int, int], KVCache], rows: int, max_len: int) -> KVCache:
        """A cache of ``rows`` rows and at least ``max_len`` slots for ``owner`` ("target", "drafter"), emptied: the
        same object (and so the same graphs) for every later request of that size. Stale K/V past the lengths is
        scratch like any other."""
        size = -(-max_len // CACHE_BUCKET) * CACHE_BUCKET
        key = (owner, rows, size)
        cache = self.caches.pop(key, None)
        if cache is None:
            cache = make(rows, size)
            mine = [k for k in self.caches if k[0] == owner]
            if len(mine) >= MAX_CACHES:
                self.forget(self.caches.pop(mine[0]))
        self.caches[key] = cache  # most recently used last
        cache.lengths.zero_()
        return cache

    def forget(self, cache: KVCache) -> None:
        """Drop the graphs captured over ``cache``."""
        for key in [k for k, step in self.steps.items() if step.cache is cache]:
            del self.steps[key]

    def run(self, key: Hashable, cache: KVCache, fn: Callable[..., object], *inputs: torch.Tensor) -> tuple:
        """``fn(*inputs)`` (a static forward over ``cache``: its launches depend on the inputs' shapes only), through
        the step captured under ``key``; the outputs are fresh tensors. ``key`` must identify everything ``fn``
        closes over that changes what it launches (the cache, its arguments' shapes, which of them are None)."""
        if self.mode == "off":
            return _as_tuple(fn(*inputs))
        step = self.steps.get(key)
        if step is None:
            t0 = time.perf_counter()
            step = self.steps[key] = self._capture(fn, cache, inputs)
            self.capture_s += time.perf_counter() - t0
        else:
            for buf, x in zip(step.inputs, inputs):
                buf.copy_(x)
        if step.graph is None:
            step.outputs = _as_tuple(step.fn(*step.inputs))
        else:
            step.graph.replay()
        return tuple(None if o is None else o.clone() for o in step.outputs)

    def _capture(self, fn, cache: KVCache, inputs: tuple[torch.Tensor, ...]) -> _Step:
        buffers = tuple(x.clone() for x in inputs)
        self.captures += 1
        if self.mode == "rehearse":
            return _Step(buffers, (), None, fn, cache)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn(*buffers)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # captured on the warm-up's stream: libraries that cache a handle or workspace per stream (cuBLAS) made theirs
        # there, not inside the capture
        with torch.cuda.graph(graph, stream=side):
            outputs = _as_tuple(fn(*buffers))
        return _Step(buffers, outputs, graph, fn, cache)
