"""The ``tensorrt_llm`` model's request parsing and responses (serve/trtllm/token_model.py), against TensorRT-LLM's recorded
token-level model (tests/data/trtllm_ensemble/tensorrt_llm_io.json); the real server runs it in
tests/serve/test_serving_token_model.py."""

import json
import re
from pathlib import Path

import numpy as np
import pytest

from trtllm_dflash.errors import DFlashError
from trtllm_dflash.serve.trtllm import token_model
from trtllm_dflash.serve.trtllm.compat import Options
from trtllm_dflash.runtime.stepper import Update
from trtllm_dflash.runtime.protocol import generate_request
from trtllm_dflash.serve.triton.render import TEMPLATES, render_text
from trtllm_dflash.serve.trtllm.token_model import TokenFrontend, word_list

FACTS = json.loads((Path(__file__).parents[1] / "data" / "trtllm_ensemble" / "tensorrt_llm_io.json").read_text())
VOCAB = 100


class Pb:
    """The two calls of triton_python_backend_utils a request parse makes."""

    class Tensor:
        def __init__(self, arr):
            self.arr = np.asarray(arr)

        def as_numpy(self):
            return self.arr

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return Pb.Tensor(request[name]) if name in request else None


def frontend(exclude: bool = False, decoupled: bool = True) -> TokenFrontend:
    front = TokenFrontend.__new__(TokenFrontend)
    front.vocab, front.max_seq_len, front.exclude_input, front.decoupled = VOCAB, 64, exclude, decoupled
    return front


def request(ids=((5, 6, 7),), lengths=None, out=8, **extra) -> dict:
    width = max(len(r) for r in ids)
    rows = np.array([list(r) + [0] * (width - len(r)) for r in ids], np.int32)
    lengths = [len(r) for r in ids] if lengths is None else lengths
    return {"input_ids": rows, "input_lengths": np.array(lengths, np.int32).reshape(-1, 1),
            "request_output_len": np.full((len(ids), 1), out, np.int32), **extra}


def parse(req, exclude=False):
    return frontend(exclude).parse(Pb, req)


def test_declared_io_is_tensorrt_llms_own():
    """Every input and output the rendered config declares has TensorRT-LLM's dtype and dims, and only its two
    required inputs are required; the client's inputs the model must take are all declared."""
    text = render_text((TEMPLATES / "tensorrt_llm" / "config.pbtxt").read_text(), {
        "name": "tensorrt_llm", "max_batch_size": 8, "loop_block_size": 8, "adaptive": "", "ngram": "off",
        "tree": "off", "datastore": "", "target_dir": "/t", "max_seq_len": 64, "max_sequences": 4, "max_queue": 4,
        "queue_timeout_s": 1, "coalesce": "on", "io_nice": 0, "decoupled": "true",
        **token_model.template_values()}, "tensorrt_llm")
    entry = re.compile(r'\{ name: "(\w+)" data_type: (\w+) dims: \[ ([-\d, ]+) \]( optional: true)? \}')
    inputs, outputs = (text.split("output [")[i] for i in (0, 1))
    declared_in = {m[0]: (m[1], [int(d) for d in m[2].split(",")], bool(m[3])) for m in entry.findall(inputs)}
    declared_out = {m[0]: (m[1], [int(d) for d in m[2].split(",")]) for m in entry.findall(outputs)}
    assert set(declared_in) == set(token_model.INPUTS) and set(declared_out) == set(token_model.OUTPUTS)
    for name, (dtype, dims, optional) in declared_in.items():
        fact = FACTS["inputs"][name]
        assert (dtype, dims, optional) == (fact["data_type"], fact["dims"], fact["optional"]), name
    for name, (dtype, dims) in declared_out.items():
        assert (dtype, dims) == (FACTS["outputs"][name]["data_type"], FACTS["outputs"][name]["dims"]), name
    client = FACTS["sources"]["example_client"]["what"]
    for name in ("input_ids", "input_lengths", "request_output_len", "beam_width", "temperature", "streaming",
                 "end_id", "pad_id", "runtime_top_k", "runtime_top_p", "stop"):
        assert name in client and name in declared_in
    assert 'string_value: "tokens"' in text and "count: 1 kind: KIND_CPU" in text


def test_words_format():
    """[2, L]: the words' ids one after another, then each word's end offset, padded with -1."""
    assert word_list(np.array([[4, 5, 6, 0], [2, 3, -1, -1]]), "stop_words_list", VOCAB) == [[4, 5], [6]]
    assert word_list(np.zeros((2, 0), np.int32), "bad_words_list", VOCAB) == []
    with pytest.raises(DFlashError, match=r"stop_words_list offsets\[1\]=2: must be an end offset in \[3, 3\]"):
        word_list(np.array([[4, 5, 6], [2, 2, -1]]), "stop_words_list", VOCAB)  # strictly increasing
    with pytest.raises(DFlashError, match=r"stop_words_list offsets=\[1, -1, 3\]: must end with -1s only"):
        word_list(np.array([[4, 5, 6], [1, -1, 3]]), "stop_words_list", VOCAB)
    with pytest.raises(DFlashError, match=r"bad_words_list token id=100: must be in \[0, 100\)"):
        word_list(np.array([[100], [1]]), "bad_words_list", VOCAB)
    with pytest.raises(DFlashError, match=r"stop_words_list shape=\[3\]"):
        word_list(np.array([1, 2, 3]), "stop_words_list", VOCAB)


