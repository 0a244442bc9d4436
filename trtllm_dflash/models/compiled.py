"""The target's one-token step compiled, for CPUs: the decoder layers of a decode step (each row's next token) as
TorchInductor graphs with a C++ wrapper, so that no Python runs between the operators of a graph.

A decode step of a small model on a CPU streams the weights once through a few dozen products, and between them
runs a few hundred small operators (norms, RoPE, attention over the cache, residual adds) that each cost more to
dispatch from Python than to compute. Compiled, the small operators fuse into generated loops run from C++; the
products stay kernel calls in one of the forms ``models.products`` measures: ``torch.mm`` as weight-major W·xᵀ (one
row padded to two columns) or x·Wᵀ, or the package's ``packed`` kernel over weights packed in panels, which the
generated C++ calls through the dispatcher.

The graphs are pure: they read the cache and return the step's new K/V, which the caller writes into the cache for
all layers at once (``KVCache``'s layout is one five-dimensional tensor, and a write into a view of it inside a graph
makes the compiler copy the whole cache). Attention runs over each row's committed keys (masked past the row's
length) and the new token's own key. One graph covers a group of consecutive layers and serves every group
(``CompiledDecode``). Shapes are dynamic (rows, cached length); the compiler still specialises a graph to one row or
several and to where in the cache the rows start, so a process compiles up to four variants, each at its first step:
from TorchInductor's on-disk cache where ``trtllm-dflash tune --compile`` filled it
(``$TRTLLM_DFLASH_CACHE/inductor``), otherwise from scratch, which on a CPU takes far longer than a request.

Numerics: the mathematics of the eager forward in float32, with the float rounding of fused loops: outputs stay
token-identical to autoregressive decoding wherever the top two logits are further apart than float32's rounding, as
between any two kernels (tested on the real model).

``TRTLLM_DFLASH_COMPILED_STEP``: ``auto`` (the default) runs the compiled step where ``tune --compile`` timed it, in
one of its product forms, faster than the eager step on this machine, for this model (the product table records the
winner); ``on`` compiles at the first step regardless (the recorded form, else weight-major); ``off`` never.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

ENV = "TRTLLM_DFLASH_COMPILED_STEP"
SETTINGS = ("auto", "on", "off")
MOST_LAYERS = 10  # layers of one compiled graph at most (``CompiledDecode``)
_FORCED: tuple[str | None, str | None] = (None, None)


@contextlib.contextmanager
def forcing(value: str | None, form: str | None = None):
    """Within the block the compiled step is ``value`` (``on``, ``off``, ``auto``; None: as the environment says)
    whatever the environment says, and its products take ``form`` (one of ``FORMS``; None: the recorded one):
    ``tune --compile`` compiles and times each."""
    global _FORCED
    before, _FORCED = _FORCED, (value, form)
    try:
        yield
    finally:
        _FORCED = before


def forced_form() -> str | None:
    return _FORCED[1]


def setting() -> str:
    """``TRTLLM_DFLASH_COMPILED_STEP`` (or ``forcing``'s value); a value that names no setting is a ConfigError."""
    value = _FORCED[0] or os.environ.get(ENV, "auto")
    if value not in SETTINGS:
        from trtllm_dflash.errors import ConfigError

        raise ConfigError(ENV, value, f"is not one of {', '.join(SETTINGS)}", "unset it or set one of those")
    return value


def inductor_cache() -> None:
    """TorchInductor's on-disk cache beside the model cache (kept per machine with the product table), unless the
    environment names one."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        from trtllm_dflash.staging import cache_dir

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


FORMS = ("weight-major", "linear", "packed")  # the products' forms a graph can call (``_product``)


def forms() -> tuple[str, ...]:
    """The forms that run here: ``packed`` where the machine has its kernel (``products.packed_available``)."""
    from trtllm_dflash.models import products

    return tuple(f for f in FORMS if f != "packed" or products.packed_available(torch.float32))


NATIVE = "native"  # the decode engine that is one call of the package's C++ step (``NativeDecode``)
NATIVE_MOST_TOKENS = 64  # the widest forward (tokens in all) the native engine is offered for: a step, not a prefill


def engines() -> tuple[str, ...]:
    """The decode engines that run here: a compiled step in each of ``forms()``, and ``native`` where the package's
    CPU library builds (``models.native``)."""
    from trtllm_dflash.models import native

    return forms() + ((NATIVE,) if native.decode_step() is not None else ())


def _product(x: torch.Tensor, w: torch.Tensor, form: str, out: int) -> torch.Tensor:
    """x [b, in] times the weight w of ``out`` output features -> [b, out]: ``weight-major`` W·xᵀ (one row padded to
    two columns), ``linear`` x·Wᵀ, or ``packed`` (w packed in panels, ``models.native``), the forms of
    ``models.products`` a compiled graph calls without Python (oneDNN's prepacked product is not one: its lowering
    takes no prepacked weight as an input)."""
    if form == "packed":
        return torch.ops.trtllm_dflash_cpu.packed_mm(x, w)[:, :out]
    if form == "linear":
        return torch.mm(x, w.T)
    if x.shape[0] == 1:
        return torch.mm(w, torch.cat([x, torch.zeros_like(x)]).T)[:, :1].T
    return torch.mm(w, x.T).T


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * sin


class DecodeLayer(NamedTuple):
    """One decoder layer's parameters as the graph reads them: the projections that share an input joined."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    qkv: torch.Tensor  # [q; k; v] weights joined (in the step's product form)
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: torch.Tensor  # [gate; up] joined
    down: torch.Tensor


