"""The three DFlash step engines behind the Triton models, free of any Triton import (unit-testable):

``TargetVerifier``  stateful: one target KV-cache row per live sequence. ``start`` prefills a prompt and samples the
                    first token; ``verify`` runs [bonus, d_1..d_{B−1}] for a batch of sequences in one forward,
                    samples, accepts (runtime.sampling) and commits τ tokens, returning their taps; given a tree's
                    ``parents`` it verifies every node of the tree instead and commits the longest accepted path
                    (runtime.tree).
``KVInjector``      stateless: taps -> per-layer context K/V (drafter.context_kv).
``BlockDrafter``    stateful: one drafter context-cache row per live sequence. ``draft`` appends the injected K/V and
                    runs one non-causal block forward per batch of sequences -> drafts (greedy, target LM head; or
                    the ``top`` best tokens per slot, for a tree verify).

Sequences are keyed by a client-chosen integer ``seq_id``; rows are allocated on ``start``/first use and freed by
``free`` or after ``idle_timeout_s`` without use. The same engines run in-process (``runtime.decoder`` builds them
over its own models, ``cache`` and ``rows_by_seq_id``) and behind the Triton step models, with the fast paths:
``kernels`` (``plugin.dispatch.Impl``; AUTO: the drafting plugin's Triton kernels on CUDA, the drafter's torch code
elsewhere) for the KV injection and the draft pass, and ``cuda_graphs`` (``runtime.graphs``: "auto", the default,
on a CUDA device only; True / "on" on CUDA, "rehearse" anywhere; or a ``StepGraphs`` the engines share) for the
verify, the tree verify and the draft pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import torch

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.models.drafter import DrafterModel, draft_block
from trtllm_dflash.models.layers import KVCache, linear, stack_padded
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.models.weights import read_state_dict
from trtllm_dflash.plugin.dispatch import Impl, draft_pass, resolve
from trtllm_dflash.runtime.graphs import StepGraphs
from trtllm_dflash.runtime.sampling import (History, SamplingParams, logprobs_buffer, tail, target_samples,
                                            verify_samples)
from trtllm_dflash.runtime.tree import Topology, commit_path


SLOTS_EXHAUSTED = "slots are in use"  # message marker the BLS loop waits on (serve/triton/bls.py)


class SlotsExhausted(ConfigError):
    pass


@dataclass
class SlotTable:
    """seq_id -> cache row, with idle-time bookkeeping; counts what it freed and why (telemetry). ``data`` holds the
    owner's per-sequence payload (sampling state, token history), dropped with the slot on free and on time-out."""

    num_rows: int
    idle_timeout_s: float
    by_seq_id: bool = False  # seq_id n takes row n where that row is free (the in-process decoder: row = request)
    rows: dict[int, int] = field(default_factory=dict)
    last_used: dict[int, float] = field(default_factory=dict)
    data: dict[int, Any] = field(default_factory=dict)
    freed: int = 0
    timed_out: int = 0

    def get(self, seq_id: int) -> int:
        if seq_id not in self.rows:
            raise ConfigError("seq_id", seq_id, "is not a live sequence (finished, cancelled or timed out)",
                              "start the sequence first")
        self.last_used[seq_id] = time.monotonic()
        return self.rows[seq_id]

    def allocate(self, seq_id: int) -> int:
        require(seq_id not in self.rows, "seq_id", seq_id, "is already live", "use a fresh sequence id")
        self.expire()
        used = set(self.rows.values())
        own = self.by_seq_id and 0 <= seq_id < self.num_rows and seq_id not in used
        free = seq_id if own else next((r for r in range(self.num_rows) if r not in used), None)
        if free is None:
            raise SlotsExhausted("live sequences", len(self.rows), f"all {self.num_rows} {SLOTS_EXHAUSTED}",
                                 "retry later or render the repository with a larger --max-sequences")
        self.rows[seq_id] = free
        self.last_used[seq_id] = time.monotonic()
        return free

    def free(self, seq_id: int) -> bool:
        if self.rows.pop(seq_id, None) is None:
            return False
        self.last_used.pop(seq_id, None)
        self.data.pop(seq_id, None)
        self.freed += 1
        return True

    def expire(self) -> list[int]:
        now = time.monotonic()
        stale = [s for s, t in self.last_used.items() if now - t > self.idle_timeout_s]
        for s in stale:
            self.free(s)
            self.timed_out += 1
        return stale


