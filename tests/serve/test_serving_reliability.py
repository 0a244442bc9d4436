"""Reliability of a real Triton server (real SmolLM2 target, real gRPC streams): cancellation through the entry
points users call, overload past --max-sequences, a battery of malformed requests, and a killed step model.
One server for the module; the killed-model test runs last (it reloads a model)."""

import json
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

from trtllm_dflash.client.grpc import DFlashClient, GenerateParams, build_inputs
from trtllm_dflash.perf.health import active_sequences, slot_counts, wait_until_idle
from trtllm_dflash.serve.triton.lifecycle import stub_pids
from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
from trtllm_dflash.serve.triton.server import TritonServer

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")

MAX_SEQUENCES, MAX_QUEUE = 16, 100


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=256,
                                max_sequences=MAX_SEQUENCES, max_queue=MAX_QUEUE, queue_timeout_s=120,
                                idle_timeout_s=120, trtllm_names=False), tmp_path_factory.mktemp("repo") / "repo")
    with TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


class Stream:
    """One gRPC stream; collects every response and error by request id."""

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: dict[str, int] = {}
        self.errors: list[str] = []
        self.finals: set[str] = set()
        self.lock = threading.Lock()
        self.client.start_stream(callback=self._on)

    def _on(self, result, error) -> None:
        with self.lock:
            if error is not None:
                self.errors.append(str(error))
                return
            resp = result.get_response()
            self.responses[resp.id] = self.responses.get(resp.id, 0) + 1
            if resp.parameters.get("triton_final_response") and resp.parameters["triton_final_response"].bool_param:
                self.finals.add(resp.id)

    def send(self, model: str, inputs, rid: str = "") -> None:
        self.client.async_stream_infer(model, inputs, request_id=rid, enable_empty_final_response=True)

    def wait(self, cond, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if cond(self):
                    return True
            time.sleep(0.1)
        return False

    def close(self, cancel: bool) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def ready(server, path: str = "/v2/health/ready") -> int:
    try:
        with urllib.request.urlopen(f"http://{server.host}:{server.http_port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def still_serving(server) -> None:
    assert ready(server) == 200
    with DFlashClient(server.grpc_url) as client:
        assert client.generate("dflash", GenerateParams("Say yes.", 2)).token_ids


@pytest.mark.parametrize("model, n", [("dflash", 100), ("baseline", 24)])
def test_cancelled_streams_through_the_entry_point_free_their_slots(server, model, n):
    """n streams (more than --max-sequences: some generating, the rest queued) cancelled by the client once
    generation runs: the loop sees it before its next step, so the gauge and both models' slots drop to 0."""
    s = Stream(server.grpc_url)
    for i in range(n):
        s.send(model, build_inputs(GenerateParams(f"Write a long story about the number {i}.", 200)), str(i))
    assert s.wait(lambda st: len(st.responses) >= min(n, MAX_SEQUENCES), 300), "generation never started"
    assert active_sequences(server.metrics_url)[model] == n  # generating + queued
    s.close(cancel=True)
    freed_s = wait_until_idle(server.grpc_url, server.metrics_url, (model,), timeout_s=30)
    assert freed_s is not None, (active_sequences(server.metrics_url), slot_counts(server.grpc_url))
    print(f"{model}: {n} cancelled streams freed in {freed_s:.1f} s")
    assert not s.finals, "a cancelled request ran to its end"
    still_serving(server)


def test_overload_beyond_the_queue_is_refused_with_the_limit_named(server):
    extra = 6
    n = MAX_SEQUENCES + MAX_QUEUE + extra
    s = Stream(server.grpc_url)
    for i in range(n):
        s.send("dflash", build_inputs(GenerateParams(f"Count to {i}.", 200)), str(i))
    assert s.wait(lambda st: len(st.errors) >= extra, 120), s.errors
    time.sleep(1.0)
    assert len(s.errors) == extra, s.errors  # the queued ones wait, they are not refused
    for msg in s.errors:
        assert "RESOURCE_EXHAUSTED" in msg and f"--max-sequences {MAX_SEQUENCES}" in msg, msg
        assert f"--max-queue {MAX_QUEUE}" in msg, msg
    assert slot_counts(server.grpc_url)[0] <= MAX_SEQUENCES
    s.close(cancel=True)
    assert wait_until_idle(server.grpc_url, server.metrics_url, ("dflash",), timeout_s=30) is not None
    still_serving(server)


def _t(name, arr, dtype):
    t = grpcclient.InferInput(name, list(np.shape(arr)), dtype)
    t.set_data_from_numpy(np.asarray(arr))
    return t


def _text(v):
    return np.array([[v]], dtype=object)


GOOD = {"text_input": (_text(b"hi"), "BYTES"), "max_tokens": (np.array([[4]], np.int32), "INT32")}
NAN, INF = float("nan"), float("inf")
# (case id, inputs to set or (None) to drop, words the error must contain: the field first)
BATTERY = [
    ("text_input-int32", {"text_input": (np.array([[1]], np.int32), "INT32")}, ["text_input", "INT32"]),
    ("max_tokens-fp32", {"max_tokens": (np.array([[4.0]], np.float32), "FP32")}, ["max_tokens", "FP32"]),
    ("stream-int32", {"stream": (np.array([[1]], np.int32), "INT32")}, ["stream", "INT32"]),
    ("temperature-fp64", {"temperature": (np.array([[0.5]], np.float64), "FP64")}, ["temperature", "FP64"]),
    ("top_k-fp32", {"top_k": (np.array([[1.0]], np.float32), "FP32")}, ["top_k", "FP32"]),
    ("top_p-int32", {"top_p": (np.array([[1]], np.int32), "INT32")}, ["top_p", "INT32"]),
    ("seed-negative-int64", {"seed": (np.array([[-1]], np.int64), "INT64")}, ["seed", "INT64"]),
    ("end_id-int64", {"end_id": (np.array([[2]], np.int64), "INT64")}, ["end_id", "INT64"]),
    ("stop_words-int32", {"stop_words": (np.array([[1]], np.int32), "INT32")}, ["stop_words", "INT32"]),
    ("chat-int32", {"apply_chat_template": (np.array([[1]], np.int32), "INT32")}, ["apply_chat_template", "INT32"]),
    ("max_tokens-shape", {"max_tokens": (np.array([[4, 4, 4]], np.int32), "INT32")}, ["max_tokens", "[1,3]"]),
    ("temperature-shape", {"temperature": (np.array([[0.1, 0.2]], np.float32), "FP32")}, ["temperature", "[1,2]"]),
    ("text_input-shape", {"text_input": (np.array([[b"a", b"b"]], dtype=object), "BYTES")}, ["text_input", "[1,2]"]),
    ("seed-shape", {"seed": (np.array([[1, 2]], np.uint64), "UINT64")}, ["seed", "[1,2]"]),
    # a batch of texts is served row by row (batch_index); one bad row refuses the request by name
    ("batch-2-bad-row", {"text_input": (np.array([[b"a"], [b""]], dtype=object), "BYTES"),
                         "max_tokens": (np.array([[4], [4]], np.int32), "INT32")}, ["text_input=''", "not be empty"]),
    ("batch-mismatch", {"max_tokens": (np.array([[4], [4]], np.int32), "INT32")}, ["text_input", "batch size does not match"]),
    ("missing-text_input", {"text_input": None}, ["text_input"]),
    ("missing-max_tokens", {"max_tokens": None}, ["max_tokens"]),
    ("unknown-input", {"top_q": (np.array([[0.5]], np.float32), "FP32")}, ["top_q"]),
    ("max_tokens-0", {"max_tokens": (np.array([[0]], np.int32), "INT32")}, ["max_tokens=0", ">= 1"]),
    ("max_tokens-negative", {"max_tokens": (np.array([[-5]], np.int32), "INT32")}, ["max_tokens=-5"]),
    ("max_tokens-huge", {"max_tokens": (np.array([[10**6]], np.int32), "INT32")}, ["max_tokens=1000000", "max_seq_len"]),
    ("temperature-negative", {"temperature": (np.array([[-1.0]], np.float32), "FP32")}, ["temperature=-1.0"]),
    ("temperature-nan", {"temperature": (np.array([[NAN]], np.float32), "FP32")}, ["temperature=nan"]),
    ("temperature-inf", {"temperature": (np.array([[INF]], np.float32), "FP32")}, ["temperature=inf", "finite"]),
    ("top_p-0", {"top_p": (np.array([[0.0]], np.float32), "FP32")}, ["top_p=0.0", "(0, 1]"]),
    ("top_p-1.5", {"top_p": (np.array([[1.5]], np.float32), "FP32")}, ["top_p=1.5"]),
    ("top_p-nan", {"top_p": (np.array([[NAN]], np.float32), "FP32")}, ["top_p=nan"]),
    ("top_k-negative", {"top_k": (np.array([[-1]], np.int32), "INT32")}, ["top_k=-1"]),
    ("text-invalid-utf8", {"text_input": (_text(b"\xff\xfe bad"), "BYTES")}, ["text_input", "not valid UTF-8"]),
    ("text-empty", {"text_input": (_text(b""), "BYTES")}, ["text_input=''", "must not be empty"]),
    ("text-over-long", {"text_input": (_text(b"word " * 600), "BYTES")}, ["prompt tokens + max_tokens", "context"]),
    ("end_id-negative", {"end_id": (np.array([[-1]], np.int32), "INT32")}, ["end_id=-1", "token id"]),
    ("end_id-out-of-vocab", {"end_id": (np.array([[10**6]], np.int32), "INT32")}, ["end_id=1000000", "token id"]),
    ("stop_words-invalid-utf8", {"stop_words": (np.array([[b"ok", b"\xc3("]], dtype=object), "BYTES")},
     ["stop_words[1]", "not valid UTF-8"]),
    ("stop_words-too-many", {"stop_words": (np.array([[b"w%d" % i for i in range(1025)]], dtype=object), "BYTES")},
     ["number of stop_words=1025", "at most 1024"]),
]


@pytest.mark.parametrize("model", ["dflash"])
@pytest.mark.parametrize("case, change, words", BATTERY, ids=[c[0] for c in BATTERY])
def test_malformed_request_gets_a_named_error_and_the_server_stays_healthy(server, model, case, change, words):
    inputs = {**GOOD, **change}
    s = Stream(server.grpc_url)
    s.send(model, [_t(name, *v) for name, v in inputs.items() if v is not None], case)
    try:
        assert s.wait(lambda st: st.errors or st.finals, 60), f"{case}: no answer"
    finally:
        s.close(cancel=False)
    assert s.errors and not s.finals, f"{case}: accepted ({s.responses})"
    msg = s.errors[0]
    for w in words:
        assert w.replace(" ", "") in msg.replace(" ", ""), f"{case}: {w!r} not in {msg!r}"
    still_serving(server)


def test_battery_is_large_enough():
    assert len(BATTERY) >= 30


def test_short_soak_loses_hangs_and_leaks_nothing(server, smollm2):
    """perf/soak.py's load for 15 s at c=8 against this server: normal (checked against the in-process runtime),
    cancelled and malformed requests mixed."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("soak", Path(__file__).parents[2] / "perf" / "soak.py")
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    expected = soak.oracle(smollm2["target"], smollm2["drafter"], 12)
    result = soak.run_soak(server, expected, concurrency=8, duration_s=15, max_tokens=12, request_timeout_s=120)
    checks = soak.verdict(result, max_rss_growth_pct=25.0)
    print(json.dumps({k: result[k] for k in ("requests", "idle_after_s", "rss_mib_after_warmup",
                                             "rss_mib_after_run")}))
    assert all(checks.values()), (checks, result)
    assert {"correct", "cancelled", "bad_refused"} <= set(result["requests"]), result["requests"]


@pytest.mark.parametrize("model, block_size", [("baseline", 1), ("dflash", 8)])
def test_concurrent_streams_step_as_one_batch_and_stay_identical(server, smollm2_decode, model, block_size):
    """16 concurrent streams: the entry model's step coalescer serves them with batched step-model calls (the
    dflash_step_rows_total / dflash_step_requests_total metrics: sequence rows per call), and every output equals
    the in-process runtime's for the same prompts decoded as one batch."""
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.perf.health import step_batching

    texts = [p.text for p in load_prompts("humaneval", MAX_SEQUENCES)]
    steps = ("verify",) if block_size == 1 else ("verify", "inject", "draft")
    before = step_batching(server.metrics_url).get(model, {})
    out: list = [None] * len(texts)

    def one(i):
        with DFlashClient(server.grpc_url) as client:
            out[i] = client.generate(model, GenerateParams(texts[i], 12)).token_ids

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    after = step_batching(server.metrics_url)[model]
    assert out == [list(r.token_ids) for r in smollm2_decode[0](texts, 12, block_size)]
    for step in steps:
        requests = after[step]["requests"] - before.get(step, {}).get("requests", 0)
        rows = after[step]["rows"] - before.get(step, {}).get("rows", 0)
        # unbatched, every sequence's call would be a request of its own (rows / requests = 1); a sequence whose
        # start (one prefill each) ends while the others' step is past its inject injects and drafts alone, then
        # joins their verify, so the verify merges the most
        assert rows >= len(texts) and rows / requests >= (8 if step == "verify" else 6), (step, rows, requests)
    starts = after["start"]["requests"] - before.get("start", {}).get("requests", 0)
    assert starts >= len(texts), starts  # every prefill went through the coalescer (at a step barrier)


def test_io_side_yields_the_cores_to_the_step_models(server):
    """On a CPU server the server's own threads and the models that only move requests (entry, loop, tokenizer
    models) run at the repository's io_nice (19, the default), the computing step models at the default 0: their OpenMP teams
    get the cores first. Every thread is checked (Linux keeps a niceness per thread)."""
    import os

    from trtllm_dflash.perf.health import stub_processes

    def niceness(pid: int) -> set[int]:
        return {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}

    by_model = {model: niceness(pid) for pid, model in stub_processes(server.repo).items()}
    steps = {"target_verify", "kv_inject", "drafter"}
    assert steps <= set(by_model) and {"dflash", "baseline", "dflash_bls", "preprocessing"} <= set(by_model)
    for model, values in by_model.items():
        assert values == ({0} if model in steps else {19}), (model, values)
    assert niceness(server.proc.pid) == {19}


def test_killed_step_model_fails_in_flight_requests_naming_it(server):
    """SIGKILL the kv_inject stub while 4 streams generate: they fail within seconds with an error naming the
    model (Triton 2.51 alone would leave them waiting forever); the server reports it (dead_models, then not ready
    once unloaded) and a reload brings it back."""
    import os
    import signal

    s = Stream(server.grpc_url)
    for i in range(4):
        s.send("dflash", build_inputs(GenerateParams(f"Tell me a story about {i}.", 200)), str(i))
    assert s.wait(lambda st: len(st.responses) >= 4, 120)
    victims = stub_pids("kv_inject", parent=server.proc.pid)
    assert victims
    for pid in victims:
        os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert s.wait(lambda st: len(st.errors) >= 4, 30), s.errors
    failed_s = time.monotonic() - t0
    s.close(cancel=False)
    assert all("kv_inject" in e for e in s.errors), s.errors
    print(f"4 in-flight requests failed {failed_s:.1f} s after kv_inject was killed: {s.errors[0]}")
    assert set(server.dead_models()) == {"kv_inject"}
    server.unload("kv_inject")
    assert ready(server) != 200 and ready(server, "/v2/models/kv_inject/ready") != 200
    server.reload("kv_inject")
    assert server.dead_models() == {}
    assert wait_until_idle(server.grpc_url, server.metrics_url, ("dflash",), timeout_s=30) is not None
    still_serving(server)
