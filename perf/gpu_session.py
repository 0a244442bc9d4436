#!/usr/bin/env python3
"""One rehearsed command for a lent GPU: the CUDA paths against the CPU oracle, then the GPU benchmarks.

    # here, once (no GPU needed): HumanEval / MT-Bench prompt files the GPU machine cannot fetch itself
    python perf/gpu_session.py --export-prompts .gpu/prompts
    # on the GPU machine (device tool, with .gpu in `carry`), from the repository root:
    python3 perf/gpu_session.py --out "$OUT" --prompts .gpu/prompts [--target DIR --drafter DIR] --budget-s 540
    # CPU rehearsal (CI, tests/perf/test_gpu_session.py): the same steps on the CPU, kernels through the interpreter
    python perf/gpu_session.py --out DIR --device cpu --prompts DIR --target DIR --drafter DIR --limit 2

Steps, in this order; each runs isolated (an exception or a failing subprocess is recorded and the next step runs),
and no step starts once ``--budget-s`` is spent (the device tool allows 10 minutes per command):

- ``env``: device name (``torch.cuda.get_device_name()``), capability, driver, torch / triton / transformers versions,
  the commit (``--commit`` or ``git rev-parse``).
- ``kernel_tests``: ``tests/plugin/test_plugin_kernels.py`` on the device, natively compiled (``TRITON_INTERPRET=0``,
  ``TRTLLM_DFLASH_TEST_DEVICE=cuda``); on the CPU, through Triton's interpreter.
- ``parity``: the runtime on the device against the CPU oracle on a tiny random pair. float64 on both devices (the
  drafter in torch): the same greedy tokens; float32 on the device with the drafting kernels (``Impl.AUTO``): DFlash
  output equal to the same device's target-only greedy (lossless) and τ beside the torch drafter's τ.
- ``graphs``: ``perf/bench_runtime.py`` at batch 1 on HumanEval in float32 (token identity required), first with
  every decoder's verify and draft forwards replayed as CUDA graphs (``--cuda-graphs on``; on the CPU ``rehearse``),
  then eager: what launching a step's kernels one by one costs, and DFlash against a baseline graphed alike.
- ``bench_kernels``, ``bench_gpu`` (bf16 and fp8): ``perf/bench_kernels.py`` and ``perf/bench_gpu.py`` on Qwen3-8B
  shapes (CUDA only; recorded as skipped on the CPU).
- ``dflash_vs_ar``: ``perf/bench_runtime.py --device`` on the prompt files, batch 1 and 8, block sizes
  ``--block-sizes``, on the target and drafter given (bf16 on CUDA, float32 on the CPU).

Writes ``gpu_session.json`` (every step's result, device and commit) into ``--out``, rewritten atomically after each
step so a cut-off run still returns what it finished; steps' logs go to ``gpu_session.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="output folder (the device tool's $OUT)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: the CI rehearsal")
    p.add_argument("--target", help="target HF directory for dflash_vs_ar")
    p.add_argument("--drafter", help="drafter directory for dflash_vs_ar")
    p.add_argument("--prompts", help="folder with humaneval.jsonl and mtbench.jsonl (from --export-prompts)")
    p.add_argument("--limit", type=int, default=24, help="prompts per dataset for dflash_vs_ar")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-sizes", default="16,8,16+ngram,auto+ngram,16+tree,auto+tree",
                   help="comma list for bench_runtime --block-size")
    p.add_argument("--steps",
                   default="env,kernel_tests,parity,graphs,bench_kernels,bench_gpu,dflash_vs_ar")
    p.add_argument("--budget-s", type=float, default=540.0, help="start no step after this many seconds")
    p.add_argument("--commit", default=None)
    p.add_argument("--export-prompts", metavar="DIR", help="write the prompt files here and exit")
    args = p.parse_args(argv)
    known = {"env", "kernel_tests", "parity", "bench_kernels", "bench_gpu", "dflash_vs_ar", "graphs"}
    args.steps = [s for s in args.steps.split(",") if s]
    bad = [s for s in args.steps if s not in known]
    if bad:
        p.error(f"--steps {','.join(bad)!r}: unknown step(s); choose from {','.join(sorted(known))}")
    if not args.export_prompts and not args.out:
        p.error("--out is required (the folder results are written to), unless --export-prompts")
    return args


def export_prompts(folder: Path) -> dict:
    from trtllm_dflash.datasets import load_prompts

    folder.mkdir(parents=True, exist_ok=True)
    counts = {}
    for name in ("humaneval", "mtbench"):
        prompts = load_prompts(name)
        text = "".join(json.dumps({"prompt": p.text, "id": p.id}) + "\n" for p in prompts)
        tmp = folder / f".{name}.jsonl.tmp"
        tmp.write_text(text)
        os.replace(tmp, folder / f"{name}.jsonl")
        counts[name] = len(prompts)
    return counts


def run(cmd: list[str], log, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    # the perf scripts import trtllm_dflash from this tree (the GPU machine runs it uninstalled)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    out = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": path, **(env or {})}, capture_output=True,
                         text=True, timeout=timeout)
    log.write(repo_relative(out.stdout + out.stderr) + f"[exit {out.returncode}]\n")
    log.flush()
    return out


def repo_relative(text: str) -> str:
    """Output with this checkout's path dropped (tracebacks), so a returned log names files as the repository does."""
    return text.replace(f"{ROOT}{os.sep}", "")


