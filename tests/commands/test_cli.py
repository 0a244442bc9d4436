"""The CLI: JSON output of generate, and bad input -> one line on stderr, exit code 2, no traceback."""

import json
import shutil

import pytest

from conftest import run_cli
from trtllm_dflash.assets import SHIPPED_DRAFTER
from trtllm_dflash.cli import main

pytestmark = pytest.mark.slow


def test_generate_json_on_the_real_model(smollm2, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "Name a primary colour."}) + "\n" + json.dumps({"prompt": "Say hi."}) + "\n")
    r = run_cli(["generate", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--prompts-file",
                 str(prompts), "--chat", "--max-new-tokens", "12", "--max-block-size", "4", "--batch-size", "2",  # auto: the default
                 "--json"])
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["prompt"] for x in lines] == ["Name a primary colour.", "Say hi."]
    for x in lines:
        assert x["num_new_tokens"] == len(x["token_ids"]) <= 12
        assert x["text"] and x["tokens_per_second"] > 0
        assert all(1 <= t <= 4 for t in x["acceptance_lengths"])
        assert x["block_size"] == "auto" and len(x["draft_lengths"]) == len(x["acceptance_lengths"])
        assert all(0 <= k <= 3 and t <= k + 1 for k, t in zip(x["draft_lengths"], x["acceptance_lengths"]))
        assert x["mean_acceptance_length"] >= 1


def test_generate_ngram_and_tree_give_the_autoregressive_tokens(smollm2):
    """--ngram on the real pair: prompt lookup's proposals are verified where the code repeats itself, and the output
    is the --block-size 1 output; so is --tree's (the drafter's block, its alternates and the lookup chain at once),
    in fewer steps."""
    prompt = "Write a Python function that returns the sum of a list, then the same for the product."
    common = ["generate", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--prompt", prompt,
              "--chat", "--max-new-tokens", "48", "--json", "--logprobs"]
    ar, looked = run_cli([*common, "--block-size", "1"]), run_cli([*common, "--block-size", "16", "--ngram"])
    assert ar.returncode == 0 and looked.returncode == 0, ar.stderr + looked.stderr
    a, b = json.loads(ar.stdout.splitlines()[-1]), json.loads(looked.stdout.splitlines()[-1])
    assert a["token_ids"] == b["token_ids"] and b["ngram"] is True
    assert len(a["logprobs"]) == len(a["token_ids"]) and b["logprobs"] == pytest.approx(a["logprobs"], abs=1e-4)
    assert a["cum_log_prob"] == pytest.approx(sum(a["logprobs"]), abs=1e-3) and a["cum_log_prob"] < 0
    assert 0 < b["lookup_steps"] < len(b["acceptance_lengths"]) <= len(a["acceptance_lengths"])
    tree = run_cli([*common, "--block-size", "16", "--tree"])
    assert tree.returncode == 0, tree.stderr
    c = json.loads(tree.stdout.splitlines()[-1])
    assert c["token_ids"] == a["token_ids"] and len(c["acceptance_lengths"]) <= len(b["acceptance_lengths"])
    bare = run_cli([*common, "--block-size", "16", "--tree", "--datastore", "none"])  # the shipped datastore off
    assert bare.returncode == 0, bare.stderr
    assert json.loads(bare.stdout.splitlines()[-1])["token_ids"] == a["token_ids"]
    # --bad-word: a word of the answer is never generated, losslessly (autoregressive = block 16 + lookup)
    from trtllm_dflash.runtime.text import load_tokenizer

    tok = load_tokenizer(smollm2["target"])
    word = next(w for w in (tok.decode([t]) for t in a["token_ids"][2:]) if w.strip()
                and len(tok.encode(w, add_special_tokens=False)) == 1)  # one answer token, alone the same token
    banned = [run_cli([*common, "--block-size", b, "--bad-word", word, "--bad-word", ""]) for b in ("1", "16")]
    assert all(r.returncode == 0 for r in banned), banned[0].stderr + banned[1].stderr
    x, y = (json.loads(r.stdout.splitlines()[-1]) for r in banned)
    assert x["token_ids"] == y["token_ids"] != a["token_ids"]


def test_generate_bias_changes_the_answer_losslessly_and_a_bad_one_is_named(smollm2):
    """--bias TEXT=WEIGHT (TensorRT-LLM's embedding bias): an answer token pushed down changes the answer, and
    block 16 + lookup gives the autoregressive tokens with the same bias; a value without a weight exits 2 naming it."""
    from trtllm_dflash.runtime.text import load_tokenizer

    common = ["generate", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--prompt",
              "Write a Python function that returns the sum of a list.", "--chat", "--max-new-tokens", "32", "--json"]
    plain = run_cli([*common, "--block-size", "1"])
    assert plain.returncode == 0, plain.stderr
    a = json.loads(plain.stdout.splitlines()[-1])["token_ids"]
    tok = load_tokenizer(smollm2["target"])
    word = next(w for w in (tok.decode([t]) for t in a[2:]) if w.strip() and tok.encode(w) == tok.encode(w)[:1])
    biased = [run_cli([*common, "--block-size", b, "--bias", f"{word}=-9", "--bias", "==0.5"]) for b in ("1", "16")]
    assert all(r.returncode == 0 for r in biased), biased[0].stderr + biased[1].stderr
    x, y = (json.loads(r.stdout.splitlines()[-1])["token_ids"] for r in biased)
    assert x == y != a
    bad = run_cli([*common, "--bias", "sorry"])
    assert bad.returncode == 2 and "--bias='sorry': must be TEXT=WEIGHT" in bad.stderr, bad.stderr


