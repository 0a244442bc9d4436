"""Our speculators-format loader against vLLM's ``speculators`` itself.

The peer's own classes run in their own venv (``.peers/speculators``, made by ``build_scripts/peer_speculators.sh``)
through ``perf/peers/speculators_dflash.py`` / ``speculators_dspark.py``: ``make`` builds and saves a random drafter
with speculators' classes and drafts one block at each of a few anchors with its own modules; ``run`` does the
drafting alone on a directory someone else wrote (ours). Both write ``peer_io.safetensors``: the inputs (taps,
input_ids, anchors) and per anchor what the peer drafted. The functions here load the same directory with our loader,
draft the same blocks and say how far apart the two are. ``tests/models`` and ``perf/drafter_formats.py`` share them.
"""

from __future__ import annotations

import contextlib
import subprocess
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from trtllm_dflash.checkpoints import drafter_spec_for
from trtllm_dflash.models import speculators
from trtllm_dflash.models.drafter import DrafterModel, draft_block
from trtllm_dflash.specs import DSparkSpec, TargetSpec

REPO = Path(__file__).resolve().parents[2]
PEER_PYTHON = REPO / ".peers" / "speculators" / "bin" / "python"
PEER_SCRIPTS = {"dflash": REPO / "perf" / "peers" / "speculators_dflash.py",
                "dspark": REPO / "perf" / "peers" / "speculators_dspark.py"}
NO_PEER = "no peer venv: run build_scripts/peer_speculators.sh (speculators 0.9.0 in .peers/speculators)"


@dataclass(frozen=True)
class Parity:
    """How far our drafts are from the peer's over every anchor of one ``peer_io.safetensors``."""

    max_logit_diff: float  # max |ours − peer's| draft logit (DSpark: Markov-corrected) over every anchor and slot
    max_abs_logit: float  # the largest |logit| the peer drafted, the scale of the difference
    tokens_equal: bool  # the drafted target ids are the same at every anchor
    max_confidence_diff: float | None = None  # DSpark: max |ours − peer's| confidence
    markov_changes_drafts: bool | None = None  # DSpark: without the Markov head some anchor drafts other tokens

    def as_dict(self) -> dict:
        return asdict(self)


