"""The toolkit's one decoding loop, as a batch step: a ``Stepper`` owns the live sequences and steps them together.

Requests are added to a stepper as ``Sequence`` s; they do not each run a loop. ``Stepper.step()`` does, for every
live sequence at once:

1. admit the waiting sequences: their prefills, in one start call; the sibling sequences of one request
   (``num_return_sequences``) fork the first one's prefill instead of computing their own;
2. decide the step for all rows together: at a fixed block size B every row drafts B − 1 tokens; under ``auto`` one
   ``AdaptivePolicy.decide`` over every row's state gives each row its k, and every row verifies the step's common
   width K + 1 (a shorter proposal pads with −1, which never matches), so the verify stays one call;
3. make each row's prompt-lookup proposal (a row whose policy chose it verifies it instead of drafting);
4. make one ``kv_inject`` call for the drafting rows' pending taps, then one draft call for them;
5. make one verify call for every row (on a tree step: every node of each row's tree);
6. commit each row's accepted tokens, stream its update, and free what finished or was cancelled.

The step's draft, verify and commit times are the calls' own; under ``auto`` they reach the cost model once per step,
for all its rows. KV injection is lazy: the taps of committed tokens wait until the row next drafts, then one
injection projects all of them, so a k = 0 step costs no injection and the drafter always receives its whole context.

Block size 1 is the autoregressive baseline through the same engines. With a ``tree`` (``runtime.tree.TreeShape``;
every step at a fixed block size, under ``auto`` where the policy's ``choose_tree`` says it pays) a step drafts the
drafter's top choices per slot, adds the lookup chains' proposals (prompt lookup, a retrieval ``datastore``, the
grafted chains after the main chain's first drafts), and verifies every node in one call, which keeps the longest
accepted path.

The calls go to ``StepEngines``: the in-process engines (``runtime.local``) or the Triton step models through BLS
(``serve.triton.bls``), whose backends are this package's torch engines or TensorRT-LLM's. ``drive`` runs a step over
engines that never suspend (the in-process ones) without an event loop.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Coroutine, Protocol

import torch

from trtllm_dflash.runtime.acceptance import SeqState
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, Lookup, ngram_lookup
from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.protocol import GenerateRequest, StopMatcher
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.steps import SLOTS_EXHAUSTED, SlotsExhausted
from trtllm_dflash.runtime.tree import TreeShape, chain_table, graft_chains, lookup_chains

RETRY_FIRST_S, RETRY_MAX_S = 0.05, 0.5  # a waiting sequence's start retries back off between these


@dataclass(frozen=True, slots=True)
class Start:
    """One sequence's start as the engines take it: a prefill (kept for ``keep`` siblings to fork), or, with
    ``fork_of``, a copy of that sibling's prefill with the sequence's own first token."""

    seq_id: int
    prompt: list[int]
    sampling: SamplingParams
    want_taps: bool
    keep: int = 0
    fork_of: int | None = None


Started = tuple  # (first token, the prompt's taps or None, [its log-probability] or None)
Verified = tuple  # (emitted tokens, their taps or None, their log-probabilities or None, a tree's kept path or None)


class StepEngines(Protocol):
    """The step models as the stepper calls them: one call for a batch of rows. Taps and K/V are opaque to the
    stepper, handed from one call to the next: torch tensors in-process, rows of Triton outputs in the BLS model
    (which stay in device memory on a GPU)."""

    async def batch_start(self, starts: list[Start]) -> list[Started | Exception]:
        """Each row's first token, or the error its start raised (``SlotsExhausted``: every slot is taken now)."""

    async def batch_inject(self, taps: list, starts: list[int]) -> list[tuple]:
        """Each row's pending taps [n, K·H] projected to the drafter's context (K, V) from position ``starts``."""

    async def batch_draft(self, seq_ids: list[int], ks: list, vs: list, bonuses: list[int], width: int,
                          top: int = 1) -> list:
        """Each row's drafts: [width − 1] tokens, or [width − 1][top] choices."""

    async def batch_verify(self, seq_ids: list[int], blocks: list[list[int]], want_taps: bool,
                           parents: tuple[int, ...] | None = None) -> list[Verified]:
        """Each row's block (or tree, given ``parents``) verified and its accepted tokens committed."""

    async def batch_free(self, seq_ids: list[int], drafter: bool) -> None:
        """The rows' slots freed (in the drafter too, with ``drafter``)."""

    def forecast(self, seq_id: int) -> list[float] | None:
        """A DSpark drafter's confidence estimates for the row's latest block; None without a confidence head."""

    def planned(self, rows: int) -> None:
        """One step was decided for ``rows`` rows together (telemetry)."""


