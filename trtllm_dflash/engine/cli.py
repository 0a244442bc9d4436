"""Subcommand ``build`` (wired into ``trtllm-dflash`` by ``trtllm_dflash/cli.py``): a ``convert`` / ``quantize`` output
-> the target, kv_inject and drafter TensorRT engines (``engine/build.py``).

    trtllm-dflash build --ckpt DIR --out DIR --gpu hopper|blackwell [--max-batch-size N] [--max-seq-len N]
                        [--max-input-len N] [--max-num-tokens N] [--dry-run] [--force]

``--dry-run`` prints the three ``trtllm-build`` commands (shell-quoted, one per line) and exits 0; it needs neither a
GPU nor TensorRT-LLM. Without it the commands run, which needs NVIDIA's TensorRT-LLM 1.2.1 container. Bad input: one
line and exit 2; a failing ``trtllm-build``: one line and exit 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trtllm_dflash.engine.build import DEFAULT_MAX_NUM_TOKENS, DEFAULT_MAX_SEQ_LEN, BuildConfig, EngineBuildFailed, Gpu


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ckpt", required=True, type=Path, metavar="DIR",
                        help="a `convert` or `quantize` output (target/, drafter/, manifest.json); its target "
                             "config.json says the quantization")
    parser.add_argument("--out", required=True, type=Path, metavar="DIR",
                        help="output directory; gets target/, kv_inject/, drafter/ and build_manifest.json")
    parser.add_argument("--gpu", required=True, choices=[g.value for g in Gpu],
                        help="GPU generation the engines run on: hopper (SM90: BF16, FP8) or blackwell "
                             "(SM100: BF16, FP8, NVFP4)")
    parser.add_argument("--max-batch-size", type=int, default=8, metavar="N",
                        help="sequences per engine call (default 8)")
    parser.add_argument("--max-seq-len", type=int, default=None, metavar="N",
                        help=f"tokens per sequence, prompt + output (default: the target's max_position_embeddings, "
                             f"at most {DEFAULT_MAX_SEQ_LEN})")
    parser.add_argument("--max-input-len", type=int, default=None, metavar="N",
                        help="prompt tokens (default: --max-seq-len)")
    parser.add_argument("--max-num-tokens", type=int, default=None, metavar="N",
                        help=f"tokens per engine call (default: max({DEFAULT_MAX_NUM_TOKENS}, max batch size x "
                             "block size)); must be >= max batch size x block size")
    parser.add_argument("--dry-run", action="store_true", help="print the trtllm-build commands and exit")
    parser.add_argument("--force", action="store_true", help="replace an existing --out directory")


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.engine import build as eb

    cfg = BuildConfig(ckpt_dir=args.ckpt, out_dir=args.out, gpu=Gpu(args.gpu), max_batch_size=args.max_batch_size,
                      max_seq_len=args.max_seq_len, max_input_len=args.max_input_len,
                      max_num_tokens=args.max_num_tokens, force=args.force)
    plan = eb.plan_build(cfg)
    if args.dry_run:
        print("\n".join(eb.shell_lines(plan)))
        return 0
    try:
        artifact = eb.run_build(plan)
    except EngineBuildFailed as exc:
        print(f"trtllm-dflash build: error: {exc}", file=sys.stderr)
        return 1
    print(artifact.root)
    return 0
