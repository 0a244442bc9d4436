"""``trtllm-dflash draft-vocab``: a reduced draft vocabulary for a full-vocabulary drafter (``models.draft_vocab``).

The vocabulary is the ``--size`` most frequent tokens of a corpus of the target's own outputs — train-drafter's regen
shards (their responses only) or a retrieval datastore (``trtllm-dflash datastore``; its sequences hold the prompts
too) — plus the target's end-of-sequence tokens. It is written as ``draft_vocab.json`` into the drafter directory,
where ``generate``, ``make-repo`` and the benchmarks pick it up (``--draft-vocab auto``, their default); the weights
are not touched, so the directory still loads unchanged in vLLM and z-lab's code. Prints one JSON object: the size,
the corpus's token count and the fraction of it the vocabulary covers at this and at other sizes, so that a size can be
chosen from the printed curve."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trtllm_dflash.errors import ArtifactError, require

CURVE = (1024, 2048, 4096, 8192, 16384, 32768)  # the other sizes whose coverage is printed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--drafter", required=True, type=Path, help="the full-vocabulary drafter directory")
    parser.add_argument("--target", required=True, type=Path, help="the target's Hugging Face directory")
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="sources", action="append", metavar="DIR",
                     help="a folder of regen shards (train-drafter's work dir 'regen'); repeat to merge folders")
    src.add_argument("--datastore", type=Path, metavar="FILE",
                     help="a retrieval datastore (e.g. DRAFTER_DIR/datastore.dflash) as the corpus")
    parser.add_argument("--size", type=int, default=8192, help="tokens in the draft vocabulary (default 8192)")
    parser.add_argument("--out", type=Path, default=None,
                        help="where to write it (atomically; default DRAFTER_DIR/draft_vocab.json)")


def corpus_counts(vocab_size: int, sources: list | None = None, datastore: Path | None = None):
    """Token counts [vocab_size] of the corpus and a description of it: regen shards' responses, or a datastore's
    sequences."""
    import numpy as np
    from tqdm import tqdm

    counts = np.zeros(vocab_size, dtype=np.int64)
    if datastore is not None:
        from trtllm_dflash.runtime.datastore import Datastore

        tokens = Datastore.load(datastore).tokens
        tokens = tokens[tokens >= 0]
        counts += np.bincount(tokens, minlength=vocab_size)[:vocab_size]
        return counts, f"datastore {datastore} (its sequences, prompts included)"
    from trtllm_dflash.commands.datastore import regen_shards
    from trtllm_dflash.train.regen import read_regen_shard

    shards = regen_shards(sources)
    for path in tqdm(shards, desc="draft-vocab: regen shards", unit="shard", disable=None):
        for sample in read_regen_shard(path):
            counts += np.bincount(sample.ids[sample.prompt_len:].numpy(), minlength=vocab_size)[:vocab_size]
    return counts, f"regen shards of {', '.join(map(str, sources))} (their responses)"


def main(args: argparse.Namespace) -> int:
    import numpy as np

    from trtllm_dflash.models import draft_vocab as dv
    from trtllm_dflash.specs import DrafterSpec, TargetSpec, check_pair

    target, drafter = TargetSpec.load(args.target), DrafterSpec.load(args.drafter)
    check_pair(target, drafter)
    require(drafter.draft_vocab_size is None, "--drafter", str(args.drafter),
            f"already drafts over a vocabulary of its own ({drafter.draft_vocab_size} tokens, its own head)",
            "pass a full-vocabulary (z-lab layout) drafter")
    require(1 <= args.size <= target.vocab_size, "--size", args.size,
            f"must be in [1, {target.vocab_size}] (the target's vocabulary)")
    out = args.out or args.drafter / dv.DRAFT_VOCAB_FILE
    require(out.parent.is_dir(), "--out", str(out), "its folder does not exist", "create it first")
    counts, source = corpus_counts(target.vocab_size, args.sources, args.datastore)
    total = int(counts.sum())
    if total == 0:
        raise ArtifactError(args.datastore or args.sources[0], "holds no tokens", "pass a non-empty corpus")
    ranked = np.sort(counts)[::-1].cumsum() / total  # coverage of the n most frequent tokens at n − 1
    ids = dv.choose(counts, args.size, keep=target.eos_token_ids)
    covered = float(counts[ids].sum() / total)
    meta = {"source": source, "corpus_tokens": total, "corpus_coverage": round(covered, 6),
            "always": sorted(target.eos_token_ids)}
    dv.write(out, ids, meta)
    curve = {n: round(float(ranked[n - 1]), 6) for n in CURVE if n <= target.vocab_size}
    print(json.dumps({"out": str(out), "draft_vocab_size": len(ids), **meta, "coverage_by_size": curve,
                      "distinct_tokens": int((counts > 0).sum())}))
    return 0

