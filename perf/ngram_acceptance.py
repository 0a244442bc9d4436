#!/usr/bin/env python3
"""How often prompt lookup's proposals are accepted: per-slot conditional acceptance of the decoder's lookup
(``runtime.adaptive.ngram_continuation`` with ``LOOKUP_MIN_N``: the continuation of a recurring 2- or 3-gram) over
known greedy outputs, at every response position.

    python perf/ngram_acceptance.py artifacts/curve19/regen              # regenerated training shards (*.safetensors)
    python perf/ngram_acceptance.py artifacts/curve14/eval/greedy-humaneval-164-128.json   # cached greedy outputs

Prints one JSON object: the fraction of positions with a proposal, and p_j = P(slot j accepted | slots before it
were), j = 1..B−1, with the number of proposals that reached each slot. ``NGRAM_PRIOR`` in runtime/adaptive.py is this
script's output on regenerated training data (pool prompts, never the evaluation sets).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def sequences(source: Path):
    """(ids, prompt_len) of every output in a shard folder or a greedy-reference JSON file."""
    if source.is_dir():
        from safetensors.torch import load_file

        for f in sorted(source.glob("*.safetensors")):
            t = load_file(f)
            cu = t["cu_seqlens"].tolist()
            for a, b, pl in zip(cu[:-1], cu[1:], t["prompt_lens"].tolist()):
                yield t["ids"][a:b].tolist(), int(pl)
    else:
        for r in json.loads(source.read_text()):
            yield r["prompt_ids"] + r["token_ids"], len(r["prompt_ids"])


def acceptance(seqs, block_size: int = 16) -> dict:
    from trtllm_dflash.runtime.adaptive import LOOKUP_MIN_N, ngram_continuation

    k = block_size - 1
    reached, accepted = [0] * k, [0] * k
    positions = proposals = 0
    for ids, prompt_len in seqs:
        for a in range(prompt_len, len(ids) - 1):
            positions += 1
            draft = ngram_continuation(ids[: a + 1], k, min_n=LOOKUP_MIN_N)
            proposals += bool(draft)
            for j, tok in enumerate(draft[: len(ids) - a - 1]):
                reached[j] += 1
                if tok != ids[a + 1 + j]:
                    break
                accepted[j] += 1
    return {"positions": positions, "with_proposal": round(proposals / max(positions, 1), 4),
            "conditional_acceptance": [round(s / n, 3) if n else None for s, n in zip(accepted, reached)],
            "reached": reached}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a folder of regenerated shards or a greedy-reference JSON file")
    p.add_argument("--block-size", type=int, default=16)
    args = p.parse_args(argv)
    src = Path(args.source)
    if not src.exists():
        print(f"source={str(src)!r}: does not exist; pass a shard folder or a greedy-*.json file", file=sys.stderr)
        return 2
    res = acceptance(sequences(src), args.block_size)
    print(json.dumps({"source": str(src), "block_size": args.block_size, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
