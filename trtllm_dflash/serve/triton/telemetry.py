"""Custom Triton metrics of the speculative loop (python-backend metrics API), exported on the metrics endpoint.

Per BLS model (label ``model``): draft tokens proposed and accepted, steps, finished requests, acceptance-length
counts (label ``tau``), live sequences (gauge), the drafts verified per step (label ``k``: what ``--block-size auto``
chose) and where the loop's time went (label ``part``: draft / verify / overhead). τ for a run = (accepted + steps) /
steps. The stepper's batched calls (label ``step``: verify / inject / draft / start, and plan: the ``auto``
decisions made together, no model call): requests sent (``dflash_step_requests_total``) and the sequence rows they
carried (``dflash_step_rows_total``); rows / requests is how many sequences one step-model call served.

Each metric call is a round trip to the server process: the counts are gathered here and handed over at most every
``FLUSH_S`` and whenever a request ends (a call per metric and step of every sequence would take a visible share of a
served stream's CPU time from decoding, in both entry models).

The same counts are also exported under the names other servers use, so their dashboards work unchanged (labels
``model_name`` and ``model``):

==================================================  ===========================================================
ecosystem metric                                    here
==================================================  ===========================================================
trtllm_spec_decode_num_draft_tokens_total           = dflash_draft_tokens_total (trtllm-serve)
trtllm_spec_decode_num_accepted_tokens_total        = dflash_accepted_draft_tokens_total (trtllm-serve)
trtllm_spec_decode_acceptance_length (gauge)        mean τ since start, (accepted + steps) / steps
trtllm_spec_decode_draft_overhead (gauge)           draft seconds / (draft + verify + overhead) seconds
vllm:spec_decode_num_drafts_total                   steps that verified at least one draft
vllm:spec_decode_num_draft_tokens_total             = dflash_draft_tokens_total
vllm:spec_decode_num_accepted_tokens_total          = dflash_accepted_draft_tokens_total
vllm:spec_decode_num_accepted_tokens_per_pos_total  label ``position`` (0-based): steps whose draft at that
                                                    position was accepted
==================================================  ===========================================================
"""

from __future__ import annotations

import time


PARTS = ("draft", "verify", "overhead")
FLUSH_S = 0.25  # counts reach Triton at most this late (and at every request's end): each metric call is an IPC


KINDS = ("start", "plan", "inject", "draft", "verify")  # a step's calls, in the order the stepper makes them


