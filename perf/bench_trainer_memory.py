#!/usr/bin/env python3
"""Trainer memory: the process's resident memory step after step, with and without returning the C heap's free pages.

Runs the real training loop (``train.trainer.train``, the learning-curve recipe: 4 sequences × 128 anchors, bf16
autocast, data vocabulary, THP on) on synthetic sequences of the regenerated data's length mix (prompts of 30-250
tokens, responses of 30-256, random tokens and taps: memory depends on the shapes only), once per mode, each in its
own process (allocator state is per process). A mode is ``trainer.TRIM_EVERY``: 0 = never trim (the allocator keeps
what it freed), n = ``malloc_trim`` every n steps. Prints JSON (resident MB per step, growth per step, median step
time) and, with ``--plot``, a PNG of resident memory against step.

    python perf/bench_trainer_memory.py --steps 48 --modes 0 8 1 --out perf/results/drafter-trainer/memory.json \\
        --plot perf/results/drafter-trainer/memory.png
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args) -> None:
    from trtllm_dflash.train.cli import use_huge_pages

    use_huge_pages()  # as the trainer's entry points do, before torch
    import torch

    from trtllm_dflash.train.curve import RECIPE
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.train import trainer
    from trtllm_dflash.train.cli import add_arguments
    from trtllm_dflash.train.config import TrainConfig
    from trtllm_dflash.train.data import Sample
    from trtllm_dflash.train.pipeline import drafter_spec

    torch.set_num_threads(args.threads)
    target_dir = prepare_demo_assets()["target"]
    target = TargetModel.from_pretrained(target_dir, dtype=torch.float32)
    taps = [1, 14, 27]
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(args.sequences):
        p, r = int(torch.randint(30, 251, (1,), generator=g)), int(torch.randint(30, 257, (1,), generator=g))
        samples.append(Sample(torch.randint(100, 20000, (p + r,), generator=g),
                              torch.randn(p + r, len(taps) * target.spec.hidden_size, generator=g).bfloat16(), p))
    with tempfile.TemporaryDirectory() as work:
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        cfg = TrainConfig.from_args(parser.parse_args([
            "--target", str(target_dir), "--out", f"{work}/export", "--work-dir", work, *RECIPE, "--init", "random",
            "--steps", str(args.steps), "--num-layers", "3", "--target-layer-ids", *map(str, taps),
            "--samples-per-step", "4", "--anchors-per-sample", "128", "--threads", str(args.threads),
            "--log-every", "1", "--ckpt-every", str(10 * args.steps), "--data", work]))
        trainer.TRIM_EVERY = args.trim_every
        trainer.train(cfg, Path(work), target, drafter_spec(cfg, target.spec), [], resume=False, samples=samples)
        records = json.loads(Path(f"{work}/export/training_log.json").read_text())["records"]
    Path(args.child_out).write_text(json.dumps({
        "resident_mb": [r["resident_mb"] for r in records], "seconds_per_step": [r["seconds_per_step"] for r in records],
    }))


def summarise(trim_every: int, got: dict) -> dict:
    mb, secs = got["resident_mb"], got["seconds_per_step"]
    n = len(mb)
    xs = range(n)
    mx, my = (n - 1) / 2, sum(mb) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, mb)) / max(1e-9, sum((x - mx) ** 2 for x in xs))
    steady = sorted(secs[2:] or secs)
    return {"trim_every": trim_every, "resident_mb_first": mb[0], "resident_mb_max": max(mb),
            "resident_mb_last": mb[-1], "growth_mb_per_step": round(slope, 1),
            "median_step_s": steady[len(steady) // 2], "resident_mb": mb, "seconds_per_step": secs}


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from trtllm_dflash.perf.report import save_png

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        label = "never trimmed" if r["trim_every"] == 0 else f"malloc_trim every {r['trim_every']} steps"
        ax.plot(range(1, len(r["resident_mb"]) + 1), r["resident_mb"],
                label=f"{label} ({r['median_step_s']:.2f} s/step)")
    ax.set_xlabel("training step")
    ax.set_ylabel("resident memory (MB)")
    ax.set_title("Drafter trainer memory (4 seq x 128 anchors, bf16 autocast)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--modes", type=int, nargs="+", default=[0, 8, 1], help="TRIM_EVERY values (0 = never trim)")
    p.add_argument("--sequences", type=int, default=400)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--trim-every", type=int, default=None, help=argparse.SUPPRESS)  # child process
    p.add_argument("--child-out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child_out:
        child(args)
        return 0
    for name in ("steps", "sequences", "threads"):
        if getattr(args, name) < 1:
            print(f"error: --{name} {getattr(args, name)} must be >= 1", file=sys.stderr)
            return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            out = f"{tmp}/{mode}.json"
            subprocess.run([sys.executable, __file__, "--child-out", out, "--trim-every", str(mode),
                            "--steps", str(args.steps), "--sequences", str(args.sequences),
                            "--threads", str(args.threads)], check=True)
            rows.append(summarise(mode, json.loads(Path(out).read_text())))
            print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("resident_mb", "seconds_per_step")}),
                  file=sys.stderr)
    import torch

    report = {"command": "python perf/bench_trainer_memory.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "modes": rows, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                         f"{args.threads} threads"}
    print(json.dumps(report, indent=1))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        Path(args.out + ".tmp").write_text(json.dumps(report, indent=1) + "\n")
        os.replace(args.out + ".tmp", args.out)
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
