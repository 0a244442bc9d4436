#!/usr/bin/env python3
"""Trainer throughput: block tokens/s of one optimizer step (forward + backward + AdamW) of the DFlash objective.

The real SmolLM2 target (embedding + LM head, frozen) and a the shipped drafter (3 layers, B = 16)
train on sequences whose taps come from the real target. Configurations run in alternation, round after round, in one
process (the machine is shared: only ratios between configurations measured side by side mean anything). Block tokens
per step = blocks × B; the accuracy check compares each configuration's loss and gradient with fp32's on the same batch.

    python perf/bench_trainer.py --rounds 3 --out perf/results/drafter-trainer/throughput.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time

CONFIGS = {  # name: (sequences per step, anchors per sequence, autocast bf16, loss vocab, packed attention)
    "before: 4 seq x 16 anchors, fp32, full vocab, per-block context copy": (4, 16, False, "full", False),
    "4 seq x 16 anchors, fp32, data vocab, per-block copy (shipped recipe)": (4, 16, False, "data", False),
    "4 seq x 128 anchors, fp32, full vocab, per-block copy": (4, 128, False, "full", False),
    "4 seq x 128 anchors, fp32, full vocab, packed": (4, 128, False, "full", True),
    "4 seq x 128 anchors, bf16 autocast, full vocab, packed": (4, 128, True, "full", True),
    "4 seq x 128 anchors, bf16 autocast, data vocab, packed": (4, 128, True, "data", True),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (prompt 128 + response)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import torch

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.train.data import Sample
    from trtllm_dflash.train.objective import collate, dflash_loss, sample_anchors

    torch.set_num_threads(args.threads)
    assets = prepare_demo_assets()
    target, drafter = load_pair(assets["target"], assets["drafter"])  # the shipped drafter: realistic losses
    spec = drafter.spec
    drafter.requires_grad_(True).train()
    g = torch.Generator().manual_seed(0)
    samples = []
    with torch.no_grad():
        for _ in range(4):
            ids = torch.randint(100, 20000, (args.seq_len,), generator=g)
            _, taps = target(ids[None], target.new_cache(1, args.seq_len), tap_layers=spec.target_layer_ids)
            samples.append(Sample(ids, taps[0].to(torch.bfloat16), 128))  # raw taps: the export folds the scale
    vocab = torch.unique(torch.cat([s.ids for s in samples]))
    vocab = torch.cat([vocab, torch.randperm(target.spec.vocab_size, generator=g)[:8192]]).unique()
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-6)

    def step(cfg, measure_grad=False):
        n, a, bf16, lv, packed = cfg
        anchors = [sample_anchors(s.prompt_len, len(s.ids), a, torch.Generator().manual_seed(1)) for s in samples[:n]]
        batch = collate(samples[:n], anchors, "cpu")
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with ctx:
            m = dflash_loss(drafter, target.embed, target.lm_head, batch, 7.0, vocab if lv == "data" else None, packed)
        opt.zero_grad(set_to_none=True)
        m.loss.backward()
        grad = torch.cat([q.grad.flatten() for q in drafter.parameters()]) if measure_grad else None
        if not measure_grad:
            opt.step()
        return time.perf_counter() - t0, int(batch.anchor_valid.sum()) * spec.block_size, float(m.loss.detach()), grad

    # accuracy: each configuration against fp32 with the same anchors, vocabulary and weights
    acc = {}
    for name, cfg in CONFIGS.items():
        ref = step((cfg[0], cfg[1], False, cfg[3], False), measure_grad=True)
        got = step(cfg, measure_grad=True)
        cos = float(torch.nn.functional.cosine_similarity(ref[3].double(), got[3].double(), dim=0))
        acc[name] = {"loss_fp32": round(ref[2], 5), "loss": round(got[2], 5), "grad_cosine_vs_fp32": round(cos, 5)}
    times = {name: [] for name in CONFIGS}
    tokens = {}
    for name, cfg in CONFIGS.items():  # warm-up
        step(cfg)
    for r in range(args.rounds):
        for name, cfg in CONFIGS.items():
            dt, tok, _, _ = step(cfg)
            times[name].append(dt)
            tokens[name] = tok
        print(f"round {r + 1}: " + ", ".join(f"{tokens[k] / times[k][-1]:.0f}" for k in CONFIGS), file=sys.stderr)
    base = next(iter(CONFIGS))
    rows = {}
    for name in CONFIGS:
        med = sorted(times[name])[len(times[name]) // 2]
        rows[name] = {"block_tokens_per_step": tokens[name], "median_step_s": round(med, 3),
                      "block_tokens_per_s": round(tokens[name] / med, 1), **acc[name],
                      "per_round_ratio_vs_before": [round((tokens[name] / t) / (tokens[base] / tb), 3)
                                                    for t, tb in zip(times[name], times[base])]}
    report = {"command": "python perf/bench_trainer.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "seq_len": args.seq_len, "drafter": "shipped smollm2-135m-instruct-dflash (3 layers, B=16)", "configs": rows,
              "machine": f"{platform.machine()} {os.cpu_count()} cpus (shared with other jobs), torch "
                         f"{torch.__version__}, {torch.get_num_threads()} threads",
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
        os.replace(args.out + ".tmp", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
