"""FP8 and NVFP4 weight numerics in plain torch (CPU is fine): quantize to the tensors a TensorRT-LLM checkpoint stores,
and dequantize them back. Formulas: trtllm_triton.md §1.4 / §1.5; tensor layouts checked against what
nvidia-modelopt 0.47.0's ``export_tensorrt_llm_checkpoint`` writes (tests/data/trtllm_1_2_1/quantized_checkpoint.json)
and the NVFP4 packing bit-exactly against modelopt's ``NVFP4QTensor.quantize`` (tests/convert/test_convert_quantize.py).

FP8 (per tensor):  scale = amax / 448;  q = e4m3(w / scale) (division in w's dtype, as modelopt);  w ≈ q * scale.
NVFP4 (16-element blocks along the input dim, two levels of scale):
    global = amax(|w|) / (6 * 448)                               -> weights_scaling_factor_2, fp32 scalar
    block  = e4m3(clamp(block_amax / (6 * global), 2^-9, 448))   -> weights_scaling_factor, [out, in / 16]
             (an all-zero block gets scale 1)
    code   = E2M1(w / (block * global))                          -> 4-bit codes, two per byte, [out, in / 2]
E2M1 codes: bit 3 = sign (set for negative inputs, so tiny negatives give "-0"), bits 0-2 index the magnitude grid
(0, 0.5, 1, 1.5, 2, 3, 4, 6). Rounding is to the nearest grid value, ties to the even index, saturating at 6.
Packing: byte k of a row holds element 2k in its low nibble and element 2k+1 in its high nibble.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # elements per block scale
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_MIN_BLOCK_SCALE = 2.0**-9  # smallest e4m3 subnormal: keeps a tiny block's scale from flushing to 0


def fp8_quantize(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """w: [...] float; scale: fp32 [1] = amax / 448 -> float8_e4m3fn [...].

    The division happens in w's own dtype (a 0-dim scale does not promote it), as modelopt 0.47's
    ``to_quantized_weight`` does when it exports: for a bf16 checkpoint the quotient is rounded to bf16 before the cast
    to e4m3, which moves some elements by one e4m3 step compared with an fp32 division. Matching it keeps
    this checkpoint and modelopt's unified HF export (hf_export.py) bit-identical."""
    return (w / scale.float().reshape(())).to(torch.float8_e4m3fn)


def fp8_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale.float()


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scalar [] from the tensor's absolute max."""
    return amax.float().reshape(()) / (E2M1_MAX * FP8_MAX)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 code (uint8 in [0, 16)) of each element of ``x`` (already divided by its scales)."""
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    mids = (grid[1:] + grid[:-1]) / 2  # [7] decision boundaries between neighbouring grid values
    a = x.float().abs()
    idx = torch.bucketize(a, mids)  # [...] in [0, 7]; a == mids[j] lands on the lower neighbour j
    on_mid = a == torch.cat([mids, mids.new_tensor([float("inf")])])[idx]
    idx = idx + (on_mid & (idx % 2 == 1)).long()  # a tie goes to the even index
    return (idx | ((x < 0).long() << 3)).to(torch.uint8)


def nvfp4_quantize(w: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [out, in] with in % 16 == 0; global_scale: fp32 [] -> (packed uint8 [out, in/2], block scales e4m3
    [out, in/16])."""
    out_f, in_f = w.shape
    assert in_f % NVFP4_BLOCK == 0, f"in_features={in_f} is not a multiple of {NVFP4_BLOCK}"
    blocks = w.float().reshape(out_f, in_f // NVFP4_BLOCK, NVFP4_BLOCK)  # [out, in/16, 16]
    block_amax = blocks.abs().amax(dim=-1)  # [out, in/16]
    block = block_amax / (E2M1_MAX * global_scale)
    block = torch.where(block == 0, torch.ones_like(block), block)
    block = block.clamp(min=_MIN_BLOCK_SCALE, max=FP8_MAX).to(torch.float8_e4m3fn)
    scaled = blocks / (block.float() * global_scale).unsqueeze(-1)  # [out, in/16, 16]
    codes = e2m1_codes(scaled).reshape(out_f, in_f)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # [out, in/2]
    return packed, block


def nvfp4_dequantize(packed: torch.Tensor, block: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``nvfp4_quantize`` up to rounding: float32 [out, in]."""
    out_f, half = packed.shape
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(out_f, 2 * half).long()  # [out, in]
    grid = torch.tensor(E2M1_GRID, dtype=torch.float32)
    values = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    scale = (block.float() * global_scale.float()).repeat_interleave(NVFP4_BLOCK, dim=1)  # [out, in]
    return values * scale


# Fake quantization (quantize, then dequantize) of activations, as the TRT-LLM kernels see them at run time.

def fp8_fake_quant(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Static per-tensor FP8: e4m3(clamp(x / scale, ±448)) * scale, in x's dtype. ``scale`` = activation amax / 448
    (``activation_scaling_factor``), or 1.0 for the unscaled FP8 KV cache. Values beyond the calibrated range
    saturate, as TRT-LLM's static quantization does."""
    scale = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * scale).to(x.dtype)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4 activations: dynamic 16-element blocks along the last dim, e4m3 block scales computed at run time over
    the static per-tensor global scale (``activation_scaling_factor`` = amax_in / (6 * 448)), E2M1 codes. The same
    arithmetic as the weights (``nvfp4_quantize``), so a block beyond the calibrated range saturates at 6 × 448 ×
    global. x: [..., in] with in % 16 == 0; returns x's shape and dtype."""
    flat = x.reshape(-1, x.shape[-1])  # [tokens, in]
    g = global_scale.float().reshape(())
    return nvfp4_dequantize(*nvfp4_quantize(flat, g), g).reshape(x.shape).to(x.dtype)
