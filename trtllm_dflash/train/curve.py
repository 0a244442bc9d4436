"""The drafter's learning curve on this machine: τ against training data, from one pool, one recipe, nested subsets.

Phases (each resumable; all state lives under ``--work``, an ignored folder):

    regen   pool prompts (seeded code/chat mix) → regenerated responses (ids + top-k target logits,
            ``train.regen.build_regen``), one shard per chunk, until ``--tokens`` response tokens or ``--minutes``
            have passed; the CPU-seconds spent are recorded per shard (the cost side of "τ per CPU-hour")
    text    the cheaper source: real code from installed sources, teacher-forced (``train.textsrc``): the prompt is
            the pool's code template around a function's signature + docstring, the response its real body; the
            labels are the target's own greedy predictions after each real prefix (top-k kept for distillation)
    train   one drafter per data size: the first N response tokens of a source's shards (a seeded shard order, so
            every prefix is a fair sample of the mix), the same recipe and step budget for every size
    eval    τ at B = ``--block-size`` on the first prompts of HumanEval and MT-Bench for every trained drafter, batched,
            checked lossless against cached greedy outputs, with prompt-lookup decoding's τ replayed on the same outputs
    report  JSON (every point with its data size, CPU cost and τ) + PNG, and a log-linear fit τ(tokens) with the
            data size it predicts for τ = 4 (an extrapolation, labelled so)

    trtllm-dflash learning-curve regen --minutes 40
    trtllm-dflash learning-curve train --size 160000 --epochs 1
    trtllm-dflash learning-curve eval --limit 32
    trtllm-dflash learning-curve report --out perf/results/drafter-curve

``eval`` drafts over each drafter directory's ``draft_vocab.json`` where it has one (``--draft-vocab``, as
``generate``'s)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import sys
import time
from pathlib import Path

from trtllm_dflash.hardware import warn_slow_bf16


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_since(c0: float) -> float:
    """CPU seconds since ``c0``, to 0.1 ms: a tiny shard on a fast machine takes well under 10 ms, and a
    coarser rounding recorded it (and the sum) as 0.0."""
    return round(cpu_seconds() - c0, 4)


def write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n")
    os.replace(tmp, path)


def read_json(path: Path, default=None):
    return json.loads(path.read_text()) if path.is_file() else default


def pool_prompts(pool: Path, num: int, code_fraction: float, seed: int, exclude: list[str] = ()) -> list[dict]:
    """A seeded sample of the pool: ``code_fraction`` of code-completion prompts, the rest chat; without the prompts
    whose ids appear in the ``exclude`` JSONL(.gz) files (e.g. a drafter's ``training_prompts.jsonl.gz``: new data for
    it)."""
    from trtllm_dflash.train.pool import jsonl_ids

    rows = [json.loads(line) for line in pool.read_text().splitlines() if line.strip()]
    seen = jsonl_ids(exclude)
    rows = [r for r in rows if r["id"] not in seen]
    code = [r for r in rows if r["id"].startswith("code/")]
    chat = [r for r in rows if not r["id"].startswith("code/")]
    rng = random.Random(seed)
    n_code = min(len(code), round(num * code_fraction))
    picked = rng.sample(code, n_code) + rng.sample(chat, min(len(chat), num - n_code))
    rng.shuffle(picked)
    return picked


def load_target(args, dtype=None):
    import torch

    from trtllm_dflash.assets import prepare_demo_assets
    from trtllm_dflash.models.target import TargetModel
    from trtllm_dflash.runtime.text import load_tokenizer, stop_token_ids

    torch.set_num_threads(args.threads)
    target_dir = args.target or prepare_demo_assets()["target"]
    target = TargetModel.from_pretrained(target_dir, dtype=dtype or torch.float32)
    tok = load_tokenizer(target_dir)
    return target_dir, target, tok, stop_token_ids(tok, target.spec.eos_token_ids)


# ---------------------------------------------------------------- regen

def regen_prompts(args, tok) -> tuple[list[dict], list[list[int]]]:
    """The pool rows ``regen`` decodes, in its order, and their chat-templated ids (rows too long dropped)."""
    from trtllm_dflash.runtime.text import encode_prompt

    rows = pool_prompts(Path(args.pool), args.num_prompts, args.code_fraction, args.seed, args.exclude)
    kept = [(r, e) for r in rows for e in [encode_prompt(tok, r["prompt"], True)] if len(e) <= args.max_prompt_len]
    return [r for r, _ in kept], [e for _, e in kept]


def cmd_prompts(args) -> None:
    """The pool prompts behind the first ``--size`` tokens of regenerated shards (after the first ``--skip``, as
    ``train``), as JSONL: the rows a drafter's ``training_prompts.jsonl.gz`` (which the overlap test reads) gains;
    each row is checked against the ids in its shard."""
    from trtllm_dflash.runtime.text import load_tokenizer
    from trtllm_dflash.train.regen import plan_chunks, read_regen_shard

    work = Path(args.work) / "regen"
    tok = load_tokenizer(args.target or load_target(args)[0])
    rows, encoded = regen_prompts(args, tok)
    chunks = plan_chunks([len(e) for e in encoded], read_json(work / "meta.json")["gen_batch_size"], args.seed)
    paths, _, _ = prefix_shards(work, args.size, args.skip)
    out = []
    for path in paths:
        chunk = chunks[int(path.stem.split("-")[1])]
        got = [r.ids[: r.prompt_len].tolist() for r in read_regen_shard(path)]
        if got != [encoded[i] for i in chunk]:
            raise SystemExit(f"{path}: its prompts are not the pool's under these settings (--pool/--num-prompts/"
                             "--code-fraction/--max-prompt-len/--seed must be regen's)")
        out += [{"id": rows[i]["id"], "prompt": rows[i]["prompt"], "chat": True} for i in chunk]
    tmp = Path(args.out).with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in out))
    os.replace(tmp, args.out)
    print(json.dumps({"shards": len(paths), "prompts": len(out), "out": args.out}))


def cmd_regen(args) -> None:
    """Regenerate shard after shard (``train.regen``'s chunking and shard layout); ``--worker i --workers n`` makes
    the shards with index ≡ i (mod n), so one process per core fills the same folder without overlap."""
    import torch
    from tqdm import tqdm

    from trtllm_dflash.train.data import write_shard
    from trtllm_dflash.train.regen import plan_chunks, regenerate, training_shard_name, write_regen_shard

    work = Path(args.work) / "regen"
    work.mkdir(parents=True, exist_ok=True)
    warn_slow_bf16(args.dtype, "--dtype", "--dtype float32")
    _, target, tok, stops = load_target(args, getattr(torch, args.dtype))
    rows, encoded = regen_prompts(args, tok)
    meta = {"pool": str(args.pool), "num_prompts": len(encoded), "code_fraction": args.code_fraction,
            "max_new_tokens": args.max_new_tokens, "gen_batch_size": args.gen_batch_size, "seed": args.seed,
            "dtype": args.dtype, "top_k": 8}
    if args.exclude:  # (absent otherwise: work folders made before --exclude existed keep resuming)
        meta["exclude"] = [Path(f).name for f in args.exclude]
    # the sample itself, so that a changed --exclude file (a drafter's training prompts grow when a drafter
    # is shipped) or pool cannot silently re-plan the shards still to come; folders made before it was recorded
    # take it on at their next call
    meta["sample_sha256"] = hashlib.sha256("\n".join(r["id"] for r in rows).encode()).hexdigest()[:16]
    old = read_json(work / "meta.json", meta)
    if {"sample_sha256": meta["sample_sha256"], **old} != meta:
        raise SystemExit(f"{work} holds responses made with other settings (--pool, --num-prompts, --exclude files "
                         "and their contents, ...: meta.json there says which); use the same ones or another --work")
    write_json(work / "meta.json", meta)
    chunks = plan_chunks([len(e) for e in encoded], args.gen_batch_size, args.seed)
    cost_path = work / f"cost-w{args.worker}.json"
    cost = read_json(cost_path, {"shards": {}, "threads": args.threads, "source": "regen", **meta})
    deadline = time.monotonic() + args.minutes * 60
    bar = tqdm(desc=f"regenerating (worker {args.worker})", unit="tok", total=args.tokens // args.workers)
    for c, chunk in enumerate(chunks):
        done = sum(s["response_tokens"] for s in cost["shards"].values())
        bar.n = done
        bar.refresh()
        if done >= args.tokens // args.workers or time.monotonic() >= deadline:
            break
        name = f"regen-{c:05d}.safetensors"
        if c % args.workers != args.worker or (work / name).is_file():
            continue
        c0, w0 = cpu_seconds(), time.monotonic()
        samples = regenerate(target, [encoded[i] for i in chunk], args.max_new_tokens, stops, 8,
                             tap_layers=tuple(args.tap_layers) if args.taps else ())
        if args.taps:  # the training shard first: a shard whose regen file exists is never tapped again here
            tdir = taps_dir(args.work, "regen", args.dtype)
            tdir.mkdir(exist_ok=True)
            write_shard(tdir / training_shard_name(name), [s.as_sample() for s in samples])
        write_regen_shard(work / name, samples)
        cost["shards"][name] = {
            "cpu_s": cpu_since(c0), "wall_s": round(time.monotonic() - w0, 2),
            "response_tokens": sum(len(s.ids) - s.prompt_len for s in samples), "sequences": len(samples),
            **({"taps": list(args.tap_layers)} if args.taps else {}),
        }
        write_json(cost_path, cost)
    bar.close()
    tot = sum(s["response_tokens"] for s in cost["shards"].values())
    cpu = sum(s["cpu_s"] for s in cost["shards"].values())
    print(json.dumps({"worker": args.worker, "shards": len(cost["shards"]), "response_tokens": tot,
                      "cpu_s": round(cpu, 4), "tokens_per_cpu_s": round(tot / max(cpu, 1e-9), 1)}))


# ---------------------------------------------------------------- text (teacher-forced real code)

def cmd_text(args) -> None:
    from trtllm_dflash.train.regen import read_regen_shard
    from trtllm_dflash.train.textsrc import build_text_source, mine_functions

    import torch

    work = Path(args.work) / "text"
    work.mkdir(parents=True, exist_ok=True)
    warn_slow_bf16(args.dtype, "--dtype", "--dtype float32")
    _, target, tok, stops = load_target(args, getattr(torch, args.dtype))
    rows_path = work / "functions.jsonl"
    c0 = cpu_seconds()
    if not rows_path.is_file():
        rows = mine_functions(args.num_functions, args.seed)
        tmp = rows_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        os.replace(tmp, rows_path)
    rows = [json.loads(line) for line in rows_path.read_text().splitlines() if line.strip()]
    mine_s = cpu_seconds() - c0
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    cost = read_json(work / "cost.json", {"shards": {}})
    cost.setdefault("mine_cpu_s", round(mine_s, 4))
    n = 0
    while sum(s["response_tokens"] for s in cost["shards"].values()) < args.tokens:
        n += 1
        name = f"regen-{n - 1:05d}.safetensors"
        if name in cost["shards"]:
            continue
        c0, w0 = cpu_seconds(), time.monotonic()
        paths = build_text_source(target, tok, rows, work, max_new_tokens=args.max_new_tokens,
                                  max_prompt_len=args.max_prompt_len, end_id=end_id, batch_size=args.batch_size,
                                  seed=args.seed, max_shards=n)
        if len(paths) < n:
            break
        samples = read_regen_shard(paths[-1])
        cost["shards"][name] = {"cpu_s": cpu_since(c0), "wall_s": round(time.monotonic() - w0, 2),
                                "response_tokens": sum(len(s.ids) - s.prompt_len for s in samples),
                                "sequences": len(samples)}
        cost.update(threads=args.threads, source="text", max_new_tokens=args.max_new_tokens, num_functions=len(rows),
                    dtype=args.dtype)
        write_json(work / "cost.json", cost)
    tot = sum(s["response_tokens"] for s in cost["shards"].values())
    cpu = sum(s["cpu_s"] for s in cost["shards"].values())
    print(json.dumps({"shards": len(cost["shards"]), "response_tokens": tot, "cpu_s": round(cpu, 4),
                      "tokens_per_cpu_s": round(tot / max(cpu, 1e-9), 1)}))


# ---------------------------------------------------------------- train

RECIPE = ["--block-size", "16", "--mask-token-id", "16", "--warmup", "0.04", "--weight-decay", "0.0", "--gamma", "7.0",
          "--loss-negatives", "8192"]


def shard_costs(src: Path) -> list[tuple[Path, int, float]]:
    """The contiguous run of finished shards of ``src`` from shard 0, in order: (path, response tokens, CPU s)."""
    shards = {}
    for f in sorted(src.glob("cost*.json")):
        shards.update(read_json(f)["shards"])
    out = []
    for c in range(len(shards)):
        name = f"regen-{c:05d}.safetensors"
        if name not in shards:
            break
        out.append((src / name, shards[name]["response_tokens"], shards[name]["cpu_s"]))
    return out


def prefix_shards(src: Path, tokens: int, skip: int = 0) -> tuple[list[Path], int, float]:
    """The first shards of ``src`` holding >= ``tokens`` response tokens: (paths, their tokens, their CPU seconds);
    with ``skip``, without the first shards holding exactly ``skip`` tokens (e.g. what a drafter was trained on)."""
    paths, tot, cpu, ends = [], 0, 0.0, [0]
    for path, n, c in shard_costs(src):
        if tot >= tokens:
            break
        paths.append(path)
        tot, cpu = tot + n, cpu + c
        ends.append(tot)
    if tot < tokens:
        raise SystemExit(f"--size {tokens}: {src} holds only {tot} response tokens; make more (regen/text phase)")
    if skip:
        if skip not in ends[:-1]:
            near = [e for e in ends if e < skip][-1:] + [e for e in ends if e > skip][:1]
            raise SystemExit(f"--skip {skip}: not where a shard ends within --size {tokens} in {src}; shards end "
                             f"at {' and '.join(map(str, near))} there: pass one of those (below --size)")
        k = ends.index(skip)
        return paths[k:], tot - skip, cpu - sum(c for _, _, c in shard_costs(src)[:k])
    return paths, tot, cpu


def cmd_taps(args) -> None:
    """The taps of the first ``--size`` response tokens ahead of ``train``, one process per core (shard i with
    i ≡ --worker mod --workers): ``train`` then finds them cached. CPU seconds go to taps-cost-w<i>.json."""
    import torch

    from trtllm_dflash.train.regen import tap_shards

    work = Path(args.work)
    paths, _, _ = prefix_shards(work / args.source, args.size)
    warn_slow_bf16(args.taps_dtype, "--taps-dtype", "--taps-dtype float32")
    tapper = load_target(args, getattr(torch, args.taps_dtype))[1]
    c0 = cpu_seconds()
    mine = paths[args.worker :: args.workers]
    out = taps_dir(args.work, args.source, args.taps_dtype)
    tap_shards(tapper, mine, out, tuple(args.tap_layers), batch_size=16)
    write_json(out / f"taps-cost-w{args.worker}.json",
               {"shards": [p.name for p in mine], "cpu_s": cpu_since(c0), "threads": args.threads})


def cmd_train(args) -> None:
    """One drafter on the first ``--size`` response tokens of a source, for ``--epochs`` passes; every checkpoint's
    export is kept as its own drafter, with the distinct response tokens its training had seen by then."""
    import shutil

    import torch

    from trtllm_dflash.train.cli import add_arguments
    from trtllm_dflash.train.config import TrainConfig
    from trtllm_dflash.train.data import read_shard
    from trtllm_dflash.train.pipeline import drafter_spec
    from trtllm_dflash.train.regen import tap_shards
    from trtllm_dflash.train.textsrc import target_labels
    from trtllm_dflash.train.trainer import step_indices, train

    work = Path(args.work)
    name = f"{args.source}-{args.labels}-{args.size}" if args.source == "text" else f"{args.source}-{args.size}"
    if args.skip:  # the shards after the first --skip tokens only (new data for a drafter trained on those)
        name += f"-after-{args.skip}"
    if args.init != "target":  # continued training (a drafter directory) or the random-init ablation
        name += "-from-" + Path(args.init).name
    if args.loss_vocab != "data" or args.distill or args.tv:  # the objective's ablations run beside the default
        name += (f"-{args.loss_vocab}-vocab" + (f"-distill{args.distill:g}" if args.distill else "")
                 + (f"-tv{args.tv:g}" if args.tv else ""))
    target_dir, target, _, _ = load_target(args)
    paths, tokens, data_cpu = prefix_shards(work / args.source, args.size, args.skip)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = TrainConfig.from_args(p.parse_args([
        "--target", str(target_dir), "--out", str(work / "train" / name / "export"),
        "--work-dir", str(work / "train" / name), *RECIPE, "--loss-vocab", args.loss_vocab,
        "--distill", str(args.distill), "--tv", str(args.tv), "--init", args.init, "--lr", str(args.lr), "--epochs", str(args.epochs),
        "--num-layers", str(args.num_layers), "--target-layer-ids", *map(str, args.tap_layers),
        "--samples-per-step", str(args.samples_per_step), "--anchors-per-sample", str(args.anchors_per_sample),
        "--seed", str(args.seed), "--threads", str(args.threads), "--log-every", "20",
        "--ckpt-every", str(args.ckpt_every), "--autocast", args.autocast, "--data", str(work / args.source)]))
    warn_slow_bf16(args.autocast, "--autocast", "--autocast none")
    spec = drafter_spec(cfg, target.spec)
    c0 = cpu_seconds()
    tapper = target if args.taps_dtype == "float32" else load_target(args, getattr(torch, args.taps_dtype))[1]
    shards = tap_shards(tapper, paths, taps_dir(args.work, args.source, args.taps_dtype), spec.target_layer_ids,
                        batch_size=16)
    del tapper
    taps_cpu = cpu_seconds() - c0
    samples = [s for p_ in shards for s in read_shard(p_)]
    if args.source == "text" and args.labels == "target":
        samples = [target_labels(s) for s in samples]
    Path(cfg.work_dir).mkdir(parents=True, exist_ok=True)
    c0, w0 = cpu_seconds(), time.monotonic()

    def keep(step: int, train_set) -> None:
        seen = {i for t in range(step) for i in step_indices(t, cfg.samples_per_step, len(train_set), cfg.seed)}
        dst = work / "drafters" / f"{name}@{step}"
        if dst.exists():
            shutil.rmtree(dst)
        shutil.copytree(cfg.out, dst)
        write_json(dst / "curve_point.json", {
            "name": name, "step": step, "source": args.source,
            "labels": args.labels if args.source == "text" else "regenerated",
            "data_response_tokens": tokens, "data_sequences": len(train_set),
            "seen_sequences": len(seen),
            "seen_response_tokens": sum(len(train_set[i].ids) - train_set[i].prompt_len for i in seen),
            "data_cpu_s": round(data_cpu, 4), "taps_cpu_s": round(taps_cpu, 4),
            "train_cpu_s": cpu_since(c0), "train_wall_s": round(time.monotonic() - w0, 1),
            "samples_per_step": cfg.samples_per_step, "anchors_per_sample": cfg.anchors_per_sample,
            "epochs": args.epochs, "threads": args.threads, "taps_dtype": args.taps_dtype, "init": args.init,
            "autocast": args.autocast, "loss_vocab": args.loss_vocab, "distill": args.distill, "tv": args.tv,
            **({"skip": args.skip} if args.skip else {}),
        })

    torch.manual_seed(cfg.seed)
    train(cfg, Path(cfg.work_dir), target, spec, [], resume=(Path(cfg.work_dir) / "checkpoint.pt").is_file(),
          samples=samples, on_save=keep)


# ---------------------------------------------------------------- eval

def greedy_reference(args, target, tok, stops, dataset: str) -> list[dict]:
    """Cached greedy outputs (target only) of the first --limit prompts (prompt lookup is replayed per block size)."""
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.train.audit import greedy_rows

    path = Path(args.work) / "eval" / f"greedy-{dataset}-{args.limit}-{args.max_new_tokens}.json"
    if path.is_file():
        return read_json(path)
    rows = greedy_rows(target, tok, stops, load_prompts(dataset, args.limit), args.max_new_tokens, args.batch_size,
                       f"greedy {dataset} (batches of {args.batch_size})")
    write_json(path, rows)
    return rows


def cmd_eval(args) -> None:
    import torch
    from tqdm import tqdm

    from trtllm_dflash.checkpoints import resolve_draft_vocab, use_draft_vocab
    from trtllm_dflash.models.draft_vocab import read as read_draft_vocab
    from trtllm_dflash.specs import DrafterSpec
    from trtllm_dflash.commands.common import resolve_datastore
    from trtllm_dflash.models.drafter import DrafterModel
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.train.audit import output_taus, prompt_lookup_taus, replay_taus

    _, target, tok, stops = load_target(args)
    drafters = [Path(d) for d in args.drafters] if args.drafters else sorted((Path(args.work) / "drafters").iterdir())
    refs = {d: greedy_reference(args, target, tok, stops, d) for d in args.datasets.split(",")}
    lookup = {d: [prompt_lookup_taus(r["prompt_ids"] + r["token_ids"], len(r["prompt_ids"]), args.block_size)
                  for r in rows] for d, rows in refs.items()}  # per output row; the same for every drafter
    for d in tqdm(drafters, desc="drafters"):
        method = "decode" if args.decode else "replay"
        sets = "" if args.datasets == "humaneval,mtbench" else f"-{args.datasets.replace(',', '+')}"
        if not (d / "model.safetensors").is_file():
            continue
        vocab = resolve_draft_vocab(args.draft_vocab, d, DrafterSpec.load(d))  # a reduced one: another result
        vocab = f"-dv{read_draft_vocab(vocab, target.spec.vocab_size).numel()}" if vocab is not None else ""
        out_path = (Path(args.work) / "eval" /
                    f"{method}-{d.name}{vocab}-B{args.block_size}-{args.limit}-{args.max_new_tokens}{sets}.json")
        if out_path.is_file():  # evaluated before: that result, if it is this drafter's (the file is named by its name)
            cached = json.loads(out_path.read_text())
            if Path(cached.get("drafter", "")).resolve() != d.resolve():  # the same directory, however named
                raise SystemExit(f"learning-curve eval: {out_path} holds the result of --drafters "
                                 f"{cached.get('drafter')!r}, not of {str(d)!r} (the same directory name); rename "
                                 f"{str(d)!r} or evaluate it with another --work")
            print(json.dumps({**cached, "cached": str(out_path)}))
            continue
        drafter = use_draft_vocab(target, DrafterModel.from_pretrained(d, dtype=torch.float32, device="cpu"), d,
                                  args.draft_vocab)
        store = resolve_datastore(args.datastore, d, tree_lookup=True)  # the drafter directory's, by default
        decs = [SpeculativeDecoder(target, drafter, args.block_size, ngram=ngram) for ngram in (False, True)] + \
            [SpeculativeDecoder(target, drafter, args.block_size, tree=True)] + \
            ([SpeculativeDecoder(target, drafter, args.block_size, tree=True, datastore=store)] if store else []) \
            if args.decode else None
        res = {"drafter": str(d), "block_size": args.block_size, "limit": args.limit,
               "max_new_tokens": args.max_new_tokens, "method": "decode" if args.decode else "replay",
               **({"datastore_tokens": store.num_tokens} if store else {})}
        for ds, rows in refs.items():
            taus, ng, pl, mismatched, both, stored = [], [], [], [], [], []
            for i in range(0, len(rows), args.batch_size):
                part = rows[i : i + args.batch_size]
                pl += [t for row_taus in lookup[ds][i : i + args.batch_size] for t in row_taus]
                if decs is None:  # the decoder's walks replayed on the known greedy output (train.audit.replay_taus)
                    for r in part:
                        t, m, tr, *st = replay_taus(target, drafter, r["prompt_ids"] + r["token_ids"],
                                                    len(r["prompt_ids"]), ngram=True, block_size=args.block_size,
                                                    tree=True, datastore=store)
                        taus, ng, both, stored = taus + t, ng + m, both + tr, stored + (st[0] if st else [])
                    continue
                reqs = [Request(tuple(r["prompt_ids"]), args.max_new_tokens, stop_token_ids=stops) for r in part]
                for r, *outs in zip(part, *(dec.generate(reqs) for dec in decs)):
                    # drafts the verify accepted past the output's end (after the stop token or the length limit)
                    # are not output: counted as the replay counts them (train.audit.output_taus)
                    for walks, out in zip((taus, ng, both, stored), outs):
                        walks += output_taus(out.acceptance_lengths, len(r["token_ids"]))
                    if any(list(out.token_ids) != r["token_ids"] for out in outs):
                        mismatched.append(r["id"])
            res[ds] = {"tau": round(sum(taus) / len(taus), 4), "prompt_lookup_tau": round(sum(pl) / len(pl), 4),
                       "steps": len(taus), "ngram_tau": round(sum(ng) / len(ng), 4), "ngram_steps": len(ng),
                       # the tree verify (runtime.tree: the drafter's block, its alternates, the lookup continuation)
                       **({"tree_tau": round(sum(both) / len(both), 4), "tree_steps": len(both)} if both else {}),
                       # ... with the drafter directory's retrieval datastore proposing too (runtime.datastore)
                       **({"tree_datastore_tau": round(sum(stored) / len(stored), 4),
                           "tree_datastore_steps": len(stored)} if stored else {}),
                       **({"lossless": not mismatched, "mismatched": mismatched} if decs else {})}
        write_json(out_path, res)
        print(json.dumps(res))


# ---------------------------------------------------------------- report

def fit_log(xs: list[float], ys: list[float]) -> tuple[float, float] | None:
    """Least squares τ = a + b · ln(tokens); None with fewer than 3 points."""
    import math

    if len(xs) < 3:
        return None
    lx = [math.log(x) for x in xs]
    mx, my = sum(lx) / len(lx), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in lx)
    b = sum((x - mx) * (y - my) for x, y in zip(lx, ys)) / sxx if sxx else 0.0
    return my - b * mx, b


def _curve_points(work: Path, args) -> list[dict]:
    """Every evaluated drafter's curve point (its training record beside its τ per dataset), in a stable order."""
    points = []
    for ev in sorted((work / "eval").glob(f"replay-*-B{args.block_size}-{args.limit}-{args.max_new_tokens}.json")):
        res = read_json(ev)
        d = Path(res["drafter"])
        meta = read_json(d / "curve_point.json")
        if meta is None:  # a reference drafter (e.g. the shipped one): its own training record
            cfg = read_json(d / "training_config.json", {})
            meta = {"name": d.name, "source": "reference", "step": cfg.get("steps"),
                    "data_response_tokens": cfg.get("data", {}).get("num_response_tokens"),
                    "seen_response_tokens": cfg.get("data", {}).get("num_response_tokens")}
        points.append({**meta, **{k: res[k] for k in ("humaneval", "mtbench") if k in res}})
    points.sort(key=lambda p: (p["source"], p.get("name", ""), p.get("step") or 0))
    return points


def _curve_fits(single: list[dict]) -> dict:
    """Log-linear and power-law fits of τ against the tokens seen, over the main run's single-pass points."""
    import math

    def tokens_or_none(exponent: float | None):
        return None if exponent is None or exponent > math.log(1e12) else round(math.exp(exponent))

    fits = {}
    for ds in ("humaneval", "mtbench"):
        xs = [p["seen_response_tokens"] for p in single]
        f = fit_log(xs, [p[ds]["tau"] for p in single])
        g = fit_log(xs, [math.log(max(p[ds]["tau"] - 1, 1e-6)) for p in single])  # ln(τ − 1) = ln c + α ln n
        if f and g:
            a, b = f
            lc, alpha = g
            fits[ds] = {
                "log_linear": {"tau": f"{a:.4f} + {b:.4f} ln(tokens)",
                               "tokens_for_tau_4": tokens_or_none((4 - a) / b if b > 0 else None),
                               "tokens_for_tau_2_5": tokens_or_none((2.5 - a) / b if b > 0 else None),
                               "none_means": "more than 1e12 tokens: no credible forecast"},
                "power_law": {"tau_minus_1": f"{math.exp(lc):.3e} * tokens^{alpha:.3f}",
                              "tokens_for_tau_4": tokens_or_none((math.log(3) - lc) / alpha if alpha > 0 else None),
                              "tokens_for_tau_2_5": tokens_or_none((math.log(1.5) - lc) / alpha if alpha > 0
                                                                   else None)},
                "note": "fits over the single-pass points of the main run (every token seen once); predicting τ 4 "
                        "is an extrapolation orders of magnitude beyond the data: read it as an order of magnitude, "
                        "and the two fits as bounds on the story, not a forecast"}
    return fits


def _curve_sources(points: list[dict], main: str | None) -> list[dict]:
    """The source comparison: each other run's τ beside what its data and training cost, in CPU-hours."""
    sources = []
    for p in points:
        if p["source"] in ("regen", "text") and p["name"] != main:
            cpu_h = (p["data_cpu_s"] + p["taps_cpu_s"] + p["train_cpu_s"]) / 3600
            sources.append({"name": f"{p['name']}@{p['step']}", "source": p["source"], "labels": p["labels"],
                            "response_tokens": p["data_response_tokens"],
                            "data_cpu_h": round(p["data_cpu_s"] / 3600, 4), "total_cpu_h": round(cpu_h, 4),
                            **{f"tau_{ds}": p[ds]["tau"] for ds in ("humaneval", "mtbench")},
                            **{f"tau_gain_per_data_cpu_h_{ds}": round((p[ds]["tau"] - 1) / max(p["data_cpu_s"] / 3600,
                                                                                               1e-9), 3)
                               for ds in ("humaneval", "mtbench")}})
    return sources


def _plot_curve(out: Path, args, points: list[dict], main_runs: list[dict], fits: dict, prompt_lookup: dict) -> None:
    """curve.png: τ against the tokens seen, per dataset, with the other sources, the shipped drafter and the fit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=False)
    for ax, ds, title in zip(axes, ("humaneval", "mtbench"), ("HumanEval", "MT-Bench")):
        xs = [p["seen_response_tokens"] for p in main_runs]
        ax.plot(xs, [p[ds]["tau"] for p in main_runs], "o-", label=f"{args.main} checkpoints (2nd pass: right end)")
        for p in points:
            if p["source"] == "text":
                ax.plot(p["seen_response_tokens"], p[ds]["tau"], "s", color="tab:green",
                        label=f"text source {p['name']}@{p['step']}")
            elif p["source"] == "regen" and p["name"] != args.main:
                ax.plot(p["seen_response_tokens"], p[ds]["tau"], "^", color="tab:purple",
                        label=f"{p['name']}@{p['step']}")
            elif p["source"] == "reference":
                ax.plot(p["seen_response_tokens"], p[ds]["tau"], "*", ms=12, color="tab:red",
                        label=f"shipped drafter ({p['step']} steps, several passes)")
        if prompt_lookup[ds] is not None:
            ax.axhline(prompt_lookup[ds], ls="--", color="gray", label="prompt lookup (no training)")
        if ds in fits:
            c, alpha = (float(v) for v in fits[ds]["power_law"]["tau_minus_1"].split(" * tokens^"))
            gx = [min(xs) * (max(xs) / min(xs)) ** (i / 20) for i in range(21)]
            ax.plot(gx, [1 + c * x**alpha for x in gx], ":", color="tab:blue", label="fit 1 + c·n^α")
        ax.set_xscale("log")
        ax.set_xlabel("distinct regenerated response tokens seen")
        ax.set_ylabel(f"τ at B={args.block_size} (first {args.limit} prompts)")
        ax.set_title(title)
        handles, labels = ax.get_legend_handles_labels()
        uniq = dict(zip(labels, handles))
        ax.legend(uniq.values(), uniq.keys(), fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    tmp = out / ".curve.png.tmp"
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, out / "curve.png")  # atomically: a reader never sees half a PNG


def cmd_report(args) -> None:
    work, out = Path(args.work), Path(args.out)
    points = _curve_points(work, args)
    regen = [p for p in points if p["source"] == "regen"]
    if args.main is None and regen:
        args.main = max(regen, key=lambda p: p["data_response_tokens"])["name"]
    main_runs = [p for p in regen if p["name"] == args.main]
    single = [p for p in main_runs if p["step"] * p["samples_per_step"] <= p["data_sequences"]]  # each seen once
    fits = _curve_fits(single)
    sources = _curve_sources(points, args.main)
    prompt_lookup = {ds: next((p[ds]["prompt_lookup_tau"] for p in points if ds in p), None)
                     for ds in ("humaneval", "mtbench")}
    doc = {"block_size": args.block_size, "eval_prompts": args.limit, "max_new_tokens": args.max_new_tokens,
           "tau_method": "replay (train.audit.replay_taus: the decoder's walk on the greedy outputs; equal to "
                         "decoding, checked in tests)", "main_run": args.main, "points": points, "fits": fits,
           "sources": sources,
           "prompt_lookup_tau": prompt_lookup, "command": "trtllm-dflash " + " ".join(sys.argv[1:])}
    write_json(out / "curve.json", doc)
    _plot_curve(out, args, points, main_runs, fits, prompt_lookup)
    print(json.dumps({"points": len(points), "fits": fits, "out": str(out)}))


# ---------------------------------------------------------------- command line

def add_pool_args(q: argparse.ArgumentParser) -> None:
    """Which pool prompts ``regen`` decodes (``prompts`` must be given the same to find them again)."""
    q.add_argument("--pool", default="artifacts/pool/pool.jsonl")
    q.add_argument("--num-prompts", type=int, default=8192, help="pool sample size (the order of the shards)")
    q.add_argument("--code-fraction", type=float, default=0.5)
    q.add_argument("--max-prompt-len", type=int, default=256)
    q.add_argument("--exclude", nargs="*", default=[], metavar="JSONL",
                   help="leave out the pool prompts whose ids these JSONL(.gz) files hold (e.g. the shipped drafter's "
                        "training_prompts.jsonl.gz, to regenerate data it has not seen)")


def add_data_args(q: argparse.ArgumentParser) -> None:
    """The shards a run trains on and how they are tapped (``taps`` and ``train`` must agree)."""
    q.add_argument("--source", choices=["regen", "text"], default="regen")
    q.add_argument("--size", type=int, required=True, help="response tokens (whole shards, at least this many)")
    q.add_argument("--taps-dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="dtype of the teacher-forced forward that makes the taps (stored as bf16 either way; "
                        "default bfloat16, the faster one on a CPU with bfloat16 products)")
    q.add_argument("--tap-layers", type=int, nargs="+", default=[1, 14, 27],
                   help="target layers tapped (default 1 14 27, the shipped drafter's)")


def taps_dir(work, source: str, dtype: str) -> Path:
    """The training shards (taps added) of ``source``'s shards, by the dtype of the forward that tapped them."""
    return Path(work) / f"{source}-taps-{dtype}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The ``learning-curve`` command's options and its phases as subcommands."""
    p.add_argument("--work", default="artifacts/curve", help="state folder (default artifacts/curve)")
    p.add_argument("--target", default=None, help="HF target directory (default: the demo target)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per process (default 1: run one process per core)")
    p.add_argument("--seed", type=int, default=0)
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_data_commands(sub)
    _add_train_command(sub)
    _add_eval_commands(sub)


def _add_data_commands(sub) -> None:
    """``regen``, ``text``, ``prompts`` and ``taps``: the phases that make the training data."""
    q = sub.add_parser("regen", help="regenerate responses from the pool until --tokens or --minutes")
    add_pool_args(q)
    q.add_argument("--max-new-tokens", type=int, default=256)
    q.add_argument("--gen-batch-size", type=int, default=32)
    q.add_argument("--tokens", type=int, default=400_000, help="stop after this many response tokens")
    q.add_argument("--minutes", type=float, default=60.0, help="or after this long")
    q.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="regeneration dtype (default bfloat16: the faster one on a CPU with bf16 units)")
    q.add_argument("--taps", action="store_true",
                   help="also keep the taps the decode computes and write each chunk's training shard to "
                        "regen-taps-<dtype>/ (what `taps --taps-dtype <dtype>` would make): no second forward "
                        "over the data, which on a CPU costs as much as the decode")
    q.add_argument("--tap-layers", type=int, nargs="+", default=[1, 14, 27],
                   help="with --taps: target layers tapped (default 1 14 27; train's --tap-layers must match)")
    q.add_argument("--worker", type=int, default=0, help="this process makes shards i with i %% --workers == --worker")
    q.add_argument("--workers", type=int, default=1)
    q = sub.add_parser("text", help="teacher-forced real code from installed sources until --tokens")
    q.add_argument("--num-functions", type=int, default=20000)
    q.add_argument("--max-prompt-len", type=int, default=256)
    q.add_argument("--max-new-tokens", type=int, default=256)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--tokens", type=int, default=400_000)
    q.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16",
                   help="forward dtype for the top-k (default bfloat16, as regen)")
    q = sub.add_parser("prompts", help="the pool prompts behind the first --size regenerated tokens, as JSONL")
    q.add_argument("--size", type=int, required=True)
    q.add_argument("--skip", type=int, default=0, metavar="TOKENS",
                   help="leave out the first shards holding exactly this many response tokens (train's --skip)")
    q.add_argument("--out", required=True)
    add_pool_args(q)
    q = sub.add_parser("taps", help="tap the first --size tokens' shards ahead of train, split over processes")
    add_data_args(q)
    q.add_argument("--worker", type=int, default=0)
    q.add_argument("--workers", type=int, default=1)


