"""TensorRT-LLM's token-level model, ``tensorrt_llm`` (serve/trtllm/token_model.py), on a real Triton server with the real
SmolLM2 pair: requests as TensorRT-LLM's ``inflight_batcher_llm_client.py`` sends them get the autoregressive answer
in the shapes its backend answers with; batches, stop requests, perf metrics and bad input; and TensorRT-LLM's tokenizer
models around it (preprocessing, postprocessing), called step by step and as a Triton ensemble wired as its own."""

import threading

import numpy as np
import pytest

from conftest import grpc_inputs, trtllm_stream
from trtllm_dflash.runtime.text import encode_prompt
from trtllm_dflash.serve.triton.render import RepoConfig, make_repo
from trtllm_dflash.serve.triton.server import TritonServer

pytestmark = pytest.mark.slow
grpcclient = pytest.importorskip("tritonclient.grpc")


@pytest.fixture(scope="module")
def server(smollm2, tmp_path_factory):
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=512,
                                max_sequences=8, idle_timeout_s=60), tmp_path_factory.mktemp("repo") / "repo")
    with TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


@pytest.fixture(scope="module")
def reference(smollm2):
    """``run(prompt ids, max_tokens, sampling, stops)``: the in-process autoregressive answer (GenerationResult)."""
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.sampling import SamplingParams

    target, _ = load_pair(smollm2["target"], smollm2["drafter"])
    done: dict = {}  # seeded decoding is a function of its arguments: a repeated reference is the first one

    def run(ids, max_tokens, sampling=SamplingParams(), stops=()):
        key = (tuple(ids), max_tokens, sampling, tuple(stops))
        if key not in done:
            done[key] = SpeculativeDecoder(target, None, 1).generate(
                [Request(tuple(ids), max_tokens, sampling, stop_token_ids=tuple(stops))])[0]
        return done[key]

    return run


@pytest.fixture(scope="module")
def tok(smollm2):
    from trtllm_dflash.runtime.text import load_tokenizer

    return load_tokenizer(smollm2["target"])


def client_inputs(ids, max_tokens, end_id, streaming, **extra) -> dict:
    """What the example client always sends (its defaults: beam 1, temperature 1, top-k 1, top-p 0)."""
    return {"input_ids": np.array([ids], np.int32), "input_lengths": np.array([[len(ids)]], np.int32),
            "request_output_len": np.array([[max_tokens]], np.int32), "beam_width": np.array([[1]], np.int32),
            "temperature": np.array([[1.0]], np.float32), "streaming": np.array([[streaming]]),
            "end_id": np.array([[end_id]], np.int32), "pad_id": np.array([[end_id]], np.int32),
            "runtime_top_k": np.array([[1]], np.int32), "runtime_top_p": np.array([[0.0]], np.float32), **extra}


def tokens_of(results) -> tuple[list[int], list[int]]:
    """(every response's output_ids beam 0 cut to its sequence_length, concatenated; each response's length)"""
    out, lengths = [], []
    for r in results:
        ids, n = r.as_numpy("output_ids"), r.as_numpy("sequence_length")
        assert ids.shape[:2] == (1, 1) and n.shape == (1, 1), (ids.shape, n.shape)
        out += ids[0, 0, :n[0, 0]].tolist()
        lengths.append(int(n[0, 0]))
    return out, lengths