def test_sampling_reads_as_the_executor_does():
    """Greedy unless top-k > 1 or top-p > 0; temperature 1 by default; top-p 0 is off; the dense embedding bias
    becomes its nonzero (id, weight) pairs; no end_id: no end token."""
    greedy = parse(request())[0].gen
    assert greedy.sampling.greedy and greedy.stop_sequences == () and not parse(request())[0].opts.exclude_input
    assert parse(request(runtime_top_k=np.array([[1]], np.int32), temperature=np.array([[0.7]], np.float32)))[
        0].gen.sampling.greedy
    s = parse(request(runtime_top_k=np.array([[5]], np.int32), seed=np.array([[9]], np.uint64)))[0].gen.sampling
    assert (s.temperature, s.top_k, s.top_p, s.seed) == (1.0, 5, 1.0, 9)
    s = parse(request(runtime_top_p=np.array([[0.5]], np.float32),
                      temperature=np.array([[0.25]], np.float32)))[0].gen.sampling
    assert (s.temperature, s.top_k, s.top_p) == (0.25, 0, 0.5)
    bias = np.zeros((1, VOCAB), np.float32)
    bias[0, [3, 50]] = [2.0, -1.5]
    assert parse(request(embedding_bias=bias))[0].gen.sampling.logit_bias == ((3, 2.0), (50, -1.5))
    assert parse(request(embedding_bias=np.zeros((1, 0), np.float32)))[0].gen.sampling.logit_bias == ()
    row = parse(request(end_id=np.array([[2]], np.int32), stop_words_list=np.array([[[7, 8], [2, -1]]], np.int32),
                        bad_words_list=np.array([[[9], [1]]], np.int32), min_tokens=np.array([[3]], np.int32)))[0]
    assert row.gen.stop_sequences == ((2,), (7, 8)) and row.gen.sampling.bad_words == ((9,),)
    assert row.gen.sampling.banned_ids == (2,) and row.opts.min_tokens == 3  # the end id waits for min_tokens
    assert parse(request(end_id=np.array([[-1]], np.int32)))[0].gen.stop_sequences == ()
    assert parse(request(runtime_top_k=np.array([[4]], np.int32), runtime_top_p=np.array([[-0.5]], np.float32)))[
        0].gen.sampling.top_p == 1.0  # a top-p <= 0 is dropped: plain top-k


def test_the_unary_model_takes_what_one_response_can_carry():
    """Rendered --tensorrt-llm-unary (TensorRT-LLM's decoupled_mode false): one row, not streamed, one sequence."""
    unary = frontend(decoupled=False)
    assert unary.parse(Pb, request())[0].gen.max_tokens == 8
    for change, message in (({"streaming": np.array([[True]])}, "streaming=True: needs the decoupled"),
                            ({"num_return_sequences": np.array([[2]], np.int32)}, "num_return_sequences=2: must be 1"),
                            (request(ids=((5, 6), (7, 8))), "batch size=2: must be 1 on the unary")):
        with pytest.raises(DFlashError, match=re.escape(message)):
            unary.parse(Pb, {**request(), **change})


def test_an_answer_past_the_context_limit_is_shortened():
    """As TensorRT-LLM's executor: input + request_output_len > the limit lowers the answer's length (and
    min_tokens with it), no error."""
    row = parse(request(out=62, min_tokens=np.array([[62]], np.int32)))[0]
    assert (row.gen.max_tokens, row.opts.min_tokens) == (61, 61)


def test_a_batch_is_one_row_per_prompt():
    rows = parse(request(ids=((5, 6, 7), (8, 9)), lengths=[3, 2], streaming=np.array([[True], [False]]),
                         exclude_input_in_output=np.array([[False], [True]])))
    assert [(r.index, r.gen.input_ids, r.gen.stream, r.opts.exclude_input) for r in rows] == [
        (0, (5, 6, 7), True, False), (1, (8, 9), False, True)]
    assert parse(request(), exclude=True)[0].opts.exclude_input  # the model's parameter is the default


