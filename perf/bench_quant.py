#!/usr/bin/env python3
"""Accuracy, acceptance and size of the quantized checkpoints (FP8, FP8 + FP8 KV cache, NVFP4; optionally with the
drafter quantized) against the BF16 conversion, on CPU through the emulating loaders. Prints one JSON object.

    python perf/bench_quant.py --work artifacts/bench_quant --eval-prompts 16 --eval-tokens 64 \
        --tau-prompts 4 --tau-tokens 64 --threads 1

Per variant:
  agreement     greedy token agreement with the BF16 target (trtllm_dflash/convert/agreement.py defines it:
                teacher-forced argmax agreement over the BF16 greedy continuations, and the free-running identical
                prefix) on the last --eval-prompts HumanEval prompts (calibration uses the first --calib-size)
  tau           mean acceptance length of DFlash (B = --block-size, greedy) with the emulated target (and drafter)
                on the first --tau-prompts of those prompts, next to the BF16 pair's on the same prompts
  bytes         on disk: target/, drafter/, and the unified HF export where one was written
Diagnostics: weight-only FP8 (activations unquantized) and the BF16 checkpoint computed in bf16 instead of fp32 (the
noise floor of the metric). All models compute in fp32 unless stated; the reference is the BF16 checkpoint in fp32.

Defaults to the demo target and the shipped drafter (``trtllm-dflash demo-assets``). Artifacts in --work are reused
when present (delete the directory to re-quantize).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

VARIANTS = {  # name -> quantize keyword arguments
    "fp8": {"recipe": "fp8"},
    "fp8-kv": {"recipe": "fp8", "kv_cache": "fp8"},
    "nvfp4": {"recipe": "nvfp4"},
    "nvfp4-kv": {"recipe": "nvfp4", "kv_cache": "fp8"},
    "fp8-drafter": {"recipe": "fp8", "quantize_drafter": True},
    "nvfp4-drafter": {"recipe": "nvfp4", "quantize_drafter": True},
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("artifacts/bench_quant"), help="checkpoints go here (reused)")
    p.add_argument("--target", default=None, help="HF target directory (default: the demo target)")
    p.add_argument("--drafter", default=None, help="z-lab drafter directory (default: the shipped demo drafter)")
    p.add_argument("--variants", default="fp8,fp8-kv,nvfp4,fp8-drafter",
                   help=f"comma-separated subset of {','.join(VARIANTS)}")
    p.add_argument("--calib-size", type=int, default=64, help="calibration prompts (first N of HumanEval)")
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--eval-prompts", type=int, default=16, help="agreement prompts (last N of HumanEval)")
    p.add_argument("--eval-tokens", type=int, default=64, help="BF16 greedy continuation length per prompt")
    p.add_argument("--no-free-running", dest="free_running", action="store_false",
                   help="skip the free-running prefix measurement (saves one greedy decode per variant)")
    p.add_argument("--tau-prompts", type=int, default=4, help="prompts for the tau comparison (0 = skip)")
    p.add_argument("--tau-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--export-hf", action="store_true", help="also export the fp8 variant as a unified HF checkpoint")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    return p.parse_args(argv)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from trtllm_dflash.assets import pair_or_demo
    from trtllm_dflash.convert import agreement as ag
    from trtllm_dflash.convert import convert, load_trtllm_drafter, load_trtllm_target
    from trtllm_dflash.convert.hf_export import load_hf_export
    from trtllm_dflash.convert.quantize import CalibDevice, CalibrationPath, QuantRecipe, calibration_ids, quantize
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import load_tokenizer, stop_token_ids

    torch.set_num_threads(args.threads)
    args.target, args.drafter = pair_or_demo(args.target, args.drafter)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        print(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}", file=sys.stderr)
        return 2
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    log = lambda msg: print(f"[{time.perf_counter() - t_start:7.1f} s] {msg}", file=sys.stderr, flush=True)  # noqa

    bf16 = work / "bf16"
    if not bf16.exists():
        convert(args.target, args.drafter, bf16)
    calib = None
    dirs = {"bf16": bf16}
    for v in variants:
        dirs[v] = work / v
        if dirs[v].exists():
            continue
        calib = calib or calibration_ids("humaneval", Path(args.target), args.calib_size, args.calib_seq_len)
        export = work / f"{v}-hf" if args.export_hf and v == "fp8" else None
        log(f"quantize {v}")
        quantize(bf16, dirs[v], calib_ids=calib, **VARIANTS[v], export_hf=export)

    tok = load_tokenizer(args.target)
    ref_model = load_trtllm_target(bf16 / "target")
    stops = stop_token_ids(tok, ref_model.spec.eos_token_ids)
    prompts = ag.eval_prompt_ids("humaneval", Path(args.target), args.eval_prompts)
    log("reference continuations")
    ref = ag.reference(ref_model, prompts, args.eval_tokens, stops)
    bf16_drafter = load_trtllm_drafter(bf16 / "drafter")

    def tau(target, drafter) -> dict:
        if args.tau_prompts <= 0:
            return {}
        dec = SpeculativeDecoder(target, drafter, args.block_size)
        reqs = [Request(tuple(p), args.tau_tokens, stop_token_ids=stops) for p in prompts[:args.tau_prompts]]
        taus = [t for r in dec.generate(reqs) for t in r.acceptance_lengths]
        return {"tau": round(sum(taus) / len(taus), 4), "tau_steps": len(taus)}

    results = {}
    log("bf16 diagnostics")
    results["bf16"] = {"bytes": {"target": tree_bytes(bf16 / "target"), "drafter": tree_bytes(bf16 / "drafter")},
                       **tau(ref_model, bf16_drafter)}
    bf16_compute = load_trtllm_target(bf16 / "target", dtype=torch.bfloat16)
    results["bf16_compute_in_bf16"] = {"agreement": ag.agreement(bf16_compute, ref, args.free_running)}
    del bf16_compute
    for v in variants:
        log(f"evaluate {v}")
        kw = VARIANTS[v]
        target = load_trtllm_target(dirs[v] / "target")
        drafter = load_trtllm_drafter(dirs[v] / "drafter") if kw.get("quantize_drafter") else bf16_drafter
        manifest = json.loads((dirs[v] / "manifest.json").read_text())
        r = {"quantize": kw, "calibration_path": manifest["calibration"].get("path"),
             "bytes": {"target": tree_bytes(dirs[v] / "target"), "drafter": tree_bytes(dirs[v] / "drafter")}}
        if not kw.get("quantize_drafter"):  # the drafter variants share their target with the plain ones
            r["agreement"] = ag.agreement(target, ref, args.free_running)
        r |= tau(target, drafter)
        if v == "fp8":
            r["agreement_weight_only"] = ag.agreement(load_trtllm_target(dirs[v] / "target", emulate_quant=False), ref,
                                                      free_running=False)
        hf = work / f"{v}-hf"
        if hf.exists():
            model = load_hf_export(hf)
            x = torch.tensor([list(prompts[0])])
            a = target.logits(target(x, target.new_cache(1, x.shape[1]))[0])
            b = model.logits(model(x, model.new_cache(1, x.shape[1]))[0])
            prov = json.loads((hf / "trtllm_dflash_export.json").read_text())
            r["hf_export"] = {"bytes": tree_bytes(hf), "function": prov["function"],
                              "nvidia-modelopt": prov["nvidia-modelopt"],
                              "max_abs_logit_diff_vs_trtllm_ckpt": round(float((a - b).abs().max()), 4),
                              "top1_agreement_vs_trtllm_ckpt": round(float((a.argmax(-1) == b.argmax(-1)).float()
                                                                            .mean()), 4),
                              "agreement": ag.agreement(model, ref, free_running=False)}
        results[v] = r

    out = {
        "command": "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]),
        "definitions": "agreement.teacher_forced: fraction of the BF16 greedy continuations' positions where the "
                       "model's argmax equals the BF16 model's (same input tokens); free_running_prefix: mean "
                       "fraction of each continuation the model reproduces before its first different token",
        "target": os.path.basename(os.path.normpath(args.target)),
        "drafter": os.path.basename(os.path.normpath(args.drafter)),
        "eval": {"dataset": "humaneval", "prompts": f"last {args.eval_prompts}", "tokens": args.eval_tokens,
                 "positions": sum(len(c) for c in ref.continuations)},
        "calibration": {"dataset": "humaneval", "prompts": f"first {args.calib_size}", "seq_len": args.calib_seq_len,
                        "paths": {r.value: CalibrationPath.choose(r, CalibDevice.CPU).description for r in QuantRecipe}},
        "tau": {"prompts": f"first {args.tau_prompts} of the eval prompts", "tokens": args.tau_tokens,
                "block_size": args.block_size},
        "results": results,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} threads",
        "wall_s": round(time.perf_counter() - t_start, 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
