"""One benchmark point = one ``PerfRecord`` = one JSON line of ``records.jsonl``.

Units are in the field names. Token counts come from the ``output_ids`` output recorded by perf_analyzer in its
profile export (cumulative ids per streamed response: the new tokens of a response are the growth of that list), not
from re-tokenizing ``text_output``. τ comes from the server's DFlash counters (difference before/after the point).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

SCHEMA = 1


@dataclass(slots=True)
class PerfRecord:
    # the point
    model: str  # served ensemble: dflash | baseline
    dataset: str
    # the repository's draft block size or "auto", "+ngram" with prompt lookup (the baseline's loop: block size 1)
    block_size: int | str
    concurrency: int
    max_tokens: int
    # client side, from the perf_analyzer profile export
    requests: int
    responses: int  # streamed responses that carried tokens
    output_tokens: int
    duration_s: float  # first request sent -> last response received
    output_tokens_per_s: float
    requests_per_s: float
    ttft_ms_p50: float
    ttft_ms_p99: float
    itl_ms_p50: float  # inter-token latency: gap between responses / tokens in the later one (GenAI-Perf's definition)
    itl_ms_p99: float
    latency_ms_p50: float  # request latency: send -> last response
    latency_ms_p99: float
    # the same acceptance lengths as seen by the client (acceptance_lengths output, one entry per verify step)
    client_steps: int
    client_tau_mean: float
    # server side, from the metrics endpoint (counter deltas over the point)
    draft_tokens: int
    accepted_draft_tokens: int
    steps: int
    server_requests: int
    tau_mean: float  # (accepted + steps) / steps
    tau_hist: dict[str, int]  # acceptance length -> verify steps (string keys: JSON objects)
    # provenance
    token_source: str = "output_ids"
    profile_export: str = ""  # path relative to the sweep directory
    drafter_dir: str = ""
    drafter_trained: bool | None = None
    env: dict = field(default_factory=dict)  # tool versions, git commit, machine
    timestamp: str = ""
    schema: int = SCHEMA

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps({k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()})

    @classmethod
    def from_dict(cls, d: dict) -> "PerfRecord":
        unknown = sorted(set(d) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"unknown record fields {unknown}")
        return cls(**{k: (math.nan if v is None and k in _FLOATS else v) for k, v in d.items()})  # TypeError if missing


_FLOATS = {f.name for f in fields(PerfRecord) if f.type == "float"}


def emit_json(doc: dict, out: str | Path | None = None) -> None:
    """A benchmark script's result: one JSON line on stdout, and the same object written atomically to ``out``."""
    print(json.dumps(doc))
    if out:
        from trtllm_dflash.models.weights import write_json

        Path(out).parent.mkdir(parents=True, exist_ok=True)
        write_json(doc, Path(out))


def append_record(path: str | Path, rec: PerfRecord) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(rec.to_json() + "\n")


def load_records(path: str | Path) -> list[PerfRecord]:
    path = Path(path)
    out = []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                out.append(PerfRecord.from_dict(json.loads(line)))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: {exc}") from None
    return out