def json_lines(text: str) -> list:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def step_env(args, log) -> dict:
    import torch

    info = {"torch": torch.__version__, "python": sys.version.split()[0], "device": args.device}
    for mod in ("triton", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except ImportError:
            info[mod] = None
    if args.device == "cuda":
        info.update(device_name=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                    cuda=torch.version.cuda)
        smi = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], log, 30)
        info["nvidia_smi"] = smi.stdout.strip()
    commit = args.commit
    if commit is None:
        git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        commit = git.stdout.strip() or None
    info["commit"] = commit
    return info


def step_kernel_tests(args, log) -> dict:
    env = {"TRITON_INTERPRET": "0" if args.device == "cuda" else "1", "TRTLLM_DFLASH_TEST_DEVICE": args.device}
    out = run([sys.executable, "-m", "pytest", "tests/plugin/test_plugin_kernels.py", "-q", "-p", "no:cacheprovider"],
              log, 420, env)
    summary = [line for line in out.stdout.splitlines() if " passed" in line or " failed" in line or "error" in line]
    return {"exit": out.returncode, "summary": summary[-1] if summary else out.stdout[-300:], **env}


def tiny_pair(root: Path) -> tuple[Path, Path]:
    from trtllm_dflash.checkpoints import drafter_spec_for, random_drafter_state, write_drafter, write_tiny_target
    from trtllm_dflash.specs import TargetSpec

    tdir, ddir = root / "tiny-target", root / "tiny-drafter"
    if not tdir.exists():
        write_tiny_target(tdir, family="qwen3", seed=0, vocab_size=256)
        spec = TargetSpec.load(tdir)
        dspec = drafter_spec_for(spec, num_layers=2, block_size=16, mask_token_id=5)
        write_drafter(ddir, dspec, spec, random_drafter_state(dspec, 0))
    return tdir, ddir


