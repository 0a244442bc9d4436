"""DSpark's two heads on a DFlash drafter: the low-rank Markov logit bias and the confidence head.

DSpark (arXiv 2607.05147; vLLM ``speculators`` 0.9.0 ``models/dspark/``) keeps the DFlash backbone, which drafts a
whole block in one non-causal forward, and adds

  Markov head      a bias on each drafted position's logits from the token before that position:
                   bias = W2 · e, e = W1[previous token] (W1 [verifier_vocab, r], W2 [draft_vocab, r]), in one of
                   three forms (``markov_head_type``):
                     vanilla  W2 · e
                     gated    W2 · (σ(G · [h ; e] + g) ⊙ e)                        h: the slot's final-normed hidden
                     rnn      s_k = z ⊙ s_{k−1} + (1 − z) ⊙ tanh(c),  bias = W2 · tanh(o),
                              [z_raw ; c ; o] = J · [s_{k−1} ; e ; h] + j,  z = σ(z_raw),  s_0 = 0
  confidence head  σ(P · [h ; e] + p) (or σ(P · h + p) without ``confidence_with_markov``): the estimated
                   probability that the position is accepted given the ones before it were (trained against
                   1 − TV(draft, target), speculators ``models/dspark/metrics.py``).

Training teacher-forces the previous tokens; drafting chains them: the first drafted position's previous token is
the bonus, every later one's is the draft chosen just before it, so the block's positions are picked left to right
(``DSparkHeads.chain``, called by ``drafter.draft_block`` after the one backbone forward). With ``top`` > 1 the
alternatives of every position are ranked with the bias of the greedy chain's previous token.

Parameter names are speculators' (``markov_head.markov_w1.weight``, ``markov_head.markov_w2.weight``,
``markov_head.gate_proj.*``, ``markov_head.joint_proj.*``, ``confidence_head.proj.*``) under ``DrafterModel.dspark``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from trtllm_dflash.models.layers import Linear
from trtllm_dflash.specs import DSparkSpec


class MarkovHead(nn.Module):
    def __init__(self, verifier_vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int,
                 head_type: str) -> None:
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(verifier_vocab_size, rank)  # [V, r]: indexed by the previous (target) id
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)  # [V', r]
        if head_type == "gated":
            self.gate_proj = Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank)

    def prev_embeddings(self, token_ids: torch.Tensor) -> torch.Tensor:  # [...] target ids -> [..., r]
        return self.markov_w1(token_ids.long())

    def step(self, e: torch.Tensor, h: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One position: e [b, r] the previous token's embedding, h [b, H] the slot's hidden, state [b, r] (rnn
        only) -> (bias [b, V'], the next state)."""
        w = self.markov_w2.weight
        e = e.to(w.dtype)
        if self.head_type == "vanilla":
            return self.markov_w2(e), state
        h = h.to(w.dtype)
        if self.head_type == "gated":
            return self.markov_w2(torch.sigmoid(self.gate_proj(torch.cat([h, e], dim=-1))) * e), state
        gate_raw, cand_raw, out_raw = self.joint_proj(torch.cat([state, e, h], dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        state = gate * state + (1.0 - gate) * torch.tanh(cand_raw)
        return self.markov_w2(torch.tanh(out_raw)), state


class ConfidenceHead(nn.Module):
    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = Linear(input_dim, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:  # [..., input_dim] -> probabilities [...]
        return torch.sigmoid(self.proj(features.to(self.proj.weight.dtype)).squeeze(-1))


class DSparkHeads(nn.Module):
    """The Markov head (None at ``markov_rank`` 0) and the confidence head (None when disabled) of one drafter."""

    def __init__(self, spec: DSparkSpec, hidden_size: int, verifier_vocab_size: int, draft_vocab_size: int,
                 anchor_predicts: bool) -> None:
        super().__init__()
        self.spec, self.anchor_predicts = spec, anchor_predicts
        self.markov_head = None
        if spec.markov_rank > 0:
            self.markov_head = MarkovHead(verifier_vocab_size, draft_vocab_size, spec.markov_rank, hidden_size,
                                          spec.markov_head_type)
        self.confidence_head = None
        if spec.confidence_head:
            self.confidence_head = ConfidenceHead(hidden_size + (spec.markov_rank if spec.confidence_with_markov
                                                                 else 0))

    def chain(
        self,
        hidden: torch.Tensor,  # [b, K, H] final-normed hidden states of the K slots that predict a draft
        logits: torch.Tensor,  # [b, K, V'] their backbone logits (draft vocabulary V', or the target's)
        bonus: torch.Tensor,  # [b] target id of the bonus: the token before the first drafted position
        to_target: Callable[[torch.Tensor], torch.Tensor],  # draft-vocabulary ids -> target ids
        lead: torch.Tensor | None = None,  # [b, H] the bonus slot's hidden when it predicts nothing (rnn steps it)
        top: int = 1,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # ids [b, K] (or [b, K, top]) in V', confidence [b, K] or None
        """The block's drafts chosen left to right with the Markov bias of each position's previous token, and each
        position's confidence (module docstring)."""
        markov, conf = self.markov_head, self.confidence_head
        if markov is None or hidden.shape[1] == 0:  # no dependence between positions (or no position at all)
            ids = logits.argmax(-1) if top == 1 else logits.topk(top, dim=-1).indices
            if conf is None:
                return ids, None
            return ids, conf(hidden) if markov is None else hidden.new_zeros(hidden.shape[:2])
        b, num, _ = hidden.shape
        state = None
        if markov.head_type == "rnn":
            state = hidden.new_zeros(b, markov.rank, dtype=markov.markov_w2.weight.dtype)
            if lead is not None:  # training steps the state over the bonus slot too (its previous token: the bonus)
                _, state = markov.step(markov.prev_embeddings(bonus), lead, state)
        prev, picks, confidence = bonus, [], []
        for k in range(num):
            e = markov.prev_embeddings(prev)  # [b, r]
            bias, state = markov.step(e, hidden[:, k], state)
            scores = logits[:, k] + bias.to(logits.dtype)  # [b, V']
            pick = scores.topk(top, dim=-1).indices if top > 1 else scores.argmax(-1, keepdim=True)  # [b, top]
            picks.append(pick if top > 1 else pick[:, 0])
            if conf is not None:
                h = hidden[:, k]
                confidence.append(conf(torch.cat([h, e.to(h.dtype)], dim=-1) if self.spec.confidence_with_markov
                                       else h))
            prev = to_target(pick[:, 0])
        return torch.stack(picks, dim=1), (torch.stack(confidence, dim=1) if confidence else None)
