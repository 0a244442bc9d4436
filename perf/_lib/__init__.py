"""Helpers of the benchmarks in ``perf/``, imported by them as ``_lib`` (a script's folder is first on its import
path; pytest adds ``perf/`` through ``pythonpath`` in pyproject.toml): the perf_analyzer sweep (``sweep``), its
per-point record (``record``) and report (``report``), before/after pairing of two checkouts (``pairing``), and the
speculators parity oracle (``speculators_parity``). Not part of the ``trtllm_dflash`` package."""
