"""``preprocessing`` / ``postprocessing``: TensorRT-LLM's tokenizer models, with its inputs and outputs.

TensorRT-LLM's Triton repository tokenizes in a ``preprocessing`` model and detokenizes in a ``postprocessing`` model,
and its ``ensemble`` wires them around the token-level ``tensorrt_llm`` model: QUERY -> INPUT_ID, REQUEST_INPUT_LEN,
BAD_WORDS_IDS, STOP_WORDS_IDS, EMBEDDING_BIAS, REQUEST_OUTPUT_LEN, OUT_END_ID, OUT_PAD_ID -> ``tensorrt_llm`` ->
output_ids, sequence_length -> TOKENS_BATCH, SEQUENCE_LENGTH -> OUTPUT. Clients that call those models themselves
(TensorRT-LLM's ``e2e_grpc_speculative_decoding_client.py``; services that use the server as their tokenizer; a
user's own ensemble over them) need their names, dtypes and shapes. These models answer as TensorRT-LLM's do
(``triton_backend/all_models/inflight_batcher_llm/{pre,post}processing``, config.pbtxt and 1/model.py, read in
NVIDIA/TensorRT-LLM @01259b1 / @2e2327b; recorded in ``tests/data/trtllm_ensemble/text_models_io.json``):

* QUERY [B, 1] is encoded with the ``add_special_tokens`` parameter (TensorRT-LLM's default: true); INPUT_ID
  [B, L] right-padded with the pad id (the tokenizer's pad token, its EOS where it has none), REQUEST_INPUT_LEN
  [B, 1]; DECODER_INPUT_ID [B, 1] the pad id (PAD_ID's when sent) and REQUEST_DECODER_INPUT_LEN [B, 1] ones, as it
  sends them for a decoder-only model.
* BAD_WORDS_DICT / STOP_WORDS_DICT [B, N] strings -> [B, 2, max(1, longest row)] INT32: each non-empty word encoded
  alone without special tokens, the ids padded with 0, each word's end offset padded with -1; absent: [B, 2, 0].
* EMBEDDING_BIAS_WORDS / _WEIGHTS -> EMBEDDING_BIAS [B, vocab] FP32: each word encoded with the tokenizer's default
  special tokens, its weight added to every one of its tokens; absent: [B, 0]. The length is the target's
  ``vocab_size`` (what the ``tensorrt_llm`` model checks it against), where TensorRT-LLM's uses the tokenizer's
  vocabulary (the same for the Llama and SmolLM2 tokenizers; Qwen3's config pads it).
* REQUEST_OUTPUT_LEN passed on; OUT_END_ID / OUT_PAD_ID [B, 1] from END_ID / PAD_ID, or the tokenizer's EOS / pad id.
* TOKENS_BATCH [B, beams, L] and SEQUENCE_LENGTH [B, beams] -> OUTPUT [B * beams]: each beam's first
  SEQUENCE_LENGTH ids decoded, special tokens skipped unless the ``skip_special_tokens`` parameter is false.

Beyond TensorRT-LLM's: bad input is refused naming the field (its model asserts or raises), and ``preprocessing``
takes an optional ``apply_chat_template`` (as the entry models do). Not declared, so Triton refuses them by name:
DECODER_QUERY (encoder-decoder models), images and video, PROMPT_TABLE_EXTRA_ID.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from trtllm_dflash.errors import require
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.runtime.protocol import decode_text

Inputs = Callable[[str], "np.ndarray | None"]  # an input by name, with its batch dimension, or None when absent


def flag(params: ModelSettings | dict[str, str], key: str) -> bool:
    """A boolean model parameter as TensorRT-LLM's models read it (a known true or false spelling; anything else:
    the setting's default), through ``ModelSettings``."""
    return bool(getattr(ModelSettings.of(params), key))


def rows_of(arr: np.ndarray, field: str, batch: int) -> list[list[str]]:
    """A [B, N] string input as B lists of decoded strings."""
    arr = np.asarray(arr)
    require(arr.ndim == 2 and arr.shape[0] == batch, f"{field} shape", list(arr.shape),
            f"must be [{batch}, N]: one row of strings per QUERY row")
    return [[decode_text(w, f"{field}[{b}][{i}]") for i, w in enumerate(row)] for b, row in enumerate(arr)]


