"""``tensorrt_llm``: TensorRT-LLM's token-level Triton model, answered by the DFlash loop.

Clients written for TensorRT-LLM's own ``tensorrt_llm`` model (its ``inflight_batcher_llm_client.py``, services that
tokenize themselves, perf_analyzer runs on token ids) send token ids and read token ids. This model declares that
model's inputs and outputs with their names, dtypes and dims (``triton_backend/all_models/inflight_batcher_llm/
tensorrt_llm/config.pbtxt`` at 1.2.0rc8, ``INPUTS`` / ``OUTPUTS``) for everything this server does, and answers as
its backend does (``model_instance_state.cc`` ``fillTritonResponse``; the executor's ``LlmRequest::createResult``):

* ``output_ids`` INT32 [1, 1, n] and ``sequence_length`` INT32 [1, 1] on every response. Streamed: each response's new
  tokens, never the prompt (the final one may carry none). Not streamed: one response with the prompt and the answer,
  the answer alone with ``exclude_input_in_output`` (default: the model's parameter, false as TensorRT-LLM's).
* Sampling as its executor does: ``temperature`` (default 1), ``runtime_top_k`` and ``runtime_top_p`` (0 = off; a
  top-p <= 0 is dropped), greedy when both are off or top-k is 1 (``regularizeTopKTopP``); ``end_id`` ends the answer
  only when it is sent (absent or -1: the answer runs to ``request_output_len`` or a stop word); the penalties,
  ``min_tokens``, ``seed``, the log-probabilities and ``num_return_sequences`` as the entry models honour them
  (``serve/trtllm/compat.py``). A prompt plus ``request_output_len`` past the context limit shortens the answer, as its
  executor does (``LlmRequest::validate``); a prompt that leaves no room is refused.
* ``stop_words_list`` / ``bad_words_list`` INT32 [2, L] per row (the words' token ids, then each word's end offset,
  strictly increasing, padded with -1: ``convertWordList``) and ``embedding_bias`` FP32 [vocab] (one value per token;
  empty: none).
* A request of B rows runs as B requests; with B > 1 every response carries ``batch_index``, and the final flag comes
  once, with the last row's last response.
* ``stop`` true with the request id of live requests ends them at their next step, each sequence with a final response
  of its tokens so far (its executor returns a cancelled request's result); the stop request itself gets one empty
  final response.
* ``return_perf_metrics``: the ten metrics on every response, [1, 1] (its example client reads all ten unguarded).
  There is no paged KV cache here, so the KV-cache counters report one block per sequence (``compat.KV_CACHE_METRICS``).

Rendered ``--tensorrt-llm-unary`` (TensorRT-LLM's ``decoupled_mode`` false) the model is not decoupled, so clients
calling unary ModelInfer get their one response; streaming, batches of several rows and several sequences are then
refused by name, as its backend refuses them.

Not declared, so Triton refuses them naming the input: draft tokens or logits sent by the client, prompt tables,
LoRA, encoder inputs, guided decoding, top-p decay, KV-cache retention and disaggregated serving's context phase.
Beam search and logits are refused by name (``compat.NEUTRAL``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from trtllm_dflash.errors import require
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.runtime.sampling import SamplingParams, bias_pairs
from trtllm_dflash.serve.trtllm.compat import Options, parse_options, response_outputs
from trtllm_dflash.runtime.stepper import Update
from trtllm_dflash.runtime.protocol import GenerateRequest, generate_request
from trtllm_dflash.serve.triton.io import RowView, get, scalar

# name: (Triton dtype, dims), as TensorRT-LLM's tensorrt_llm config declares them; input_ids, input_lengths and
# request_output_len come first (input_ids is optional there too: a stop request needs none)
INPUTS = {
    "input_ids": ("TYPE_INT32", "-1"), "input_lengths": ("TYPE_INT32", "1"),
    "request_output_len": ("TYPE_INT32", "1"), "num_return_sequences": ("TYPE_INT32", "1"),
    "end_id": ("TYPE_INT32", "1"), "pad_id": ("TYPE_INT32", "1"), "stop_words_list": ("TYPE_INT32", "2, -1"),
    "bad_words_list": ("TYPE_INT32", "2, -1"), "embedding_bias": ("TYPE_FP32", "-1"),
    "beam_width": ("TYPE_INT32", "1"), "temperature": ("TYPE_FP32", "1"), "runtime_top_k": ("TYPE_INT32", "1"),
    "runtime_top_p": ("TYPE_FP32", "1"), "len_penalty": ("TYPE_FP32", "1"), "early_stopping": ("TYPE_BOOL", "1"),
    "repetition_penalty": ("TYPE_FP32", "1"), "min_tokens": ("TYPE_INT32", "1"),
    "beam_search_diversity_rate": ("TYPE_FP32", "1"), "presence_penalty": ("TYPE_FP32", "1"),
    "frequency_penalty": ("TYPE_FP32", "1"), "seed": ("TYPE_UINT64", "1"), "return_log_probs": ("TYPE_BOOL", "1"),
    "return_context_logits": ("TYPE_BOOL", "1"), "return_generation_logits": ("TYPE_BOOL", "1"),
    "return_perf_metrics": ("TYPE_BOOL", "1"), "return_num_input_tokens": ("TYPE_BOOL", "1"),
    "return_num_output_tokens": ("TYPE_BOOL", "1"), "exclude_input_in_output": ("TYPE_BOOL", "1"),
    "stop": ("TYPE_BOOL", "1"), "streaming": ("TYPE_BOOL", "1"),
}
REQUIRED = ("input_lengths", "request_output_len")
PERF_METRICS = ("kv_cache_alloc_new_blocks", "kv_cache_reused_blocks", "kv_cache_alloc_total_blocks",
                "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
OUTPUTS = {
    "output_ids": ("TYPE_INT32", "-1, -1"), "sequence_length": ("TYPE_INT32", "-1"),
    "cum_log_probs": ("TYPE_FP32", "-1"), "output_log_probs": ("TYPE_FP32", "-1, -1"),
    "batch_index": ("TYPE_INT32", "1"), "sequence_index": ("TYPE_INT32", "1"),
    **{m: ("TYPE_FP32" if m == "acceptance_rate" else "TYPE_INT64" if m.endswith("_ns") else "TYPE_INT32", "1")
       for m in PERF_METRICS},
    "num_input_tokens": ("TYPE_INT32", "1"), "num_output_tokens": ("TYPE_INT32", "1"),
}
# the ensemble's names compat.parse_options reads -> the tensorrt_llm model's
ALIASES = {"length_penalty": "len_penalty"}


def template_values() -> dict[str, str]:
    """The input and output lists of the ``tensorrt_llm`` config.pbtxt."""
    def entries(table: dict, optional: bool) -> str:
        return ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: [ {d} ]'
                          f'{" optional: true" if optional and n not in REQUIRED else ""} }}'
                          for n, (t, d) in table.items())

    return {"token_inputs": entries(INPUTS, True), "token_outputs": entries(OUTPUTS, False)}


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a request: what its loop runs and what its responses carry."""

    gen: GenerateRequest
    opts: Options
    index: int  # batch_index


