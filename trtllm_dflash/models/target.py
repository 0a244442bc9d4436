"""The target model: a compact Llama / Qwen3 decoder that loads Hugging Face safetensors unchanged (same parameter
names, ``model.`` prefix and all), runs over a preallocated ``KVCache`` and taps hidden states for the drafter.

Taps: ``forward(..., tap_layers=(i, j, ...))`` returns the concatenated outputs of decoder layers i, j, ... — the
residual stream after each layer, before the final norm; ``hidden_states[i + 1]`` in HF terms (specs.py).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

import torch.nn.functional as F

from trtllm_dflash.models.layers import MLP, KVCache, Linear, Packing, RMSNorm, RopeAt, Rotary, fused, rms_norm
from trtllm_dflash.models import compiled, products
from trtllm_dflash.models.products import linear, project
from trtllm_dflash.models.weights import load_into, read_state_dict
from trtllm_dflash.specs import TargetSpec

SCRATCH_POSITIONS = 1024  # rotary rows past the context limit, for a block's scratch slots


class TargetAttention(nn.Module):
    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=spec.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=spec.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=spec.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)
        if spec.qk_norm:
            self.q_norm = RMSNorm(d, spec.rms_norm_eps)
            self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def forward(self, x, rope: RopeAt, slots, cache: KVCache, layer: int, rows, row_idx, allowed, blocked, kv_len,
                packing: Packing | None = None):
        # x: [b, S, hidden], or [N, hidden] the real tokens of a ``packing``
        q, k, v = fused(x, self.q_proj, self.k_proj, self.v_proj)
        if packing is not None:
            q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
        b, s = q.shape[:2]
        q = q.view(b, s, self.num_heads, self.head_dim)
        k = k.view(b, s, self.num_kv_heads, self.head_dim)
        v = v.view(b, s, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q), rope.apply(k)
        cache.write(layer, rows, slots, k, v, row_idx)  # slots: the tokens' positions, but in a runtime.tree step
        out = cache.attend(layer, q.transpose(1, 2), rows, kv_len, allowed, blocked)  # [b, S, heads * head_dim]
        return self.o_proj(out if packing is None else packing.pack(out))


class TargetLayer(nn.Module):
    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        self.self_attn = TargetAttention(spec)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(self, x, *args):
        x = x + self.self_attn(self.input_layernorm(x), *args)
        return x + self.mlp(self.post_attention_layernorm(x))


class BoundLayer(NamedTuple):
    """One decoder layer's parameters as the flat loop reads them (``bind_layers``)."""

    norm1: torch.Tensor
    norm2: torch.Tensor
    eps: float
    qkv: tuple[torch.Tensor, ...]
    qkv_bias: tuple[torch.Tensor | None, ...]
    o: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    gate_up: tuple[torch.Tensor, torch.Tensor]
    down: torch.Tensor
    heads: tuple[int, int, int]  # query heads, KV heads, head dim


