"""A retrieval datastore: proposals for the tree verify's lookup chains from a corpus of the target's own outputs.

Prompt lookup proposes what followed the context's last tokens earlier in the same sequence. A datastore does the same
over a corpus — the drafter's regenerated training responses, which are the target's own greedy outputs on other
prompts — so a reply that starts like many earlier replies ("Here are some ways to …", a docstring after ``def``)
gets their most common continuation proposed (retrieval-based speculation, as in REST). The verify keeps a proposal
only where the target agrees, so a datastore can cost τ nothing and the output stays the target's greedy output.

The store is the corpus's tokens, sequences separated by −1, with, for every n in ``NGRAMS``, the start of every
n-gram sorted by the n-gram's hash (a 64-bit polynomial; a match is checked against the tokens, so a collision costs
nothing but time). ``propose`` finds the longest n whose last n context tokens occur in the corpus, takes the
continuations after their latest ``max_matches`` occurrences, and returns ``count`` paths through the trie of those
continuations: the c-th most frequent first token, then at each depth the most frequent next token among the
continuations that agree so far (ties: the smaller token id, so the result never depends on the machine). Only the
tokens are saved (``save``: safetensors, uint16 when the vocabulary allows); the index is rebuilt on ``load`` (about a
second per million tokens)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from trtllm_dflash.errors import ArtifactError

# A drafter directory's datastore (``generate --tree`` finds it there). safetensors inside, but not named *.safetensors:
# vLLM (and SGLang, TRT-LLM) load every top-level *.safetensors of a drafter directory as weights and refuse the
# unknown tensor ``tokens``, so only config.json + model.safetensors may look like weights there.
DATASTORE_FILE = "datastore.dflash"
LEGACY_DATASTORE_FILE = "datastore.safetensors"  # the name before; ``commands.common.drafter_datastore`` warns on it
NGRAMS = (8, 6, 5, 4, 3, 2)  # n-gram lengths matched, longest first
MAX_MATCHES = 512  # continuations a proposal is ranked over: those after the latest occurrences
MAX_LEN = 64  # the longest proposal
_PRIME = np.uint64(1_000_003)
_SEP = -1


def hash_windows(tokens: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The hash of every n-token window of ``tokens`` [T] that holds no separator, and its start."""
    starts = np.arange(len(tokens) - n + 1, dtype=np.int64)
    h = np.zeros(len(starts), dtype=np.uint64)
    ok = np.ones(len(starts), dtype=bool)
    with np.errstate(over="ignore"):
        for j in range(n):
            col = tokens[j: j + len(starts)]
            h = h * _PRIME + col.astype(np.uint64)
            ok &= col != _SEP
    return h[ok], starts[ok]


_POWERS = np.array([pow(int(_PRIME), k, 2 ** 64) for k in range(max(NGRAMS))], dtype=np.uint64)


def tail_hashes(context: Sequence[int]) -> np.ndarray:
    """``hash_windows``' hash of the context's last n tokens for every n = 1 .. max(NGRAMS) at once (entry n − 1; the
    same polynomial, newest token times P^0): one small numpy call per proposal instead of one per n."""
    rev = np.asarray(context[max(len(context) - len(_POWERS), 0):], dtype=np.int64)[::-1].astype(np.uint64)
    with np.errstate(over="ignore"):
        return np.cumsum(rev * _POWERS[: len(rev)], dtype=np.uint64)


