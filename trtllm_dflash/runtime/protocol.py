"""Request-level protocol of the served ensembles: tensorrtllm_backend-compatible names, parsing and validation.

Ensemble inputs (batch dimension first, as in tensorrtllm_backend): ``text_input`` BYTES [1], ``max_tokens`` INT32 [1],
optional ``stream`` BOOL, ``temperature`` FP32, ``top_k`` INT32, ``top_p`` FP32, ``seed`` UINT64, ``end_id`` INT32,
``stop_words`` BYTES [-1], ``apply_chat_template`` BOOL. Outputs: ``text_output`` BYTES [1] (a delta when streaming),
``acceptance_lengths`` INT32 [-1] (τ of the steps this response covers), ``num_draft_tokens`` and
``num_accepted_draft_tokens`` INT32 [1] (same steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.runtime.sampling import SamplingParams

STOP_SEPARATOR = -1  # flat encoding of stop sequences: [a, b, -1, c, -1] = {(a, b), (c,)}
MAX_STOP_WORDS = 1024  # stop_words entries a request may send (each is tokenized when the request arrives)


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What preprocessing hands to the BLS loop."""

    input_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_sequences: tuple[tuple[int, ...], ...]
    stream: bool
    min_tokens: int = 0  # no stop ends the answer before this many tokens (sampling bans the end ids until then)


def generate_request(ids, max_tokens: int, sampling: SamplingParams, stops: tuple[tuple[int, ...], ...],
                     stream: bool, min_tokens: int = 0) -> GenerateRequest:
    """A ``GenerateRequest`` whose sampling keeps the target from choosing a single-token stop (the end ids) before
    ``min_tokens`` new tokens (``SamplingParams.with_min_tokens``)."""
    ids = tuple(ids)
    end_ids = [s[0] for s in stops if len(s) == 1]
    return GenerateRequest(ids, max_tokens, sampling.with_min_tokens(min_tokens, len(ids), end_ids), stops, stream,
                           min_tokens)


def decode_text(raw: bytes | str, field: str) -> str:
    if isinstance(raw, str):
        return raw
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(field, raw[:32], f"is not valid UTF-8 ({exc.reason} at byte {exc.start})",
                          "send UTF-8 encoded text") from None


def validate_generation(max_tokens: int, sampling: SamplingParams, prompt_len: int, max_seq_len: int) -> None:
    require(max_tokens >= 1, "max_tokens", max_tokens, "must be >= 1")
    require(max_tokens < max_seq_len, "max_tokens", max_tokens, f"must be < the repository's max_seq_len ({max_seq_len})")
    sampling.validate()
    require(prompt_len >= 1, "text_input", "", "must not be empty")
    require(prompt_len + max_tokens <= max_seq_len, "prompt tokens + max_tokens", prompt_len + max_tokens,
            f"exceeds the context limit ({max_seq_len} tokens)", "shorten the prompt or lower max_tokens")


def encode_stops(sequences: list[list[int]]) -> list[int]:
    flat: list[int] = []
    for seq in sequences:
        if seq:
            flat += list(seq) + [STOP_SEPARATOR]
    return flat


def decode_stops(flat: list[int]) -> tuple[tuple[int, ...], ...]:
    out, cur = [], []
    for t in flat:
        if t == STOP_SEPARATOR:
            if cur:
                out.append(tuple(cur))
            cur = []
        else:
            cur.append(t)
    if cur:
        out.append(tuple(cur))
    return tuple(out)


class StopMatcher:
    """A request's stop sequences, indexed by their last token: each new token is compared with the stops that end in
    it, not with every stop. Comparing every stop at every new token would let one request with 20,000 stop words slow
    every stream of its loop model (which runs all of them on one thread)."""

    def __init__(self, stops: tuple[tuple[int, ...], ...], min_tokens: int = 0) -> None:
        """``min_tokens``: a stop ending within the first that many tokens does not count (``GenerateRequest``)."""
        self.min_end = min_tokens + 1
        self.by_last: dict[int, list[tuple[int, ...]]] = {}
        for stop in stops:
            self.by_last.setdefault(stop[-1], []).append(stop)  # decode_stops never yields an empty one
        self.longest = max((len(s) for s in stops), default=0)

    def truncate(self, tokens: list[int], checked: int) -> int | None:
        """Length to keep if a stop sequence ends inside ``tokens[checked:]`` (the stop itself is dropped), else
        None."""
        for end in range(max(checked + 1, self.min_end), len(tokens) + 1):
            for stop in self.by_last.get(tokens[end - 1], ()):
                if end >= len(stop) and tuple(tokens[end - len(stop): end]) == stop:
                    return end - len(stop)
        return None
