"""A running server read from outside: the Prometheus text of Triton's metrics endpoint and the DFlash loop counters
in it (``metrics``), and what the server holds: live sequences, step-model slots, python stubs and their memory
(``health``). The benchmarks in ``perf/`` and the serving tests use them."""
