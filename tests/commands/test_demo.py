"""``trtllm-dflash demo`` (README command (a)): the speeds are medians of answers the two models give in turns, every
answer is checked against the baseline's, and the whole command runs on the real pair in-process and through Triton."""

import json
from types import SimpleNamespace

import pytest

from conftest import run_cli
from trtllm_dflash.commands.demo import _summary, timed_turns


def test_the_two_models_take_turns_and_only_the_first_answer_streams():
    calls = []
    d_runs, a_runs = timed_turns(lambda stream: calls.append(("dflash", stream)) or len(calls),
                                 lambda: calls.append(("baseline", False)) or len(calls), 4)
    assert calls == [("dflash", True), ("baseline", False), ("baseline", False), ("dflash", False),
                     ("dflash", False), ("baseline", False), ("baseline", False), ("dflash", False)]
    assert d_runs == [1, 4, 5, 8] and a_runs == [2, 3, 6, 7]


def answer(tps, ids=(1, 2, 3), taus=(2, 1)):
    return SimpleNamespace(tokens_per_second=tps, token_ids=list(ids), acceptance_lengths=list(taus))


def test_the_summary_takes_medians_and_checks_every_answer():
    d = [answer(10.0), answer(30.0, taus=(3,)), answer(20.0)]
    a = [answer(25.0), answer(5.0), answer(15.0)]
    s = _summary("auto", True, d, a, True, "in-process")
    assert s["dflash_tokens_per_second"] == 20.0 and s["baseline_tokens_per_second"] == 15.0
    assert s["speedup"] == round(20 / 15, 3) and s["repeats"] == 3
    assert s["runs"] == {"dflash_tokens_per_second": [10.0, 30.0, 20.0],
                         "baseline_tokens_per_second": [25.0, 5.0, 15.0], "dflash_steps": [2, 1, 2]}
    assert s["mean_acceptance_length"] == 1.8 and s["lossless"] and s["num_new_tokens"] == 3
    assert not _summary("auto", True, [*d[:2], answer(20.0, ids=(1, 2, 4))], a, True, "x")["lossless"]
    assert not _summary("auto", True, d, [*a[:2], answer(15.0, ids=(1, 2))], True, "x")["lossless"]


def test_bad_repeats_is_one_line_and_exit_code_2():
    r = run_cli(["demo", "--repeats", "0"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--repeats=0: must be >= 1" in r.stderr and "e.g. --repeats 3" in r.stderr


def check_demo_output(r, repeats, path):
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads(r.stdout.strip().splitlines()[-1])
    assert s["path"].startswith(path) and s["lossless"] is True and s["drafter_trained"] is True
    assert s["repeats"] == repeats and s["block_size"] == "auto" and s["ngram"] is True
    d, a = s["runs"]["dflash_tokens_per_second"], s["runs"]["baseline_tokens_per_second"]
    assert len(d) == len(a) == len(s["runs"]["dflash_steps"]) == repeats and min(d + a) > 0
    assert all(0 < n <= s["num_new_tokens"] for n in s["runs"]["dflash_steps"])
    # the speed-up is rounded to 3 decimals from the unrounded medians, the tokens/s to 2 (8.30 / 5.25 printed for a
    # 1.583x run: 2.05e-3 off their quotient)
    d_tps, a_tps = s["dflash_tokens_per_second"], s["baseline_tokens_per_second"]
    assert s["speedup"] == pytest.approx(d_tps / a_tps, abs=5e-4 + 0.005 * (1 + d_tps / a_tps) / a_tps)
    assert sorted(d)[0] <= s["dflash_tokens_per_second"] <= sorted(d)[-1]
    assert s["mean_acceptance_length"] >= 1 and 0 < s["num_new_tokens"] <= 24
    return s


@pytest.mark.slow
def test_demo_in_process_on_the_real_pair(smollm2):
    s = check_demo_output(run_cli(["demo", "--in-process", "--max-new-tokens", "24", "--repeats", "2"]), 2,
                          "in-process")
    assert s["adaptive"]["steps"] > 0


@pytest.mark.slow
def test_demo_through_triton_on_the_real_pair(smollm2):
    s = check_demo_output(run_cli(["demo", "--max-new-tokens", "24", "--repeats", "3"]), 3, "triton grpc")
    assert s["ttft_ms"] > 0
