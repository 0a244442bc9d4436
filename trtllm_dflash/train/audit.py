"""Training/inference consistency audit: does a training sample see what an inference draft step sees?

The usual causes of "good training accuracy, poor acceptance" are a mismatch between the two paths: taps off by one,
another chat template, another mask token, another LM head or final norm at inference. This module runs both paths
on the same prompts and compares what comes out, so any of those shows up as disagreeing drafts:

    data path       ``train.data.generate_with_taps`` (the exact function that builds training shards) regenerates
                    the response of each chat-templated prompt and records the taps; ``train.objective.drafter_blocks``
                    + the target's LM head turn a block anchored at p into the training-time prediction.
    inference path  ``runtime.decoder.SpeculativeDecoder`` decodes the same prompt; every draft it proposes is recorded
                    with its anchor (the committed length, i.e. the bonus token's position).

For each inference step, the training path's block at the same anchor must propose the same drafts (up to bf16
rounding of the cached taps), and the response must be token-identical to the lossless DFlash output. The report puts
the training metrics (per-slot accuracy over every anchor of the held-out responses, expected τ) next to the τ the
drafter actually gets, so the two can be read side by side.
"""

from __future__ import annotations

import contextlib

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, ngram_continuation
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
from trtllm_dflash.runtime.tree import TreeShape, graft_chains, lookup_chains
from trtllm_dflash.train.data import Sample, generate_with_taps
from trtllm_dflash.train.objective import collate, drafter_blocks