def test_generate_min_new_tokens_holds_the_stop_back_losslessly(smollm2):
    """A raw prompt SmolLM2-Instruct answers with nothing at once; --min-new-tokens gets that many tokens, the same
    from the tree verify as from autoregressive decoding (the stop masked out of the target's choice alike)."""
    common = ["generate", "--target", smollm2["target"], "--drafter", smollm2["drafter"], "--prompt",
              "Write a long story about a dragon.", "--max-new-tokens", "24", "--json"]
    free = run_cli([*common, "--block-size", "1"])
    ar = run_cli([*common, "--block-size", "1", "--min-new-tokens", "24"])
    tree = run_cli([*common, "--block-size", "16", "--tree", "--min-new-tokens", "24"])
    assert free.returncode == ar.returncode == tree.returncode == 0, free.stderr + ar.stderr + tree.stderr
    f, a, t = (json.loads(r.stdout.splitlines()[-1]) for r in (free, ar, tree))
    assert f["num_new_tokens"] == 0 and a["num_new_tokens"] == 24 and t["token_ids"] == a["token_ids"]


def test_demo_assets_is_idempotent_json(smollm2):
    r = run_cli(["demo-assets"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"target": smollm2["target"], "drafter": smollm2["drafter"]}


@pytest.mark.parametrize(
    "extra, words",
    [
        (["--prompt", ""], "--prompt='': must not be empty"),
        (["--prompt", "hello " * 9000], "exceeds the target's context limit (8192 tokens)"),
        (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens=0: must be >= 1"),
        (["--prompt", "hi", "--block-size", "32"], "block_size=32: must be <= the drafter's trained block_size (16)"),
        (["--prompt", "hi", "--temperature", "-0.5"], "--temperature=-0.5: must be >= 0"),
        (["--prompt", "hi", "--block-size", "8", "--max-block-size", "8"],
         "--max-block-size=8: only applies to --block-size auto (the default)"),
        (["--prompt", "hi", "--block-size", "1", "--ngram"], "--ngram=True: needs a block size > 1"),
        (["--prompt", "hi", "--block-size", "1", "--tree"], "the tree verify needs a block size >= 2"),
        (["--prompt", "hi", "--datastore", "nowhere.safetensors"], "nowhere.safetensors: no such datastore file"),
        (["--prompt", "hi", "--block-size", "16", "--datastore", str(SHIPPED_DRAFTER / "datastore.dflash")],
         "proposes for the tree verify's lookup chains only"),
        (["--prompt", "hi", "--tree", "--no-ngram", "--datastore", str(SHIPPED_DRAFTER / "datastore.dflash")],
         "proposes for the tree verify's lookup chains only"),
        (["--prompt", "hi", "--block-size", "auto", "--max-block-size", "32"],
         "max_block_size=32: must be <= the drafter's trained block_size (16)"),
        (["--prompt", "hi", "--repetition-penalty", "0"], "--repetition-penalty=0.0: must be a finite number > 0"),
        (["--prompt", "hi", "--top-k", "-1"], "--top-k=-1: must be >= 0"),
        (["--prompt", "hi", "--max-new-tokens", "4", "--min-new-tokens", "5"],
         "--min-new-tokens=5: must be in [0, --max-new-tokens=4]"),
        (["--prompt", "hi", "--device", "cpu", "--cuda-graphs"],
         "cuda_graphs=True: needs a CUDA device, not cpu; use --device cuda, or drop --cuda-graphs"),
    ],
)
def test_bad_input_exit_2_one_line(smollm2, capsys, extra, words):
    code = main(["generate", "--target", smollm2["target"], "--drafter", smollm2["drafter"], *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert words in err and len(err.splitlines()) == 1, err


def test_mismatched_pair_and_corrupt_weights_exit_2(smollm2, tiny_dirs, tmp_path):
    r = run_cli(["generate", "--target", smollm2["target"], "--drafter", str(tiny_dirs["llama"][1]), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "hidden_size=64: must equal the target's hidden_size (576)" in r.stderr
    bad = tmp_path / "drafter"
    shutil.copytree(smollm2["drafter"], bad)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    r = run_cli(["generate", "--target", smollm2["target"], "--drafter", str(bad), "--prompt", "hi"])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.safetensors: unreadable safetensors" in r.stderr
    # the console entry point itself (python -m trtllm_dflash in a fresh interpreter): its exit code is main's
    r = run_cli(["generate", "--target", str(tmp_path / "missing"), "--drafter", str(bad), "--prompt", "hi"], fresh=True)
    assert r.returncode == 2 and "target directory does not exist" in r.stderr
