"""Serving benchmarks: perf_analyzer sweeps over the served ensembles (``sweep``), the per-point record schema
(``record``), the Triton metrics parser for acceptance telemetry (``metrics``), and the JSONL-only report
(``report``)."""
