#!/usr/bin/env python3
"""A batched prefill of prompts of different lengths, right-padded to the longest: every slot computed (``padded``)
against the real tokens only (``packed``: ``TargetModel.forward(widths=...)``, ``models.layers.Packing``), with the
taps the decoder asks for. Prints seconds (best of --repeats), the real and padded token counts, and checks that the
two agree (last-token argmax, largest hidden-state difference at real slots).

    python perf/bench_prefill.py --dataset mtbench --limit 16 --threads 2 --out perf/results/adaptive/s28/prefill.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch



def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="mtbench,humaneval", help="comma list: humaneval | mtbench | JSONL path")
    p.add_argument("--limit", type=int, default=16, help="prompts per batch")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.models.weights import write_json
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

    torch.set_num_threads(args.threads)
    target_dir = args.target or prepare_demo_assets()["target"]
    target, tok = TargetModel.from_pretrained(target_dir), load_tokenizer(target_dir)
    taps = (1, target.spec.num_hidden_layers // 2, target.spec.num_hidden_layers - 3)
    res = {"machine": f"{os.cpu_count()} cpus, torch {torch.__version__}, {args.threads} threads",
           "command": "python perf/bench_prefill.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "datasets": {}}
    for name in args.dataset.split(","):
        prompts = [encode_prompt(tok, q.text, q.chat) for q in load_prompts(name, args.limit)]
        widths = torch.tensor([len(q) for q in prompts])
        ids = torch.zeros(len(prompts), int(widths.max()), dtype=torch.long)
        for i, q in enumerate(prompts):
            ids[i, : len(q)] = torch.tensor(q)
        got = {}
        for mode, w in (("padded", None), ("packed", widths)):
            best = float("inf")
            for _ in range(args.repeats):
                cache = target.new_cache(len(prompts), ids.shape[1])
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    hidden, _ = target(ids, cache, tap_layers=taps, widths=w)
                    best = min(best, time.perf_counter() - t0)
            got[mode] = (best, hidden)
        last = torch.arange(len(prompts)), widths - 1
        real = torch.arange(ids.shape[1])[None, :] < widths[:, None]
        (t_pad, h_pad), (t_pack, h_pack) = got["padded"], got["packed"]
        res["datasets"][name] = {
            "prompts": len(prompts), "real_tokens": int(widths.sum()), "padded_tokens": ids.numel(),
            "padded_s": round(t_pad, 3), "packed_s": round(t_pack, 3), "speedup": round(t_pad / t_pack, 3),
            "same_next_token": bool(torch.equal(target.logits(h_pad[last]).argmax(-1),
                                                target.logits(h_pack[last]).argmax(-1))),
            "max_hidden_diff": float((h_pad - h_pack)[real].abs().max()),
        }
        print(json.dumps({name: res["datasets"][name]}), file=sys.stderr)
    text = json.dumps(res, indent=1) + "\n"
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(res, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
