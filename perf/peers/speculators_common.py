"""Runs INSIDE the peer venv ``.peers/speculators``: what ``speculators_dflash.py`` and ``speculators_dspark.py``
share. Building a random drafter with speculators 0.9.0's own helpers, loading one for eager drafting, and running
its training forward (``_backbone_forward``) on one anchor at a time, which is the inference arrangement: the block
sees exactly the context before it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

SEED = 0
NUM_LAYERS = 2
SEQ_LEN = 40
ANCHORS = [5, 17, 30]


def layer_config_and_vocab(target: str, draft_vocab: int):
    """(transformer_layer_config for ``target``, draft vocabulary size, d2t, t2d): ``draft_vocab`` random target ids,
    sorted (what speculators' ``build_vocab_mappings_from_distribution`` returns), or with 0 the full vocabulary
    (no tables)."""
    from speculators.train.cli import create_transformer_layer_config

    torch.manual_seed(SEED)
    layer_cfg = create_transformer_layer_config(target, NUM_LAYERS, "qwen3", None, 4096, list(range(NUM_LAYERS)))
    vocab = layer_cfg.vocab_size
    if not draft_vocab:
        return layer_cfg, vocab, None, None
    ids = torch.randperm(vocab)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return layer_cfg, draft_vocab, ids - torch.arange(draft_vocab), t2d


@torch.no_grad()
def randomise(model, full_vocab: bool) -> None:
    """A trained-looking drafter: decisive random weights (std 0.15), Markov weights large enough to change drafts
    (std 0.6); the verifier's tensors kept, and the head too where it is the verifier's (full vocabulary)."""
    for name, p in model.named_parameters():
        if name.startswith(("embed_tokens", "verifier_")) or (name == "lm_head.weight" and full_vocab):
            continue
        if name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            p.normal_(0.0, 0.6 if name.startswith("markov_head.") else 0.15)


def load_eager(model_class, drafter):
    """``model_class.from_pretrained(drafter)`` in float32 with eager attention and a dense float mask (what
    ``__init__`` picks for "eager"); flex attention needs compilation."""
    from speculators.models.attention import create_float_mask

    model = model_class.from_pretrained(str(drafter)).float().eval()
    model.config.transformer_layer_config._attn_implementation = "eager"
    model._attn_impl, model._create_mask_fn = "eager", create_float_mask
    return model


def anchor_forwards(model):
    """Random taps and input ids long enough for every anchor's block, and per anchor the training forward's
    (hidden [1, B, H], logits [1, B, draft_vocab]) with that anchor alone. Returns (tensors, {anchor: (hidden,
    logits)}); ``tensors`` holds the inputs (taps, input_ids, anchors) for ``peer_io.safetensors``."""
    hidden_size = model.config.transformer_layer_config.hidden_size
    # select_anchors (speculators' dflash/utils.py) takes only anchors a < seq_len − block_size
    seq_len = max(SEQ_LEN, max(ANCHORS) + model.block_size + 1)
    gen = torch.Generator().manual_seed(SEED + 1)
    taps = torch.randn(1, seq_len, len(model.target_layer_ids) * hidden_size, generator=gen)  # [1, T, taps·H]
    input_ids = torch.randint(0, model.config.transformer_layer_config.vocab_size, (1, seq_len), generator=gen)
    out = {}
    with torch.no_grad():
        for a in ANCHORS:
            loss_mask = torch.zeros(1, seq_len, dtype=torch.long)
            loss_mask[0, a] = 1  # the only valid anchor: select_anchors must pick a
            hidden, logits, _, _, _ = model._backbone_forward(
                taps, input_ids, loss_mask, torch.zeros(1, seq_len, hidden_size),
                torch.zeros(1, seq_len, dtype=torch.long), max_anchors=1,
            )
            out[a] = (hidden, logits)
    return {"taps": taps, "input_ids": input_ids, "anchors": torch.tensor(ANCHORS)}, out


def parse_cli(argv: list[str], description: str, add_make_arguments=lambda parser: None) -> argparse.Namespace:
    """``make OUT --target DIR [...]`` or ``run DRAFTER OUT``; OUT is created."""
    p = argparse.ArgumentParser(description=description)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("out", type=Path)
    m.add_argument("--target", required=True)
    add_make_arguments(m)
    r = sub.add_parser("run")
    r.add_argument("drafter", type=Path)
    r.add_argument("out", type=Path)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    return args
