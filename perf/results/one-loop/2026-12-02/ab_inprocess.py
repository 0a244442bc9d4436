#!/usr/bin/env python3
"""Two SpeculativeDecoder implementations timed in ONE process, alternating, on the same loaded models and prompts.

The decoder before the one-loop change is read from git (``git show 32d5e3c:trtllm_dflash/runtime/decoder.py >
/tmp/decoder_before.py``) and imported from that file against this checkout's package (it needs nothing this
checkout lacks); the decoder after is ``trtllm_dflash.runtime.decoder``. Each repetition times every mode on both
sides, the order flipping every repetition, so the VM's drift (its speed moved by a third between runs of one
configuration) hits both sides alike. Prints one JSON line per (dataset, batch, mode): both sides' tokens/s per
repetition, the medians, ratio = after / before, and whether their tokens are identical.

With ``--pair-by call`` the two sides alternate on every ``generate`` call instead (one prompt at batch 1, one batch
of prompts at batch 8), the order flipping every call, so each pair is two back-to-back runs of the same work a few
seconds apart. The line then also carries each call's speed ratio after / before, their geometric mean and its 95 %
confidence interval (a t interval on the log ratios): the resolution the many short pairs buy on a noisy machine.

Every line also says what each side planned: its steps, its mean drafts per step, and the share of requests whose
plans (k per step) were the same on both sides. Under ``auto`` each side's cost model follows the step times it
observes, so the two drift apart and plan differently; ``--freeze-cost`` gives both sides one copy of the calibrated
model that no step updates, so that equal acceptances give equal plans and the pairs time the loops alone.

    python perf/results/one-loop/2026-12-02/ab_inprocess.py --before /tmp/decoder_before.py --reps 5
    python perf/results/one-loop/2026-12-02/ab_inprocess.py --before /tmp/decoder_before.py --reps 3 --limit 16 \
        --pair-by call --batches 1 --modes 16,auto+ngram
    python perf/results/one-loop/2026-12-02/ab_inprocess.py --before /tmp/decoder_before.py --reps 3 --limit 16 \
        --pair-by call --batches 1,8 --modes auto+ngram --freeze-cost
    git show HEAD:trtllm_dflash/runtime/decoder.py > /tmp/decoder_now.py     # one decoder, frozen against adapting
    python perf/results/one-loop/2026-12-02/ab_inprocess.py --before /tmp/decoder_now.py --reps 3 --limit 32 \
        --pair-by call --batches 8 --modes auto+ngram --freeze-cost before
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--before", required=True, help="the earlier decoder.py (git show COMMIT:trtllm_dflash/runtime/decoder.py)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--datasets", default="humaneval,mtbench")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--modes", default="1,16,auto+ngram")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--pair-by", choices=("rep", "call"), default="rep",
                   help="alternate the sides per repetition (default) or per generate call")
    p.add_argument("--freeze-cost", nargs="?", const="both", default=None, choices=("both", "before", "after"),
                   help="auto: both sides plan from one copy of the calibrated cost model that no step updates, so "
                        "equal acceptance histories give equal plans and the pairs time the loops, not two cost "
                        "models adapting apart; 'before' or 'after' freezes that side alone (the other adapts as "
                        "it does in service): with --before set to this checkout's decoder, frozen against "
                        "adapting")
    args = p.parse_args()

    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.perf.pairing import ratio_summary
    from trtllm_dflash.runtime import decoder as after
    from trtllm_dflash.runtime.acceptance import prior_from_training_log
    from trtllm_dflash.runtime.cost import CostModel
    from trtllm_dflash.runtime.mode import DecodeMode
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids

    spec = importlib.util.spec_from_file_location("decoder_before", args.before)
    before = importlib.util.module_from_spec(spec)
    sys.modules["decoder_before"] = before
    spec.loader.exec_module(before)

    torch.set_num_threads(args.threads)
    assets = prepare_demo_assets()
    target, drafter = load_pair(assets["target"], assets["drafter"])
    tok = load_tokenizer(assets["target"])
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    prior = prior_from_training_log(assets["drafter"], drafter.spec.block_size - 1)

    def decoder(module, mode: DecodeMode):
        if mode.autoregressive:
            return module.SpeculativeDecoder(target, None, 1)
        return module.SpeculativeDecoder(target, drafter, mode.block_size, prior=prior if mode.auto else None,
                                         ngram=mode.ngram)

    modes = [DecodeMode.parse(m) for m in args.modes.split(",")]
    jobs = [(ds, int(b), m) for ds in args.datasets.split(",") for b in args.batches.split(",") for m in modes]
    bar = tqdm(total=len(jobs) * args.reps * 2, desc="A/B", file=sys.stderr)
    for ds, batch, mode in jobs:
        prompts = [tuple(encode_prompt(tok, q.text, q.chat)) for q in load_prompts(ds, args.limit)]
        sides = {"before": decoder(before, mode), "after": decoder(after, mode)}
        if args.freeze_cost and mode.auto:
            frozen = sides["before"].policy.cost.to_json()
            for side, dec in sides.items():
                dec.policy.cost = CostModel.from_json(frozen)
                if args.freeze_cost in ("both", side):
                    dec.policy.cost.observe = lambda *a, **kw: None
        rates, tokens = {s: [] for s in sides}, {}
        call_ratios: list[float] = []
        plans: dict[str, list] = {s: [] for s in sides}  # each counted request's k per step, in schedule order

        def run(side: str, chunk: list) -> tuple[list, int, float, list]:
            mod = before if side == "before" else after
            t0 = time.perf_counter()
            res = sides[side].generate([mod.Request(p, args.max_new_tokens, stop_token_ids=stops) for p in chunk])
            dt = time.perf_counter() - t0
            return ([r.token_ids for r in res], sum(r.num_new_tokens for r in res), dt,
                    [r.draft_lengths or (mode.block_size - 1,) * len(r.acceptance_lengths) for r in res])

        chunks = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
        def schedule(rep: int) -> list[tuple[str, int, list]]:
            """(side, call, prompts) in the order one repetition runs them; the order of the sides flips every
            repetition, or with ``--pair-by call`` every call."""
            flip = lambda i: list(sides) if i % 2 == 0 else list(sides)[::-1]  # noqa: E731
            if args.pair_by == "call":
                return [(side, c, chunk) for c, chunk in enumerate(chunks) for side in flip(rep + c)]
            return [(side, c, chunk) for side in flip(rep) for c, chunk in enumerate(chunks)]

        for rep in range(args.reps + 1):  # repetition 0 warms both sides up and is not counted
            n, spent, out = {s: 0 for s in sides}, {s: 0.0 for s in sides}, {s: [] for s in sides}
            took: dict[int, dict[str, float]] = {}  # call -> side -> seconds
            planned: dict[str, dict[int, list]] = {s: {} for s in sides}  # side -> call -> its requests' k
            for side, c, chunk in schedule(rep):
                toks, k, dt, ks = run(side, chunk)
                planned[side][c] = ks
                out[side] += toks
                n[side] += k
                spent[side] += dt
                took.setdefault(c, {})[side] = dt
            if rep:
                for side in sides:
                    rates[side].append(round(n[side] / spent[side], 3))
                    bar.update()
                    plans[side] += [ks for c in sorted(planned[side]) for ks in planned[side][c]]
                if args.pair_by == "call":  # same tokens on both sides: speed after / before
                    call_ratios += [t["before"] / t["after"] for t in took.values()]
            tokens = out
        med = {s: statistics.median(v) for s, v in rates.items()}
        line = {"dataset": ds, "batch_size": batch, "mode": mode.label, "before": rates["before"],
                "after": rates["after"], "before_median": med["before"], "after_median": med["after"],
                "ratio": round(med["after"] / med["before"], 4),
                "identical_tokens": tokens["before"] == tokens["after"], "freeze_cost": args.freeze_cost,
                # the plans each side made: steps, drafts verified per step, and the requests planned alike
                "steps": {s: sum(map(len, v)) for s, v in plans.items()},
                "k_mean": {s: round(statistics.fmean([k for ks in v for k in ks] or [0]), 3) for s, v in plans.items()},
                "same_plans": round(statistics.fmean(a == b for a, b in zip(plans["before"], plans["after"])), 4)}
        if call_ratios:
            line.update(ratio_summary(call_ratios))
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