@dataclass(frozen=True, slots=True)
class StartResult:
    first_token: int
    taps: torch.Tensor | None  # [P, K·H] of the prompt, or None when taps were not requested
    logprobs: list[float] | None = None  # [1] the first token's log-probability, when its sampling asks


@dataclass(frozen=True, slots=True)
class VerifyResult:
    emitted: list[int]  # x_0..x_a: accepted drafts + bonus (τ = len)
    taps: torch.Tensor | None  # [τ, K·H] of the committed tokens [bonus, d_1..d_a]
    logprobs: list[float] | None = None  # [τ] the emitted tokens' log-probabilities, when the sequence asks
    path: int | None = None  # a tree verify: the index of the kept path (``TreeShape.tables``), else None


def real_width(block: list[int]) -> int:
    """The tokens of a verify block before its −1 padding (the step's common width, ``runtime.stepper``): on a CPU the
    layers compute only those (``TargetModel.verify_widths``), so a row that verifies no drafts costs one token."""
    return next((j for j, t in enumerate(block) if t < 0), len(block))


def out_of_vocab(ids: torch.Tensor, vocab: int, pad: int | None = None) -> int | None:
    """The first of a client's token ids outside [0, ``vocab``) (``pad``: a padding id allowed besides), or None. The
    step engines check them before any state changes: out of the vocabulary, the embedding lookup fails with torch's
    "index out of range in self" after ``start`` has taken a slot, which then stays taken until the idle time-out
    (unchecked, three such requests held three of a demo server's four slots)."""
    bad = (ids < 0) | (ids >= vocab)
    if pad is not None:
        bad &= ids != pad
    return int(ids[bad][0]) if bool(bad.any()) else None


@lru_cache(maxsize=16)
def tree_topology(parents: tuple[int, ...]) -> Topology:
    """A tree verify's topology as a request gives it (``parents``), or a ConfigError naming what is wrong."""
    try:
        return Topology(parents)
    except ValueError as exc:
        raise ConfigError("parents", list(parents[:8]), str(exc), "send runtime.tree.TreeShape.parents") from None


def verify_forward(target: TargetModel, graphs: StepGraphs | None, cache: KVCache, ids: torch.Tensor,
                   rows: torch.Tensor | None, tap_layers: tuple[int, ...], widths: list[int] | None = None):
    """The target over a verify's [b, S] tokens at the rows' next positions (``rows`` None: every row of ``cache``) ->
    (hidden, taps at ``tap_layers``): through the CUDA graph of this shape when ``graphs`` are on, else skipping the
    padding past each row's real ``widths`` where that pays (``TargetModel.verify_widths``). ``TargetVerifier``
    verifies through it and the cost model's calibration (``runtime.decoder.calibrated_policy``) times it."""
    if graphs is None:
        return target(ids, cache, rows, tap_layers, widths=None if widths is None else target.verify_widths(widths))
    inputs = (ids,) if rows is None else (ids, rows)
    return graphs.run(("verify", id(cache), tuple(ids.shape), bool(tap_layers), rows is None), cache,
                      lambda x, *r: target(x, cache, r[0] if r else None, tap_layers=tap_layers, static=True),
                      *inputs)


