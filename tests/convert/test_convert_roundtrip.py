"""Convert -> load back round trips on tiny random Llama / Qwen3 targets and their drafters.

Exactness: conversion only slices, concatenates, zero-pads and casts, and the loader undoes exactly that, so in the same
dtype the reloaded target's logits are bit-identical to the original's (no tolerance), for TP 1 and 2 (ranks merged).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.checkpoints import drafter_spec_for, random_drafter_state, write_drafter, write_tiny_target
from trtllm_dflash.convert import convert, load_trtllm_drafter, load_trtllm_target
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.target import TargetModel
from trtllm_dflash.specs import TargetSpec

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}




@pytest.fixture(scope="module")
def converted(tiny_dirs, tmp_path_factory):
    """(family, tp, dtype) -> OUT, converted once per module."""
    root = tmp_path_factory.mktemp("converted")
    cache = {}

    def get(family, tp, dtype):
        key = (family, tp, dtype)
        if key not in cache:
            t, d = tiny_dirs[family]
            cache[key] = convert(t, d, root / f"{family}-tp{tp}-{dtype}", dtype=dtype, tp=tp)
        return cache[key]

    return get


def _logits(model, ids):
    hidden, _ = model(ids, model.new_cache(ids.shape[0], ids.shape[1]))
    return model.logits(hidden)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_target_logits_round_trip_exactly(family, tp, dtype, tiny_dirs, converted):
    out = converted(family, tp, dtype)
    ref = TargetModel.from_pretrained(tiny_dirs[family][0], dtype=DTYPES[dtype])
    got = load_trtllm_target(out / "target", dtype=DTYPES[dtype])
    ids = torch.randint(0, ref.spec.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(_logits(got, ids), _logits(ref, ids))
    # eos/bos come back through the manifest; torch_dtype is the checkpoint's, i.e. the conversion dtype
    assert got.spec == dataclasses.replace(ref.spec, torch_dtype=dtype)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_drafter_weights_round_trip_exactly(family, tp, tiny_dirs, converted):
    # The fixture drafter is stored in bf16, so a bf16 conversion is lossless.
    out = converted(family, tp, "bfloat16")
    ref = DrafterModel.from_pretrained(tiny_dirs[family][1], dtype=torch.bfloat16)
    got = load_trtllm_drafter(out / "drafter", dtype=torch.bfloat16)
    assert got.spec == ref.spec
    ref_state, got_state = ref.state_dict(), got.state_dict()
    assert ref_state.keys() == got_state.keys()
    for name, t in ref_state.items():
        assert torch.equal(got_state[name], t), name


def test_tied_embeddings_and_odd_vocab(tmp_path):
    """Tied lm_head (no lm_head.weight in the HF file) and a vocabulary TP does not divide: the embedding is replicated,
    lm_head is written explicitly, zero-padded to a multiple of tp and split; the round trip stays exact."""
    t = write_tiny_target(tmp_path / "t", family="llama", vocab_size=255, num_layers=4, tie_word_embeddings=True)
    spec = TargetSpec.load(t)
    dspec = drafter_spec_for(spec, num_layers=1, block_size=4, mask_token_id=5)
    d = write_drafter(tmp_path / "d", dspec, spec, random_drafter_state(dspec, 1))
    out = convert(t, d, tmp_path / "out", dtype="float32", tp=2)
    cfg = json.loads((out / "target" / "config.json").read_text())
    assert cfg["use_parallel_embedding"] is False and cfg["tie_word_embeddings"] is True
    ranks = [load_file(str(out / "target" / f"rank{r}.safetensors")) for r in range(2)]
    assert [r["lm_head.weight"].shape[0] for r in ranks] == [128, 128]
    assert torch.count_nonzero(ranks[1]["lm_head.weight"][-1]) == 0  # the padding row
    assert all(r["transformer.vocab_embedding.weight"].shape == (255, 64) for r in ranks)
    ref = TargetModel.from_pretrained(t)
    got = load_trtllm_target(out / "target")
    ids = torch.randint(0, 255, (1, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(_logits(got, ids), _logits(ref, ids))


def test_manifest_records_inputs_outputs_and_tools(converted, tiny_dirs):
    from trtllm_dflash.convert.manifest import sha256_file

    out = converted("qwen3", 2, "bfloat16")
    m = json.loads((out / "manifest.json").read_text())
    t, d = tiny_dirs["qwen3"]
    assert m["inputs"]["target"]["model.safetensors"] == sha256_file(t / "model.safetensors")
    assert m["inputs"]["drafter"]["config.json"] == sha256_file(d / "config.json")
    assert m["outputs"]["target"]["rank1.safetensors"] == sha256_file(out / "target" / "rank1.safetensors")
    assert m["config"]["tp"] == 2 and m["config"]["dtype"] == "bfloat16"
    assert m["resolved"]["target"]["family"] == "qwen3"
    assert m["resolved"]["drafter"]["target_layer_ids"] == [1, 3]
    assert m["tools"]["torch"] and m["tools"]["trtllm-dflash"]
    assert "git" in m
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left behind

