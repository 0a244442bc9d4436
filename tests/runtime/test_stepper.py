"""The stepper on its own, over scripted step engines (the real engines: test_decoder.py, test_adaptive.py and the
served tests): every live row steps in one call per kind, a sequence joins at the next step, a failing call ends
the sequences it was for and no others, and the outputs are the scripted target's own."""

import asyncio

import pytest
import torch

from trtllm_dflash.runtime.mode import DecodeMode
from trtllm_dflash.runtime.protocol import GenerateRequest
from trtllm_dflash.runtime.sampling import SamplingParams
from trtllm_dflash.runtime.stepper import Sequence, Stepper, drive

VOCAB = 50


def target_next(token: int) -> int:
    """The scripted target's greedy choice after ``token``."""
    return (token * 7 + 3) % VOCAB


class Scripted:
    """Step engines of a target that continues with ``target_next``; sequence ids ending in 1 draft wrongly after
    their second draft, the others exactly. Records (kind, rows) per call; ``fail``: the kind that raises."""

    def __init__(self, fail: str | None = None, fail_rows: set[int] = frozenset(), suspend: bool = False):
        self.calls: list[tuple[str, int]] = []
        self.last: dict[int, int] = {}
        self.fail, self.fail_rows, self.suspend = fail, fail_rows, suspend
        self.freed: list[int] = []

    async def _call(self, kind: str, seq_ids):
        self.calls.append((kind, len(seq_ids)))
        if self.suspend:
            await asyncio.sleep(0)
        if kind == self.fail and self.fail_rows & set(seq_ids):
            raise RuntimeError(f"{kind} failed")

    async def batch_start(self, starts):
        await self._call("start", [s.seq_id for s in starts])
        out = []
        for s in starts:
            self.last[s.seq_id] = target_next(s.prompt[-1])
            out.append((self.last[s.seq_id], torch.zeros(len(s.prompt), 2), None))
        return out

    async def batch_inject(self, taps, starts):
        await self._call("inject", starts)
        return [(t, t) for t in taps]

    async def batch_draft(self, seq_ids, ks, vs, bonuses, width, top=1):
        await self._call("draft", seq_ids)
        out = []
        for s, b in zip(seq_ids, bonuses):
            row, t = [], b
            for j in range(width - 1):
                t = target_next(t) if s % 10 != 1 or j < 2 else (t + 1) % VOCAB
                row.append(t)
            out.append(row)
        return out

    async def batch_verify(self, seq_ids, blocks, want_taps, parents=None):
        await self._call("verify", seq_ids)
        out = []
        for block in blocks:
            emitted = [target_next(block[0])]
            for d in block[1:]:
                if d != emitted[-1]:
                    break
                emitted.append(target_next(d))
            out.append((emitted, torch.zeros(len(emitted), 2) if want_taps else None, None, None))
        return out

    async def batch_free(self, seq_ids, drafter):
        self.freed += seq_ids

    def forecast(self, seq_id):
        return None

    def planned(self, rows):
        self.calls.append(("plan", rows))


def greedy(prompt, n):
    out, t = [], prompt[-1]
    for _ in range(n):
        t = target_next(t)
        out.append(t)
    return out


def add(stepper, seq_id, prompt, n, updates=None):
    req = GenerateRequest(tuple(prompt), n, SamplingParams(), (), True)
    return stepper.add(Sequence(seq_id, req, (updates.append if updates is not None else (lambda u: None))))


@pytest.mark.parametrize("block_size", [1, 4])
def test_every_live_row_steps_in_one_call_per_kind_and_decodes_the_target(block_size):
    engines = Scripted()
    stepper = Stepper(engines, DecodeMode(block_size))
    seqs = [add(stepper, i, [i + 2, i + 5], 20) for i in (10, 11, 12, 13)]
    drive(stepper.run())
    assert [s.tokens for s in seqs] == [greedy([i + 2, i + 5], 20) for i in (10, 11, 12, 13)]
    assert all(s.finish_reason == "length" for s in seqs) and sorted(engines.freed) == [10, 11, 12, 13]
    verifies = [rows for kind, rows in engines.calls if kind == "verify"]
    assert engines.calls[0] == ("start", 4) and verifies[0] == 4  # one prefill call, one verify call for all rows
    assert len(verifies) == len([1 for kind, _ in engines.calls if kind == "verify"])
    if block_size > 1:
        drafts = [rows for kind, rows in engines.calls if kind == "draft"]
        assert len(drafts) == len(verifies) and drafts[0] == 4
        assert [k for k, _ in engines.calls].count("inject") == len(drafts)


