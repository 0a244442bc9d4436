"""What a running server holds, read from outside: live sequences (the ``dflash_active_sequences`` gauge), the step
models' sequence slots, its python stubs and their memory. Used by the reliability tests and ``perf/soak.py``."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from trtllm_dflash.perf.metrics import fetch_metrics, parse_prometheus

STATS = 3  # the step models' STATS mode (serve/triton/handlers.py)


def active_sequences(metrics_url: str) -> dict[str, float]:
    """{model: requests its loop is serving (generating or waiting for a slot)} from the metrics endpoint."""
    samples = parse_prometheus(fetch_metrics(metrics_url))
    return {dict(labels)["model"]: v for (name, labels), v in samples.items() if name == "dflash_active_sequences"}


def step_batching(metrics_url: str) -> dict[str, dict[str, float]]:
    """{model: {step: sequence rows per step-model call}} of the loop models' steppers (and the totals)."""
    samples = parse_prometheus(fetch_metrics(metrics_url))
    out: dict[str, dict[str, float]] = {}
    for (name, labels), v in samples.items():
        if name in ("dflash_step_requests_total", "dflash_step_rows_total"):
            lab = dict(labels)
            out.setdefault(lab["model"], {}).setdefault(lab["step"], {})[name.split("_")[2]] = v
    return {m: {s: {**c, "rows_per_request": c.get("rows", 0) / c["requests"] if c.get("requests") else None}
                for s, c in steps.items()} for m, steps in out.items()}


def slot_counts(grpc_url: str) -> tuple[int, int]:
    """Live sequences holding state in (target_verify, drafter)."""
    import tritonclient.grpc as grpcclient

    counts = []
    with grpcclient.InferenceServerClient(grpc_url) as c:
        for model in ("target_verify", "drafter"):
            mode = grpcclient.InferInput("mode", [1, 1], "INT32")
            mode.set_data_from_numpy(np.array([[STATS]], dtype=np.int32))
            seq = grpcclient.InferInput("seq_id", [1, 1], "UINT64")
            seq.set_data_from_numpy(np.array([[0]], dtype=np.uint64))
            counts.append(int(c.infer(model, [mode, seq]).as_numpy("num_active")[0, 0]))
    return counts[0], counts[1]


def wait_until_idle(grpc_url: str, metrics_url: str, models: tuple[str, ...], timeout_s: float) -> float | None:
    """Seconds until every model's gauge is 0 and no slot is held, or None if that did not happen in time."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        gauge = active_sequences(metrics_url)
        if all(gauge.get(m, 0) == 0 for m in models) and slot_counts(grpc_url) == (0, 0):
            return time.monotonic() - t0
        time.sleep(0.25)
    return None


def stub_processes(repo: str | Path) -> dict[int, str]:
    """{pid: model} of every live python stub serving a model of ``repo`` (whoever its parent is)."""
    prefix = str(Path(repo).resolve()) + "/"
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("Z", "X") or len(argv) < 2 or not argv[0].endswith(b"triton_python_backend_stub"):
            continue
        path = argv[1].decode(errors="replace")
        if path.startswith(prefix):
            out[int(entry.name)] = path[len(prefix):].split("/")[0]
    return out


def rss_mib(pids) -> float:
    """Resident memory of ``pids`` together, MiB (processes that exited count 0)."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024