def run_peer(kind: str, *args: object, timeout: float = 600) -> None:
    """Run ``perf/peers/speculators_{kind}.py ARGS`` in the peer venv; its stderr tail on failure."""
    done = subprocess.run([str(PEER_PYTHON), str(PEER_SCRIPTS[kind]), *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"peer {kind} {' '.join(map(str, args))} exited {done.returncode}:\n"
                           f"{done.stderr[-3000:]}")


def _injected(drafter: DrafterModel, io: dict, anchor: int):
    cache = drafter.new_cache(1, 128)
    drafter.inject(io["taps"][:, :anchor], torch.tensor([anchor]), cache)
    return cache


def dflash_parity(target, drafter: DrafterModel, io: dict) -> Parity:
    """A speculators DFlash drafter with its own head: its draft logits [B, draft_vocab] and drafted ids at every
    anchor of ``io`` (``speculators_dflash.py``), ours against the peer's."""
    block = drafter.spec.block_size
    worst, equal = 0.0, True
    for a in io["anchors"].tolist():
        with torch.inference_mode():
            cache = _injected(drafter, io, a)
            ids = torch.full((1, block), drafter.spec.mask_token_id)
            ids[0, 0] = io["input_ids"][0, a]
            with drafter.draft_head.drafting():
                logits = drafter.draft_head(drafter.draft(target.embed(ids), cache))[0]  # [B, draft_vocab]
        worst = max(worst, (logits - io[f"logits_{a}"]).abs().max().item())
        with torch.inference_mode():
            cache = _injected(drafter, io, a)
            tokens = draft_block(io["input_ids"][0, a:a + 1], block, drafter.spec.mask_token_id, target.embed,
                                 lambda e: drafter.draft(e, cache), None, own_head=drafter.draft_head)
        equal &= torch.equal(tokens[0], io[f"tokens_{a}"][1:])  # slot 0 is the bonus, not a draft
    return Parity(worst, _max_abs_logit(io), equal)


def _corrected_logits(target, drafter: DrafterModel, hidden, bonus, tokens):
    """Our heads' Markov-corrected logits [K, V'] along the chain ``tokens`` [K] (target ids): what ``draft_block``
    scored at each position once the drafts before it were chosen."""
    spec, markov = drafter.spec, drafter.dspark.markov_head
    predicting = hidden if spec.anchor_predicts else hidden[:, 1:]
    own = drafter.draft_head
    base = own(predicting) if own is not None else target.logits(predicting)  # [1, K, V']
    state = None
    if markov.head_type == "rnn":
        state = hidden.new_zeros(1, markov.rank)
        if not spec.anchor_predicts:
            _, state = markov.step(markov.prev_embeddings(bonus), hidden[:, 0], state)
    rows, prev = [], bonus
    for k in range(predicting.shape[1]):
        bias, state = markov.step(markov.prev_embeddings(prev), predicting[:, k], state)
        rows.append(base[0, k] + bias[0])
        prev = tokens[k: k + 1]
    return torch.stack(rows)


def dspark_parity(target, drafter: DrafterModel, io: dict) -> Parity:
    """A DSpark drafter: the Markov-corrected logits, drafted ids and confidence at every anchor of ``io``
    (``speculators_dspark.py``), ours against the peer's; and whether the Markov head changes any anchor's drafts
    (so that the comparison exercises it)."""
    spec = drafter.spec
    worst, worst_conf, equal, changed = 0.0, 0.0, True, False
    for a in io["anchors"].tolist():
        bonus = io["input_ids"][0, a: a + 1]

        def drafted(heads):
            with torch.inference_mode():
                cache = _injected(drafter, io, a)
                return draft_block(bonus, spec.block_size, spec.mask_token_id, target.embed,
                                   lambda e: drafter.draft(e, cache), target.logits, own_head=drafter.draft_head,
                                   heads=heads, scores=True)

        tokens, confidence = drafted(drafter.dspark)
        plain, _ = drafted(None)
        changed |= not torch.equal(plain, tokens)
        equal &= torch.equal(tokens[0], io[f"tokens_{a}"])
        with torch.inference_mode(), (drafter.draft_head.drafting() if drafter.draft_head is not None
                                      else contextlib.nullcontext()):
            cache = _injected(drafter, io, a)
            ids = torch.full((1, spec.trained_block_size), spec.mask_token_id)
            ids[0, 0] = bonus
            hidden = drafter.draft(target.embed(ids), cache)
            logits = _corrected_logits(target, drafter, hidden, bonus, io[f"tokens_{a}"])
        worst = max(worst, (logits - io[f"logits_{a}"]).abs().max().item())
        worst_conf = max(worst_conf, (confidence[0] - io[f"conf_{a}"]).abs().max().item())
    return Parity(worst, _max_abs_logit(io), equal, worst_conf, changed)


def _max_abs_logit(io: dict) -> float:
    return max(io[f"logits_{a}"].abs().max().item() for a in io["anchors"].tolist())


def random_dspark_drafter(target: TargetSpec, head_type: str = "vanilla", anchor: bool = True,
                          draft_vocab: int | None = None, confidence: bool = True, seed: int = 0,
                          dtype: torch.dtype = torch.float64) -> DrafterModel:
    """A random DSpark drafter for ``target`` (2 layers, trained block 6, Markov rank 8; decisive weights, Markov
    weights large enough to change drafts), with a random reduced draft vocabulary of ``draft_vocab`` ids."""
    spec = drafter_spec_for(target, num_layers=2, block_size=6, mask_token_id=5)
    heads = DSparkSpec(markov_rank=8, markov_head_type=head_type, confidence_head=confidence,
                       confidence_with_markov=confidence)
    spec = replace(spec, num_target_layers=None, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab,
                   dspark=heads, anchor_predicts=anchor, block_size=6 + int(anchor))
    torch.manual_seed(seed)
    model = DrafterModel(spec, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.6 if name.startswith("dspark.markov_head.") else 0.15)
    if draft_vocab is not None:
        ids = torch.randperm(target.vocab_size)[:draft_vocab].sort().values
        model.draft_head.load_map(*speculators.vocab_tables(ids, target.vocab_size), "random")
    return model.eval()
