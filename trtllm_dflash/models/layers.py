"""Building blocks shared by the target and the drafter: RMSNorm, RoPE, SwiGLU MLP, a preallocated KV cache and one
masked attention function.

Cache model. A ``KVCache`` holds, per layer, K and V for ``num_rows`` sequences ("rows") in fixed slots
``[num_rows, max_len, num_kv_heads, head_dim]`` and a per-row ``lengths`` vector: the number of committed tokens. A
forward over ``S`` new tokens writes their K/V at positions ``lengths[row] + [0, S)`` but does **not** advance
``lengths``; the caller commits what it keeps (``commit``). Entries at or beyond ``lengths`` are therefore scratch:
every attention mask excludes keys that are not committed or part of the current step, so cropping a cache is just
not advancing (or lowering) ``lengths`` — no copy, and the result equals recomputation from scratch (tested).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.errors import ConfigError
from trtllm_dflash.models import products
from trtllm_dflash.models.products import linear, project
from trtllm_dflash.specs import RopeSpec


def widen(x: torch.Tensor) -> torch.Tensor:
    """The dtype to take statistics (norms, softmax) in: float32 for bf16/fp16, float32 and float64 unchanged. A cast
    here only ever widens, so the float64 oracle stays float64 on every CPU."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def stack_padded(xs: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """Tensors equal in shape but along ``dim`` (ragged rows: taps or K/V of several sequences) stacked into
    [len(xs), ...], zero-padded along ``dim`` to the longest; no padding copy when all are equally long."""
    width = max(x.shape[dim] for x in xs)
    if all(x.shape[dim] == width for x in xs):
        return torch.stack(xs)
    shape = list(xs[0].shape)
    shape[dim] = width
    out = xs[0].new_zeros([len(xs), *shape])
    for j, x in enumerate(xs):
        out[j].narrow(dim, 0, x.shape[dim]).copy_(x)
    return out


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose inference products on a CPU run by the kernel measured
    fastest on this machine for their shape and row count (``models.products``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def fused(x: torch.Tensor, *modules: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(m(x) for m in modules)`` (Q, K and V; gate and up), as one product over their weights concatenated when
    all are ``Linear`` without hooks (``products.project``); modules converted by another tool (``plain_linears``, a
    quantizer's wrappers) or observed through hooks each run their own forward."""
    if all(type(m) is Linear and not (m._forward_hooks or m._forward_pre_hooks) for m in modules):
        return project(x, [m.weight for m in modules], [m.bias for m in modules])
    return tuple(m(x) for m in modules)


