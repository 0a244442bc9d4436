"""Argument helpers shared by subcommands that load a target/drafter pair and generate."""

from __future__ import annotations

import argparse

import torch

from trtllm_dflash.errors import require

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def add_model_arguments(parser: argparse.ArgumentParser, drafter_required: bool = False) -> None:
    parser.add_argument("--target", required=True, help="Hugging Face target model directory (Llama or Qwen3)")
    parser.add_argument("--drafter", required=drafter_required, help="z-lab-format DFlash drafter directory")
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per draft block incl. the bonus slot (default: the drafter's; 1 = autoregressive)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="compute dtype (default float32: fastest on CPUs without bf16 units)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, per prompt (default 0)")


def resolve_block_size(args, drafter) -> int:
    if args.block_size is not None:
        return args.block_size
    require(drafter is not None, "--drafter", None, "is required unless --block-size 1", "pass --drafter DIR")
    return drafter.spec.block_size
