"""perf/ngram_acceptance.py: per-slot conditional acceptance of prompt lookup's proposals, counted by hand."""

import json

from conftest import perf_script, run_script


def test_counts_by_hand(tmp_path):
    acceptance = perf_script("ngram_acceptance").acceptance

    # prompt 1 2 3, output 1 2 3 9: at the output's "1" the tail "3 1" never occurred before; at "1 2" (at 0) the
    # proposal is 3 1 2: slot 1 right (3), slot 2 wrong (9 follows); at "1 2 3" the proposal 1 2 3 is wrong at once
    res = acceptance([([1, 2, 3, 1, 2, 3, 9], 3)], block_size=5)
    assert res["positions"] == 3 and res["with_proposal"] == round(2 / 3, 4)
    assert res["reached"] == [2, 1, 0, 0] and res["conditional_acceptance"] == [0.5, 0.0, None, None]
    greedy = tmp_path / "greedy.json"
    greedy.write_text(json.dumps([{"prompt_ids": [1, 2, 3], "token_ids": [1, 2, 3, 9]}]))
    run = run_script("perf/ngram_acceptance.py", [str(greedy), "--block-size", "5"])
    assert run.returncode == 0 and json.loads(run.stdout)["reached"] == [2, 1, 0, 0]
    run = run_script("perf/ngram_acceptance.py", [str(tmp_path / "nope")])
    assert run.returncode == 2 and "does not exist" in run.stderr


def test_match_table_and_forecast_loss_by_hand():
    """The same sequence: at the output's "1 2" the 2-gram (1 2) matched at the start (2 tokens, no earlier
    occurrence to disagree): 3 accepted, 1 rejected (9 came); at "1 2 3" a 3-token match proposes 1, rejected. The
    decoder's walk verifies only the first (then it is past the end): slot 1 right, slot 2 wrong."""
    import math

    script = perf_script("ngram_acceptance")
    by_match, forecast_loss = script.by_match, script.forecast_loss

    from trtllm_dflash.runtime.acceptance import NGRAM_PRIOR
    from trtllm_dflash.runtime.lookup import LOOKUP_FIRST, LOOKUP_NEXT

    seqs = [([1, 2, 3, 1, 2, 3, 9], 3)]
    table = by_match(seqs, block_size=5)
    assert table["first"][0][:3] == [1.0, 0.0, None] and table["first_n"] == [[1, 1, 0, 0, 0, 0], [0] * 6]
    assert table["next"][:2] == [0.0, None] and table["next_n"][:2] == [1, 0]
    loss = forecast_loss(seqs, block_size=5, strengths=(1e6,))
    history = (-math.log(NGRAM_PRIOR[0]) - math.log(1 - NGRAM_PRIOR[1])) / 2
    match = (-math.log(LOOKUP_FIRST[0][0]) - math.log(1 - max(LOOKUP_NEXT[0], LOOKUP_FIRST[0][0]))) / 2
    assert loss["history"] == {"all_slots": round(history, 4), "slot_1": round(-math.log(NGRAM_PRIOR[0]), 4),
                               "steps": 1}
    assert loss["match x1e+06"]["all_slots"] == round(match, 4)