def test_the_example_clients_requests_get_the_autoregressive_answer(server, reference, tok):
    """Greedy (top-k 1), with the tokenizer's end id: streamed, the answer in pieces without the prompt; not
    streamed, one response with the prompt and the answer (the answer alone with exclude_input_in_output); the perf
    metrics on every response, [1, 1]."""
    ids = encode_prompt(tok, "What is the capital of France?", chat=True)
    ref = reference(ids, 48, stops=[tok.eos_token_id])
    assert ref.finish_reason == "stop", "the reference should end at the end id"
    results, error = trtllm_stream(server, "tensorrt_llm", client_inputs(
        ids, 48, tok.eos_token_id, True, return_perf_metrics=np.array([[True]]),
        return_num_output_tokens=np.array([[True]])))
    assert error is None, error
    got, lengths = tokens_of(results)
    assert got == list(ref.token_ids) and len(results) > 1
    assert [int(r.as_numpy("num_output_tokens")[0, 0]) for r in results] == lengths
    for r in results:
        assert r.as_numpy("arrival_time_ns").shape == (1, 1) and r.as_numpy("acceptance_rate").shape == (1, 1)
        assert r.as_numpy("kv_cache_alloc_total_blocks").tolist() == [[1]]
    drafted = int(results[-1].as_numpy("total_draft_tokens")[0, 0])
    assert drafted > 0 and 0 <= results[-1].as_numpy("acceptance_rate")[0, 0] <= 1
    for exclude in (False, True):
        results, error = trtllm_stream(server, "tensorrt_llm", client_inputs(
            ids, 48, tok.eos_token_id, False, exclude_input_in_output=np.array([[exclude]])))
        assert error is None and len(results) == 1, error
        assert tokens_of(results)[0] == ([] if exclude else list(ids)) + list(ref.token_ids)


