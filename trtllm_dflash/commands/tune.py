"""``trtllm-dflash tune``: measure, ahead of serving, the CPU kernels a pair's steps will use on this machine.

The runtime chooses each product's and each attention's kernel by measuring the candidates the first time a shape
and row bucket comes up (``models.products``), and keeps the choice on disk per machine. Left to the first requests,
those measurements land on their latency; ``tune`` runs the pair's forwards through every bucket a served or
in-process step uses (verify widths, prefills, draft passes of several rows) so that the table is complete before
the first request. It is what ``trtllm-build`` is to a GPU engine: done once per machine, thread count and pair shape.
A choice timed while another process computes can be the wrong one and is kept, so ``tune`` says when the machine is
busy, and ``--refresh`` measures every choice again (in memory and on disk).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from trtllm_dflash.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=None, help="target directory (default: the demo target)")
    parser.add_argument("--drafter", default=None, help="drafter directory (default: the demo drafter)")
    parser.add_argument("--threads", default=None,
                        help="comma list of torch thread counts to tune for (default: torch's choice)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="widest target forward to tune, a prefill's or a batch verify's (default 512)")
    parser.add_argument("--max-rows", type=int, default=16, help="most rows of one draft pass (default 16)")
    parser.add_argument("--max-step-tokens", type=int, default=64,
                        help="widest target forward whose kernel kind is also measured on whole forwards "
                             "(default 64: decode and verify steps; 0: none)")
    parser.add_argument("--compile", action="store_true",
                        help="also compile the target's decode step (models.compiled: slow on a CPU, once per "
                             "machine) and time it against the eager step at 1 to --max-rows rows; the faster runs "
                             "from then on")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="default float32")
    parser.add_argument("--refresh", action="store_true",
                        help="forget the table's choices (the file too) and measure every one again")


def _counts(top: int) -> list[int]:
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return out + [top]


def _choose_step(target, taps: tuple[int, ...], width: int, context: int = 256) -> str:
    """The product kind for the target's forwards of ``width`` tokens (a decode or verify step over ``context``
    cached tokens, with the drafter's taps and the LM head over every token), measured on the forward itself
    (``products.choose_step``)."""
    import torch

    from trtllm_dflash.models import products

    cache = target.new_cache(1, context + width + 1)
    ids = torch.zeros(1, width, dtype=torch.long)

    def forward():
        cache.lengths.fill_(context)
        hidden, _ = target(ids, cache, tap_layers=taps)
        return target.logits(hidden)

    return products.choose_step(target.step_name, target.dtype, width, forward)


def _choose_compiled(target, rows: list[int], context: int = 256) -> dict | None:
    """Compiles the target's decode step with each product form that runs here (``compiled.forms()``) in each
    variant a process meets (``TargetModel.warm_decode``), which leaves them in TorchInductor's on-disk cache, then
    times decode steps of each of ``rows`` rows compiled in each form, native (``compiled.engines()``) and eager, and
    records the fastest per row bucket in the table (``TargetModel.compiled_entry``). None where the compiled step
    does not apply (another dtype or device)."""
    import torch
    from tqdm import tqdm

    from trtllm_dflash.models import compiled, products

    if target.device.type != "cpu" or target.dtype != torch.float32:
        return None
    print("tune: compiling the target's decode step (slow the first time on a CPU)", file=sys.stderr)
    seconds = {}
    for form in compiled.forms():
        with compiled.forcing("on", form):
            seconds[form] = target.warm_decode(context)
    choices, step_ms = {}, {}
    for b in tqdm(rows, desc="timing decode steps", file=sys.stderr, disable=None):
        cache = target.new_cache(b, context + 2)
        ids = torch.zeros(b, 1, dtype=torch.long)

        def step(setting: str, form: str | None = None):
            def run():
                with compiled.forcing(setting, form):
                    cache.lengths.fill_(context)
                    hidden, _ = target(ids, cache)
                    return target.logits(hidden)
            return run

        def measure() -> dict[str, float]:
            runs = {form: step("on", form) for form in compiled.engines()}
            step_ms[b] = products.fastest({**runs, "eager": step("off")}, repeats=5, calls=3)
            return step_ms[b]

        choices[b] = products.table().choose(target.compiled_entry(b), measure)
    return {"choices": choices, "first_step_seconds": seconds,
            "step_ms": {b: {k: round(v * 1e3, 2) for k, v in t.items()} for b, t in step_ms.items()}}


def main(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.models import products
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder

    parts = args.threads.split(",") if args.threads else [str(torch.get_num_threads())]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ConfigError("--threads", args.threads, "is not a comma list of integers >= 1", "e.g. --threads 1,2")
    threads = [int(p) for p in parts]
    if args.max_step_tokens < 0:
        raise ConfigError("--max-step-tokens", args.max_step_tokens, "must be >= 0", "pass 0 or more")
    for name in ("max_tokens", "max_rows"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}", getattr(args, name), "must be >= 1", "pass 1 or more")
    if products.forced_kind() is not None:
        raise ConfigError(products.ENV, products.forced_kind(), "forces one kernel, so there is nothing to tune",
                          f"unset {products.ENV}")
    target_dir, drafter_dir = pair_or_demo(args.target, args.drafter)
    dtype = getattr(torch, args.dtype)
    target, drafter = load_pair(target_dir, drafter_dir, dtype=dtype)
    dec = SpeculativeDecoder(target, drafter, drafter.spec.block_size) if drafter is not None else None
    widths, draft_rows = _counts(args.max_tokens), _counts(args.max_rows)
    load = os.getloadavg()[0]
    if load >= 1.0:  # a choice measured beside another computing process may be the wrong one, and it is kept
        print(f"tune: the load average is {load:.2f}: another process is computing, so kernels timed now may be "
              "chosen wrongly; run `trtllm-dflash tune --refresh` again on an idle machine", file=sys.stderr)
    started = time.perf_counter()
    summary = []
    for n in threads:
        torch.set_num_threads(n)
        table = products.table()
        if args.refresh:  # the file too: a save merges what the file holds back in
            table.forget()
        before = len(table.choices)
        jobs = [("target", w) for w in widths] + ([("draft", r) for r in draft_rows] if dec is not None else [])
        with torch.inference_mode():
            for part, size in tqdm(jobs, desc=f"tuning ({n} threads)", file=sys.stderr, disable=None):
                if part == "target":
                    cache = target.new_cache(1, size + 1)
                    hidden, _ = target(torch.zeros(1, size, dtype=torch.long), cache,
                                       tap_layers=drafter.spec.target_layer_ids if drafter is not None else ())
                    target.logits(hidden)
                else:
                    bsz = dec.block_size
                    cache = drafter.new_cache(size, bsz + 2)
                    cache.lengths.fill_(1)
                    dec.propose(torch.zeros(size, dtype=torch.long), cache, None, cache.lengths, bsz - 1)
            steps = [w for w in widths if w <= args.max_step_tokens]
            for w in tqdm(steps, desc=f"whole steps ({n} threads)", file=sys.stderr, disable=None):
                _choose_step(target, drafter.spec.target_layer_ids if drafter is not None else (), w)
            compiled_step = _choose_compiled(target, draft_rows) if args.compile else None
        if len(table.choices) > before and not args.refresh:  # (forget made a new epoch already)
            table.renew()  # the kernels changed under what was timed through them (the auto policy's cost model)
        summary.append({"threads": n, "table": str(table.path), "choices": len(table.choices),
                        "measured": len(table.choices) - before, "compiled_step": compiled_step})
    print(json.dumps({"target": target_dir, "drafter": drafter_dir, "dtype": args.dtype, "load_average": load,
                      "tables": summary,
                      "seconds": round(time.perf_counter() - started, 1)}))
    return 0
