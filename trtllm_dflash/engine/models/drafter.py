"""Drafter model classes for ``trtllm-build --model_cls_file``, both built from ``DIR/drafter`` (architecture
``DFlashDrafterForTRTLLM``, convert/configs.py):

``DFlashKVInjectForTRTLLM``  taps [T, K·H], position_ids [T] -> ctx_k, ctx_v [L, T, n_kv, hd]
                             context_proj -> context_norm -> every layer's K/V rows of attention.qkv in ONE GEMM ->
                             ``dflash::kv_rope`` (k_layernorm + RoPE; V passes through) (plugin/kv_inject.py math).
``DFlashDrafterForTRTLLM``   block_ids, position_ids [n, B], ctx_k/ctx_v [L, n, S, n_kv, hd], ctx_lens [n]
                             -> draft_ids [n, B-1]: the target's embedding, per layer QKV + q/k norm + RoPE and
                             ``dflash::block_attention`` over the context plus the block, final norm, the target's LM
                             head, argmax of positions 1..B-1 (plugin/dispatch.draft math).

Parameter names are the converter's (convert/weight_map.py ``DRAFTER_GLOBAL`` / ``DRAFTER_LAYER``: ``drafter.*``),
so ``PretrainedModel.from_checkpoint`` loads the rank file as written; the drafter borrows ``vocab_embedding.weight``
and ``lm_head.weight`` from the sibling target's rank file (``layout.borrowed_tensors``). I/O names and shapes are
contract.py's; shape profiles come from ``layout.input_profiles`` (tested without TensorRT).

Runs only inside NVIDIA's TensorRT-LLM container; symbols it relies on are recorded with sources in
tests/data/trtllm_1_2_1/model_api.json. Unverified on a GPU: wiring a ``tensorrt.plugin`` AOT op into a TensorRT-LLM
network (``add_plugin(..., aot=True)`` on ``default_trtnet()``) has no upstream example (plugin/trt.py).
Limits: single GPU (tp_size 1), one causality / window for all drafter layers (one block_attention registration).
"""

from __future__ import annotations

from pathlib import Path

import tensorrt.plugin as trtp
from tensorrt_llm._common import default_trtnet
from tensorrt_llm.functional import (Tensor, _create_tensor, arange, argmax, cast, concat, constant, embedding, matmul,
                                     shape, slice)
from tensorrt_llm.layers import ColumnLinear, Embedding, GatedMLP, RmsNorm, RowLinear
from tensorrt_llm.models import MODEL_MAP
from tensorrt_llm.models.modeling_utils import PretrainedModel
from tensorrt_llm.module import Module, ModuleList

from trtllm_dflash.convert.configs import drafter_spec_from_config
from trtllm_dflash.engine import contract, layout
from trtllm_dflash.plugin import trt as dflash_plugins

_REGISTERED: set[str] = set()  # plugin ids registered in this trtllm-build process (TensorRT rejects a second one)


def _spec(config):
    return drafter_spec_from_config(config.to_dict(), Path("drafter/config.json"))


def _register_plugins(spec) -> None:
    if dflash_plugins.NAMESPACE in _REGISTERED:
        return
    import torch

    causal, window = set(spec.layer_causal), spec.sliding_window
    if len(causal) != 1:
        raise ValueError(f"drafter layer_causal {spec.layer_causal}: one block_attention registration per engine "
                         "needs the same causality for every layer")
    major, minor = torch.cuda.get_device_capability()
    kv = dflash_plugins.KvRopeConfig(spec.num_hidden_layers, spec.num_key_value_heads, spec.head_dim,
                                     spec.rms_norm_eps)
    attn = dflash_plugins.BlockAttentionConfig(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim,
                                               max_q_len=spec.block_size, causal=causal.pop(), window=window)
    dflash_plugins.register(kv, attn, max_num_drafts=spec.block_size - 1, arch=10 * major + minor)
    _REGISTERED.add(dflash_plugins.NAMESPACE)