def step_parity(args, log) -> dict:
    import torch

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.plugin.dispatch import Impl
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder

    tdir, ddir = tiny_pair(Path(args.scratch))
    g = torch.Generator().manual_seed(0)
    prompts = [tuple(torch.randint(6, 256, (n,), generator=g).tolist()) for n in (5, 11, 17)]
    reqs = [Request(p, 24) for p in prompts]

    def decode(dtype, device, block, kernels=None, pair=(tdir, ddir), tree=False):
        target, drafter = load_pair(*pair, dtype=dtype, device=device)
        dec = SpeculativeDecoder(target, drafter if block > 1 else None, block, kernels=kernels, tree=tree,
                                 cuda_graphs="off")  # the eager kernels' parity (step_graphs runs the graphs)
        outs = dec.generate(reqs)
        taus = [t for o in outs for t in o.acceptance_lengths]
        return [o.token_ids for o in outs], (sum(taus) / len(taus) if taus else None), getattr(dec, "kernels", None)

    cpu64, _, _ = decode(torch.float64, "cpu", 16, Impl.TORCH)
    dev64, _, _ = decode(torch.float64, args.device, 16, Impl.TORCH)
    ar32, _, _ = decode(torch.float32, args.device, 1)
    auto32, tau_auto, impl = decode(torch.float32, args.device, 16, Impl.AUTO)
    torch32, tau_torch, _ = decode(torch.float32, args.device, 16, Impl.TORCH)
    tree64, _, _ = decode(torch.float64, args.device, 16, Impl.TORCH, tree=True)  # runtime.tree's verify on the device
    real = {}
    if args.target and args.drafter and args.prompts:  # the real pair: float32 AR on the CPU vs DFlash on the device
        from trtllm_dflash.datasets import file_prompts
        from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer

        tok = load_tokenizer(args.target)
        texts = file_prompts(Path(args.prompts) / "humaneval.jsonl", chat=True)[:2]
        reqs = [Request(tuple(encode_prompt(tok, p.text, p.chat)), 32) for p in texts]
        pair = (args.target, args.drafter)
        cpu_ar, _, _ = decode(torch.float32, "cpu", 1, pair=pair)
        dev_df, tau, _ = decode(torch.float32, args.device, 16, Impl.AUTO, pair=pair)
        dev_tree, tau_tree, _ = decode(torch.float32, args.device, 16, Impl.AUTO, pair=pair, tree=True)
        real = {"real_float32_device_dflash_equals_cpu_ar": dev_df == cpu_ar, "real_tau": tau,
                "real_float32_device_tree_equals_cpu_ar": dev_tree == cpu_ar, "real_tree_tau": tau_tree}
    return {**real,
        "float64_device_equals_cpu": dev64 == cpu64,
        "float64_device_tree_equals_cpu": tree64 == cpu64,
        "float32_kernels_lossless": auto32 == ar32,
        "float32_torch_lossless": torch32 == ar32,
        "kernels": str(impl), "tau_kernels": tau_auto, "tau_torch": tau_torch,
        "num_tokens": sum(len(t) for t in cpu64),
    }


def step_bench(script: str, extra: list[str]):
    def step(args, log) -> dict:
        if args.device != "cuda":
            return {"skipped": f"{script} needs CUDA"}
        out = run([sys.executable, script, "--json", *extra], log, 300)
        return {"exit": out.returncode, "results": json_lines(out.stdout)}
    return step


def step_bench_gpu(args, log) -> dict:
    return {w: step_bench("perf/bench_gpu.py", ["--weights", w])(args, log) for w in ("bf16", "fp8")}


def step_dflash_vs_ar(args, log) -> dict:
    if not (args.target and args.drafter and args.prompts):
        return {"skipped": "needs --target, --drafter and --prompts"}
    tdir, ddir = Path(args.target), Path(args.drafter)
    datasets = {n: Path(args.prompts) / f"{n}.jsonl" for n in ("humaneval", "mtbench")}
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    results = []
    for batch in (1, 8):  # batch 1 on both datasets first: it is the goal's number
        for name, path in datasets.items():
            cmd = [sys.executable, "perf/bench_runtime.py", "--dataset", str(path), "--limit", str(args.limit),
                   "--max-new-tokens", str(args.max_new_tokens), "--block-size", args.block_sizes,
                   "--batch-size", str(batch), "--target", str(tdir), "--drafter", str(ddir),
                   "--device", args.device, "--dtype", dtype, "--json",
                   # bfloat16: token identity is reported, not required (a 16-token verify rounds differently from
                   # 1-token steps; on the CPU 4 of 8 HumanEval outputs differed at B = 16). The parity step checks
                   # identity in float32.
                   *(["--allow-mismatch"] if dtype != "float32" else [])]
            out = run(cmd, log, 300)
            results.append({"dataset": name, "batch_size": batch, "exit": out.returncode,
                            "results": json_lines(out.stdout)})
            args.checkpoint({"runs": results, "partial": True})  # kept if the lease ends before the next run
    return {"runs": results}


