"""A real Triton server (the one bundled in nvidia-pytriton) on a rendered repository with the real SmolLM2 target:
streaming over gRPC, identity with the in-process runtime, batching, bad requests, cancellation."""

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

from conftest import trtllm_stream
from trtllm_dflash.client.grpc import DFlashClient, GenerateParams, ServerError
from trtllm_dflash.runtime.text import encode_prompt
from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
from trtllm_dflash.serve.triton.server import SHM_DIR, TritonServer, shm_prefix

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")

PROMPTS = ["What is the capital of Italy?", "Write a haiku about rain.", "List three prime numbers.",
           "Explain recursion in one sentence.", "def add(a, b):", "Translate 'good morning' to French.",
           "What is 7 times 8?", "Name a famous physicist."]


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=512,
                                max_sequences=12, idle_timeout_s=60), tmp_path_factory.mktemp("repo") / "repo")
    log = tmp_path_factory.mktemp("log") / "server.log"
    with TritonServer(repo, log_path=log) as s:
        regions = list(SHM_DIR.glob(shm_prefix(s.grpc_port) + "*"))
        assert regions, "the python backend's shared memory should carry this server's prefix"
        yield s
    left = [f.name for f in SHM_DIR.glob(shm_prefix(s.grpc_port) + "*")]
    assert not left, f"stop() must free the server's shared memory (RAM): {left}"


@pytest.fixture(scope="module")
def oracle(smollm2_decode):
    decode, tok = smollm2_decode
    return (lambda prompt, max_tokens, block_size: decode([prompt], max_tokens, block_size)[0]), tok


def step_stats(server, model: str):
    """A step model's STATS response."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    mode = grpcclient.InferInput("mode", [1, 1], "INT32")
    mode.set_data_from_numpy(np.array([[3]], dtype=np.int32))
    seq = grpcclient.InferInput("seq_id", [1, 1], "UINT64")
    seq.set_data_from_numpy(np.array([[0]], dtype=np.uint64))
    return c.infer(model, [mode, seq])


def active_states(server) -> tuple[int, int]:
    return tuple(int(step_stats(server, m).as_numpy("num_active")[0, 0]) for m in ("target_verify", "drafter"))


@pytest.mark.parametrize("model, block_size", [("dflash", 8), ("baseline", 1)])
def test_streamed_output_equals_in_process_runtime(server, oracle, model, block_size):
    run, tok = oracle
    with DFlashClient(server.grpc_url) as client:
        for prompt in PROMPTS[:3]:
            chunks = []
            done = client.generate(model, GenerateParams(prompt, 24), on_chunk=chunks.append)
            ref = run(prompt, 24, block_size)
            assert done.token_ids == list(ref.token_ids)
            assert done.text == tok.decode(ref.token_ids, skip_special_tokens=True)
            assert done.acceptance_lengths == list(ref.acceptance_lengths)
            assert len(chunks) > 1, "streaming should deliver several responses"


def test_non_streaming_gives_one_response(server, oracle):
    run, _ = oracle
    with DFlashClient(server.grpc_url) as client:
        done = client.generate("dflash", GenerateParams(PROMPTS[0], 16, stream=False))
    assert len(done.chunks) == 1 and done.token_ids == list(run(PROMPTS[0], 16, 8).token_ids)


def test_eight_concurrent_streams_are_correct_and_batched(server, oracle, smollm2):
    """Every other request asks for log-probabilities: rows with and without them verify in one batch, and those that
    asked get the autoregressive values."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import stop_token_ids

    run, tok = oracle
    lengths = [8, 24, 16, 32, 12, 20, 28, 10]
    stats = grpcclient.InferenceServerClient(server.grpc_url)

    def batched_executions() -> int:
        s = stats.get_inference_statistics("target_verify", as_json=True)["model_stats"][0]
        return sum(int(b["compute_infer"]["count"]) for b in s.get("batch_stats", []) if int(b["batch_size"]) > 1)

    before = batched_executions()
    with DFlashClient(server.grpc_url) as client:
        rids = [client.submit("dflash", GenerateParams(p, n, logprobs=i % 2 == 0))
                for i, (p, n) in enumerate(zip(PROMPTS, lengths))]
        results, logprobs = {}, {}

        def drain(rid):
            chunks = list(client.responses(rid))
            results[rid], logprobs[rid] = chunks[-1].output_ids, [v for c in chunks for v in c.logprobs]

        threads = [threading.Thread(target=drain, args=(r,)) for r in rids]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    target, _ = load_pair(smollm2["target"], smollm2["drafter"])
    for i, (rid, prompt, n) in enumerate(zip(rids, PROMPTS, lengths)):
        assert results[rid] == list(run(prompt, n, 8).token_ids), prompt
        if i % 2:
            assert logprobs[rid] == []
            continue
        ar = SpeculativeDecoder(target, None, 1).generate([Request(
            tuple(encode_prompt(tok, prompt, chat=True)), n, SamplingParams(logprobs=True),
            stop_token_ids=stop_token_ids(tok, target.spec.eos_token_ids))])[0]
        assert logprobs[rid] == pytest.approx(list(ar.logprobs), abs=2e-4), prompt
    assert batched_executions() > before, "target_verify never executed a batch larger than 1"


