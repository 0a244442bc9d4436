"""Runs INSIDE the peer venv ``.peers/speculators`` (build_scripts/peer_speculators.sh), never in .venv.

``make OUT --target DIR --head-type T --anchor 0|1 --draft-vocab N`` builds a small random speculators
``DSparkDraftModel`` (its own ``from_training_args``, Markov head of type T, confidence head on the Markov embedding,
``sample_from_anchor`` as given, a reduced draft vocabulary of N random target ids or, with N = 0, the full one),
saves it with its own ``save_pretrained`` into OUT/drafter, loads it back with ``from_pretrained`` and drafts one
block per anchor with its own modules:

- the backbone through ``_backbone_forward`` (the training forward, eager attention, one anchor: the block sees
  exactly the context before it, which is the inference arrangement), giving the block's hidden states and logits;
- the Markov chain left to right: the bias of each predicting slot from ``markov_head.block_bias`` over the block's
  previous tokens so far (the bonus, then the drafts chosen, mapped to target ids with its ``d2t``: what training
  teacher-forces), the greedy draft, and ``confidence_head`` over ``[hidden ; prev_embeddings]``, as its
  ``forward`` builds them.

``run DRAFTER OUT`` does the loading and drafting alone, on a DSpark directory written by someone else (ours).

Writes OUT/peer_io.safetensors: the inputs (taps, input_ids, anchors) and per anchor the corrected logits
[K, draft_vocab] of the K predicting slots, the drafted target ids [K] and the confidence [K] (sigmoid of the head).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

SEED = 0
NUM_LAYERS = 2
BLOCK_SIZE = 6
MARKOV_RANK = 16
AUX_IDS = [2, 4]  # speculators ids: outputs of target layers 1 and 3
MASK_TOKEN_ID = 5
SEQ_LEN = 40
ANCHORS = [5, 17, 30]


def make(out: Path, target: str, head_type: str, anchor: bool, draft_vocab: int) -> Path:
    from speculators.models.dspark import DSparkDraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(SEED)
    layer_cfg = create_transformer_layer_config(target, NUM_LAYERS, "qwen3", None, 4096, list(range(NUM_LAYERS)))
    vocab = layer_cfg.vocab_size
    n = draft_vocab or vocab
    t2d = d2t = None
    if draft_vocab:  # random target ids, sorted (what build_vocab_mappings_from_distribution returns)
        ids = torch.randperm(vocab)[:n].sort().values
        d2t = ids - torch.arange(n)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[ids] = True
    model = DSparkDraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=n, block_size=BLOCK_SIZE, verifier_name_or_path=target,
        target_layer_ids=AUX_IDS, mask_token_id=MASK_TOKEN_ID, draft_attn_impl="eager", markov_rank=MARKOV_RANK,
        markov_head_type=head_type, sample_from_anchor=anchor,
    )
    with torch.no_grad():  # a trained-looking drafter: decisive random weights; Markov weights large enough to matter
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")) or (name == "lm_head.weight" and not draft_vocab):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.6 if name.startswith("markov_head.") else 0.15)
    drafter = out / "drafter"
    model.save_pretrained(str(drafter))
    return run(drafter, out)


def run(drafter: Path, out: Path) -> Path:
    from speculators.models.attention import create_float_mask
    from speculators.models.dspark import DSparkDraftModel

    model = DSparkDraftModel.from_pretrained(str(drafter)).float().eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    hidden_size = model.config.transformer_layer_config.hidden_size
    anchor = model.config.sample_from_anchor
    # select_anchors (speculators' dflash/utils.py) takes only anchors a < seq_len − block_size
    seq_len = max(SEQ_LEN, max(ANCHORS) + model.block_size + 1)
    gen = torch.Generator().manual_seed(SEED + 1)
    taps = torch.randn(1, seq_len, len(model.target_layer_ids) * hidden_size, generator=gen)  # [1, T, taps·H]
    input_ids = torch.randint(0, model.config.transformer_layer_config.vocab_size, (1, seq_len), generator=gen)
    tensors = {"taps": taps, "input_ids": input_ids, "anchors": torch.tensor(ANCHORS)}
    markov, conf = model.markov_head, model.confidence_head
    with torch.no_grad():
        for a in ANCHORS:
            loss_mask = torch.zeros(1, seq_len, dtype=torch.long)
            loss_mask[0, a] = 1  # the only valid anchor: select_anchors must pick a
            hidden, logits, _, _, _ = model._backbone_forward(
                taps, input_ids, loss_mask, torch.zeros(1, seq_len, hidden_size),
                torch.zeros(1, seq_len, dtype=torch.long), max_anchors=1,
            )  # hidden [1, B, H], logits [1, B, draft_vocab]
            bonus = int(input_ids[0, a])
            # previous token of slot k: the token at position a + k (sample_from_anchor) or a + k − 1 (slot 0's: a)
            prev = [bonus] if anchor else [bonus, bonus]
            rows, drafted, confidence = [], [], []
            for k in range(0 if anchor else 1, model.block_size):
                prev_ids = torch.tensor([prev[: k + 1]])  # [1, k + 1]
                bias = markov.block_bias(prev_token_ids=prev_ids, hidden_states=hidden[:, : k + 1])  # [1, k+1, V']
                row = logits[0, k] + bias[0, k]
                d = int(row.argmax())
                t = d + int(model.d2t[d]) if model.d2t is not None else d
                emb = markov.prev_embeddings(prev_ids)[:, k]  # [1, r]
                confidence.append(torch.sigmoid(conf(torch.cat([hidden[:, k], emb.to(hidden.dtype)], dim=-1)))[0])
                rows.append(row)
                drafted.append(t)
                prev.append(t)
            tensors[f"logits_{a}"] = torch.stack(rows).contiguous()
            tensors[f"tokens_{a}"] = torch.tensor(drafted)
            tensors[f"conf_{a}"] = torch.stack(confidence).contiguous()
    path = out / "peer_io.safetensors"
    save_file(tensors, str(path))
    return path


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--target", required=True)
    m.add_argument("--head-type", required=True, choices=["vanilla", "gated", "rnn"])
    m.add_argument("--anchor", type=int, choices=[0, 1], required=True)
    m.add_argument("--draft-vocab", type=int, default=0)
    r = sub.add_parser("run")
    r.add_argument("drafter", type=Path)
    r.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.cmd == "make":
        print(make(args.out, args.target, args.head_type, bool(args.anchor), args.draft_vocab))
    else:
        print(run(args.drafter, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
