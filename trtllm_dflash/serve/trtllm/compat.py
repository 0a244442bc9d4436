"""What clients written for TensorRT-LLM's Triton ``ensemble`` send, accepted by the entry models.

Those clients send more than ``text_input`` and ``max_tokens``: TensorRT-LLM's ``end_to_end_grpc_client.py`` always
sends ``beam_width``, ``temperature`` and ``exclude_input_in_output``; GenAI-Perf 0.0.16 (``--backend tensorrtllm``)
always sends ``exclude_input_in_output: true`` and, with ``--output-tokens-mean-deterministic``, ``min_length``
(``genai_perf/inputs/converters/tensorrtllm_converter.py``). Triton refuses an input a model does not declare, and
perf_analyzer refuses it on the client side, so without these declarations both fail against ``dflash`` before
generating a token; and both read ``text_output`` as ``as_numpy("text_output")[0].decode()``, which needs a 1-D tensor.

The entry models (and the trtllm-pytorch bridge) declare the ensemble's text-level inputs below with its names, dtypes
and dims (``triton_backend/all_models/inflight_batcher_llm/ensemble/config.pbtxt``; ``design/trtllm_triton.md`` §4.3)
and ``min_length`` (TensorRT-LLM's name for ``min_tokens`` before 2025-05, still GenAI-Perf's). They honour what this
server can do exactly (the penalties, read with the other sampling inputs: ``handlers.sampling_from``; the
log-probabilities, the bad words and ``num_return_sequences``: ``bls.LoopModel``; the embedding bias:
``runtime.sampling.add_bias``; batches of texts, each row a request of its own with ``batch_index`` on its
responses) and accept only the neutral value of what it does not do, refusing any other by name. The ensemble's
prompt-table, LoRA, guided-decoding and multimodal inputs are not declared: Triton refuses them naming the input.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from trtllm_dflash.errors import require

# name: (Triton dtype, dims); all optional, all [1] but bad_words and embedding_bias_words (strings, tokenized:
# ``handlers.Preprocessor``) and their embedding_bias_weights
INPUTS = {
    "num_return_sequences": ("TYPE_INT32", 1), "bad_words": ("TYPE_STRING", -1),
    "exclude_input_in_output": ("TYPE_BOOL", 1), "pad_id": ("TYPE_INT32", 1), "min_tokens": ("TYPE_INT32", 1),
    "min_length": ("TYPE_INT32", 1), "beam_width": ("TYPE_INT32", 1), "length_penalty": ("TYPE_FP32", 1),
    "repetition_penalty": ("TYPE_FP32", 1), "presence_penalty": ("TYPE_FP32", 1),
    "frequency_penalty": ("TYPE_FP32", 1), "return_log_probs": ("TYPE_BOOL", 1),
    "return_context_logits": ("TYPE_BOOL", 1), "return_generation_logits": ("TYPE_BOOL", 1),
    "return_perf_metrics": ("TYPE_BOOL", 1), "return_num_input_tokens": ("TYPE_BOOL", 1),
    "return_num_output_tokens": ("TYPE_BOOL", 1),
    "embedding_bias_words": ("TYPE_STRING", -1), "embedding_bias_weights": ("TYPE_FP32", -1),
}
# return_perf_metrics' KV-cache counters: there is no paged KV cache here, a sequence holds one contiguous cache slot
# of max_seq_len tokens from its start, so they report that one block (allocated 1, reused 0, total 1)
KV_CACHE_METRICS = {"kv_cache_alloc_new_blocks": 1, "kv_cache_reused_blocks": 0, "kv_cache_alloc_total_blocks": 1}
# name: (Triton dtype, dims), sent on every response when asked for (return_perf_metrics: the KV-cache, timing and
# speculative-decoding ones; return_log_probs: the log-probabilities, [beam, tokens] and [beam] as the tensorrt_llm
# model declares them)
OUTPUTS = {**{m: ("TYPE_INT32", "1") for m in KV_CACHE_METRICS},
           "acceptance_rate": ("TYPE_FP32", "1"), "total_accepted_draft_tokens": ("TYPE_INT32", "1"),
           "total_draft_tokens": ("TYPE_INT32", "1"), "num_input_tokens": ("TYPE_INT32", "1"),
           "num_output_tokens": ("TYPE_INT32", "1"), "output_log_probs": ("TYPE_FP32", "-1, -1"),
           "cum_log_probs": ("TYPE_FP32", "-1"), "sequence_index": ("TYPE_INT32", "1"),
           "batch_index": ("TYPE_INT32", "1"),
           **{f"{t}_time_ns": ("TYPE_INT64", "1") for t in ("arrival", "first_scheduled", "first_token", "last_token")}}

# inputs accepted at one value only: (neutral value, what this server does instead)
NEUTRAL = {
    "beam_width": (1, "speculative decoding here runs one beam"),
    "return_context_logits": (False, "logits are not returned"),
    "return_generation_logits": (False, "logits are not returned"),
}


def template_values() -> dict[str, str]:
    """The config.pbtxt lines of ``INPUTS`` and ``OUTPUTS`` (each entry ends with a comma: the templates put them
    before their last entry) and, for an ensemble, their maps to its step."""
    def entry(name: str, dtype: str, dims, optional: str = "") -> str:
        return f'  {{ name: "{name}" data_type: {dtype} dims: [ {dims} ]{optional} }},'

    def maps(kind: str, names) -> str:
        return "\n".join(f'      {kind}_map {{ key: "{n}" value: "{n}" }}' for n in names)

    return {"trtllm_inputs": "\n".join(entry(n, t, d, " optional: true") for n, (t, d) in INPUTS.items()),
            "trtllm_outputs": "\n".join(entry(n, t, d) for n, (t, d) in OUTPUTS.items()),
            "trtllm_input_map": maps("input", INPUTS), "trtllm_output_map": maps("output", OUTPUTS)}


@dataclass(frozen=True, slots=True)
class Options:
    """What a request asks beyond its tokens."""

    min_tokens: int = 0  # end ids are not generated, and stop sequences do not end it, before this many tokens
    exclude_input: bool = True  # False (and not streaming): the prompt text comes before the answer, as TRT-LLM
    perf_metrics: bool = False
    num_input_tokens: bool = False
    num_output_tokens: bool = False
    log_probs: bool = False  # return_log_probs (the request's SamplingParams.logprobs too: the target computes them)
    sequences: int = 1  # num_return_sequences: sequence i samples with seed + i (``bls.LoopModel``)


Reader = Callable[[str, Any, type], Any]  # (name, default, kind) -> the request's scalar input, or the default


def parse_options(read: Reader, max_tokens: int, vocab_size: int, exclude_default: bool = True) -> Options:
    """Check TensorRT-LLM's optional inputs of one request (``bad_words`` is read with the sampling: its words are
    tokenized); every error names its field, its value and the fix. ``exclude_default``: exclude_input_in_output when
    the request does not send it (the entry models: true, as GenAI-Perf sends it; the ``tensorrt_llm`` model: its
    parameter)."""
    for name, (neutral, why) in NEUTRAL.items():
        value = read(name, None, type(neutral))
        if isinstance(value, float):
            value = float(f"{value:.7g}")  # an FP32 input as its sender wrote it: 1.3, not 1.2999999523162842
        require(value is None or value == neutral, name, value, f"is not supported: {why}",
                f"send {name} {str(neutral).lower() if isinstance(neutral, bool) else neutral} or omit it")
    length_penalty = read("length_penalty", None, float)  # scales beam scores only: nothing to do with one beam
    require(length_penalty is None or math.isfinite(length_penalty), "length_penalty", length_penalty, "must be finite")
    pad_id = read("pad_id", None, int)  # responses are never padded
    require(pad_id is None or 0 <= pad_id < vocab_size, "pad_id", pad_id, f"must be a token id in [0, {vocab_size})")
    min_tokens, min_length = read("min_tokens", None, int), read("min_length", None, int)
    require(min_tokens is None or min_length is None or min_tokens == min_length, "min_length", min_length,
            f"differs from min_tokens={min_tokens} (min_length is the older name of min_tokens)", "send one of them")
    low = min_tokens if min_tokens is not None else (min_length if min_length is not None else 0)
    field = "min_tokens" if min_tokens is not None else "min_length"
    require(0 <= low <= max_tokens, field, low, f"must be in [0, max_tokens={max_tokens}]")
    flags = [bool(read(name, default, bool)) for name, default in (
        ("exclude_input_in_output", exclude_default), ("return_perf_metrics", False),
        ("return_num_input_tokens", False), ("return_num_output_tokens", False), ("return_log_probs", False))]
    sequences = read("num_return_sequences", 1, int)
    require(sequences >= 1, "num_return_sequences", sequences, "must be at least 1")
    return Options(low, *flags, sequences)


def request_options(pb_utils, request, max_tokens: int, vocab_size: int) -> Options:
    """``parse_options`` over a Triton request's inputs (the entry models and the trtllm-pytorch bridge)."""
    from trtllm_dflash.serve.triton.io import scalar

    return parse_options(lambda name, default, kind: scalar(pb_utils, request, name, default, kind), max_tokens,
                         vocab_size)