GRAPH_BLOCK_SIZES = "16,16+ngram,16+tree,auto+ngram"


def step_graphs(args, log) -> dict:
    """bench_runtime at batch 1 on HumanEval, float32, graphed (``runtime.graphs``) and then eager (a lease that ends
    in between keeps the graphed run, the one never seen; the first GPU lease, perf/results/gpu/2026-11-26-h200, has
    eager numbers): both runs must be lossless, and each speed-up is against the baseline run the same way."""
    if not (args.target and args.drafter and args.prompts):
        return {"skipped": "needs --target, --drafter and --prompts"}
    runs = []
    for mode in ("on" if args.device == "cuda" else "rehearse", "off"):
        cmd = [sys.executable, "perf/bench_runtime.py", "--dataset", str(Path(args.prompts) / "humaneval.jsonl"),
               "--limit", str(args.limit), "--max-new-tokens", str(args.max_new_tokens),
               "--block-size", GRAPH_BLOCK_SIZES, "--batch-size", "1", "--target", str(args.target),
               "--drafter", str(args.drafter), "--device", args.device, "--dtype", "float32",
               "--cuda-graphs", mode, "--json"]
        out = run(cmd, log, 300)
        runs.append({"cuda_graphs": mode, "exit": out.returncode, "results": json_lines(out.stdout)})
        args.checkpoint({"runs": runs, "partial": True})
    return {"runs": runs}


def succeeded(result) -> bool:
    """No error and no non-zero exit anywhere in a step's (nested) result."""
    if isinstance(result, dict):
        if "error" in result or result.get("exit", 0) != 0:
            return False
        return all(succeeded(v) for v in result.values())
    if isinstance(result, list):
        return all(succeeded(v) for v in result)
    return True


STEPS = {"env": step_env, "kernel_tests": step_kernel_tests, "parity": step_parity,
         "bench_kernels": step_bench("perf/bench_kernels.py", []), "bench_gpu": step_bench_gpu,
         "dflash_vs_ar": step_dflash_vs_ar, "graphs": step_graphs}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.export_prompts:
        print(json.dumps(export_prompts(Path(args.export_prompts))))
        return 0
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    args.scratch = tempfile.mkdtemp(prefix="gpu-session-")
    t0 = time.monotonic()
    report: dict = {"steps": {}, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    def write_report() -> None:
        tmp = out_dir / ".gpu_session.json.tmp"
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, out_dir / "gpu_session.json")

    with open(out_dir / "gpu_session.log", "a") as log:
        for name in args.steps:
            def checkpoint(partial: dict, name: str = name) -> None:  # a step's results so far, kept if it is cut off
                report["steps"][name] = partial
                write_report()

            args.checkpoint = checkpoint
            elapsed = time.monotonic() - t0
            if elapsed > args.budget_s:
                report["steps"][name] = {"skipped": f"budget spent ({elapsed:.0f} s > {args.budget_s:.0f} s)"}
                continue
            s0 = time.monotonic()
            try:
                result = STEPS[name](args, log)
            except Exception as exc:  # recorded, and the next step runs: one broken step must not cost the lease
                result = {"error": f"{type(exc).__name__}: {exc}"}
            result["seconds"] = round(time.monotonic() - s0, 1)
            report["steps"][name] = result
            print(f"gpu_session: {name}: {json.dumps(result)[:400]}", file=sys.stderr, flush=True)
            write_report()
    failed = [n for n, r in report["steps"].items() if not succeeded(r)]
    print(json.dumps({"failed_steps": failed, "out": str(out_dir / "gpu_session.json")}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