def _plain(*modules: nn.Module) -> bool:
    return not any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def bind_layers(layers: nn.ModuleList) -> list[BoundLayer] | None:
    """The layers' parameters for ``TargetModel``'s flat loop, read afresh each forward (a weight replaced or loaded
    is seen at once), or None where the loop must call every module: a hook on any of them (global ones too), or a
    projection that is not this package's ``Linear`` (a quantizer's or ``plain_linears``' conversion). The flat loop
    runs the same operators in the same order as the modules' forwards; it saves their calls and attribute look-ups,
    which in a one-token step of a small model add up to a share of the time the products take."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return None
    bound = []
    for layer in layers:
        mods = layer._modules
        attn, mlp, n1, n2 = mods["self_attn"], mods["mlp"], mods["input_layernorm"], mods["post_attention_layernorm"]
        am, mm = attn._modules, mlp._modules
        q, k, v, o, gate, up, down = am["q_proj"], am["k_proj"], am["v_proj"], am["o_proj"], mm["gate_proj"], \
            mm["up_proj"], mm["down_proj"]
        qn, kn = am.get("q_norm"), am.get("k_norm")
        norms = (n1, n2) if qn is None else (n1, n2, qn, kn)
        linears = (q, k, v, o, gate, up, down)
        if not (all(type(m) is Linear for m in linears) and _plain(layer, attn, mlp, *norms, *linears)
                and all(type(n) is RMSNorm and n.eps == n1.eps for n in norms)):
            return None
        bound.append(BoundLayer(
            n1._parameters["weight"], n2._parameters["weight"], n1.eps,
            (q._parameters["weight"], k._parameters["weight"], v._parameters["weight"]),
            (q._parameters["bias"], k._parameters["bias"], v._parameters["bias"]),
            o._parameters["weight"],
            None if qn is None else qn._parameters["weight"], None if kn is None else kn._parameters["weight"],
            (gate._parameters["weight"], up._parameters["weight"]), down._parameters["weight"],
            (attn.num_heads, attn.num_kv_heads, attn.head_dim)))
    return bound


def flat_layer(p: BoundLayer, x, rope: RopeAt, slots, cache: KVCache, layer: int, rows, row_idx, allowed, blocked,
               kv_len, packing: Packing | None = None):
    """``TargetLayer.forward`` over its bound parameters: the same operators in the same order, bit for bit."""
    q, k, v = project(rms_norm(x, p.norm1, p.eps), p.qkv, p.qkv_bias)
    if packing is not None:
        q, k, v = packing.unpack(q), packing.unpack(k), packing.unpack(v)
    b, s = q.shape[:2]
    heads, kv_heads, d = p.heads
    q, k, v = q.view(b, s, heads, d), k.view(b, s, kv_heads, d), v.view(b, s, kv_heads, d)
    if p.q_norm is not None:
        q, k = rms_norm(q, p.q_norm, p.eps), rms_norm(k, p.k_norm, p.eps)
    q, k = rope.apply(q), rope.apply(k)
    cache.write(layer, rows, slots, k, v, row_idx)
    out = cache.attend(layer, q.transpose(1, 2), rows, kv_len, allowed, blocked)
    x = x + linear(out if packing is None else packing.pack(out), p.o)
    gate, up = project(rms_norm(x, p.norm2, p.eps), p.gate_up)
    return x + linear(F.silu(gate) * up, p.down)


def _spread(flat: torch.Tensor, b: int, s: int, keep: torch.Tensor | None) -> torch.Tensor:
    """[N, f] values of the real tokens -> [b, S, f], zeros where ``keep`` [b, S] is False (None: all real)."""
    if keep is None:
        return flat.view(b, s, -1)
    out = flat.new_zeros(b, s, flat.shape[-1])
    out[keep] = flat
    return out


class TargetBody(nn.Module):
    """Mirrors HF's ``model.`` submodule so parameter names match the checkpoint."""

    def __init__(self, spec: TargetSpec) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(TargetLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class TargetModel(nn.Module):
    flat = True  # run the layers through ``flat_layer`` where ``bind_layers`` allows (False: every module's forward)

    def __init__(self, spec: TargetSpec, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        self.spec = spec
        with torch.device("meta"):
            self.model = TargetBody(spec)
            self.lm_head = Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.to_empty(device=device)
        self.to(dtype)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Scratch slots (a block past the last committed token) may sit up to one block beyond the context limit.
        self.rotary = Rotary(spec.rope, spec.head_dim, spec.max_position_embeddings + SCRATCH_POSITIONS, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> "TargetModel":
        spec = TargetSpec.load(model_dir)
        model = cls(spec, dtype=dtype, device=device)
        ignore = ("lm_head.weight",) if spec.tie_word_embeddings else ()
        load_into(model, read_state_dict(model_dir), model_dir, ignore=ignore)
        return model.eval().requires_grad_(False)

    def new_cache(self, num_rows: int, max_len: int) -> KVCache:
        s = self.spec
        return KVCache.allocate(
            s.num_hidden_layers, num_rows, max_len, s.num_key_value_heads, s.head_dim, self.dtype, self.device
        )

    def embed(self, ids: torch.Tensor) -> torch.Tensor:  # ids: [b, S] -> [b, S, hidden]
        return self.model.embed_tokens(ids)

    def compiled_entry(self, rows: int) -> str:
        """The product table's record of which decode step of ``rows`` rows (its bucket) ``tune --compile`` found
        fastest on this machine: a compiled one (its product form, ``compiled.forms()``), ``native``, or ``eager``."""
        return f"compiled:{self.step_name}:{str(self.dtype).removeprefix('torch.')}:{products.bucket(rows)}"

    def native_entry(self, tokens: int, verify: bool = False) -> str:
        """The table's record of whether the native step or the eager one ran faster for a decode step of ``tokens``
        rows, or (``verify``) a forward of ``tokens`` tokens in all (their bucket), measured at the first such step
        where nothing else decides (``decode_engine``, ``verify_engine``)."""
        what = "native-verify" if verify else "native"
        return f"{what}:{self.step_name}:{str(self.dtype).removeprefix('torch.')}:{products.bucket(tokens)}"

    def _engines(self) -> tuple[str, ...]:
        """The decode engines that run here for this model (``compiled.engines()``; the native step's attention
        takes head dimensions that are a multiple of 16), none off a CPU, in float64, or with ``linear`` forced."""
        if self.device.type != "cpu" or self.dtype != torch.float32 or products.forced_kind() == "linear":
            return ()
        engines = compiled.engines()
        if self.spec.head_dim % 16 or self.spec.head_dim > 512:
            engines = tuple(e for e in engines if e != compiled.NATIVE)
        return engines

    def _engine(self, form: str) -> "compiled.CompiledDecode | compiled.NativeDecode":
        made = self.__dict__.setdefault("_decode_engines", {})
        if form not in made:
            made[form] = (compiled.NativeDecode() if form == compiled.NATIVE
                          else compiled.CompiledDecode(self.spec.num_hidden_layers, form))
        return made[form]

    def decode_engine(self, rows: int = 1) -> "compiled.CompiledDecode | compiled.NativeDecode | None":
        """The decode step engine for ``rows`` rows, where ``TRTLLM_DFLASH_COMPILED_STEP`` and this machine's table
        ask for one; None: the eager step. Under ``auto``, what ``tune --compile`` recorded, else the native step
        where it measures faster than the eager one here (measured at the first step of each row bucket)."""
        engines = self._engines()
        mode = compiled.setting()
        if not engines or mode == "off":
            return None
        recorded = products.table().choices.get(self.compiled_entry(rows))
        if mode == "auto" and recorded is None and compiled.NATIVE in engines:
            recorded = products.table().choose(self.native_entry(rows), lambda: self._time_native(rows))
        if mode == "auto" and recorded not in engines:
            return None
        return self._engine(compiled.forced_form() or (recorded if recorded in engines else engines[0]))

    def verify_engine(self, tokens: int) -> "compiled.NativeDecode | None":
        """The native engine for a plain causal forward of several tokens per row (``tokens`` in all, at most
        ``compiled.NATIVE_MOST_TOKENS``: a prefill is not a step), or None: the eager forward. Under ``auto`` where it
        measured faster than the eager forward at that token bucket here (at the first such forward); under ``on``
        where ``compiled.forcing`` names it."""
        mode = compiled.setting()
        if compiled.NATIVE not in self._engines() or mode == "off" or tokens > compiled.NATIVE_MOST_TOKENS:
            return None
        if mode == "on":
            chosen = compiled.forced_form() == compiled.NATIVE
        else:
            chosen = products.table().choose(self.native_entry(tokens, verify=True),
                                             lambda: self._time_native(tokens, verify=True)) == compiled.NATIVE
        return self._engine(compiled.NATIVE) if chosen else None

    def _time_native(self, tokens: int, verify: bool = False, context: int = 256) -> dict[str, float]:
        """Seconds of a decode step of ``tokens`` rows (their bucket), or (``verify``) a forward of one row of that
        many tokens, at ``context`` cached tokens, native and eager."""
        b = products.bucket(tokens)
        rows, width = (1, b) if verify else (b, 1)
        cache = self.new_cache(rows, context + width + 1)
        ids = torch.zeros(rows, width, dtype=torch.long, device=self.device)

        def step(setting: str, form: str | None = None):
            def run():
                with compiled.forcing(setting, form), torch.inference_mode():
                    cache.lengths.fill_(context)
                    self.logits(self(ids, cache)[0])
            return run

        return products.fastest({compiled.NATIVE: step("on", compiled.NATIVE), "eager": step("off")},
                                repeats=5, calls=3)

    VARIANTS = ((1, 0), (1, 1), (2, 0), (2, 1))  # (rows, first row): the compiled step's specialisations

    def warm_decode(self, context: int = 8) -> dict[str, float]:
        """Runs the compiled decode step once in each variant a process meets (one row or several, starting at the
        cache's first row or past it), so that no request waits for its compilation -> seconds of each first step;
        {} where the compiled step is off."""
        if self.decode_engine() is None and self.decode_engine(2) is None:
            return {}
        seconds = {}
        with torch.inference_mode():
            for b, first in self.VARIANTS:
                cache = self.new_cache(first + b, context + 2)
                cache.lengths.fill_(context)
                started = time.perf_counter()
                self(torch.zeros(b, 1, dtype=torch.long, device=self.device), cache, torch.arange(first, first + b))
                seconds[f"{b} row{'s' if b > 1 else ''} from row {first}"] = round(time.perf_counter() - started, 1)
        return seconds

    def _engine_step(self, input_ids, cache: KVCache, rows, tap_layers, widths):
        """``forward`` through a decode engine, or None where none applies: a decode step (one token per row) through
        ``decode_engine``'s, a plain causal forward of more tokens (``widths`` or not) through ``verify_engine``'s;
        not under autograd, hooks or converted modules; for a compiled step not for rows that are not one run of
        consecutive cache rows or a cache holding fewer than two tokens in some row (its shapes start there)."""
        b, s = input_ids.shape
        full = widths is None or int(widths.min()) >= s
        if torch.is_grad_enabled() or (widths is not None and int(widths.max()) < 1):  # no token to compute
            return None
        engine = self.decode_engine(b) if s == 1 and full else self.verify_engine(b * s)
        if engine is None or engine.failed:
            return None
        bound = bind_layers(self.model.layers)
        if bound is None:
            return None
        rows = torch.arange(b) if rows is None else rows
        lengths = cache.lengths[rows]
        first = int(rows[0]) if engine.consecutive else None
        if engine.consecutive and (rows.tolist() != list(range(first, first + b)) or int(lengths.min()) < 2):
            return None
        positions = lengths[:, None] + torch.arange(s)  # [b, S]
        cache.require_capacity(int(positions.max()) + 1)
        layers = self._decode_layers(bound, engine.form)
        shape = compiled.Shape(*bound[0].heads, bound[0].eps, engine.form)
        x = self.embed(input_ids)
        keep = None if full else torch.arange(s)[None, :] < widths[:, None]  # [b, S]: the real tokens
        fused = False  # the final norm inside the engine's call
        try:
            if engine.consecutive:
                rope = self.rotary.at(lengths[:, None])
                outs = engine(shape, layers, x[:, 0], rope.cos[:, 0], rope.sin[:, 0], cache, first, lengths,
                              int(lengths.max()))
            else:
                at_rows = rows[:, None].expand(b, s)
                if keep is None:
                    x, at_rows, at = x.reshape(b * s, -1), at_rows.reshape(-1), positions.reshape(-1)
                else:
                    x, at_rows, at = x[keep], at_rows[keep], positions[keep]
                rope = self.rotary.at(at[:, None])
                final = self.model.norm
                fused = type(final) is RMSNorm and _plain(final) and final.eps == shape.eps  # else its own forward
                outs = engine(shape, layers, x, rope.cos, rope.sin, cache, at_rows, at,
                              final.weight if fused else None)
                if fused:
                    *outs, hidden = outs
        except Exception as exc:  # a compiler that fails here (a toolchain, a locale) must not fail the step
            engine.failed = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            what = "compiled decode step" if engine.consecutive else "native step"
            print(f"trtllm-dflash: the {what} failed ({engine.failed}); the target runs eagerly",
                  file=sys.stderr, flush=True)
            return None
        if engine.consecutive or not fused:
            hidden = self.model.norm(outs[-1])
        taps = torch.cat([outs[i] for i in tap_layers], dim=-1) if tap_layers else None
        return _spread(hidden, b, s, keep), (None if taps is None else _spread(taps, b, s, keep))

    def _decode_layers(self, bound: list[BoundLayer], form: str) -> list["compiled.DecodeLayer"]:
        """The bound layers' parameters as the engines read them in ``form`` (``_decode_layer``), each kept until one
        of its tensors is replaced or changed in place (its identity or version: ``products.stamp``), so a step
        pays a stamp per layer rather than the joined copies' look-ups."""
        kept = self.__dict__.setdefault("_engine_layers", {})
        out = []
        for i, p in enumerate(bound):
            tensors = [p.norm1, p.norm2, *p.qkv, p.o, p.q_norm, p.k_norm, *p.gate_up, p.down]
            stamp = products.stamp([t for t in tensors if t is not None], p.qkv_bias)
            found = kept.get((form, i))
            if found is None or found[0] != stamp:
                found = kept[(form, i)] = (stamp, self._decode_layer(p, form))
            out.append(found[1])
        return out

    @staticmethod
    def _decode_layer(p: BoundLayer, form: str) -> "compiled.DecodeLayer":
        kind = "packed" if form in ("packed", compiled.NATIVE) else "linear"  # the others read the plain weights
        qkv, qkv_bias = products.joined(p.qkv, p.qkv_bias, kind)
        (gate_up, _), (o, _), (down, _) = (products.joined(w, kind=kind) for w in (p.gate_up, [p.o], [p.down]))
        return compiled.DecodeLayer(p.norm1, p.norm2, qkv, qkv_bias, o, p.q_norm, p.k_norm, gate_up, down)

    @property
    def step_name(self) -> str:
        """What names this model's steps in the product table (``products.step_choice``): its products' shapes."""
        s = self.spec
        return f"target:{s.num_hidden_layers}x{s.hidden_size}x{s.intermediate_size}x{s.vocab_size}"

    def step_kind(self, rows: int):
        """The product kind of a step of ``rows`` token rows, as ``tune`` measured it for whole forwards on this
        machine (``products.step_kind``; a no-op where it did not)."""
        return products.step_kind(products.step_choice(self.step_name, self.dtype, rows))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden (final-normed): [..., hidden] -> [..., vocab]
        # one GEMM over all positions: a view whose leading dimensions do not merge (hidden[:, :1] of a wider step)
        # would otherwise go through one GEMM per row, each reading the whole head (``draft_block``)
        flat = hidden.reshape(-1, hidden.shape[-1])
        with self.step_kind(flat.shape[0]):
            return self.lm_head(flat).view(*hidden.shape[:-1], self.spec.vocab_size)

    def verify_widths(self, widths: list[int]) -> torch.Tensor | None:
        """``forward``'s ``widths`` for a verify step whose rows hold ``widths`` real tokens (the rest padding to the
        step's width): on a CPU, where every token is compute, the padding is skipped (``perf/results/packed-verify/``
        measured it); elsewhere None — a GPU computes a few padded slots for free, and packing would add kernel
        launches to a launch-bound step."""
        return torch.tensor(widths) if self.device.type == "cpu" else None

    def forward(
        self,
        input_ids: torch.Tensor,  # [b, S] tokens at positions cache.lengths[rows] + [0, S)
        cache: KVCache,
        rows: torch.Tensor | None = None,  # [b] cache rows of the batch; None = all rows in order
        tap_layers: tuple[int, ...] = (),
        layout=None,  # runtime.tree.StepLayout: positions, cache slots and mask of a step that is not one run
        widths: torch.Tensor | None = None,  # [b] real tokens per row (a prefix, the rest padding); default all S
        static: bool = False,  # attend over all cache slots, read nothing back to the host (``runtime.graphs``)
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns (final-normed hidden [b, S, hidden], taps [b, S, len(tap_layers) * hidden] or None).

        Writes K/V for the S tokens into ``cache`` without committing them (see layers.KVCache): by default at the
        rows' next S slots, causally; with ``layout`` where and as it says. With ``widths`` the layers compute only
        each row's first ``widths[row]`` tokens (``layers.Packing``); hidden states and taps past them are zero.
        ``static``: the shapes and launches depend on the arguments' shapes only, never on the cache's lengths
        (attention runs over all ``cache.max_len`` slots, the uncommitted ones masked; capacity is the caller's to
        check), so a CUDA graph can replay the forward (``runtime.graphs``); not with ``layout`` or ``widths``.
        """
        with self.step_kind(input_ids.numel()):
            return self._forward(input_ids, cache, rows, tap_layers, layout, widths, static)

    def _forward(self, input_ids, cache, rows, tap_layers, layout, widths, static):
        b, s = input_ids.shape
        rows = rows if static else cache.every_row(rows)
        if layout is None and not static:
            found = self._engine_step(input_ids, cache, rows, tap_layers, widths)
            if found is not None:
                return found
        if layout is None:
            positions = slots = cache.step_positions(rows, s, check=not static)  # [b, S]
            kv_len = cache.max_len if static else int(positions[:, -1].max()) + 1
            key_pos = torch.arange(kv_len, device=input_ids.device)
            allowed = key_pos[None, None, :] <= positions[:, :, None]  # [b, S, kv_len]: causal over cache + step
        else:
            positions, slots, allowed = layout.positions, layout.slots, layout.allowed
            kv_len = allowed.shape[-1]
            cache.require_capacity(kv_len)
        # what every layer shares, computed once: RoPE tables, cache rows, the mask's complement
        step = (self.rotary.at(positions), slots, cache)
        packing = Packing.of(widths, s, input_ids.device) if layout is None else None
        shared = (KVCache.view_rows(rows), cache.row_index(rows), allowed, ~allowed, kv_len, packing)
        x = self.embed(input_ids)
        if packing is not None:
            x = packing.pack(x)  # [N, hidden]: the residual stream of the real tokens
        wanted = {layer: i for i, layer in enumerate(tap_layers)}
        taps: list[torch.Tensor | None] = [None] * len(tap_layers)
        bound = bind_layers(self.model.layers) if self.flat else None
        for i, layer in enumerate(self.model.layers):
            x = layer(x, *step, i, *shared) if bound is None else flat_layer(bound[i], x, *step, i, *shared)
            if i in wanted:
                taps[wanted[i]] = x
        tapped = torch.cat(taps, dim=-1) if tap_layers else None  # type: ignore[arg-type]
        x = self.model.norm(x)
        if packing is None:
            return x, tapped
        return packing.unpack(x), (packing.unpack(tapped) if tapped is not None else None)
