"""The speculative loop of one request, independent of where the steps run: the toolkit's one decoding loop.

The Triton ``dflash_bls`` model runs it over BLS calls to ``target_verify`` / ``kv_inject`` / ``drafter``; the
in-process API (``runtime.decoder.SpeculativeDecoder.generate``, the CLI, the benchmarks) runs it over the same step
engines in-process (``BatchedLocalSteps``); a TensorRT-LLM backend only needs another ``StepClient``. One step:

    drafts  = drafter(seq, context K/V of the last committed tokens, bonus)        (block_size > 1 only)
    emitted = target_verify(seq, [bonus, drafts...])                                -> τ tokens + their taps
    K/V     = kv_inject(taps, position of the first of them)                       (block_size > 1 only)

``block_size == 1`` is the autoregressive baseline through the same models. ``block_size == "auto"``: before each
step the shared ``runtime.policy`` policy picks how many drafts k this sequence verifies (k = 0: no draft call, the
verify is a plain autoregressive step), and the step's draft / verify / other times are fed back to its cost model.
KV injection is lazy: the taps of committed tokens wait until the sequence next drafts, then one ``kv_inject`` call
projects all of them, so k = 0 steps cost no injection and the drafter always receives its whole context.

Where the step client batches the live sequences' calls (``StepClient.plan``: the step coalescer below), the
``auto`` decision is made for them together (``plan_together``): one ``decide`` over every sequence's state, and every
sequence verifies the step's common K + 1 slots (a row with fewer proposals pads with −1, which never matches), so
their verifies stay one batched call; the step's timing reaches the cost model once, for all its rows. Decided one by
one, each sequence would price its verify as if alone and choose its own width, and the coalescer would send one
target forward per distinct width (``docs/adaptive.md`` has the measurement).

With a ``tree`` (``runtime.tree.TreeShape``; at a fixed block size every step, under ``auto`` where the policy's
``choose_tree`` says it pays) a step drafts the drafter's top
choices per slot, makes the lookup chains' proposals here (prompt lookup, a retrieval ``datastore``, and the grafted
chains after the main chain's first draft), and verifies every node of the tree in one ``target_verify`` call, which
keeps the longest accepted path, greedy or sampled (each node's sample drawn from its position's noise,
``runtime.tree``).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Protocol

import torch

from trtllm_dflash.models.layers import stack_padded
from trtllm_dflash.runtime.acceptance import SeqState
from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, Lookup, ngram_lookup
from trtllm_dflash.runtime.policy import AdaptivePolicy
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.tree import TreeShape, chain_table, graft_chains, lookup_chains
from trtllm_dflash.runtime.protocol import GenerateRequest, StopMatcher


class StepClient(Protocol):
    """The three step models as the loop sees them. Taps and K/V are opaque to the loop, only handed from one step to
    the next: torch tensors in-process (LocalSteps), Triton tensors in the BLS model (TritonSteps), which stay in
    device memory between the models when they run on a GPU. ``start`` and ``verify`` also return their tokens'
    log-probabilities where the sequence's sampling asks for them (``SamplingParams.logprobs``), else None."""

    async def start(self, seq_id: int, prompt_ids: list[int], sampling: SamplingParams,
                    want_taps: bool) -> tuple[int, torch.Tensor | None, list[float] | None]: ...

    async def verify(self, seq_id: int, block: list[int], want_taps: bool, parents: tuple[int, ...] | None = None
                     ) -> tuple[list[int], torch.Tensor | None, list[float] | None]: ...

    async def inject(self, taps: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    async def draft(self, seq_id: int, k: torch.Tensor, v: torch.Tensor, bonus: int, block_size: int,
                    top: int = 1) -> list: ...  # [B − 1] drafts, or [B − 1][top] choices

    async def free(self, seq_id: int, drafter: bool) -> None: ...

    # Optional: a client that batches the live sequences' calls decides their ``auto`` steps together
    # (``plan_together`` over every waiting sequence's ``StepReport``). Without it each sequence decides alone.
    # async def plan(self, policy, tree, state, lookup_len: int, report: StepReport | None) -> tuple[int, int, bool]
    # def ended(self, policy, tree, report: StepReport) -> None  (a finished sequence's last step: CoalescedSteps)


@dataclass
class StepReport:
    """One sequence's step as ``plan_together`` feeds it to the cost model: drafts verified (k), accepted, seconds."""

    k: int
    accepted: int
    draft_s: float
    verify_s: float
    other_s: float
    drafted: bool
    tree: bool
    context: int = 0  # the cached tokens its verify attended over (``CostModel.context``)


def observe_steps(policy: AdaptivePolicy, tree: TreeShape | None, reports: list[StepReport]) -> None:
    """The timing of one step of these sequences (one sequence's, or a batched step's) into the cost model, once for
    its chain rows and once for its tree rows. A sequence's wait at the barrier is in its times: the shortest of each
    is the batched call's own."""
    for is_tree in (False, True):
        group = [r for r in reports if r.tree == is_tree]
        if group:
            drafted = [r.draft_s for r in group if r.drafted]
            policy.observe_step([r.k for r in group], [r.accepted for r in group],
                                min(drafted or [r.draft_s for r in group]), min(r.verify_s for r in group),
                                min(r.other_s for r in group), len(drafted),
                                verify_tokens=len(group) * tree.size if is_tree and tree is not None else None,
                                context=sum(r.context for r in group))


def plan_together(policy: AdaptivePolicy, tree: TreeShape | None,
                  entries: list[tuple[object, int, StepReport | None]], weigh: bool = False,
                  ended: list[StepReport] = ()) -> list[tuple[int, int, bool]]:
    """The next ``auto`` step of several sequences, decided for them as one batch. ``entries``:
    per sequence its policy state, its prompt-lookup continuation's length and its previous step (None: its first).
    The previous steps' timing goes into the cost model once (the sequences' calls were batched: one step of all their
    rows; each sequence's times include its wait for the others', so the shortest of each is the call's own), then
    ``decide`` and ``choose_tree`` run over all the states. ``weigh``: the sequences are a static batch (one
    ``generate`` call), so each row's tokens are worth what ``AdaptivePolicy.batch_weights`` says from what it still
    has to make; serving, every row's weight is 1. Returns per sequence (k, the step's common width K = max k,
    whether it is a tree step). ``ended``: the last steps of sequences that finished in the same step as the
    previous ones (``CoalescedSteps.ended``), observed with them."""
    observe_steps(policy, tree, [r for _, _, r in entries if r is not None] + list(ended))
    states = [state for state, _, _ in entries]
    if weigh:
        for s, w in zip(states, policy.batch_weights([s.remaining for s in states], sum(s.context for s in states))):
            s.weight = w
    ks = policy.decide(states, [n for _, n, _ in entries])
    use_tree = tree is not None and policy.choose_tree(states)
    width = max(ks, default=0)
    return [(k, width, use_tree) for k in ks]


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


@dataclass
class _Progress:
    tokens: list[int] = field(default_factory=list)
    reported: int = 0
    taus: list[int] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    finish_reason: str | None = None
    ks: list[int] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(("draft", "verify", "overhead"), 0.0))
    logprobs: list[float] = field(default_factory=list)
    lookup_steps: int = 0
    lookup_ms: float = 0.0


