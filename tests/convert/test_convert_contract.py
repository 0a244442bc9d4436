"""The written target checkpoint against the TensorRT-LLM 1.2.1 facts in
tests/data/trtllm_1_2_1/checkpoint_contract.json (config keys, weight names, the gate/up naming swap, per-rank QKV
fusion, TP split dims), plus the weight-map coverage rule (every source tensor consumed exactly once)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from trtllm_dflash.convert import configs, convert
from trtllm_dflash.convert import weight_map as wm
from trtllm_dflash.errors import ArtifactError
from trtllm_dflash.models.weights import read_state_dict
from trtllm_dflash.specs import TargetSpec

CONTRACT = json.loads((Path(__file__).parents[1] / "data" / "trtllm_1_2_1" / "checkpoint_contract.json").read_text())
ARCH = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.fixture(scope="module")
def tp2(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    return {fam: convert(t, d, root / fam, dtype="float32", tp=2) for fam, (t, d) in tiny_dirs.items()}


def test_every_fact_cites_a_source_file_and_commit():
    for name, src in CONTRACT["sources"].items():
        assert src["repo"] == "NVIDIA/TensorRT-LLM" and src["path"].startswith("tensorrt_llm/"), name
        assert re.fullmatch(r"[0-9a-f]{40}", src["commit"]), name
    for section in (*CONTRACT["config_keys"].values(), *CONTRACT["weight_names"].values()):
        assert section["source"] in CONTRACT["sources"]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_config_keys_are_recorded_trtllm_keys(family, tp2):
    cfg = json.loads((tp2[family] / "target" / "config.json").read_text())
    keys = CONTRACT["config_keys"]
    assert cfg["architecture"] == ARCH[family]
    allowed = set(keys["base"]["keys"]) | set(keys[ARCH[family]]["keys"])
    assert set(cfg) <= allowed, sorted(set(cfg) - allowed)
    assert set(cfg["mapping"]) <= set(keys["mapping"]["keys"])
    assert set(cfg["quantization"]) <= set(keys["quantization"]["keys"])
    assert cfg["position_embedding_type"] == CONTRACT["config_values"]["position_embedding_type"]["value"]
    assert cfg["mapping"]["tp_size"] == cfg["mapping"]["world_size"] == 2
    if family == "qwen3":
        assert cfg["qwen_type"] == CONTRACT["config_values"]["Qwen3ForCausalLM.qwen_type"]["value"]
        assert cfg["qk_layernorm"] is True and cfg["head_size"] == 16


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_weight_names_match_recorded_patterns(family, tp2):
    patterns = [re.compile(p) for p in CONTRACT["weight_names"][ARCH[family]]["patterns"]]
    for r in range(2):
        names = load_file(str(tp2[family] / "target" / f"rank{r}.safetensors")).keys()
        unmatched = [n for n in names if not any(p.match(n) for p in patterns)]
        assert not unmatched
        unused = [p.pattern for p in patterns if not any(p.match(n) for n in names)]
        assert not unused  # every recorded kind of tensor is written


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_values_follow_the_recorded_name_map_and_split_dims(family, tiny_dirs, tp2):
    """By value, on rank 1 of 2: gate_proj -> mlp.fc and up_proj -> mlp.gate (the swap), qkv = [q_1; k_1; v_1],
    dense/proj split on dim 1, lm_head rows [vocab/2, vocab)."""
    hf = read_state_dict(tiny_dirs[family][0])
    rank1 = load_file(str(tp2[family] / "target" / "rank1.safetensors"))
    name_map = CONTRACT["hf_to_trtllm"]["map"]
    for src, dst in name_map.items():
        src, dst = src.format(i=2), dst.format(i=2)
        if src not in hf:
            assert family == "llama" and "norm" in src  # QK-norm is Qwen3-only
            continue
        full, piece = hf[src], rank1[dst]
        if any(k in dst for k in ("mlp.fc", "mlp.gate", "lm_head", "vocab_embedding")):
            expected = full.chunk(2, dim=0)[1]
        elif any(k in dst for k in ("attention.dense", "mlp.proj")):
            expected = full.chunk(2, dim=1)[1]
        else:
            expected = full
        assert torch.equal(piece, expected), (src, dst)
    q, k, v = (hf[f"model.layers.2.self_attn.{p}_proj.weight"].chunk(2, dim=0)[1] for p in "qkv")
    assert torch.equal(rank1["transformer.layers.2.attention.qkv.weight"], torch.cat([q, k, v]))


def test_every_source_tensor_consumed_exactly_once(tiny_dirs):
    for family, (t, d) in tiny_dirs.items():
        spec = TargetSpec.load(t)
        entries = configs.target_entries(spec, 2, lm_head_from_embedding=False)
        consumed = [s for e in entries for s in e.src]
        assert sorted(consumed) == sorted(read_state_dict(t))  # exactly once each, nothing left over
        assert len({e.dst for e in entries}) == len(entries)


def test_coverage_check_names_the_offenders():
    e = wm.Entry("x", ("a", "b"), ((2,), (2,)), wm.Shard.COLUMN)
    with pytest.raises(ArtifactError, match=r"missing 1 tensors \(e.g. \['b'\]\).*1 tensors no rule consumes"):
        wm.check_coverage([e], ["a", "c"], "src")
    with pytest.raises(ArtifactError, match=r"consumed more than once: \['a'\].*duplicate destination names"):
        wm.check_coverage([e, wm.Entry("x", ("a",), ((2,),), wm.Shard.ROW)], ["a", "b"], "src")


@pytest.mark.parametrize("shard", list(wm.Shard))
def test_shard_then_merge_is_identity(shard):
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(6, 4, generator=g), torch.randn(2, 4, generator=g)] if shard is wm.Shard.COLUMN else [
        torch.randn(7 if shard is wm.Shard.VOCAB else 6, 4, generator=g)]
    e = wm.Entry("x", tuple(f"s{i}" for i in range(len(srcs))), tuple(tuple(s.shape) for s in srcs),
                 wm.Shard.REPLICATE if shard is wm.Shard.EMBEDDING else shard)
    pieces = [wm.shard(e, srcs, 2, r) for r in range(2)]
    assert all(tuple(p.shape) == wm.rank_shape(e, 2) for p in pieces)
    assert all(torch.equal(a, b) for a, b in zip(wm.merge(e, pieces, "x"), srcs))