class Shape(NamedTuple):
    """What a compiled step is specialised to (the graph's constants)."""

    heads: int
    kv_heads: int
    head_dim: int
    eps: float
    product: str  # one of ``FORMS``


def decode_layer(shape: Shape, p: DecodeLayer, x, cos, sin, cache_k, cache_v, n: int, blocked):
    """One decoder layer over one token per row: the graph each layer's step runs (the layers share it, their
    parameters being its inputs).

    x [b, hidden] the residual stream; cos, sin [b, 1, head_dim] RoPE at the new tokens' positions (sign folded in,
    ``layers.RopeAt``); cache_k, cache_v the layer's cache rows of the step [b, max_len, kv, d], their first ``n``
    slots the keys; blocked [b, 1, 1, n] the slots past each row's committed tokens. Returns (the layer's output
    [b, hidden], the new token's K and V [b, kv, d])."""
    b = x.shape[0]
    heads, kv_heads, d, eps, form = shape
    hidden = x.shape[1]
    qkv = _product(_rms(x, p.norm1, eps), p.qkv, form, (heads + 2 * kv_heads) * d)
    if p.qkv_bias is not None:
        qkv = qkv + p.qkv_bias
    q, k, v = qkv.split_with_sizes([heads * d, kv_heads * d, kv_heads * d], -1)
    q, k, v = q.reshape(b, heads, d), k.reshape(b, kv_heads, d), v.reshape(b, kv_heads, d)
    if p.q_norm is not None:
        q, k = _rms(q, p.q_norm, eps), _rms(k, p.k_norm, eps)
    q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    ck = cache_k[:, :n].transpose(1, 2)  # [b, kv, n, d]
    cv = cache_v[:, :n].transpose(1, 2)
    qg = q.reshape(b, kv_heads, heads // kv_heads, d)
    scale = d ** -0.5
    scores = torch.matmul(qg, ck.transpose(-1, -2)) * scale  # [b, kv, group, n]
    own = (qg * k[:, :, None, :]).sum(-1, keepdim=True) * scale  # [b, kv, group, 1]: the token's own key
    probs = torch.softmax(torch.cat([scores.masked_fill(blocked, float("-inf")), own], -1), dim=-1)
    out = torch.matmul(probs[..., :n], cv) + probs[..., n:] * v[:, :, None, :]  # [b, kv, group, d]
    x = x + _product(out.reshape(b, heads * d), p.o, form, hidden)
    inner = p.down.shape[1]  # the down projection's inputs, in every form
    gate, up = _product(_rms(x, p.norm2, eps), p.gate_up, form, 2 * inner).chunk(2, -1)
    return x + _product(F.silu(gate) * up, p.down, form, hidden), k, v


def decode_layers(shape: Shape, layers: list[DecodeLayer], x, cos, sin, caches_k, caches_v, n: int, blocked):
    """``decode_layer`` through consecutive layers (their caches ``caches_k``, ``caches_v``) -> (each layer's
    output, the new K and V stacked [len(layers), b, kv, d])."""
    outs, new_k, new_v = [], [], []
    for p, cache_k, cache_v in zip(layers, caches_k, caches_v):
        x, k, v = decode_layer(shape, p, x, cos, sin, cache_k, cache_v, n, blocked)
        outs.append(x)
        new_k.append(k)
        new_v.append(v)
    return outs, torch.stack(new_k), torch.stack(new_v)


def group_size(num_layers: int, most: int) -> int:
    """The layers of one compiled graph: ``num_layers`` split into as few equal groups of at most ``most`` as
    divide it (one graph then serves every group)."""
    for groups in range(-(-num_layers // most), num_layers + 1):
        if num_layers % groups == 0:
            return num_layers // groups
    return 1


class CompiledDecode:
    """A target's compiled decode step: ``decode_layers`` over ``group`` layers compiled once per ``Shape`` (at its
    first call) and run for each group of layers in turn; the new K/V of every layer are written into the cache
    together after the last.

    A graph of all the layers runs fastest (nothing but C++ between the first operator and the last), but its
    compilation time grows with it. One layer a graph compiles quickly, but each call of a compiled function pays
    its dispatch (guards, argument handling) once per layer. Groups of a few
    layers keep both small."""

    consecutive = True  # the rows of a step are one run of cache rows, from ``first_row``

    def __init__(self, num_layers: int, form: str) -> None:
        self.group = group_size(num_layers, MOST_LAYERS)
        self.form = form
        self.failed: str | None = None  # why compiling or running it failed: the process then decodes eagerly
        self.graphs: dict[Shape, Callable] = {}
        self.seconds: dict[tuple[Shape, int, int], float] = {}  # the first step of each row count and first row
        self.steps = 0

    def graph(self, shape: Shape) -> Callable:
        fn = self.graphs.get(shape)
        if fn is None:
            inductor_cache()

            def layers_step(*inputs):
                return decode_layers(shape, *inputs)

            fn = self.graphs[shape] = torch.compile(layers_step, dynamic=True, fullgraph=True,
                                                    options={"cpp_wrapper": True})
        return fn

    def __call__(self, shape: Shape, layers: list[DecodeLayer], x, cos, sin, cache, first_row: int, lengths, n: int):
        """The decoder layers over one token per row (x [b, hidden] embedded, the rows ``first_row + [0, b)`` of
        ``cache`` holding ``lengths`` [b] committed tokens, at most ``n``) -> every layer's output [b, hidden]; the
        new tokens' K/V are written into the cache at their positions."""
        fn = self.graph(shape)
        started = time.perf_counter()
        b = x.shape[0]
        blocked = torch.arange(n, device=x.device)[None, None, None, :] >= lengths[:, None, None, None]
        g = self.group
        outs, new_k, new_v = [], [], []
        for i in range(0, len(layers), g):
            caches_k = [cache.k[j, first_row:first_row + b] for j in range(i, i + g)]
            caches_v = [cache.v[j, first_row:first_row + b] for j in range(i, i + g)]
            group_outs, k, v = fn(layers[i:i + g], x, cos, sin, caches_k, caches_v, n, blocked)
            x = group_outs[-1]
            outs += group_outs
            new_k.append(k)
            new_v.append(v)
        index = (slice(None), torch.arange(first_row, first_row + b), lengths)
        cache.k[index] = torch.cat(new_k)
        cache.v[index] = torch.cat(new_v)
        self.seconds.setdefault((shape, b, first_row), time.perf_counter() - started)
        self.steps += 1
        return outs


class NativeDecode:
    """A target's forward over a few new tokens as one call of the package's C++ step (``decode_step.cpp``): every
    layer's norms, products (the packed kernel), RoPE, attention over the cache and cache writes, with no Python,
    dispatcher or temporary tensor between them, and nothing to compile beyond the library itself (seconds, once per
    machine). It serves decode steps (one token per row, any cache rows) and plain causal verify steps (a few tokens
    per row); a token rounds the same whatever else the call holds, so a verify step's tokens are bit for bit the same
    tokens decoded one at a time."""

    form = NATIVE
    consecutive = False  # any cache rows (``CompiledDecode``'s graphs take one run of them)

    def __init__(self) -> None:
        self.failed: str | None = None
        self.steps = 0

    def __call__(self, shape: Shape, layers: list[DecodeLayer], x, cos, sin, cache, rows, slots_at,
                 final_norm: torch.Tensor | None = None):
        """x [N, hidden] the new tokens embedded, cos and sin [N, ..., head_dim] RoPE at their positions, token t at
        slot ``slots_at[t]`` of cache row ``rows[t]`` (attending to that row's slots up to its own) -> every layer's
        output [N, hidden], then (``final_norm``: the model's final norm weight) the last one normed; the tokens' K/V
        are written into the cache at their slots."""
        from trtllm_dflash.models import native

        none = x.new_empty(0)
        flat = []
        for p in layers:
            flat += [p.norm1, p.norm2, p.qkv, none if p.qkv_bias is None else p.qkv_bias, p.o,
                     none if p.q_norm is None else p.q_norm, none if p.k_norm is None else p.k_norm, p.gate_up, p.down]
        n = x.shape[0]
        outs = native.decode_step()(x, cos.reshape(n, -1), sin.reshape(n, -1), flat, cache.k, cache.v, rows, slots_at,
                                    none if final_norm is None else final_norm, shape.heads, shape.kv_heads, shape.eps)
        self.steps += 1
        return outs.unbind(0)