async def run_generation(
    steps: StepClient,
    req: GenerateRequest,
    block_size: int | str,
    seq_id: int,
    on_update: Callable[[Update], Awaitable[None]],
    is_cancelled: Callable[[], bool] = lambda: False,
    policy: AdaptivePolicy | None = None,
    ngram: bool = False,
    tree: TreeShape | None = None,
    datastore: Datastore | None = None,
    report_cancelled: Callable[[], bool] = lambda: False,
    state: SeqState | None = None,
) -> str:
    """Run one request to completion; returns the finish reason ("length" | "stop" | "cancelled").

    ``block_size="auto"`` needs ``policy`` (shared by the model's requests: one cost model, one state per request).
    ``ngram`` at a fixed block size: a step whose context ends in a recurring 2- or 3-gram verifies prompt lookup's
    continuation instead of drafting; under ``auto`` the policy's own ``ngram`` decides.
    ``tree`` (k = the longest block − 1) with an optional ``datastore``: tree steps (module docstring).
    ``report_cancelled``: whether a cancelled request still sends its tokens so far as a final update (TensorRT-LLM's
    stop request: its executor returns a cancelled request's result); otherwise a cancellation reports nothing.
    ``state``: under ``auto``, the sequence's policy state to use (the caller reads its ``chosen`` k afterwards).
    """
    adaptive = block_size == "auto"
    if adaptive and policy is None:
        raise ValueError("block_size 'auto' needs a policy")
    if tree is not None and (tree.k != (policy.max_k if adaptive else block_size - 1)):
        raise ValueError(f"a tree with k = {tree.k} does not fit block size {block_size}")
    if adaptive and tree is not None:
        policy.tree_nodes = tree.size  # a tree step is one of the policy's options (adaptive.choose_tree)
    want_taps = adaptive or block_size > 1
    state = (state or policy.new_sequence()) if adaptive else None
    plan = getattr(steps, "plan", None) if adaptive else None  # the live sequences' steps decided together
    # a DSpark drafter's confidence estimates for the latest block: the policy's forecast for the next plan
    forecast = getattr(steps, "forecast", None) if adaptive else None
    last_step: StepReport | None = None
    stops = StopMatcher(req.stop_sequences, req.min_tokens)
    holdback = max(stops.longest, 1) - 1  # a stop may still cut these tokens
    p = _Progress()

    def add(new: list[int], logprobs: list[float] | None) -> None:
        """Keep what a step emitted up to the length limit, and up to a stop ending within it ("stop"; a stop that
        would come after the limit's last token is never reached: "length")."""
        checked = len(p.tokens)
        p.tokens.extend(new[: req.max_tokens - checked])
        if req.sampling.logprobs:
            p.logprobs.extend(logprobs)
        cut = stops.truncate(p.tokens, checked)
        if cut is not None:
            del p.tokens[cut:]
            p.finish_reason = "stop"
        elif len(p.tokens) >= req.max_tokens:
            p.finish_reason = "length"
        del p.logprobs[len(p.tokens):]

    async def report(final: bool) -> None:
        upto = len(p.tokens) if final else max(p.reported, len(p.tokens) - holdback)
        if not final and (not req.stream or upto == p.reported):
            return
        await on_update(Update(p.tokens[:upto], p.reported, p.taus, p.proposed, p.accepted, final, p.finish_reason,
                               p.ks, p.seconds, p.logprobs[:upto], p.lookup_steps, p.lookup_ms))
        p.reported, p.taus, p.proposed, p.accepted = upto, [], 0, 0
        p.ks, p.seconds, p.lookup_steps, p.lookup_ms = [], dict.fromkeys(p.seconds, 0.0), 0, 0.0

    async def inject_pending():
        """The K/V of every committed token the drafter has not received yet, in one kv_inject call."""
        nonlocal pending, injected
        k, v = await steps.inject(pending[0] if len(pending) == 1 else torch.cat(pending), injected)
        pending, injected = [], committed
        return k, v

    started = False
    try:
        first, taps, logprobs = await steps.start(seq_id, list(req.input_ids), req.sampling, want_taps)
        started = True
        committed = len(req.input_ids)
        pending = [taps] if want_taps else []  # taps of committed tokens the drafter has not received yet
        injected = 0  # tokens whose K/V the drafter has
        add([first], logprobs)
        await report(False)
        bonus = first
        while p.finish_reason is None:
            if is_cancelled():
                p.finish_reason = "cancelled"
                break
            t0 = time.perf_counter()
            context = req.input_ids + tuple(p.tokens)
            use_lookup = policy.ngram if adaptive else ngram and want_taps
            found = ngram_lookup(context, block_size - 1 if not adaptive else policy.max_k, min_n=LOOKUP_MIN_N) \
                if use_lookup and (tree is None or adaptive) else Lookup([])
            lookup = found.tokens
            if adaptive:
                state.lookup = found  # what predicts its acceptance (``AdaptivePolicy.lookup_expectation``)
                state.context = len(context)  # what its verify attends over (``CostModel.context``)
                state.remaining = req.max_tokens - len(p.tokens)  # whether a first probe can pay (``decide``)
            if plan is not None:  # joint: k, the step's common width, tree or not
                n, width, tree_step = await plan(policy, tree, state, len(lookup), last_step)
                t0 = time.perf_counter()  # the wait for the other sequences is not this step's cost
            elif adaptive:
                (n, width, tree_step), = plan_together(policy, tree, [(state, len(lookup), None)])
            else:
                n = width = block_size - 1
                tree_step = tree is not None
            if tree_step:
                k, v = await inject_pending()
                choices = await steps.draft(seq_id, k, v, bonus, tree.k + 1, top=tree.top)
                if forecast is not None:
                    state.forecast = forecast(seq_id)
                t_look = time.perf_counter()
                block, parents = tree_block(tree, bonus, choices, context, datastore), tuple(tree.parents)
                drafts = block[1: tree.k + 1]  # the main chain: a tree step counts k drafts (its depth), as a chain
                t1 = time.perf_counter()
                p.lookup_ms += (t1 - t_look) * 1e3
                # a client whose verifier says which path it kept (the step engines) adds it: a lookup chain's?
                emitted, taps, logprobs, *path = await steps.verify(seq_id, block, True, parents=parents)
                t2 = time.perf_counter()
                if path and path[0] is not None and tree.from_lookup[path[0]]:
                    p.lookup_steps += 1
            else:
                if lookup and (not adaptive or state.source == "ngram"):
                    drafts = lookup[:n]
                    p.lookup_steps += bool(drafts)
                elif want_taps and n > 0:
                    k, v = await inject_pending()
                    drafts = await steps.draft(seq_id, k, v, bonus, width + 1)
                    if forecast is not None:
                        state.forecast = forecast(seq_id)
                else:
                    drafts = []
                t1 = time.perf_counter()
                # the step's common width (a shorter proposal pads with −1, which never matches): the live sequences'
                # verifies stay one batched call where the client batches them
                pad = [-1] * (width - len(drafts))
                emitted, taps, logprobs = await steps.verify(seq_id, [bonus, *drafts, *pad], want_taps)
                t2 = time.perf_counter()
            p.taus.append(len(emitted))
            p.proposed += len(drafts)
            p.accepted += len(emitted) - 1
            add(emitted, logprobs)
            if p.finish_reason is None and want_taps:
                pending.append(taps)
            committed += len(emitted)
            bonus = emitted[-1]
            if adaptive and tree_step:
                policy.observe_tree(state, len(emitted) - 1)
            elif adaptive:
                policy.observe(state, n, len(emitted) - 1)
            t3 = time.perf_counter()
            if adaptive:  # alone: into the cost model now; joint: with the other sequences' steps at the next plan
                last_step = StepReport(tree.k if tree_step else n, len(emitted) - 1, t1 - t0, t2 - t1, t3 - t2,
                                       tree_step or state.source == "drafter", tree_step, len(context))
                if plan is None:
                    observe_steps(policy, tree, [last_step])
            p.ks.append(len(drafts))
            for name, sec in zip(("draft", "verify", "overhead"), (t1 - t0, t2 - t1, t3 - t2)):
                p.seconds[name] += sec
            if p.finish_reason is None:
                await report(False)
        if plan is not None and last_step is not None and p.finish_reason != "cancelled":
            # its last step: no later plan of its own observes it
            ended = getattr(steps, "ended", None)
            if ended is None:
                observe_steps(policy, tree, [last_step])
            else:
                ended(policy, tree, last_step)
    finally:
        if started:
            await steps.free(seq_id, drafter=want_taps)
    if p.finish_reason != "cancelled" or report_cancelled():
        await report(True)
    return p.finish_reason or "length"


