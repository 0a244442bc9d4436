"""The DFlash training objective (dflash.md §3), written with the inference modules so the two cannot drift.

Glossary, for one training sequence of S tokens (prompt of P tokens + target-regenerated response):

    anchor p   a response position with a next token in the response (P <= p <= S − 2). At inference the anchor is
               the bonus token: the last token the target emitted, which the target has not processed yet.
    block      B slots ``[ids[p], MASK × (B − 1)]`` at absolute positions p .. p + B − 1, embedded with the target's
               frozen embedding table.
    context    target taps of positions 0 .. S − 1, fused as C = hidden_norm(fc(taps)) and projected by every drafter
               layer's own k_proj / v_proj (KV injection), at their absolute positions.
    visibility a block's queries see context keys at positions **strictly < p** (the anchor's own taps do not exist
               yet at inference) and the B keys of their own block (bidirectional; causal only on causal/sliding
               layers); never another block.
    labels     same-position prediction: slot k (1 <= k <= B − 1) predicts ids[p + k] (or a
               sample's own ``labels``, train/textsrc.py); slot 0 has no label; slots
               past the end of the sequence are ignored.
    loss       Σ w_k · CE_k / Σ w_k over labelled slots, w_k = exp(−(k − 1) / γ); logits through the target's frozen
               LM head.

This is exactly ``DrafterModel.inject`` + ``DrafterModel.draft`` run for every anchor at once: a block anchored at p
equals an inference draft step with p committed tokens (tests/train/test_train_objective.py checks the equality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.layers import attention, widen
from trtllm_dflash.specs import LayerType


@dataclass(frozen=True, slots=True)
class Batch:
    """``n`` sequences (right-padded to S) and ``A`` anchors each; anchor slots past a sequence's count are padding."""

    ids: torch.Tensor  # [n, S] int64 prompt + response tokens
    taps: torch.Tensor  # [n, S, K·H] target taps
    anchors: torch.Tensor  # [n, A] int64 anchor positions
    anchor_valid: torch.Tensor  # [n, A] bool (False = padding block, no loss)
    lengths: torch.Tensor  # [n] int64 real tokens per sequence
    ctx_len: int  # context keys any block can see (its last anchor; >= 1), known on the host
    topk_ids: torch.Tensor | None = None  # [n, S, k] the target's top-k next tokens per position (data.Sample)
    topk_logits: torch.Tensor | None = None  # [n, S, k]
    labels: torch.Tensor | None = None  # [n, S] what each position is trained to be, where it is not ``ids``


def sample_anchors(prompt_len: int, seq_len: int, num_anchors: int, generator: torch.Generator) -> torch.Tensor:
    """Up to ``num_anchors`` distinct positions p with P <= p <= S − 2, uniformly without replacement, sorted."""
    candidates = torch.arange(prompt_len, seq_len - 1)  # anchor and its next token are response tokens
    if len(candidates) <= num_anchors:
        return candidates
    pick = torch.randperm(len(candidates), generator=generator)[:num_anchors]
    return candidates[pick].sort().values


def collate(samples, anchors: list[torch.Tensor], device, dtype: torch.dtype = torch.float32,
            tap_scale: torch.Tensor | None = None) -> Batch:
    """samples: list of data.Sample; anchors[i]: [a_i] positions (on the host) from ``sample_anchors``; taps cast to
    ``dtype`` and multiplied by ``tap_scale`` [K·H] if given (see ``tap_standardizer``). The taps are gathered where
    they are (a GPU run's online taps, ``regen.with_taps``, never leave the device) and then moved to ``device``.
    Host tensors go to the device without a wait (``non_blocking`` from pageable memory: staged at once, and the
    stream is not synchronised as a blocking copy's would be)."""
    n, s_max, a_max = len(samples), max(len(x.ids) for x in samples), max(1, max(len(a) for a in anchors))
    width = samples[0].taps.shape[1]

    def moved(t: torch.Tensor) -> torch.Tensor:
        return t.to(device, non_blocking=True)

    ids = torch.zeros(n, s_max, dtype=torch.long)
    taps = torch.zeros(n, s_max, width, dtype=dtype, device=samples[0].taps.device)
    anc = torch.zeros(n, a_max, dtype=torch.long)
    valid = torch.zeros(n, a_max, dtype=torch.bool)
    for i, (x, a) in enumerate(zip(samples, anchors)):
        ids[i, : len(x.ids)] = x.ids
        taps[i, : len(x.ids)] = x.taps.to(dtype)
        anc[i, : len(a)] = a
        valid[i, : len(a)] = True
    taps = moved(taps)
    if tap_scale is not None:  # the scale lives on the training device (taps from disk are built on the host)
        taps = taps * tap_scale.to(device, dtype)
    lengths = torch.tensor([len(x.ids) for x in samples])
    labels = None
    if any(x.labels is not None for x in samples):
        labels = torch.zeros(n, s_max, dtype=torch.long)
        for i, x in enumerate(samples):
            labels[i, : len(x.ids)] = x.label_ids
        labels = moved(labels)
    topk_ids = topk_logits = None
    if all(x.topk_ids is not None for x in samples):
        k = samples[0].topk_ids.shape[1]
        topk_ids = torch.zeros(n, s_max, k, dtype=torch.long)
        topk_logits = torch.full((n, s_max, k), float("-inf"))
        for i, x in enumerate(samples):
            topk_ids[i, : len(x.ids)] = x.topk_ids.long()
            topk_logits[i, : len(x.ids)] = x.topk_logits.float()
        topk_ids, topk_logits = moved(topk_ids), moved(topk_logits)
    ctx_len = max([1] + [int(a.max()) for a in anchors if len(a)])  # host tensors: no device read
    return Batch(moved(ids), taps, moved(anc), moved(valid), moved(lengths), ctx_len, topk_ids, topk_logits, labels)


