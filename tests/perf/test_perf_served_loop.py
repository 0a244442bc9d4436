"""perf/bench_served_loop.py on the real SmolLM2 pair: the serving loop (in-process engines, make-repo's ``auto``
settings) and the decoder answer the same prompt in turns, token-identical; ``--out`` holds what was printed; bad
options exit 2."""

import json

from conftest import run_script


def run(args):
    return run_script("perf/bench_served_loop.py", args)


def test_the_loop_and_the_decoder_answer_alike(smollm2, tmp_path):
    out = tmp_path / "res" / "loop.json"
    r = run(["--dataset", "humaneval", "--limit", "1", "--max-new-tokens", "24", "--repeats", "2", "--threads", "1",
             "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--out", str(out)])
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout)
    assert json.loads(out.read_text()) == doc
    assert doc["identical_tokens"] is True and doc["prompts"] == 1 and doc["repeats"] == 2 and doc["ngram"]
    for path in ("decoder", "loop"):
        x = doc[path]
        assert len(x["answers_tokens_per_second"]) == 2 and x["tokens_per_second"] > 0
        assert x["mean_acceptance_length"] >= 1
        k = x["adaptive"]["k_distribution"]
        assert sum(k.values()) == x["adaptive"]["steps"] > 0  # the warm-up's steps included
    assert doc["loop_over_decoder"] == round(doc["loop"]["tokens_per_second"] / doc["decoder"]["tokens_per_second"], 3)


def test_bad_options_exit_2():
    r = run(["--repeats", "0"])
    assert r.returncode == 2 and "--repeats 0" in r.stderr
    r = run(["--target", "/x"])
    assert r.returncode == 2 and "--target and --drafter go together" in r.stderr
