"""Parse the Prometheus text of Triton's metrics endpoint and read the DFlash acceptance counters from it.

The BLS loop models export (``trtllm_dflash/serve/triton/telemetry.py``), per label ``model`` (the entry models dflash | baseline, and
the token-level dflash_bls | baseline_bls):
``dflash_draft_tokens_total``, ``dflash_accepted_draft_tokens_total``, ``dflash_steps_total``,
``dflash_requests_total`` and ``dflash_acceptance_length_total{tau=..}``. A benchmark point reads them before and
after and keeps the difference, so τ belongs to that point only (as long as nothing else talks to the server).
"""

from __future__ import annotations

import math
import re
import urllib.request
from dataclasses import dataclass, field

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Samples = dict[tuple[str, frozenset], float]


def parse_prometheus(text: str) -> Samples:
    """{(metric name, frozenset of (label, value)): value} for every sample line; comments and blanks skipped."""
    out: Samples = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            raise ValueError(f"not a Prometheus sample line: {line!r}")
        name, labels, value = m.groups()
        pairs = frozenset((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in _LABEL.findall(labels or ""))
        out[(name, pairs)] = float(value)  # also parses NaN, +Inf, -Inf
    return out


def fetch_metrics(url: str, timeout_s: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as r:
        return r.read().decode()


@dataclass(frozen=True, slots=True)
class LoopCounters:
    """The DFlash loop counters of one BLS model (a snapshot, or the difference of two)."""

    draft_tokens: int = 0
    accepted_draft_tokens: int = 0
    steps: int = 0
    requests: int = 0
    by_tau: dict[int, int] = field(default_factory=dict)  # acceptance length -> verify steps

    @classmethod
    def from_samples(cls, samples: Samples, model: str) -> "LoopCounters":
        def get(name: str) -> int:
            return int(samples.get((name, frozenset({("model", model)})), 0))

        by_tau = {}
        for (name, labels), value in samples.items():
            lab = dict(labels)
            if name == "dflash_acceptance_length_total" and lab.get("model") == model and "tau" in lab:
                by_tau[int(lab["tau"])] = int(value)
        return cls(get("dflash_draft_tokens_total"), get("dflash_accepted_draft_tokens_total"),
                   get("dflash_steps_total"), get("dflash_requests_total"), dict(sorted(by_tau.items())))

    @classmethod
    def read(cls, metrics_url: str, model: str) -> "LoopCounters":
        return cls.from_samples(parse_prometheus(fetch_metrics(metrics_url)), model)

    def __sub__(self, before: "LoopCounters") -> "LoopCounters":
        taus = sorted(set(self.by_tau) | set(before.by_tau))
        return LoopCounters(self.draft_tokens - before.draft_tokens,
                            self.accepted_draft_tokens - before.accepted_draft_tokens,
                            self.steps - before.steps, self.requests - before.requests,
                            {t: self.by_tau.get(t, 0) - before.by_tau.get(t, 0) for t in taus})

    @property
    def mean_acceptance_length(self) -> float:
        """τ = tokens emitted per verify step = (accepted + steps) / steps; NaN without steps."""
        return (self.accepted_draft_tokens + self.steps) / self.steps if self.steps else math.nan