def test_sampling_without_end_id_is_the_seeded_sample_to_the_length(server, reference, tok):
    """top-p 0.9 at temperature 0.8 with seed 11: the autoregressive sample with that seed; no end_id, so the answer
    runs to request_output_len (TensorRT-LLM ends at an end token only when one is sent), log-probs included."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    ids = encode_prompt(tok, "Write a haiku about rain.", chat=True)
    ref = reference(ids, 40, SamplingParams(0.8, top_p=0.9, seed=11, logprobs=True))
    inputs = client_inputs(ids, 40, 0, True, temperature=np.array([[0.8]], np.float32),
                           runtime_top_k=np.array([[0]], np.int32), runtime_top_p=np.array([[0.9]], np.float32),
                           seed=np.array([[11]], np.uint64), return_log_probs=np.array([[True]]))
    del inputs["end_id"]
    results, error = trtllm_stream(server, "tensorrt_llm", inputs)
    assert error is None, error
    got, _ = tokens_of(results)
    assert got == list(ref.token_ids) and len(got) == 40
    logprobs = np.concatenate([r.as_numpy("output_log_probs")[0, 0] for r in results])
    np.testing.assert_allclose(logprobs, ref.logprobs, rtol=1e-4, atol=1e-4)


def test_a_batch_answers_each_row_with_its_batch_index(server, reference, tok):
    """Two prompts of different lengths in one request (input_ids padded, input_lengths per row): each row's
    answer is its own; responses carry batch_index; the final flag comes once, last."""
    rows = [encode_prompt(tok, p, chat=True) for p in ("Name a prime number.", "Say hello in Spanish, please.")]
    width = max(map(len, rows))
    inputs = {k: np.repeat(v, 2, axis=0) for k, v in client_inputs(rows[0], 24, tok.eos_token_id, True).items()}
    inputs["input_ids"] = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    inputs["input_lengths"] = np.array([[len(r)] for r in rows], np.int32)
    results, error = trtllm_stream(server, "tensorrt_llm", inputs)
    assert error is None, error
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals.count(True) == 1 and finals[-1]
    for b, ids in enumerate(rows):
        mine = [r for r in results if int(r.as_numpy("batch_index")[0, 0]) == b]
        assert tokens_of(mine)[0] == list(reference(ids, 24, stops=[tok.eos_token_id]).token_ids), b


@pytest.mark.parametrize("streaming", [True, False])
def test_a_stop_request_ends_the_request_with_its_id(server, tok, streaming):
    """The example client's stop request (same request id, stop true, empty lengths): the long request ends early
    with a final response of its tokens so far (streamed: the last piece; not streamed: prompt + answer so far), as
    TensorRT-LLM's executor returns a cancelled request's result; the stop request gets one empty final response; no
    sequence is left held; a stop request without an id is refused by name."""
    import time

    from test_serving_server import active_states

    ids = encode_prompt(tok, "Write a long story about a dragon.", chat=True)
    first, done, results = threading.Event(), threading.Event(), []

    def on_response(result, error):
        assert error is None, error
        results.append(result)
        first.set()
        if result.get_response().parameters["triton_final_response"].bool_param:
            done.set()

    long = grpcclient.InferenceServerClient(server.grpc_url)
    long.start_stream(callback=on_response)
    long.async_stream_infer("tensorrt_llm", grpc_inputs(client_inputs(ids, 400, 0, streaming)), request_id="story-1")  # as the example client: no empty finals
    if streaming:
        assert first.wait(120)
    else:
        time.sleep(3)
    stop = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
            "request_output_len": np.zeros((1, 1), np.int32), "stop": np.array([[True]])}
    answer, error = trtllm_stream(server, "tensorrt_llm", stop, request_id="story-1")
    assert error is None and len(answer) == 1 and answer[0].as_numpy("output_ids") is None, error
    assert done.wait(60), "the stopped request should end with a final response"
    long.stop_stream()
    got, _ = tokens_of(results)
    if not streaming:
        assert len(results) == 1 and got[:len(ids)] == ids
        got = got[len(ids):]
    assert 0 < len(got) < 400
    assert active_states(server) == (0, 0)
    _, error = trtllm_stream(server, "tensorrt_llm", stop)
    assert error is not None and "stop=True: needs the request id of the request to stop" in error


@pytest.mark.parametrize("change, message", [
    ({"input_lengths": np.array([[99]], np.int32)}, "input_lengths=99: must be in [1, "),
    ({"runtime_top_p": np.array([[2.0]], np.float32)}, "runtime_top_p=2.0: must be at most 1"),
    ({"beam_width": np.array([[2]], np.int32)}, "beam_width=2: is not supported"),
    ({"stop_words_list": np.array([[[5, 6], [3, -1]]], np.int32)}, "stop_words_list offsets[0]=3: must be an end "
                                                                   "offset in [0, 2]"),
    ({"input_lengths": np.array([[512]], np.int32), "input_ids": np.ones((1, 512), np.int32)},
     "input_lengths=512: leaves no room in the context limit (512 tokens)"),
])
def test_bad_requests_get_named_errors(server, tok, change, message):
    ids = encode_prompt(tok, "Hi", chat=False)
    _, error = trtllm_stream(server, "tensorrt_llm", {**client_inputs(ids, 4, tok.eos_token_id, True), **change})
    assert error is not None and message in error, error
    results, error = trtllm_stream(server, "tensorrt_llm", client_inputs(ids, 4, tok.eos_token_id, True))
    assert error is None and results  # the server keeps serving


def test_return_sequences_are_the_seeded_samples(server, reference, tok):
    """num_return_sequences 2, sampled: sequence i is the autoregressive sample with seed + i, labelled
    sequence_index i (TensorRT-LLM's child requests)."""
    from trtllm_dflash.runtime.sampling import SamplingParams

    ids = encode_prompt(tok, "Tell me a fun fact.", chat=True)
    results, error = trtllm_stream(server, "tensorrt_llm", client_inputs(
        ids, 16, tok.eos_token_id, False, runtime_top_k=np.array([[0]], np.int32),
        runtime_top_p=np.array([[0.95]], np.float32), seed=np.array([[5]], np.uint64),
        num_return_sequences=np.array([[2]], np.int32), exclude_input_in_output=np.array([[True]])))
    assert error is None and len(results) == 2, error
    for r in results:
        i = int(r.as_numpy("sequence_index")[0, 0])
        ref = reference(ids, 16, SamplingParams(1.0, top_p=0.95, seed=5 + i), stops=[tok.eos_token_id])
        assert tokens_of([r])[0] == list(ref.token_ids), i


def test_perf_analyzer_drives_it_with_token_input_data(server, reference, tok, tmp_path):
    """perf_analyzer, as TensorRT-LLM's docs run it against tensorrt_llm (--input-data of input_ids, input_lengths,
    request_output_len; streaming): every request completes and its streamed output_ids are the autoregressive
    answer of the ids it sent (the profile export records both)."""
    import json
    import subprocess

    from conftest import install_perf_analyzer

    exe = install_perf_analyzer()
    data = []
    for prompt in ("Write a function that reverses a string.", "Name three colors."):
        ids = encode_prompt(tok, prompt, chat=True)
        data.append({"input_ids": {"content": ids, "shape": [len(ids)]}, "input_lengths": [len(ids)],
                     "request_output_len": [24], "end_id": [tok.eos_token_id], "streaming": [True]})
    (tmp_path / "input.json").write_text(json.dumps({"data": data}))
    done = subprocess.run([exe, "-m", "tensorrt_llm", "-i", "grpc", "--streaming", "-u", server.grpc_url,
                           "--input-data", str(tmp_path / "input.json"), "--concurrency-range", "2:2",
                           "--measurement-mode", "count_windows", "--measurement-request-count", "4",
                           "--request-count", "4", "--max-trials", "1",
                           "--profile-export-file", str(tmp_path / "profile.json")],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (experiment,) = json.loads((tmp_path / "profile.json").read_text())["experiments"]
    assert len(experiment["requests"]) == 4
    for request in experiment["requests"]:
        ids = request["request_inputs"]["input_ids"]
        got = []
        for out in request["response_outputs"]:  # a one-token response is written as a scalar, none as ''
            value = out["output_ids"]
            got += value if isinstance(value, list) else [] if value == "" else [value]
        assert got == list(reference(ids, 24, stops=[tok.eos_token_id]).token_ids)


@pytest.fixture(scope="module")
def unary_server(smollm2, tmp_path_factory):
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=512, max_sequences=8,
                                tensorrt_llm_decoupled=False), tmp_path_factory.mktemp("unary") / "repo")
    with TritonServer(repo, log_path=tmp_path_factory.mktemp("log") / "server.log") as s:
        yield s