@pytest.mark.parametrize(
    "params, words",
    [
        (GenerateParams("hi", 0), "max_tokens=0: must be >= 1"),
        (GenerateParams("hi", 10**6), "max_tokens=1000000: must be < the repository's max_seq_len (512)"),
        (GenerateParams("hi", 8, temperature=-1.0), "temperature=-1.0: must be >= 0"),
        (GenerateParams("hi", 8, top_p=1.5), "top_p=1.5: must be in (0, 1]"),
        (GenerateParams("word " * 600, 8), "exceeds the context limit (512 tokens)"),
        (GenerateParams("", 8), "text_input='': must not be empty"),
    ],
)
def test_bad_requests_get_named_errors_and_server_stays_up(server, params, words):
    with DFlashClient(server.grpc_url) as client:
        with pytest.raises(ServerError, match=None) as exc:
            client.generate("dflash", params)
        assert words in str(exc.value)
        assert client.generate("baseline", GenerateParams("Say yes.", 4)).token_ids  # still serving


def test_malformed_tensors_are_rejected(server):
    c = grpcclient.InferenceServerClient(server.grpc_url)
    errors = []
    c.start_stream(callback=lambda result, error: errors.append(error))

    def send(inputs):
        c.async_stream_infer("dflash", inputs)

    text = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    text.set_data_from_numpy(np.array([[b"\xff\xfe bad utf8"]], dtype=object))
    mt = grpcclient.InferInput("max_tokens", [1, 1], "INT32")
    mt.set_data_from_numpy(np.array([[4]], dtype=np.int32))
    send([text, mt])  # invalid UTF-8
    send([mt])  # missing text_input
    good = grpcclient.InferInput("text_input", [1, 1], "BYTES")
    good.set_data_from_numpy(np.array([[b"hi"]], dtype=object))
    bad_dtype = grpcclient.InferInput("max_tokens", [1, 1], "FP32")
    bad_dtype.set_data_from_numpy(np.array([[4.0]], dtype=np.float32))
    send([good, bad_dtype])  # wrong dtype
    bad_shape = grpcclient.InferInput("max_tokens", [1, 3], "INT32")
    bad_shape.set_data_from_numpy(np.array([[4, 4, 4]], dtype=np.int32))
    send([good, bad_shape])  # wrong shape
    deadline = time.time() + 120
    while len([e for e in errors if e is not None]) < 4 and time.time() < deadline:
        time.sleep(0.2)
    c.stop_stream()
    messages = [str(e) for e in errors if e is not None]
    assert any("text_input" in m and "not valid UTF-8" in m for m in messages), messages
    assert any("text_input" in m for m in messages if "UTF-8" not in m), messages
    assert any("max_tokens" in m and "FP32" in m for m in messages), messages
    assert any("max_tokens" in m and "[1,3]" in m.replace(" ", "") for m in messages), messages
    with DFlashClient(server.grpc_url) as client:
        assert client.generate("dflash", GenerateParams("Say yes.", 4)).token_ids


def test_unary_call_maps_bad_input_to_invalid_argument(server):
    """postprocessing (TensorRT-LLM's, unary) with a sequence length past its tokens: INVALID_ARGUMENT naming it."""
    c = grpcclient.InferenceServerClient(server.grpc_url)
    tokens = grpcclient.InferInput("TOKENS_BATCH", [1, 1, 3], "INT32")
    tokens.set_data_from_numpy(np.array([[[1, 2, 3]]], dtype=np.int32))
    length = grpcclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")
    length.set_data_from_numpy(np.array([[9]], dtype=np.int32))
    with pytest.raises(Exception) as exc:
        c.infer("postprocessing", [tokens, length])
    assert "INVALID_ARGUMENT" in str(exc.value.status()) and "SEQUENCE_LENGTH=9: must be in [0, 3]" in str(exc.value)


def bls_inputs(tok, prompt: str, max_tokens: int, sequences: int = 1):
    """Inputs of the dflash_bls model itself (what preprocessing would produce)."""
    ids = np.array([encode_prompt(tok, prompt, chat=True)], dtype=np.int32)
    values = [("input_ids", ids, "INT32"), ("max_tokens", np.array([[max_tokens]], np.int32), "INT32"),
              ("stream", np.array([[True]]), "BOOL"), ("temperature", np.array([[0.0]], np.float32), "FP32"),
              ("top_k", np.array([[0]], np.int32), "INT32"), ("top_p", np.array([[1.0]], np.float32), "FP32"),
              ("seed", np.array([[0]], np.uint64), "UINT64"), ("stop_sequences", np.array([[2, -1]], np.int32), "INT32")]
    if sequences > 1:
        values.append(("num_return_sequences", np.array([[sequences]], np.int32), "INT32"))
    out = []
    for name, arr, dtype in values:
        t = grpcclient.InferInput(name, list(arr.shape), dtype)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def test_cancelled_streams_free_their_state(server, oracle):
    """50 streams cancelled mid-generation on the token-level loop model dflash_bls, and 10 requests of 3 sequences
    (num_return_sequences: one prefill, two forks) cancelled at whatever point they had reached: the loop sees the
    cancellation at its next step and frees every sequence's state in both stateful models. (The entry points dflash
    / baseline run the same loop: tests/serve/test_serving_reliability.py cancels through them.)"""
    _, tok = oracle
    for _ in range(10):
        c = grpcclient.InferenceServerClient(server.grpc_url)
        first = threading.Event()
        c.start_stream(callback=lambda result, error: first.set())
        for p in PROMPTS[:5]:
            c.async_stream_infer("dflash_bls", bls_inputs(tok, p, 200))
        c.async_stream_infer("dflash_bls", bls_inputs(tok, PROMPTS[5], 200, sequences=3))
        assert first.wait(timeout=300), "no response before cancelling"
        c.stop_stream(cancel_requests=True)
        c.close()
    deadline = time.time() + 180
    while active_states(server) != (0, 0) and time.time() < deadline:
        time.sleep(1.0)
    assert active_states(server) == (0, 0)
    with DFlashClient(server.grpc_url) as client:
        assert client.generate("dflash", GenerateParams("Say yes.", 4)).token_ids


