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

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trtllm_dflash.errors import ConfigError
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


# A float32 product of a few rows with a weight on a CPU runs weight-major, W · xᵀ: PyTorch's x · Wᵀ (``F.linear``, MKL
# on x86) takes about as long per row as a whole matrix-vector product for 2 or 3 rows (and for 7), and gains nothing
# from a second thread. On the 2-core AMD EPYC VM (``git show ede48fc:perf/bench_cpu_gemm.py``, ``perf/results/cpu-gemm/``), 2 threads:
# the 49,152 × 576 LM head over 1 / 2 / 3 / 8 / 16 rows 7.1 / 14.7 / 21.9 / 11.3 / 14.0 ms -> 2.9 / 3.1 / 3.7 / 6.3 /
# 11.7; a SmolLM2 verify forward of 1 / 4 tokens 43.3 / 56.1 -> 25.6 / 27.0 ms, of 16 rows × 1 token 78.8 -> 77.6; a
# one-row draft pass of 4 slots 28.2 -> 6.9 ms. One thread: verify of 1 / 4 tokens 41.0 / 53.6 -> 32.9 / 36.8 ms, but
# 8 rows were slower weight-major (a 1 × 8 verify 61 -> 66 ms), so one thread uses it up to 4 rows. Larger products,
# other dtypes (bf16 goes through oneDNN, already fast), autograd and other devices keep ``F.linear``.
# ``TRTLLM_DFLASH_CPU_GEMM=linear`` turns it off. The logits differ from ``F.linear``'s in the last bits (as they
# already differ between row counts); every path of the runtime goes through the same function.
CPU_WEIGHT_MAJOR = os.environ.get("TRTLLM_DFLASH_CPU_GEMM", "weight-major") != "linear"


def weight_major_rows(rows: int, threads: int) -> int:
    """The row count a CPU float32 product of ``rows`` rows is padded to when it runs weight-major (0: run
    ``F.linear``): rows as they are up to 8 (at least 2: one row alone is a slow matrix-vector product), above that
    a multiple of 8 (the weight-major time climbs from 9 to 15 rows and drops back at 16); up to 96 rows with two or
    more threads, up to 4 with one — but not 17 to 20 rows, where ``F.linear`` is the faster (a packed verify of 16
    rows and a few more tokens; on the 2-core CPU, the target's projections over 17 / 20 rows, all 30 layers, 41.2 /
    39.8 ms weight-major against 34.3 / 34.2 ms, and 29.8 against 44.6 at 16, ``perf/bench_cpu_gemm.py`` of ede48fc
    ``--threads 2 --parts products --rows 16,17,20,24,28``; the whole verify of 16 rows over 300 cached tokens with
    1 / 4 rows 2 wide 83.8, 78.8 / 82.6, 78.7 -> 76.2, 74.5 / 77.5, 75.6 ms, two interleaved runs; at 24 rows no
    gain)."""
    if rows <= 0 or rows > (4 if threads <= 1 else 96) or 16 < rows <= 20:
        return 0
    return max(rows, 2) if rows <= 8 else -(-rows // 8) * 8


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, same state dict) whose small float32 products on a CPU run weight-major
    (``CPU_WEIGHT_MAJOR``, ``weight_major_rows``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)``, weight-major where ``weight_major_rows`` says so: every product with a weight the
    runtime holds goes through here (``Linear``, and the Triton drafter's LM head, ``runtime.steps.BlockDrafter``)."""
    if not CPU_WEIGHT_MAJOR or x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 \
            or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad)):
        return F.linear(x, w, bias)
    flat = x.reshape(-1, x.shape[-1])
    m = flat.shape[0]
    rows = weight_major_rows(m, torch.get_num_threads())
    if rows == 0:
        return F.linear(x, w, bias)
    if rows > m:
        flat = torch.cat([flat, flat.new_zeros(rows - m, flat.shape[1])])
    out = torch.mm(w, flat.T)[:, :m].T.contiguous()
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], w.shape[0])


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
        dtype = x.dtype
        x = widen(x)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        whose per-layer slicing of the queries, masks and cache costs a one-row decode about 2 % on the 2-core CPU
        (perf/results/one-loop/2026-12-06)."""
        if rows is None or rows.device.type != "cpu" or len(rows) != self.num_rows:
            return rows
        return None if rows.tolist() == list(range(self.num_rows)) else rows

    @staticmethod
    def view_rows(rows: torch.Tensor | None, max_runs: int = 4) -> "torch.Tensor | list[tuple[slice, slice]] | None":
        """How ``attend`` reads the selected rows: ``rows`` on the host that form at most ``max_runs`` runs of
        consecutive cache rows in order (a served batch sorted by slot) as [(cache rows, batch rows)] slices, each
        read as a view; else unchanged (an index tensor copies the rows' K and V, every layer, every step: at 16
        rows × 300 tokens on a 2-core CPU, 89–168 ms a decode step against 70–83 ms through views)."""
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


def attention(
    q: torch.Tensor,  # [b, num_heads, S, head_dim]
    k: torch.Tensor,  # [b, num_kv_heads, L, head_dim]
    v: torch.Tensor,  # [b, num_kv_heads, L, head_dim]
    allowed: torch.Tensor,  # [b, S, L] bool: query may see key
    blocked: torch.Tensor | None = None,  # ~allowed, when the caller computed it once for several layers
) -> torch.Tensor:  # [b, S, num_heads * head_dim]
    """Masked GQA attention, written out: for the few query rows of a decode/verify/draft step this is several times
    faster on CPU than SDPA's fused kernel with an explicit mask. Query head h reads KV head h // (heads / kv_heads),
    as in HF's ``repeat_kv``; the group's queries are folded into the row dimension instead of repeating K/V."""
    b, h, s, d = q.shape
    kv = k.shape[1]
    g = h // kv
    qg = q.reshape(b, kv, g * s, d)  # [b, kv, g·S, d]: rows ordered (group member, query)
    blocked = ~allowed if blocked is None else blocked
    mask = blocked[:, None].expand(b, g, s, blocked.shape[-1]).reshape(b, 1, g * s, -1)  # [b, 1, g·S, L]
    if q.device.type == "cpu" and kv > 1 and (k.stride(0) != kv * k.stride(1) or v.stride(0) != kv * v.stride(1)):
        # K/V read from the cache as views ([b, kv, L, d] slices of its [rows, max_len, kv, d] layout): their (b, kv)
        # dimensions do not merge into one batch dimension, so a matmul over both would copy K and V whole, every
        # layer and step (a fifth of a 16-row decode step on a 2-core CPU); one KV head's [b, L, d] slice is a
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