class LocalSteps:
    """A StepClient over in-process step engines (tests, and a reference for other backends)."""

    def __init__(self, verifier, injector, drafter) -> None:
        self.verifier, self.injector, self.drafter = verifier, injector, drafter

    async def start(self, seq_id, prompt_ids, sampling, want_taps):
        r = self.verifier.start(seq_id, prompt_ids, sampling, want_taps)
        return r.first_token, r.taps, r.logprobs

    async def verify(self, seq_id, block, want_taps, parents=None):
        tree = () if parents is None else (parents,)  # the engine backend's verifier takes no tree
        return _verified(self.verifier.verify([seq_id], [block], want_taps, *tree)[0], parents)

    async def inject(self, taps, start):
        return self.injector(taps, start)

    async def draft(self, seq_id, k, v, bonus, block_size, top=1):
        return self.drafter.draft([seq_id], [k], [v], [bonus], block_size, top)[0].tolist()

    def forecast(self, seq_id) -> list[float] | None:
        """The drafter's confidence estimates for the sequence's latest block (``BlockDrafter.forecast``), None where
        the drafter has no confidence head or its engine keeps none."""
        of = getattr(self.drafter, "forecast", None)
        return of(seq_id) if of is not None else None

    async def free(self, seq_id, drafter):
        self.verifier.free(seq_id)
        if drafter:
            self.drafter.free(seq_id)


