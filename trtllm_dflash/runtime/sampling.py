"""Token selection and the DFlash acceptance rule.

Vocabulary (per sequence, one step, block size B):
- **drafts** d_1..d_{B−1}: the drafter's greedy guesses for positions start+1..start+B−1.
- **target samples** x_0..x_{B−1}: one token per verified slot, drawn from the target's (processed) distribution at
  that slot (argmax when greedy). Slot i's distribution is conditioned on [prefix, bonus, d_1..d_i].
- **accepted length** a: the longest prefix with d_{i+1} == x_i; a ∈ [0, B−1].
- **emitted tokens** x_0..x_a: d_1..d_a (equal to x_0..x_{a−1}) plus the **bonus** x_a, the target's own sample at
  the first mismatch (or after the last draft). τ = a + 1 ∈ [1, B] tokens per step.

Lossless at any temperature: every emitted token is a target sample drawn conditioned on already-emitted tokens; for a
one-hot (greedy) proposal this equals Leviathan/Chen speculative sampling (arXiv 2211.17192; dflash.md §2.2).
"""

from __future__ import annotations

import math

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from trtllm_dflash.errors import require
from trtllm_dflash.models.layers import widen


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # SamplingParams' names, TensorRT-LLM's


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1 = no nucleus filter
    seed: int = 0
    # the target never picks these ids for a token at an absolute position < banned_before (min_tokens: a request's
    # end ids until it has that many new tokens); set per sequence by ``with_min_tokens``
    banned_ids: tuple[int, ...] = ()
    banned_before: int = 0
    # TensorRT-LLM's occurrence penalties (``penalize``): 1.0 / 0.0 / 0.0 = off
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # also return each chosen token's log-probability (``chosen_logprobs``; TensorRT-LLM's return_log_probs)
    logprobs: bool = False
    # TensorRT-LLM's bad words as token ids (``ban_words``): never chosen where the sequence ends in all but its last
    bad_words: tuple[tuple[int, ...], ...] = ()
    # TensorRT-LLM's embedding bias, sparse (``add_bias``): (token id, weight) pairs, ids ascending and distinct
    logit_bias: tuple[tuple[int, float], ...] = ()

    def with_min_tokens(self, min_tokens: int, prompt_len: int, end_ids: Sequence[int]) -> SamplingParams:
        """These parameters for a sequence of ``prompt_len`` prompt tokens that must not end (no ``end_ids``)
        before its ``min_tokens``-th new token."""
        if min_tokens <= 0 or not end_ids:
            return self
        return replace(self, banned_ids=tuple(sorted({int(e) for e in end_ids})), banned_before=prompt_len + min_tokens)

    def validate(self, prefix: str = "") -> None:
        """Every field in range, or a ConfigError naming it: ``prefix`` + its name (prefix "--": the CLI's flag)."""
        def field(name: str) -> str:
            return f"--{name.replace('_', '-')}" if prefix == "--" else f"{prefix}{name}"

        require(self.temperature >= 0, field("temperature"), self.temperature, "must be >= 0 (0 = greedy)")
        require(math.isfinite(self.temperature), field("temperature"), self.temperature, "must be finite")
        require(self.top_k >= 0, field("top_k"), self.top_k, "must be >= 0 (0 = off)")
        require(0 < self.top_p <= 1, field("top_p"), self.top_p, "must be in (0, 1]")
        require(self.banned_before >= 0, field("banned_before"), self.banned_before, "must be >= 0")
        require(math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, field("repetition_penalty"),
                self.repetition_penalty, "must be a finite number > 0 (1.0 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            require(math.isfinite(getattr(self, name)), field(name), getattr(self, name), "must be finite (0.0 = off)")
        for i, word in enumerate(self.bad_words):
            require(len(word) > 0 and all(t >= 0 for t in word), field(f"bad_words[{i}]"), list(word),
                    "must be one or more token ids")
        ids = [t for t, _ in self.logit_bias]
        require(all(t >= 0 for t in ids) and ids == sorted(set(ids)), field("logit_bias"), ids[:8],
                "must be distinct token ids >= 0 in ascending order (``bias_pairs``)")
        for t, w in self.logit_bias:
            require(math.isfinite(w), field(f"logit_bias[{t}]"), w, "must be a finite weight")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_history(self) -> bool:
        """Whether choosing this row's tokens depends on the tokens before them (``History``)."""
        return self.penalized or bool(self.bad_words)

    @property
    def word_context(self) -> int:
        """How many of the latest tokens the bad words look at (the longest one's length − 1)."""
        return max((len(w) for w in self.bad_words), default=1) - 1


def bias_pairs(ids: Sequence[int], weights: Sequence[float]) -> tuple[tuple[int, float], ...]:
    """``SamplingParams.logit_bias`` from parallel lists of token ids and weights: an id listed twice gets the sum
    of its weights (TensorRT-LLM's preprocessing adds each word's weight to each of its tokens' entries)."""
    total: dict[int, float] = {}
    for t, w in zip(ids, weights, strict=True):
        total[int(t)] = total.get(int(t), 0.0) + float(w)
    return tuple(sorted(total.items()))


def add_bias(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """``logits`` [b, S, V] with each row's ``logit_bias`` added at every slot: TensorRT-LLM's embedding bias, which
    its penalty kernel adds to the raw logit before temperature and the occurrence penalties
    (``penaltyKernels.cu``). Stateless, so a verify slot gets exactly what a one-token step gets: lossless. A copy;
    the same tensor when no row is biased."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    out = widen(logits).clone()
    for i in rows:
        ids, weights = zip(*params[i].logit_bias)
        out[i, :, list(ids)] += torch.tensor(weights, dtype=out.dtype, device=out.device)
    return out


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] -> probabilities [n, V] after temperature, top-k and top-p (nucleus) filtering."""
    logits = widen(logits) / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # [n, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p: drop a token if the mass before it already does.
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def slot_generator(generator: torch.Generator, position: int) -> torch.Generator:
    """The noise for the token at absolute ``position`` of a sequence seeded like ``generator``.

    Keying the noise by position (not by how many draws came before) makes a sampled sequence the same whatever the
    block sizes of its steps: verify slots past a rejection are discarded and their positions drawn again later from
    the same noise, which is independent of the prefix, so each emitted token is still an exact target sample.
    """
    return torch.Generator().manual_seed((generator.initial_seed() * 1_000_003 + position) % (1 << 63))


@lru_cache(maxsize=64)
def _on_path(parents: tuple[int, ...] | None, size: int) -> torch.Tensor:
    """[size, size] bool: node t (t >= 1) is on the path from node 0 down to node s, s included. A chain
    (``parents`` None) is the path 0, 1, ..., s."""
    if parents is None:
        out = torch.ones(size, size, dtype=torch.bool).tril()
    else:
        out = torch.zeros(size, size, dtype=torch.bool)
        for s, p in enumerate(parents):
            if s:
                out[s] = out[p]
                out[s, s] = True
    out[:, 0] = False
    return out


@dataclass(frozen=True)
class History:
    """What each verified slot's choice looks back at: per row, every token of the sequence up to and including slot
    0's input token (prompt and answer so far, the bonus among them), and the step's own input tokens on the path to
    the slot, which a one-token step would see once they are emitted. The occurrence penalties count them
    (``penalize``); the bad words read the latest (``ban_words``)."""

    counts: list[torch.Tensor | None]  # [b] of [V]: occurrences of each token id; None for a row without penalties
    ids: torch.Tensor | None = None  # [b, S] the verify's input tokens (slot 0 the bonus; < 0: no token)
    parents: tuple[int, ...] | None = None  # a tree verify's node parents (runtime.tree.Topology); None: a chain
    tails: list[tuple[int, ...] | None] | None = None  # [b] the sequence's latest tokens (``word_context`` of them)

    @staticmethod
    def of(sequences: Sequence[Sequence[int] | None], vocab: int, ids: torch.Tensor | None = None,
           parents: Sequence[int] | None = None, params: Sequence[SamplingParams] | None = None) -> History:
        """The history of rows whose tokens so far are ``sequences`` (None: a row that looks at none); with
        ``params``, only what each row's sampling needs (counts where penalised, the tail its bad words read;
        without, the counts of every row)."""
        counts, tails = [], []
        for seq, p in zip(sequences, params or [None] * len(sequences)):
            count = seq is not None and (p is None or p.penalized)
            counts.append(torch.bincount(torch.tensor(list(seq), dtype=torch.long), minlength=vocab).float()
                          if count else None)
            tails.append(tail(seq, p.word_context) if seq is not None and p is not None and p.bad_words else None)
        return History(counts, ids, None if parents is None else tuple(parents), tails)

    def rows(self, index: Sequence[int]) -> History:
        return History([self.counts[i] for i in index], None if self.ids is None else self.ids[list(index)],
                       self.parents, None if self.tails is None else [self.tails[i] for i in index])

    def slot_tails(self, row: int, first: int, n: int, length: int) -> list[tuple[int, ...]]:
        """The latest ``length`` tokens before slots first..first + n − 1 of ``row`` (its tail, then the step's
        input tokens on the path to each slot, the slot's own included)."""
        base = self.tails[row] if self.tails is not None and self.tails[row] is not None else ()
        if self.ids is None:
            return [tail(base, length)] * n
        ids = self.ids[row].tolist()
        on_path = _on_path(self.parents, len(ids))[first : first + n].tolist()
        return [tail(tuple(base) + tuple(t for t, on in zip(ids, path) if on and t >= 0), length) for path in on_path]

    def slot_counts(self, row: int, first: int, n: int) -> torch.Tensor:
        """[n, V] the occurrences behind slots first..first + n − 1 of ``row``: its counts plus the step's input
        tokens on the path to each slot (node 0, the bonus, is counted already)."""
        base = self.counts[row]
        assert base is not None
        out = base.expand(n, -1).clone()
        if self.ids is None:
            return out
        ids = self.ids[row].cpu()
        slot, node = _on_path(self.parents, ids.shape[0])[first : first + n].nonzero(as_tuple=True)
        tok = ids[node]
        keep = tok >= 0
        out.index_put_((slot[keep], tok[keep]), torch.ones(int(keep.sum())), accumulate=True)
        return out


def tail(tokens: Sequence[int], length: int) -> tuple[int, ...]:
    """The last ``length`` of ``tokens`` (all of them when there are fewer)."""
    return tuple(tokens[len(tokens) - length:]) if length > 0 else ()


def ban_words(
    logits: torch.Tensor,  # [b, S, V] at slots first..first + S − 1 of a step
    params: list[SamplingParams],
    history: History | None,
    first: int = 0,
) -> torch.Tensor:
    """``logits`` with each row's bad words applied as TensorRT-LLM's sampling layer applies them
    (``cpp/tensorrt_llm/kernels/banBadWords.cu``): a one-token word is never chosen; a longer one's last token is not
    chosen where the sequence so far (prompt included) ends in the word's other tokens. A verify slot looks at the
    step's tokens before it as a one-token step would once they are emitted, so drafts are checked against the same
    rule: lossless as ever. A copy; the same tensor when no row has bad words."""
    rows = [i for i, p in enumerate(params) if p.bad_words]
    if not rows:
        return logits
    require(history is not None, "history", None, "is needed to ban bad words")
    out = None
    for i in rows:
        words = params[i].bad_words
        for s, before in enumerate(history.slot_tails(i, first, logits.shape[1], params[i].word_context)):
            banned = [w[-1] for w in words if len(before) >= len(w) - 1 and tail(before, len(w) - 1) == w[:-1]]
            if banned:
                out = logits.clone() if out is None else out
                out[i, s, torch.tensor(banned)] = float("-inf")
    return logits if out is None else out


def penalize(
    logits: torch.Tensor,  # [b, S, V] at slots first..first + S − 1 of a step
    params: list[SamplingParams],
    history: History | None,
    first: int = 0,
) -> torch.Tensor:
    """``logits`` with each row's occurrence penalties applied, as TensorRT-LLM's sampling layer applies them
    (``cpp/tensorrt_llm/kernels/penaltyKernels.cu``, ``batchApplyPenalty``, with its default promptIgnoreLength 0):
    over every token of the prompt and of the answer so far, a token that occurs c > 0 times has its logit l, after
    temperature, turned into l / r (l >= 0) or l · r (l < 0) for ``repetition_penalty`` r, then lowered by
    ``presence_penalty`` and by c × ``frequency_penalty``. Here the temperature divides later (``processed_probs``),
    so the subtracted terms are scaled by it. A verify slot counts the step's tokens before it as a one-token step
    would count them once emitted, so drafts are checked against the penalised distribution: lossless as ever. A
    copy; the same tensor when no row is penalised."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    require(history is not None, "history", None, "is needed to apply repetition/presence/frequency penalties")
    out = widen(logits).clone()
    for i in rows:
        p = params[i]
        counts = history.slot_counts(i, first, out.shape[1]).to(out.device, out.dtype)  # [S, V'], V' <= V
        counts = torch.nn.functional.pad(counts, (0, out.shape[-1] - counts.shape[-1]))  # a padded head's extra ids
        seen = counts > 0
        x = out[i]
        if p.repetition_penalty != 1.0:
            x = torch.where(seen, torch.where(x < 0, x * p.repetition_penalty, x / p.repetition_penalty), x)
        scale = 1.0 if p.greedy else p.temperature
        if p.presence_penalty:
            x = x - (p.presence_penalty * scale) * seen
        if p.frequency_penalty:
            x = x - (p.frequency_penalty * scale) * counts
        out[i] = x
    return out


def chosen_logprobs(
    logits: torch.Tensor,  # [b, S, V] processed logits (``ban_tokens``, ``penalize``): what the choice was made from
    params: list[SamplingParams],  # [b]
    tokens: torch.Tensor,  # [b, S] the chosen tokens (< 0: none; its value is meaningless)
) -> torch.Tensor:  # [b, S], float32 or wider (the logits' widened dtype)
    """The log-probability of each chosen token under the distribution it was drawn from: the softmax of the
    processed logits at the row's temperature (1 for a greedy row), before top-k / top-p truncation — what
    TensorRT-LLM's sampling kernels add to ``cum_log_probs`` and write to ``output_log_probs`` when
    ``normalize_log_probs`` is off (``samplingTopKKernels.cu``: log P(i | vocabulary), "the same way as OpenAI
    does"). A verify slot's logits are a one-token step's, so speculative decoding returns the autoregressive values
    (up to float rounding: the forward's shapes differ)."""
    x = widen(logits)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=x.dtype, device=x.device)
    x = x / temps[:, None, None]
    picked = x.gather(-1, tokens.clamp(min=0)[..., None].to(x.device))[..., 0]
    return picked - torch.logsumexp(x, dim=-1)


def logprobs_buffer(params: Sequence[SamplingParams], rows: int, slots: int, device) -> torch.Tensor | None:
    """A step's [rows, slots] buffer for its tokens' log-probabilities (``target_samples`` writes it; NaN where
    nothing is written; float64, so a float64 model's values stay exact) when one of its rows asks for them
    (``SamplingParams.logprobs``); None otherwise."""
    if not any(p.logprobs for p in params):
        return None
    return torch.full((rows, slots), float("nan"), dtype=torch.float64, device=device)


def target_samples(
    logits: torch.Tensor,  # [b, S, V] target logits at the verified slots
    params: list[SamplingParams],  # [b]
    generators: list[torch.Generator | None],  # [b]; None for greedy rows
    positions: torch.Tensor | None = None,  # [b] absolute position of the token slot 0 predicts; None = sequential
    offsets: list[int] | None = None,  # [S] with positions: slot s predicts position positions + offsets[s] (a tree's
    # node depths); None: + s
    history: History | None = None,  # what the slots of penalised rows and rows with bad words look back at
    logprobs: torch.Tensor | None = None,  # [b, S] written: each sample's log-probability (``logprobs_buffer``)
) -> torch.Tensor:  # [b, S] int64
    """One target sample per slot (x_i in the module docstring). With ``positions``, sampled rows draw each slot's
    token from that position's noise (``slot_generator``); without, from the row's generator in order."""
    logits = add_bias(logits, params)
    logits = ban_tokens(ban_words(penalize(logits, params, history), params, history), params, positions, offsets)
    out = logits.argmax(-1)
    for row, p in enumerate(params):
        if not p.greedy:
            probs = processed_probs(logits[row], p)  # [S, V]
            if positions is None:
                out[row] = torch.multinomial(probs, 1, generator=generators[row]).squeeze(-1).to(out.device)
            else:
                start = int(positions[row])
                at = range(probs.shape[0]) if offsets is None else offsets
                out[row] = torch.tensor([int(torch.multinomial(probs[s], 1, generator=slot_generator(
                    generators[row], start + o))) for s, o in enumerate(at)], device=out.device)
    if logprobs is not None:
        logprobs.copy_(chosen_logprobs(logits, params, out))
    return out


def ban_tokens(
    logits: torch.Tensor,  # [b, S, V] at the slots of ``target_samples``
    params: list[SamplingParams],
    positions: torch.Tensor | None,  # [b] absolute position slot 0 predicts
    offsets: Sequence[int] | None = None,  # [S] slot s predicts positions + offsets[s]; None: + s
) -> torch.Tensor:
    """``logits`` with each row's ``banned_ids`` at −inf in the slots that predict a position before its
    ``banned_before`` (a copy; the same tensor when no row bans anything there). Applied before any choice, so a
    verify slot and a one-token step choose alike: lossless as ever."""
    rows = [i for i, p in enumerate(params) if p.banned_ids]
    if not rows:
        return logits
    require(positions is not None, "positions", None, "are needed to ban tokens by position")
    at = torch.tensor(list(offsets) if offsets is not None else range(logits.shape[1]))
    out = None
    for i in rows:
        slots = (int(positions[i]) + at < params[i].banned_before).nonzero().flatten().tolist()
        if slots:
            out = logits.clone() if out is None else out
            out[i, torch.tensor(slots)[:, None], torch.tensor(params[i].banned_ids)[None]] = float("-inf")
    return logits if out is None else out


def accepted_lengths(
    drafts: torch.Tensor,  # [b, B−1] d_1..d_{B−1}
    samples: torch.Tensor,  # [b, B] x_0..x_{B−1}
) -> torch.Tensor:  # [b] a: longest prefix with d_{i+1} == x_i
    """Example: drafts [7, 8, 9], samples [7, 8, 5, 4] -> a = 2; emitted 7, 8, 5 (τ = 3)."""
    match = (drafts == samples[:, :-1]).long()  # [b, B−1]
    return match.cumprod(dim=-1).sum(dim=-1)


def verify_samples(
    head,  # final-normed hidden [n, S, H] -> logits [n, S, V] (the target's LM head)
    hidden: torch.Tensor,  # [b, B, H] the verify forward's final-normed hidden states
    drafts: torch.Tensor,  # [b, B−1] d_1..d_{B−1}
    params: list[SamplingParams],  # [b]
    generators: list[torch.Generator | None],  # [b]
    positions: torch.Tensor | None = None,  # [b] see ``target_samples``
    history: History | None = None,  # see ``target_samples``
    logprobs: torch.Tensor | None = None,  # [b, B] written at x_0..x_a at least (``logprobs_buffer``)
) -> tuple[torch.Tensor, torch.Tensor]:  # samples [b, B] (x_0..x_a valid), accepted lengths a [b]
    """Target samples and accepted lengths of one verify step (= ``target_samples`` then ``accepted_lengths``).

    On a CPU with all rows greedy the LM head (a 49k × 576 GEMM per slot for SmolLM2) runs lazily: slots in chunks
    of 1, 2, 4, ... and only for rows that accepted every draft so far, so a step that rejects d_1 (most steps where
    acceptance is low) computes one slot instead of B. Slots after a row's bonus token are left at −1. Sampled rows
    and GPUs (where the full head is one cheap GEMM and a host sync per chunk would cost more) take the eager path. A
    draft of −1 (padding under ``--block-size auto``) never matches. Rows with a min_tokens ban
    (``SamplingParams.banned_ids``), penalties or bad words have them applied to each chunk's logits.
    """
    if hidden.device.type != "cpu" or not all(p.greedy for p in params):
        samples = target_samples(head(hidden), params, generators, positions, history=history, logprobs=logprobs)
        return samples, accepted_lengths(drafts, samples)
    b, B = hidden.shape[:2]
    banning = any(p.banned_ids for p in params)
    looking = any(p.needs_history for p in params)
    samples = torch.full((b, B), -1, dtype=torch.long, device=hidden.device)
    acc = torch.zeros(b, dtype=torch.long, device=hidden.device)
    alive = torch.arange(b, device=hidden.device)  # rows whose drafts all matched so far
    lo, width = 0, 1
    while lo < B and len(alive):
        hi = min(B, lo + width)
        x = head(hidden[alive, lo:hi])  # [a, hi − lo, V]
        live = alive.tolist()
        rows = [params[i] for i in live]
        x = add_bias(x, rows)
        if looking:  # penalties and bad words: each slot's tokens before it
            hist = history and history.rows(live)
            x = ban_words(penalize(x, rows, hist, first=lo), rows, hist, first=lo)
        if banning:  # min_tokens: the rows' end ids out of the slots before their positions
            x = ban_tokens(x, rows, None if positions is None else positions[alive] + lo)
        chosen = x.argmax(-1)  # [a, hi − lo]
        if logprobs is not None:
            logprobs[alive, lo:hi] = chosen_logprobs(x, rows, chosen).to(logprobs.dtype)
        samples[alive, lo:hi] = chosen
        m = min(hi, B - 1) - lo  # slots of this chunk that have a draft to check (the last slot has none)
        if m > 0:
            match = (drafts[alive, lo : lo + m] == chosen[:, :m]).long().cumprod(-1)  # [a, m]
            acc[alive] += match.sum(-1)
            alive = alive[match[:, -1].bool()]
        lo, width = hi, 2 * width
    return samples, acc