class RecordingDecoder(SpeculativeDecoder):
    """The real decoder, recording (anchor, drafts) of every draft step of a single-request batch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[int, list[int]]] = []

    def propose(self, bonus, dcache, rows, committed, num_drafts=None, top=1):
        drafts = super().propose(bonus, dcache, rows, committed, num_drafts, top)
        assert drafts.shape[0] == 1, "RecordingDecoder records one request at a time"
        self.steps.append((int(committed[0]), drafts[0].tolist()))
        return drafts


@torch.no_grad()
def training_drafts(target: TargetModel, drafter: DrafterModel, sample: Sample, anchors: list[int],
                    chunk: int = 64) -> torch.Tensor:  # [A, B − 1] greedy drafts of the training-time blocks
    """What the training objective predicts for blocks anchored at ``anchors`` of ``sample`` (raw taps, as exported)."""
    out = []
    for i in range(0, len(anchors), chunk):
        a = torch.tensor(anchors[i : i + chunk])
        batch = collate([sample], [a], target.device, dtype=drafter.dtype)
        hidden = drafter_blocks(drafter, target.embed, batch)  # [a, B, H]
        out.append(target.lm_head(hidden[:, 1:].to(target.dtype)).argmax(-1).cpu())
    return torch.cat(out) if out else torch.empty(0, drafter.spec.block_size - 1, dtype=torch.long)


def walk(accepted: Sequence[int], prompt_len: int, length: int) -> list[int]:
    """The decoder's greedy walk over a known output of ``length`` tokens: the prefill emits the first response
    token, then each step, anchored at the bonus token's position a, accepts ``accepted[a − prompt_len]`` drafts (cut
    at the output's end) plus the target's bonus token. Returns the acceptance length (τ) of every step."""
    taus, c = [], prompt_len + 1
    while c < length:
        acc = min(int(accepted[c - 1 - prompt_len]), length - c)
        taus.append(acc + 1)
        c += acc + 1
    return taus


def output_taus(acceptance_lengths: Sequence[int], num_tokens: int) -> list[int]:
    """A decoder's acceptance lengths restricted to its output of ``num_tokens`` new tokens (stop token excluded), as
    ``walk`` counts them: the step that reaches the output's end counts the tokens up to it plus one (the bonus: the
    stop token or the first token past the length limit), not drafts the verify accepted beyond it, and a last step
    that only emitted the stop token is not counted. What ``replay_taus`` reproduces exactly."""
    out, left = [], num_tokens - 1  # the prefill emitted the first token
    for t in acceptance_lengths:
        if left <= 0:
            break
        out.append(min(t, left + 1))
        left -= out[-1]
    return out


def accepted_prefix(draft: Sequence[int], ids: Sequence[int], start: int) -> int:
    """How many of ``draft``'s tokens equal the known output ``ids`` from position ``start`` on (the verify's greedy
    acceptance of a proposal at that anchor)."""
    acc = 0
    while acc < len(draft) and start + acc < len(ids) and draft[acc] == ids[start + acc]:
        acc += 1
    return acc


def greedy_rows(target: TargetModel, tok, stops: tuple[int, ...], prompts, max_new_tokens: int,
                batch_size: int = 16, desc: str = "greedy") -> list[dict]:
    """Greedy outputs (target only) of ``datasets.Prompt``s under their chat templates, in batches, as the
    greedy-reference rows the replays read: {"id", "prompt_ids", "token_ids"}."""
    from tqdm import tqdm

    from trtllm_dflash.runtime.text import encode_prompt

    ar, rows = SpeculativeDecoder(target, None, 1), []
    for i in tqdm(range(0, len(prompts), batch_size), desc=desc):
        reqs = [Request(tuple(encode_prompt(tok, p.text, p.chat)), max_new_tokens, stop_token_ids=stops)
                for p in prompts[i : i + batch_size]]
        for p, r, out in zip(prompts[i : i + batch_size], reqs, ar.generate(reqs)):
            rows.append({"id": p.id, "prompt_ids": list(r.prompt_ids), "token_ids": list(out.token_ids)})
    return rows


def lookup_acceptance(ids: list[int], prompt_len: int, block_size: int, max_ngram: int = 3,
                      min_ngram: int = 1, tree: TreeShape | None = None, datastore: Datastore | None = None,
                      main: torch.Tensor | None = None) -> list[tuple[int, int]]:
    """Prompt lookup at every response anchor a of a known output ``ids`` (prompt + response): (drafts accepted,
    drafts proposed). The draft is ``runtime.lookup.ngram_continuation`` of ids[: a + 1] (as the decoder proposes
    it), at most B − 1 tokens; no recurring suffix of min_ngram .. max_ngram tokens, no draft. With ``tree``: the
    proposals of its lookup chains (``runtime.tree.lookup_chains``, as the tree verify makes them, with
    ``datastore``'s if given), the longest accepted of them; and of its grafted chains (``runtime.tree.graft_chains``
    on the drafter's greedy block ``main`` [A, K] at each anchor: ``drafter_choices``' first choices), a graft at
    depth d counting where the drafts d_1..d_d are the output's (d + its accepted tokens)."""
    if tree is not None and tree.grafts and main is None:
        raise ValueError("a tree with grafted lookup chains needs the drafter's greedy blocks (main=)")

    out = []
    for a in range(prompt_len, len(ids) - 1):
        context = ids[: a + 1]
        drafts = lookup_chains(tree, context, datastore) if tree is not None else \
            [ngram_continuation(context, block_size - 1, max_ngram, min_ngram)]
        best = max((accepted_prefix(d, ids, a + 1) for d in drafts), default=0)
        proposed = max(map(len, drafts), default=0)
        if tree is not None and tree.grafts:
            blocks = main[a - prompt_len].tolist()
            grafted = graft_chains(tree, context, blocks, datastore, drafts)
            for g, depth in enumerate(tree.grafts):
                right = blocks[:depth] == ids[a + 1: a + 1 + depth]
                for cont in grafted[g * tree.lookup: (g + 1) * tree.lookup]:
                    if cont:
                        proposed = max(proposed, depth + len(cont))
                        if right:
                            best = max(best, depth + accepted_prefix(cont, ids, a + 1 + depth))
        out.append((best, proposed))
    return out


def prompt_lookup_taus(ids: list[int], prompt_len: int, block_size: int, max_ngram: int = 3) -> list[int]:
    """Acceptance lengths of prompt-lookup decoding replayed over a known greedy output ``ids`` (prompt + response):
    the longest suffix n-gram (n = max_ngram .. 1) of the sequence so far, its most recent earlier occurrence, and the
    B − 1 tokens that followed it as the draft; no occurrence, no draft (τ = 1). A free heuristic: a trained drafter
    has to beat it."""
    return walk([acc for acc, _ in lookup_acceptance(ids, prompt_len, block_size, max_ngram)], prompt_len, len(ids))


