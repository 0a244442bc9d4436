"""Custom Triton metrics of the speculative loop (python-backend metrics API), exported on the metrics endpoint.

Per BLS model (label ``model``): draft tokens proposed and accepted, steps, finished requests, acceptance-length
counts (label ``tau``), and live sequences (gauge). τ for a run = (accepted + steps) / steps.
"""

from __future__ import annotations


class LoopTelemetry:
    def __init__(self, pb_utils, model: str, block_size: int) -> None:
        counter, gauge = pb_utils.MetricFamily.COUNTER, pb_utils.MetricFamily.GAUGE
        labels = {"model": model}
        fam = pb_utils.MetricFamily
        self._families = [  # keep the families alive as long as their metrics
            fam("dflash_draft_tokens_total", "Draft tokens proposed to the target", counter),
            fam("dflash_accepted_draft_tokens_total", "Draft tokens accepted by the target", counter),
            fam("dflash_steps_total", "Verify steps (each emits tau tokens)", counter),
            fam("dflash_requests_total", "Requests finished", counter),
            fam("dflash_acceptance_length_total", "Verify steps by acceptance length tau", counter),
            fam("dflash_active_sequences", "Sequences being generated", gauge),
        ]
        self.proposed, self.accepted, self.steps, self.requests = (f.Metric(labels=labels) for f in self._families[:4])
        self.by_tau = [self._families[4].Metric(labels={**labels, "tau": str(t)}) for t in range(1, block_size + 1)]
        self.live = self._families[5].Metric(labels=labels)
        self._active = 0

    def record(self, update) -> None:
        self.proposed.increment(update.num_draft_tokens)
        self.accepted.increment(update.num_accepted_draft_tokens)
        self.steps.increment(len(update.acceptance_lengths))
        for tau in update.acceptance_lengths:
            self.by_tau[tau - 1].increment(1)
        if update.final:
            self.requests.increment(1)

    def active(self, delta: int) -> None:
        self._active += delta
        self.live.set(self._active)