def tap_standardizer(samples) -> torch.Tensor:  # [K·H]
    """Per-channel 1 / RMS of the target taps over ``samples``.

    Transformer residual streams carry a few "massive activation" channels (SmolLM2's: RMS orders of magnitude above
    the median channel's, a handful of channels holding nearly all the energy). Through a randomly initialised ``fc``
    and ``hidden_norm`` they would make every context feature nearly the same vector, and Adam's per-weight steps on
    those columns would be huge. Training therefore feeds standardised taps (taps · scale) to ``fc`` and the export
    folds the scale into its weight (``fc.weight · scale``), so the shipped drafter reads raw taps with exactly the
    same result."""
    total, count = None, 0
    for x in samples:
        t = x.taps[:-1].float()  # the last row holds no taps (data.py)
        sq = t.pow(2).sum(0)
        total = sq if total is None else total + sq
        count += t.shape[0]
    rms = (total / max(count, 1)).sqrt()
    return 1.0 / rms.clamp(min=1e-3)


def block_visibility(
    anchors: torch.Tensor,  # [b] anchor position of each block
    ctx_len: int,  # context keys at positions 0 .. ctx_len − 1
    block_size: int,
    causal: bool,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [b, B, ctx_len + B] bool: block query slot j may see key
    """Keys are [context positions 0..ctx_len−1 ; this block's own B slots]. Worked example, anchor 3, B = 2,
    ctx_len 5, not causal: slot rows see context keys 0, 1, 2 (< 3; not 3, the anchor's own taps, nor 4) and both
    block keys: [[1,1,1,0,0, 1,1], [1,1,1,0,0, 1,1]]."""
    ctx_pos = torch.arange(ctx_len, device=anchors.device)
    q_pos = anchors[:, None] + torch.arange(block_size, device=anchors.device)  # [b, B]
    key_pos = torch.cat([ctx_pos.expand(len(anchors), ctx_len), q_pos], dim=1)  # [b, ctx_len + B]
    see_ctx = (ctx_pos[None, :] < anchors[:, None])[:, None, :].expand(-1, block_size, -1)  # [b, B, ctx_len]
    see_block = torch.ones(len(anchors), block_size, block_size, dtype=torch.bool, device=anchors.device)
    if causal:
        see_block = see_block.tril()
    allowed = torch.cat([see_ctx, see_block], dim=2)
    if sliding_window is not None:
        allowed = allowed & (q_pos[:, :, None] - key_pos[:, None, :] < sliding_window)
    return allowed


def packed_block_attention(
    q: torch.Tensor,  # [n·A, B, heads, d] block queries, A blocks per sequence
    k: torch.Tensor,  # [n·A, B, kv, d] block keys
    v: torch.Tensor,  # [n·A, B, kv, d]
    ck: torch.Tensor,  # [n, T, kv, d] context keys of each sequence (shared by its A blocks)
    cv: torch.Tensor,  # [n, T, kv, d]
    allowed: torch.Tensor,  # [n·A, B, T + B] bool, as block_visibility
) -> torch.Tensor:  # [n·A, B, heads·d]
    """``layers.attention`` over [context ; own block] keys without copying the context K/V once per block: the A
    blocks of a sequence attend to its one context K/V in a single matmul, their own B keys in a batched one, and the
    two score sets share one softmax. Same result as ``attention(q, cat(ck[owner], k), cat(cv[owner], v), allowed)``
    (tests/train/test_train_objective.py)."""
    n, t, kv, d = ck.shape
    b, bs, h, _ = q.shape
    a, g = b // n, h // kv
    qg = q.reshape(n, a, bs, kv, g, d).permute(0, 3, 4, 1, 2, 5)  # [n, kv, g, A, B, d]
    s_ctx = torch.matmul(qg.reshape(n, kv, g * a * bs, d), ck.permute(0, 2, 3, 1).to(q.dtype))  # [n, kv, g·A·B, T]
    kb = k.reshape(n, a, bs, kv, d).permute(0, 3, 1, 4, 2)[:, :, None]  # [n, kv, 1, A, d, B]
    s_blk = torch.matmul(qg, kb.to(q.dtype))  # [n, kv, g, A, B, B]
    scores = torch.cat([s_ctx.view(n, kv, g, a, bs, t), s_blk], dim=-1) * d**-0.5  # [n, kv, g, A, B, T + B]
    mask = allowed.view(n, 1, 1, a, bs, t + bs)
    probs = torch.softmax(widen(scores).masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)
    p_ctx, p_blk = probs[..., :t], probs[..., t:]
    out = torch.matmul(p_ctx.reshape(n, kv, g * a * bs, t), cv.permute(0, 2, 1, 3).to(q.dtype))  # [n, kv, g·A·B, d]
    vb = v.reshape(n, a, bs, kv, d).permute(0, 3, 1, 2, 4)[:, :, None]  # [n, kv, 1, A, B, d]
    out = out.view(n, kv, g, a, bs, d) + torch.matmul(p_blk, vb.to(q.dtype))  # [n, kv, g, A, B, d]
    return out.permute(0, 3, 4, 1, 2, 5).reshape(b, bs, h * d)


def drafter_blocks(
    drafter: DrafterModel,
    embed,  # target embedding: ids [..] -> [.., H]
    batch: Batch,
    packed: bool = True,  # False: the per-block context copy (the reference formulation, kept for benchmarks)
    block_size: int | None = None,  # B (default: the drafter's): blocks of [ids[p], MASK × (B − 1)], as decoding at B
) -> torch.Tensor:  # [n·A, B, H] final-normed drafter hidden states of every block
    spec = drafter.spec
    n, s = batch.ids.shape
    a, bs = batch.anchors.shape[1], block_size or spec.block_size
    ctx_len = batch.ctx_len  # keys beyond the last anchor are never visible
    owner = torch.arange(n, device=batch.ids.device).repeat_interleave(a)  # [b]: sequence of each block
    anchors = batch.anchors.reshape(-1)  # [b]
    b = len(anchors)

    c = drafter.hidden_norm(drafter.fc(batch.taps[:, :ctx_len].to(drafter.dtype)))  # [n, ctx_len, H]
    ctx_positions = torch.arange(ctx_len, device=c.device).expand(n, ctx_len)  # [n, ctx_len]
    positions = anchors[:, None] + torch.arange(bs, device=c.device)  # [b, B]
    block = torch.full((b, bs), spec.mask_token_id, dtype=torch.long, device=c.device)
    block[:, 0] = batch.ids.gather(1, batch.anchors).reshape(-1)  # [b, B] = [ids[p], MASK × (B − 1)]
    x = embed(block).to(drafter.dtype)  # [b, B, H]
    ctx_rope, rope = drafter.rotary.at(ctx_positions), drafter.rotary.at(positions)
    for i, layer in enumerate(drafter.layers):
        attn = layer.self_attn
        sliding = spec.layer_types[i] is LayerType.SLIDING
        allowed = block_visibility(anchors, ctx_len, bs, spec.layer_causal[i], spec.sliding_window if sliding else None)
        ck, cv = attn.context_kv(c, ctx_rope)  # [n, ctx_len, kv, d] each
        h = layer.input_layernorm(x)
        q = attn.q_norm(attn.q_proj(h).view(b, bs, attn.num_heads, attn.head_dim))
        k = attn.k_norm(attn.k_proj(h).view(b, bs, attn.num_kv_heads, attn.head_dim))
        v = attn.v_proj(h).view(b, bs, attn.num_kv_heads, attn.head_dim)
        q, k = rope.apply(q), rope.apply(k)
        if packed:
            x = x + attn.o_proj(packed_block_attention(q, k, v, ck, cv, allowed))
        else:
            k_all = torch.cat([ck[owner], k], dim=1).transpose(1, 2)  # [b, kv, ctx_len + B, d]
            v_all = torch.cat([cv[owner], v], dim=1).transpose(1, 2)
            x = x + attn.o_proj(attention(q.transpose(1, 2), k_all, v_all, allowed))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


@dataclass(frozen=True, slots=True)
class StepMetrics:
    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B − 1] correct predictions per slot k = 1..B−1
    counted: torch.Tensor  # [B − 1] labelled slots per k
    expected_tau: torch.Tensor  # scalar: mean over blocks of 1 + (longest all-correct prefix of slots 1..B−1)


