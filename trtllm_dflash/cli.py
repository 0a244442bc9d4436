"""The ``trtllm-dflash`` command: an argparse root and a table of subcommands; no logic lives here.

Each subcommand module exposes ``add_arguments(parser)`` and ``main(args) -> int``. Exit codes: 0 ok, 2 bad input
(one line on stderr, no traceback), 1 anything else.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

# name -> (module, one-line help). Modules are imported only when their subcommand runs, so `--help` stays fast.
SUBCOMMANDS = {
    "demo-assets": ("trtllm_dflash.commands.assets", "prepare the SmolLM2 demo target and drafter; print their paths"),
    "tune": ("trtllm_dflash.commands.tune", "measure this machine's fastest CPU kernels for a pair's steps ahead "
                                            "of serving"),
    "generate": ("trtllm_dflash.commands.generate", "generate text in-process with DFlash speculative decoding"),
    "demo": ("trtllm_dflash.commands.demo", "the end-to-end demo on the embedded default model"),
    "make-repo": ("trtllm_dflash.commands.serving:make_repo", "render the Triton model repository"),
    "serve": ("trtllm_dflash.commands.serving:serve", "run a Triton server on a rendered repository"),
    "client": ("trtllm_dflash.commands.serving:client", "stream one generation from a served ensemble over gRPC"),
    "convert": ("trtllm_dflash.convert.cli", "HF target + DFlash drafter -> TensorRT-LLM checkpoints"),
    "quantize": ("trtllm_dflash.convert.cli", "TensorRT-LLM checkpoint -> FP8 / NVFP4 checkpoint (modelopt)"),
    "inspect": ("trtllm_dflash.convert.cli", "summarise a TensorRT-LLM checkpoint"),
    "train-drafter": ("trtllm_dflash.train.cli", "train a DFlash drafter for a target (the DFlash recipe)"),
    "learning-curve": ("trtllm_dflash.train.curve", "τ against training data: regenerate, train, evaluate, report"),
    "datastore": ("trtllm_dflash.commands.datastore", "regen shards -> a retrieval datastore for the tree verify"),
    "draft-vocab": ("trtllm_dflash.commands.draft_vocab", "a corpus -> a reduced draft vocabulary for a drafter"),
    "export-drafter": ("trtllm_dflash.commands.export_drafter", "a drafter -> the same drafter in speculators' or "
                                                                "z-lab's format"),
    "build": ("trtllm_dflash.engine.cli", "TensorRT-LLM checkpoints -> target, kv_inject and drafter engines"),
}


def _entry(name: str, attr: str):
    """The subcommand's function: ``module`` exposes add_arguments/main; ``module:prefix`` exposes
    add_<prefix>_arguments / <prefix>_main."""
    module, _, prefix = SUBCOMMANDS[name][0].partition(":")
    mod = importlib.import_module(module)
    if not prefix:
        return getattr(mod, attr)
    return getattr(mod, f"add_{prefix}_arguments" if attr == "add_arguments" else f"{prefix}_main")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from trtllm_dflash import __version__

    parser = argparse.ArgumentParser(prog="trtllm-dflash", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"trtllm-dflash {__version__}")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    subs = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = next((a for a in argv if a in SUBCOMMANDS), None)
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub = subs.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            _entry(name, "add_arguments")(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    from trtllm_dflash.errors import DFlashError

    try:
        return _entry(args.command, "main")(args)
    except DFlashError as exc:
        print(f"trtllm-dflash {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
