"""runtime.mode.DecodeMode: one value for the decoding mode, its compact spelling parsed and written back."""

import pytest

from trtllm_dflash.runtime.mode import DecodeMode


@pytest.mark.parametrize("text,mode", [
    ("16", DecodeMode(16)),
    ("16+ngram", DecodeMode(16, ngram=True)),
    ("16+tree", DecodeMode(16, ngram=True, tree=True)),  # the tree's lookup chains are prompt lookup's
    ("auto", DecodeMode("auto")),
    ("auto+ngram", DecodeMode("auto", ngram=True)),
    ("auto+tree", DecodeMode("auto", ngram=True, tree=True)),
    ("1", DecodeMode(1)),
])
def test_the_compact_spelling_round_trips(text, mode):
    assert DecodeMode.parse(text) == mode
    assert str(mode.label) == text and DecodeMode.parse(str(mode.label)) == mode
    assert mode.decoder_options()["block_size"] == mode.block_size


def test_labels_keep_a_plain_block_an_integer_as_the_benchmarks_report_it():
    assert DecodeMode(8).label == 8 and DecodeMode("auto").label == "auto"
    assert DecodeMode.from_flags(4, ngram=True).label == "4+ngram"
    assert DecodeMode.from_flags(16, tree=True).label == "16+tree"
    assert DecodeMode.from_flags("auto", max_block_size=8).max_block_size == 8
    assert DecodeMode.from_flags(16, max_block_size=8).max_block_size is None  # applies to auto only


@pytest.mark.parametrize("text,why", [("x", "must be 'auto' or an integer >= 1"), ("0", ">= 1"),
                                      ("1+ngram", "need drafts"), ("16+foo", "must be 'auto'"), ("", "must be")])
def test_bad_spellings_are_refused_naming_them(text, why):
    with pytest.raises(ValueError, match=why):
        DecodeMode.parse(text)
    with pytest.raises(ValueError, match=">= 2"):
        DecodeMode.parse("1", min_block=2)


def test_invalid_combinations_are_refused():
    with pytest.raises(ValueError, match="only with 'auto'"):
        DecodeMode(16, max_block_size=8)
    with pytest.raises(ValueError, match="need drafts"):
        DecodeMode(1, tree=True)