# -- step coalescing ------------------------------------------------------------------------------------------------
# Each request's ``run_generation`` awaits its own verify / inject / draft calls. A loop model instance's coalescer
# holds each call until a barrier: every live sequence waits on a step call and no batched call is in flight (the
# sequences then step together, as the rows of an in-process batch do). It then sends the calls of the EARLIEST phase
# any sequence waits on (``KINDS``; a sequence in another phase, e.g. one that just started, catches up and the phases
# merge; within a step the drafting sequences inject and draft while the others' verify waits, so the step's verifies
# stay one call), as one request per shape group, and hands each sequence its own row of the results. Sending first
# the kind the fewest sequences wait on would split a step in two for good as soon as one sequence verified prompt
# lookup while the rest drafted. A live sequence that does not reach a step call within ``max_wait_s`` holds the
# others no longer than that; ``enabled=False`` sends every call at once on its own.
#
# A sequence's ``start`` (its prefill) is a step call too, sent at the barrier before the step's other calls: a
# sequence joins the next step, and a prefill never computes while the loop's draft or inject call does (so a CPU step
# model may give every request of a coalescing loop every core: ``serve.triton.handlers.CpuThreads``). The coalescer
# knows nothing about Triton: ``send(kind, key, calls)`` makes the batched call (``bls.TritonSteps``, or
# ``BatchedLocalSteps`` in-process). A ``plan`` call is no model call: the ``auto`` decision of the waiting sequences'
# next step, made for them together (``plan_together``), so that they then draft and verify as one batch.

