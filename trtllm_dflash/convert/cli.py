"""Subcommands ``convert``, ``quantize`` and ``inspect`` (wired into ``trtllm-dflash`` by ``trtllm_dflash/cli.py``).

All three live here and share the contract of every subcommand module: ``add_arguments(parser)`` then
``main(args) -> int``.
Which of the two a parser is for is read from its ``prog`` (argparse names a subparser ``"<root> <command>"``), and
recorded in ``args.convert_command``. ``ConfigError`` / ``ArtifactError`` propagate; the root CLI prints them as one
line and exits 2.

    trtllm-dflash convert --target DIR --drafter DIR --out DIR [--dtype bfloat16|float16] [--tp N] [--force]
    trtllm-dflash quantize --src DIR --out DIR --recipe fp8|nvfp4 [--kv-cache fp8] [--quantize-drafter]
                           [--calib-dataset humaneval|mtbench|FILE.jsonl] [--tokenizer DIR] [--calib-ids FILE.json]
                           [--calib-size N] [--calib-seq-len N] [--calib-device auto|cpu|cuda] [--export-hf DIR]
                           [--force]

``quantize`` prints the calibration path it used (CUDA modelopt, or CPU own amax + packing) on stderr, then the
output directory on stdout.
    trtllm-dflash inspect DIR [--json] [--no-stats]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, metavar="DIR",
                        help="Hugging Face target directory (Llama or Qwen3: config.json + safetensors)")
    parser.add_argument("--drafter", required=True, type=Path, metavar="DIR",
                        help="DFlash drafter directory: z-lab, or speculators DFlash with the full vocabulary")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output directory; gets target/, drafter/ and manifest.json")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                        help="dtype of the written weights (default bfloat16)")
    parser.add_argument("--tp", type=int, default=1, metavar="N",
                        help="tensor-parallel size: rank files per checkpoint (default 1)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out directory")
    parser.set_defaults(convert_command="convert")


def add_inspect_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ckpt_dir", type=Path, metavar="DIR",
                        help="a checkpoint directory (config.json + rank*.safetensors) or a `convert --out` directory")
    parser.add_argument("--json", action="store_true", help="print the full summary as JSON")
    parser.add_argument("--no-stats", dest="stats", action="store_false",
                        help="skip per-tensor min/max/mean/std (faster on large checkpoints)")
    parser.set_defaults(convert_command="inspect")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--in", "--src", dest="src", required=True, type=Path, metavar="DIR",
                        help="a `convert --out` directory")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR", help="output directory (same layout)")
    parser.add_argument("--format", "--recipe", dest="recipe", required=True, choices=("fp8", "nvfp4"),
                        help="fp8: per-tensor FP8 W8A8 (Hopper+); nvfp4: NVFP4 W4A4, 16-element blocks (Blackwell)")
    parser.add_argument("--kv-cache", choices=("fp8",), default=None,
                        help="also quantize the target's KV cache (FP8, unscaled as modelopt 0.47 writes it)")
    parser.add_argument("--calib", "--calib-dataset", dest="calib_dataset", default="humaneval", metavar="NAME|FILE",
                        help="calibration prompts: humaneval, mtbench or a JSONL file (default humaneval)")
    parser.add_argument("--tokenizer", type=Path, metavar="DIR",
                        help="tokenizer directory (default: the target directory recorded in --src's manifest)")
    parser.add_argument("--calib-ids", type=Path, metavar="FILE",
                        help="JSON list of token-id lists; replaces --calib-dataset and --tokenizer")
    parser.add_argument("--calib-size", type=int, default=64, metavar="N", help="calibration prompts (default 64)")
    parser.add_argument("--calib-seq-len", type=int, default=512, metavar="N",
                        help="tokens kept per prompt (default 512)")
    parser.add_argument("--quantize-drafter", action="store_true",
                        help="quantize the drafter too (its fused QKV, which holds the K/V projections, and its "
                             "context projection stay unquantized); default: the drafter is copied unchanged")
    parser.add_argument("--calib-device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where modelopt calibrates (default auto: cuda when available)")
    parser.add_argument("--export-hf", type=Path, metavar="DIR", default=None,
                        help="also write the target as a modelopt unified Hugging Face checkpoint (what TensorRT-LLM's "
                             "PyTorch backend loads) into DIR")
    parser.add_argument("--force", action="store_true", help="replace an existing --out (and --export-hf) directory")
    parser.set_defaults(convert_command="quantize")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command = parser.prog.split()[-1]
    if command == "inspect":
        add_inspect_arguments(parser)
    elif command == "quantize":
        add_quantize_arguments(parser)
    else:
        add_convert_arguments(parser)


def _human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n} B"


def _print_checkpoint(name: str, s: dict) -> None:
    print(f"{name}: {s['architecture']}  dtype={s['dtype']}  quant={s['quant_algo']}  "
          f"kv_cache_quant={s['kv_cache_quant_algo']}  tp={s['tp_size']}  layers={s['num_hidden_layers']}  "
          f"hidden={s['hidden_size']}  vocab={s['vocab_size']}")
    if s["quant_algo"] and s.get("exclude_modules"):
        print(f"  not quantized: {', '.join(s['exclude_modules'])}")
    print(f"  files: {_human_bytes(s['total_file_bytes'])} in {len(s['ranks'])} rank(s); tensor dtypes "
          + ", ".join(f"{k}×{v}" for k, v in s["tensor_dtypes"].items()))
    if "dflash" in s:
        d = s["dflash"]
        print(f"  dflash: block_size={d['block_size']} mask_token_id={d['mask_token_id']} "
              f"target_layer_ids={d['target_layer_ids']}")
    for tname, t in (s.get("tensors") or {}).items():
        stats = f"  min={t['min']:.4g} max={t['max']:.4g} mean={t['mean']:.4g} std={t['std']:.4g}" if "min" in t else ""
        print(f"  {tname:60s} {str(t['shape']):16s} {t['dtype']:14s}{stats}")


def main(args: argparse.Namespace) -> int:
    command = getattr(args, "convert_command", None) or getattr(args, "command", "convert")
    if command == "inspect":
        from trtllm_dflash.convert.summary import inspect

        summary = inspect(args.ckpt_dir, stats=getattr(args, "stats", True))
        if args.json:
            print(json.dumps(summary, indent=2))
        elif "architecture" in summary:
            _print_checkpoint(str(summary["path"]), summary)
        else:
            git = summary.get("git") or {}
            print(f"{summary['path']}: {summary.get('format')}  git={git.get('commit')}  "
                  f"config={summary.get('config')}")
            sizes = summary["sizes"]
            print("sizes on disk: " + ", ".join(f"{k.removesuffix('_bytes')} {_human_bytes(v)} ({v} B)"
                                                for k, v in sizes.items()))
            if (summary.get("calibration") or {}).get("path"):
                print(summary["calibration"]["path"])
            for what in ("target", "drafter"):
                if what in summary:
                    _print_checkpoint(what, summary[what])
        return 0

    if command == "quantize":
        return _quantize(args)

    from trtllm_dflash.convert.checkpoint import convert

    out = convert(args.target, args.drafter, args.out, dtype=args.dtype, tp=args.tp, force=args.force)
    print(out)
    return 0


def _quantize(args: argparse.Namespace) -> int:
    import sys

    import torch

    from trtllm_dflash.convert.quantize import CalibrationPath, calibration_ids, quantize_config, run_quantize
    from trtllm_dflash.errors import ArtifactError, require

    require(args.calib_size >= 1, "calib_size", args.calib_size, "must be >= 1")
    require(args.calib_seq_len >= 1, "calib_seq_len", args.calib_seq_len, "must be >= 1")
    if args.calib_ids is not None:
        try:
            ids = [torch.tensor(seq, dtype=torch.long) for seq in json.loads(args.calib_ids.read_text())]
        except (OSError, ValueError, TypeError) as exc:
            raise ArtifactError(args.calib_ids, f"not a JSON list of token-id lists ({exc})", "fix the file") from exc
    else:
        tokenizer = args.tokenizer
        if tokenizer is None:
            try:
                tokenizer = Path(json.loads((args.src / "manifest.json").read_text())["config"]["target_dir"])
            except (OSError, KeyError, TypeError, ValueError) as exc:
                raise ArtifactError(args.src / "manifest.json", f"no recorded target_dir ({exc})",
                                    "pass --tokenizer DIR") from exc
        ids = calibration_ids(args.calib_dataset, tokenizer, args.calib_size, args.calib_seq_len)
    cfg = quantize_config(args.src, args.out, args.recipe, args.force, args.kv_cache, args.quantize_drafter,
                          args.calib_device, args.export_hf)
    print(CalibrationPath.choose(cfg.recipe, cfg.calib_device).description, file=sys.stderr)
    out = run_quantize(cfg, ids)
    if cfg.export_hf is not None:
        print(f"unified HF checkpoint (modelopt export_hf_checkpoint): {cfg.export_hf}", file=sys.stderr)
    print(out)
    return 0