def plain_linears(model: nn.Module) -> nn.Module:
    """``model`` with every ``Linear`` turned back into a plain ``nn.Linear`` in place (same parameters; ``Linear``
    adds no state): for tools that convert modules by their exact type — modelopt's ``mtq.quantize`` knows
    ``nn.Linear``, not a subclass, and quantizes nothing otherwise."""
    for module in model.modules():
        if type(module) is Linear:
            module.__class__ = nn.Linear
    return model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., dim]
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``RMSNorm`` as a function (the statistics in ``widen``'s dtype), for loops that run layers without their
    modules."""
    dtype = x.dtype
    x = widen(x)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = fused(x, self.gate_proj, self.up_proj)
        return self.down_proj(F.silu(gate) * up)


class Rotary:
    """cos/sin tables for absolute positions [0, max_positions), HF ``rotate_half`` convention."""

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype, device) -> None:
        inv_freq = torch.tensor(rope.inv_freq(head_dim), dtype=torch.float64)  # [head_dim/2]
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, inv_freq)  # [P, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, head_dim]
        self.cos = emb.cos().to(dtype=dtype, device=device)
        self.sin = emb.sin().to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def apply(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x: [b, S, heads, head_dim]; positions: [b, S] absolute token positions."""
        return self.at(positions).apply(x)

    def at(self, positions: torch.Tensor) -> "RopeAt":
        """The tables gathered once for ``positions`` [b, S], for every layer of a forward to apply."""
        half = self.cos.shape[-1] // 2
        sin = self.sin[positions].unsqueeze(2)  # [b, S, 1, head_dim]
        # rotate_half's negation folded into the table: (-x2)·s == x2·(-s) exactly, so results are bit-identical
        sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return RopeAt(self.cos[positions].unsqueeze(2), sin)


@dataclass
class RopeAt:
    """RoPE tables at one step's positions: ``cos`` and ``sin`` with rotate_half's sign folded in, [b, S, 1, head_dim].
    A 30-layer forward gathers them once instead of 60 times (on a GPU each gather, negation and concatenation is a
    kernel launch, and batch-1 decoding is bound by launches)."""

    cos: torch.Tensor
    sin: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:  # x: [b, S, heads, head_dim]
        half = x.shape[-1] // 2
        return x * self.cos + torch.cat((x[..., half:], x[..., :half]), dim=-1) * self.sin


@dataclass
class KVCache:
    """Per-layer K/V slots for ``num_rows`` sequences; see the module docstring for the commit/crop model."""

    k: torch.Tensor  # [num_layers, num_rows, max_len, num_kv_heads, head_dim]
    v: torch.Tensor  # [num_layers, num_rows, max_len, num_kv_heads, head_dim]
    lengths: torch.Tensor  # [num_rows] int64: committed tokens per row

    @classmethod
    def allocate(cls, num_layers, num_rows, max_len, num_kv_heads, head_dim, dtype, device) -> "KVCache":
        shape = (num_layers, num_rows, max_len, num_kv_heads, head_dim)
        return cls(
            k=torch.zeros(shape, dtype=dtype, device=device),
            v=torch.zeros(shape, dtype=dtype, device=device),
            lengths=torch.zeros(num_rows, dtype=torch.long, device=device),
        )

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def num_rows(self) -> int:
        return self.k.shape[1]

    def step_positions(self, rows: torch.Tensor | None, num_new: int, check: bool = True) -> torch.Tensor:
        """Absolute positions [b, num_new] of the next ``num_new`` tokens of each selected row (``check``: that they
        fit, which reads the lengths back to the host; a static step, ``runtime.graphs``, leaves that to its caller)."""
        lengths = self.lengths if rows is None else self.lengths[rows]
        pos = lengths[:, None] + torch.arange(num_new, device=lengths.device)  # [b, num_new]
        if num_new and check:
            self.require_capacity(int(pos.max()) + 1)
        return pos

    def require_capacity(self, num_slots: int) -> None:
        """A step that uses the first ``num_slots`` slots of a row must fit the cache."""
        if num_slots > self.max_len:
            raise ConfigError("sequence length", num_slots, f"exceeds the cache capacity ({self.max_len} tokens)",
                              "lower max_new_tokens or the prompt length")

    def row_index(self, rows: torch.Tensor | None) -> torch.Tensor:
        """[b, 1] cache rows for ``write`` (computed once per forward by the callers that write every layer)."""
        return (torch.arange(self.num_rows, device=self.lengths.device) if rows is None else rows)[:, None]

    def write(self, layer: int, rows: torch.Tensor | None, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              row_idx: torch.Tensor | None = None):
        """k, v: [b, S, num_kv_heads, head_dim] written at ``positions`` [b, S] of the selected rows (``row_idx``:
        ``row_index(rows)``, when the caller has it)."""
        row_idx = self.row_index(rows) if row_idx is None else row_idx
        self.k[layer][row_idx, positions] = k.to(self.k.dtype)
        self.v[layer][row_idx, positions] = v.to(self.v.dtype)

    def every_row(self, rows: torch.Tensor | None) -> torch.Tensor | None:
        """``rows``, or None where they are every row of the cache in order (a batch that fills its cache, as
        ``generate``'s does): the forwards then read the whole cache as it is instead of through ``view_rows``' runs,
        which slice the queries, masks and cache in every layer."""
        if rows is None or rows.device.type != "cpu" or len(rows) != self.num_rows:
            return rows
        return None if rows.tolist() == list(range(self.num_rows)) else rows

    @staticmethod
    def view_rows(rows: torch.Tensor | None, max_runs: int = 4) -> "torch.Tensor | list[tuple[slice, slice]] | None":
        """How ``attend`` reads the selected rows: ``rows`` on the host that form at most ``max_runs`` runs of
        consecutive cache rows in order (a served batch sorted by slot) as [(cache rows, batch rows)] slices, each
        read as a view; else unchanged (an index tensor copies the rows' K and V, every layer, every step, where a
        view reads them in place)."""
        if rows is None or rows.device.type != "cpu" or not len(rows):
            return rows
        r = rows.tolist()
        starts = [0] + [j for j in range(1, len(r)) if r[j] != r[j - 1] + 1] + [len(r)]
        if len(starts) - 1 > max_runs or any(b < a for a, b in zip(r, r[1:])):
            return rows
        return [(slice(r[a], r[a] + b - a), slice(a, b)) for a, b in zip(starts, starts[1:])]

    def attend(self, layer: int, q: torch.Tensor, rows, kv_len: int, allowed: torch.Tensor,
               blocked: torch.Tensor | None = None) -> torch.Tensor:
        """``attention`` of q [b, heads, S, head_dim] over the first ``kv_len`` cached slots of ``rows`` (None, an
        index tensor, or ``view_rows``' runs: each run attends over a view of its rows)."""
        if not isinstance(rows, list):
            k, v = self.read(layer, rows, kv_len)
            return attention(q, k, v, allowed, blocked)
        outs = []
        for cache_rows, batch in rows:
            k, v = self.read(layer, cache_rows, kv_len)  # a slice: views
            outs.append(attention(q[batch], k, v, allowed[batch], None if blocked is None else blocked[batch]))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def read(self, layer: int, rows: torch.Tensor | slice | None, kv_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V of the first ``kv_len`` slots of the selected rows, each [b, num_kv_heads, kv_len, head_dim] (copies
        for an index tensor, views for a slice)."""
        k, v = self.k[layer, :, :kv_len], self.v[layer, :, :kv_len]
        if rows is not None:
            k, v = k[rows], v[rows]
        return k.transpose(1, 2), v.transpose(1, 2)

    def commit(self, rows: torch.Tensor | None, num_tokens: torch.Tensor) -> None:
        """Advance the committed length of the selected rows by ``num_tokens`` [b]."""
        if rows is None:
            self.lengths += num_tokens
        else:
            self.lengths[rows] += num_tokens

    def crop(self, rows: torch.Tensor | None, lengths: torch.Tensor) -> None:
        """Roll the selected rows back to ``lengths`` [b] committed tokens."""
        if rows is None:
            self.lengths.copy_(lengths)
        else:
            self.lengths[rows] = lengths


class Packing:
    """The real tokens of a [b, S] forward whose rows hold only a prefix of their S slots (``widths`` [b]): a batched
    prefill of prompts of different lengths, right-padded to the longest, or on a CPU a verify step whose rows
    propose fewer tokens than the step's common width (``TargetModel.verify_widths``). The projections and MLPs
    (nearly all of a forward's time on a CPU) run over the ``sum(widths)`` real tokens only, as TensorRT-LLM does
    with ``remove_input_padding``; RoPE, the cache writes and attention keep the [b, S] layout (a padding slot's K/V
    lands in scratch past the row's real tokens, where no real query looks: the causal mask ends at each query)."""

    def __init__(self, widths: torch.Tensor, s: int, device) -> None:
        self.b, self.s = len(widths), s
        real = torch.arange(s)[None, :] < widths[:, None]  # [b, S]
        self.index = real.flatten().nonzero().squeeze(1).to(device)  # [N] flat positions of the real tokens

    @classmethod
    def of(cls, widths: torch.Tensor | None, s: int, device) -> "Packing | None":
        """A packing when some row is shorter than ``s``, else None (nothing to skip). ``widths`` is read on the
        host (the caller knows its rows' lengths): deciding and indexing cost no device sync."""
        if widths is None:
            return None
        widths = widths.cpu()
        return cls(widths, s, device) if int(widths.min()) < s else None

    def pack(self, x: torch.Tensor) -> torch.Tensor:  # [b, S, f] -> [N, f]
        return x.reshape(self.b * self.s, -1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:  # [N, f] -> [b, S, f], zeros in the padding
        out = x.new_zeros(self.b * self.s, x.shape[-1])
        return out.index_copy_(0, self.index, x).view(self.b, self.s, -1)


ATTENTION_KINDS = ("explicit", "sdpa")


def attention(
    q: torch.Tensor,  # [b, num_heads, S, head_dim]
    k: torch.Tensor,  # [b, num_kv_heads, L, head_dim]
    v: torch.Tensor,  # [b, num_kv_heads, L, head_dim]
    allowed: torch.Tensor,  # [b, S, L] bool: query may see key
    blocked: torch.Tensor | None = None,  # ~allowed, when the caller computed it once for several layers
) -> torch.Tensor:  # [b, S, num_heads * head_dim]
    """Masked GQA attention: query head h reads KV head h // (heads / kv_heads), as in HF's ``repeat_kv``. A CPU
    inference step in float32 or bfloat16 runs the kernel measured faster on this machine for its shape
    (``attention_kind``): PyTorch's fused ``scaled_dot_product_attention`` or the softmax written out; every other
    case (float64, the oracle; autograd; other devices) runs the written-out form."""
    b, h, s, d = q.shape
    if attention_kind(q, k) == "sdpa":
        out = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=allowed[:, None],
                                             enable_gqa=h != k.shape[1])
        return out.transpose(1, 2).reshape(b, s, h * d)
    return explicit_attention(q, k, v, allowed, blocked)


def attention_kind(q: torch.Tensor, k: torch.Tensor) -> str:
    """``explicit`` or ``sdpa`` for a CPU inference step of q's shape: measured once per (dtype, heads, rows bucket,
    query bucket) on this machine (``products.table``) over a 512-slot cache; ``explicit`` wherever the choice does
    not apply."""
    if (q.device.type != "cpu" or q.dtype not in (torch.float32, torch.bfloat16) or products.forced_kind() == "linear"
            or (torch.is_grad_enabled() and q.requires_grad)):
        return "explicit"
    b, h, s, d = q.shape
    kv = k.shape[1]
    rows, queries = products.bucket(b), products.bucket(s)
    name = f"attention:{str(q.dtype).removeprefix('torch.')}:{h}x{kv}x{d}:{rows}x{queries}"
    key = (name, torch.get_num_threads(), products.GENERATION)
    plans = _ATTENTION_PLANS.get(key)
    if plans is None:
        plans = _ATTENTION_PLANS[key] = products.table().choose(
            name, lambda: _measure_attention(rows, h, kv, queries, d, q.dtype))
    return plans


_ATTENTION_PLANS: dict[tuple[str, int, int], str] = {}


def _measure_attention(b: int, h: int, kv: int, s: int, d: int, dtype: torch.dtype, slots: int = 512,
                       repeats: int = 3, calls: int = 10) -> dict[str, float]:
    """Seconds of one attention call of each kind over K/V read from a cache laid out as ``KVCache``'s, causal."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, b, slots, kv, d, generator=gen).to(dtype)
    k, v = cache[0].transpose(1, 2), cache[1].transpose(1, 2)
    q = torch.randn(b, h, s, d, generator=gen).to(dtype)
    pos = torch.arange(slots - s, slots)[None].expand(b, s)
    allowed = torch.arange(slots)[None, None, :] <= pos[:, :, None]
    blocked = ~allowed
    runs = {"explicit": lambda: explicit_attention(q, k, v, allowed, blocked),
            "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None], enable_gqa=h != kv)}
    return products.fastest(runs, repeats, calls)


def explicit_attention(q, k, v, allowed, blocked=None) -> torch.Tensor:
    """``attention`` with the softmax written out; the group's queries are folded into the row dimension instead of
    repeating K/V."""
    b, h, s, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = q.reshape(b, kv, g * s, d)  # [b, kv, g·S, d]: rows ordered (group member, query)
    blocked = ~allowed if blocked is None else blocked
    mask = blocked[:, None].expand(b, g, s, blocked.shape[-1]).reshape(b, 1, g * s, -1)  # [b, 1, g·S, L]
    if q.device.type == "cpu" and kv > 1 and (k.stride(0) != kv * k.stride(1) or v.stride(0) != kv * v.stride(1)):
        # K/V read from the cache as views ([b, kv, L, d] slices of its [rows, max_len, kv, d] layout): their (b, kv)
        # dimensions do not merge into one batch dimension, so a matmul over both would copy K and V whole, every
        # layer and step; one KV head's [b, L, d] slice is a
        # strided view a batched GEMM reads in place
        out = torch.stack([_attend(qg[:, j], k[:, j], v[:, j], mask[:, 0]) for j in range(kv)], 1)
    else:
        out = _attend(qg, k, v, mask)  # [b, kv, g·S, d]
    return out.view(b, kv, g, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h * d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ / √d, masked) v over the trailing two dimensions (leading ones batched, ``mask`` broadcast)."""
    scores = torch.matmul(q, k.to(q.dtype).transpose(-1, -2)) * q.shape[-1] ** -0.5
    probs = torch.softmax(widen(scores).masked_fill(mask, float("-inf")), dim=-1).to(q.dtype)
    return torch.matmul(probs, v.to(q.dtype))
