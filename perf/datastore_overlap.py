#!/usr/bin/env python3
"""How much of the evaluation outputs a retrieval datastore already holds: the fraction of each greedy response's
n-grams (default 8 tokens) that occur anywhere in the datastore (``runtime.datastore``), per evaluation set — the
check that a datastore's τ gain comes from the target's habits, not from the evaluation answers being in it.

    python perf/datastore_overlap.py artifacts/curve24/eval/greedy-humaneval-164-128.json \\
        artifacts/curve24/eval/greedy-mtbench-164-128.json

Prints one JSON object per file: mean and largest coverage, how many responses are over half covered, and the ids
of the most covered ones with their share (read them: a degenerate repetition is covered by any corpus)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def coverage(store, responses: list[list[int]], n: int) -> list[float]:
    """Per response: the share of its n-grams found in ``store`` (responses shorter than n: skipped, None)."""
    import numpy as np

    from trtllm_dflash.runtime.datastore import hash_windows

    known = store.ngram_hashes(n)
    out = []
    for resp in responses:
        hashes, _ = hash_windows(np.asarray(resp, dtype=np.int32), n)
        out.append(float(np.isin(hashes, known).mean()) if len(hashes) else None)
    return out


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("greedy", nargs="+", type=Path, help="`trtllm-dflash learning-curve eval`'s greedy-*.json files")
    p.add_argument("--datastore", type=Path,
                   default=REPO / "trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash/datastore.dflash")
    p.add_argument("--n", type=int, default=8, help="n-gram length (one of runtime.datastore.NGRAMS)")
    args = p.parse_args(argv)
    from trtllm_dflash.runtime.datastore import Datastore

    store = Datastore.load(args.datastore)
    results = []
    for path in args.greedy:
        rows = json.loads(path.read_text())
        cov = coverage(store, [r["token_ids"] for r in rows], args.n)
        scored = sorted(((c, r["id"]) for c, r in zip(cov, rows) if c is not None), reverse=True)
        res = {"file": path.name, "datastore_tokens": store.num_tokens, "n": args.n, "responses": len(scored),
               "mean_coverage": round(sum(c for c, _ in scored) / max(len(scored), 1), 4),
               "max_coverage": round(scored[0][0], 4) if scored else None,
               "over_half": sum(c > 0.5 for c, _ in scored),
               "most_covered": [[i, round(c, 3)] for c, i in scored[:5]]}
        print(json.dumps(res))
        results.append(res)
    return results


if __name__ == "__main__":
    main()
