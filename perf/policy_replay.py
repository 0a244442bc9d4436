#!/usr/bin/env python3
"""Replay ``--block-size auto``'s prompt-lookup decisions on known greedy outputs, without the machine's noise.

A static batch of greedy outputs (``perf/ngram_acceptance.py --generate``'s JSON) is decoded again on paper: every
step the policy decides from its cost model and each row's lookup (``runtime.lookup.ngram_lookup``), a row accepts
what its proposal shares with the known output, and the step costs what the cost model says. The drafter is left out
(its acceptance needs the model); so are the machine's timing swings, which on a shared 2-core VM move an in-process
batch-16 run by ±10 % and hide policy changes worth a few per cent. Prints JSON: simulated seconds, steps and τ per
variant, and the same for autoregressive decoding (one token per row and step).

    python perf/policy_replay.py artifacts/lookup/greedy-mtbench.json --batch-size 16 --max-new-tokens 48
    python perf/policy_replay.py artifacts/lookup/greedy-humaneval.json --extra-context 1000 \
        --policy-cost perf/results/adaptive/2026-11-27-verify-cost/cost-cache-2threads-amd-v2.json   # the decoder's own starting belief

The policy's cost model is pulled toward each step's true cost as the decoder pulls it toward the step it timed.
Steps cost more as the rows' contexts grow (``CostModel.context``: each row's prompt and the tokens it has so far).
Variants: the lookup's acceptance from the sequence's history (``NGRAM_PRIOR``, the decoder's earlier forecast) or
from the match's features (``Lookup.prior``), each with and without a static batch's row weights (``batch_weights``);
and "match+weights" with a belief blind to the context (α = β = 0: a cost model that ignores context).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


# the cost of a verify over n tokens on the 2-core development machine (AMD EPYC, 2 threads), ms, over an empty
# cache, each row's first slot through the LM head: 16 rows × (K + 1) tokens from 16 tokens up; below, the rows left
# in a finishing batch, one token each (1, 4 and 8 rows measured, 2 interpolated); and what attending over the rows'
# contexts adds, per context token, α per row and β per verified token (least squares over the same runs over 300
# tokens of context, 1 to 16 rows × 1 to 16 tokens), with small products weight-major on a CPU
# (models.layers.Linear): perf/verify_cost.py --dtype float32 --threads 2 --batch 16,8,4,1 --sizes 1,2,4,8,16 --head
# first --context 0,300 --repeats 12 (perf/results/cpu-gemm/verify-cost-context.json; medians, sizes and contexts
# interleaved). With ``F.linear`` for every product (perf/results/adaptive/2026-11-27-verify-cost/): {1: 39.7,
# 2: 50.0, 4: 58.1, 8: 58.1, 16: 74.1, 32: 92.8, 64: 128.8, 128: 209.6, 256: 341.5}, α 2.7 µs, β 0.31 µs.
DEFAULT_COST = {1: 22.4, 2: 22.7, 4: 23.3, 8: 41.3, 16: 60.9, 32: 81.2, 64: 123.1, 128: 211.9, 256: 357.0}
DEFAULT_CONTEXT_S = (2.55e-6, 0.55e-6)


def row_context(row: dict, emitted: int, extra_context: int) -> int:
    """The tokens a row's next verify attends over: the extra context, its prompt and what it has emitted."""
    return extra_context + len(row["prompt_ids"]) + emitted