@pytest.mark.parametrize("change, message", [
    ({"request_output_len": np.array([[0]], np.int32)}, "request_output_len=0: must be >= 1"),
    ({"input_ids": np.array([list(range(64))], np.int32), "input_lengths": np.array([[64]], np.int32)},
     "input_lengths=64: leaves no room in the context limit (64 tokens)"),
    ({"input_lengths": np.array([[4]], np.int32)}, r"input_lengths=4: must be in [1, 3]"),
    ({"input_ids": np.array([[5, 600, 7]], np.int32)}, "input_ids=[600]: must be token ids in [0, 100)"),
    ({"runtime_top_p": np.array([[1.5]], np.float32)}, "runtime_top_p=1.5: must be at most 1"),
    ({"runtime_top_k": np.array([[-2]], np.int32)}, "runtime_top_k=-2: must be >= 0"),
    ({"temperature": np.array([[-1]], np.float32)}, "temperature=-1.0: must be finite and >= 0"),
    ({"end_id": np.array([[100]], np.int32)}, "end_id=100: must be a token id in [0, 100) or -1"),
    ({"embedding_bias": np.zeros((1, 7), np.float32)}, "embedding_bias length=7: must be the vocabulary size (100)"),
    ({"beam_width": np.array([[2]], np.int32)}, "beam_width=2: is not supported"),
    ({"return_generation_logits": np.array([[True]])}, "return_generation_logits=True: is not supported"),
    ({"min_tokens": np.array([[9]], np.int32)}, "min_tokens=9: must be in [0, max_tokens=8]"),
    ({"temperature": np.array([[1.0], [1.0]], np.float32)}, "temperature shape=[2, 1]: must have the request's "
                                                             "batch of 1 rows first"),
])
def test_bad_requests_are_named(change, message):
    req = {**request(), **change}
    with pytest.raises(DFlashError, match=re.escape(message)):
        parse(req)
    with pytest.raises(DFlashError, match="input_ids=None: is required"):
        parse({k: v for k, v in request().items() if k != "input_ids"})


def test_responses_carry_what_the_backend_sends():
    """Streamed: the new tokens only; not streamed: prompt + answer (the answer alone when the input is excluded),
    num_output_tokens counting what the response carries; the perf metrics [1, 1]."""
    gen = generate_request((5, 6, 7), 8, parse(request())[0].gen.sampling, (), stream=True)
    opts = Options(exclude_input=False, perf_metrics=True, num_output_tokens=True, num_input_tokens=True)
    row = token_model.Row(gen, opts, 0)
    out = dict(frontend().outputs(row, Update([1, 2, 3], 1, [], 4, 2, False), 4, 2, (1, 2, 3, 0), []))
    assert out["output_ids"].tolist() == [[[2, 3]]] and out["sequence_length"].tolist() == [[2]]
    assert out["num_output_tokens"].tolist() == [[2]] and out["num_input_tokens"].tolist() == [[3]]
    assert out["acceptance_rate"].tolist() == [[0.5]] and out["last_token_time_ns"].tolist() == [[0]]
    assert all(out[m].shape == (1, 1) for m in token_model.PERF_METRICS)
    final = dict(frontend().outputs(row, Update([1, 2, 3], 3, [], 0, 0, True), 4, 2, (1, 2, 3, 4), []))
    assert final["output_ids"].shape == (1, 1, 0) and final["sequence_length"].tolist() == [[0]]
    whole = token_model.Row(generate_request((5, 6, 7), 8, gen.sampling, (), stream=False), opts, 0)
    out = dict(frontend().outputs(whole, Update([1, 2], 0, [], 0, 0, True), 0, 0, (1, 2, 3, 4),
                                  [("batch_index", np.array([[1]], np.int32))]))
    assert out["output_ids"].tolist() == [[[5, 6, 7, 1, 2]]] and out["num_output_tokens"].tolist() == [[5]]
    assert out["batch_index"].tolist() == [[1]]
    excluded = token_model.Row(whole.gen, Options(exclude_input=True), 0)
    out = dict(frontend().outputs(excluded, Update([1, 2], 0, [], 0, 0, True), 0, 0, (1, 2, 3, 4), []))
    assert out["output_ids"].tolist() == [[[1, 2]]] and set(out) == {"output_ids", "sequence_length"}


def test_row_views_read_one_row_of_a_batch_as_a_request_of_its_own():
    """The entry models' batches: each row's inputs as a one-row request (serve.triton.io.RowView)."""
    from trtllm_dflash.serve.triton.io import row_views, scalar

    req = {"text_input": np.array([[b"a"], [b"b"]], dtype=object), "max_tokens": np.array([[3], [5]], np.int32),
           "temperature": np.array([[0.5]], np.float32)}
    views = row_views(Pb, req, "text_input")
    assert [scalar(v, req, "max_tokens", None, int) for v in views] == [3, 5]
    assert views[1].get_input_tensor_by_name(req, "text_input").as_numpy().tolist() == [[b"b"]]
    assert views[0].get_input_tensor_by_name(req, "seed") is None and views[0].Tensor is Pb.Tensor
    with pytest.raises(DFlashError, match=r"temperature shape=\[1, 1\]: must have the request's batch of 2 rows"):
        scalar(views[0], req, "temperature")
    assert row_views(Pb, {"text_input": np.array([[b"a"]], dtype=object)}, "text_input") == [Pb]