@dataclass
class Update:
    """One streamed response: ``tokens`` = everything emitted so far, of which ``prev_len`` were reported before."""

    tokens: list[int]
    prev_len: int
    acceptance_lengths: list[int]  # τ of the steps since the previous update
    num_draft_tokens: int  # drafts proposed in those steps
    num_accepted_draft_tokens: int
    final: bool
    finish_reason: str | None = None
    draft_lengths: list[int] = field(default_factory=list)  # drafts verified (k) per step since the previous update
    seconds: dict[str, float] = field(default_factory=dict)  # draft / verify / overhead seconds since then
    logprobs: list[float] = field(default_factory=list)  # ``tokens``' log-probabilities, when the request asks
    lookup_steps: int = 0  # steps since then that verified (or, in a tree, kept) a prompt-lookup proposal
    lookup_ms: float = 0.0  # host time since then making tree steps' lookup chains


def _zero_seconds() -> dict[str, float]:
    return dict.fromkeys(("draft", "verify", "overhead"), 0.0)


@dataclass
class _Since:
    """What a sequence did since its previous update."""

    taus: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    ks: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=_zero_seconds)
    lookup_steps: int = 0
    lookup_ms: float = 0.0


@dataclass(eq=False)
class Sequence:
    """One request's sequence in a stepper: its tokens, stops and hold-back, the taps its drafter has not received,
    and its policy state. ``on_update`` gets each streamed ``Update`` (a coroutine function's result is awaited);
    ``cancelled``: polled before each step; ``report_cancelled``: a cancelled sequence still sends its tokens so far
    as a final update (TensorRT-LLM's stop request); ``on_end``: called once when it leaves the stepper, with
    ``error`` set where it failed. ``keep``: siblings that fork its prefill (their ``fork_of``)."""

    seq_id: int
    request: GenerateRequest
    on_update: Callable[[Update], Any]
    cancelled: Callable[[], bool] = lambda: False
    report_cancelled: Callable[[], bool] = lambda: False
    on_end: Callable[[Sequence], None] | None = None
    state: SeqState | None = None
    keep: int = 0
    fork_of: Sequence | None = None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: Exception | None = None
    started: bool = False
    prompt_taps: Any = None  # the prompt's taps, kept while siblings may fork it
    scheduled_ns: int = 0  # time.monotonic_ns() of the start that took its slot (or of its latest try)
    first_token_ns: int = 0
    pending: list = field(default_factory=list)  # taps of committed tokens the drafter has not received
    injected: int = 0  # tokens whose K/V the drafter has
    committed: int = 0  # tokens in the target's cache
    bonus: int = 0  # the last emitted token: the next block's first
    reported: int = 0
    since: _Since = field(default_factory=_Since)
    queued_at: float | None = None  # time.monotonic() of its first start that found no slot
    retry_at: float = 0.0
    retry_delay: float = RETRY_FIRST_S

    def __post_init__(self) -> None:
        self.stops = StopMatcher(self.request.stop_sequences, self.request.min_tokens)
        self.holdback = max(self.stops.longest, 1) - 1  # a stop may still cut these tokens

    def add(self, new: list[int], logprobs: list[float] | None) -> None:
        """Keep what a step emitted up to the length limit, and up to a stop ending within it ("stop"; a stop that
        would come after the limit's last token is never reached: "length")."""
        req, checked = self.request, len(self.tokens)
        self.tokens.extend(new[: req.max_tokens - checked])
        if req.sampling.logprobs:
            self.logprobs.extend(logprobs)
        cut = self.stops.truncate(self.tokens, checked)
        if cut is not None:
            del self.tokens[cut:]
            self.finish_reason = "stop"
        elif len(self.tokens) >= req.max_tokens:
            self.finish_reason = "length"
        del self.logprobs[len(self.tokens):]

    def update(self, final: bool) -> Update | None:
        """The update to stream now (None: nothing new to send), and the counts since the last one reset."""
        upto = len(self.tokens) if final else max(self.reported, len(self.tokens) - self.holdback)
        if not final and (not self.request.stream or upto == self.reported):
            return None
        s = self.since
        u = Update(self.tokens[:upto], self.reported, s.taus, s.proposed, s.accepted, final, self.finish_reason,
                   s.ks, s.seconds, self.logprobs[:upto], s.lookup_steps, s.lookup_ms)
        self.reported, self.since = upto, _Since()
        return u

    @property
    def context(self) -> tuple[int, ...]:
        return self.request.input_ids + tuple(self.tokens)


