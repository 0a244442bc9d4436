"""Step coalescing: the live sequences' step calls of one kind reach a step model as ONE batched request.

Each request's loop (``loop.run_generation``) awaits its own ``verify`` / ``inject`` / ``draft`` calls. Sent one by
one, C concurrent sequences reached the step models as many small requests, which their dynamic batchers merged only
partly: several small forwards per step where the in-process runtime runs one over C rows, plus a BLS round trip per
sequence and call. The coalescer of a loop model instance holds each call until a barrier: every live sequence of the
instance waits on a step call and no batched call is in flight (the sequences then step together, as the rows of an
in-process batch do). It then sends the calls of the EARLIEST phase of a step any sequence waits on (``KINDS``: a
sequence in another phase, e.g. one that just started, catches up, and the phases merge into one; within a step the
sequences that draft inject and draft while the others' verify waits, so the step's verifies stay one call), as one
request per shape group, and hands each sequence its own row of the results. (An earlier version sent first the kind
the fewest sequences waited on: when one sequence of a step verified prompt lookup's proposal while fifteen drafted,
its verify went alone, and the step split in two from then on.) A live sequence that does not reach a step call
within ``max_wait_s`` does not hold the others longer than that. ``enabled=False`` sends every call at once on its
own (the former behaviour).

A sequence's ``start`` (its prefill) is a step call too, sent at the barrier before the step's other calls: a
sequence joins the next step, and a prefill never computes while the loop's draft or inject call does (so a CPU step
model may give every request of a coalescing loop every core: ``handlers.CpuThreads``).

The coalescer knows nothing about Triton: ``send(kind, key, calls)`` does the batched call (``bls.TritonSteps``).
A ``plan`` call is no model call: the ``auto`` decision of the waiting sequences' next step, made for them together
(``loop.plan_together``), so that they then draft and verify as one batch.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Awaitable, Callable

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
    flights: int = 0  # batched requests in flight
    pending: dict[str, list[Call]] = field(default_factory=lambda: {k: [] for k in KINDS})
    _check_soon: bool = False
    _timer: asyncio.TimerHandle | None = None

    def join(self) -> None:
        """A sequence started: the barrier now waits for it too."""
        self.live += 1

    def leave(self) -> None:
        """A sequence ended (finished, cancelled or failed): the barrier stops waiting for it."""
        self.live -= 1
        self._schedule()

    async def submit(self, kind: str, key: tuple, *args):
        loop = asyncio.get_running_loop()
        call = Call(kind, key, args, loop.create_future(), loop.time())
        self.pending[kind].append(call)
        self._schedule()
        return await call.future

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
