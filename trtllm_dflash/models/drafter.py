"""The DFlash drafter (z-lab format): Qwen3-style layers conditioned on target taps through KV injection.

Parameter names are z-lab's (dflash.md §1.8): ``fc``, ``hidden_norm``, ``norm``, ``layers.{i}.…``; no embedding and
no LM head, which are the target's. Two operations, mirroring SGLang/vLLM's "precompute context K/V" design:

``inject(taps)``  context features C = hidden_norm(fc(taps)); for every layer, K = RoPE(k_norm(k_proj(C))) and
                  V = v_proj(C) at the tokens' absolute positions, appended to the drafter's context cache, which
                  therefore holds exactly the committed tokens (dflash.md §1.4, §2.3).
``draft(block)``  one non-causal forward of the B block embeddings ``[bonus, MASK × (B−1)]`` at positions
                  ``ctx_len + [0, B)``: queries from the block only, keys/values = [cached context ; block]. The
                  block's K/V go to scratch slots past ``ctx_len`` and are never committed (the reference's crop).

Sliding layers (``layer_types``) see keys within ``sliding_window`` of the query and are causal inside the block
unless the config overrides it (specs.DrafterSpec.layer_causal).

A speculators-format drafter (``models/speculators.py``) loads into the same module; one with a reduced draft
vocabulary also carries ``draft_head`` (``models/draft_vocab.py``), its own LM head plus the draft-to-target id map,
which ``draft_block`` applies in place of the target's head. A DSpark drafter also carries ``dspark``
(``models/dspark.py``): its Markov head, which ``draft_block`` applies to the block's logits position by position,
and its confidence head, whose per-position estimates ``draft_block(scores=True)`` returns with the drafts.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from torch import nn

from trtllm_dflash.models.draft_vocab import DraftVocabHead
from trtllm_dflash.models.dspark import DSparkHeads
from trtllm_dflash.models.layers import MLP, KVCache, Linear, RMSNorm, RopeAt, Rotary, fused
from trtllm_dflash.models.weights import load_into, read_state_dict
from trtllm_dflash.specs import DrafterSpec, LayerType


class DrafterAttention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_attention_heads, spec.num_key_value_heads, d
        self.q_proj = Linear(h, self.num_heads * d, bias=spec.attention_bias)
        self.k_proj = Linear(h, self.num_kv_heads * d, bias=spec.attention_bias)
        self.v_proj = Linear(h, self.num_kv_heads * d, bias=spec.attention_bias)
        self.o_proj = Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)

    def block_qkv(self, h: torch.Tensor, rope: RopeAt):
        """h: normed block hidden [b, B, hidden] -> Q (q_norm, RoPE) [b, B, heads, d], K (k_norm, RoPE), V
        [b, B, kv_heads, d] at the block's positions (``rope = rotary.at(positions)``, [b, B])."""
        b, bs, _ = h.shape
        q, k, v = fused(h, self.q_proj, self.k_proj, self.v_proj)
        q = self.q_norm(q.view(b, bs, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(b, bs, self.num_kv_heads, self.head_dim))
        v = v.view(b, bs, self.num_kv_heads, self.head_dim)
        return rope.apply(q), rope.apply(k), v

    def context_kv(self, c: torch.Tensor, rope: RopeAt):
        """c: context features [b, T, hidden] -> K (normed, rotated at ``rope``'s positions [b, T]), V: [b, T,
        num_kv_heads, head_dim]."""
        b, t, _ = c.shape
        k, v = fused(c, self.k_proj, self.v_proj)
        k = self.k_norm(k.view(b, t, self.num_kv_heads, self.head_dim))
        return rope.apply(k), v.view(b, t, self.num_kv_heads, self.head_dim)


class DrafterLayer(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.self_attn = DrafterAttention(spec)
        self.mlp = MLP(spec.hidden_size, spec.intermediate_size)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


class DrafterModel(nn.Module):
    def __init__(self, spec: DrafterSpec, dtype: torch.dtype = torch.float32, device="cpu", max_positions=None):
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = Linear(spec.num_taps * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(spec) for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.draft_head = None
        if spec.draft_vocab_size is not None:
            self.draft_head = DraftVocabHead(h, spec.draft_vocab_size, spec.vocab_size)
            # every draft forward (``draft`` and the plugin path's ``plugin.dispatch.draft``) ends in ``norm``: checking
            # there catches any caller that would use the target's head on this drafter (draft_vocab.py)
            self.norm.register_forward_pre_hook(lambda _m, _x: self.draft_head.check_armed())
        self.dspark = None
        if spec.dspark is not None:
            self.dspark = DSparkHeads(spec.dspark, h, spec.vocab_size, spec.draft_vocab_size or spec.vocab_size,
                                      spec.anchor_predicts)
        self.to(dtype=dtype, device=device)
        self.rotary = Rotary(spec.rope, spec.head_dim, max_positions or 32768, dtype, device)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, dtype=torch.float32, device="cpu", max_positions=None):
        from trtllm_dflash.models import speculators

        spec = DrafterSpec.load(model_dir)
        model = cls(spec, dtype=dtype, device=device, max_positions=max_positions)
        if speculators.is_speculators_dir(model_dir):
            speculators.load_into_drafter(model, model_dir)
        else:
            load_into(model, read_state_dict(model_dir), model_dir)
        return model.eval().requires_grad_(False)

    def new_cache(self, num_rows: int, max_len: int) -> KVCache:
        s = self.spec
        return KVCache.allocate(
            s.num_hidden_layers, num_rows, max_len, s.num_key_value_heads, s.head_dim, self.dtype, self.device
        )

    def context_kv(
        self,
        taps: torch.Tensor,  # [b, T, num_taps * hidden] target taps of the tokens to commit
        positions: torch.Tensor,  # [b, T] their absolute positions
    ) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [num_layers, b, T, num_kv_heads, head_dim]
        """KV injection, the stateless half: C = hidden_norm(fc(taps)); per layer K = RoPE(k_norm(k_proj(C))),
        V = v_proj(C). (The Triton ``kv_inject`` model is exactly this.)"""
        c = self.hidden_norm(self.fc(taps.to(self.dtype)))  # [b, T, hidden]
        rope = self.rotary.at(positions)
        ks, vs = zip(*(layer.self_attn.context_kv(c, rope) for layer in self.layers))
        return torch.stack(ks), torch.stack(vs)

    def append_context(
        self,
        k: torch.Tensor,  # [num_layers, b, T, num_kv_heads, head_dim] from context_kv
        v: torch.Tensor,
        num_tokens: torch.Tensor,  # [b] how many of the T tokens each row commits (the rest is padding)
        cache: KVCache,
        rows: torch.Tensor | None = None,  # [b] cache rows; None = all rows in order
    ) -> None:
        """KV injection, the stateful half: write the context K/V at the rows' next positions and commit them."""
        positions = cache.step_positions(rows, k.shape[2])  # [b, T]
        row_idx = cache.row_index(rows)
        for i in range(self.spec.num_hidden_layers):
            cache.write(i, rows, positions, k[i], v[i], row_idx)
        cache.commit(rows, num_tokens)

    def inject(self, taps: torch.Tensor, num_tokens: torch.Tensor, cache: KVCache, rows: torch.Tensor | None = None):
        """KV injection: append the committed tokens' context K/V to every layer's cache and commit them."""
        k, v = self.context_kv(taps, cache.step_positions(rows, taps.shape[1]))
        self.append_context(k, v, num_tokens, cache, rows)

    def draft(
        self,
        block_embeds: torch.Tensor,  # [b, B, hidden] target embeddings of [bonus, MASK × (B−1)]
        cache: KVCache,
        rows: torch.Tensor | None = None,
        static: bool = False,  # over all cache slots, nothing read back to the host (``TargetModel.forward``'s)
    ) -> torch.Tensor:  # [b, B, hidden] final-normed; slot k predicts the token at position ctx_len + k
        b, bs, _ = block_embeds.shape
        rows = rows if static else cache.every_row(rows)
        positions = cache.step_positions(rows, bs, check=not static)  # [b, B]
        kv_len = cache.max_len if static else int(positions[:, -1].max()) + 1
        key_pos = torch.arange(kv_len, device=block_embeds.device)[None, None, :]  # [1, 1, kv_len]
        q_pos = positions[:, :, None]  # [b, B, 1]
        in_range = key_pos <= positions[:, -1:, None]  # [b, 1, kv_len]: committed context + this block
        x = block_embeds.to(self.dtype)
        rope, row_idx, read_rows = self.rotary.at(positions), cache.row_index(rows), KVCache.view_rows(rows)
        for i, layer in enumerate(self.layers):
            allowed = in_range.expand(b, bs, kv_len)
            if self.spec.layer_causal[i]:
                allowed = allowed & (key_pos <= q_pos)
            if self.spec.sliding_window is not None and self.spec.layer_types[i] is LayerType.SLIDING:
                allowed = allowed & (q_pos - key_pos < self.spec.sliding_window)
            attn = layer.self_attn
            q, k, v = attn.block_qkv(layer.input_layernorm(x), rope)
            cache.write(i, rows, positions, k, v, row_idx)  # scratch: past ctx_len, never committed
            x = x + attn.o_proj(cache.attend(i, q.transpose(1, 2), read_rows, kv_len, allowed))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)


def draft_block(
    bonus: torch.Tensor,  # [b] last emitted token of each sequence (its position = the drafter's context length)
    block_size: int,  # the verified block: the bonus and block_size − 1 drafts
    mask_token_id: int,
    embed,  # ids [b, S] -> target embeddings [b, S, hidden]
    forward,  # block embeddings [b, S, hidden] -> final-normed drafter hidden states [b, S, hidden]
    head,  # hidden [b, B−1, hidden] -> target logits [b, B−1, vocab]
    top: int = 1,  # > 1: the ``top`` best tokens of every slot, best first ([b, B−1, top])
    *,
    own_head: DraftVocabHead | None = None,  # the drafter's ``draft_head``: used instead of ``head`` when not None
    heads: DSparkHeads | None = None,  # the drafter's ``dspark`` heads (models/dspark.py), None for plain DFlash
    scores: bool = False,  # also return the confidence head's estimates
):  # [b, B−1] greedy drafts d_1..d_{B−1}, target ids; with ``scores``: (drafts, confidence [b, B−1] or None)
    """One DFlash draft: the block ``[bonus, MASK × (S−1)]`` through the drafter, then greedy through the target's
    head. The callables say where the embedding, the drafter forward (torch or plugin kernels, which cache rows) and
    the head come from; the in-process decoder and the Triton drafter model both draft through this one function.

    The forward has S = B slots, slot k predicting the token at ctx_len + k (slot 0 only carries the bonus); an
    anchor-predicting drafter (``heads.anchor_predicts``, speculators' sample_from_anchor) has S = B − 1, slot k
    predicting ctx_len + k + 1, so the same B − 1 drafts come from a forward one slot shorter.
    With ``own_head`` (a reduced-vocabulary drafter, ``draft_vocab.py``) the greedy or top-``top`` choice is made over
    the drafter's own logits [b, B−1, draft_vocab] and mapped to target ids; ``head`` is then unused. With ``heads``
    the Markov bias is added position by position as the drafts are chosen (``DSparkHeads.chain``)."""
    anchor = heads is not None and heads.anchor_predicts
    slots = max(block_size - 1, 1) if anchor else block_size  # at least the bonus (a timed pass of no drafts)
    block = torch.full((bonus.shape[0], slots), mask_token_id, dtype=torch.long, device=bonus.device)
    block[:, 0] = bonus
    # slots 1..B−1 made contiguous first: with b > 1 rows the [:, 1:] view's rows do not merge into one matrix, and
    # torch.matmul of such a view with a weight that needs no grad runs one GEMM per row, each reading the whole LM
    # head, where one GEMM over a small copy reads it once
    if heads is None and own_head is None:
        logits = head(forward(embed(block))[:, 1:].contiguous())
        drafts = logits.argmax(-1) if top == 1 else logits.topk(top, dim=-1).indices
        return (drafts, None) if scores else drafts
    with own_head.drafting() if own_head is not None else contextlib.nullcontext():
        hidden = forward(embed(block))  # [b, S, hidden]
        predicting = (hidden[:, : block_size - 1] if anchor else hidden[:, 1:]).contiguous()  # [b, B−1, hidden]
        logits = (own_head if own_head is not None else head)(predicting)  # [b, B−1, draft_vocab or vocab]
    to_target = own_head.to_target if own_head is not None else (lambda ids: ids)
    if heads is None:
        drafts, confidence = logits.argmax(-1) if top == 1 else logits.topk(top, dim=-1).indices, None
    else:
        drafts, confidence = heads.chain(predicting, logits, bonus, to_target, None if anchor else hidden[:, 0], top)
    drafts = to_target(drafts)
    return (drafts, confidence) if scores else drafts