# Triton's HTTP generate extension (/v2/models/<model>/generate and generate_stream): what a curl user or an
# HTTP-only client calls, with the JSON body TensorRT-LLM's own quick-start sends to its ensemble.
def http_post(server, path: str, body: dict, timeout: float = 300):
    """(connection, response) of one JSON POST; Triton's errors come back as their status and body."""
    conn = http.client.HTTPConnection(server.host, server.http_port, timeout=timeout)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse_events(resp):
    """The JSON objects of a generate_stream response's ``data:`` lines, as they arrive."""
    for line in resp:
        if line.startswith(b"data: "):
            yield json.loads(line[6:])


@pytest.mark.parametrize("model", ["dflash", "ensemble", "tensorrt_llm_bls"])
def test_http_generate_equals_the_runtime(server, oracle, model):
    """TensorRT-LLM's quick-start request (POST /v2/models/ensemble/generate with its keys) on dflash and on the two
    names TensorRT-LLM's deployments give their text-level model: the DFlash loop's answer on each."""
    run, tok = oracle
    ref = run(PROMPTS[0], 16, 8)
    conn, resp = http_post(server, f"/v2/models/{model}/generate",
                           {"text_input": PROMPTS[0], "max_tokens": 16, "apply_chat_template": True,
                            "bad_words": "", "stop_words": ""})  # keys of TRT-LLM's curl example are accepted
    out = json.loads(resp.read())
    conn.close()
    assert resp.status == 200, out
    assert out["output_ids"] == list(ref.token_ids)
    assert out["text_output"] == tok.decode(ref.token_ids, skip_special_tokens=True)


def test_http_generate_stream_deltas_concatenate_to_the_answer(server, oracle):
    run, tok = oracle
    ref = run(PROMPTS[1], 24, 8)
    conn, resp = http_post(server, "/v2/models/dflash/generate_stream",
                           {"text_input": PROMPTS[1], "max_tokens": 24, "stream": True, "apply_chat_template": True})
    events = list(sse_events(resp))
    conn.close()
    assert resp.status == 200 and len(events) > 1, events
    assert "".join(e["text_output"] for e in events) == tok.decode(ref.token_ids, skip_special_tokens=True)
    assert events[-1]["output_ids"] == list(ref.token_ids)


@pytest.mark.parametrize("path", ["generate", "generate_stream"])
def test_http_bad_input_is_a_400_naming_the_field(server, path):
    for body, words in [({"text_input": "hi", "max_tokens": 0}, "max_tokens=0: must be >= 1"),
                        ({"text_input": "hi", "max_tokens": 4, "temperature": -1}, "temperature=-1.0"),
                        ({"text_input": "hi"}, "max_tokens")]:
        conn, resp = http_post(server, f"/v2/models/dflash/{path}", body)
        raw = resp.read()
        conn.close()
        text = raw.decode()
        error = json.loads(text[6:] if text.startswith("data: ") else text)["error"]
        assert resp.status == 400 and words in error, (body, resp.status, text)
    with DFlashClient(server.grpc_url) as client:
        assert client.generate("dflash", GenerateParams("Say yes.", 4)).token_ids  # still serving


def test_http_stream_closed_by_the_client_frees_its_sequence(server):
    """A curl user's Ctrl-C: the connection closes mid-stream; the generation stops within seconds and its rows in
    target_verify and the drafter are freed (not by the idle time-out: 60 s here; 400 tokens take >10 s here)."""
    conn, resp = http_post(server, "/v2/models/dflash/generate_stream",
                           {"text_input": "Write a long story about a dragon.", "max_tokens": 400, "stream": True,
                            "apply_chat_template": True})
    events = sse_events(resp)
    for _ in range(3):
        next(events)
    assert active_states(server) != (0, 0)
    conn.sock.shutdown(socket.SHUT_RDWR)  # the client is gone
    conn.close()
    deadline = time.time() + 6
    while active_states(server) != (0, 0) and time.time() < deadline:
        time.sleep(0.5)
    assert active_states(server) == (0, 0), "the abandoned generation kept its rows"


