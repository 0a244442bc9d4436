"""``trtllm-dflash export-drafter``: a drafter rewritten in speculators' or z-lab's layout, drafting the same ids."""

import json

import numpy as np
import torch

from conftest import run_cli
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.models import draft_vocab, speculators


def _state_equal(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_shipped_drafter_exports_with_its_draft_vocabulary_and_back(smollm2, tmp_path):
    """The shipped drafter over its draft_vocab.json becomes a reduced-vocabulary speculators drafter with the same
    weights and ids; over the full vocabulary it round-trips to z-lab's layout unchanged."""
    target_dir, drafter_dir = smollm2["target"], smollm2["drafter"]
    common = ["export-drafter", "--target", target_dir, "--dtype", "float32"]
    r = run_cli([*common, "--drafter", drafter_dir, "--to", "speculators", "--out", str(tmp_path / "spec")])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) | {"out": None} == {"format": "speculators", "out": None, "dtype": "float32",
                                                    "draft_vocab_size": 8192}
    assert speculators.is_speculators_dir(tmp_path / "spec")
    _, want = load_pair(target_dir, drafter_dir, draft_vocab="auto")
    _, got = load_pair(target_dir, tmp_path / "spec")
    assert got.spec.draft_vocab_size == 8192 and _state_equal(got, want)
    assert torch.equal(got.draft_head.draft_to_target, want.draft_head.draft_to_target)

    r = run_cli([*common, "--drafter", drafter_dir, "--to", "speculators", "--draft-vocab", "full",
                 "--out", str(tmp_path / "full")])
    assert r.returncode == 0 and json.loads(r.stdout)["draft_vocab_size"] == 49152, r.stderr
    r = run_cli([*common, "--drafter", str(tmp_path / "full"), "--to", "z-lab", "--out", str(tmp_path / "zlab")])
    assert r.returncode == 0, r.stderr
    assert not speculators.is_speculators_dir(tmp_path / "zlab")
    _, full = load_pair(target_dir, drafter_dir, draft_vocab="full")
    _, back = load_pair(target_dir, tmp_path / "zlab", draft_vocab="full")
    assert back.draft_head is None and _state_equal(back, full)


def test_what_a_format_cannot_carry_is_refused_and_nothing_is_written(tiny_dirs, tmp_path):
    tdir, zdir = tiny_dirs["llama"]
    vocab = draft_vocab.write(tmp_path / "ids.json", np.arange(0, 256, 4), {})
    common = ["export-drafter", "--target", tdir]
    r = run_cli([*common, "--drafter", zdir, "--to", "speculators", "--draft-vocab", str(vocab),
                 "--out", str(tmp_path / "spec")])
    assert r.returncode == 0, r.stderr

    cases = [  # (arguments, what the one error line names)
        (["--drafter", str(tmp_path / "spec"), "--to", "z-lab"], "drafter.draft_vocab_size=64"),
        (["--drafter", zdir, "--to", "z-lab"], "is already in the z-lab layout"),
        (["--drafter", str(tmp_path / "spec"), "--to", "z-lab", "--draft-vocab", "full"], "--draft-vocab='full'"),
    ]
    for args, named in cases:
        r = run_cli([*common, *args, "--out", str(tmp_path / "zlab")])
        assert r.returncode == 2 and named in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
        assert not (tmp_path / "zlab").exists()
    r = run_cli([*common, "--drafter", zdir, "--to", "speculators", "--out", str(tmp_path / "spec")])
    assert r.returncode == 2 and "--force" in r.stderr
    r = run_cli([*common, "--drafter", zdir, "--to", "speculators", "--out", str(tmp_path / "spec"), "--force"])
    assert r.returncode == 0 and json.loads(r.stdout)["draft_vocab_size"] == 256, r.stderr
