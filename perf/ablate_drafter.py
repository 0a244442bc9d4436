#!/usr/bin/env python3
"""Drafter-training ablations over one shared taps cache: same prompts, same regenerated responses, same held-out
sequences, same step budget; one knob changed per variant. Prints one JSON object with each variant's held-out
metrics (expected τ = 1 + Σ_k Π_{j≤k} acc_j over the block, per-position accuracy, loss) from its training log.

    python perf/ablate_drafter.py --source-work artifacts/train/smollm2-135m-instruct-dflash --steps 150 \
        --variants base,layers1,gamma4,init-random --json

``--source-work`` is a ``train-drafter`` work directory whose ``prompts.jsonl`` and ``taps/`` are reused (linked, not
copied). Tap variants (``taps-*``) keep its prompts and regenerated responses but re-tap them at their own layers
(``train.data.retap_cache``: one teacher-forced forward per sample, written under the variant's work dir). Every
variant trains with the shipped drafter's recipe (``BASE``) for ``--steps`` steps; only the named knob differs.
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
    # taps: BASE spreads 3 taps over the depth (the default rule, 1/14/27 of SmolLM2's 30 layers)
    # one late tap (EAGLE-1-like feature); 26 is the latest that leaves target layers 27-29 to initialise from
    "taps-single": {"--target-layer-ids": ["26"]},
    "taps-late": {"--target-layer-ids": ["23", "25", "27"]},  # three late layers
    "taps-five": {"--target-layer-ids": ["1", "7", "14", "20", "27"]},  # five spread taps
}


def flags(variant: str, steps: int) -> list[str]:
    out, over = list(BASE), VARIANTS[variant]
    for key, value in over.items():
        i = out.index(key) + 1
        j = next((k for k in range(i, len(out)) if out[k].startswith("--")), len(out))  # the key's old values
        out[i:j] = value if isinstance(value, list) else [value]
    return out + ["--steps", str(steps), "--log-every", "10", "--ckpt-every", str(steps)]


def retap(target_dir: str, src: Path, out: Path, layers: tuple[int, ...]) -> None:
    import torch
    from tqdm import tqdm

    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.train.data import retap_cache

    torch.set_num_threads(1)
    bar = tqdm(desc=f"re-tapping at layers {list(layers)}", unit="shard", file=sys.stderr)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    retap_cache(TargetModel.from_pretrained(target_dir), src, out, layers, progress)
    bar.close()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source-work", required=True, help="train-drafter work dir whose prompts and taps are reused")
    p.add_argument("--target", default=None, help="target HF directory (default: the demo target in the model cache)")
    p.add_argument("--variants", default="base,layers1,gamma4,init-random")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--out", default="artifacts/ablations")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.target is None:
        from trtllm_dflash.assets import cache_dir, TARGET_NAME

        args.target = str(cache_dir() / TARGET_NAME)
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
        taps = VARIANTS[variant].get("--target-layer-ids")
        for name in ("prompts.jsonl", "taps") if taps is None else ("prompts.jsonl",):
            if not (work / name).exists():
                (work / name).symlink_to(src / name)
        if taps is not None:
            retap(args.target, src / "taps", work / "taps", tuple(int(t) for t in taps))
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