def _blocks(target: TargetModel, drafter: DrafterModel, ids: list[int], prompt_len: int, chunk: int, block_size: int):
    """The drafter's blocks at every response anchor of a known output, ``chunk`` anchors at a time: (anchors [a],
    final-normed hidden [a, B, H]), after one teacher-forced target forward for the taps."""
    s = len(ids)
    anchors = torch.arange(prompt_len, s - 1)
    if len(anchors) == 0:
        return
    x = torch.tensor(ids)
    _, taps = target(x[None].to(target.device), target.new_cache(1, s), tap_layers=drafter.spec.target_layer_ids)
    sample = Sample(x, taps[0].cpu(), prompt_len)
    head = drafter.draft_head  # a reduced draft vocabulary's head: armed for the drafter's forward (draft_vocab.py)
    for i in range(0, len(anchors), chunk):
        a = anchors[i : i + chunk]
        with head.drafting() if head is not None else contextlib.nullcontext():
            hidden = drafter_blocks(drafter, target.embed, collate([sample], [a], target.device, dtype=drafter.dtype),
                                    block_size=block_size)
        yield a, hidden


def _draft_logits(target: TargetModel, drafter: DrafterModel, hidden: torch.Tensor) -> torch.Tensor:
    """The logits the decoder drafts from (float32, on the CPU): the drafter's own draft-vocabulary head where it has
    one (``models.draft_vocab``; map the chosen indices with ``_to_target``), else the target's LM head."""
    head = drafter.draft_head
    return (head(hidden) if head is not None else target.lm_head(hidden.to(target.dtype))).float().cpu()


def _to_target(drafter: DrafterModel, idx: torch.Tensor) -> torch.Tensor:
    """Indices into ``_draft_logits``' last dimension -> target token ids."""
    head = drafter.draft_head
    return idx if head is None else head.draft_to_target.cpu()[idx]


