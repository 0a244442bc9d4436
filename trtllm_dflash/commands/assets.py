"""``trtllm-dflash demo-assets``: prepare the demo target and drafter (idempotent) and print their paths as JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help="where generated assets live (default: $TRTLLM_DFLASH_CACHE or ~/.cache/trtllm_dflash)")


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.assets import prepare_demo_assets

    paths = prepare_demo_assets(args.cache_dir)
    print(json.dumps({"target": paths["target"], "drafter": paths["drafter"]}))
    return 0
