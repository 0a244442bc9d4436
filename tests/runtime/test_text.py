"""Incremental detokenization: deltas concatenate to the full text and never show broken characters."""

import pytest

from trtllm_dflash.runtime.text import IncrementalDetokenizer, load_tokenizer, text_delta

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", ["naïve café — 東京タワー 🚀🎉 done", "def f(x):\n    return x ** 2  # ½"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_stream_deltas_concatenate_to_full_text(smollm2, text, step):
    """Pushed ``step`` tokens at a time (a verify commits several; the Triton entry models push each response's)."""
    tok = load_tokenizer(smollm2["target"])
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(ids[j: j + step]) for j in range(0, len(ids), step)] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("text", ["naïve café — 東京タワー 🚀🎉 done", "def f(x):\n    return x ** 2  # ½"])
@pytest.mark.parametrize("step", [1, 2, 3])
def test_served_deltas_concatenate_to_full_text(smollm2, text, step):
    """The Triton entry models' stateless deltas (``text_delta``: each response knows only its tokens so far and how
    many were reported before), one response per ``step`` tokens as a verify commits several: no broken
    character in any delta, and together the whole text."""
    tok = load_tokenizer(smollm2["target"])
    ids = tok.encode(text, add_special_tokens=False)
    bounds = [*range(step, len(ids), step), len(ids)]
    deltas = [text_delta(tok, ids[:n], prev, n == len(ids)) for prev, n in zip([0, *bounds], bounds)]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
