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

``trtllm_dflash/perf/speculators_parity.py`` runs this with the peer interpreter and compares against our loader, for
the tests (tests/models/test_speculators_format.py) and ``perf/drafter_formats.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SEED = 0
NUM_LAYERS = 2
BLOCK_SIZE = 8
DRAFT_VOCAB = 4096
AUX_IDS = [2, 15, 28]  # speculators ids: outputs of target layers 1, 14, 27
MASK_TOKEN_ID = 16
SEQ_LEN = 40
ANCHORS = [5, 17, 30]


def make(out: Path, target: str) -> Path:
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(SEED)
    layer_cfg = create_transformer_layer_config(target, NUM_LAYERS, "qwen3", None, 4096, list(range(NUM_LAYERS)))
    vocab = layer_cfg.vocab_size
    # a draft vocabulary of random target ids, sorted (what build_vocab_mappings_from_distribution returns)
    ids = torch.randperm(vocab)[:DRAFT_VOCAB].sort().values
    d2t = ids - torch.arange(DRAFT_VOCAB)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    model = DFlashDraftModel.from_training_args(
        layer_cfg, t2d=t2d, d2t=d2t, draft_vocab_size=DRAFT_VOCAB, block_size=BLOCK_SIZE,
        verifier_name_or_path=target, target_layer_ids=AUX_IDS, mask_token_id=MASK_TOKEN_ID,
        draft_attn_impl="eager",
    )
    with torch.no_grad():  # a trained-looking drafter: decisive random weights, and an lm_head of its own
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    drafter = out / "drafter"
    model.save_pretrained(str(drafter))
    return run(drafter, out)


def run(drafter: Path, out: Path) -> Path:
    from speculators.models.dflash import DFlashDraftModel

    from speculators.models.attention import create_float_mask

    model = DFlashDraftModel.from_pretrained(str(drafter)).float().eval()
    # eager attention with a dense float mask (what __init__ picks for "eager"); flex attention needs compilation
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    hidden = model.config.transformer_layer_config.hidden_size
    # select_anchors (speculators' dflash/utils.py) takes only anchors a < seq_len − block_size
    seq_len = max(SEQ_LEN, max(ANCHORS) + model.block_size + 1)
    gen = torch.Generator().manual_seed(SEED + 1)
    taps = torch.randn(1, seq_len, len(model.target_layer_ids) * hidden, generator=gen)  # [1, T, taps·H]
    input_ids = torch.randint(0, model.config.transformer_layer_config.vocab_size, (1, seq_len), generator=gen)
    tensors = {"taps": taps, "input_ids": input_ids, "anchors": torch.tensor(ANCHORS)}
    with torch.no_grad():
        for a in ANCHORS:
            loss_mask = torch.zeros(1, seq_len, dtype=torch.long)
            loss_mask[0, a] = 1  # the only valid anchor: select_anchors must pick a
            _, logits, _, _, _ = model._backbone_forward(
                taps, input_ids, loss_mask, torch.zeros(1, seq_len, hidden), torch.zeros(1, seq_len, dtype=torch.long),
                max_anchors=1,
            )  # logits [1, B, draft_vocab]
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--target", required=True)
    r = sub.add_parser("run")
    r.add_argument("drafter", type=Path)
    r.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = make(args.out, args.target) if args.cmd == "make" else run(args.drafter, args.out)
    print(path)
    _ = load_file(str(path))  # readable
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