class LoopTelemetry:
    def __init__(self, pb_utils, model: str, block_size: int) -> None:
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        labels = {"model": model}
        eco = {"model_name": model, "model": model}
        fam = pb_utils.MetricFamily
        self._families = [  # keep the families alive as long as their metrics
            fam("dflash_draft_tokens_total", "Draft tokens proposed to the target", counter),
            fam("dflash_accepted_draft_tokens_total", "Draft tokens accepted by the target", counter),
            fam("dflash_steps_total", "Verify steps (each emits tau tokens)", counter),
            fam("dflash_requests_total", "Requests finished", counter),
            fam("dflash_acceptance_length_total", "Verify steps by acceptance length tau", counter),
            fam("dflash_active_sequences", "Sequences being generated", gauge),
            fam("dflash_chosen_draft_length_total", "Verify steps by drafts verified k (--block-size auto)", counter),
            fam("dflash_step_seconds_total", "Loop seconds by part: draft, verify, overhead", counter),
            fam("trtllm_spec_decode_num_draft_tokens_total", "Draft tokens proposed (trtllm-serve name)", counter),
            fam("trtllm_spec_decode_num_accepted_tokens_total", "Draft tokens accepted (trtllm-serve name)", counter),
            fam("trtllm_spec_decode_acceptance_length", "Mean acceptance length tau since start", gauge),
            fam("trtllm_spec_decode_draft_overhead", "Fraction of loop time spent drafting", gauge),
            fam("vllm:spec_decode_num_drafts_total", "Steps that verified drafts (vLLM name)", counter),
            fam("vllm:spec_decode_num_draft_tokens_total", "Draft tokens proposed (vLLM name)", counter),
            fam("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted (vLLM name)", counter),
            fam("vllm:spec_decode_num_accepted_tokens_per_pos_total", "Accepted drafts by position (vLLM name)",
                counter),
            fam("dflash_step_requests_total", "Batched step-model calls sent by the loop model's stepper", counter),
            fam("dflash_step_rows_total", "Sequence rows carried by the batched step-model calls", counter),
        ]
        f = self._families
        self.proposed, self.accepted, self.steps, self.requests = (x.Metric(labels=labels) for x in f[:4])
        self.by_tau = [f[4].Metric(labels={**labels, "tau": str(t)}) for t in range(1, block_size + 1)]
        self.live = f[5].Metric(labels=labels)
        self.by_k = [f[6].Metric(labels={**labels, "k": str(k)}) for k in range(block_size)]
        self.seconds = {part: f[7].Metric(labels={**labels, "part": part}) for part in PARTS}
        self.trt_drafted, self.trt_accepted, self.trt_tau, self.trt_overhead = (x.Metric(labels=eco) for x in f[8:12])
        self.vllm_drafts, self.vllm_drafted, self.vllm_accepted = (x.Metric(labels=eco) for x in f[12:15])
        self.vllm_per_pos = [f[15].Metric(labels={**eco, "position": str(j)}) for j in range(block_size - 1)]
        self.step_requests = {k: f[16].Metric(labels={**labels, "step": k}) for k in KINDS}
        self.step_rows = {k: f[17].Metric(labels={**labels, "step": k}) for k in KINDS}
        self._active = 0
        self._pending: dict[int, tuple[object, float]] = {}  # id(metric) -> (metric, increment not yet flushed)
        self._flushed = time.monotonic()
        self._totals = {"steps": 0, "accepted": 0, **dict.fromkeys(PARTS, 0.0)}

    def _add(self, metric, value: float) -> None:
        if value:
            key = id(metric)
            self._pending[key] = (metric, self._pending.get(key, (metric, 0))[1] + value)

    def flush(self, force: bool = True) -> None:
        """Hand the counts gathered since the last flush to Triton; unless ``force``, only once ``FLUSH_S`` passed."""
        now = time.monotonic()
        if not self._pending or (not force and now - self._flushed < FLUSH_S):
            return
        pending, self._pending, self._flushed = self._pending, {}, now
        for metric, value in pending.values():
            metric.increment(value)
        t = self._totals
        if t["steps"]:
            self.trt_tau.set((t["accepted"] + t["steps"]) / t["steps"])
        total = sum(t[p] for p in PARTS)
        if total > 0:
            self.trt_overhead.set(t["draft"] / total)

    def record(self, update, request_done: bool | None = None) -> None:
        """One response's update; ``request_done``: whether it ends its request (default: its sequence's last; with
        num_return_sequences > 1 only the last sequence's last does)."""
        add = self._add
        for metric in (self.proposed, self.trt_drafted, self.vllm_drafted):
            add(metric, update.num_draft_tokens)
        for metric in (self.accepted, self.trt_accepted, self.vllm_accepted):
            add(metric, update.num_accepted_draft_tokens)
        add(self.steps, len(update.acceptance_lengths))
        for tau in update.acceptance_lengths:
            add(self.by_tau[tau - 1], 1)
            for j in range(tau - 1):
                add(self.vllm_per_pos[j], 1)
        for k in update.draft_lengths:
            add(self.by_k[k], 1)
        for part, sec in update.seconds.items():
            add(self.seconds[part], sec)
        add(self.vllm_drafts, sum(1 for k in update.draft_lengths if k > 0))
        t = self._totals
        t["steps"] += len(update.acceptance_lengths)
        t["accepted"] += update.num_accepted_draft_tokens
        for part, sec in update.seconds.items():
            t[part] += sec
        if update.final if request_done is None else request_done:
            add(self.requests, 1)
        self.flush(force=update.final)

    def step_call(self, kind: str, rows: int) -> None:
        self._add(self.step_requests[kind], 1)
        self._add(self.step_rows[kind], rows)
        self.flush(force=False)

    def active(self, delta: int) -> None:
        """A request began (+1) or ended (-1, also cancelled or failed: everything gathered is flushed)."""
        self._active += delta
        self.live.set(self._active)
        if delta < 0:
            self.flush()