@torch.no_grad()
def drafter_acceptance(target: TargetModel, drafter: DrafterModel, ids: list[int], prompt_len: int,
                       chunk: int = 64, block_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafter's block of ``block_size`` (default: its own) at every response anchor a of a known greedy output
    ``ids`` (prompt + response): how many of its drafts equal the output (longest prefix) and the probability the
    drafter gives its first draft. One
    teacher-forced target forward for the taps, then the training path's blocks (which the audit proves equal to the
    decoder's drafts). The LM head runs slot by slot and only for blocks whose earlier slots all matched (a draft
    after the first miss is never accepted), so most blocks cost one slot of the head instead of B − 1."""
    s, bs = len(ids), block_size or drafter.spec.block_size
    accepted = torch.zeros(max(s - 1 - prompt_len, 0), dtype=torch.long)
    confidence = torch.zeros(len(accepted))
    x = torch.tensor(ids)
    for a, hidden in _blocks(target, drafter, ids, prompt_len, chunk, bs):
        i = int(a[0]) - prompt_len
        alive = torch.arange(len(a))  # blocks whose slots 1 .. k − 1 all matched
        for k in range(1, bs):
            pos = a[alive] + k
            alive = alive[pos < s]
            if len(alive) == 0:
                break
            logits = _draft_logits(target, drafter, hidden[alive, k])
            if k == 1:
                confidence[i + alive] = logits.softmax(-1).amax(-1)
            alive = alive[_to_target(drafter, logits.argmax(-1)) == x[a[alive] + k]]
            accepted[i + alive] += 1
    return accepted, confidence


@torch.no_grad()
def drafter_choices(target: TargetModel, drafter: DrafterModel, ids: list[int], prompt_len: int, top: int,
                    block_size: int | None = None, chunk: int = 64) -> torch.Tensor:
    """The drafter's ``top`` best tokens at every slot of its block at every response anchor of a known output
    ([A, B − 1, top], best first): what a tree verify chooses its nodes' tokens from. The head runs over every
    slot."""
    out = [_to_target(drafter, _draft_logits(target, drafter, hidden[:, 1:]).topk(top, dim=-1).indices)
           for _, hidden in _blocks(target, drafter, ids, prompt_len, chunk, block_size or drafter.spec.block_size)]
    k = (block_size or drafter.spec.block_size) - 1
    return torch.cat(out) if out else torch.zeros(0, k, top, dtype=torch.long)


def tree_acceptance(shape: TreeShape, choices: torch.Tensor, ids: list[int], prompt_len: int) -> torch.Tensor:
    """The depth the drafter's part of a tree verify (``shape``'s main chain and alternates; its lookup chains are
    ``lookup_acceptance``'s) accepts at every response anchor of a known greedy output [A]: ``TreeShape.accept`` with
    the output as the tokens the target picks. ``choices``: ``drafter_choices`` with at least ``shape.top``."""
    drafts_only = dataclasses.replace(shape, lookup=False)
    anchors = torch.arange(prompt_len, prompt_len + len(choices))
    x = torch.tensor(ids + [-1] * (shape.k + 1))  # −1 past the end: never matched
    tokens = drafts_only.tokens(anchors, choices[:, : shape.k, : drafts_only.top], None)  # [A, N]; node 0 not compared
    return drafts_only.accept(tokens, x[anchors[:, None] + torch.tensor(drafts_only.depths)])[1]


def with_lookup(drafted: Sequence[int], lookup: list[tuple[int, int]], keep_longer: bool = False) -> list[int]:
    """Per anchor, the drafts a step accepts when prompt lookup's proposal (``lookup_acceptance``) is in play too:
    ``ngram`` mode verifies the lookup instead of the drafter's block wherever one is proposed; a tree verify with
    lookup chains (``keep_longer``) keeps the longer of the two."""
    return [(max(acc, drafted[a]) if keep_longer else acc) if proposed else drafted[a]
            for a, (acc, proposed) in enumerate(lookup)]


def replay_taus(target: TargetModel, drafter: DrafterModel, ids: list[int], prompt_len: int,
                chunk: int = 64, ngram: bool = False, block_size: int | None = None, tree: bool | TreeShape = False,
                datastore: Datastore | None = None) -> list[int] | tuple[list[int], ...]:
    """Acceptance lengths of greedy DFlash decoding at ``block_size`` (default: the drafter's) replayed over a known
    greedy output ``ids`` (prompt + response): ``drafter_acceptance`` at every anchor, then the decoder's ``walk``.
    With ``ngram``, also those of the decoder's ``ngram`` mode (prompt lookup's continuation wherever the context
    ends in a recurring 2- or 3-gram, the drafter's block elsewhere): (drafter τs, ngram τs). With ``tree`` as well,
    those of the decoder's tree verify (``runtime.tree``, ``TreeShape.for_block``: the drafter's block, its
    alternates and prompt lookup's proposals verified side by side in one step, the deepest accepted path kept; True,
    or a ``TreeShape``): (drafter τs, ngram τs, tree τs); and with a ``datastore`` (``runtime.datastore``), those of
    the tree verify with its proposals too (True: ``TreeShape.for_block(B − 1, datastore=True)``) after them."""
    if len(ids) - 1 <= prompt_len:
        return ([], []) if ngram else []
    bs = block_size or drafter.spec.block_size
    accepted = drafter_acceptance(target, drafter, ids, prompt_len, chunk, bs)[0].tolist()
    taus = walk(accepted, prompt_len, len(ids))
    if not ngram:
        return taus
    mixed = with_lookup(accepted, lookup_acceptance(ids, prompt_len, bs, min_ngram=LOOKUP_MIN_N))
    if not tree:
        return taus, walk(mixed, prompt_len, len(ids))
    trees = [(TreeShape.for_block(bs - 1) if tree is True else tree, None)]
    if datastore is not None:
        trees.append((TreeShape.for_block(bs - 1, datastore=True) if tree is True else tree, datastore))
    top = max(shape.top for shape, _ in trees)
    need = top > 1 or any(shape.grafts for shape, _ in trees)
    choices = drafter_choices(target, drafter, ids, prompt_len, top, bs, chunk) if need else None
    walks = []
    for shape, store in trees:
        drafted = accepted if not shape.alternates else tree_acceptance(shape, choices, ids, prompt_len).tolist()
        if shape.lookup:
            main = choices[:, :, 0] if shape.grafts else None
            drafted = with_lookup(drafted, lookup_acceptance(ids, prompt_len, bs, tree=shape, datastore=store,
                                                             main=main), keep_longer=True)
        walks.append(walk(drafted, prompt_len, len(ids)))
    return (taus, walk(mixed, prompt_len, len(ids)), *walks)


def _prefix(hit: torch.Tensor) -> torch.Tensor:  # [A, K] bool -> [A] longest all-true prefix
    return hit.long().cumprod(1).sum(1)


@dataclass
class PromptAudit:
    id: str
    prompt_len: int
    response_len: int
    lossless: bool  # inference output == the regenerated training response (stop token dropped)
    inference_taus: list[int]
    train_taus_at_inference_anchors: list[int]  # the training path's acceptance at the same anchors
    slots_agree: int  # draft slots where training and inference proposed the same token
    slots_compared: int
    correct: list[int] = field(default_factory=list)  # per slot k: teacher-forced hits over every response anchor
    counted: list[int] = field(default_factory=list)
    all_anchor_taus: list[int] = field(default_factory=list)
    prompt_lookup_taus: list[int] = field(default_factory=list)  # the free heuristic on the same output


def audit_prompt(target: TargetModel, drafter: DrafterModel, prompt_id: str, prompt_ids: list[int],
                 max_new_tokens: int, stop_token_ids: tuple[int, ...], all_anchors: bool = True) -> PromptAudit:
    spec = drafter.spec
    bs = spec.block_size
    sample = generate_with_taps(target, [prompt_ids], max_new_tokens, stop_token_ids, spec.target_layer_ids)[0]
    dec = RecordingDecoder(target, drafter, bs)
    res = dec.generate([Request(tuple(prompt_ids), max_new_tokens, stop_token_ids=stop_token_ids)])[0]
    ids = sample.ids
    s, p0 = len(ids), sample.prompt_len
    response = [t for t in ids[p0:].tolist() if t not in stop_token_ids]
    lossless = list(res.token_ids) == response

    def hits(drafts: torch.Tensor, anchors: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.tensor(anchors)[:, None] + torch.arange(1, bs)  # [A, B − 1] label positions
        labelled = pos < s
        labels = ids[pos.clamp(max=s - 1)]
        return (drafts == labels) & labelled, labelled

    inf_anchors = [a for a, _ in dec.steps if a < s]
    inf_drafts = torch.tensor([d for a, d in dec.steps if a < s], dtype=torch.long).view(-1, bs - 1)
    tr_drafts = training_drafts(target, drafter, sample, inf_anchors)
    hit_tr, labelled = hits(tr_drafts, inf_anchors)
    hit_inf, _ = hits(inf_drafts, inf_anchors)
    audit = PromptAudit(
        id=prompt_id, prompt_len=p0, response_len=s - p0, lossless=lossless,
        inference_taus=list(res.acceptance_lengths),
        train_taus_at_inference_anchors=(_prefix(hit_tr) + 1).tolist(),
        slots_agree=int(((tr_drafts == inf_drafts) & labelled).sum()), slots_compared=int(labelled.sum()),
    )
    assert len(_prefix(hit_inf)) == len(inf_anchors)
    audit.prompt_lookup_taus = prompt_lookup_taus(ids.tolist(), p0, bs)
    if all_anchors and s - 1 > p0:
        anchors = list(range(p0, s - 1))  # every response anchor with a next token (train.objective.sample_anchors)
        hit_all, lab_all = hits(training_drafts(target, drafter, sample, anchors), anchors)
        audit.correct, audit.counted = hit_all.sum(0).tolist(), lab_all.sum(0).tolist()
        audit.all_anchor_taus = (_prefix(hit_all) + 1).tolist()
    return audit


def summarize(audits: list[PromptAudit]) -> dict:
    """Training-path metrics beside inference τ, pooled over prompts (τ = mean over draft steps, as bench_runtime)."""
    def mean(xs):
        return round(sum(xs) / len(xs), 3) if xs else None

    k = len(audits[0].correct) if audits and audits[0].correct else 0
    correct = [sum(a.correct[i] for a in audits if a.correct) for i in range(k)]
    counted = [sum(a.counted[i] for a in audits if a.counted) for i in range(k)]
    return {
        "num_prompts": len(audits),
        "lossless": all(a.lossless for a in audits),
        "inference_tau": mean([t for a in audits for t in a.inference_taus]),
        "train_path_tau_at_inference_anchors": mean([t for a in audits for t in a.train_taus_at_inference_anchors]),
        "expected_tau_all_anchors": mean([t for a in audits for t in a.all_anchor_taus]),
        "prompt_lookup_tau": mean([t for a in audits for t in a.prompt_lookup_taus]),
        "accuracy_by_slot": [round(c / max(n, 1), 3) for c, n in zip(correct, counted)],
        "position1_accuracy": round(correct[0] / max(counted[0], 1), 3) if k else None,
        "draft_slot_agreement": round(sum(a.slots_agree for a in audits) / max(1, sum(a.slots_compared for a in audits)), 4),
        "num_draft_steps": sum(len(a.inference_taus) for a in audits),
        "num_response_tokens": sum(a.response_len for a in audits),
    }
