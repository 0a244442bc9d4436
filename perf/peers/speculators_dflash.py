"""Runs INSIDE the peer venv ``.peers/speculators`` (build_scripts/peer_speculators.sh), never in .venv.

Two commands, both with speculators 0.9.0's own classes and forward:

``make OUT --target DIR``  builds a small random speculators ``DFlashDraftModel`` for the target with a reduced draft
                          vocabulary (``from_training_args`` with its own ``create_transformer_layer_config``, t2d/d2t
                          made the way ``build_vocab_mappings_from_distribution`` makes them), saves it with its own
                          ``save_pretrained`` into OUT/drafter, then does ``run`` on it.
``run DRAFTER OUT``        loads DRAFTER with ``DFlashDraftModel.from_pretrained`` (embeddings from the verifier path
                          in its config) and drafts one block per anchor through ``_backbone_forward`` (the training
                          forward, eager attention, one anchor: the block sees exactly the context before it, which is
                          the inference arrangement); writes OUT/peer_io.safetensors: the inputs (taps, input_ids,
                          anchors) and per anchor the draft logits [B, draft_vocab] and drafted target ids [B].

``perf/_lib/speculators_parity.py`` runs this with the peer interpreter and compares against our loader, for
the tests (tests/models/test_speculators_format.py) and ``perf/drafter_formats.py``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from speculators_common import anchor_forwards, layer_config_and_vocab, load_eager, parse_cli, randomise

BLOCK_SIZE = 8
DRAFT_VOCAB = 4096
AUX_IDS = [2, 15, 28]  # speculators ids: outputs of target layers 1, 14, 27
MASK_TOKEN_ID = 16


def make(out: Path, target: str) -> Path:
    from speculators.models.dflash import DFlashDraftModel

    layer_cfg, n, d2t, t2d = layer_config_and_vocab(target, DRAFT_VOCAB)
    model = DFlashDraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=n, block_size=BLOCK_SIZE, verifier_name_or_path=target,
        target_layer_ids=AUX_IDS, mask_token_id=MASK_TOKEN_ID, draft_attn_impl="eager",
    )
    randomise(model, full_vocab=False)  # with an lm_head of its own
    drafter = out / "drafter"
    model.save_pretrained(str(drafter))
    return run(drafter, out)


def run(drafter: Path, out: Path) -> Path:
    from speculators.models.dflash import DFlashDraftModel

    model = load_eager(DFlashDraftModel, drafter)
    tensors, forwards = anchor_forwards(model)
    for a, (_, logits) in forwards.items():  # logits [1, B, draft_vocab]
        draft = logits[0].argmax(-1)  # [B] draft ids
        mapped = draft + model.d2t[draft] if model.d2t is not None else draft  # [B] target ids
        tensors[f"logits_{a}"] = logits[0].contiguous()
        tensors[f"tokens_{a}"] = mapped.contiguous()
    path = out / "peer_io.safetensors"
    save_file(tensors, str(path))
    json.dump({"block_size": model.block_size, "mask_token_id": model.mask_token_id},
              open(out / "peer_meta.json", "w"))
    return path


def main(argv: list[str]) -> int:
    args = parse_cli(argv, __doc__.splitlines()[0])
    path = make(args.out, args.target) if args.cmd == "make" else run(args.drafter, args.out)
    print(path)
    _ = load_file(str(path))  # readable
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