def word_list(arr: np.ndarray | None, field: str, vocab: int) -> list[list[int]]:
    """TensorRT-LLM's words format, one row's [2, L]: the words' token ids one after another (padded), then each
    word's end offset into them (padded with -1)."""
    if arr is None or arr.size == 0:
        return []
    require(arr.ndim == 2 and arr.shape[0] == 2, f"{field} shape", list(arr.shape),
            "must be [2, L] per row: token ids, then each word's end offset (padded with -1)")
    ids, ends = arr[0].tolist(), arr[1].tolist()
    words, start = [], 0
    for i, end in enumerate(ends):
        if end == -1:
            require(all(e == -1 for e in ends[i:]), f"{field} offsets", ends, "must end with -1s only (padding)")
            break
        low = start + 1 if i else 0  # TensorRT-LLM's convertWordList: strictly increasing
        require(low <= end <= len(ids), f"{field} offsets[{i}]", end,
                f"must be an end offset in [{low}, {len(ids)}] (offsets grow; pad with -1)")
        word = ids[start:end]
        for t in word:
            require(0 <= t < vocab, f"{field} token id", t, f"must be in [0, {vocab})")
        if word:
            words.append(word)
        start = end
    return words


def token_sampling(pb, request, vocab: int) -> SamplingParams:
    """One row's sampling as TensorRT-LLM's executor reads it (``pb``: the row's ``RowView``): greedy unless top-k > 1
    or top-p > 0 (with neither sent: greedy), temperature 1 by default."""
    temperature = scalar(pb, request, "temperature", 1.0, float)
    top_k = scalar(pb, request, "runtime_top_k", 0, int)
    top_p = scalar(pb, request, "runtime_top_p", 0.0, float)
    require(math.isfinite(temperature) and temperature >= 0, "temperature", temperature, "must be finite and >= 0")
    require(top_k >= 0, "runtime_top_k", top_k, "must be >= 0 (0 = off)")
    require(top_p <= 1, "runtime_top_p", top_p, "must be at most 1 (0 or less = off)")
    top_p = max(top_p, 0.0)  # the backend drops a top-p <= 0 (utils.cc)
    greedy = temperature == 0 or top_k == 1 or (top_k == 0 and top_p == 0)
    bias = get(pb, request, "embedding_bias")
    pairs = ()
    if bias is not None and np.asarray(bias).size:
        bias = np.asarray(bias, dtype=np.float32).reshape(-1)
        require(bias.size == vocab, "embedding_bias length", bias.size,
                f"must be the vocabulary size ({vocab}): one value per token id", "send a dense [vocab] vector")
        require(bool(np.isfinite(bias).all()), "embedding_bias", "non-finite values", "must be finite")
        ids = np.flatnonzero(bias)
        pairs = bias_pairs(ids.tolist(), bias[ids].tolist())
    return SamplingParams(
        temperature=0.0 if greedy else temperature, top_k=0 if greedy else top_k,
        top_p=1.0 if greedy or top_p == 0 else top_p, seed=scalar(pb, request, "seed", 0, int),
        repetition_penalty=scalar(pb, request, "repetition_penalty", 1.0, float),
        presence_penalty=scalar(pb, request, "presence_penalty", 0.0, float),
        frequency_penalty=scalar(pb, request, "frequency_penalty", 0.0, float),
        logprobs=bool(scalar(pb, request, "return_log_probs", False, bool)),
        bad_words=tuple(tuple(w) for w in word_list(get(pb, request, "bad_words_list"), "bad_words_list", vocab)),
        logit_bias=pairs)