def _add_train_command(sub) -> None:
    """``train``: one drafter on the first --size response tokens of a source."""
    q = sub.add_parser("train", help="train one drafter on the first --size response tokens of a source")
    add_data_args(q)
    q.add_argument("--labels", choices=["target", "text"], default="target",
                   help="text source: the target's greedy predictions (default) or the real text as labels")
    q.add_argument("--epochs", type=float, default=1.0, help="passes over the data (default 1: each token once)")
    q.add_argument("--ckpt-every", type=int, default=100, help="steps between kept checkpoints (curve points)")
    q.add_argument("--skip", type=int, default=0, metavar="TOKENS",
                   help="leave out the first shards holding exactly this many response tokens (e.g. the --size an "
                        "--init drafter was trained on: continue on the newer shards only)")
    q.add_argument("--num-layers", type=int, default=3, help="drafter layers (default 3, the shipped drafter's)")
    q.add_argument("--init", default="target",
                   help="'target' (default), 'random', or a drafter directory to continue training (e.g. the shipped one)")
    q.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default 1e-3, the shipped recipe's)")
    q.add_argument("--samples-per-step", type=int, default=4)
    q.add_argument("--anchors-per-sample", type=int, default=16)
    q.add_argument("--autocast", choices=["bf16", "none"], default="bf16",
                   help="the objective under bf16 autocast (default: the faster one on a CPU with avx512_bf16) or none "
                        "(float32: the faster choice on a CPU without bf16 units)")
    q.add_argument("--loss-vocab", choices=["data", "full"], default="data",
                   help="softmax over the data's tokens plus 8192 random others (default: the CPU economy) or the "
                        "whole vocabulary (what --distill and --tv need)")
    q.add_argument("--distill", type=float, default=0.0, metavar="W",
                   help="self-distillation weight in [0, 1]: cross-entropy to the target's stored top-k distribution, "
                        "mixed with the hard labels' (1 - W); needs --loss-vocab full")
    q.add_argument("--tv", type=float, default=0.0, metavar="W",
                   help="total-variation weight in [0, 1 - distill]: the distance to the target's stored top-k "
                        "distribution, mixed with the hard labels' CE (e.g. 0.9 keeps 0.1 CE); needs --loss-vocab full")


