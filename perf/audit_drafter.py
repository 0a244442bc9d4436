#!/usr/bin/env python3
"""Training metrics next to inference τ on the same held-out prompts (train/audit.py).

For each prompt (HumanEval and MT-Bench first turns: held out from training by the no-overlap proof), the target
regenerates the response exactly as the training-data stage does, the drafter's training-path predictions are scored
at every response anchor (per-slot accuracy, position 1 first, and expected τ), and the real decoder's τ on the same
prompt is measured; the drafts the two paths propose at the decoder's own anchors are compared slot by slot.

    python perf/audit_drafter.py --limit 8 --max-new-tokens 128 --out perf/results/drafter-audit/audit.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--datasets", default="humaneval,mtbench", help="comma list of humaneval | mtbench | JSONL path")
    p.add_argument("--limit", type=int, default=8, help="first N prompts of each dataset")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompt-lookup-only", action="store_true",
                   help="only regenerate the greedy outputs (batched) and replay prompt-lookup decoding over them")
    p.add_argument("--out", default=None, help="write the JSON report here (atomically)")
    args = p.parse_args(argv)

    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.train.audit import audit_prompt, prompt_lookup_taus, summarize
    from trtllm_dflash.train.regen import regenerate

    torch.set_num_threads(args.threads)
    if args.target is None:
        assets = prepare_demo_assets()
        args.target, args.drafter = assets["target"], args.drafter or assets["drafter"]
    target, drafter = load_pair(args.target, args.drafter)
    tok = load_tokenizer(args.target)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    report = {"command": "python perf/audit_drafter.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "target": os.path.basename(os.path.normpath(args.target)),
              "drafter": os.path.basename(os.path.normpath(args.drafter)),
              "block_size": drafter.spec.block_size, "max_new_tokens": args.max_new_tokens, "sets": {}}
    t0 = time.perf_counter()
    for name in args.datasets.split(","):
        prompts = load_prompts(name, args.limit)
        if args.prompt_lookup_only:
            encoded = [encode_prompt(tok, q.text, q.chat) for q in prompts]
            outs = [r for i in tqdm(range(0, len(encoded), 16), desc=f"regenerate {name}", file=sys.stderr)
                    for r in regenerate(target, encoded[i : i + 16], args.max_new_tokens, stops)]
            taus = [t for r in outs for t in prompt_lookup_taus(r.ids.tolist(), r.prompt_len, drafter.spec.block_size)]
            report["sets"][name] = {"num_prompts": len(prompts), "prompt_lookup_tau": round(sum(taus) / len(taus), 3),
                                    "num_steps": len(taus), "prompts": [q.id for q in prompts]}
            print(name, json.dumps(report["sets"][name]), flush=True)
            continue
        audits = [audit_prompt(target, drafter, q.id, encode_prompt(tok, q.text, q.chat), args.max_new_tokens, stops)
                  for q in tqdm(prompts, desc=f"audit {name}", file=sys.stderr)]
        report["sets"][name] = summarize(audits) | {"prompts": [a.id for a in audits]}
        print(name, json.dumps(report["sets"][name]), flush=True)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["machine"] = (f"{platform.machine()} {os.cpu_count()} cpus (shared), torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads")
    report["time"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(json.dumps(report, indent=1) + "\n")
        os.replace(tmp, args.out)
    return 0 if all(s.get("lossless", True) for s in report["sets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