def test_the_unary_model_answers_modelinfer_as_the_example_client_calls_it(unary_server, reference, tok):
    """Rendered --tensorrt-llm-unary: the example client's default path (unary async_infer with its 'Streaming'
    parameter) gets one response with the prompt and the autoregressive answer; three concurrent requests each get
    their own; its stop request (unary too, same request id) ends a long one early with its tokens so far; streaming is
    refused by name with INVALID_ARGUMENT."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from tritonclient.utils import InferenceServerException

    def infer(prompt, streaming=False, max_tokens=24, request_id=""):
        ids = encode_prompt(tok, prompt, chat=True)
        c = grpcclient.InferenceServerClient(unary_server.grpc_url)
        return ids, c.infer("tensorrt_llm", grpc_inputs(client_inputs(ids, max_tokens, tok.eos_token_id, streaming)),
                            parameters={"Streaming": streaming}, request_id=request_id)

    prompts = ["Name a prime number.", "What is the capital of Spain?", "Say hello in French."]
    with ThreadPoolExecutor(3) as pool:
        answers = list(pool.map(infer, prompts))
    for ids, result in answers:
        ref = reference(ids, 24, stops=[tok.eos_token_id])
        assert tokens_of([result])[0] == list(ids) + list(ref.token_ids)
    with ThreadPoolExecutor(1) as pool:
        story = pool.submit(infer, "Write a long story about a dragon.", False, 400, "story-2")
        time.sleep(3)
        stop = {"input_ids": np.zeros((1, 1), np.int32), "input_lengths": np.zeros((1, 1), np.int32),
                "request_output_len": np.zeros((1, 1), np.int32), "stop": np.array([[True]])}
        c = grpcclient.InferenceServerClient(unary_server.grpc_url)
        assert c.infer("tensorrt_llm", grpc_inputs(stop), request_id="story-2").as_numpy("output_ids") is None
        ids, result = story.result(timeout=60)
    got = tokens_of([result])[0]
    assert got[:len(ids)] == ids and 0 < len(got) - len(ids) < 400
    with pytest.raises(InferenceServerException, match=r"streaming=True: needs the decoupled tensorrt_llm model") as e:
        infer(prompts[0], streaming=True)
    assert "INVALID_ARG" in str(e.value.status())


# TensorRT-LLM's ensemble wiring (triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt): preprocessing's
# outputs and the ensemble tensor each becomes, the preprocessing output each tensorrt_llm input takes, the
# tensorrt_llm output each postprocessing input takes (through an ensemble tensor named "_" + that input)
WIRING = {
    "preprocessing": {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                      "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "BAD_WORDS_IDS": "_BAD_WORDS_IDS",
                      "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
                      "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"},
    "tensorrt_llm": {"input_ids": "INPUT_ID", "input_lengths": "REQUEST_INPUT_LEN",
                     "request_output_len": "REQUEST_OUTPUT_LEN", "bad_words_list": "BAD_WORDS_IDS",
                     "stop_words_list": "STOP_WORDS_IDS", "embedding_bias": "EMBEDDING_BIAS", "end_id": "OUT_END_ID",
                     "pad_id": "OUT_PAD_ID"},
    "postprocessing": {"TOKENS_BATCH": "output_ids", "SEQUENCE_LENGTH": "sequence_length"},
}


def test_tensorrt_llms_own_pipeline_runs_over_preprocessing_tensorrt_llm_and_postprocessing(server, reference, tok):
    """TensorRT-LLM's ensemble, step by step as its config wires them (and its speculative-decoding example client
    calls them): preprocessing's QUERY -> INPUT_ID and the rest into tensorrt_llm, its output_ids and
    sequence_length into postprocessing's TOKENS_BATCH and SEQUENCE_LENGTH -> OUTPUT, the prompt and the
    autoregressive answer to the tokenizer's end id (empty bad and stop words, as its examples send them)."""
    c = grpcclient.InferenceServerClient(server.grpc_url)

    def unary(model, inputs, names):
        result = c.infer(model, grpc_inputs(inputs))
        return {n: result.as_numpy(n) for n in names}

    prompt = "def fibonacci(n):"
    pre = unary("preprocessing", {"QUERY": np.array([[prompt.encode()]], dtype=object),
                                  "REQUEST_OUTPUT_LEN": np.array([[24]], np.int32),
                                  "BAD_WORDS_DICT": np.array([[b""]], dtype=object),
                                  "STOP_WORDS_DICT": np.array([[b""]], dtype=object)},
                list(WIRING["preprocessing"]))
    ids = tok.encode(prompt)  # add_special_tokens true, TensorRT-LLM's default
    assert pre["INPUT_ID"].tolist() == [ids] and pre["REQUEST_INPUT_LEN"].tolist() == [[len(ids)]]
    assert pre["OUT_END_ID"].tolist() == [[tok.eos_token_id]] and pre["BAD_WORDS_IDS"].tolist() == [[[0], [-1]]]
    results, error = trtllm_stream(server, "tensorrt_llm", {
        **{llm: pre[out] for llm, out in WIRING["tensorrt_llm"].items()}, "streaming": np.array([[False]])})
    assert error is None, error
    out = [r for r in results if r.as_numpy("output_ids") is not None][-1]
    ref = reference(ids, 24, stops=[tok.eos_token_id])
    assert out.as_numpy("output_ids")[0, 0].tolist() == ids + list(ref.token_ids)  # not excluded: the prompt first
    text = unary("postprocessing", {post: out.as_numpy(llm) for post, llm in WIRING["postprocessing"].items()},
                 ["OUTPUT"])["OUTPUT"]
    assert text.tolist() == [tok.decode(ids + list(ref.token_ids), skip_special_tokens=True).encode()]
    with pytest.raises(Exception) as exc:  # bad input: INVALID_ARGUMENT naming the field, as every model here
        unary("preprocessing", {"QUERY": np.array([[b"hi"]], dtype=object), "REQUEST_OUTPUT_LEN": np.array([[4]], np.int32),
                                "EMBEDDING_BIAS_WORDS": np.array([[b" a", b" b"]], dtype=object),
                                "EMBEDDING_BIAS_WEIGHTS": np.array([[1.0]], np.float32)}, ["INPUT_ID"])
    assert "INVALID_ARGUMENT" in str(exc.value.status()) and "EMBEDDING_BIAS_WEIGHTS[0] count=1" in str(exc.value)