def _add_eval_commands(sub) -> None:
    """``eval`` and ``report``: τ of the trained drafters, and the curve from it."""
    from trtllm_dflash.commands.common import add_draft_vocab_argument

    q = sub.add_parser("eval", help="τ of every trained drafter (or --drafters) on the evaluation prompts")
    q.add_argument("--drafters", nargs="*", default=None)
    q.add_argument("--datasets", default="humaneval,mtbench")
    q.add_argument("--limit", type=int, default=32)
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--block-size", type=int, default=16)
    q.add_argument("--batch-size", type=int, default=16)
    q.add_argument("--decode", action="store_true",
                   help="run the real decoder (lossless check) instead of replaying its walk on the greedy outputs")
    q.add_argument("--datastore", default="auto", metavar="FILE|auto|none",
                   help="also the tree verify with a retrieval datastore; auto (default): the drafter directory's "
                        "datastore.dflash where it has one")
    add_draft_vocab_argument(q)
    q = sub.add_parser("report", help="curve.json + curve.png from the evaluations")
    q.add_argument("--out", default="perf/results/drafter-curve")
    q.add_argument("--main", default=None, help="the main run's name, e.g. regen-140000 (default: the largest regen run)")
    q.add_argument("--limit", type=int, default=32)
    q.add_argument("--max-new-tokens", type=int, default=128)
    q.add_argument("--block-size", type=int, default=16)


def main(args: argparse.Namespace) -> int:
    from trtllm_dflash.train.cli import use_huge_pages

    use_huge_pages()  # before the first torch import (every phase imports it lazily)
    {"regen": cmd_regen, "text": cmd_text, "prompts": cmd_prompts, "taps": cmd_taps, "train": cmd_train,
     "eval": cmd_eval, "report": cmd_report}[args.cmd](args)
    return 0