@dataclass
class Admission:
    """How long sequences wait for a slot: at most ``max_queue`` wait at once, each at most ``timeout_s``;
    ``refuse(reason, waiting)`` makes the error a refused sequence ends with ("full" or "timeout")."""

    max_queue: int | None = None
    timeout_s: float = float("inf")
    refuse: Callable[[str, int], Exception] = lambda reason, waiting: SlotsExhausted(
        "live sequences", waiting, f"no sequence slot ({reason})", "retry later")


def no_slot(exc: BaseException) -> bool:
    """Whether a start failed only because every sequence slot is taken (in-process, or as a step model says)."""
    return isinstance(exc, SlotsExhausted) or SLOTS_EXHAUSTED in str(exc)


@dataclass
class _Rows:
    """One step's live rows and what was decided for them."""

    seqs: list[Sequence]
    ks: list[int]
    width: int
    tree: bool
    founds: list[Lookup]
    contexts: list[int]  # the cached tokens each row's verify attends over
    drafts: list[list[int]] = field(default_factory=list)
    blocks: list[list[int]] = field(default_factory=list)

    def drop(self, gone: list[Sequence]) -> None:
        """Rows that ended in this step (a failed call) leave it."""
        keep = [j for j, s in enumerate(self.seqs) if s not in gone]
        self.seqs, self.ks, self.founds, self.contexts = ([xs[j] for j in keep] for xs in
                                                          (self.seqs, self.ks, self.founds, self.contexts))
        self.drafts = [self.drafts[j] for j in keep if j < len(self.drafts)]


