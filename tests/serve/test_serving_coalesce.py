"""The step coalescer's barrier, on its own (the batched calls through a real server are tested in
test_serving_reliability.py): every live sequence's call goes into one request, phases merge, a busy sequence holds
the others at most max_wait_s, errors reach every caller, and off means one call per request."""

import asyncio
import time

import pytest

from trtllm_dflash.runtime.loop import StepCoalescer


class Recorder:
    """The coalescer's ``send``: records (kind, key, args of every row) and answers each row with its own args."""

    def __init__(self, fail: bool = False) -> None:
        self.sent: list[tuple[str, tuple, list[tuple]]] = []
        self.fail = fail

    async def __call__(self, kind, key, calls):
        self.sent.append((kind, key, [c.args for c in calls]))
        await asyncio.sleep(0.01)  # the step model computing
        if self.fail:
            raise RuntimeError(f"{kind} failed")
        return [(kind, c.args) for c in calls]


def run(coro):
    return asyncio.run(coro)


def test_every_live_sequence_steps_in_one_request():
    async def main():
        send = Recorder()
        co = StepCoalescer(send, max_wait_s=5.0)

        async def seq(i):
            co.join()
            for step in range(3):
                await asyncio.sleep(0.001 * i)  # sequences reach their calls at different times
                assert await co.submit("verify", (2, True), i, step) == ("verify", (i, step))
            co.leave()

        await asyncio.gather(*(seq(i) for i in range(6)))
        return send.sent

    sent = run(main())
    assert [len(rows) for _, _, rows in sent] == [6, 6, 6]
    assert [sorted(r[1] for r in rows) for _, _, rows in sent] == [[0] * 6, [1] * 6, [2] * 6]


def test_sequences_in_other_phases_catch_up_and_merge():
    async def main():
        send = Recorder()
        co = StepCoalescer(send, max_wait_s=5.0)

        async def seq(i, first):
            co.join()
            kinds = ["draft", "verify", "inject"] * 3
            for kind in kinds[kinds.index(first):][:5]:
                await co.submit(kind, (), i)
            co.leave()

        await asyncio.gather(seq(0, "verify"), seq(1, "verify"), seq(2, "verify"), seq(3, "inject"))
        return send.sent

    sent = run(main())
    # the one sequence in an earlier phase goes first until it reaches the others' kind; from then on
    # all four step together (the last two requests: sequence 3 made its five calls and left)
    assert [(k, len(rows)) for k, _, rows in sent] == [("inject", 1), ("draft", 1), ("verify", 4), ("inject", 4),
                                                        ("draft", 4), ("verify", 3), ("inject", 3)]


def test_a_start_waits_for_the_flight_in_the_air_and_goes_before_the_step():
    """A sequence's start (its prefill) never computes alongside another call of the loop: it waits for the flight
    in the air, then goes first, and the live sequences' next step follows it."""
    async def main():
        events = []

        async def send(kind, key, calls):
            events.append(("begin", kind, len(calls)))
            await asyncio.sleep(0.02)
            events.append(("end", kind))
            return [None] * len(calls)

        co = StepCoalescer(send, max_wait_s=5.0)

        async def seq(i):
            co.join()
            for _ in range(2):
                await co.submit("verify", (2,), i)
            co.leave()

        async def newcomer():
            await asyncio.sleep(0.005)  # while the live sequences' first verify computes
            await co.submit("start", (9,), 9)

        await asyncio.gather(seq(0), seq(1), newcomer())
        return events

    assert run(main()) == [("begin", "verify", 2), ("end", "verify"), ("begin", "start", 1), ("end", "start"),
                           ("begin", "verify", 2), ("end", "verify")]


def test_keys_split_a_kind_into_requests_and_max_rows_caps_them():
    async def main():
        send = Recorder()
        co = StepCoalescer(send, max_rows=3, max_wait_s=5.0)
        for _ in range(7):
            co.join()
        await asyncio.gather(*(co.submit("verify", (i % 2,), i) for i in range(7)))
        return send.sent

    sent = run(main())
    assert sorted((key, len(rows)) for _, key, rows in sent) == [((0,), 1), ((0,), 3), ((1,), 3)]


def test_a_busy_sequence_holds_the_others_at_most_max_wait():
    async def main():
        send = Recorder()
        co = StepCoalescer(send, max_wait_s=0.1)
        co.join()
        co.join()  # this one never calls (e.g. busy elsewhere)
        t0 = time.perf_counter()
        await co.submit("verify", (), 0)
        return time.perf_counter() - t0, send.sent

    waited, sent = run(main())
    assert len(sent) == 1 and 0.09 <= waited < 1.0


def test_an_error_reaches_every_caller_of_the_batch():
    async def main():
        co = StepCoalescer(Recorder(fail=True), max_wait_s=5.0)
        for _ in range(3):
            co.join()
        return await asyncio.gather(*(co.submit("draft", (), i) for i in range(3)), return_exceptions=True)

    results = run(main())
    assert all(isinstance(r, RuntimeError) and "draft failed" in str(r) for r in results)


@pytest.mark.parametrize("n", [1, 5])
def test_off_sends_each_call_alone_at_once(n):
    async def main():
        send = Recorder()
        co = StepCoalescer(send, enabled=False, max_wait_s=5.0)
        for _ in range(n + 1):
            co.join()  # one more live sequence than calls: off never waits for it
        t0 = time.perf_counter()
        await asyncio.gather(*(co.submit("verify", (), i) for i in range(n)))
        return time.perf_counter() - t0, send.sent

    waited, sent = run(main())
    assert [len(rows) for _, _, rows in sent] == [1] * n and waited < 1.0


def test_the_last_sequence_of_a_static_batch_sends_its_calls_in_its_own_task():
    """With ``sequences`` (a static batch, as ``generate`` makes), the calls of the last live sequence skip the barrier:
    the send runs in the caller's own task. Until every sequence has joined, a lone live sequence still waits at the
    barrier for the others resuming behind it, so the batch's first step stays one request."""
    async def main():
        sent = []

        async def send(kind, key, calls):
            sent.append((kind, len(calls), asyncio.current_task()))
            await asyncio.sleep(0.001)
            return [c.args for c in calls]

        co = StepCoalescer(send, max_wait_s=5.0, sequences=2)
        mine = {}

        async def seq(i, steps):
            mine[i] = asyncio.current_task()
            co.join()  # the first to join is alone for a moment: the second has not resumed yet
            for step in range(steps):
                assert await co.submit("verify", (2, True), i, step) == (i, step)
            co.leave()

        await asyncio.gather(seq(0, 2), seq(1, 4))
        return sent, mine

    sent, mine = run(main())
    assert [(kind, rows) for kind, rows, _ in sent] == [("verify", 2), ("verify", 2), ("verify", 1), ("verify", 1)]
    assert all(task not in mine.values() for _, _, task in sent[:2])  # batched: the barrier's flight task
    assert all(task is mine[1] for _, _, task in sent[2:])  # alone: sequence 1's own task


def test_an_open_ended_coalescer_never_bypasses_its_barrier():
    """Serving (``sequences`` None): a request may join at any moment, so even a lone sequence's calls go through the
    barrier."""
    async def main():
        tasks = []

        async def send(kind, key, calls):
            tasks.append(asyncio.current_task())
            return [c.args for c in calls]

        co = StepCoalescer(send, max_wait_s=5.0)
        co.join()
        for step in range(3):
            await co.submit("verify", (2, True), step)
        co.leave()
        return tasks, asyncio.current_task()

    tasks, me = run(main())
    assert len(tasks) == 3 and me not in tasks
