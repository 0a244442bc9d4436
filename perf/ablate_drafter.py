#!/usr/bin/env python3
"""Drafter-training ablations over one shared taps cache: same prompts, same regenerated responses, same held-out
sequences, same step budget; one knob changed per variant. Prints one JSON object with each variant's held-out
metrics (expected τ = 1 + Σ_k Π_{j≤k} acc_j over the block, per-position accuracy, loss) from its training log.

    python perf/ablate_drafter.py --source-work artifacts/train/smollm2-135m-instruct-dflash --steps 150 \
        --variants base,layers1,gamma4,init-random --json

``--source-work`` is a ``train-drafter`` work directory whose ``prompts.jsonl`` and ``taps/`` are reused (linked, not
copied); its taps fix the tapped layers, so tap ablations need their own cache. Every variant trains with the
shipped drafter's recipe (``BASE``) for ``--steps`` steps; only the named knob differs.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BASE = ["--num-layers", "3", "--target-layer-ids", "1", "14", "27", "--block-size", "16", "--mask-token-id", "16", "--data", "mined",
        "--num-code-prompts", "192", "--num-chat-prompts", "64", "--max-new-tokens", "256", "--max-prompt-len", "384",
        "--gen-batch-size", "32", "--samples-per-step", "4", "--anchors-per-sample", "16", "--lr", "0.001",
        "--warmup", "0.04", "--weight-decay", "0.0", "--gamma", "7.0", "--loss-vocab", "data",
        "--loss-negatives", "8192", "--init", "target", "--seed", "0", "--device", "cpu", "--threads", "1"]

# variant -> the flags it overrides
VARIANTS = {
    "base": {},
    "layers1": {"--num-layers": "1"},
    "layers5": {"--num-layers": "5"},
    "gamma4": {"--gamma": "4.0"},
    "gamma16": {"--gamma": "16.0"},
    "init-random": {"--init": "random"},
    "full-vocab-loss": {"--loss-vocab": "full"},
}


def flags(variant: str, steps: int) -> list[str]:
    out, over = list(BASE), VARIANTS[variant]
    for key, value in over.items():
        out[out.index(key) + 1] = value
    return out + ["--steps", str(steps), "--log-every", "10", "--ckpt-every", str(steps)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source-work", required=True, help="train-drafter work dir whose prompts and taps are reused")
    p.add_argument("--target", default=str(Path.home() / ".cache/trtllm_dflash/smollm2-135m-instruct"))
    p.add_argument("--variants", default="base,layers1,gamma4,init-random")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default="artifacts/ablations")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    src, root = Path(args.source_work).resolve(), Path(args.out)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown or not (src / "taps").is_dir():
        print(f"ablate_drafter: error: --variants {unknown} must be in {sorted(VARIANTS)} and "
              f"--source-work must hold taps/ (got {src})", file=sys.stderr)
        return 2
    results = {"source_work": str(args.source_work), "steps": args.steps, "variants": {}}
    for variant in args.variants.split(","):
        work, out = root / variant / "work", root / variant / "drafter"
        work.mkdir(parents=True, exist_ok=True)
        for name in ("prompts.jsonl", "taps"):
            if not (work / name).exists():
                (work / name).symlink_to(src / name)
        cmd = [sys.executable, "-m", "trtllm_dflash.train.cli", "--target", args.target, "--out", str(out),
               "--work-dir", str(work), *flags(variant, args.steps)]
        if (work / "checkpoint.pt").exists():
            cmd.append("--resume")
        t0 = time.time()
        with open(root / variant / "train.log", "a") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT)
        log_doc = json.loads((out / "training_log.json").read_text()) if rc == 0 else None
        held = log_doc["held_out"][-1] if log_doc else None
        results["variants"][variant] = {
            "overrides": VARIANTS[variant], "exit_code": rc, "seconds": round(time.time() - t0),
            "held_out": held, "command": " ".join(cmd[1:]).replace(str(Path.home()), "~"),
        }
        print(json.dumps({variant: results["variants"][variant]}), file=sys.stderr)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
