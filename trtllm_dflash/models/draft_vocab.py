"""A drafter's own LM head over a reduced draft vocabulary, and the map of its ids to the target's.

Drafters trained with vLLM's ``speculators`` may predict over a *draft vocabulary*: the ``draft_vocab_size`` most
frequent target tokens (``speculators/train/vocab_mapping.py``), sorted by target id. Their ``lm_head`` is
[draft_vocab_size, hidden] and only meaningful with its own id map; the target's head is the wrong matrix for them
(fed the target's head, such a drafter's drafts are hardly ever accepted). Two tables travel
with the checkpoint, EAGLE-3 style:

  d2t [draft_vocab_size] int64   offsets: target_id = draft_id + d2t[draft_id]
  t2d [target_vocab_size] bool   True at the target ids the draft vocabulary holds

Worked example: draft vocabulary = target ids (3, 7, 8) -> d2t = (3 - 0, 7 - 1, 8 - 2) = (3, 6, 6) and t2d is True
at 3, 7, 8. Here ``draft_to_target`` holds the absolute ids (3, 7, 8), so mapping a drafted id is one gather.

The head is applied by ``drafter.draft_block``; ``DraftVocabHead.drafting`` arms it for that call, and the drafter
refuses to finish a draft forward while it is not armed, so a caller that would put the target's head on this
drafter's hidden states fails loudly instead of drafting near-random tokens.

A full-vocabulary drafter (z-lab's layout, which drafts through the target's LM head) can draft over a reduced
vocabulary too: ``draft_vocab.json`` in its directory lists the draft vocabulary's target ids (``choose`` picks the
most frequent tokens of a corpus of the target's own outputs), and ``derived_head`` cuts those rows out of the target's
head. Drafting then reads [draft_vocab_size, hidden] instead of [vocab_size, hidden] of head weights for every drafted
slot (on SmolLM2 the head is 28M of the target's 135M parameters), and a slot whose right token lies outside the draft
vocabulary is a certain miss. The weights stay as they are, so peers that load the directory (vLLM, z-lab's code) are
not affected: they ignore the file.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
from torch import nn

from trtllm_dflash.errors import ArtifactError, ConfigError, read_json
from trtllm_dflash.models.layers import Linear

DRAFT_VOCAB_FILE = "draft_vocab.json"  # in a full-vocabulary drafter's directory: its reduced draft vocabulary
FORMAT = "trtllm-dflash-draft-vocab"


class DraftVocabHead(nn.Module):
    def __init__(self, hidden_size: int, draft_vocab_size: int, target_vocab_size: int | None = None) -> None:
        super().__init__()
        self.lm_head = Linear(hidden_size, draft_vocab_size, bias=False)
        # [draft_vocab_size] absolute target ids, ascending; filled by ``load_map``
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)
        self.target_vocab_size = target_vocab_size
        self._armed = 0  # draft_block calls inside ``drafting``; a counter so nested arming stays armed

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    def load_map(self, d2t: torch.Tensor, t2d: torch.Tensor | None, source: object) -> None:
        """Check the speculators tables (module docstring) and keep the absolute ids.

        d2t: [draft_vocab_size] offsets; t2d: [target_vocab_size] bool or None (then only d2t is checked)."""
        n = self.draft_vocab_size
        if tuple(d2t.shape) != (n,) or d2t.dtype.is_floating_point:
            raise ConfigError(f"{source}:d2t", f"shape {list(d2t.shape)}, dtype {d2t.dtype}",
                              f"must be an integer vector of draft_vocab_size={n} offsets",
                              "re-save the drafter with speculators' save_pretrained")
        ids = torch.arange(n) + d2t.to(torch.long).cpu()  # [n] target ids
        vocab = self.target_vocab_size
        outside = (ids < 0) | (ids >= vocab) if vocab is not None else ids < 0  # [n]
        if bool(outside.any()) or bool((ids[1:] <= ids[:-1]).any()):
            raise ConfigError(f"{source}:d2t", f"maps to target ids such as {ids[outside][:3].tolist() or 'unsorted'}",
                              f"draft_id + d2t[draft_id] must be distinct, ascending ids in [0, {vocab})",
                              "check that the tables belong to this checkpoint")
        if t2d is not None:
            if vocab is not None and tuple(t2d.shape) != (vocab,):
                raise ConfigError(f"{source}:t2d", f"shape {list(t2d.shape)}",
                                  f"must be a [target vocab_size={vocab}] mask", "check the checkpoint")
            held = torch.nonzero(t2d.cpu().bool()).flatten()
            if held.numel() != n or not torch.equal(held, ids):
                raise ConfigError(f"{source}:t2d", f"{held.numel()} ids set",
                                  f"must be True exactly at the draft_vocab_size={n} ids d2t maps to",
                                  "check that d2t and t2d belong together")
        self.draft_to_target.copy_(ids.to(self.draft_to_target.device))

    @contextlib.contextmanager
    def drafting(self):
        """Arm the head for one ``draft_block`` call (the drafter checks this before its final norm)."""
        self._armed += 1
        try:
            yield self
        finally:
            self._armed -= 1

    def check_armed(self) -> None:
        if not self._armed:
            raise ConfigError(
                "drafter.draft_vocab_size", self.draft_vocab_size,
                "this drafter predicts over its own reduced vocabulary, but the caller drafts without its head "
                "(it would put the target's LM head on the drafter's hidden states)",
                "pass own_head=drafter.draft_head to models.drafter.draft_block",
            )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> draft logits [..., draft_vocab]
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:  # any shape of draft ids -> target ids
        return self.draft_to_target[draft_ids]


def choose(counts: np.ndarray, size: int, keep: Iterable[int] = ()) -> np.ndarray:
    """The draft vocabulary: the ``size`` target ids with the largest ``counts`` [vocab_size] (ties: the smaller id, so
    the choice never depends on the machine), ``keep`` always among them (e.g. the stop tokens, which end a draft's
    accepted run when the target stops); ascending."""
    counts = np.asarray(counts, dtype=np.int64)
    keep = sorted({int(k) for k in keep})
    vocab = counts.shape[0]
    if not 1 <= size <= vocab:
        raise ConfigError("--size", size, f"must be in [1, {vocab}] (the target's vocabulary)")
    if any(not 0 <= k < vocab for k in keep) or len(keep) > size:
        raise ConfigError("keep", keep, f"must be at most {size} ids in [0, {vocab})")
    order = np.lexsort((np.arange(vocab), -counts))  # most frequent first, then by id
    rest = order[~np.isin(order, keep)][: size - len(keep)]
    return np.sort(np.concatenate([np.asarray(keep, dtype=np.int64), rest]))


def coverage(ids: np.ndarray, tokens: np.ndarray) -> float:
    """The fraction of ``tokens`` (any shape of target ids) that the draft vocabulary ``ids`` holds."""
    tokens = np.asarray(tokens).ravel()
    return float(np.isin(tokens, ids).mean()) if tokens.size else 1.0


def write(path: str | Path, ids: np.ndarray, meta: dict) -> Path:
    """A draft vocabulary file (``DRAFT_VOCAB_FILE`` in a drafter directory), atomically and readable by all: the ids
    (on one line) and how they were chosen (``meta``)."""
    import json
    import os

    from trtllm_dflash.staging import write_atomic

    path = Path(path)
    doc = {"format": FORMAT, "draft_vocab_size": int(len(ids)), **meta}
    head = json.dumps(doc, indent=2)[:-2]  # without the closing "\n}"
    write_atomic(path, f'{head},\n  "ids": {json.dumps([int(i) for i in ids])}\n}}\n')
    os.chmod(path, 0o644)
    return path


def read(path: str | Path, target_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary's ids [n] (int64, ascending) from a draft_vocab.json, checked against the target."""
    fix = "write it again with `trtllm-dflash draft-vocab`, or draft over the full vocabulary (--draft-vocab full)"
    doc = read_json(path, fix)
    if doc.get("format") != FORMAT or not isinstance(doc.get("ids"), list):
        raise ArtifactError(path, f"is not a draft vocabulary (format {doc.get('format')!r}, no 'ids' list)", fix)
    ids = torch.tensor(doc["ids"], dtype=torch.long)
    if ids.numel() == 0 or bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 \
            or int(ids[-1]) >= target_vocab_size:
        raise ArtifactError(path, f"holds {ids.numel()} ids, not distinct ascending ids in [0, {target_vocab_size})"
                            " (the target's vocabulary)", fix)
    return ids


def derived_head(lm_head: torch.Tensor, ids: torch.Tensor) -> DraftVocabHead:
    """A ``DraftVocabHead`` over the draft vocabulary ``ids`` whose weights are those rows of the target's LM head
    ``lm_head`` [vocab_size, hidden] (a copy: [n, hidden], on its device and in its dtype)."""
    head = DraftVocabHead(lm_head.shape[1], ids.numel(), lm_head.shape[0])
    head.lm_head.weight = nn.Parameter(lm_head.detach()[ids.to(lm_head.device)].clone(), requires_grad=False)
    head.draft_to_target = ids.to(lm_head.device)
    return head
