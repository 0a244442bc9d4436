"""The ``convert`` / ``inspect`` subcommand module (add_arguments + main) and ``inspect`` summaries."""

from __future__ import annotations

import argparse
import json

import pytest

from trtllm_dflash.cli import build_parser
from trtllm_dflash.convert import cli
from trtllm_dflash.convert.summary import inspect
from trtllm_dflash.errors import ArtifactError, ConfigError


def _parse(argv: list[str]):
    """argv through the real ``trtllm-dflash`` parser (root options and the chosen subcommand's arguments)."""
    return build_parser(argv).parse_args(argv)


@pytest.fixture(scope="module")
def out(tiny_dirs, tmp_path_factory):
    t, d = tiny_dirs["qwen3"]
    out = tmp_path_factory.mktemp("cli") / "ckpt"
    args = _parse(["convert", "--target", str(t), "--drafter", str(d), "--out", str(out), "--tp", "2"])
    assert cli.main(args) == 0
    return out


def test_convert_defaults_and_choices():
    args = _parse(["convert", "--target", "t", "--drafter", "d", "--out", "o"])
    assert (args.dtype, args.tp, args.force, args.convert_command) == ("bfloat16", 1, False, "convert")
    with pytest.raises(SystemExit):
        _parse(["convert", "--target", "t", "--drafter", "d", "--out", "o", "--dtype", "int8"])


def test_convert_errors_propagate(tiny_dirs, tmp_path):
    t, d = tiny_dirs["qwen3"]
    args = _parse(["convert", "--target", str(t), "--drafter", str(d), "--out", str(tmp_path / "o"),
                                 "--tp", "3"])
    with pytest.raises(ConfigError, match="tp=3"):
        cli.main(args)


def test_inspect_json(out, capsys):
    capsys.readouterr()
    assert cli.main(_parse(["inspect", str(out), "--json"])) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["format"] == "trtllm_dflash.checkpoint/1" and summary["config"]["tp"] == 2
    target, drafter = summary["target"], summary["drafter"]
    assert target["architecture"] == "Qwen3ForCausalLM" and target["dtype"] == "bfloat16"
    assert target["quant_algo"] is None and target["tp_size"] == 2
    assert target["tensor_dtypes"] == {"bfloat16": 2 * (3 + 6 * 9)}  # per rank: embedding, ln_f, lm_head + 9/layer
    assert target["total_file_bytes"] == sum(r["file_bytes"] for r in target["ranks"])
    qkv = target["tensors"]["rank1/transformer.layers.0.attention.qkv.weight"]
    assert qkv["shape"] == [64, 64] and qkv["bytes"] == 64 * 64 * 2 and qkv["min"] <= qkv["mean"] <= qkv["max"]
    assert drafter["architecture"] == "DFlashDrafterForTRTLLM" and drafter["dflash"]["block_size"] == 16


def test_inspect_text_and_single_checkpoint(out, capsys):
    capsys.readouterr()
    assert cli.main(_parse(["inspect", str(out / "drafter"), "--no-stats"])) == 0
    text = capsys.readouterr().out
    assert "DFlashDrafterForTRTLLM" in text and "mask_token_id=5" in text
    assert "tensors" not in inspect(out / "target", stats=False)


def test_inspect_rejects_non_checkpoints(tmp_path):
    with pytest.raises(ArtifactError, match="neither config.json nor manifest.json"):
        inspect(tmp_path)
    with pytest.raises(ArtifactError, match="is not a directory"):
        inspect(tmp_path / "nope")


def test_quantize_subcommand_with_calib_ids(out, tmp_path, capsys):
    pytest.importorskip("modelopt.torch.quantization")
    root = argparse.ArgumentParser(prog="trtllm-dflash")
    subs = root.add_subparsers(dest="command", required=True)
    cli.add_arguments(subs.add_parser("quantize"))
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps([[1, 7, 9, 200], [3, 4]]))
    args = root.parse_args(["quantize", "--src", str(out), "--out", str(tmp_path / "fp8"), "--recipe", "fp8",
                            "--calib-ids", str(ids)])
    assert args.convert_command == "quantize"
    assert cli.main(args) == 0
    assert inspect(tmp_path / "fp8", stats=False)["target"]["quant_algo"] == "FP8"
    ids.write_text(json.dumps([[1, 999]]))
    with pytest.raises(ConfigError, match=r"calib_ids='max id 999': must be in \[0, vocab_size=256\)"):
        cli.main(root.parse_args(["quantize", "--src", str(out), "--out", str(tmp_path / "x"), "--recipe", "nvfp4",
                                  "--calib-ids", str(ids)]))