def maps(kind: str, pairs) -> str:
    return "\n".join(f'      {kind}_map {{ key: "{k}" value: "{v}" }}' for k, v in pairs)


# A Triton ensemble over preprocessing -> tensorrt_llm -> postprocessing, wired with TensorRT-LLM's own tensor names
# (WIRING), as users write their own: Triton checks every connection's dtype and dims when it loads it
PIPELINE = f"""name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [
  {{ name: "text_input" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "max_tokens" data_type: TYPE_INT32 dims: [ 1 ] }},
  {{ name: "bad_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }},
  {{ name: "stop_words" data_type: TYPE_STRING dims: [ -1 ] optional: true }},
  {{ name: "end_id" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "top_k" data_type: TYPE_INT32 dims: [ 1 ] optional: true }},
  {{ name: "stream" data_type: TYPE_BOOL dims: [ 1 ] optional: true }}
]
output [ {{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }} ]
ensemble_scheduling {{
  step [
    {{ model_name: "preprocessing" model_version: -1
{maps("input", [("QUERY", "text_input"), ("REQUEST_OUTPUT_LEN", "max_tokens"), ("BAD_WORDS_DICT", "bad_words"),
                ("STOP_WORDS_DICT", "stop_words"), ("END_ID", "end_id")])}
{maps("output", WIRING["preprocessing"].items())} }},
    {{ model_name: "tensorrt_llm" model_version: -1
{maps("input", [(llm, WIRING["preprocessing"][out]) for llm, out in WIRING["tensorrt_llm"].items()])}
{maps("input", [("runtime_top_k", "top_k"), ("streaming", "stream")])}
{maps("output", [(llm, "_" + post) for post, llm in WIRING["postprocessing"].items()])} }},
    {{ model_name: "postprocessing" model_version: -1
{maps("input", [(post, "_" + post) for post in WIRING["postprocessing"]])}
      output_map {{ key: "OUTPUT" value: "text_output" }} }}
  ]
}}
"""


