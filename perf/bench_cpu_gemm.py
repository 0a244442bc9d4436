#!/usr/bin/env python3
"""Weight-major float32 products on a CPU (``models.layers.Linear``) against PyTorch's ``F.linear``, interleaved.

Two parts, each timing both ways alternately in one process (a shared VM's speed drifts between minutes):

- ``products``: one product of ``rows`` rows with each distinct weight shape of the target (the LM head, the
  attention and MLP projections), random weights;
- ``forwards``: the real pair's verify forward (``rows`` × ``width`` tokens over ``--context`` cached tokens a row,
  the LM head over each row's first slot, as the decoder's verify that rejects d_1) and draft pass (``rows`` ×
  ``slots`` block slots, the head on the drafts), with ``layers.CPU_WEIGHT_MAJOR`` switched off and on; and the same
  draft pass through the Triton drafter model's engine (``served draft``: ``runtime.steps.BlockDrafter``, its own cache
  and head), which should cost what the in-process one costs.

    python perf/bench_cpu_gemm.py --threads 2 --out perf/results/cpu-gemm/amd-2threads.json
    python perf/bench_cpu_gemm.py --threads 1 --parts forwards

Prints JSON: medians in ms per shape, both ways, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


ROWS = (1, 2, 3, 4, 7, 8, 12, 16, 32, 64, 96, 128)
VERIFY = ((1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (4, 1), (8, 1), (16, 1), (16, 2), (16, 4))
DRAFT = ((1, 2), (1, 4), (1, 8), (1, 16), (16, 2), (16, 4), (16, 16))


def interleaved(cases: dict, repeats: int, switch) -> dict:
    """{name: fn} timed ``repeats`` times each way (``switch(bool)`` selects it), alternating; medians in ms."""
    times = {(name, on): [] for name in cases for on in (False, True)}
    for name, fn in cases.items():  # warm-up, both ways
        for on in (False, True):
            switch(on)
            fn()
    for _ in range(repeats):
        for name, fn in cases.items():
            for on in (False, True):
                switch(on)
                t0 = time.perf_counter()
                fn()
                times[name, on].append(time.perf_counter() - t0)
    switch(True)
    out = {}
    for name in cases:
        linear, major = (statistics.median(times[name, on]) * 1e3 for on in (False, True))
        out[name] = {"linear_ms": round(linear, 3), "weight_major_ms": round(major, 3),
                     "ratio": round(major / linear, 3)}
    return out


def products(spec, rows: tuple[int, ...], repeats: int) -> dict:
    import torch

    from trtllm_dflash.models import layers

    h, d = spec.hidden_size, spec.head_dim
    shapes = {"lm_head": (spec.vocab_size, h), "q_proj": (spec.num_attention_heads * d, h),
              "k_proj": (spec.num_key_value_heads * d, h), "gate_proj": (spec.intermediate_size, h),
              "down_proj": (h, spec.intermediate_size)}
    cases = {}
    for name, (n, k) in shapes.items():
        lin = layers.Linear(k, n, bias=False).requires_grad_(False)
        for m in rows:
            x = torch.randn(m, k)
            cases[f"{name} {n}x{k} rows={m}"] = (lambda lin=lin, x=x: lin(x))

    def switch(on: bool) -> None:
        layers.CPU_WEIGHT_MAJOR = on

    with torch.inference_mode():
        return interleaved(cases, repeats, switch)


def forwards(target_dir, drafter_dir, context: int, repeats: int) -> dict:
    import torch

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models import layers
    from trtllm_dflash.models.drafter import DrafterModel, draft_block
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder
    from trtllm_dflash.runtime.steps import BlockDrafter, TargetHead

    assets = prepare_demo_assets() if target_dir is None or drafter_dir is None else {}
    target = TargetModel.from_pretrained(target_dir or assets["target"], dtype=torch.float32)
    drafter = DrafterModel.from_pretrained(drafter_dir or assets["drafter"], dtype=torch.float32, device="cpu")
    dec = SpeculativeDecoder(target, drafter, drafter.spec.block_size)  # a fixed block: no policy to calibrate
    caches: dict = {}

    def cache(kind: str, rows: int):
        if (kind, rows) not in caches:
            model = target if kind == "verify" else drafter
            caches[kind, rows] = model.new_cache(rows, context + 17)
            caches[kind, rows].lengths.fill_(context)
        return caches[kind, rows]

    def verify(rows: int, width: int) -> None:
        ids = torch.zeros(rows, width, dtype=torch.long)
        target.logits(target(ids, cache("verify", rows), tap_layers=dec.taps)[0][:, :1])

    def draft(rows: int, slots: int) -> None:
        dcache = cache("draft", rows)
        draft_block(torch.zeros(rows, dtype=torch.long), slots, dec.mask_token_id, target.embed,
                    lambda e: dec._draft(e, dcache, None), lambda hidden: target.logits(hidden))

    # the Triton drafter model's engine (runtime.steps.BlockDrafter): the same draft pass, its own cache and head
    served = BlockDrafter(drafter, TargetHead(target_dir or assets["target"]), 16, context + 17)
    none = drafter.new_cache(1, 1).k[:, 0, :0]  # [L, 0, kv, hd]: no new context K/V

    def served_draft(rows: int, slots: int) -> None:
        served.draft(list(range(rows)), [none] * rows, [none] * rows, [0] * rows, slots)

    for r in {r for r, _ in DRAFT}:  # the first draft of a sequence id takes its row
        served_draft(r, 2)
    served.cache.lengths.fill_(context)

    cases = {f"verify {r}x{w}": (lambda r=r, w=w: verify(r, w)) for r, w in VERIFY}
    cases.update({f"draft {r}x{s}": (lambda r=r, s=s: draft(r, s)) for r, s in DRAFT})
    cases.update({f"served draft {r}x{s}": (lambda r=r, s=s: served_draft(r, s)) for r, s in DRAFT
                  if s <= drafter.spec.block_size})  # the engine drafts at most the trained block

    def switch(on: bool) -> None:
        layers.CPU_WEIGHT_MAJOR = on

    with torch.inference_mode():
        return interleaved(cases, repeats, switch)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--parts", default="products,forwards", help="comma list: products, forwards")
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="rows of the products part")
    p.add_argument("--context", type=int, default=300, help="cached tokens a row attends over in the forwards part")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--target", default=None, help="default: the demo target")
    p.add_argument("--drafter", default=None, help="default: the demo drafter (forwards part)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in ("products", "forwards")]
    if bad:
        p.error(f"--parts {','.join(bad)!r}: unknown; choose from products, forwards")
    try:
        rows = tuple(int(x) for x in args.rows.split(","))
    except ValueError:
        p.error(f"--rows {args.rows!r}: not a comma list of integers; e.g. 1,2,4,16")
    import torch

    from trtllm_dflash.hardware import cpu_model

    torch.set_num_threads(args.threads)
    out: dict = {"cpu": cpu_model(), "threads": args.threads, "torch": torch.__version__, "repeats": args.repeats}
    if "products" in parts:
        from trtllm_dflash.assets import prepare_demo_assets
        from trtllm_dflash.specs import TargetSpec

        spec = TargetSpec.load(args.target or prepare_demo_assets()["target"])
        out["products"] = products(spec, rows, args.repeats)
    if "forwards" in parts:
        out["context"] = args.context
        out["forwards"] = forwards(args.target, args.drafter, args.context, args.repeats)
    text = json.dumps(out, indent=1)
    if args.out:
        from trtllm_dflash.models.weights import write_json

        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        write_json(out, Path(args.out))
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
