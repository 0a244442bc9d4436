"""Incremental detokenization: deltas concatenate to the full text and never show broken characters."""

import pytest

from trtllm_dflash.runtime.text import IncrementalDetokenizer, load_tokenizer

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("text", ["naïve café — 東京タワー 🚀🎉 done", "def f(x):\n    return x ** 2  # ½"])
def test_stream_deltas_concatenate_to_full_text(smollm2, text):
    tok = load_tokenizer(smollm2["target"])
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