def test_out_of_vocabulary_ids_to_the_token_loop_are_named_and_hold_no_slot(server, oracle):
    """dflash_bls takes token ids: ids outside the vocabulary get an error naming them, and (unlike before session
    39: torch's "index out of range in self" and a target_verify slot held until the idle time-out) no slot stays
    taken; the server answers the next request. So do they for a request of 3 sequences (the first sequence's start
    fails, its siblings' fall-back prefills alike: one error)."""
    _, tok = oracle
    for bad, sequences in ((len(tok) + 5, 1), (-3, 1), (len(tok) + 7, 3)):
        inputs = bls_inputs(tok, "hi", 4, sequences)
        ids = grpcclient.InferInput("input_ids", [1, 2], "INT32")
        ids.set_data_from_numpy(np.array([[1, bad]], np.int32))
        errors, done = [], threading.Event()
        c = grpcclient.InferenceServerClient(server.grpc_url)
        c.start_stream(callback=lambda result, error: (errors.append(error), done.set()))
        c.async_stream_infer("dflash_bls", [ids, *inputs[1:]])
        assert done.wait(60)
        c.stop_stream()
        assert errors[0] is not None and f"prompt token id={bad}: must be in [0," in str(errors[0]), errors
    assert active_states(server) == (0, 0)
    with DFlashClient(server.grpc_url) as client:
        assert client.generate("dflash", GenerateParams("Say yes.", 4)).token_ids


# Clients written for TensorRT-LLM's Triton ensemble (serve/trtllm/compat.py, tests/data/trtllm_ensemble/ensemble_io.json):
# its example client and GenAI-Perf send inputs beyond ours and read text_output as a 1-D tensor.
@pytest.fixture(scope="module")
def raw_runtime(smollm2, oracle):
    """``run(prompt, max_tokens, sampling, min_new_tokens)``: the in-process autoregressive decoding of a prompt sent
    as is (no chat template), stopping at the target's stop tokens, as the entry models do."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import stop_token_ids

    _, tok = oracle
    target, _ = load_pair(smollm2["target"], smollm2["drafter"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)

    done: dict = {}  # seeded decoding is a function of its arguments: each served model's test reuses the answer

    def run(prompt, max_tokens, sampling=SamplingParams(), min_new_tokens=0, result=False):
        """(prompt ids, answer tokens); ``result``: (prompt ids, the GenerationResult)."""
        ids = encode_prompt(tok, prompt, chat=False)
        key = (prompt, max_tokens, sampling, min_new_tokens)
        if key not in done:
            done[key] = SpeculativeDecoder(target, None, 1).generate(
                [Request(tuple(ids), max_tokens, sampling, stop_token_ids=stops, min_new_tokens=min_new_tokens)])[0]
        out = done[key]
        return ids, out if result else list(out.token_ids)

    return run


# what TensorRT-LLM's end_to_end_grpc_client.py asks for by name with --return-log-probs --return-perf-metrics
# (inflight_batcher_llm/client/, NVIDIA/TensorRT-LLM 2a9abd9): Triton refuses a request naming an undeclared output
EXAMPLE_CLIENT_OUTPUTS = ["text_output", "cum_log_probs", "output_log_probs", "kv_cache_alloc_new_blocks",
                          "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks", "arrival_time_ns",
                          "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns", "acceptance_rate",
                          "total_accepted_draft_tokens", "total_draft_tokens"]


def test_tensorrt_llm_example_client_works_unchanged(server, oracle, raw_runtime):
    """What end_to_end_grpc_client.py sends (beam_width, temperature, exclude_input_in_output, stream; each [1, 1]) to
    its default --model-name, ensemble, with --return-log-probs --return-perf-metrics: the outputs it asks for by
    name, read as it reads them (as_numpy("text_output")[0].decode(), each metric as_numpy(name)[0][0]). Each of
    these once broke it: Triton refused the unexpected input 'exclude_input_in_output'; text_output was [1, 1], so
    [0] was an array without decode(); there was no model named ensemble (its --model-name accepts only ensemble and
    tensorrt_llm_bls); the three KV-cache metrics were not declared (Triton refused the request naming the first);
    and the metrics were [1], so [0][0] raised IndexError."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    _, tok = oracle
    prompt = "What is machine learning?"
    ids, ref = raw_runtime(prompt, 24, SamplingParams(1.0))  # temperature 1.0, the server's default seed 0
    for stream in (False, True):
        results, error = trtllm_stream(server, "ensemble", {
            "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[24]], np.int32),
            "stream": np.array([[stream]]), "beam_width": np.array([[1]], np.int32),
            "temperature": np.array([[1.0]], np.float32), "exclude_input_in_output": np.array([[False]]),
            "return_log_probs": np.array([[True]]), "return_perf_metrics": np.array([[True]])},
            outputs=EXAMPLE_CLIENT_OUTPUTS)
        assert error is None, error
        sent = [r for r in results if r.as_numpy("text_output") is not None]
        text = "".join(r.as_numpy("text_output")[0].decode("utf8") for r in sent)
        # TensorRT-LLM echoes the prompt (prompt and answer decoded together) when not streaming only
        assert text == tok.decode((ids if not stream else []) + ref, skip_special_tokens=True), (stream, text)
        metrics = [{n: r.as_numpy(n)[0][0] for n in EXAMPLE_CLIENT_OUTPUTS[3:]} for r in sent]
        assert all([m[n] for n in EXAMPLE_CLIENT_OUTPUTS[3:6]] == [1, 0, 1] for m in metrics)
        last = metrics[-1]
        drafted, accepted = last["total_draft_tokens"], last["total_accepted_draft_tokens"]
        assert drafted > 0 and 0 <= accepted <= drafted and last["acceptance_rate"] == pytest.approx(accepted / drafted)
        assert last["arrival_time_ns"] <= last["first_scheduled_time_ns"] < last["first_token_time_ns"] \
            <= last["last_token_time_ns"]
        assert sum(r.as_numpy("output_log_probs").shape[-1] for r in sent) == len(ref)
    _, error = trtllm_stream(server, "dflash", {"text_input": np.array([[prompt]], dtype=object),
                                                "max_tokens": np.array([[8]], np.int32),
                                                "beam_width": np.array([[4]], np.int32)})
    assert error is not None and "beam_width=4: is not supported: speculative decoding here runs one beam" in error
    with DFlashClient(server.grpc_url) as client:  # our client's min_tokens (trtllm-dflash client --min-tokens)
        params = GenerateParams("Write a long story about a dragon.", 8, chat=False, min_tokens=8)
        assert len(client.generate("dflash", params).token_ids) == 8