KINDS = ("start", "plan", "inject", "draft", "verify")  # a step's phases, in the order a sequence goes through them


@dataclass
class Call:
    kind: str
    key: tuple  # calls of one key go into one request (same block length, ...)
    args: tuple
    future: asyncio.Future
    since: float


@dataclass
class StepCoalescer:
    send: Callable[[str, tuple, list[Call]], Awaitable[list]]  # -> one result per call, in order
    enabled: bool = True
    max_rows: int = 64  # rows per request (the step models' max_batch_size)
    max_wait_s: float = 0.05
    live: int = 0  # sequences between their start and their free
    sequences: int | None = None  # how many will ever join: a static batch's size; None: open-ended (serving)
    joined: int = 0
    flights: int = 0  # batched requests in flight
    pending: dict[str, list[Call]] = field(default_factory=lambda: {k: [] for k in KINDS})
    _check_soon: bool = False
    _timer: asyncio.TimerHandle | None = None

    def join(self) -> None:
        """A sequence started: the barrier now waits for it too."""
        self.live += 1
        self.joined += 1

    def leave(self) -> None:
        """A sequence ended (finished, cancelled or failed): the barrier stops waiting for it."""
        self.live -= 1
        self._schedule()

    async def submit(self, kind: str, key: tuple, *args):
        loop = asyncio.get_running_loop()
        call = Call(kind, key, args, loop.create_future(), loop.time())
        if self._alone():
            return await self._direct(call)
        self.pending[kind].append(call)
        self._schedule()
        return await call.future

    def _alone(self) -> bool:
        """Whether the caller is the last live sequence of a static batch that has all joined, and no other call waits
        or flies: then no call can ever join its batch, and the barrier would send it on its own. (While a batch's
        started sequences resume one by one, the first to join is briefly the only live one: ``joined`` tells.)"""
        return (self.sequences is not None and self.joined == self.sequences and self.live == 1 and not self.flights
                and not any(self.pending.values()))

    async def _direct(self, call: Call):
        """``call`` sent at once, awaited in the caller's own task: the barrier's future, its check and its flight
        task cost a few event-loop turns per call, a measurable share of a batch-1 step on a CPU. It still counts as
        a flight, so calls that arrive meanwhile wait for its end as they would for a batched one."""
        self.flights += 1
        try:
            return (await self.send(call.kind, call.key, [call]))[0]
        finally:
            self.flights -= 1
            if any(self.pending.values()):
                self._schedule()

    def _schedule(self) -> None:
        if not self._check_soon:  # after the other coroutines woken with this one have run to their next call
            self._check_soon = True
            asyncio.get_running_loop().call_soon(self._check)

    def _check(self) -> None:
        self._check_soon = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waiting = [c for calls in self.pending.values() for c in calls if not c.future.done()]
        if not waiting:
            return
        if not self.enabled:
            for kind, calls in self.pending.items():
                self.pending[kind] = []
                for call in calls:
                    self._launch(kind, call.key, [call])
            return
        if self.flights:
            return  # the flight's end checks again
        loop = asyncio.get_running_loop()
        age = loop.time() - min(c.since for c in waiting)
        if len(waiting) < self.live and age < self.max_wait_s:
            self._timer = loop.call_later(self.max_wait_s - age, self._check)
            return
        kind = next(k for k in KINDS if self.pending[k])  # the earliest phase: the others wait for it to catch up
        calls, self.pending[kind] = self.pending[kind], []
        groups: dict[tuple, list[Call]] = {}
        for call in calls:
            if not call.future.done():  # a cancelled caller's call is dropped
                groups.setdefault(call.key, []).append(call)
        for key, group in groups.items():
            for i in range(0, len(group), self.max_rows):
                self._launch(kind, key, group[i:i + self.max_rows])
        if not self.flights:
            self._schedule()

    def _launch(self, kind: str, key: tuple, calls: list[Call]) -> None:
        self.flights += 1
        asyncio.get_running_loop().create_task(self._fly(kind, key, calls))

    async def _fly(self, kind: str, key: tuple, calls: list[Call]) -> None:
        try:
            results = await self.send(kind, key, calls)
        except Exception as exc:  # every caller of the batch gets the error
            for call in calls:
                if not call.future.done():
                    call.future.set_exception(exc)
        except BaseException:  # cancelled (the model is stopping): so are its callers
            for call in calls:
                call.future.cancel()
            raise
        else:
            for call, result in zip(calls, results):
                if not call.future.done():
                    call.future.set_result(result)
        finally:
            self.flights -= 1
            self._schedule()