def test_a_sequence_added_while_others_run_joins_at_the_next_step():
    engines = Scripted()
    stepper = Stepper(engines, DecodeMode(4))
    first = add(stepper, 0, [3, 4], 24)
    drive(stepper.step())
    drive(stepper.step())
    late = add(stepper, 2, [8, 9], 8)
    drive(stepper.step())
    assert ("start", 1) in engines.calls[-4:-2] and engines.calls[-1] == ("verify", 2)
    drive(stepper.run())
    assert first.tokens == greedy([3, 4], 24) and late.tokens == greedy([8, 9], 8)


def test_a_failing_call_ends_the_sequences_it_was_for_and_no_others():
    engines = Scripted(fail="verify", fail_rows={1})
    stepper = Stepper(engines, DecodeMode(1))
    ok_ended, bad_ended = [], []
    seqs = [add(stepper, i, [i, i + 1], 12) for i in (1, 2)]
    seqs[0].on_end, seqs[1].on_end = bad_ended.append, ok_ended.append
    drive(stepper.step())  # the step's verify holds both rows: both end with its error
    assert bad_ended == [seqs[0]] and ok_ended == [seqs[1]] and all(isinstance(s.error, RuntimeError) for s in seqs)
    assert sorted(engines.freed) == [1, 2] and not stepper.busy
    engines = Scripted(fail="draft", fail_rows={1})
    stepper = Stepper(engines, DecodeMode(4))
    seqs = [add(stepper, i, [i, i + 1], 12) for i in (1, 2)]
    drive(stepper.run())  # the draft call held both rows too: both end
    assert all(s.error is not None for s in seqs)
    engines = Scripted(fail="start", fail_rows={1})
    stepper = Stepper(engines, DecodeMode(4))
    seqs = [add(stepper, i, [i, i + 1], 12) for i in (1, 2)]
    drive(stepper.run())
    assert isinstance(seqs[0].error, RuntimeError) and isinstance(seqs[1].error, RuntimeError)  # one start call


def test_a_cancelled_sequence_ends_before_its_next_step_and_reports_nothing_unless_asked():
    engines = Scripted()
    stepper = Stepper(engines, DecodeMode(4))
    updates, stopped = [], []
    flag = {"on": False}
    seq = add(stepper, 0, [3, 4], 40, updates)
    seq.cancelled = lambda: flag["on"]
    other = add(stepper, 1, [5, 6], 40, stopped)
    other.cancelled, other.report_cancelled = (lambda: flag["on"]), (lambda: True)
    drive(stepper.step())
    flag["on"] = True
    drive(stepper.step())
    assert not stepper.busy and seq.finish_reason == other.finish_reason == "cancelled"
    assert not any(u.final for u in updates) and stopped[-1].final and stopped[-1].tokens == other.tokens
    assert sorted(engines.freed) == [0, 1]


def test_drive_refuses_engines_that_suspend():
    stepper = Stepper(Scripted(suspend=True), DecodeMode(4))
    add(stepper, 0, [1, 2], 4)
    with pytest.raises(RuntimeError, match="suspended"):
        drive(stepper.step())
    stepper = Stepper(Scripted(suspend=True), DecodeMode(4))  # awaited in an event loop, the same engines decode
    seq = add(stepper, 0, [1, 2], 9)
    asyncio.run(stepper.run())
    assert seq.tokens == greedy([1, 2], 9)


def test_auto_rows_share_one_decision_and_the_step_is_observed_once_with_its_own_times():
    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    policy = AdaptivePolicy(CostModel([1e-3 * (1 + n / 64) for n in GRID], [5e-4 * (1 + n / 64) for n in GRID],
                                      alpha=0.0), 8, [0.6] * 7)

    class Widths(Scripted):
        widths: list[set[int]] = []

        async def batch_verify(self, seq_ids, blocks, want_taps, parents=None):
            self.widths.append({len(b) for b in blocks})
            return await super().batch_verify(seq_ids, blocks, want_taps, parents)

    engines = Widths()
    stepper = Stepper(engines, DecodeMode("auto"), policy)
    seqs = [add(stepper, i, [i + 2, i + 5], 16) for i in (10, 11, 12)]
    drive(stepper.run())
    assert [s.tokens for s in seqs] == [greedy([i + 2, i + 5], 16) for i in (10, 11, 12)]
    assert all(len(w) == 1 for w in engines.widths)  # every row verifies the step's common width
    plans = [rows for kind, rows in engines.calls if kind == "plan"]
    assert len(plans) == len(engines.widths) == policy.telemetry.steps  # one decision, one observation per step
