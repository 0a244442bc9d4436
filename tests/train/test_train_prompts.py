"""Training prompts come from installed Python sources and never overlap the evaluation sets."""

from __future__ import annotations

from pathlib import Path

import pytest

from trtllm_dflash.datasets import humaneval_prompts
from trtllm_dflash.train.prompts import CODE_TEMPLATE, EvalIndex, ngrams

SHIPPED = Path(__file__).parents[2] / "trtllm_dflash" / "data" / "drafters" / "smollm2-135m-instruct-dflash"


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


def test_pool_later_passes_keep_pass_one_and_give_each_item_new_tasks(index, tmp_path):
    """``--passes N`` leaves the one-pass pool's rows untouched (earlier shards stay valid) and appends each item under
    a different task per pass, still through the overlap check (a HumanEval entry point is rejected in every pass)."""
    from trtllm_dflash.train.pool import build_pool
    from trtllm_dflash.train.prompts import CHAT_TASKS, CODE_TASKS

    pkg = tmp_path / "toypkg"
    pkg.mkdir()
    para = "This paragraph describes how the toy package stores {} values in a small ring buffer for later use."
    funcs = "".join(f'def scale_{i}(x, k):\n    """Multiply every item of x by k, {i} times over, and return a new list."""\n'
                    f"    return x\n\n" for i in range(6))
    (pkg / "__init__.py").write_text(f'"""{para.format("integer")}\n\n{para.format("float")}"""\n\n{funcs}'
                                     'def has_close_elements(numbers, threshold):\n    """Check two numbers closer than'
                                     ' the threshold, as the evaluation set asks."""\n    return False\n')
    roots = [("toypkg", pkg)]
    one, s1 = build_pool(index=index, roots=roots)
    three, s3 = build_pool(index=index, roots=roots, passes=3)
    assert len(one) == 8 and s1["rejected_overlap"] == {"function name": 1}
    assert three[: len(one)] == one and len(three) == 3 * len(one)
    assert s3["rejected_overlap"] == {"function name": 3} and s3["passes"] == 3
    by_id = {r["id"]: r["prompt"] for r in three}
    for r in one:
        p2, p3 = by_id[r["id"] + "#p2"], by_id[r["id"] + "#p3"]
        tasks = CODE_TASKS if r["id"].startswith("code/") else CHAT_TASKS
        heads = {t.split("{")[0] for t in tasks}
        assert all(any(p.startswith(h) for h in heads) for p in (p2, p3)) and len({p2, p3, r["prompt"]}) == 3
    with pytest.raises(ValueError, match="passes=5"):
        build_pool(index=index, roots=roots, passes=5)