class Datastore:
    """The corpus's tokens [T] (int32, −1 between sequences) and their n-gram index (module docstring)."""

    def __init__(self, tokens: np.ndarray, meta: dict | None = None) -> None:
        self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)
        self.meta = dict(meta or {})
        self._padded = np.concatenate([self.tokens, np.full(MAX_LEN, _SEP, dtype=np.int32)])  # a continuation's tail
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for n in NGRAMS:
            h, starts = hash_windows(self.tokens, n)
            order = np.argsort(h, kind="stable")  # equal hashes keep position order: the latest occurrences last
            self._index[n] = (h[order], starts[order])

    @classmethod
    def from_sequences(cls, sequences: Iterable[Sequence[int]], meta: dict | None = None) -> Datastore:
        parts, count = [], 0
        for seq in sequences:
            parts.append(np.asarray(seq, dtype=np.int32))
            parts.append(np.array([_SEP], dtype=np.int32))
            count += 1
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        return cls(tokens, {**(meta or {}), "num_sequences": count, "num_tokens": int((tokens != _SEP).sum())})

    def ngram_hashes(self, n: int) -> np.ndarray:
        """The sorted hashes of every n-gram in the store (n in ``NGRAMS``)."""
        return self._index[n][0]

    @property
    def num_tokens(self) -> int:
        return int((self.tokens != _SEP).sum())

    def save(self, path: str | Path) -> None:
        """Tokens (uint16 where every id fits, −1 stored as 65535) and ``meta``, written atomically."""
        import torch

        from trtllm_dflash.models.weights import write_state_dict

        small = self.tokens.max(initial=0) < np.iinfo(np.uint16).max
        data = self.tokens.astype(np.uint16) if small else self.tokens  # −1 wraps to 65535 in uint16
        write_state_dict({"tokens": torch.from_numpy(data)}, path, metadata={
            "format": "trtllm-dflash-datastore", "meta": json.dumps(self.meta, sort_keys=True)})
        os.chmod(path, 0o644)  # a shareable data file, not the temporary file's 0600

    @classmethod
    def load(cls, path: str | Path) -> Datastore:
        from safetensors import safe_open

        path = Path(path)
        fix = "build one with `trtllm-dflash datastore --from REGEN_DIR --out FILE`"
        if not path.is_file():
            raise ArtifactError(path, "no such datastore file", fix)
        try:
            with safe_open(str(path), "np") as f:
                info = f.metadata() or {}
                raw = f.get_tensor("tokens") if "tokens" in f.keys() else None
        except Exception as exc:  # safetensors raises its own error types for a damaged file
            raise ArtifactError(path, f"unreadable as safetensors ({exc})", fix) from exc
        if info.get("format") != "trtllm-dflash-datastore" or raw is None:
            raise ArtifactError(path, "is not a trtllm-dflash datastore (no 'tokens' with its format tag)", fix)
        tokens = raw.astype(np.int32)
        if raw.dtype == np.uint16:
            tokens[raw == np.iinfo(np.uint16).max] = _SEP
        return cls(tokens, json.loads(info.get("meta", "{}")))

    def continuations(self, context: Sequence[int], max_len: int, max_matches: int = MAX_MATCHES) -> np.ndarray:
        """What followed the latest occurrences of the context's longest recurring tail (n in ``NGRAMS``):
        [m, max_len], −1 past a sequence's end; [0, max_len] if no tail of n >= 2 tokens occurs."""
        if not 1 <= max_len <= MAX_LEN:
            raise ValueError(f"max_len = {max_len}: a proposal holds 1 to {MAX_LEN} tokens")
        last = np.asarray(context[max(len(context) - max(NGRAMS), 0):], dtype=np.int64)  # every tail matched
        padded, keys = self._padded, tail_hashes(last)
        for n in NGRAMS:
            if n > len(last):
                continue
            tail = last[len(last) - n:]
            hashes, starts = self._index[n]
            key = keys[n - 1]  # the context holds no separator
            lo, hi = np.searchsorted(hashes, key, "left"), np.searchsorted(hashes, key, "right")
            if lo == hi:
                continue
            found = starts[lo:hi]
            found = found[(padded[found[:, None] + np.arange(n)] == tail).all(1)][-max_matches:]  # not a collision
            if len(found) == 0:
                continue
            conts = padded[found[:, None] + n + np.arange(max_len)]  # [m, max_len]
            conts[np.maximum.accumulate(conts == _SEP, axis=1)] = _SEP  # nothing after a sequence's end
            conts = conts[conts[:, 0] != _SEP]
            if len(conts):
                return conts
        return np.zeros((0, max_len), dtype=np.int32)

    def propose(self, context: Sequence[int], max_len: int, count: int, max_matches: int = MAX_MATCHES
                ) -> list[list[int]]:
        """Up to ``count`` proposals of at most ``max_len`` tokens, best first (module docstring)."""
        conts = self.continuations(context, max_len, max_matches)
        if not len(conts) or count < 1:
            return []
        firsts, counts = np.unique(conts[:, 0], return_counts=True)
        out = []
        for first in firsts[np.argsort(-counts, kind="stable")][:count]:
            live, path = conts[conts[:, 0] == first], [int(first)]
            for depth in range(1, max_len):
                if (live[:, depth:] == live[0, depth:]).all():  # one continuation left (often): the rest of it
                    rest = live[0, depth:]
                    path += rest[: int(np.argmax(rest == _SEP)) if (rest == _SEP).any() else len(rest)].tolist()
                    break
                col = live[:, depth]
                col = col[col != _SEP]
                if not len(col):
                    break
                values, counts_d = np.unique(col, return_counts=True)
                token = values[int(np.argmax(counts_d))]  # the first maximum: the smaller id on a tie
                path.append(int(token))
                live = live[live[:, depth] == token]
            out.append(path)
        return out