class TargetVerifier:
    forks = True  # a sibling sequence may copy a kept prefill (``start(keep=)``, ``fork``)

    def __init__(self, target: TargetModel, tap_layers: tuple[int, ...], max_sequences: int, max_seq_len: int,
                 max_block_size: int, idle_timeout_s: float = 120.0, max_tree_nodes: int = 0,
                 cuda_graphs: bool | str | StepGraphs = "auto", cache: KVCache | None = None,
                 rows_by_seq_id: bool = False) -> None:
        """``max_tree_nodes``: the widest tree verify allowed (0: none); the cache keeps that many scratch slots past
        a sequence's committed tokens (else one block's). ``cuda_graphs``: the verify and tree-verify forwards replay
        a CUDA graph per step shape (``runtime.graphs``; the prefill runs eagerly). ``cache``: the KV cache to use
        (a decoder's pooled one, whose graphs outlive this engine) instead of a new one; ``rows_by_seq_id``: sequence
        n takes cache row n (``SlotTable.by_seq_id``)."""
        self.target, self.tap_layers = target, tap_layers
        self.graphs = StepGraphs.for_device(target.device, cuda_graphs)
        self.max_seq_len, self.max_tree_nodes = max_seq_len, max_tree_nodes
        self.cache = cache if cache is not None else \
            target.new_cache(max_sequences, max_seq_len + max(max_block_size, max_tree_nodes))
        self.slots = SlotTable(max_sequences, idle_timeout_s, by_seq_id=rows_by_seq_id)
        # seq_id -> its sampling, generator, and its tokens so far (prompt and returned tokens) as runtime.sampling
        # looks back at them: when penalised, their occurrences [V] (``penalize``); with bad words, the latest
        # ``word_context`` of them (``ban_words``)
        self.sampling: dict[int, tuple[SamplingParams, torch.Generator | None, torch.Tensor | None, list[int] | None]] \
            = self.slots.data
        # seq_id -> [siblings still to fork, its prompt, its prompt's last hidden state] (``start(keep=)``, ``fork``)
        self.prefills: dict[int, list] = {}
        self.forked = 0  # sequences started by ``fork`` (no prefill of their own)

    def start(self, seq_id: int, prompt_ids: list[int], sampling: SamplingParams, want_taps: bool,
              keep: int = 0) -> StartResult:
        """A sequence's prefill and first token. ``keep`` > 0: that many sibling sequences of the same prompt will
        ``fork`` from this one (a request's num_return_sequences), so its prompt's last hidden state is kept until
        they have."""
        (result,), last = self._prefill([seq_id], [prompt_ids], [sampling], want_taps)
        if keep > 0:
            self.prefills[seq_id] = [keep, tuple(prompt_ids), last[0].clone()]  # not the whole prompt's
        return result

    def start_many(self, seq_ids: list[int], prompts: list[list[int]], samplings: list[SamplingParams],
                   want_taps: bool) -> list[StartResult]:
        """Several sequences' prefills in one forward over their right-padded prompts (the layers compute each
        prompt's own tokens only, ``TargetModel.forward``'s ``widths``), and their first tokens. All or none start:
        a failure frees every slot it took."""
        return self._prefill(seq_ids, prompts, samplings, want_taps)[0]

    def _prefill(self, seq_ids, prompts, samplings, want_taps) -> tuple[list[StartResult], torch.Tensor]:
        """``start_many`` -> (its results, each prompt's last hidden state [n, 1, 1, H])."""
        opened: list[tuple[int, History | None]] = []
        lens = [len(p) for p in prompts]
        try:
            for seq_id, prompt, sampling in zip(seq_ids, prompts, samplings):
                opened.append(self._open(seq_id, prompt, sampling))
            rows = torch.tensor([row for row, _ in opened])
            ids = torch.zeros(len(prompts), max(lens), dtype=torch.long)
            for j, prompt in enumerate(prompts):
                ids[j, : lens[j]] = torch.tensor(prompt)
            self.cache.crop(rows, torch.zeros(len(rows), dtype=torch.long))
            with torch.inference_mode():
                hidden, taps = self.target(ids.to(self.target.device), self.cache, rows,
                                           self.tap_layers if want_taps else (),
                                           widths=torch.tensor(lens))  # padding: skipped
            last = torch.stack([hidden[j : j + 1, n - 1 : n] for j, n in enumerate(lens)])  # [n, 1, 1, H]
            firsts = [self._first_token(s, last[j], lens[j], opened[j][1]) for j, s in enumerate(seq_ids)]
        except BaseException:
            for seq_id in seq_ids[: len(opened)]:
                self.slots.free(seq_id)  # a failed start holds no slot
            raise
        self.cache.commit(rows, torch.tensor(lens))
        return [StartResult(first, taps[j, : lens[j]] if want_taps else None, lp)
                for j, (first, lp) in enumerate(firsts)], last

    def fork(self, seq_id: int, parent: int, prompt_ids: list[int], sampling: SamplingParams) -> StartResult:
        """A sibling's start without a prefill: the prompt's K/V copied from the live sequence ``parent`` (started
        with ``keep``), its first token drawn from the parent's last hidden state with its own sampling: what
        ``start`` would compute (the same forward's values), at the cost of a copy. No taps: the prompt's are the
        parent's."""
        kept = self.prefills.get(parent)
        require(kept is not None and parent in self.slots.rows, "fork_of", parent,
                "is not a live sequence started with keep_prefill (or its siblings have all forked)",
                "start the sequence with its own prefill")
        require(tuple(prompt_ids) == kept[1], "tokens", f"{len(prompt_ids)} tokens",
                f"differ from the prompt of sequence {parent}", "fork only siblings of the same prompt")
        row, history = self._open(seq_id, prompt_ids, sampling)
        try:
            src, n = self.slots.rows[parent], len(prompt_ids)
            for cache in (self.cache.k, self.cache.v):
                cache[:, row, :n] = cache[:, src, :n]
            first, lp = self._first_token(seq_id, kept[2], n, history)
        except BaseException:
            self.slots.free(seq_id)
            raise
        self.cache.crop(torch.tensor([row]), torch.tensor([n]))
        self.forked += 1
        kept[0] -= 1
        if kept[0] <= 0:
            del self.prefills[parent]
        return StartResult(first, None, lp)

    def _open(self, seq_id: int, prompt_ids: list[int], sampling: SamplingParams) -> tuple[int, History | None]:
        """Check a start's inputs (before any state changes), take a slot and set up the sequence's sampling ->
        (its cache row, what its first token's choice looks back at)."""
        require(0 < len(prompt_ids) < self.max_seq_len, "prompt length", len(prompt_ids),
                f"must be in [1, {self.max_seq_len}) tokens (the repository's max_seq_len)", "shorten the prompt")
        self._check_ids(torch.tensor([prompt_ids]), "prompt token id", pad=None)
        if sampling.banned_ids:  # min_tokens' end ids (runtime.sampling.ban_tokens indexes the logits with them)
            self._check_ids(torch.tensor([sampling.banned_ids]), "banned_ids", pad=None)
        for word in sampling.bad_words:  # so do the bad words' last tokens
            self._check_ids(torch.tensor([word]), "bad_words token id", pad=None)
        if sampling.logit_bias:  # and runtime.sampling.add_bias
            self._check_ids(torch.tensor([[t for t, _ in sampling.logit_bias]]), "logit_bias token id", pad=None)
        sampling.validate()
        row = self.slots.allocate(seq_id)
        try:
            gen = None if sampling.greedy else torch.Generator().manual_seed(sampling.seed)
            history = (History.of([prompt_ids], self.target.spec.vocab_size, params=[sampling])
                       if sampling.needs_history else None)
            self.sampling[seq_id] = (sampling, gen, history.counts[0] if history else None,
                                     list(tail(prompt_ids, sampling.word_context)) if sampling.bad_words else None)
        except BaseException:
            self.slots.free(seq_id)
            raise
        return row, history

    def _first_token(self, seq_id: int, last_hidden: torch.Tensor, prompt_len: int,
                     history: History | None) -> tuple[int, list[float] | None]:
        """A started sequence's first token from its prompt's last hidden state [1, 1, H] (and its log-probability)."""
        sampling, gen, *_ = self.sampling[seq_id]
        lp = logprobs_buffer([sampling], 1, 1, self.target.device)
        with torch.inference_mode():
            first = int(target_samples(self.target.logits(last_hidden), [sampling], [gen], torch.tensor([prompt_len]),
                                       history=history, logprobs=lp)[0, 0])
        self._count(seq_id, [first])
        return first, None if lp is None else lp[0].tolist()

    def verify(self, seq_ids: list[int], blocks: list[list[int]], want_taps: bool,
               parents: tuple[int, ...] | None = None) -> list[VerifyResult]:
        """One forward over equally long blocks [bonus, d_1..d_{B−1}] of several sequences (−1: padding to the
        common length, never accepted, and on a CPU the projections and MLPs skip it: ``real_width``); with a tree's
        ``parents`` each block holds every node's token (node 0 the bonus; −1: no token there)."""
        require(len({len(b) for b in blocks}) == 1, "blocks", [len(b) for b in blocks], "must share one length")
        slots = [self.slots.get(s) for s in seq_ids]
        order = sorted(range(len(seq_ids)), key=slots.__getitem__)
        if slots != sorted(slots):  # by slot: consecutive slots read the cache as a view (KVCache.view_rows)
            got = self.verify([seq_ids[j] for j in order], [blocks[j] for j in order], want_taps, parents)
            back: list = [None] * len(order)
            for result, j in zip(got, order):
                back[j] = result
            return back
        rows = torch.tensor(slots)
        ids = torch.tensor(blocks)  # [b, B]
        self._check_ids(ids, "verify token id", pad=-1)
        ids = ids.to(self.target.device)
        params = [self.sampling[s] for s in seq_ids]
        if parents is not None:
            results = self._verify_tree(rows, ids, want_taps, tree_topology(tuple(parents)), params)
        else:
            positions = self.cache.lengths[rows] + 1  # [b] the token slot 0 predicts (per-position sampling noise)
            lp = logprobs_buffer([p for p, *_ in params], *ids.shape, self.target.device)
            with torch.inference_mode():
                hidden, taps = self._forward(ids.clamp(min=0), rows, want_taps, [real_width(b) for b in blocks])
                samples, acc = verify_samples(self.target.logits, hidden, ids[:, 1:], [p for p, *_ in params],
                                              [g for _, g, *_ in params], positions,
                                              self._history(params, ids), lp)  # [b, B], [b]
            self.cache.commit(rows, acc + 1)
            results = self._results(samples, acc, taps if want_taps else None, lp)
        for seq_id, r in zip(seq_ids, results):
            self._count(seq_id, r.emitted)
        return results

    def _forward(self, ids: torch.Tensor, rows: torch.Tensor, want_taps: bool, widths: list[int]):
        return verify_forward(self.target, self.graphs, self.cache, ids, rows.to(ids.device),
                              self.tap_layers if want_taps else (), widths)

    @staticmethod
    def _history(params, ids: torch.Tensor, parents: tuple[int, ...] | None = None) -> History | None:
        """What the sequences of a verify with penalties or bad words look back at: their occurrences or latest tokens
        so far, and the block's tokens."""
        if not any(p.needs_history for p, *_ in params):
            return None
        return History([c for _, _, c, _ in params], ids, parents,
                       [None if t is None else tuple(t) for *_, t in params])

    def _count(self, seq_id: int, returned: list[int]) -> None:
        """Add a sequence's returned tokens to what its penalties count and its bad words read (the next verify's
        slot 0 is the last of them)."""
        sampling, _, counts, tokens = self.sampling[seq_id]
        if counts is not None:
            counts.index_put_((torch.tensor(returned, dtype=torch.long),), torch.ones(len(returned)), accumulate=True)
        if tokens is not None:
            tokens[:] = tail(tokens + returned, sampling.word_context)

    def _verify_tree(self, rows, ids, want_taps, topology: Topology, params) -> list[VerifyResult]:
        require(topology.size <= self.max_tree_nodes, "parents", f"a tree of {topology.size} nodes",
                f"exceeds the {self.max_tree_nodes} nodes this target_verify keeps room for",
                "render the repository with --tree (make-repo sizes the cache for its tree)")
        require(ids.shape[1] == topology.size, "tokens", ids.shape[1],
                f"must hold one token per tree node ({topology.size})")
        committed = self.cache.lengths[rows]
        lp = logprobs_buffer([p for p, *_ in params], *ids.shape, self.target.device)
        layers, cache = self.tap_layers if want_taps else (), self.cache
        with torch.inference_mode():
            if self.graphs is None:
                hidden, taps = self.target(ids.clamp(min=0), cache, rows, layers, layout=topology.layout(committed))
            else:  # the layout over every cache slot, from the lengths on the device
                hidden, taps = self.graphs.run(
                    ("tree", id(cache), tuple(ids.shape), tuple(topology.parents), want_taps), cache,
                    lambda x, r: self.target(x, cache, r, layers, layout=topology.layout(cache.lengths[r],
                                                                                         cache.max_len)),
                    ids.clamp(min=0), rows.to(ids.device))
            preds = topology.samples(self.target.logits(hidden), [p for p, *_ in params], [g for _, g, *_ in params],
                                     committed, self._history(params, ids, topology.parents), lp)
            samples, acc, taken, best = topology.verify(preds, ids)
        commit_path(self.cache, rows, committed, taken, acc)
        self.cache.commit(rows, acc + 1)
        if want_taps:
            taps = taps.gather(1, taken[..., None].expand(-1, -1, taps.shape[-1]))
        return self._results(samples, acc, taps if want_taps else None, None if lp is None else lp.gather(1, taken),
                             best.tolist())

    def _check_ids(self, ids: torch.Tensor, field: str, pad: int | None) -> None:
        vocab = self.target.spec.vocab_size
        bad = out_of_vocab(ids, vocab, pad)
        if bad is not None:
            raise ConfigError(field, bad, f"must be in [0, {vocab}) (the target's vocabulary)",
                              "send token ids of the target's tokenizer")

    @staticmethod
    def _results(samples: torch.Tensor, acc: torch.Tensor, taps: torch.Tensor | None,
                 logprobs: torch.Tensor | None = None, paths: list[int] | None = None) -> list[VerifyResult]:
        accepted = acc.tolist()
        lps = None if logprobs is None else logprobs.tolist()
        return [VerifyResult(samples[j, : a + 1].tolist(), taps[j, : a + 1] if taps is not None else None,
                             None if lps is None else lps[j][: a + 1], None if paths is None else paths[j])
                for j, a in enumerate(accepted)]

    def free(self, seq_id: int) -> bool:
        self.prefills.pop(seq_id, None)
        return self.slots.free(seq_id)

    def expire(self) -> None:
        self.slots.expire()
        for seq in [s for s in self.prefills if s not in self.slots.rows]:  # timed out with siblings still to fork
            del self.prefills[seq]