class Stepper:
    """The live sequences of one model and the step that advances them all (module docstring)."""

    def __init__(self, engines: StepEngines, mode: DecodeMode, policy: AdaptivePolicy | None = None,
                 tree: TreeShape | None = None, datastore: Datastore | None = None, weigh: bool = False,
                 admission: Admission | None = None) -> None:
        """``mode``: a fixed block of B tokens (1: autoregressive) or ``auto`` with ``policy``. Prompt lookup at a
        fixed block (``mode.ngram``): a row whose context ends in a recurring 2- or 3-gram verifies prompt lookup's
        continuation instead of drafting; under ``auto`` the policy's own ``ngram`` decides. ``tree``: the shape
        of a tree step (``mode.tree``), k = the longest block − 1. ``weigh``: the sequences are one static batch (a
        ``generate`` call), so each row's tokens are worth what ``AdaptivePolicy.batch_weights`` says from what it
        still has to make; serving, every row's weight is 1."""
        self.mode, self.adaptive = mode, mode.auto
        if self.adaptive and policy is None:
            raise ValueError("block_size 'auto' needs a policy")
        self.max_k = policy.max_k if self.adaptive else mode.block_size - 1  # the most drafts a row verifies
        if tree is not None and tree.k != self.max_k:
            raise ValueError(f"a tree with k = {tree.k} does not fit block size {mode.label}")
        if self.adaptive and tree is not None:
            policy.tree_nodes = tree.size  # a tree step is one of the policy's options (``choose_tree``)
        self.engines, self.policy, self.tree, self.datastore = engines, policy, tree, datastore
        self.want_taps = self.adaptive or self.max_k > 0
        self.lookup = (policy.ngram if self.adaptive else mode.ngram) and (tree is None or self.adaptive)
        self.weigh = weigh
        self.admission = admission or Admission()
        self.waiting: list[Sequence] = []
        self.live: list[Sequence] = []
        self.freed = False  # a slot was freed since the waiting sequences last tried to start

    def add(self, seq: Sequence) -> Sequence:
        """``seq`` joins at the next step (its prefill), or waits there for a slot."""
        if self.adaptive and seq.state is None:
            seq.state = self.policy.new_sequence()
        self.waiting.append(seq)
        return seq

    @property
    def busy(self) -> bool:
        return bool(self.live or self.waiting)

    def retry_in(self) -> float:
        """Seconds until a waiting sequence tries to start again (0: at the next step)."""
        if self.live or self.freed or not self.waiting:
            return 0.0
        return max(0.0, min(s.retry_at for s in self.waiting) - time.monotonic())

    async def run(self) -> None:
        """Step until no sequence is live or waiting (a static batch: the sequences were all added first)."""
        while self.busy:
            await self.step()

    async def step(self) -> None:
        await self._admit()
        await self._end([s for s in self.live if s.cancelled()], "cancelled")
        if not self.live:
            return
        rows = self._plan(list(self.live))
        t0 = time.perf_counter()
        await self._propose(rows)
        t1 = time.perf_counter()
        verified = await self._verify(rows)
        t2 = time.perf_counter()
        if verified is None:
            return
        accepted = [self._commit(s, k, d, v, rows.tree)
                    for s, k, d, v in zip(rows.seqs, rows.ks, rows.drafts, verified)]
        t3 = time.perf_counter()
        self._observe(rows, accepted, (t1 - t0, t2 - t1, t3 - t2))
        for s, drafts in zip(rows.seqs, rows.drafts):
            s.since.ks.append(len(drafts))
            for name, sec in zip(("draft", "verify", "overhead"), (t1 - t0, t2 - t1, t3 - t2)):
                s.since.seconds[name] += sec
        await self._stream([s for s in rows.seqs if s.finish_reason is None])
        await self._end([s for s in rows.seqs if s.finish_reason is not None and s in self.live])

    # -- admission --------------------------------------------------------------------------------------------------

    async def _admit(self) -> None:
        """Start the waiting sequences that may try now: first those with their own prefill, then the siblings that
        fork one that has started (in the same step, before it steps: the rows they copy are its own)."""
        now = time.monotonic()
        gone = [s for s in self.waiting if s.cancelled()]
        for s in gone:
            self.waiting.remove(s)
            s.finish_reason = "cancelled"
            await self._finish(s)
        retry, self.freed = self.freed, False
        ready = [s for s in self.waiting if s.fork_of is None and (retry or s.retry_at <= now)]
        await self._start(ready)
        for s in [s for s in self.waiting if s.fork_of is not None and s.fork_of.error is not None]:
            await self._fail([s], s.fork_of.error)
        forks = [s for s in self.waiting if s.fork_of is not None and s.fork_of.started]
        await self._start(forks)

    async def _start(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        starts = [Start(s.seq_id, list(s.request.input_ids), s.request.sampling,
                        self.want_taps and s.fork_of is None, s.keep,
                        s.fork_of.seq_id if s.fork_of is not None else None) for s in seqs]
        sent = time.monotonic_ns()
        try:
            results = await self.engines.batch_start(starts)
        except Exception as exc:  # noqa: BLE001 - the sequences end with it; the others go on
            results = [exc] * len(seqs)
        for s, r in zip(seqs, results):
            s.scheduled_ns = sent
            if not isinstance(r, Exception):
                await self._started(s, *r)
            elif s.fork_of is not None:  # no slot, or a target that cannot fork: it prefills itself
                s.fork_of = None
            elif no_slot(r):
                self._queue(s)
            else:
                await self._fail([s], r)

    def _queue(self, seq: Sequence) -> None:
        """``seq`` found no slot: it waits (``Admission``) and tries again after a growing delay, or at once when a
        sequence of this stepper ends."""
        now = time.monotonic()
        if seq.queued_at is None:
            waiting = sum(s.queued_at is not None for s in self.waiting)
            if self.admission.max_queue is not None and waiting >= self.admission.max_queue:
                self.waiting.remove(seq)
                seq.error = self.admission.refuse("full", waiting)
                return self._notify_end(seq)
            seq.queued_at = now
        elif now - seq.queued_at > self.admission.timeout_s:
            self.waiting.remove(seq)
            seq.error = self.admission.refuse("timeout", 0)
            return self._notify_end(seq)
        seq.retry_at = now + seq.retry_delay
        seq.retry_delay = min(RETRY_MAX_S, seq.retry_delay * 1.5)  # waiters must not flood the target with starts

    async def _started(self, seq: Sequence, first: int, taps, logprobs) -> None:
        self.waiting.remove(seq)
        seq.started, seq.first_token_ns = True, time.monotonic_ns()
        if seq.fork_of is not None:
            taps = seq.fork_of.prompt_taps
        if seq.keep:
            seq.prompt_taps = taps
        seq.committed = len(seq.request.input_ids)
        seq.pending = [taps] if self.want_taps else []
        seq.add([first], logprobs)
        seq.bonus = first
        self.live.append(seq)
        if seq.finish_reason is not None:
            await self._end([seq])
        else:
            await self._stream([seq])

    # -- one step -----------------------------------------------------------------------------------------------------

    def _plan(self, seqs: list[Sequence]) -> _Rows:
        """Each row's lookup proposal and draft count, decided for all rows together."""
        founds = [ngram_lookup(s.context, self.max_k, min_n=LOOKUP_MIN_N) if self.lookup else Lookup([])
                  for s in seqs]
        contexts = [len(s.request.input_ids) + len(s.tokens) for s in seqs]
        if not self.adaptive:
            return _Rows(seqs, [self.max_k] * len(seqs), self.max_k, self.tree is not None, founds, contexts)
        policy = self.policy
        states = [s.state for s in seqs]
        for s, found, context in zip(seqs, founds, contexts):
            s.state.lookup = found  # what predicts its acceptance (``AdaptivePolicy.lookup_expectation``)
            s.state.context = context  # what its verify attends over (``CostModel.context``)
            s.state.remaining = s.request.max_tokens - len(s.tokens)  # whether a first probe can pay (``decide``)
        if self.weigh:
            weights = policy.batch_weights([s.remaining for s in states], sum(s.context for s in states))
            for state, w in zip(states, weights):
                state.weight = w
        ks = policy.decide(states, [len(f.tokens) for f in founds])
        use_tree = self.tree is not None and policy.choose_tree(states)
        self.engines.planned(len(seqs))
        return _Rows(seqs, ks, max(ks, default=0), use_tree, founds, contexts)

    async def _propose(self, rows: _Rows) -> None:
        """Each row's drafts (``rows.drafts``) and the blocks it verifies (``rows.blocks``): lookup continuations,
        one draft call for the drafting rows, or the tree's nodes."""
        tree = self.tree
        if rows.tree:
            choices = await self._draft(rows, rows.seqs, tree.k + 1, tree.top)
            for s, c in zip(rows.seqs, choices or ()):
                t_look = time.perf_counter()
                block = tree_block(tree, s.bonus, c, s.context, self.datastore)
                s.since.lookup_ms += (time.perf_counter() - t_look) * 1e3
                rows.blocks.append(block)
                rows.drafts.append(block[1: tree.k + 1])  # a tree step counts its depth's drafts, as a chain
            return
        drafting = []
        for s, k, found in zip(rows.seqs, rows.ks, rows.founds):
            if found.tokens and (not self.adaptive or s.state.source == "ngram"):
                rows.drafts.append(found.tokens[:k])
                s.since.lookup_steps += k > 0
            else:
                rows.drafts.append([])
                if self.want_taps and k > 0:
                    drafting.append(s)
        if drafting:
            drafted = iter(await self._draft(rows, drafting, rows.width + 1, 1) or ())  # failed rows are dropped
            rows.drafts = [next(drafted) if s in drafting else d for s, d in zip(rows.seqs, rows.drafts)]
        for s, drafts in zip(rows.seqs, rows.drafts):
            # the step's common width: a shorter proposal pads with −1, which never matches
            rows.blocks.append([s.bonus, *drafts, *[-1] * (rows.width - len(drafts))])

    async def _draft(self, rows: _Rows, seqs: list[Sequence], width: int, top: int) -> list | None:
        """The drafting rows' pending taps injected (one call) and their blocks drafted (one call). A failing call
        ends the rows it was for (None); the others verify without them."""
        try:
            kv = await self.engines.batch_inject(
                [s.pending[0] if len(s.pending) == 1 else torch.cat(s.pending) for s in seqs],
                [s.injected for s in seqs])
            for s in seqs:
                s.pending, s.injected = [], s.committed
            choices = await self.engines.batch_draft([s.seq_id for s in seqs], [k for k, _ in kv],
                                                     [v for _, v in kv], [s.bonus for s in seqs], width, top)
        except Exception as exc:  # noqa: BLE001 - these sequences end with it
            await self._fail(seqs, exc)
            rows.drop(seqs)
            return None
        if self.adaptive:
            for s in seqs:
                s.state.forecast = self.engines.forecast(s.seq_id)
        return choices

    async def _verify(self, rows: _Rows) -> list[Verified] | None:
        if not rows.seqs:
            return None
        parents = tuple(self.tree.parents) if rows.tree else None
        try:
            return await self.engines.batch_verify([s.seq_id for s in rows.seqs], rows.blocks,
                                                   self.want_taps, parents)
        except Exception as exc:  # noqa: BLE001 - the step's sequences end with it
            await self._fail(rows.seqs, exc)
            return None

    def _commit(self, s: Sequence, k: int, drafts: list[int], verified: Verified, tree_step: bool) -> int:
        """One row's verify result committed: its tokens kept, its taps pending, its policy told how its k drafts
        fared; returns the drafts accepted."""
        emitted, taps, logprobs, path = verified
        since = s.since
        since.taus.append(len(emitted))
        since.proposed += len(drafts)
        since.accepted += len(emitted) - 1
        if tree_step and path is not None and self.tree.from_lookup[path]:
            since.lookup_steps += 1
        s.add(emitted, logprobs)
        if s.finish_reason is None and self.want_taps:
            s.pending.append(taps)
        s.committed += len(emitted)
        s.bonus = emitted[-1]
        if self.adaptive and tree_step:
            self.policy.observe_tree(s.state, len(emitted) - 1)
        elif self.adaptive:
            self.policy.observe(s.state, k, len(emitted) - 1)
        return len(emitted) - 1

    def _observe(self, rows: _Rows, accepted: list[int], seconds: tuple[float, float, float]) -> None:
        """The step's own timing into the cost model, once for all its rows (``auto`` only)."""
        if not self.adaptive:
            return
        ks = [self.tree.k] * len(rows.seqs) if rows.tree else rows.ks
        drafting = len(rows.seqs) if rows.tree else sum(1 for s, k in zip(rows.seqs, rows.ks)
                                                         if k > 0 and s.state.source == "drafter")
        self.policy.observe_step(ks, accepted, *seconds, drafting,
                                 verify_tokens=len(rows.seqs) * self.tree.size if rows.tree else None,
                                 context=sum(rows.contexts))

    async def _stream(self, seqs: list[Sequence]) -> None:
        """Each sequence's update, where it has one to send; a sequence whose stream fails ends with that error."""
        for s in seqs:
            try:
                await _emit(s, s.update(False))
            except Exception as exc:  # noqa: BLE001 - a failing stream ends its own sequence only
                await self._fail([s], exc)

    # -- leaving --------------------------------------------------------------------------------------------------------

    async def fail_all(self, exc: Exception) -> None:
        """Every live and waiting sequence ends with ``exc`` (a step that raised)."""
        await self._fail(list(self.live) + list(self.waiting), exc)

    async def _end(self, seqs: list[Sequence], reason: str | None = None) -> None:
        """Finished (or, with ``reason``, cancelled) sequences leave: their slots freed in one call, then each one's
        final update."""
        if not seqs:
            return
        for s in seqs:
            self.live.remove(s)
            if reason is not None:
                s.finish_reason = reason
        await self._free(seqs)
        for s in seqs:
            await self._finish(s)

    async def _free(self, seqs: list[Sequence]) -> None:
        self.freed = True
        try:
            await self.engines.batch_free([s.seq_id for s in seqs], self.want_taps)
        except Exception as exc:  # noqa: BLE001 - the first failure is the sequences' own error
            for s in seqs:
                s.error = s.error or exc

    async def _finish(self, seq: Sequence) -> None:
        if seq.error is None and (seq.finish_reason != "cancelled" or seq.report_cancelled()):
            try:
                await _emit(seq, seq.update(True))
            except Exception as exc:  # noqa: BLE001 - a failing stream ends its own sequence only
                seq.error = exc
        self._notify_end(seq)

    async def _fail(self, seqs: list[Sequence], exc: Exception) -> None:
        """Sequences end with ``exc``: freed where they had started, reported to ``on_end``."""
        live = [s for s in seqs if s in self.live]
        for s in seqs:
            s.error = exc
            if s in self.waiting:
                self.waiting.remove(s)
        for s in live:
            self.live.remove(s)
        if live:
            await self._free(live)
        for s in seqs:
            self._notify_end(s)

    @staticmethod
    def _notify_end(seq: Sequence) -> None:
        if seq.on_end is not None:
            seq.on_end(seq)


async def _emit(seq: Sequence, update: Update | None) -> None:
    if update is not None:
        result = seq.on_update(update)
        if inspect.isawaitable(result):
            await result


def drive(coro: Coroutine) -> Any:
    """Run a coroutine whose awaits all complete at once (a stepper over in-process engines) without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a step engine suspended: run this stepper in an event loop (await it)")


def tree_block(tree: TreeShape, bonus: int, choices: list, context, datastore: Datastore | None) -> list[int]:
    """Every node's token of one sequence's tree step: node 0 the bonus, the drafter's ``choices`` ([K] drafts or
    [K][R] best tokens per slot), and the lookup chains proposed from ``context`` (and, grafted, from the context
    extended by the main chain's first drafts); −1 where a chain has no token."""
    drafts = torch.tensor(choices, dtype=torch.long)  # [K] or [K, R]
    main = (drafts[:, 0] if drafts.dim() == 2 else drafts)[: max(tree.grafts, default=0)].tolist()
    own = lookup_chains(tree, context, datastore)
    grafted = graft_chains(tree, context, main, datastore, own)
    return tree.tokens(torch.tensor([bonus]), drafts[None], chain_table(tree, [(own, grafted)]))[0].tolist()


async def run_generation(engines: StepEngines, req: GenerateRequest, block_size: int | str, seq_id: int,
                         on_update: Callable[[Update], Any], is_cancelled: Callable[[], bool] = lambda: False,
                         policy: AdaptivePolicy | None = None, ngram: bool = False, tree: TreeShape | None = None,
                         datastore: Datastore | None = None, report_cancelled: Callable[[], bool] = lambda: False,
                         state: SeqState | None = None) -> str:
    """One request through a stepper of its own, to completion; returns its finish reason ("length" | "stop" |
    "cancelled") or raises its error."""
    mode = DecodeMode(block_size, ngram=ngram and block_size != 1, tree=tree is not None)
    stepper = Stepper(engines, mode, policy, tree, datastore)
    seq = stepper.add(Sequence(seq_id, req, on_update, is_cancelled, report_cancelled, state=state))
    await stepper.run()
    if seq.error is not None:
        raise seq.error
    return seq.finish_reason or "length"
