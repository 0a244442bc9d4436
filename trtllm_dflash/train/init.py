"""Initialising a drafter from its target's own early layers, so training starts with working attention heads.

A randomly initialised drafter on long contexts sits on a unigram plateau: its block queries spread evenly over
hundreds of context keys, so the anchor's information barely reaches the masked slots and its gradient is tiny
(on SmolLM2, even many steps on one fixed batch leave every slot predicting the same token). The target's
layers 2, 3, ... already hold previous-token and copying heads over exactly these inputs:

    drafter layer i  <-  target layer first_tap + 1 + i (attention, MLP and both norms copied)
    fc, hidden_norm  <-  C = RMSNorm_{layer first_tap+1}(output of layer first_tap): the first tap passed through,
                         i.e. what target layer first_tap + 1 attends over, so layer 0's context K/V are the target's
    q_norm, k_norm   <-  per-dimension RMS of the target's q / k on a sample, so QK-norm keeps the target's scale

Only the starting point changes; the architecture (and so inference) is the z-lab drafter as before.
"""

from __future__ import annotations

import torch

from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.specs import DrafterSpec


@torch.no_grad()
def init_from_target(state: dict[str, torch.Tensor], target: TargetModel, spec: DrafterSpec,
                     tap_scale: torch.Tensor, sample_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """state: a drafter state dict (random); tap_scale [K·H]: the training tap standardiser; sample_ids [S]."""
    first = spec.target_layer_ids[0]
    h = spec.hidden_size
    src = [first + 1 + i for i in range(spec.num_hidden_layers)]
    if src[-1] >= target.spec.num_hidden_layers:
        raise ValueError(f"target has too few layers to initialise {spec.num_hidden_layers} drafter layers")
    state = dict(state)
    fc = torch.zeros_like(state["fc.weight"])  # [H, K·H]; input = taps · tap_scale
    fc[:, :h] = torch.diag(1.0 / tap_scale[:h].cpu())  # undo the standardisation of the first tap
    state["fc.weight"] = fc
    layers = target.model.layers
    state["hidden_norm.weight"] = layers[src[0]].input_layernorm.weight.float().clone()
    cache = target.new_cache(1, len(sample_ids))
    _, taps = target(sample_ids[None], cache, tap_layers=tuple(j - 1 for j in src))  # inputs of the src layers
    for i, j in enumerate(src):
        t = layers[j]
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"layers.{i}.self_attn.{name}.weight"] = getattr(t.self_attn, name).weight.float().clone()
        for name in ("gate_proj", "up_proj", "down_proj"):
            state[f"layers.{i}.mlp.{name}.weight"] = getattr(t.mlp, name).weight.float().clone()
        state[f"layers.{i}.input_layernorm.weight"] = t.input_layernorm.weight.float().clone()
        state[f"layers.{i}.post_attention_layernorm.weight"] = t.post_attention_layernorm.weight.float().clone()
        x = t.input_layernorm(taps[0, :, i * h : (i + 1) * h].float())  # [S, H]
        d = spec.head_dim
        q = t.self_attn.q_proj.float()(x).view(-1, d)  # [S·heads, d]
        k = t.self_attn.k_proj.float()(x).view(-1, d)
        q_unit = q / q.pow(2).mean(-1, keepdim=True).sqrt()
        k_unit = k / k.pow(2).mean(-1, keepdim=True).sqrt()
        state[f"layers.{i}.self_attn.q_norm.weight"] = (q / q_unit).abs().mean(0)  # ≈ per-head RMS, [d]
        state[f"layers.{i}.self_attn.k_norm.weight"] = (k / k_unit).abs().mean(0)
    return state
