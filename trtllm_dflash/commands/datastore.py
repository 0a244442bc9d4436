"""``trtllm-dflash datastore``: a retrieval datastore (``runtime.datastore``) from regenerated training data.

The drafter's training data is the target's own greedy responses to thousands of prompts (``train-drafter``'s
regen shards, ``regen-*.safetensors``); the same tokens, indexed, let the tree verify propose what followed the
context's last tokens in those responses. Put the file in the drafter directory as ``datastore.dflash`` (``runtime.datastore.DATASTORE_FILE``: safetensors
inside, but named so that no peer loads it as weights) and ``generate --tree`` uses it by default."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trtllm_dflash.errors import ArtifactError, require


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--from", dest="sources", action="append", required=True, metavar="DIR",
                        help="a folder of regen shards (regen-*.safetensors, train-drafter's work dir 'regen'); "
                             "repeat to merge folders")
    parser.add_argument("--out", required=True, type=Path,
                        help="the datastore file to write (atomically), e.g. DRAFTER_DIR/datastore.dflash")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="stop adding sequences once the store holds this many tokens (default: all)")


def regen_shards(sources: list) -> list[Path]:
    """Every regen shard (regen-*.safetensors) of the folders ``sources``, in order; a folder without any is refused."""
    shards = []
    for src in sources:
        found = sorted(Path(src).glob("regen-*.safetensors"))
        if not found:
            raise ArtifactError(src, "holds no regen shards (regen-*.safetensors)",
                                "pass train-drafter's work directory's 'regen' folder")
        shards += found
    return shards


def build(sources: list, max_tokens: int | None = None):
    """A ``Datastore`` of every sequence in the regen shards of ``sources`` (folders), in order, until it holds
    ``max_tokens``; its meta records the folders' ``meta.json`` (what the shards were regenerated from)."""
    from tqdm import tqdm

    from trtllm_dflash.runtime.datastore import Datastore
    from trtllm_dflash.train.regen import read_regen_shard

    shards = regen_shards(sources)

    def sequences():
        total = 0
        for path in tqdm(shards, desc="datastore: regen shards", unit="shard", disable=None):
            for sample in read_regen_shard(path):
                if max_tokens is not None and total >= max_tokens:
                    return
                total += len(sample.ids)
                yield sample.ids.tolist()

    provenance = [json.loads(m.read_text()) for m in (Path(s) / "meta.json" for s in sources) if m.is_file()]
    return Datastore.from_sequences(sequences(), {"num_shards": len(shards), "regen_meta": provenance})


def main(args: argparse.Namespace) -> int:
    require(args.max_tokens is None or args.max_tokens >= 1, "--max-tokens", args.max_tokens, "must be >= 1")
    require(args.out.parent.is_dir(), "--out", str(args.out), "its folder does not exist", "create it first")
    store = build(args.sources, args.max_tokens)
    store.save(args.out)
    print(json.dumps({"out": str(args.out), **store.meta}))
    return 0
