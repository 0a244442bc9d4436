#!/usr/bin/env python3
"""How often prompt lookup's proposals are accepted: per-slot conditional acceptance of the decoder's lookup
(``runtime.lookup.ngram_continuation`` with ``LOOKUP_MIN_N``: the continuation of a recurring 2- or 3-gram) over
known greedy outputs, at every response position.

    python perf/ngram_acceptance.py artifacts/curve19/regen              # regenerated training shards (*.safetensors)
    python perf/ngram_acceptance.py artifacts/curve14/eval/greedy-humaneval-164-128.json   # cached greedy outputs

Prints one JSON object: the fraction of positions with a proposal, and p_j = P(slot j accepted | slots before it
were), j = 1..B−1, with the number of proposals that reached each slot. ``NGRAM_PRIOR`` in runtime/acceptance.py is this
script's output on regenerated training data (pool prompts, never the evaluation sets).

``--by-match`` adds what ``runtime.lookup.Lookup.prior`` is fitted from: P(slot 1 accepted) by the match's length
bin and whether the n-gram's two latest occurrences were followed by different tokens, and the later slots'
conditional acceptance by bin (``LOOKUP_FIRST``, ``LOOKUP_NEXT``); and how well each way of predicting a step's
lookup forecasts it along the decoder's own walk (every step proposes; log-loss per verified slot): the sequence's
history with ``NGRAM_PRIOR`` (the decoder's forecast before ``Lookup.prior`` replaced it) against the match's
features held at several strengths.
Greedy outputs of the training pool (the fit's source, never the evaluation sets):

    python perf/ngram_acceptance.py --generate trtllm_dflash/data/drafters/smollm2-135m-instruct-dflash/\
training_prompts.jsonl.gz --every 200 --by-match artifacts/lookup/greedy-pool.json   # writes it, then analyses it
    python perf/ngram_acceptance.py --generate humaneval --every 1 --by-match artifacts/lookup/greedy-humaneval.json
"""

from __future__ import annotations

import argparse
import gzip
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
    from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, ngram_continuation

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


def by_match(seqs, block_size: int = 16) -> dict:
    """P(slot 1 accepted) per (match bin, split) and the later slots' conditional acceptance per bin, at every
    response position that has a proposal."""
    from trtllm_dflash.runtime.lookup import LOOKUP_MATCH_BINS, LOOKUP_MIN_N, lookup_bin, ngram_lookup
    from trtllm_dflash.train.audit import accepted_prefix

    nb = len(LOOKUP_MATCH_BINS) + 1
    first = [[[0, 0] for _ in range(nb)] for _ in range(2)]  # [split][bin] = [accepted, proposals]
    later = [[0, 0] for _ in range(nb)]  # [bin] = [accepted, reached] over slots 2..
    for ids, prompt_len in seqs:
        for a in range(prompt_len, len(ids) - 1):
            lk = ngram_lookup(ids[: a + 1], block_size - 1, min_n=LOOKUP_MIN_N)
            if not lk.tokens:
                continue
            b, acc = lookup_bin(lk.match), accepted_prefix(lk.tokens, ids, a + 1)
            reach = min(len(lk.tokens), len(ids) - a - 1)
            first[int(lk.split)][b][0] += acc > 0
            first[int(lk.split)][b][1] += 1
            if acc:
                later[b][0] += acc - 1
                later[b][1] += acc - 1 + (acc < reach)
    ratio = lambda c: round(c[0] / c[1], 3) if c[1] else None  # noqa: E731
    return {"match_bins_upper": list(LOOKUP_MATCH_BINS) + [None],
            "first": [[ratio(c) for c in row] for row in first], "first_n": [[c[1] for c in row] for row in first],
            "next": [ratio(c) for c in later], "next_n": [c[1] for c in later]}


