"""Run a quantized checkpoint in the PyTorch reference models the way TensorRT-LLM's quantized kernels compute it, so
its accuracy can be measured on a CPU (fake quantization: quantize, then dequantize, in plain torch).

What a TRT-LLM FP8 / NVFP4 engine does, and what is emulated here:

  weights      stored quantized; the loader dequantizes them (``loader.dequantize_rank``), exactly
  activations  the input of every quantized linear is quantized before the GEMM:
                 FP8    static per tensor: e4m3(clamp(x / s, ±448)) * s, s = ``activation_scaling_factor``
                 NVFP4  dynamic 16-element blocks with e4m3 block scales over the static global scale
                        ``activation_scaling_factor`` (``quant.nvfp4_fake_quant``)
               installed as a forward pre-hook on each quantized ``nn.Linear`` (HF / z-lab module names)
  KV cache     ``kv_cache_quant_algo: FP8``: K and V are stored as e4m3 with ``kv_cache_scaling_factor`` (1.0 as
               modelopt 0.47 writes it); the model's caches (``new_cache``) round every write through e4m3
  unchanged    embedding, norms, lm_head, attention softmax and the GEMM accumulation (fp32 here; TRT-LLM
               accumulates in fp32 and writes the model dtype)

The emulation does not model TRT-LLM's fused-kernel rounding order (e.g. bf16 outputs between fused ops); use an fp32
model for the cleanest comparison with an fp32 reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from trtllm_dflash.convert import quant
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.models.layers import KVCache

ALGOS = ("FP8", "NVFP4")


@dataclass(frozen=True, slots=True)
class QuantEmulation:
    """What a quantized checkpoint asks of the runtime, in the reference model's module names."""

    quant_algo: str | None  # "FP8" | "NVFP4" | None (weights and activations)
    input_scales: dict[str, torch.Tensor] = field(default_factory=dict)  # module -> fp32 activation scale
    kv_cache_quant_algo: str | None = None  # "FP8" | None
    kv_cache_scale: float = 1.0

    @property
    def active(self) -> bool:
        return bool(self.input_scales) or self.kv_cache_quant_algo is not None


def from_checkpoint(quantization: dict, entries: list[wm.Entry], rank0: dict[str, torch.Tensor]) -> QuantEmulation:
    """``quantization``: the config's ``quantization`` block; ``entries``: the plan the loader merges with (TRT-LLM
    name -> source names); ``rank0``: rank 0's raw tensors (scales are per full tensor, the same on every rank)."""
    algo = quantization.get("quant_algo")
    scales = {}
    if algo in ALGOS:
        for e in entries:
            linear = e.dst.removesuffix(".weight")
            s = rank0.get(f"{linear}.activation_scaling_factor")
            if s is not None and e.dst.endswith(".weight"):
                for src in e.src:  # fused qkv: q, k and v see the same input and share its scale
                    scales[src.removesuffix(".weight")] = s.float().reshape(())
    kv_algo = quantization.get("kv_cache_quant_algo")
    kv_scale = 1.0
    if kv_algo == "FP8":
        found = [float(t) for n, t in rank0.items() if n.endswith(".kv_cache_scaling_factor")]
        kv_scale = max(found) if found else 1.0
    return QuantEmulation(algo, scales, kv_algo, kv_scale)


class FP8KVCache(KVCache):
    """A KV cache whose writes are rounded through float8_e4m3fn (with ``scale``), as an FP8 KV cache stores them."""

    scale: float = 1.0

    def write(self, layer, rows, positions, k, v, row_idx=None):
        super().write(layer, rows, positions, quant.fp8_fake_quant(k, self.scale), quant.fp8_fake_quant(v, self.scale),
                      row_idx)


def _input_hook(fake_quant, scale):
    def hook(module: nn.Module, args):
        return (fake_quant(args[0], scale), *args[1:])

    return hook


def install(model: nn.Module, emulation: QuantEmulation) -> nn.Module:
    """Hook ``emulation`` into ``model`` (a TargetModel or DrafterModel) in place; returns it. Idempotence is not
    needed: loaders call this once on a fresh model."""
    fake = quant.fp8_fake_quant if emulation.quant_algo == "FP8" else quant.nvfp4_fake_quant
    for name, scale in emulation.input_scales.items():
        module = model.get_submodule(name)
        assert isinstance(module, nn.Linear), name
        module.register_forward_pre_hook(_input_hook(fake, scale.to(model.device)))
    if emulation.kv_cache_quant_algo == "FP8":
        plain = model.new_cache

        def new_cache(num_rows: int, max_len: int) -> KVCache:
            c = plain(num_rows, max_len)
            cache = FP8KVCache(c.k, c.v, c.lengths)
            cache.scale = emulation.kv_cache_scale
            return cache

        model.new_cache = new_cache  # instance attribute: every cache this model hands out is an FP8 one
    model.quant_emulation = emulation
    return model