class KVInjector:
    def __init__(self, drafter: DrafterModel, kernels: Impl = Impl.AUTO) -> None:
        """``kernels``: AUTO runs the drafting plugin's fused injection (every layer's K/V projection in one GEMM, the
        k_norm + RoPE + store as one Triton kernel: ``plugin.kv_inject``) on CUDA and ``DrafterModel.context_kv``
        elsewhere, as the in-process decoder does."""
        self.drafter = drafter
        self.kernels = resolve(kernels, next(drafter.parameters()).device)
        self.weights = None
        if self.kernels is Impl.TRITON:
            from trtllm_dflash.plugin.kv_inject import InjectWeights

            self.weights = InjectWeights.from_drafter(drafter)

    def __call__(self, taps: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """taps [T, K·H] of tokens at positions start..start+T−1 -> K, V [num_layers, T, num_kv_heads, head_dim]."""
        k, v = self.rows(taps[None], torch.tensor([start]))
        return k[0], v[0]

    def rows(self, taps: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """taps [n, T, K·H] of n sequences, row j at positions starts[j].. -> K, V [n, num_layers, T, kv, head_dim]
        (one forward; every token's K/V depends on that token alone, so padded rows cost only their padding)."""
        positions = starts.to(taps.device)[:, None] + torch.arange(taps.shape[1], device=taps.device)[None]
        # a short row padded to a long one (a sequence that verified prompt lookup for many steps) may run past the
        # rotary table there; those K/V are padding, discarded by the caller
        positions = positions.clamp(max=self.drafter.rotary.max_positions - 1)
        with torch.inference_mode():
            if self.weights is not None:
                return self._kernel_kv(taps, positions)
            k, v = self.drafter.context_kv(taps, positions)
        return k.transpose(0, 1), v.transpose(0, 1)

    def _kernel_kv(self, taps: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` through the plugin's injection: each row's K/V stored into an output laid out as a one-row cache
        of T slots, rotated at the row's own positions (the rotary tables gathered at them, so slot t takes
        position positions[j, t])."""
        from trtllm_dflash.plugin import dispatch
        from trtllm_dflash.plugin.ragged import RaggedBatch

        w, rotary = self.weights, self.drafter.rotary
        n, t, _ = taps.shape
        shape = (w.num_layers, 1, t, w.num_kv_heads, w.head_dim)  # one row of t slots: what the kernel stores into
        batch = RaggedBatch.from_lengths(torch.tensor([t], dtype=torch.int32, device=taps.device))
        zero = torch.zeros(1, dtype=torch.long, device=taps.device)
        ks, vs = [], []
        for j in range(n):
            k, v = taps.new_empty(shape, dtype=w.fc.dtype), taps.new_empty(shape, dtype=w.fc.dtype)
            dispatch.kv_inject(taps[j], batch, zero, zero, w, rotary.cos[positions[j]], rotary.sin[positions[j]],
                               k, v, self.kernels)
            ks.append(k)
            vs.append(v)
        return torch.cat(ks, dim=1).transpose(0, 1), torch.cat(vs, dim=1).transpose(0, 1)


class TargetHead:
    """The target's embedding table and LM head, loaded alone (the drafter model needs both, nothing else)."""

    def __init__(self, target_dir, dtype=torch.float32, device="cpu") -> None:
        from trtllm_dflash.specs import TargetSpec

        spec = TargetSpec.load(target_dir)
        names = ("model.embed_tokens.weight",) + (() if spec.tie_word_embeddings else ("lm_head.weight",))
        state = read_state_dict(target_dir, names)  # these two tensors only, not the target's layers
        self.embed = state["model.embed_tokens.weight"].to(dtype=dtype, device=device)  # [V, H]
        head = self.embed if spec.tie_word_embeddings else state["lm_head.weight"]
        self.lm_head = head.to(dtype=dtype, device=device)  # [V, H]

    @classmethod
    def of(cls, target: TargetModel) -> "TargetHead":
        """A loaded target's own embedding table and LM head (shared, not copied): the in-process decoder's."""
        head = cls.__new__(cls)
        head.embed, head.lm_head = target.model.embed_tokens.weight, target.lm_head.weight
        return head


class BlockDrafter:
    def __init__(self, drafter: DrafterModel, head: TargetHead, max_sequences: int, max_seq_len: int,
                 idle_timeout_s: float = 120.0, kernels: Impl = Impl.AUTO,
                 cuda_graphs: bool | str | StepGraphs = "auto",
                 cache: KVCache | None = None, rows_by_seq_id: bool = False, propose=None) -> None:
        """``kernels``: AUTO runs the draft pass's attention through the drafting plugin's Triton kernel on CUDA
        (``plugin.dispatch.draft``) and the drafter's torch code elsewhere; ``cuda_graphs``: the whole draft (block
        embedding, drafter, head, argmax) replays a CUDA graph per batch shape. ``cache`` and ``rows_by_seq_id`` as
        ``TargetVerifier``'s. ``propose(seq_ids, bonus, rows, num_drafts, top)``: what makes the drafts once the
        context is appended (default ``block``; the in-process decoder routes it through its own ``propose``, which
        tests override to choose the drafts)."""
        self.drafter, self.head = drafter, head
        device = next(drafter.parameters()).device
        self.kernels = resolve(kernels, device)
        self.graphs = StepGraphs.for_device(device, cuda_graphs)
        self.cache = cache if cache is not None else drafter.new_cache(max_sequences,
                                                                       max_seq_len + drafter.spec.block_size)
        self.slots = SlotTable(max_sequences, idle_timeout_s, by_seq_id=rows_by_seq_id)
        self.propose = propose or (lambda seq_ids, bonus, rows, k, top: self.block(bonus, self.cache, rows, k, top))
        # a DSpark drafter's confidence head: its per-position estimates of each sequence's latest block, the
        # ``auto`` policy's forecast for that sequence's next step (``forecast``); None: no head, no extra work
        heads = drafter.dspark
        self.scored = heads is not None and heads.confidence_head is not None
        self.forecasts: dict[int, list[float]] = {}
        self.confidence: torch.Tensor | None = None  # [b, K] of the latest ``block`` call (scored drafters)

    def draft(self, seq_ids: list[int], new_k: list[torch.Tensor], new_v: list[torch.Tensor],
              bonus: list[int], block_size: int, top: int = 1) -> torch.Tensor:  # [b, block_size − 1] drafts
        """Append each sequence's injected context K/V ([L, T_i, kv, d], T_i may differ), then draft a block: the
        greedy drafts, or with ``top`` > 1 the ``top`` best tokens of every slot ([b, block_size − 1, top])."""
        require(1 < block_size <= self.drafter.spec.block_size, "block_size", block_size,
                f"must be in [2, {self.drafter.spec.block_size}] (the drafter's trained block size)")
        require(1 <= top <= 64, "top", top, "must be in [1, 64] (1: the greedy block)")
        vocab = self.head.embed.shape[0]
        bad = out_of_vocab(torch.tensor(bonus), vocab)
        require(bad is None, "bonus", bad, f"must be a token id in [0, {vocab}) (the target's vocabulary)")
        rows = []
        for s, k in zip(seq_ids, new_k):
            if s in self.slots.rows:
                row = self.slots.get(s)
            else:  # first draft of this sequence: a fresh row, emptied
                row = self.slots.allocate(s)
                self.cache.crop(torch.tensor([row]), torch.zeros(1, dtype=torch.long))
            if int(self.cache.lengths[row]) + k.shape[1] + block_size > self.cache.max_len:
                raise ConfigError("sequence length", int(self.cache.lengths[row]) + k.shape[1],
                                  f"exceeds the drafter cache ({self.cache.max_len} tokens)")
            rows.append(row)
        self._append(rows, new_k, new_v)
        device = self.head.embed.device
        self.confidence = None
        with torch.inference_mode():
            drafts = self.propose(seq_ids, torch.tensor(bonus, device=device), torch.tensor(rows, device=device),
                                  block_size - 1, top)
        if self.confidence is not None:
            for s, row in zip(seq_ids, self.confidence.tolist()):
                self.forecasts[s] = row
        return drafts

    def forecast(self, seq_id: int) -> list[float] | None:
        """The confidence head's estimates [K] for the sequence's latest drafted block: p_j = P(draft j accepted |
        drafts before it were); None without a confidence head or before the sequence's first draft."""
        return self.forecasts.get(seq_id)

    def _append(self, rows: list[int], new_k: list[torch.Tensor], new_v: list[torch.Tensor]) -> None:
        """The sequences' new context K/V into their cache rows: one write for all of them, or row by row where
        padding to the longest would run past a shorter row's capacity (a row that verified prompt lookup's
        proposals for many steps while another drafted every step)."""
        fresh = [(r, k, v) for r, k, v in zip(rows, new_k, new_v) if k.shape[1]]
        if not fresh:
            return
        longest = max(k.shape[1] for _, k, _ in fresh)
        if len(fresh) > 1 and max(int(self.cache.lengths[r]) for r, *_ in fresh) + longest > self.cache.max_len:
            for r, k, v in fresh:
                self._append([r], [k], [v])
            return
        ks = stack_padded([k for _, k, _ in fresh], 1).transpose(0, 1)  # [L, n, T, kv, d]
        vs = stack_padded([v for *_, v in fresh], 1).transpose(0, 1)
        self.drafter.append_context(ks, vs, torch.tensor([k.shape[1] for _, k, _ in fresh]), self.cache,
                                    torch.tensor([r for r, *_ in fresh]))

    def block(self, bonus: torch.Tensor, cache: KVCache, rows: torch.Tensor | None, num_drafts: int,
              top: int = 1) -> torch.Tensor:
        """One DFlash draft over ``cache``'s rows (None: all) whose context is committed: [bonus, MASK × K] through
        the drafter, greedy through the target's head ([b, K] drafts; [b, K, top] with ``top`` > 1); through the CUDA
        graph of this shape when graphs are on."""

        def run(ids: torch.Tensor, r: torch.Tensor | None):  # drafts, or (drafts, confidence) for a scored drafter
            static = self.graphs is not None
            return draft_block(ids, num_drafts + 1, self.drafter.spec.mask_token_id, lambda x: self.head.embed[x],
                               lambda e: draft_pass(self.drafter, e, cache, r, self.kernels, static),
                               self.logits, top, own_head=self.drafter.draft_head, heads=self.drafter.dspark,
                               scores=self.scored)

        with torch.inference_mode():
            if self.graphs is None:
                out = run(bonus, rows)
            else:
                inputs = (bonus,) if rows is None else (bonus, rows)
                out = self.graphs.run(("draft", id(cache), tuple(bonus.shape), rows is None, num_drafts, top), cache,
                                      lambda x, *r: run(x, r[0] if r else None), *inputs)
                out = out if self.scored else out[0]
        if not self.scored:
            return out
        drafts, self.confidence = out
        return drafts

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over drafter hidden states [..., H] -> [..., V]: the product the in-process
        decoder's head runs (``layers.linear``; as x · Wᵀ this was 2–4× slower on a CPU for 2–8 rows, so served
        draft passes looked dear to ``--block-size auto``, which drafted half as often through Triton)."""
        head = self.head.lm_head  # [V, H]
        return linear(hidden.to(head.dtype), head)

    def free(self, seq_id: int) -> bool:
        self.forecasts.pop(seq_id, None)
        return self.slots.free(seq_id)

    def expire(self) -> None:
        self.slots.expire()
        for s in [s for s in self.forecasts if s not in self.slots.rows]:
            del self.forecasts[s]
