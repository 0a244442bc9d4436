"""Text around the token loop: tokenizer loading, chat templating, stop tokens and incremental detokenization."""

from __future__ import annotations

from pathlib import Path

from trtllm_dflash.errors import ArtifactError


def load_tokenizer(model_dir: str | Path):
    """The target's tokenizer (tokenizer.json etc. in the model directory), offline."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as exc:
        raise ArtifactError(model_dir, f"cannot load a tokenizer ({exc})", "the target directory must hold tokenizer files") from exc


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Token ids of ``text``; with ``chat`` wrapped as one user turn in the target's chat template."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ArtifactError("tokenizer", "has no chat template", "drop --chat / apply_chat_template")
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True
        )
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return list(tokenizer.encode(text, add_special_tokens=False))


def stop_token_ids(tokenizer, eos_from_config: tuple[int, ...]) -> tuple[int, ...]:
    ids = set(eos_from_config)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


class IncrementalDetokenizer:
    """Turns a growing token sequence into text deltas whose concatenation equals ``decode(all tokens)``.

    A delta is held back while the decoded tail ends in U+FFFD (a multi-byte character split across tokens), so a
    stream never shows broken characters. ``flush`` returns whatever is left at the end.

    Each call decodes a window, not the whole sequence: the tokens of the previous delta (context, e.g. for a
    SentencePiece word-start space) and the new ones; the delta is what the new ones add to the window's text.
    Decoding everything so far on every call would grow with the response, paid per stream and per step in the
    Triton entry model's loop process (perf/results/detokenize/).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._start = 0  # the window's first token: those before it are never decoded again
        self._read = 0  # tokens whose text has been given out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _delta(self, final: bool) -> str:
        before = self._decode(self.ids[self._start:self._read])
        text = self._decode(self.ids[self._start:])
        if (text.endswith("\ufffd") and not final) or not text.startswith(before):
            return ""
        self._start, self._read = self._read, len(self.ids)
        return text[len(before):]

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        return self._delta(final=False)

    def flush(self) -> str:
        return self._delta(final=True)


def stable_text(tokenizer, ids: list[int]) -> str:
    """decode(ids) without a trailing partial character (U+FFFD from a multi-byte character split across tokens)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False).rstrip("\ufffd")


def text_delta(tokenizer, ids: list[int], prev_len: int, final: bool) -> str:
    """Stateless streaming delta: the text ``ids`` add over ``ids[:prev_len]``.

    Deltas for prev_len = 0 = n_0 < n_1 < … < n_k = len(ids) (the last with ``final``) concatenate to
    ``decode(ids)``, and no delta contains a broken character. Used by the Triton postprocessing model, which sees
    each streamed response on its own.
    """
    before = stable_text(tokenizer, ids[:prev_len]) if prev_len else ""
    now = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    if not final:
        now = now.rstrip("\ufffd")
    return now[len(before):] if now.startswith(before) else now


def encode_bias(tokenizer, words) -> tuple[tuple[int, float], ...]:
    """TensorRT-LLM's embedding bias from its word-level inputs, (word, weight) pairs (its preprocessing model's
    rule): each word tokenized alone with the tokenizer's default special tokens, and its weight added to every one
    of its tokens' entries -> ``SamplingParams.logit_bias``."""
    from trtllm_dflash.runtime.sampling import bias_pairs

    ids, weights = [], []
    for word, weight in words:
        tokens = tokenizer.encode(word)
        ids += tokens
        weights += [float(weight)] * len(tokens)
    return bias_pairs(ids, weights)


def encode_words(tokenizer, words) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's bad words as token ids: each non-empty word tokenized alone, without special tokens (as its
    preprocessing model does)."""
    return tuple(tuple(ids) for ids in (tokenizer.encode(w, add_special_tokens=False) for w in words if w) if ids)
