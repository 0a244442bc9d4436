"""``trtllm-dflash export-drafter``: a drafter rewritten in another format (``docs/drafters.md``).

``--to speculators`` writes vLLM's speculators layout (``models.speculators.write_speculators_drafter``), which vLLM,
SGLang and speculators' own ``from_pretrained`` read. A full-vocabulary drafter that drafts over a draft vocabulary
(``--draft-vocab auto`` picks up its ``draft_vocab.json``) is written as a reduced-vocabulary drafter: those rows of
the target's head become its own head, with the ``d2t`` / ``t2d`` tables, so every reader drafts over the same ids.

``--to z-lab`` rewrites a full-vocabulary speculators DFlash drafter in z-lab's layout (``dflash_config``), the one
TensorRT-LLM's DFlash loader reads (``make-repo --backend trtllm-pytorch``, ``convert``). A reduced vocabulary or a
DSpark drafter is refused by name: the z-lab layout has no head of its own to carry them.

Only the weights and config.json are written, atomically as a directory; a retrieval datastore or training logs in
the source directory stay there. Prints one JSON object: the format, the output path and the draft vocabulary size.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trtllm_dflash.errors import require

FORMATS = ("speculators", "z-lab")
DTYPES = ("bfloat16", "float16", "float32")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", required=True, type=Path, help="the target's Hugging Face directory")
    parser.add_argument("--drafter", required=True, type=Path,
                        help="the drafter directory: z-lab, speculators DFlash or DSpark")
    parser.add_argument("--to", required=True, choices=FORMATS, help="the format to write")
    parser.add_argument("--out", required=True, type=Path, help="the output drafter directory")
    parser.add_argument("--draft-vocab", default="auto", metavar="FILE|auto|full",
                        help="--to speculators: the draft vocabulary to write the drafter over (default auto: the "
                             "drafter directory's draft_vocab.json where it has one; full: the whole vocabulary)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the written weights "
                                                                            "(default bfloat16)")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")


def main(args: argparse.Namespace) -> int:
    import torch

    from trtllm_dflash.models import speculators
    from trtllm_dflash.specs import DrafterSpec, TargetSpec
    from trtllm_dflash.staging import refuse_existing

    refuse_existing(args.out, args.force)
    dtype = getattr(torch, args.dtype)
    target_spec = TargetSpec.load(args.target)
    if args.to == "z-lab":
        require(speculators.is_speculators_dir(args.drafter), "--drafter", str(args.drafter),
                "is already in the z-lab layout", "use the directory as it is, or pass --to speculators")
        require(args.draft_vocab == "auto", "--draft-vocab", args.draft_vocab,
                "applies to --to speculators only (the z-lab layout drafts through the target's head)",
                "drop --draft-vocab, or keep a draft_vocab.json beside the z-lab copy")
        out = speculators.write_zlab_copy(args.drafter, args.out, target_spec, dtype=dtype)
        draft_vocab_size = None
    else:  # the drafter alone; of the target only its LM head, and only for a draft vocabulary derived from it
        from trtllm_dflash.checkpoints import load_drafter, resolve_draft_vocab
        from trtllm_dflash.runtime.steps import TargetHead

        derived = resolve_draft_vocab(args.draft_vocab, args.drafter, DrafterSpec.load(args.drafter)) is not None
        lm_head = TargetHead(args.target).lm_head if derived else None
        drafter = load_drafter(args.target, args.drafter, torch.float32, draft_vocab=args.draft_vocab, lm_head=lm_head)
        out = speculators.write_speculators_drafter(args.out, drafter, target_spec, args.target, dtype=dtype)
        draft_vocab_size = drafter.draft_head.draft_vocab_size if drafter.draft_head is not None else None
    print(json.dumps({"format": args.to, "out": str(out), "dtype": args.dtype,
                      "draft_vocab_size": draft_vocab_size or target_spec.vocab_size}))
    return 0