class CoalescedSteps:
    """The step calls of a StepClient whose ``coalescer`` (``StepCoalescer(self._send)``) batches
    the live sequences' calls: each call is submitted with its shape as the key (verify: block length, taps, tree;
    draft: block size, top), the ``plan`` calls are decided together here (``plan_together``), and ``_step(kind,
    key, calls)`` makes the batched step-model call. ``on_batch(kind, rows)``: told of every batched call."""

    coalescer: StepCoalescer
    on_batch: Callable[[str, int], None] | None = None
    weigh: bool = False  # the sequences are one static batch: ``plan_together(weigh=True)``

    async def plan(self, policy, tree, state, lookup_len, last_step):
        return await self.coalescer.submit("plan", (), policy, tree, state, lookup_len, last_step)

    def ended(self, policy, tree, last_step: StepReport) -> None:
        """A finished sequence's last step, which no plan of its own will observe: held for the next ``plan``, which
        observes it with the other sequences' reports of the same step, or observed now when no sequence is left to
        plan (this is the last live one)."""
        held = self.__dict__.setdefault("_ended", [])
        held.append(last_step)
        if self.coalescer.live <= 1:
            observe_steps(policy, tree, held)
            held.clear()

    async def verify(self, seq_id, block, want_taps, parents=None):
        return await self.coalescer.submit("verify", (len(block), want_taps, parents), seq_id, block)

    async def inject(self, taps, start):
        return await self.coalescer.submit("inject", (), taps, start)

    async def draft(self, seq_id, k, v, bonus, block_size, top=1):
        return await self.coalescer.submit("draft", (block_size, top), seq_id, k, v, bonus)

    async def _send(self, kind: str, key: tuple, calls: list) -> list:
        if self.on_batch is not None:
            self.on_batch(kind, len(calls))
        if kind == "plan":  # no model call: the step's decision for all the waiting sequences
            held, self.__dict__["_ended"] = self.__dict__.get("_ended", []), []
            return plan_together(*calls[0].args[:2], [c.args[2:] for c in calls], weigh=self.weigh, ended=held)
        return await self._step(kind, key, calls)

    async def _step(self, kind: str, key: tuple, calls: list) -> list:
        raise NotImplementedError


