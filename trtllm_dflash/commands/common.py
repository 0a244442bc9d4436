"""Argument helpers shared by subcommands that load a target/drafter pair and generate."""

from __future__ import annotations

import argparse

import torch

from trtllm_dflash.errors import require

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def add_model_arguments(parser: argparse.ArgumentParser, drafter_required: bool = False) -> None:
    parser.add_argument("--target", required=True, help="Hugging Face target model directory (Llama or Qwen3)")
    parser.add_argument("--drafter", required=drafter_required,
                        help="DFlash drafter directory: z-lab, speculators DFlash or DSpark (docs/drafters.md)")
    parser.add_argument("--block-size", type=block_size_arg, default=None,
                        help="tokens per draft block incl. the bonus slot, or 'auto' (per sequence and step, verify "
                             "as many drafts as pay off on this device, so never many fewer tokens/s than "
                             "autoregressive decoding; the default); 1 = autoregressive")
    parser.add_argument("--max-block-size", type=int, default=None,
                        help="with --block-size auto: the longest block (default: the drafter's block size)")
    add_ngram_argument(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="compute dtype (default float32: fastest on CPUs without bf16 units)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device (default: cuda when available, else cpu)")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    parser.add_argument("--min-new-tokens", type=int, default=0,
                        help="the target does not choose a stop token before this many new tokens (default 0; "
                             "TensorRT-LLM's min_tokens)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default)")
    parser.add_argument("--top-p", type=float, default=1.0, help="1.0 = off (default)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed, per prompt (default 0)")
    add_penalty_arguments(parser, (1.0, 0.0, 0.0), " (default %(default)s: off)")


def add_penalty_arguments(parser: argparse.ArgumentParser, defaults=(None, None, None), note: str = "") -> None:
    """TensorRT-LLM's occurrence penalties over the prompt and the answer so far (runtime.sampling.penalize)."""
    for flag, default, what in zip(("--repetition-penalty", "--presence-penalty", "--frequency-penalty"), defaults, (
            "divide a repeated token's positive logit by this, multiply a negative one", "subtract this from a "
            "repeated token's logit", "subtract this times a token's occurrences from its logit")):
        parser.add_argument(flag, type=float, default=default, help=f"{what}; TensorRT-LLM's{note}")


def add_bias_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bias", action="append", default=[], metavar="TEXT=WEIGHT",
                        help="add WEIGHT to the logits of TEXT's tokens before sampling (TensorRT-LLM's "
                             "embedding_bias_words / _weights: TEXT tokenized alone; a large negative weight all but "
                             "bans it); repeat for more")


def bias_words(values: list[str]) -> tuple[tuple[str, float], ...]:
    """``--bias`` values -> (text, weight) pairs (the weight after the last '=': TEXT may hold '=' itself)."""
    import math

    from trtllm_dflash.errors import require

    out = []
    for value in values:
        text, sep, weight = value.rpartition("=")
        try:
            w = float(weight) if sep and text else math.nan
        except ValueError:
            w = math.nan
        require(math.isfinite(w), "--bias", value, "must be TEXT=WEIGHT with a non-empty TEXT and a finite WEIGHT",
                "e.g. --bias ' sorry=-5'")
        out.append((text, w))
    return tuple(out)


def add_ngram_argument(parser: argparse.ArgumentParser, where: str = "") -> None:
    parser.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=None,
                        help="verify prompt lookup's proposal (the tokens that followed an earlier occurrence of the "
                             "context's last 2-3 tokens) instead of the drafter's block where the context repeats "
                             "itself; under auto where it is expected to yield more. Lossless either way. Default: on "
                             f"wherever it applies (a block size > 1{where}); --no-ngram turns it off")


def resolve_ngram(flag: bool | None, block_size: int | str, backend: str = "torch") -> bool:
    """--ngram / --no-ngram / neither: on by default wherever prompt lookup applies (a block size > 1, a backend whose
    steps our loop drives); an explicit --ngram where it does not is refused by the block-size and repository checks."""
    if flag is None:
        return block_size != 1 and backend != "trtllm-pytorch"
    return flag


def block_size_arg(text: str) -> int | str:
    """``--block-size``: an integer >= 1 or ``auto``."""
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"--block-size={text!r}: must be an integer >= 1 or 'auto'; "
                                         "e.g. --block-size auto or --block-size 16")
    return value


def resolve_block_size(args, drafter) -> int | str:
    """The block size to decode with (an int, or "auto"); checks --max-block-size goes with auto. The default is
    "auto": a fixed block size verifies every step's drafts whether they pay or not, which on a device where a wide
    verify costs several narrow ones (a CPU) makes decoding slower than autoregressive when the drafter is weak,
    where auto stops drafting (README "Adaptive block size")."""
    max_block = getattr(args, "max_block_size", None)
    if max_block is not None:
        require(args.block_size in ("auto", None), "--max-block-size", max_block,
                "only applies to --block-size auto (the default)", "drop --block-size or --max-block-size")
        require(max_block >= 2, "--max-block-size", max_block, "must be >= 2")
    if args.block_size is not None:
        require(getattr(args, "ngram", None) is not True or args.block_size != 1, "--ngram", True,
                "needs a block size > 1 (prompt lookup's proposals are verified in the drafter's blocks)",
                "drop --ngram or pass --block-size 16 or auto")
        return args.block_size
    require(drafter is not None, "--drafter", None, "is required unless --block-size 1", "pass --drafter DIR")
    return "auto"


