"""The ``quantize`` subcommand's new options: it names the calibration path it used (CUDA modelopt vs CPU own amax +
packing), ``--quantize-drafter``, ``--calib-device``; ``inspect`` reports checkpoint sizes and what stays unquantized."""

from __future__ import annotations

import json

import pytest
import torch

from trtllm_dflash.cli import build_parser
from trtllm_dflash.convert import cli
from trtllm_dflash.convert.quantize import CalibDevice, CalibrationPath, QuantRecipe
from trtllm_dflash.convert.summary import inspect
from trtllm_dflash.errors import ConfigError

pytestmark = pytest.mark.usefixtures("one_thread")
CPU_NVFP4 = "nvfp4 calibration path: CPU own-amax + modelopt packing"


def _parse(argv: list[str]):
    """argv through the real ``trtllm-dflash`` parser (root options and the chosen subcommand's arguments)."""
    return build_parser(argv).parse_args(argv)


@pytest.fixture(scope="module")
def src(tiny_dirs, tmp_path_factory):
    t, d = tiny_dirs["qwen3"]
    out = tmp_path_factory.mktemp("qcli") / "bf16"
    assert cli.main(_parse(["convert", "--target", str(t), "--drafter", str(d), "--out", str(out)])) == 0
    (out.parent / "ids.json").write_text(json.dumps([[1, 7, 9, 200, 13, 14], [3, 4, 5]]))
    return out


def test_calibration_path_descriptions():
    cpu = CalibrationPath.choose(QuantRecipe.NVFP4, CalibDevice.CPU)
    assert cpu.device == "cpu" and cpu.modelopt_config == "FP8_DEFAULT_CFG"
    assert cpu.description.startswith(CPU_NVFP4) and "NVFP4QTensor" in cpu.description
    assert CalibrationPath.choose(QuantRecipe.FP8, CalibDevice.CPU).description.startswith("fp8 calibration path: CPU")
    if torch.cuda.is_available():
        gpu = CalibrationPath.choose(QuantRecipe.NVFP4, CalibDevice.AUTO)
        assert gpu.device == "cuda" and gpu.modelopt_config == "NVFP4_DEFAULT_CFG"
        assert gpu.description.startswith("nvfp4 calibration path: CUDA modelopt")
    else:
        assert CalibrationPath.choose(QuantRecipe.NVFP4, CalibDevice.AUTO) == cpu
        with pytest.raises(ConfigError, match="calib_device='cuda': no CUDA device is available"):
            CalibrationPath.choose(QuantRecipe.NVFP4, CalibDevice.CUDA)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine auto calibrates on the GPU")
def test_quantize_prints_the_nvfp4_cpu_path_and_quantizes_the_drafter(src, capsys):
    pytest.importorskip("modelopt.torch.quantization")
    out = src.parent / "nvfp4"
    args = _parse(["quantize", "--in", str(src), "--out", str(out), "--format", "nvfp4",
                                 "--calib-ids", str(src.parent / "ids.json"), "--quantize-drafter"])
    capsys.readouterr()
    assert cli.main(args) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines()[0].startswith(CPU_NVFP4)
    assert captured.out.strip().splitlines()[-1] == str(out)  # (modelopt prints its own lines before it)
    summary = inspect(out, stats=False)
    assert summary["calibration"]["path"].startswith(CPU_NVFP4) and summary["calibration"]["device"] == "cpu"
    assert summary["drafter"]["quant_algo"] == "NVFP4" and summary["target"]["quant_algo"] == "NVFP4"
    sizes, base = summary["sizes"], inspect(src, stats=False)["sizes"]
    assert sizes["total_bytes"] == sizes["target_bytes"] + sizes["drafter_bytes"]
    assert sizes["target_bytes"] < base["target_bytes"] and sizes["drafter_bytes"] < base["drafter_bytes"]
    assert cli.main(_parse(["inspect", str(out), "--no-stats"])) == 0
    text = capsys.readouterr().out
    assert f"({sizes['target_bytes']} B)" in text and f"({sizes['total_bytes']} B)" in text
    assert "not quantized: drafter.context_proj, drafter.layers.*.attention.qkv" in text
    assert CPU_NVFP4 in text


def test_quantize_cuda_request_without_cuda_fails_before_writing(src, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("CUDA is available")
    args = _parse(["quantize", "--in", str(src), "--out", str(tmp_path / "x"), "--format", "fp8",
                                 "--calib-ids", str(src.parent / "ids.json"), "--calib-device", "cuda"])
    with pytest.raises(ConfigError, match="calib_device='cuda'"):
        cli.main(args)
    assert not (tmp_path / "x").exists()