def replay(rows, policy_factory, truth, batch_size: int, max_new: int, features: bool, weights: bool,
           extra_context: int = 0) -> dict:
    """Simulated seconds, steps, tokens and τ of decoding ``rows`` in static batches; ``features``: the policy sees
    each lookup's match (``SeqState.lookup``; without it, the sequence's lookup history decides)."""
    from trtllm_dflash.runtime.lookup import LOOKUP_MIN_N, ngram_lookup
    from trtllm_dflash.train.audit import accepted_prefix

    seconds = steps = tokens = row_steps = 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        policy = policy_factory()
        states = [policy.new_sequence() for _ in batch]
        done = [0] * len(batch)  # output tokens emitted per row
        want = [min(max_new, len(r["token_ids"])) for r in batch]
        while True:
            active = [j for j in range(len(batch)) if done[j] < want[j]]
            if not active:
                break
            found = [ngram_lookup(batch[j]["prompt_ids"] + batch[j]["token_ids"][:done[j]], policy.max_k,
                                  min_n=LOOKUP_MIN_N) for j in active]
            st = [states[j] for j in active]
            for j, s, lk in zip(active, st, found):
                s.lookup = lk if features else None
                s.context = row_context(batch[j], done[j], extra_context)
            w = policy.batch_weights([want[j] - done[j] for j in active], sum(s.context for s in st)) if weights \
                else [1.0] * len(active)
            for s, wj in zip(st, w):
                s.weight = wj
            ks = policy.decide(st, [len(lk.tokens) for lk in found])
            accepted = []
            for j, s, lk, k in zip(active, st, found, ks):
                a = accepted_prefix(lk.tokens[:k], batch[j]["token_ids"], done[j]) if s.source == "ngram" else 0
                accepted.append(max(min(a, want[j] - done[j] - 1), 0))  # the step's last token is the bonus
            for s, k, a in zip(st, ks, accepted):
                policy.observe(s, k, a)
            kmax = max(ks)
            width, context = len(active) * (kmax + 1), policy.context
            seconds += truth.step(len(active), kmax, 0, context=context)
            # as the decoder feeds back the step it timed
            policy.cost.observe(width, truth.verify(width, len(active), context), rows=len(active), context=context)
            steps += 1
            for j, a in zip(active, accepted):
                done[j] += a + 1
                tokens += a + 1
                row_steps += 1
    return {"seconds": round(seconds, 4), "steps": steps, "tokens": tokens, "tau": round(tokens / row_steps, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("greedy", help="greedy outputs JSON (perf/ngram_acceptance.py --generate)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--limit", type=int, default=0)
    p.add_argument("--extra-context", type=int, default=0, metavar="N",
                   help="N more cached tokens before every prompt (a long system prompt): what its verifies cost")
    p.add_argument("--true-cost", metavar="FILE", help="what steps really cost, as a cost cache file (default: "
                   "DEFAULT_COST and DEFAULT_CONTEXT_S, timed on the 2-core development machine)")
    p.add_argument("--policy-cost", metavar="FILE",
                   help="what the policy believes steps cost: a cost cache file (the decoder's calibration, "
                        "$TRTLLM_DFLASH_CACHE/adaptive/cost-*.json); default: the true cost below")
    args = p.parse_args(argv)
    from trtllm_dflash.runtime.cost import GRID, CostModel
    from trtllm_dflash.runtime.policy import AdaptivePolicy

    path = Path(args.greedy)
    if not path.is_file():
        print(f"greedy={str(path)!r}: not a file; write one with perf/ngram_acceptance.py --generate", file=sys.stderr)
        return 2
    rows = json.loads(path.read_text())[: args.limit or None]
    verify = [DEFAULT_COST[n] / 1e3 for n in GRID]
    truth = CostModel.from_json(json.loads(Path(args.true_cost).read_text())) if args.true_cost else \
        CostModel(verify, [v / 2 for v in verify], context_row_s=DEFAULT_CONTEXT_S[0],
                  context_token_s=DEFAULT_CONTEXT_S[1])
    belief = CostModel.from_json(json.loads(Path(args.policy_cost).read_text())) if args.policy_cost else truth

    def policy_factory(context: bool):
        def make():
            cost = CostModel(list(belief.verify_s), list(belief.draft_s),
                             context_row_s=belief.context_row_s if context else 0.0,
                             context_token_s=belief.context_token_s if context else 0.0)
            return AdaptivePolicy(cost, 16, prior=[0.02] * 15, probe_every=10**6, max_probe_every=10**6, ngram=True)
        return make

    out = {"greedy": str(path), "prompts": len(rows), "batch_size": args.batch_size,
           "extra_context": args.extra_context,
           "max_new_tokens": args.max_new_tokens, "true_cost_ms": [round(v * 1e3, 1) for v in truth.verify_s],
           "policy_cost_ms": [round(v * 1e3, 1) for v in belief.verify_s],
           "true_context_us": [round(truth.context_row_s * 1e6, 3), round(truth.context_token_s * 1e6, 3)],
           "policy_context_us": [round(belief.context_row_s * 1e6, 3), round(belief.context_token_s * 1e6, 3)]}
    ar = 0.0
    for i in range(0, len(rows), args.batch_size):
        batch = rows[i:i + args.batch_size]
        want = [min(args.max_new_tokens, len(r["token_ids"])) for r in batch]
        for t in range(max(want)):
            live = [row_context(r, t, args.extra_context) for r, w in zip(batch, want) if w > t]
            ar += truth.step(len(live), 0, 0, context=sum(live))
    out["autoregressive_seconds"] = round(ar, 4)
    for name, features, weights, context in (("history", False, False, True), ("match", True, False, True),
                                             ("match+weights", True, True, True),
                                             ("history+weights", False, True, True),
                                             ("match+weights, context-blind", True, True, False)):
        res = replay(rows, policy_factory(context), truth, args.batch_size, args.max_new_tokens, features, weights,
                     args.extra_context)
        res["speedup"] = round(ar / res["seconds"], 4)
        out[name] = res
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