def _plugin(op: str, inputs: list[Tensor]) -> list[Tensor]:
    plugin = getattr(trtp.op.dflash, op)(*[t.trt_tensor for t in inputs])
    layer = default_trtnet().add_plugin(plugin, aot=True)
    return [_create_tensor(layer.get_output(i), layer) for i in range(layer.num_outputs)]


def _inputs(model, ios, max_batch_size, max_seq_len, max_num_tokens) -> dict[str, Tensor]:
    spec = model.spec
    dims = layout.engine_dims(num_layers=spec.num_hidden_layers, num_kv_heads=spec.num_key_value_heads,
                              head_dim=spec.head_dim, block_size=spec.block_size,
                              taps_width=spec.num_taps * spec.hidden_size, max_batch_size=max_batch_size,
                              max_seq_len=max_seq_len, max_num_tokens=max_num_tokens)
    out = {}
    for io in ios:
        dims_shape, ranges = layout.input_profiles((io,), dims)[io.name]
        dtype = model.config.dtype if io.dtype == "model" else io.dtype
        out[io.name] = Tensor(name=io.name, dtype=dtype, shape=dims_shape, dim_range=ranges)
    return out


def _rows(t: Tensor, first: int, count: int) -> Tensor:
    """t[:, first:first + count] of a 2-D tensor with a dynamic first dimension."""
    return slice(t, starts=[0, first], sizes=concat([shape(t, 0), count]))


