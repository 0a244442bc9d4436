#!/usr/bin/env python3
"""What one streamed response's text delta costs as an answer grows: the stateless ``text_delta`` (decodes every
token so far; the Triton ``postprocessing`` model, which sees each response alone) against the request's own
``IncrementalDetokenizer`` (decodes the new tokens and the previous delta's; the ``dflash`` / ``baseline`` entry
models and ``trtllm-dflash generate`` since session 39). Both are checked to give the same text as one decode of the
whole answer, for responses of 1, 2, 3 and 7 tokens.

    python perf/bench_detokenize.py --out perf/results/detokenize/smollm2.json

Prints JSON: per answer length, the median ms of one delta both ways (a delta of one token at the end of it).
Tokens: this repository's README, tokenized by the target's tokenizer (default: the demo's SmolLM2).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


LENGTHS = (128, 512, 2000, 4000)


def _median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 4)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="a model directory with the tokenizer (default: the demo's)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--out", default=None, help="also write the JSON here")
    args = p.parse_args(argv)

    from trtllm_dflash.perf.record import emit_json
    from trtllm_dflash.runtime.text import IncrementalDetokenizer, load_tokenizer, text_delta

    if args.target is None:
        from trtllm_dflash.assets import prepare_demo_assets

        args.target = prepare_demo_assets()["target"]
    tok = load_tokenizer(args.target)
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = tok.encode(text, add_special_tokens=False)[: max(LENGTHS)]
    whole = tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    for step in (1, 2, 3, 7):
        detok = IncrementalDetokenizer(tok)
        streamed = "".join(detok.push(ids[j: j + step]) for j in range(0, len(ids), step)) + detok.flush()
        bounds = [*range(step, len(ids), step), len(ids)]
        stateless = "".join(text_delta(tok, ids[:n], prev, n == len(ids)) for prev, n in zip([0, *bounds], bounds))
        if streamed != whole or stateless != whole:
            print(json.dumps({"error": f"deltas of {step} tokens do not concatenate to the whole text"}))
            return 1

    def incremental(n: int):
        """One push of the n-th token, the detokenizer put back as it was after the previous response each time."""
        detok = IncrementalDetokenizer(tok)
        detok.push(ids[: n - 2])
        detok.push(ids[n - 2: n - 1])
        state = (detok._start, detok._read)

        def one() -> None:
            detok.push(ids[n - 1: n])
            del detok.ids[n - 1:]
            detok._start, detok._read = state
        return one

    rows = []
    for n in (n for n in LENGTHS if n <= len(ids)):
        rows.append({"tokens": n,
                     "text_delta_ms": _median_ms(lambda: text_delta(tok, ids[:n], n - 1, False), args.repeats),
                     "incremental_ms": _median_ms(incremental(n), args.repeats)})
        rows[-1]["ratio"] = round(rows[-1]["text_delta_ms"] / max(rows[-1]["incremental_ms"], 1e-6), 1)
    out = {"tokenizer": Path(args.target).name, "identical_text": True, "per_delta": rows}
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