def forecast_loss(seqs, block_size: int = 16, strengths=(0.5, 2.0, 8.0, 1e6)) -> dict:
    """Log-loss per verified slot of each predictor along the decoder's walk (a step proposes the lookup where there
    is one and moves past its accepted tokens and the bonus), all of slot 1's and all slots'."""
    import math

    from trtllm_dflash.runtime.acceptance import NGRAM_PRIOR, NGRAM_PRIOR_STRENGTH, AcceptanceModel
    from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, ngram_lookup
    from trtllm_dflash.train.audit import accepted_prefix

    k = block_size - 1
    ways = {"history": None, **{f"match x{s:g}": s for s in strengths}}
    loss = {w: [0.0, 0, 0.0, 0] for w in ways}  # all slots: sum, n; slot 1: sum, n
    for ids, prompt_len in seqs:
        models = {w: AcceptanceModel(k, list(NGRAM_PRIOR), NGRAM_PRIOR_STRENGTH) for w in ways}
        a = prompt_len
        while a < len(ids) - 1:
            lk = ngram_lookup(ids[: a + 1], k, min_n=LOOKUP_MIN_N)
            if not lk.tokens:
                a += 1
                for m in models.values():
                    m.relax()
                continue
            reach = min(len(lk.tokens), len(ids) - a - 1)
            acc = accepted_prefix(lk.tokens[:reach], ids, a + 1)
            for w, s in ways.items():
                probs = models[w].probabilities(*(() if s is None else (lk.prior(k), s)))
                for j in range(min(acc + 1, reach)):
                    p = min(max(probs[j], 1e-3), 1 - 1e-3)
                    nll = -math.log(p if j < acc else 1 - p)
                    loss[w][0] += nll
                    loss[w][1] += 1
                    if j == 0:
                        loss[w][2] += nll
                        loss[w][3] += 1
                models[w].observe(reach, acc)
            a += acc + 1
    return {w: {"all_slots": round(v[0] / max(v[1], 1), 4), "slot_1": round(v[2] / max(v[3], 1), 4), "steps": v[3]}
            for w, v in loss.items()}


def generate(prompts: str, every: int, out: Path, max_new_tokens: int = 128, batch_size: int = 16) -> None:
    """Greedy outputs (target only, the demo SmolLM2) of every ``every``-th prompt of a JSONL(.gz) file, HumanEval or
    MT-Bench, written as a greedy-reference JSON (atomically)."""
    import torch

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import Prompt, load_prompts
    from trtllm_dflash.models.weights import write_json
    from trtllm_dflash.runtime.text import load_tokenizer, stop_token_ids
    from trtllm_dflash.train.audit import greedy_rows

    assets = prepare_demo_assets()
    target, _ = load_pair(assets["target"], None, dtype=torch.float32)
    tok = load_tokenizer(assets["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    if prompts in ("humaneval", "mtbench"):
        chosen = load_prompts(prompts)[::every]
    else:
        opener = gzip.open if prompts.endswith(".gz") else open
        with opener(prompts, "rt") as f:  # the training prompts: gzipped JSONL with an "id" and "chat" per line
            lines = [json.loads(line) for line in f if line.strip()]
        chosen = [Prompt(d.get("id", str(i)), d["prompt"], d.get("chat", True)) for i, d in enumerate(lines)][::every]
    rows = greedy_rows(target, tok, stops, chosen, max_new_tokens, batch_size)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(rows, out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", help="a folder of regenerated shards or a greedy-reference JSON file")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--by-match", action="store_true", help="also the match-feature table and the forecast losses")
    p.add_argument("--generate", metavar="PROMPTS.jsonl[.gz]|humaneval|mtbench",
                   help="first write greedy outputs (128 tokens) of every --every-th of these prompts to SOURCE")
    p.add_argument("--every", type=int, default=200)
    args = p.parse_args(argv)
    src = Path(args.source)
    if args.generate:
        if args.every < 1:
            print(f"--every={args.every}: must be >= 1", file=sys.stderr)
            return 2
        generate(args.generate, args.every, src)
    if not src.exists():
        print(f"source={str(src)!r}: does not exist; pass a shard folder or a greedy-*.json file", file=sys.stderr)
        return 2
    res = acceptance(sequences(src), args.block_size)
    if args.by_match:
        res.update(by_match=by_match(sequences(src), args.block_size),
                   forecast_loss=forecast_loss(sequences(src), args.block_size))
    print(json.dumps({"source": str(src), "block_size": args.block_size, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