class TokenFrontend:
    """Parses ``tensorrt_llm`` requests into the loop's rows and builds their responses."""

    def __init__(self, params: ModelSettings | dict[str, str]) -> None:
        from trtllm_dflash.specs import TargetSpec

        s = ModelSettings.of(params)
        self.vocab = TargetSpec.load(s.tokenizer_dir).vocab_size
        self.max_seq_len = s.max_seq_len
        self.exclude_input = s.exclude_input_in_output
        self.decoupled = s.decoupled

    @staticmethod
    def is_stop(pb_utils, request) -> bool:
        t = pb_utils.get_input_tensor_by_name(request, "stop")
        return t is not None and bool(np.asarray(t.as_numpy()).reshape(-1).any())

    def parse(self, pb_utils, request) -> list[Row]:
        """Every row of a request (each error names its field, its value and the fix)."""
        for name in ("input_ids", *REQUIRED):
            require(pb_utils.get_input_tensor_by_name(request, name) is not None, name, None, "is required",
                    f"send {name} INT32 [batch, {'tokens' if name == 'input_ids' else 1}]")
        batch = max(1, pb_utils.get_input_tensor_by_name(request, "input_lengths").as_numpy().shape[0])
        rows = [self._row(RowView(pb_utils, b, batch), request, b) for b in range(batch)]
        if not self.decoupled:  # one response per request (TensorRT-LLM's utils.cc refuses these alike)
            fix = "or render the repository without --tensorrt-llm-unary (a decoupled tensorrt_llm model)"
            require(batch == 1, "batch size", batch, "must be 1 on the unary tensorrt_llm model",
                    f"send one row per request, {fix}")
            require(not rows[0].gen.stream, "streaming", True, "needs the decoupled tensorrt_llm model",
                    f"send streaming false, {fix}")
            require(rows[0].opts.sequences == 1, "num_return_sequences", rows[0].opts.sequences,
                    "must be 1 on the unary tensorrt_llm model", f"send 1, {fix}")
        return rows

    def _row(self, pb, request, b: int) -> Row:
        """Row ``b`` of a request, read through its ``RowView`` ``pb``."""
        ids = np.asarray(get(pb, request, "input_ids")).reshape(-1)
        length = scalar(pb, request, "input_lengths", None, int)
        require(1 <= length <= ids.size, "input_lengths", length, f"must be in [1, {ids.size}] (the row's input_ids)")
        prompt = [int(t) for t in ids[:length]]
        bad = [t for t in prompt if not 0 <= t < self.vocab]
        require(not bad, "input_ids", bad[:8], f"must be token ids in [0, {self.vocab})")
        asked = scalar(pb, request, "request_output_len", None, int)
        require(asked >= 1, "request_output_len", asked, "must be >= 1")
        room = self.max_seq_len - length
        require(room >= 1, "input_lengths", length, f"leaves no room in the context limit ({self.max_seq_len} tokens)",
                "shorten the prompt")
        sampling = token_sampling(pb, request, self.vocab)

        def read(name: str, default, kind):
            return scalar(pb, request, ALIASES.get(name, name), default, kind)

        opts = parse_options(read, asked, self.vocab, exclude_default=self.exclude_input)
        # prompt + answer past the context limit: the answer is shortened, as TensorRT-LLM's executor does
        max_tokens = min(asked, room)
        opts = replace(opts, log_probs=sampling.logprobs, min_tokens=min(opts.min_tokens, max_tokens))
        stops = [[s] for s in [scalar(pb, request, "end_id", -1, int)] if s != -1]
        for s in stops:
            require(0 <= s[0] < self.vocab, "end_id", s[0], f"must be a token id in [0, {self.vocab}) or -1 (none)")
        stops += word_list(get(pb, request, "stop_words_list"), "stop_words_list", self.vocab)
        stream = bool(scalar(pb, request, "streaming", False, bool))
        gen = generate_request(prompt, max_tokens, sampling, tuple(tuple(s) for s in stops), stream, opts.min_tokens)
        gen.sampling.validate()
        return Row(gen, opts, b)

    def outputs(self, row: Row, u: Update, drafted: int, accepted: int, times, labels) -> list[tuple[str, Any]]:
        """One response's tensors (``labels``: its batch_index / sequence_index pairs, when it has them)."""
        new = u.tokens[u.prev_len:]
        ids = new if row.gen.stream or row.opts.exclude_input else [*row.gen.input_ids, *u.tokens]
        extra = response_outputs(row.opts, len(row.gen.input_ids), len(new), drafted, accepted, u.logprobs, times)
        out = [("output_ids", np.array(ids, dtype=np.int32).reshape(1, 1, -1)),
               ("sequence_length", np.array([[len(ids)]], dtype=np.int32))]
        for name, value in extra:
            if name == "num_output_tokens":  # the tokens this response carries, its prompt included
                value = np.array([[len(ids)]], dtype=np.int32)
            out.append((name, value))
        return out + list(labels)