def test_a_batch_of_texts_answers_each_row_with_its_batch_index(server, oracle, raw_runtime):
    """text_input [2, 1] (a batch, as TensorRT-LLM's ensemble takes): each row's answer is its own autoregressive
    one, every response carries batch_index, the final flag comes once, last; dflash_bls (token ids without their
    lengths) refuses a batch by name."""
    _, tok = oracle
    prompts = ["What is 7 times 8?", "Name a famous physicist."]
    results, error = trtllm_stream(server, "dflash", {
        "text_input": np.array([[p] for p in prompts], dtype=object), "max_tokens": np.array([[20], [20]], np.int32),
        "stream": np.array([[True], [True]])})
    assert error is None, error
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1]
    for b, prompt in enumerate(prompts):
        mine = [r for r in results if int(r.as_numpy("batch_index")[0, 0]) == b]
        text = "".join(r.as_numpy("text_output")[0].decode("utf8") for r in mine)
        assert text == tok.decode(raw_runtime(prompt, 20)[1], skip_special_tokens=True), b
    ids = encode_prompt(tok, prompts[0], chat=True)
    _, error = trtllm_stream(server, "dflash_bls", {
        "input_ids": np.array([ids, ids], np.int32), "max_tokens": np.array([[4], [4]], np.int32),
        "stream": np.array([[True], [True]]), "temperature": np.zeros((2, 1), np.float32),
        "top_k": np.zeros((2, 1), np.int32), "top_p": np.ones((2, 1), np.float32), "seed": np.zeros((2, 1), np.uint64),
        "stop_sequences": np.array([[2, -1], [2, -1]], np.int32)})
    assert error is not None and "input_ids shape=[2, " in error and "must be one prompt per request" in error, error


@pytest.mark.parametrize("model", ["dflash", "baseline"])
def test_genai_perf_fixed_length_requests_get_exactly_their_length(server, raw_runtime, model):
    """GenAI-Perf's request with --output-tokens-mean-deterministic (min_length = max_tokens, exclude_input_in_output,
    streamed): exactly max_tokens tokens, the target's own greedy choice with its stop tokens held back until then;
    TensorRT-LLM's perf metrics and token counts on its responses, with its timing metrics (steady-clock
    nanoseconds: this machine's monotonic clock; the last token's 0 until the final response)."""
    prompt = "Write a long story about a dragon."  # raw, as GenAI-Perf sends it: SmolLM2-Instruct answers nothing
    ids, free = raw_runtime(prompt, 40)
    _, ref = raw_runtime(prompt, 40, min_new_tokens=40)
    assert len(free) < 40 and len(ref) == 40, (len(free), len(ref))
    before = time.monotonic_ns()
    results, error = trtllm_stream(server, model, {
        "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[40]], np.int32),
        "min_length": np.array([[40]], np.int32), "exclude_input_in_output": np.array([[True]]),
        "stream": np.array([[True]]), "return_perf_metrics": np.array([[True]]),
        "return_num_input_tokens": np.array([[True]]), "return_num_output_tokens": np.array([[True]])})
    assert error is None, error
    sent = [r for r in results if r.as_numpy("output_ids") is not None]
    last = sent[-1]
    assert last.as_numpy("output_ids").reshape(-1).tolist() == ref and len(sent) > 1
    # every response: its own tokens (summed, the usage Triton's OpenAI frontend reports), the prompt's, the totals
    assert sum(int(r.as_numpy("num_output_tokens")[0, 0]) for r in sent) == 40
    assert all(r.as_numpy("num_input_tokens").tolist() == [[len(ids)]] for r in sent)
    totals = [[int(r.as_numpy(n)[0, 0]) for n in ("total_draft_tokens", "total_accepted_draft_tokens")] for r in sent]
    assert all(0 <= a <= d for d, a in totals)
    assert all(d1 <= d2 and a1 <= a2 for (d1, a1), (d2, a2) in zip(totals, totals[1:]))
    drafted, accepted = totals[-1]
    assert (drafted > 0) == (model == "dflash")
    assert last.as_numpy("acceptance_rate")[0, 0] == pytest.approx(accepted / drafted if drafted else 0.0)
    after = time.monotonic_ns()
    times = [[int(r.as_numpy(f"{t}_time_ns")[0, 0]) for t in ("arrival", "first_scheduled", "first_token", "last_token")]
             for r in sent]
    assert len({tuple(t[:3]) for t in times}) == 1  # the same request on every response
    arrival, scheduled, first, final = times[-1]
    assert before <= arrival <= scheduled < first <= final <= after
    assert all(t[3] == 0 for t in times[:-1])


