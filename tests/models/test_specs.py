"""Config parsing and validation: every error names the field, the value and the rule."""

import copy
import json

import pytest

from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.specs import DrafterSpec, LayerType, TargetSpec, build_target_layer_ids, check_pair

# The Qwen3-8B-DFlash-b16 config as recorded in dflash.md §1.7 (z-lab, via SpecForge configs/qwen3-8b-dflash.json).
QWEN3_8B_DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 16, "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "rope_scaling": None, "max_position_embeddings": 40960, "layer_types": ["full_attention"] * 5,
    "sliding_window": None, "use_sliding_window": False, "vocab_size": 151936, "attention_bias": False,
}
QWEN3_8B_TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
    "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960, "vocab_size": 151936,
    "tie_word_embeddings": False, "eos_token_id": 151645, "bos_token_id": 151643,
}


def test_default_tap_rule_matches_released_drafters():
    assert build_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-4B/8B
    assert build_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)  # Llama-3.1-8B
    assert build_target_layer_ids(30, 1) == (15,)
    with pytest.raises(ConfigError, match="num_taps"):
        build_target_layer_ids(8, 7)


def test_qwen3_8b_pair_parses():
    t, d = TargetSpec.from_hf_config(QWEN3_8B_TARGET), DrafterSpec.from_hf_config(QWEN3_8B_DRAFTER)
    assert t.qk_norm and t.head_dim == 128 and t.eos_token_ids == (151645,)
    assert d.block_size == 16 and d.mask_token_id == 151669 and d.target_layer_ids == (1, 9, 17, 25, 33)
    assert d.layer_causal == (False,) * 5 and d.sliding_window is None
    check_pair(t, d)


def test_transformers5_rope_parameters_and_llama3_scaling():
    cfg = {k: v for k, v in QWEN3_8B_TARGET.items() if k != "rope_theta"}
    cfg |= {"model_type": "llama", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    spec = TargetSpec.from_hf_config(cfg)
    assert spec.rope.theta == 500000.0 and spec.rope.kind == "llama3"
    inv = spec.rope.inv_freq(128)
    assert inv[0] == 1.0 and inv[-1] < 1.0 / 500000.0 ** (126 / 128) / 7.9  # long wavelengths scaled by 1/8


def test_sliding_window_layers_are_causal_unless_overridden():
    cfg = copy.deepcopy(QWEN3_8B_DRAFTER)
    cfg["layer_types"] = ["sliding_attention"] * 4 + ["full_attention"]
    cfg["sliding_window"] = 2048
    d = DrafterSpec.from_hf_config(cfg)
    assert d.layer_types[0] is LayerType.SLIDING and d.layer_causal == (True,) * 4 + (False,)
    cfg["dflash_config"]["causal"] = False
    assert DrafterSpec.from_hf_config(cfg).layer_causal == (False,) * 5


def test_block_size_under_dflash_config_is_read():
    cfg = copy.deepcopy(QWEN3_8B_DRAFTER)
    del cfg["block_size"]
    cfg["dflash_config"]["block_size"] = 8
    assert DrafterSpec.from_hf_config(cfg).block_size == 8


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (lambda c: c.update(block_size=0), "drafter.block_size", "must be >= 1"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[1, 40]), "target_layer_ids[1]", "num_target_layers=36"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id", "is required"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "drafter.architectures", "DFlashDraftModel"),
        (lambda c: c["dflash_config"].update(conv_kernel_size=4), "conv_kernel_size", "DFlash2"),
        (lambda c: c.update(layer_types=["sliding_attention"] * 5), "sliding_window", "positive window"),
        (lambda c: c.update(num_key_value_heads=5), "num_key_value_heads", "must divide"),
    ],
)
def test_drafter_errors_name_field_and_rule(mutate, field, words):
    cfg = copy.deepcopy(QWEN3_8B_DRAFTER)
    mutate(cfg)
    with pytest.raises(ConfigError) as exc:
        DrafterSpec.from_hf_config(cfg)
    assert field in str(exc.value) and words in str(exc.value)


@pytest.mark.parametrize(
    "target_mut, drafter_mut, words",
    [
        (lambda c: c.update(hidden_size=2560), None, "drafter.hidden_size=4096: must equal the target's hidden_size (2560)"),
        (lambda c: c.update(num_hidden_layers=28), None, "num_target_layers=36: must equal the target's num_hidden_layers (28)"),
        (lambda c: c.update(vocab_size=151600, eos_token_id=2), None, "mask_token_id=151669: must be < the target's vocab_size (151600)"),
    ],
)
def test_pair_mismatches(target_mut, drafter_mut, words):
    t = copy.deepcopy(QWEN3_8B_TARGET)
    target_mut(t)
    with pytest.raises(ConfigError) as exc:
        check_pair(TargetSpec.from_hf_config(t), DrafterSpec.from_hf_config(QWEN3_8B_DRAFTER))
    assert words in str(exc.value)


def test_target_rejects_a_drafter_config_and_unknown_families():
    with pytest.raises(ConfigError, match="--target"):
        TargetSpec.from_hf_config(QWEN3_8B_DRAFTER)
    with pytest.raises(ConfigError, match="Llama or Qwen3"):
        TargetSpec.from_hf_config(QWEN3_8B_TARGET | {"model_type": "gpt2"})


def test_missing_and_corrupt_config_files(tmp_path):
    with pytest.raises(ArtifactError, match="does not exist"):
        TargetSpec.load(tmp_path / "nope")
    with pytest.raises(ArtifactError, match="config.json: missing"):
        TargetSpec.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ArtifactError, match="unreadable JSON"):
        DrafterSpec.load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_8B_DRAFTER))
    assert DrafterSpec.load(tmp_path).num_taps == 5