def one_per_row(read: Inputs, name: str, batch: int, default, kind=np.int32) -> np.ndarray:
    """An optional [B, 1] input, ``default`` in every row when absent."""
    arr = read(name)
    if arr is None:
        return np.full((batch, 1), default, dtype=kind)
    arr = np.asarray(arr)
    require(arr.size == batch, f"{name} shape", list(arr.shape), f"must be [{batch}, 1]: one value per QUERY row")
    return arr.reshape(batch, 1).astype(kind)


def word_lists(rows: list[list[list[int]]]) -> np.ndarray:
    """Words' token ids (per row, a list of words) in TensorRT-LLM's format, [B, 2, max(1, longest row)] INT32."""
    flat = [[t for w in words for t in w] for words in rows]
    width = max([1, *map(len, flat)])
    out = np.zeros((len(rows), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, words in enumerate(rows):
        out[b, 0, :len(flat[b])] = flat[b]
        ends = np.cumsum([len(w) for w in words]).tolist()
        out[b, 1, :len(ends)] = ends
    return out


class PerRequest:
    """A unary model's ``execute``: each request's inputs through ``self`` into one response, a failure into that
    request's error response (INVALID_ARGUMENT naming the field for bad input)."""

    pb = None  # Triton's python-backend utilities, set by the subclass's constructor

    def execute(self, requests) -> list:
        from trtllm_dflash.serve.triton.io import error_response

        pb_utils = self.pb
        responses = []
        for request in requests:
            try:
                outputs = [pb_utils.Tensor(n, a) for n, a in self(request_reader(pb_utils, request))]
                responses.append(pb_utils.InferenceResponse(output_tensors=outputs))
            except Exception as exc:  # every failure becomes this request's error response
                responses.append(error_response(pb_utils, exc))
        return responses


class TextPreprocessor(PerRequest):
    """TensorRT-LLM's ``preprocessing`` (see the module docstring)."""

    def __init__(self, params: ModelSettings | dict[str, str], pb_utils=None) -> None:
        from trtllm_dflash.runtime.text import load_tokenizer
        from trtllm_dflash.specs import TargetSpec

        s = ModelSettings.of(params)
        self.pb = pb_utils  # Triton's python-backend utilities (None where a test only builds the model)
        self.tokenizer = load_tokenizer(s.tokenizer_dir)
        self.vocab = TargetSpec.load(s.tokenizer_dir).vocab_size
        self.add_special_tokens = s.add_special_tokens
        tok = self.tokenizer
        self.end_id = tok.encode(tok.eos_token, add_special_tokens=False)[0]
        self.pad_id = tok.encode(tok.pad_token or tok.eos_token, add_special_tokens=False)[0]

    def encode(self, text: str, chat: bool) -> list[int]:
        from trtllm_dflash.runtime.text import encode_prompt

        return encode_prompt(self.tokenizer, text, True) if chat else \
            list(self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens))

    def __call__(self, read: Inputs) -> list[tuple[str, np.ndarray]]:
        query, out_len = read("QUERY"), read("REQUEST_OUTPUT_LEN")
        require(query is not None, "QUERY", None, "is required")
        require(out_len is not None, "REQUEST_OUTPUT_LEN", None, "is required")
        texts = [row[0] for row in rows_of(query, "QUERY", np.asarray(query).shape[0])]
        batch = len(texts)
        for b, text in enumerate(texts):
            require(text != "", f"QUERY[{b}]", "", "must not be empty")
        chat = one_per_row(read, "apply_chat_template", batch, False, bool)
        ids = [self.encode(t, bool(c)) for t, c in zip(texts, chat[:, 0])]
        pad_ids = one_per_row(read, "PAD_ID", batch, self.pad_id)
        padded = np.full((batch, max(map(len, ids))), self.pad_id, dtype=np.int32)
        for b, row in enumerate(ids):
            padded[b, :len(row)] = row
        out_len = np.asarray(out_len, dtype=np.int32).reshape(batch, -1)
        return [("INPUT_ID", padded), ("REQUEST_INPUT_LEN", np.array([[len(r)] for r in ids], dtype=np.int32)),
                ("DECODER_INPUT_ID", pad_ids), ("REQUEST_DECODER_INPUT_LEN", np.ones((batch, 1), dtype=np.int32)),
                ("BAD_WORDS_IDS", self._words(read, "BAD_WORDS_DICT", batch)),
                ("STOP_WORDS_IDS", self._words(read, "STOP_WORDS_DICT", batch)),
                ("REQUEST_OUTPUT_LEN", out_len), ("EMBEDDING_BIAS", self._bias(read, batch)),
                ("OUT_END_ID", one_per_row(read, "END_ID", batch, self.end_id)), ("OUT_PAD_ID", pad_ids)]

    def _words(self, read: Inputs, name: str, batch: int) -> np.ndarray:
        from trtllm_dflash.runtime.text import encode_words

        arr = read(name)
        if arr is None:
            return np.empty((batch, 2, 0), dtype=np.int32)
        return word_lists([[list(w) for w in encode_words(self.tokenizer, row)] for row in rows_of(arr, name, batch)])

    def _bias(self, read: Inputs, batch: int) -> np.ndarray:
        from trtllm_dflash.runtime.text import encode_bias

        words, weights = read("EMBEDDING_BIAS_WORDS"), read("EMBEDDING_BIAS_WEIGHTS")
        if words is None or weights is None:
            return np.empty((batch, 0), dtype=np.float32)
        words = rows_of(words, "EMBEDDING_BIAS_WORDS", batch)
        weights = np.asarray(weights, dtype=np.float32).reshape(batch, -1)
        out = np.zeros((batch, self.vocab), dtype=np.float32)
        for b, (row, ws) in enumerate(zip(words, weights)):
            require(len(row) == len(ws), f"EMBEDDING_BIAS_WEIGHTS[{b}] count", len(ws),
                    f"must equal the number of EMBEDDING_BIAS_WORDS[{b}] ({len(row)}): one weight per word")
            for w in ws.tolist():
                require(np.isfinite(w), f"EMBEDDING_BIAS_WEIGHTS[{b}]", w, "must be finite")
            for t, w in encode_bias(self.tokenizer, zip(row, ws.tolist())):  # a token of several words: their sum
                require(0 <= t < self.vocab, "EMBEDDING_BIAS_WORDS token id", t, f"must be in [0, {self.vocab})")
                out[b, t] = w
        return out


class TextPostprocessor(PerRequest):
    """TensorRT-LLM's ``postprocessing`` (see the module docstring)."""

    def __init__(self, params: ModelSettings | dict[str, str], pb_utils=None) -> None:
        from trtllm_dflash.runtime.text import load_tokenizer

        s = ModelSettings.of(params)
        self.pb = pb_utils  # Triton's python-backend utilities (None where a test only builds the model)
        self.tokenizer = load_tokenizer(s.tokenizer_dir)
        self.skip_special_tokens = s.skip_special_tokens

    def __call__(self, read: Inputs) -> list[tuple[str, np.ndarray]]:
        tokens, lengths = read("TOKENS_BATCH"), read("SEQUENCE_LENGTH")
        require(tokens is not None, "TOKENS_BATCH", None, "is required")
        require(lengths is not None, "SEQUENCE_LENGTH", None, "is required")
        tokens, lengths = np.asarray(tokens), np.asarray(lengths)
        require(tokens.ndim == 3, "TOKENS_BATCH shape", list(tokens.shape), "must be [batch, beams, tokens]")
        require(lengths.shape == tokens.shape[:2], "SEQUENCE_LENGTH shape", list(lengths.shape),
                f"must be {list(tokens.shape[:2])}: one length per TOKENS_BATCH beam")
        texts = []
        for beams, lens in zip(tokens, lengths):
            for ids, n in zip(beams, lens.tolist()):
                require(0 <= n <= len(ids), "SEQUENCE_LENGTH", n, f"must be in [0, {len(ids)}] (the beam's tokens)")
                texts.append(self.tokenizer.decode(ids[:n].tolist(), skip_special_tokens=self.skip_special_tokens))
        return [("OUTPUT", np.array([t.encode("utf-8") for t in texts], dtype=object))]


def request_reader(pb_utils, request) -> Inputs:
    """A request's inputs by name, with their batch dimension (None when absent)."""
    def read(name: str) -> Any:
        t = pb_utils.get_input_tensor_by_name(request, name)
        return None if t is None else t.as_numpy()

    return read