@pytest.mark.parametrize("stream", [True, False])
def test_triton_openai_frontends_request_gets_its_usage(server, oracle, stream):
    """The request Triton's OpenAI-compatible frontend builds for a model that is not vLLM's (chat: the template
    applied by the frontend, temperature 0.7; every sampling field it always sends; the token counts it always asks
    for) and the usage it computes: the prompt's count, and the responses' own counts summed. (The frontend itself
    runs Triton in-process and exists only in NVIDIA's containers; its request is recorded in
    tests/data/trtllm_ensemble/ensemble_io.json.)"""
    _, tok = oracle
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[3]}], tokenize=False,
                                   add_generation_prompt=True)
    results, error = trtllm_stream(server, "dflash", {
        "text_input": np.array([[text]], dtype=object), "stream": np.array([[stream]]),
        "max_tokens": np.array([[16]], np.int32), "return_num_input_tokens": np.array([[True]]),
        "return_num_output_tokens": np.array([[True]]), "top_p": np.array([[1.0]], np.float32),
        "frequency_penalty": np.array([[0.0]], np.float32), "presence_penalty": np.array([[0.0]], np.float32),
        "temperature": np.array([[0.7]], np.float32)})
    assert error is None, error
    sent = [r for r in results if r.as_numpy("output_ids") is not None]
    assert len(sent) == 1 or stream
    completion = sum(int(r.as_numpy("num_output_tokens")[0, 0]) for r in sent)
    assert completion == len(sent[-1].as_numpy("output_ids").reshape(-1)) > 0
    assert int(sent[0].as_numpy("num_input_tokens")[0, 0]) == len(tok.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("model", ["dflash", "baseline"])
def test_penalised_requests_get_the_penalised_autoregressive_answer(server, raw_runtime, model):
    """TensorRT-LLM's repetition, presence and frequency penalties (as its clients send them: FP32): the answer is
    the in-process autoregressive one with the same penalties, which differs from the unpenalised answer; the drafts
    were verified against the penalised distribution (block 8: drafts are accepted and rejected)."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    prompt = "def fibonacci(n):"
    values = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.2}
    sampling = SamplingParams(**{k: float(np.float32(v)) for k, v in values.items()})
    _, ref = raw_runtime(prompt, 48, sampling)
    _, plain = raw_runtime(prompt, 48)
    assert ref != plain
    results, error = trtllm_stream(server, model, {
        "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[48]], np.int32),
        "stream": np.array([[True]]), **{k: np.array([[v]], np.float32) for k, v in values.items()}})
    assert error is None, error
    sent = [r for r in results if r.as_numpy("output_ids") is not None]
    assert sent[-1].as_numpy("output_ids").reshape(-1).tolist() == ref
    _, error = trtllm_stream(server, model, {
        "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[8]], np.int32),
        "repetition_penalty": np.array([[0.0]], np.float32)})
    assert "repetition_penalty=0.0: must be a finite number > 0" in error


@pytest.mark.parametrize("model, stream", [("dflash", True), ("baseline", False)])  # the loop's paths are shared
def test_log_probs_are_the_autoregressive_ones(server, raw_runtime, model, stream):
    """``return_log_probs`` (TensorRT-LLM's input): every response carries ``output_log_probs`` [1, 1, its tokens]
    and ``cum_log_probs`` [1, 1] (the sum over every token so far), equal to the in-process autoregressive decoding's
    (block 8 here: the verify's slots give a one-token step's values, up to float rounding); greedy and sampled."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    prompt = "def fibonacci(n):"
    for temperature, min_tokens in ((0.0, 0), (0.8, 40)):  # min_tokens: a start with a ban too
        _, ref = raw_runtime(prompt, 40, SamplingParams(temperature, seed=5, logprobs=True), min_tokens, result=True)
        results, error = trtllm_stream(server, model, {
            "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[40]], np.int32),
            "stream": np.array([[stream]]), "temperature": np.array([[temperature]], np.float32),
            "seed": np.array([[5]], np.uint64), "min_tokens": np.array([[min_tokens]], np.int32),
            "return_log_probs": np.array([[True]])})
        assert error is None, error
        sent = [r for r in results if r.as_numpy("output_ids") is not None]
        assert sent[-1].as_numpy("output_ids").reshape(-1).tolist() == list(ref.token_ids)
        got, before = [], 0
        for r in sent:
            lp, cum = r.as_numpy("output_log_probs"), r.as_numpy("cum_log_probs")
            assert lp.dtype == np.float32 and lp.shape[:2] == (1, 1) and cum.shape == (1, 1)
            assert lp.shape[2] == r.as_numpy("output_ids").size - before  # this response's tokens
            before = r.as_numpy("output_ids").size
            got += lp.reshape(-1).tolist()
            assert float(cum[0, 0]) == pytest.approx(sum(got), abs=1e-3)
        assert got == pytest.approx(list(ref.logprobs), abs=2e-4)
        assert all(v <= 0 for v in got) and len(sent) > (1 if stream else 0)
    results, _ = trtllm_stream(server, model, {"text_input": np.array([[prompt]], dtype=object),
                                               "max_tokens": np.array([[8]], np.int32)})
    assert results[-1].as_numpy("output_log_probs") is None  # not asked: not sent


def test_the_token_level_loop_returns_log_probs_too(server, smollm2, oracle):
    """dflash_bls (the loop model over token ids) with return_log_probs: output_log_probs per response, the
    in-process autoregressive values over the same ids."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.sampling import SamplingParams

    _, tok = oracle
    prompt = "Write a haiku about the sea."
    target, _ = load_pair(smollm2["target"], smollm2["drafter"])
    want = SpeculativeDecoder(target, None, 1).generate([Request(
        tuple(encode_prompt(tok, prompt, chat=True)), 24, SamplingParams(logprobs=True), stop_token_ids=(2,))])[0]
    results, errors, done = [], [], threading.Event()

    def on_response(result, error):  # tritonclient passes both by keyword
        if error is not None:
            errors.append(error)
        else:
            results.append(result)
        if error is not None or bool(result.as_numpy("is_final")[0]):
            done.set()

    c = grpcclient.InferenceServerClient(server.grpc_url)
    c.start_stream(callback=on_response)
    flag = grpcclient.InferInput("return_log_probs", [1, 1], "BOOL")
    flag.set_data_from_numpy(np.array([[True]]))
    c.async_stream_infer("dflash_bls", [*bls_inputs(tok, prompt, 24), flag])
    assert done.wait(120), "no final response"
    c.stop_stream()
    assert not errors, errors
    assert results[-1].as_numpy("output_ids").reshape(-1).tolist() == list(want.token_ids)
    got = [v for r in results for v in r.as_numpy("output_log_probs").reshape(-1).tolist()]
    assert got == pytest.approx(list(want.logprobs), abs=2e-4)
    assert float(results[-1].as_numpy("cum_log_probs")[0, 0]) == pytest.approx(sum(want.logprobs), abs=1e-3)


def by_sequence(results) -> dict[int, list]:
    """A request's responses that carry tokens, by their ``sequence_index`` (in arrival order)."""
    out: dict[int, list] = {}
    for r in results:
        if r.as_numpy("output_ids") is not None:
            out.setdefault(int(r.as_numpy("sequence_index").reshape(-1)[0]), []).append(r)
    return out


@pytest.mark.parametrize("model, stream", [("dflash", True), ("baseline", False)])
def test_num_return_sequences_are_the_seeded_autoregressive_samples(server, raw_runtime, oracle, model, stream):
    """TensorRT-LLM's ``num_return_sequences`` n: one request, n sequences; sequence i is the in-process
    autoregressive sample with seed + i (the executor's child requests: ``randomSeed += sequenceIndex``), with its
    own log-probabilities, though the prompt is prefilled once (the others fork its K/V: ``TargetVerifier.fork``);
    every response names its ``sequence_index``; the final flag comes once, after the last sequence's last
    response. Streamed, the sequences' responses interleave (they step as rows of one batch); not streamed, each
    sequence sends one response. Greedy: n equal answers. More than --max-sequences: refused."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    _, tok = oracle
    prompt, n, seed = "def fibonacci(n):", 3, 7
    refs = [raw_runtime(prompt, 24, SamplingParams(0.9, top_k=40, seed=seed + i, logprobs=True), result=True)[1]
            for i in range(n)]
    assert len({r.token_ids for r in refs}) > 1  # different seeds, different samples
    base = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[24]], np.int32),
            "stream": np.array([[stream]]), "num_return_sequences": np.array([[n]], np.int32)}
    forked = int(step_stats(server, "target_verify").as_numpy("forked")[0, 0])
    results, error = trtllm_stream(server, model, {
        **base, "temperature": np.array([[0.9]], np.float32), "top_k": np.array([[40]], np.int32),
        "seed": np.array([[seed]], np.uint64), "return_log_probs": np.array([[True]])})
    assert error is None, error
    # the prompt was prefilled once: the other sequences forked its K/V (TargetVerifier.fork)
    assert int(step_stats(server, "target_verify").as_numpy("forked")[0, 0]) == forked + n - 1
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1]
    got = by_sequence(results)
    assert sorted(got) == list(range(n))
    for i, ref in enumerate(refs):
        assert got[i][-1].as_numpy("output_ids").reshape(-1).tolist() == list(ref.token_ids)
        text = "".join(r.as_numpy("text_output")[0].decode() for r in got[i])
        assert text == tok.decode(list(ref.token_ids), skip_special_tokens=True)
        logprobs = [v for r in got[i] for v in r.as_numpy("output_log_probs").reshape(-1).tolist()]
        assert logprobs == pytest.approx(list(ref.logprobs), abs=2e-4)
        assert len(got[i]) > 1 if stream else len(got[i]) == 1
    if stream:  # sequence 1 streamed before sequence 0 had finished: they ran together
        order = [int(r.as_numpy("sequence_index").reshape(-1)[0]) for r in results
                 if r.as_numpy("output_ids") is not None]
        assert order.index(1) < len(order) - 1 - order[::-1].index(0)
    results, error = trtllm_stream(server, model, {**base, "num_return_sequences": np.array([[2]], np.int32)})
    assert error is None, error
    greedy = by_sequence(results)
    answers = [greedy[i][-1].as_numpy("output_ids").reshape(-1).tolist() for i in (0, 1)]
    assert answers == [raw_runtime(prompt, 24)[1]] * 2
    _, error = trtllm_stream(server, model, {**base, "num_return_sequences": np.array([[13]], np.int32)})
    assert "num_return_sequences=13: must be at most --max-sequences 12" in error


def test_the_client_returns_every_sequence(server, raw_runtime):
    """``DFlashClient.generate_sequences`` and ``trtllm-dflash client --num-return-sequences``: the interleaved
    responses sorted into one completion per sequence (each the autoregressive sample with seed + i, with its
    log-probabilities); ``generate`` refuses to merge several; 0 sequences is a CLI error (exit 2) naming the flag."""
    from tests.conftest import run_cli
    from trtllm_dflash.runtime.sampling import SamplingParams

    prompt = "Name three rivers."
    refs = [raw_runtime(prompt, 16, SamplingParams(1.0, seed=3 + i, logprobs=True), result=True)[1] for i in range(2)]
    params = GenerateParams(prompt, 16, chat=False, temperature=1.0, seed=3, logprobs=True, num_return_sequences=2)
    with DFlashClient(server.grpc_url) as client:
        done = client.generate_sequences("dflash", params)
        with pytest.raises(ValueError, match="num_return_sequences=2: generate returns one sequence"):
            client.generate("dflash", params)
    assert [d.token_ids for d in done] == [list(r.token_ids) for r in refs]
    assert done[1].logprobs == pytest.approx(list(refs[1].logprobs), abs=2e-4)
    cli = run_cli(["client", "--url", server.grpc_url, "--prompt", prompt, "--raw", "--max-tokens", "16",
                   "--temperature", "1.0", "--seed", "3", "--num-return-sequences", "2", "--json"])
    assert cli.returncode == 0, cli.stderr
    assert [x["token_ids"] for x in json.loads(cli.stdout)["sequences"]] == [list(r.token_ids) for r in refs]
    bad = run_cli(["client", "--url", server.grpc_url, "--prompt", prompt, "--num-return-sequences", "0"])
    assert bad.returncode == 2 and "--num-return-sequences=0: must be at least 1" in bad.stderr


@pytest.mark.parametrize("model", ["dflash", "baseline"])
def test_bad_words_are_banned_as_tensorrt_llm_bans_them(server, raw_runtime, oracle, model):
    """TensorRT-LLM's ``bad_words`` (strings, tokenized as its preprocessing does, without special tokens): words
    taken from the plain answer change it, and the answer is the in-process autoregressive one with those token ids
    banned (one-token and multi-token words; block 8: drafts are checked against the same rule). An empty word, as
    TensorRT-LLM's examples send, bans nothing."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    _, tok = oracle
    prompt = "def fibonacci(n):"
    _, plain = raw_runtime(prompt, 40)
    # pieces of the plain answer that tokenize back to themselves: a two-token one and a one-token one
    pieces = [plain[i: i + n] for n in (2, 1) for i in range(4, 30)]
    words = [next(tok.decode(p) for p in pieces if len(p) == n and tok.encode(tok.decode(p), add_special_tokens=False)
                  == p) for n in (2, 1)]
    ids = tuple(tuple(tok.encode(w, add_special_tokens=False)) for w in words)
    _, ref = raw_runtime(prompt, 40, SamplingParams(bad_words=ids))
    assert ref != plain
    results, error = trtllm_stream(server, model, {
        "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[40]], np.int32),
        "stream": np.array([[True]]), "bad_words": np.array([[w.encode() for w in words] + [b""]], dtype=object)})
    assert error is None, error
    sent = [r for r in results if r.as_numpy("output_ids") is not None]
    assert sent[-1].as_numpy("output_ids").reshape(-1).tolist() == ref


@pytest.mark.parametrize("model", ["dflash", "baseline"])
def test_embedding_bias_is_added_as_tensorrt_llm_adds_it(server, raw_runtime, oracle, model):
    """TensorRT-LLM's ``embedding_bias_words`` / ``embedding_bias_weights`` (each word tokenized alone, its weight added
    to its tokens' logits before the penalties: ``runtime.text.encode_bias``): two tokens of the plain answer pushed
    down and one word pushed up change it, and the answer is the in-process autoregressive one with that bias
    (block 8: every verify slot adds the same bias). Counts that differ are refused naming both inputs."""
    from trtllm_dflash.runtime.sampling import SamplingParams
    from trtllm_dflash.runtime.text import encode_bias

    _, tok = oracle
    prompt = "def fibonacci(n):"
    _, plain = raw_runtime(prompt, 40)
    singles = [tok.decode([t]) for t in plain[3:30] if tok.encode(tok.decode([t])) == [t]]
    words, weights = [singles[0], singles[3], " return"], [-6.0, -6.0, 2.5]
    _, ref = raw_runtime(prompt, 40, SamplingParams(logit_bias=encode_bias(tok, zip(words, weights))))
    assert ref != plain
    base = {"text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[40]], np.int32),
            "stream": np.array([[True]]), "embedding_bias_words": np.array([[w.encode() for w in words]], dtype=object)}
    results, error = trtllm_stream(server, model, {**base, "embedding_bias_weights": np.array([weights], np.float32)})
    assert error is None, error
    sent = [r for r in results if r.as_numpy("output_ids") is not None]
    assert sent[-1].as_numpy("output_ids").reshape(-1).tolist() == ref
    with DFlashClient(server.grpc_url) as client:  # GenerateParams.embedding_bias (client --bias) sends the same
        bias = tuple(zip(words, weights))
        done = client.generate(model, GenerateParams(prompt, 40, True, False, embedding_bias=bias))
    assert list(done.token_ids) == ref
    _, error = trtllm_stream(server, model, {**base, "embedding_bias_weights": np.array([[1.0]], np.float32)})
    assert "number of embedding_bias_weights=1: must equal the number of embedding_bias_words (3)" in error
