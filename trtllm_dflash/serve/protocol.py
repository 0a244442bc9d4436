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


@dataclass(frozen=True, slots=True)
class GenerateRequest:
    """What preprocessing hands to the BLS loop."""

    input_ids: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams
    stop_sequences: tuple[tuple[int, ...], ...]
    stream: bool


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


def truncate_at_stop(tokens: list[int], stops: tuple[tuple[int, ...], ...], checked: int) -> int | None:
    """Length to keep if a stop sequence ends inside ``tokens[checked:]`` (the stop itself is dropped), else None."""
    for end in range(max(checked, 0) + 1, len(tokens) + 1):
        for stop in stops:
            if end >= len(stop) and tuple(tokens[end - len(stop) : end]) == stop:
                return end - len(stop)
    return None