def loss_weights(block_size: int, gamma: float, device=None) -> torch.Tensor:  # [B − 1]
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


def dflash_loss(drafter: DrafterModel, embed, lm_head, batch: Batch, gamma: float,
                vocab: torch.Tensor | None = None, packed: bool = True, distill: float = 0.0,
                tv: float = 0.0) -> StepMetrics:
    """The per-slot term is ``(1 − distill − tv) · CE(hard label) + distill · CE(p, q) + tv · TV(p, q)``, where q is
    the drafter's softmax and p the target's own next-token distribution renormalised over its stored top-k
    (``batch.topk_*``): ``distill`` weighs self-distillation, ``tv`` the total-variation distance
    ½ Σ |p − q| = ½ (Σ_top-k |p_i − q_i| + 1 − Σ_top-k q_i) (p is zero outside its top-k). TV is 1 minus the chance
    that a draft sampled from q equals one sampled from p, the quantity speculative acceptance depends on; the
    small-target trainers weight it 0.9 with 0.1 CE. Both soft terms need the full vocabulary (``vocab=None``).
``lm_head``: the target's frozen head, a Linear. ``vocab`` [V'] (sorted token ids, every label among them)
    restricts the softmax to those candidates — a CPU economy, since the head over all slots dominates the cost; the
    drafter's inference argmax still runs over the full vocabulary, so held-out metrics use ``vocab=None``.
    Reads nothing back to the host (on a GPU the next step's launches queue behind this one's kernels)."""
    bs = drafter.spec.block_size
    hidden = drafter_blocks(drafter, embed, batch, packed)  # [b, B, H]
    anchors = batch.anchors.reshape(-1)  # [b]
    owner_len = batch.lengths.repeat_interleave(batch.anchors.shape[1])  # [b]
    label_pos = anchors[:, None] + torch.arange(1, bs, device=anchors.device)  # [b, B − 1]
    labelled = (label_pos < owner_len[:, None]) & batch.anchor_valid.reshape(-1)[:, None]  # [b, B − 1]
    owner = torch.arange(batch.ids.shape[0], device=anchors.device).repeat_interleave(batch.anchors.shape[1])
    source = batch.ids if batch.labels is None else batch.labels
    labels = source[owner[:, None], label_pos.clamp(max=batch.ids.shape[1] - 1)]  # [b, B − 1]
    if vocab is None:
        logits = lm_head(hidden[:, 1:]).float()  # [b, B − 1, V]
    else:
        logits = F.linear(hidden[:, 1:], lm_head.weight[vocab]).float()  # [b, B − 1, V']
        labels = torch.searchsorted(vocab, labels)  # token id -> candidate index
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    if distill > 0 or tv > 0:
        if batch.topk_ids is None or vocab is not None:
            raise ValueError("distill or tv > 0 needs top-k target logits in the data and the full-vocabulary loss")
        rows = (label_pos - 1).clamp(max=batch.ids.shape[1] - 1)  # row j holds the prediction of token j + 1
        t_ids = batch.topk_ids[owner[:, None], rows]  # [b, B − 1, k]
        t_p = torch.softmax(batch.topk_logits[owner[:, None], rows], dim=-1).nan_to_num(0.0)  # padding rows: 0
        logq = torch.log_softmax(logits, dim=-1)  # [b, B − 1, V]
        soft = torch.zeros_like(ce)
        if distill > 0:
            soft = soft - distill * (t_p * logq.gather(-1, t_ids)).sum(-1)
        if tv > 0:
            q_top = logq.gather(-1, t_ids).exp()  # [b, B − 1, k]
            soft = soft + tv * 0.5 * ((t_p - q_top).abs().sum(-1) + (1 - q_top.sum(-1)).clamp(min=0))
        ce = (1 - distill - tv) * ce + soft
    w = loss_weights(bs, gamma, anchors.device)[None, :] * labelled  # [b, B − 1]
    loss = (ce * w).sum() / w.sum().clamp(min=1e-9)
    with torch.no_grad():
        hit = (logits.argmax(-1) == labels) & labelled  # [b, B − 1]
        valid_blocks = batch.anchor_valid.reshape(-1)
        prefix = hit.long().cumprod(1).sum(1)  # [b]: accepted drafts if the target agreed with the labels
        tau = ((prefix + 1) * valid_blocks).sum().float() / valid_blocks.sum()  # NaN without a valid block
    return StepMetrics(loss, hit.sum(0), labelled.sum(0), tau)