def drafter_datastore(drafter_dir):
    """The drafter directory's retrieval datastore file (``runtime.datastore.DATASTORE_FILE``), or None if it has none.
    A datastore under its old name (``LEGACY_DATASTORE_FILE``, a top-level *.safetensors that vLLM takes for weights and
    refuses) is not used: a WARNING says how to rename it."""
    import logging
    from pathlib import Path

    from trtllm_dflash.runtime.datastore import DATASTORE_FILE, LEGACY_DATASTORE_FILE

    if drafter_dir is None:
        return None
    path, legacy = Path(drafter_dir) / DATASTORE_FILE, Path(drafter_dir) / LEGACY_DATASTORE_FILE
    if not path.is_file() and legacy.is_file():
        logging.getLogger(__name__).warning(
            "%s: a datastore under its old name is not used (vLLM loads every *.safetensors in a drafter directory as "
            "weights and refuses it); rename it: mv %s %s", legacy, legacy, path)
    return path if path.is_file() else None


def datastore_path(choice: str | None, drafter_dir, tree_lookup: bool):
    """The datastore file ``choice`` names: "auto" — the drafter directory's (``drafter_datastore``) where there is
    one and the tree verify has lookup chains; "none", "" or None — none; else that file. The in-process decoders
    (``resolve_datastore``) and the repository renderer (``RepoConfig.datastore_file``) both resolve it here."""
    from pathlib import Path

    if choice in (None, "", "none"):
        return None
    if choice == "auto":
        return drafter_datastore(drafter_dir) if tree_lookup else None
    return Path(choice)


def resolve_datastore(choice: str | None, drafter_dir, tree_lookup: bool):
    """The datastore a decoder proposes from (``datastore_path``), loaded; None for none."""
    from trtllm_dflash.runtime.datastore import Datastore

    path = datastore_path(choice, drafter_dir, tree_lookup)
    return Datastore.load(path) if path is not None else None


def resolve_mode(args, drafter, backend: str = "torch"):
    """The command line's decoding mode, parsed once: ``--block-size`` (default auto), ``--max-block-size``,
    ``--ngram`` (``resolve_ngram``) and ``--tree`` as one ``runtime.mode.DecodeMode``; a combination that cannot
    decode is refused here, with the flags named."""
    from trtllm_dflash.runtime.mode import DecodeMode

    block = resolve_block_size(args, drafter)
    tree = bool(getattr(args, "tree", False))
    require(not tree or (block != 1 and drafter is not None), "--tree", True,
            "the tree verify needs a block size >= 2 (or auto) and a drafter", "pass --drafter and --block-size 16")
    return DecodeMode.from_flags(block, resolve_ngram(getattr(args, "ngram", None), block, backend), tree,
                                 getattr(args, "max_block_size", None))


def make_decoder(target, drafter, mode, drafter_dir=None, datastore: str | None = "auto",
                 cuda_graphs: bool | str = "auto"):
    """A SpeculativeDecoder for ``mode`` (``runtime.mode.DecodeMode``); under ``auto`` with the acceptance prior from
    the drafter's training log (and, with ``ngram``, prompt-lookup proposals too); ``tree``: the tree verify, with
    lookup chains only with ``ngram``, and proposals from ``datastore`` (``resolve_datastore``; "auto": the drafter
    directory's, if it has one); ``cuda_graphs``: ``SpeculativeDecoder``'s."""
    from trtllm_dflash.runtime.acceptance import prior_from_training_log
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder

    block_size, max_block_size, ngram, tree = mode.block_size, mode.max_block_size, mode.ngram, mode.tree
    prior = None
    if block_size == "auto" and drafter is not None:
        prior = prior_from_training_log(drafter_dir, drafter.spec.block_size - 1)
    store = resolve_datastore(datastore, drafter_dir, bool(tree) and ngram)
    if tree and block_size != 1 and drafter is not None:  # auto: the tree of its longest block
        from trtllm_dflash.runtime.tree import tree_for

        longest = (max_block_size or drafter.spec.block_size) if block_size == "auto" else block_size
        tree = tree_for(longest - 1, ngram, store is not None)
    return SpeculativeDecoder(target, drafter, block_size, max_block_size=max_block_size, prior=prior, ngram=ngram,
                              tree=tree, datastore=store, cuda_graphs=cuda_graphs)


def add_draft_vocab_argument(parser) -> None:
    """``--draft-vocab FILE|auto|full`` (``checkpoints.load_pair``'s ``draft_vocab``), for every command that drafts."""
    parser.add_argument("--draft-vocab", default="auto", metavar="FILE|auto|full",
                        help="draft over a reduced vocabulary (`trtllm-dflash draft-vocab`): auto (default) the "
                             "drafter directory's draft_vocab.json if it has one; full: the target's whole vocabulary; "
                             "or a file")
