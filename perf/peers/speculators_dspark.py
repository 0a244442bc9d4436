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

import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators_common import anchor_forwards, layer_config_and_vocab, load_eager, parse_cli, randomise

BLOCK_SIZE = 6
MARKOV_RANK = 16
AUX_IDS = [2, 4]  # speculators ids: outputs of target layers 1 and 3
MASK_TOKEN_ID = 5


def make(out: Path, target: str, head_type: str, anchor: bool, draft_vocab: int) -> Path:
    from speculators.models.dspark import DSparkDraftModel

    layer_cfg, n, d2t, t2d = layer_config_and_vocab(target, draft_vocab)
    model = DSparkDraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=n, block_size=BLOCK_SIZE, verifier_name_or_path=target,
        target_layer_ids=AUX_IDS, mask_token_id=MASK_TOKEN_ID, draft_attn_impl="eager", markov_rank=MARKOV_RANK,
        markov_head_type=head_type, sample_from_anchor=anchor,
    )
    randomise(model, full_vocab=not draft_vocab)
    drafter = out / "drafter"
    model.save_pretrained(str(drafter))
    return run(drafter, out)


def run(drafter: Path, out: Path) -> Path:
    from speculators.models.dspark import DSparkDraftModel

    model = load_eager(DSparkDraftModel, drafter)
    anchor = model.config.sample_from_anchor
    tensors, forwards = anchor_forwards(model)
    markov, conf, input_ids = model.markov_head, model.confidence_head, tensors["input_ids"]
    with torch.no_grad():
        for a, (hidden, logits) in forwards.items():  # hidden [1, B, H], logits [1, B, draft_vocab]
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
    def heads(m):
        m.add_argument("--head-type", required=True, choices=["vanilla", "gated", "rnn"])
        m.add_argument("--anchor", type=int, choices=[0, 1], required=True)
        m.add_argument("--draft-vocab", type=int, default=0)

    args = parse_cli(argv, __doc__.splitlines()[0], heads)
    if args.cmd == "make":
        print(make(args.out, args.target, args.head_type, bool(args.anchor), args.draft_vocab))
    else:
        print(run(args.drafter, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
