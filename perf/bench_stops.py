#!/usr/bin/env python3
"""What checking a request's stop sequences costs per new token: ``runtime.protocol.StopMatcher`` (stops indexed by
their last token) against comparing every stop at every new token (the naive scan), same cuts.

    python perf/bench_stops.py --stops 1024 --out perf/results/reliability/stops.json

Stop words ``zq<i>xv word of many tokens number <i> and more`` tokenized by the target's tokenizer (default: the
demo's SmolLM2), a 512-token stream (this repository's README) checked one new token at a time as the serving loop
does. Prints JSON: µs per new token both ways.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path



def every_stop(tokens, stops, checked):
    """The naive cut StopMatcher replaces: every stop compared at every position since ``checked``."""
    for end in range(max(checked, 0) + 1, len(tokens) + 1):
        for stop in stops:
            if end >= len(stop) and tuple(tokens[end - len(stop): end]) == stop:
                return end - len(stop)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stops", type=int, default=1024)
    p.add_argument("--target", default=None, help="a model directory with the tokenizer (default: the demo's)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    from _lib.record import emit_json
    from trtllm_dflash.runtime.text import load_tokenizer
    from trtllm_dflash.runtime.protocol import StopMatcher

    if args.target is None:
        from trtllm_dflash.assets import prepare_demo_assets

        args.target = prepare_demo_assets()["target"]
    tok = load_tokenizer(args.target)
    stops = tuple(tuple(tok.encode(f"zq{i}xv word of many tokens number {i} and more", add_special_tokens=False))
                  for i in range(args.stops))
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    tokens = tok.encode(readme, add_special_tokens=False)[:512]
    matcher = StopMatcher(stops)
    out = {"stops": args.stops, "tokens": len(tokens)}
    for name, cut in (("every_stop", lambda t, c: every_stop(t, stops, c)), ("indexed", matcher.truncate)):
        cuts, t0 = [], time.perf_counter()
        for n in range(1, len(tokens) + 1):
            cuts.append(cut(tokens[:n], n - 1))
        out[f"{name}_us_per_token"] = round((time.perf_counter() - t0) / len(tokens) * 1e6, 2)
        out.setdefault("cuts", cuts)
        if cuts != out["cuts"]:
            print(json.dumps({"error": "the two ways cut differently"}))
            return 1
    out["same_cuts"] = True
    del out["cuts"]
    emit_json(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
