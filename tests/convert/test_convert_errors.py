"""Bad inputs to ``convert``: each raises ConfigError / ArtifactError whose one-line message names the field or path,
the value and the fix, and leaves nothing behind (no OUT, no temporary directory next to it)."""

from __future__ import annotations

import json
import shutil

import pytest

from trtllm_dflash.checkpoints import random_drafter_state, write_drafter
from trtllm_dflash.convert import convert
from trtllm_dflash.errors import ArtifactError, ConfigError
from trtllm_dflash.specs import DrafterSpec, TargetSpec


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(model_dir, **changes):
    path = model_dir / "config.json"
    cfg = json.loads(path.read_text()) | changes
    path.write_text(json.dumps(cfg))


def _assert_nothing_written(parent, out):
    assert not out.exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}")]


def _convert_fails(exc_type, t, d, out, **kw):
    with pytest.raises(exc_type) as info:
        convert(t, d, out, **kw)
    msg = str(info.value)
    assert "\n" not in msg  # one line for the CLI
    _assert_nothing_written(out.parent, out)
    return msg


def test_unsupported_target_architecture(tiny_dirs, tmp_path):
    t = _copy(tiny_dirs["llama"][0], tmp_path / "t")
    _edit_config(t, model_type="mistral", architectures=["MistralForCausalLM"])
    msg = _convert_fails(ConfigError, t, tiny_dirs["llama"][1], tmp_path / "out")
    assert "target.model_type" in msg and "mistral" in msg and "Llama or Qwen3" in msg


def test_drafter_hidden_size_must_match_target(tiny_dirs, tmp_path):
    t = tiny_dirs["qwen3"][0]
    target = TargetSpec.load(t)
    cfg = json.loads((tiny_dirs["qwen3"][1] / "config.json").read_text())
    cfg |= {"hidden_size": 32, "head_dim": 8}
    dspec = DrafterSpec.from_hf_config(cfg)
    d = write_drafter(tmp_path / "d", dspec, target, random_drafter_state(dspec, 0))
    msg = _convert_fails(ConfigError, t, d, tmp_path / "out")
    assert "drafter.hidden_size=32" in msg and "(64)" in msg and "use the drafter trained for this target" in msg


def test_missing_safetensors(tiny_dirs, tmp_path):
    t = _copy(tiny_dirs["llama"][0], tmp_path / "t")
    (t / "model.safetensors").unlink()
    msg = _convert_fails(ArtifactError, t, tiny_dirs["llama"][1], tmp_path / "out")
    assert str(t) in msg and "no model.safetensors" in msg


def test_corrupt_safetensors(tiny_dirs, tmp_path):
    d = _copy(tiny_dirs["llama"][1], tmp_path / "d")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    msg = _convert_fails(ArtifactError, tiny_dirs["llama"][0], d, tmp_path / "out")
    assert "model.safetensors" in msg and "unreadable safetensors" in msg and "re-download" in msg


def test_tensor_with_wrong_shape(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(tiny_dirs["qwen3"][1], tmp_path / "d")
    state = load_file(str(d / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"][:, :64].contiguous()
    save_file(state, str(d / "model.safetensors"))
    msg = _convert_fails(ArtifactError, tiny_dirs["qwen3"][0], d, tmp_path / "out")
    assert "fc.weight has shape [64, 64]" in msg and "[64, 128]" in msg


def test_extra_tensor_is_not_silently_dropped(tiny_dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    t = _copy(tiny_dirs["llama"][0], tmp_path / "t")
    state = load_file(str(t / "model.safetensors"))
    state["model.layers.0.mlp.extra.weight"] = state["model.norm.weight"].clone()
    save_file(state, str(t / "model.safetensors"))
    msg = _convert_fails(ArtifactError, t, tiny_dirs["llama"][1], tmp_path / "out")
    assert "no rule consumes" in msg and "model.layers.0.mlp.extra.weight" in msg


@pytest.mark.parametrize("tp, field", [(3, "target.num_attention_heads (4)"), (4, "target.num_key_value_heads (2)")])
def test_tp_must_divide_heads_and_kv_heads(tiny_dirs, tmp_path, tp, field):
    t, d = tiny_dirs["qwen3"]
    msg = _convert_fails(ConfigError, t, d, tmp_path / "out", tp=tp)
    assert f"tp={tp}" in msg and f"must divide {field}" in msg and "choose a --tp" in msg


def test_bad_dtype(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    msg = _convert_fails(ConfigError, t, d, tmp_path / "out", dtype="int8")
    assert "dtype='int8'" in msg and "--dtype bfloat16" in msg


def test_existing_output_refused_unless_force(tiny_dirs, tmp_path):
    t, d = tiny_dirs["llama"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(ArtifactError, match="already exists; pass --force"):
        convert(t, d, out)
    assert (out / "keep.txt").read_text() == "mine" and not (out / "target").exists()
    convert(t, d, out, force=True)
    assert not (out / "keep.txt").exists() and (out / "target" / "rank0.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temp or old dirs left behind


def test_loader_rejects_damaged_checkpoints(tiny_dirs, tmp_path):
    from trtllm_dflash.convert import load_trtllm_drafter, load_trtllm_target

    t, d = tiny_dirs["llama"]
    out = convert(t, d, tmp_path / "out", dtype="float32", tp=2)
    (out / "target" / "rank1.safetensors").unlink()
    with pytest.raises(ArtifactError, match=r"rank1.safetensors: missing \(mapping.tp_size=2\)"):
        load_trtllm_target(out / "target")
    _edit_config(out / "drafter", dflash={"block_size": 4})
    with pytest.raises(ArtifactError, match=r"drafter/config.json: missing or malformed entry \(KeyError"):
        load_trtllm_drafter(out / "drafter")


def test_attention_bias_refused(tiny_dirs, tmp_path):
    t = _copy(tiny_dirs["llama"][0], tmp_path / "t")
    _edit_config(t, attention_bias=True)
    msg = _convert_fails(ConfigError, t, tiny_dirs["llama"][1], tmp_path / "out")
    assert "target.attention_bias=True" in msg and "attention_bias false" in msg
