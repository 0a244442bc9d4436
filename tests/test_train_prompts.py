"""Training prompts come from installed Python sources and never overlap the evaluation sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_dflash.datasets import humaneval_prompts
from trtllm_dflash.train.prompts import CODE_TEMPLATE, EvalIndex, ngrams

SHIPPED = Path(__file__).parents[1] / "trtllm_dflash" / "data" / "drafters" / "smollm2-135m-instruct-dflash"


@pytest.fixture(scope="module")
def index():
    return EvalIndex.build()


def test_eval_index_covers_both_sets(index):
    assert len(index.entry_points) == 158 and "has_close_elements" in index.entry_points  # 164 tasks, 158 names
    assert len(index.ngrams) > 5000


def test_overlap_check_catches_evaluation_prompts(index):
    """Every HumanEval prompt, wrapped like a training prompt, is flagged; so is a paraphrase-free MT-Bench copy."""
    for p in humaneval_prompts()[:20]:
        code = p.text.split("```python\n", 1)[1]
        assert index.overlap(CODE_TEMPLATE.format(code=code)) is not None
    from trtllm_dflash.datasets import mtbench_prompts

    q = mtbench_prompts()[0].text
    assert index.overlap(f"Explain the following in simple terms:\n\n{q}") is not None
    assert index.overlap("def has_close_elements(x):\n    pass") is not None  # entry-point name alone


def test_overlap_check_passes_unrelated_text(index):
    text = CODE_TEMPLATE.format(code='def shuffle_deck(cards, seed):\n    """Return the cards in a seeded order."""\n')
    assert index.overlap(text) is None
    assert ngrams("a b c d e f g h i") == {"a b c d e f g h", "b c d e f g h i"}


def test_shipped_training_prompts_do_not_overlap(index):
    """The prompts the shipped drafter was trained on (recorded with it) are disjoint from HumanEval and MT-Bench."""
    from trtllm_dflash.datasets import read_jsonl

    path = SHIPPED / "training_prompts.jsonl.gz"
    if not path.is_file():
        pytest.skip("no shipped drafter yet")
    rows = read_jsonl(path)
    assert len(rows) >= 100
    bad = [(r["id"], index.overlap(r["prompt"])) for r in rows if index.overlap(r["prompt"]) is not None]
    assert not bad, bad[:3]