def test_a_triton_ensemble_wired_as_tensorrt_llms_runs_over_these_models(smollm2, reference, tok, tmp_path):
    """TensorRT-LLM's wiring as a real Triton ensemble of its own (Triton validates each connection's dtype and dims
    at load): streamed, each response's text is its new tokens decoded, and they add up to the answer; not streamed,
    the prompt and the answer; both the autoregressive answer to the tokenizer's end id."""
    repo = make_repo(RepoConfig(smollm2["target"], smollm2["drafter"], block_size=8, max_seq_len=256, max_sequences=2,
                                trtllm_names=False), tmp_path / "repo")
    (repo / "pipeline" / "1").mkdir(parents=True)
    (repo / "pipeline" / "config.pbtxt").write_text(PIPELINE)
    prompt = "def fibonacci(n):"
    ids = tok.encode(prompt)
    ref = list(reference(ids, 24, stops=[tok.eos_token_id]).token_ids)
    with TritonServer(repo, log_path=tmp_path / "server.log") as s:
        for stream in (False, True):
            results, error = trtllm_stream(s, "pipeline", {
                "text_input": np.array([[prompt]], dtype=object), "max_tokens": np.array([[24]], np.int32),
                "bad_words": np.array([[""]], dtype=object), "stop_words": np.array([[""]], dtype=object),
                "top_k": np.array([[1]], np.int32), "stream": np.array([[stream]])})
            assert error is None, error
            texts = [r.as_numpy("text_output")[0].decode() for r in results if r.as_numpy("text_output") is not None]
            want = tok.decode(ref if stream else ids + ref, skip_special_tokens=True)
            assert "".join(texts) == want and (len(texts) > 1) == stream, (stream, texts)