class BatchedLocalSteps(CoalescedSteps, LocalSteps):
    """A StepClient over in-process step engines that batches the concurrent sequences' calls as the BLS model does
    (one engine call per kind and shape for every waiting sequence) and, with ``joint``, decides their ``auto`` steps
    together (``plan``; ``weigh``: as one static batch, ``plan_together``). ``sequences``: the static batch's size,
    whose last live sequence then sends its calls straight (``StepCoalescer.sequences``). ``calls`` records (kind,
    rows) per batched call."""

    def __init__(self, verifier, injector, drafter, joint: bool = True, max_wait_s: float = 5.0,
                 weigh: bool = False, sequences: int | None = None) -> None:
        LocalSteps.__init__(self, verifier, injector, drafter)
        self.weigh = weigh
        self.coalescer = StepCoalescer(self._send, max_wait_s=max_wait_s, sequences=sequences)
        self.calls: list[tuple[str, int]] = []
        self.on_batch = lambda kind, rows: self.calls.append((kind, rows))
        if not joint:
            self.plan = None  # run_generation then decides each sequence's step alone

    async def start(self, seq_id, prompt_ids, sampling, want_taps):
        """The sequences starting together prefill in one forward where the verifier can (``start_many``)."""
        if hasattr(self.verifier, "start_many"):
            started = await self.coalescer.submit("start", (want_taps,), seq_id, prompt_ids, sampling)
        else:
            started = await LocalSteps.start(self, seq_id, prompt_ids, sampling, want_taps)
        self.coalescer.join()
        return started

    async def free(self, seq_id, drafter):
        self.coalescer.leave()
        await LocalSteps.free(self, seq_id, drafter)

    async def _step(self, kind, key, calls) -> list:
        if kind == "inject":  # one projection of every sequence's pending taps
            taps = [c.args[0] for c in calls]
            ks, vs = self.injector.rows(stack_padded(taps), torch.tensor([c.args[1] for c in calls]))
            return [(ks[j, :, : len(t)], vs[j, :, : len(t)]) for j, t in enumerate(taps)]
        seqs = [c.args[0] for c in calls]
        if kind == "start":
            started = self.verifier.start_many(seqs, [c.args[1] for c in calls], [c.args[2] for c in calls], *key)
            return [(r.first_token, r.taps, r.logprobs) for r in started]
        if kind == "verify":
            _, want, parents = key
            tree = () if parents is None else (parents,)
            return [_verified(r, parents) for r in self.verifier.verify(seqs, [c.args[1] for c in calls], want, *tree)]
        block, top = key
        return self.drafter.draft(seqs, [c.args[1] for c in calls], [c.args[2] for c in calls],
                                  [c.args[3] for c in calls], block, top).tolist()


def _verified(result, parents) -> tuple:
    """A step engine's ``VerifyResult`` as the loop takes it: (emitted, taps, logprobs), and for a tree verify the
    kept path's node too (where the verifier says which)."""
    out = (result.emitted, result.taps, result.logprobs)
    return out + (getattr(result, "path", None),) if parents is not None else out


def tree_block(tree: TreeShape, bonus: int, choices: list, context, datastore: Datastore | None) -> list[int]:
    """Every node's token of one sequence's tree step: node 0 the bonus, the drafter's ``choices`` ([K] drafts or
    [K][R] best tokens per slot), and the lookup chains proposed from ``context`` (and, grafted, from the context
    extended by the main chain's first drafts) exactly as the in-process decoder proposes them; −1 where a chain has no
    token."""
    drafts = torch.tensor(choices, dtype=torch.long)  # [K] or [K, R]
    main = (drafts[:, 0] if drafts.dim() == 2 else drafts)[: max(tree.grafts, default=0)].tolist()
    own = lookup_chains(tree, context, datastore)
    grafted = graft_chains(tree, context, main, datastore, own)
    return tree.tokens(torch.tensor([bonus]), drafts[None], chain_table(tree, [(own, grafted)]))[0].tolist()
