"""HF target -> ModelOpt unified Hugging Face checkpoint (FP8 or NVFP4) for TensorRT-LLM's PyTorch backend.

The PyTorch-backend image (docker/Dockerfile.trtllm-pytorch) serves a Hugging Face directory through the llmapi
Triton model; TensorRT-LLM reads ModelOpt's quantized HF export (``hf_quant_config.json`` + quantized safetensors)
directly. This is the only step of that path that the package's ``quantize`` command (which writes TensorRT-LLM
checkpoints for the engine path) does not cover, so it lives here as one short script over ModelOpt's public API:
``mtq.quantize(model, cfg, forward_loop)`` then ``export_hf_checkpoint``. Calibration prompts and their tokenization
are the package's (``convert.quantize.calibration_ids``), so both paths calibrate on the same data. The drafter stays
in its own dtype (TensorRT-LLM loads the z-lab drafter as is).

Exit codes: 0 ok, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch


def quant_config(fmt: str, kv_cache: str | None) -> dict:
    """ModelOpt's default FP8 / NVFP4 recipe, plus the FP8 KV-cache entries when asked. ``quant_cfg`` is a dict in
    older ModelOpt releases (the ones TensorRT-LLM 1.2/1.3 pin) and a list of entries in newer ones (0.47)."""
    import copy

    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(mtq.FP8_DEFAULT_CFG if fmt == "fp8" else mtq.NVFP4_DEFAULT_CFG)
    if kv_cache == "fp8":
        kv = copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
        if isinstance(cfg["quant_cfg"], dict):
            cfg["quant_cfg"].update(kv)
        else:
            cfg["quant_cfg"] = [*cfg["quant_cfg"], *kv]
    return cfg


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="quantize_hf.py", description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, type=Path, metavar="DIR", help="Hugging Face target directory")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="quantized HF checkpoint directory")
    parser.add_argument("--format", required=True, choices=("fp8", "nvfp4"),
                        help="fp8: W8A8 per-tensor (Hopper+); nvfp4: W4A4 16-element blocks (Blackwell)")
    parser.add_argument("--kv-cache", choices=("fp8",), default=None, help="also quantize the KV cache to FP8")
    parser.add_argument("--calib", default="humaneval", metavar="NAME|FILE",
                        help="calibration prompts: humaneval, mtbench or a JSONL file (default humaneval)")
    parser.add_argument("--calib-size", type=int, default=64, metavar="N", help="calibration prompts (default 64)")
    parser.add_argument("--calib-seq-len", type=int, default=512, metavar="N", help="tokens per prompt (default 512)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="device for calibration (default cuda when available)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)

    def bad(field: str, value, rule: str) -> int:
        print(f"quantize_hf: error: {field}={value!r}: {rule}", file=sys.stderr)
        return 2

    if not (args.target / "config.json").is_file():
        return bad("--target", str(args.target), "not a Hugging Face model directory (no config.json)")
    if args.out.exists() and not args.force:
        return bad("--out", str(args.out), "exists; pass --force to replace it")
    if args.calib_size < 1:
        return bad("--calib-size", args.calib_size, "must be >= 1")

    from modelopt.torch.export import export_hf_checkpoint
    import modelopt.torch.quantization as mtq
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trtllm_dflash.convert.quantize import calibration_ids

    calib = calibration_ids(args.calib, args.target, args.calib_size, args.calib_seq_len)
    if not calib:
        return bad("--calib", args.calib, "gave no non-empty calibration prompts")
    model = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.bfloat16).to(args.device).eval()

    def forward_loop(m) -> None:
        with torch.no_grad():
            for ids in calib:  # [S_i], one sequence per forward: lengths differ
                m(ids[None].to(args.device))

    mtq.quantize(model, quant_config(args.format, args.kv_cache), forward_loop)

    staging = args.out.with_name(args.out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    export_hf_checkpoint(model, export_dir=staging)
    AutoTokenizer.from_pretrained(str(args.target)).save_pretrained(str(staging))
    if args.out.exists():
        shutil.rmtree(args.out)
    staging.rename(args.out)
    quant = args.out / "hf_quant_config.json"
    print(json.dumps({"out": str(args.out), "format": args.format, "kv_cache": args.kv_cache,
                      "num_calib_seqs": len(calib),
                      "hf_quant_config": json.loads(quant.read_text()) if quant.is_file() else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