def response_outputs(opts: Options, num_input: int, num_output: int, drafted: int, accepted: int,
                     logprobs: Sequence[float] = (), times: Sequence[int] | None = None) -> list[tuple[str, Any]]:
    """The extra outputs of one response, as (name, array) pairs, shaped as TensorRT-LLM's ``tensorrt_llm`` model
    sends them and its ensemble passes them on (batch, beam[, tokens]: ``model_instance_state.cc``; its example
    client reads each metric as ``as_numpy(name)[0][0]``): every count and metric [1, 1], ``output_log_probs``
    [1, 1, num_output]. ``num_output`` = the tokens this response carries (when streaming, each response's own:
    Triton's OpenAI frontend sums them over a stream's chunks for its usage), ``drafted`` / ``accepted`` = the
    request's draft tokens so far (TensorRT-LLM's ``total_*``), ``logprobs`` = the log-probabilities of every token
    so far, of which the last ``num_output`` are this response's, ``cum_log_probs`` their sum. ``times``: the
    request's (arrival, first scheduled, first token, last token) in nanoseconds of the monotonic clock (C++'s
    steady_clock on Linux, as TensorRT-LLM reports them; the last token's 0 until the final response), sent with the
    perf metrics."""
    def one(name: str, value, dtype) -> tuple[str, Any]:
        return name, np.array([[value]], dtype=dtype)

    out: list[tuple[str, Any]] = []
    if opts.perf_metrics:
        out += [one(name, v, np.int32) for name, v in KV_CACHE_METRICS.items()]
        out += [one("acceptance_rate", accepted / drafted if drafted else 0.0, np.float32),
                one("total_accepted_draft_tokens", accepted, np.int32), one("total_draft_tokens", drafted, np.int32)]
        if times is not None:
            out += [one(f"{t}_time_ns", v, np.int64)
                    for t, v in zip(("arrival", "first_scheduled", "first_token", "last_token"), times, strict=True)]
    if opts.num_input_tokens:
        out.append(one("num_input_tokens", num_input, np.int32))
    if opts.num_output_tokens:
        out.append(one("num_output_tokens", num_output, np.int32))
    if opts.log_probs:
        mine = list(logprobs[len(logprobs) - num_output:]) if num_output else []
        out += [("output_log_probs", np.array(mine, dtype=np.float32).reshape(1, 1, -1)),
                one("cum_log_probs", math.fsum(logprobs), np.float32)]
    return out
