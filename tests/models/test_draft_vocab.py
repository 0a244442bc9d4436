"""A reduced draft vocabulary for a full-vocabulary drafter (``models.draft_vocab``, ``trtllm-dflash draft-vocab``):
chosen by frequency, read back checked, drafted through rows of the target's head in every path, lossless."""

import json
import random

import numpy as np
import pytest
import torch

from conftest import greedy_reference, make_tiny_pair, run_cli
from trtllm_dflash.checkpoints import load_pair
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.models import draft_vocab as dv
from trtllm_dflash.runtime.datastore import Datastore
from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder


def prompts_for(seed, lengths):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def test_choose_ranks_by_count_then_by_id_and_keeps_what_it_must():
    counts = np.array([5, 0, 9, 5, 1, 9, 0, 2])
    assert dv.choose(counts, 3).tolist() == [0, 2, 5]  # 9, 9, then the smaller id of the two 5s
    assert dv.choose(counts, 3, keep=[6]).tolist() == [2, 5, 6]
    assert dv.choose(counts, 8).tolist() == list(range(8))
    with pytest.raises(ConfigError, match="--size"):
        dv.choose(counts, 0)
    with pytest.raises(ConfigError, match="keep"):
        dv.choose(counts, 1, keep=[1, 2])


@pytest.mark.parametrize("doc,what", [
    ({"format": "other", "ids": [1, 2]}, "is not a draft vocabulary"),
    ({"format": dv.FORMAT, "ids": [3, 2]}, "not distinct ascending"),
    ({"format": dv.FORMAT, "ids": [1, 256]}, r"\[0, 256\)"),
    ({"format": dv.FORMAT, "ids": []}, "holds 0 ids"),
])
def test_a_malformed_file_is_refused_naming_it(tmp_path, doc, what):
    path = tmp_path / dv.DRAFT_VOCAB_FILE
    path.write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match=what) as err:
        dv.read(path, 256)
    assert str(path) in str(err.value) and "trtllm-dflash draft-vocab" in str(err.value)


def test_the_derived_head_is_those_rows_of_the_targets_head():
    w = torch.randn(50, 8, dtype=torch.float64)
    ids = torch.tensor([1, 4, 9, 33])
    head = dv.derived_head(w, ids)
    h = torch.randn(3, 8, dtype=torch.float64)
    assert torch.equal(head(h), torch.nn.functional.linear(h, w)[:, ids])
    assert head.to_target(torch.tensor([[0, 3], [2, 1]])).tolist() == [[1, 33], [9, 4]]
    assert head.lm_head.weight.data_ptr() != w.data_ptr()  # a copy: the target's head is not aliased


def _pair_with_vocab(tmp_path, ids):
    tdir, ddir = make_tiny_pair(tmp_path, "qwen3", seed=2, block_size=8)
    dv.write(ddir / dv.DRAFT_VOCAB_FILE, np.asarray(ids), {"source": "test"})
    return tdir, ddir


class RecordedDrafts(SpeculativeDecoder):
    def __init__(self, *a, **kw):
        super().__init__(*a, proposer=self.recorded, **kw)
        self.drafted: list[int] = []

    def recorded(self, propose, bonus, dcache, rows, committed, num_drafts=None, top=1):
        out = propose(bonus, dcache, rows, committed, num_drafts, top)
        self.drafted += out.flatten().tolist()
        return out


def test_a_reduced_vocabulary_drafts_inside_it_and_stays_lossless(tmp_path):
    ids = list(range(0, 256, 3))  # every third token: most of the target's choices lie outside
    tdir, ddir = _pair_with_vocab(tmp_path, ids)
    target, drafter = load_pair(tdir, ddir, dtype=torch.float64)  # "auto": the directory's draft_vocab.json
    assert drafter.draft_head is not None and drafter.draft_head.draft_vocab_size == len(ids)
    prompts = prompts_for(4, lengths=(6, 13))
    dec = RecordedDrafts(target, drafter, 8)
    out = dec.generate([Request(tuple(p), 24) for p in prompts])
    assert [tuple(r.token_ids) for r in out] == [tuple(x) for x in greedy_reference(target, prompts, 24)]
    assert dec.drafted and set(dec.drafted) <= set(ids)
    _, full = load_pair(tdir, ddir, dtype=torch.float64, draft_vocab="full")
    assert full.draft_head is None


def test_the_whole_vocabulary_as_a_draft_vocabulary_changes_nothing(tmp_path):
    tdir, ddir = _pair_with_vocab(tmp_path, range(256))
    prompts = prompts_for(7, lengths=(9, 3, 15))
    runs = []
    for choice in ("auto", "full"):
        target, drafter = load_pair(tdir, ddir, dtype=torch.float64, draft_vocab=choice)
        assert (drafter.draft_head is not None) == (choice == "auto")
        runs.append([(r.token_ids, r.acceptance_lengths)
                     for r in SpeculativeDecoder(target, drafter, 8).generate([Request(tuple(p), 20) for p in prompts])])
    assert runs[0] == runs[1]