def _rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [Tq, heads, hd], cos/sin [Tq, 1, hd]: HF rotate_half RoPE (models/layers.Rotary.apply)."""
    heads, hd = x.shape[1], x.shape[2]
    half = hd // 2
    sizes = concat([shape(x, 0), heads, half])
    x1, x2 = slice(x, starts=[0, 0, 0], sizes=sizes), slice(x, starts=[0, 0, half], sizes=sizes)
    return x * cos + concat([x2 * -1.0, x1], dim=2) * sin


class DrafterAttention(Module):
    def __init__(self, spec, dtype, kv_only: bool) -> None:
        super().__init__()
        nh, nkv, hd, h = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size
        self.qkv = ColumnLinear(h, (nh + 2 * nkv) * hd, bias=False, dtype=dtype, gather_output=False)
        self.k_layernorm = RmsNorm(normalized_shape=hd, eps=spec.rms_norm_eps, dtype=dtype)
        if not kv_only:
            self.dense = RowLinear(nh * hd, h, bias=False, dtype=dtype)
            self.q_layernorm = RmsNorm(normalized_shape=hd, eps=spec.rms_norm_eps, dtype=dtype)


class DrafterLayer(Module):
    def __init__(self, spec, dtype) -> None:
        super().__init__()
        self.input_layernorm = RmsNorm(normalized_shape=spec.hidden_size, eps=spec.rms_norm_eps, dtype=dtype)
        self.attention = DrafterAttention(spec, dtype, kv_only=False)
        self.post_layernorm = RmsNorm(normalized_shape=spec.hidden_size, eps=spec.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(hidden_size=spec.hidden_size, ffn_hidden_size=spec.intermediate_size, hidden_act="silu",
                            dtype=dtype, bias=False)


class KVInjectLayer(Module):
    def __init__(self, spec, dtype) -> None:
        super().__init__()
        self.attention = DrafterAttention(spec, dtype, kv_only=True)


class KVInjectBody(Module):
    def __init__(self, spec, dtype) -> None:
        super().__init__()
        taps_width = spec.num_taps * spec.hidden_size
        self.context_proj = ColumnLinear(taps_width, spec.hidden_size, bias=False, dtype=dtype, gather_output=False)
        self.context_norm = RmsNorm(normalized_shape=spec.hidden_size, eps=spec.rms_norm_eps, dtype=dtype)
        self.layers = ModuleList([KVInjectLayer(spec, dtype) for _ in range(spec.num_hidden_layers)])


class DrafterBody(Module):
    def __init__(self, spec, dtype) -> None:
        super().__init__()
        self.layers = ModuleList([DrafterLayer(spec, dtype) for _ in range(spec.num_hidden_layers)])
        self.ln_f = RmsNorm(normalized_shape=spec.hidden_size, eps=spec.rms_norm_eps, dtype=dtype)


class _DFlashEngine(PretrainedModel):
    """Shared by both engines: the parsed DrafterSpec, RoPE tables, builder-facing prepare_inputs signature."""

    INPUTS: tuple = ()

    def __init__(self, config) -> None:
        super().__init__(config)
        self.spec = _spec(config)
        if config.mapping.tp_size != 1:
            raise ValueError("the DFlash drafter engines are single-GPU (tp_size 1)")

    def _rope_tables(self) -> tuple[Tensor, Tensor]:
        cos, sin = layout.rope_tables(self.spec.rope.inv_freq(self.spec.head_dim), self.config.max_position_embeddings)
        return cast(constant(cos), self.config.dtype), cast(constant(sin), self.config.dtype)  # [P, hd] each

    # The keyword set TensorRT-LLM's builder passes (build_flags.json builder_rules.prepare_inputs_kwargs).
    def prepare_inputs(self, max_batch_size, max_input_len, max_seq_len, use_cache, max_beam_width, max_num_tokens,
                       opt_num_tokens=None, prompt_embedding_table_size=0, max_draft_len=0,
                       speculative_decoding_draft_tokens_external=False, gather_context_logits=False,
                       lora_target_modules=None):
        if use_cache:
            raise ValueError("build the DFlash drafter engines with --kv_cache_type disabled")
        return _inputs(self, self.INPUTS, max_batch_size, max_seq_len, max_num_tokens)


class DFlashKVInjectForTRTLLM(_DFlashEngine):
    INPUTS = contract.KV_INJECT_INPUTS

    def __init__(self, config) -> None:
        super().__init__(config)
        self.drafter = KVInjectBody(self.spec, config.dtype)

    def forward(self, taps: Tensor, position_ids: Tensor):
        _register_plugins(self.spec)
        spec, body = self.spec, self.drafter
        x = body.context_norm(body.context_proj(taps))  # [T, H]
        k0, kv_rows = layout.qkv_rows(spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim)["k"]
        w_kv = concat([slice(layer.attention.qkv.weight.value, starts=[k0, 0], sizes=[2 * kv_rows, spec.hidden_size])
                       for layer in body.layers], dim=0)  # [L·2·n_kv·hd, H]; rows (layer, k|v, head, dim)
        kv = matmul(x, w_kv, transb=True)  # [T, L·2·n_kv·hd]
        k_norm = concat([layer.attention.k_layernorm.weight.value.view([1, spec.head_dim]) for layer in body.layers],
                        dim=0)  # [L, hd]
        pos = cast(position_ids, "int64")  # [T]; the kernel reads int64 positions (plugin/trt.py compile_ptx)
        cos, sin = self._rope_tables()
        k, v = _plugin("kv_rope", [kv, pos, pos, k_norm, cos, sin])  # row input unused in the dense layout
        ctx_k, ctx_v = contract.KV_INJECT_OUTPUTS
        k.mark_output(ctx_k.name, self.config.dtype)
        v.mark_output(ctx_v.name, self.config.dtype)
        return k, v


class DFlashDrafterForTRTLLM(_DFlashEngine):
    INPUTS = contract.DRAFTER_INPUTS

    def __init__(self, config) -> None:
        super().__init__(config)
        self.vocab_embedding = Embedding(config.vocab_size, self.spec.hidden_size, dtype=config.dtype)
        self.drafter = DrafterBody(self.spec, config.dtype)
        self.lm_head = ColumnLinear(self.spec.hidden_size, config.vocab_size, bias=False, dtype=config.dtype,
                                    gather_output=True)

    @classmethod
    def from_checkpoint(cls, ckpt_dir, rank=None, config=None, *, preprocess_weights_hook=None):
        """The drafter's rank file plus the embedding and LM head it borrows from the sibling target's."""
        from safetensors import safe_open

        borrowed = layout.borrowed_tensors(config.to_dict(), ckpt_dir)
        r = config.mapping.rank if rank is None else rank
        target_file = layout.sibling(ckpt_dir, layout.TARGET_DIR) / f"rank{r}.safetensors"

        def add_target_tensors(weights):
            with safe_open(str(target_file), framework="pt") as f:
                for param, name in borrowed.items():
                    weights[param] = f.get_tensor(name)
            return preprocess_weights_hook(weights) if preprocess_weights_hook else weights

        return super().from_checkpoint(ckpt_dir, rank=rank, config=config, preprocess_weights_hook=add_target_tensors)

    def forward(self, block_ids: Tensor, position_ids: Tensor, ctx_k: Tensor, ctx_v: Tensor, ctx_lens: Tensor):
        _register_plugins(self.spec)
        spec = self.spec
        nh, nkv, hd, h, b = spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim, spec.hidden_size, \
            spec.block_size
        x = self.vocab_embedding(block_ids.view([-1]))  # [n·B, H]
        cos_t, sin_t = self._rope_tables()
        pos = position_ids.view([-1])  # [n·B]
        cos = embedding(pos, cos_t).view([-1, 1, hd])  # [n·B, 1, hd]
        sin = embedding(pos, sin_t).view([-1, 1, hd])
        n = shape(ctx_lens, 0)
        rows = cast(arange(0, n, "int32"), "int64")  # [n]: sequence i reads ctx row i
        cu_seqlens_q = arange(0, n + 1, "int32") * b  # [n + 1]: every sequence sends B block tokens
        lens = cast(ctx_lens, "int64")  # [n]
        parts = layout.qkv_rows(nh, nkv, hd)  # name -> (first row, rows) in the fused qkv
        for i, layer in enumerate(self.drafter.layers):
            qkv = layer.attention.qkv(layer.input_layernorm(x))  # [n·B, (nh + 2·n_kv)·hd]
            q = layer.attention.q_layernorm(_rows(qkv, *parts["q"]).view([-1, nh, hd]))
            k = layer.attention.k_layernorm(_rows(qkv, *parts["k"]).view([-1, nkv, hd]))
            v = _rows(qkv, *parts["v"]).view([-1, nkv, hd])
            cache_shape = concat([shape(ctx_k, 1), shape(ctx_k, 2), nkv, hd])  # [n, S, n_kv, hd]
            k_cache = slice(ctx_k, starts=[i, 0, 0, 0, 0], sizes=concat([1, cache_shape])).view(cache_shape)
            v_cache = slice(ctx_v, starts=[i, 0, 0, 0, 0], sizes=concat([1, cache_shape])).view(cache_shape)
            (o,) = _plugin("block_attention", [_rope(q, cos, sin), _rope(k, cos, sin), v, k_cache, v_cache,
                                               cu_seqlens_q, rows, lens])  # [n·B, nh, hd]
            x = x + layer.attention.dense(o.view([-1, nh * hd]))
            x = x + layer.mlp(layer.post_layernorm(x))
        x = self.drafter.ln_f(x).view([-1, b, h])  # [n, B, H]
        drafts = slice(x, starts=[0, 1, 0], sizes=concat([shape(x, 0), b - 1, h])).view([-1, h])  # positions 1..B-1
        draft_ids = cast(argmax(self.lm_head(drafts), dim=-1), "int32").view([-1, b - 1])  # [n, B-1]
        (out,) = contract.DRAFTER_OUTPUTS
        draft_ids.mark_output(out.name, "int32")
        return draft_ids


# PretrainedConfig.from_dict looks config['architecture'] up in MODEL_MAP before any model class is used
# (build_flags.json builder_rules.model_cls_file); our drafter checkpoints name this architecture.
MODEL_MAP.setdefault(contract.DRAFTER_CLASS, DFlashDrafterForTRTLLM)
