"""Prompt lookup: proposals copied from the sequence's own context, and the features that predict their acceptance.

A context that ends in an n-gram seen earlier proposes the tokens that followed it (``ngram_lookup``); the
match length and whether the n-gram's two latest occurrences agree give the proposal's own acceptance prior
(``Lookup.prior``). The decoding loop, the tree verify's lookup chains and the training audit use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


# P(first token accepted) by match length (bins: ≤ 2, 3, 4–5, 6–9, 10–19, ≥ 20 tokens), when the n-gram's latest two
# earlier occurrences agree on the next token or it has one (row 0) and when they disagree (row 1); later slots'
# conditional acceptance by match length. `perf/ngram_acceptance.py --by-match` (at 0620e3a) on greedy outputs
# (128 tokens) of 325 training pool prompts (every 200th of the shipped drafter's training prompts); on HumanEval's and
# MT-Bench's greedy outputs the same predictor has a lower log-loss per verified slot than the sequence's own history
# with ``NGRAM_PRIOR``.
LOOKUP_MATCH_BINS = (2, 3, 5, 9, 19)
LOOKUP_FIRST = ((0.63, 0.77, 0.85, 0.90, 0.93, 0.97), (0.17, 0.16, 0.24, 0.36, 0.54, 0.77))
LOOKUP_NEXT = (0.81, 0.84, 0.88, 0.91, 0.94, 0.97)


LOOKUP_MIN_N = 2  # the decoder's prompt lookup proposes the continuation of a recurring 2- or 3-gram, not a 1-gram


def held(proposal: list[int], chains: Sequence[list[int]]) -> bool:
    """Whether one of ``chains`` already starts with ``proposal`` (verifying it again would add nothing)."""
    return any(chain[: len(proposal)] == proposal for chain in chains)


def ngram_candidates(context: Sequence[int], max_len: int, max_candidates: int, max_n: int = 3, min_n: int = 1,
                     per_n: int = 1) -> list[list[int]]:
    """Prompt lookup's proposals, best first: for n = max_n down to min_n, the tokens that followed each of the
    ``per_n`` latest earlier occurrences of the context's last n tokens (at most ``max_len`` of them), skipping one
    that an earlier proposal already starts with; at most ``max_candidates``, [] if no such suffix recurs."""
    size, found = len(context), []
    for n in range(min(max_n, size - 1), max(min_n, 1) - 1, -1):
        tail, taken = list(context[size - n:]), 0
        for start in range(size - n - 1, -1, -1):
            if context[start] == tail[0] and list(context[start:start + n]) == tail:
                cont = list(context[start + n:start + n + max_len])  # never empty: start + n < size
                if not held(cont, found):
                    found.append(cont)
                    taken += 1
                if len(found) == max_candidates:
                    return found
                if taken == per_n:
                    break
    return found


def ngram_continuation(context: Sequence[int], max_len: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the context's last n tokens
    (n = max_n down to min_n), at most ``max_len`` of them; [] if no such suffix recurs."""
    return ngram_lookup(context, max_len, max_n, min_n).tokens


@dataclass(frozen=True)
class Lookup:
    """Prompt lookup's proposal for one sequence, with what predicts whether the target will accept it."""

    tokens: list[int]  # what followed the latest earlier occurrence of the context's last n tokens
    match: int = 0  # tokens before the proposal that equal the context's end (the n-gram, extended backwards)
    split: bool = False  # the n-gram's two latest earlier occurrences were followed by different tokens

    def prior(self, num_drafts: int) -> list[float]:
        """P(slot j accepted | slots before it were), j = 1..num_drafts, for this match (``LOOKUP_FIRST``)."""
        b = lookup_bin(self.match)
        return [LOOKUP_FIRST[int(self.split)][b]] + [LOOKUP_NEXT[b]] * (num_drafts - 1)


def lookup_bin(match: int) -> int:
    """The index of a match length's bin in ``LOOKUP_FIRST`` / ``LOOKUP_NEXT`` (``LOOKUP_MATCH_BINS`` upper bounds)."""
    return next((i for i, top in enumerate(LOOKUP_MATCH_BINS) if match <= top), len(LOOKUP_MATCH_BINS))


MAX_MATCH = 32  # a match is extended backwards at most this far (the last bin of LOOKUP_MATCH_BINS starts at 20)


def ngram_lookup(context: Sequence[int], max_len: int, max_n: int = 3, min_n: int = 1) -> Lookup:
    """``ngram_continuation`` with its ``Lookup`` features: how far back the matched occurrence agrees with the
    context's end, and whether the n-gram's previous occurrence was followed by another token (host scans)."""
    size = len(context)
    for n in range(min(max_n, size - 1), max(min_n, 1) - 1, -1):
        tail = list(context[size - n:])
        latest = None
        for start in range(size - n - 1, -1, -1):
            if context[start] == tail[0] and list(context[start:start + n]) == tail:
                if latest is not None:
                    return Lookup(tokens, match, context[start + n] != tokens[0])
                latest, tokens = start, list(context[start + n:start + n + max_len])  # never empty: start + n < size
                match = n
                while match < MAX_MATCH and start - (match - n) > 0 and \
                        context[start - (match - n) - 1] == context[size - match - 1]:
                    match += 1
        if latest is not None:
            return Lookup(tokens, match)
    return Lookup([])