def test_an_explicit_file_is_checked(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=4)
    with pytest.raises(ArtifactError, match="--draft-vocab"):
        load_pair(tdir, ddir, draft_vocab=tmp_path / "nowhere.json")


def test_the_command_writes_the_most_frequent_tokens_and_their_coverage(tmp_path):
    tdir, ddir = make_tiny_pair(tmp_path, "llama", seed=5)
    corpus = [[7, 7, 7, 9, 9, 11], [7, 9, 12, 2]]
    store = tmp_path / "corpus.dflash"
    Datastore.from_sequences(corpus).save(store)
    res = run_cli(["draft-vocab", "--drafter", str(ddir), "--target", str(tdir), "--datastore", str(store),
                   "--size", "3"], timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    # the tiny target's end-of-sequence token is 2 (checkpoints.write_tiny_target): kept, then 7 (4 times), 9 (3)
    assert dv.read(ddir / dv.DRAFT_VOCAB_FILE, 256).tolist() == [2, 7, 9]
    assert doc["draft_vocab_size"] == 3 and doc["corpus_tokens"] == 10 and doc["always"] == [2]
    assert doc["corpus_coverage"] == pytest.approx(0.8)
    bad = run_cli(["draft-vocab", "--drafter", str(ddir), "--target", str(tdir), "--datastore", str(store),
                   "--size", "0"], timeout=120)
    assert bad.returncode == 2 and "--size" in bad.stderr


def test_make_repo_hands_the_draft_vocabulary_to_the_drafter_model(tmp_path, capsys):
    """``make-repo --draft-vocab`` (auto by default): the drafter model reads the file back and drafts through its
    head; ``full`` renders none; a backend whose drafter keeps the target's head is refused by name."""
    from trtllm_dflash.cli import main
    from trtllm_dflash.serve.settings import ModelSettings
    from trtllm_dflash.serve.triton.handlers import DrafterStepModel
    from trtllm_dflash.serve.triton.render import config_parameters

    tdir, ddir = _pair_with_vocab(tmp_path, range(0, 256, 2))
    common = ["make-repo", "--target", str(tdir), "--drafter", str(ddir), "--block-size", "4", "--max-seq-len", "64",
              "--max-sequences", "2"]
    settings = {}
    for choice in ("auto", "full"):
        assert main([*common, "--out", str(tmp_path / choice), "--draft-vocab", choice]) == 0
        text = (tmp_path / choice / "drafter" / "config.pbtxt").read_text()
        settings[choice] = ModelSettings.from_parameters(config_parameters(text))
    assert settings["auto"].draft_vocab == str((ddir / dv.DRAFT_VOCAB_FILE).resolve())
    assert settings["full"].draft_vocab == ""
    assert DrafterStepModel(settings["auto"]).drafter.drafter.draft_head.draft_vocab_size == 128
    assert DrafterStepModel(settings["full"]).drafter.drafter.draft_head is None
    capsys.readouterr()
    assert main([*common, "--out", str(tmp_path / "engine"), "--backend", "trtllm-engine", "--engines",
                 str(tmp_path), "--draft-vocab", str(ddir / dv.DRAFT_VOCAB_FILE)]) == 2
    assert "--draft-vocab" in capsys.readouterr().err


def test_a_repository_config_drafts_over_what_load_pair_drafts_over(tmp_path):
    """``RepoConfig`` built in code defaults to ``draft_vocab="auto"`` as ``load_pair`` and ``make-repo`` do: the
    torch drafter model gets the drafter directory's file, the other backends (whose drafter keeps the target's head)
    none; ``full`` names none anywhere."""
    from trtllm_dflash.serve.triton.render import RepoConfig
    from trtllm_dflash.specs import DrafterSpec

    tdir, ddir = _pair_with_vocab(tmp_path, range(0, 256, 2))
    spec = DrafterSpec.load(ddir)
    torch_cfg = RepoConfig(str(tdir), str(ddir), block_size=4, max_seq_len=64, max_sequences=2)
    assert torch_cfg.draft_vocab_file(spec) == str((ddir / dv.DRAFT_VOCAB_FILE).resolve())
    assert torch_cfg.values(spec)["drafter"]["draft_vocab"] == torch_cfg.draft_vocab_file(spec)
    assert load_pair(tdir, ddir)[1].draft_head.draft_vocab_size == 128
    engine_cfg = RepoConfig(str(tdir), str(ddir), backend="trtllm-engine", block_size=4)
    assert engine_cfg.draft_vocab_file(spec) == ""
    full_cfg = RepoConfig(str(tdir), str(ddir), block_size=4, draft_vocab="full")
    assert full_cfg.draft_vocab_file(spec) == ""
