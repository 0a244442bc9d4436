"""The ``train-drafter`` stages (prompts → taps → train → export → evaluate) over one work directory; see
train/cli.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from trtllm_dflash.datasets import Prompt, file_prompts
from trtllm_dflash.errors import ConfigError
from trtllm_dflash.specs import DrafterSpec, TargetSpec
from trtllm_dflash.train.config import TrainConfig

log = logging.getLogger(__name__)


def drafter_spec(cfg: TrainConfig, target: TargetSpec) -> DrafterSpec:
    from trtllm_dflash.checkpoints import drafter_spec_for

    return drafter_spec_for(
        target, num_layers=cfg.num_layers, block_size=cfg.block_size, mask_token_id=cfg.mask_token_id,
        target_layer_ids=cfg.target_layer_ids, intermediate_size=cfg.intermediate_size,
    )


def stage_prompts(cfg: TrainConfig, work: Path) -> list[Prompt]:
    """The training prompts, written once to work/prompts.jsonl and proven disjoint from the evaluation sets."""
    from trtllm_dflash.staging import write_atomic
    from trtllm_dflash.train.prompts import EvalIndex, mine_prompts, prompts_digest

    path = work / "prompts.jsonl"
    if path.is_file():
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        prompts = [Prompt(r["id"], r["prompt"], r["chat"]) for r in rows]
    else:
        index = EvalIndex.build()
        if cfg.data == "mined":
            prompts = mine_prompts(cfg.num_code_prompts, cfg.num_chat_prompts, seed=cfg.seed, index=index)
        else:
            rows = [json.loads(line) for line in Path(cfg.data).read_text().splitlines() if line.strip()]
            prompts = [Prompt(p.id, p.text, bool(r.get("chat", True))) for p, r in zip(file_prompts(cfg.data, True), rows)]
        for p in prompts:
            why = index.overlap(p.text)
            if why is not None:
                raise ConfigError(f"training prompt {p.id}", p.text[:60], f"overlaps the evaluation sets: {why}",
                                  "remove it from --data")
        write_atomic(path, "".join(json.dumps({"id": p.id, "prompt": p.text, "chat": p.chat}) + "\n" for p in prompts))
        log.info("%d training prompts (digest %s) written to %s", len(prompts), prompts_digest(prompts), path)
    return prompts


def stage_taps(cfg: TrainConfig, work: Path, target, spec: DrafterSpec, prompts: list[Prompt]) -> list[Path]:
    from tqdm import tqdm

    from trtllm_dflash.runtime.text import load_tokenizer, stop_token_ids
    from trtllm_dflash.train.regen import build_taps_cache

    tok = load_tokenizer(cfg.target)
    bar = tqdm(total=len(prompts), desc="regenerating responses", unit="prompt", mininterval=10)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    paths = build_taps_cache(
        target, tok, prompts, work / "taps", tap_layers=spec.target_layer_ids, max_new_tokens=cfg.max_new_tokens,
        max_prompt_len=cfg.max_prompt_len, stop_token_ids=stop_token_ids(tok, target.spec.eos_token_ids),
        batch_size=cfg.gen_batch_size, max_shards=cfg.max_shards, progress=progress,
    )
    bar.close()
    return paths


def stage_evaluate(cfg: TrainConfig, work: Path, target, limit: int, max_new_tokens: int) -> dict:
    """The exported drafter (``cfg.out``) on the evaluation sets, HumanEval and MT-Bench (their first ``limit``
    prompts, chat template, greedy, ``max_new_tokens`` each), one prompt at a time at the trained block size: τ,
    DFlash and autoregressive tokens/s, and whether every answer is the autoregressive one. Written to
    work/eval.json (atomically) and returned."""
    import time

    from tqdm import tqdm

    from trtllm_dflash.models.target import SCRATCH_POSITIONS
    from trtllm_dflash.datasets import load_prompts
    from trtllm_dflash.models.drafter import DrafterModel
    from trtllm_dflash.runtime.decoder import Request, SpeculativeDecoder
    from trtllm_dflash.runtime.text import encode_prompt, load_tokenizer, stop_token_ids
    from trtllm_dflash.staging import write_atomic

    drafter = DrafterModel.from_pretrained(cfg.out, dtype=target.dtype, device=target.device,
                                           max_positions=target.spec.max_position_embeddings + SCRATCH_POSITIONS)
    tok = load_tokenizer(cfg.target)
    stops = stop_token_ids(tok, target.spec.eos_token_ids)
    decoders = {"dflash": SpeculativeDecoder(target, drafter, cfg.block_size), "ar": SpeculativeDecoder(target, None, 1)}
    report: dict = {"drafter": cfg.out, "block_size": cfg.block_size, "max_new_tokens": max_new_tokens, "datasets": {}}
    for dataset in ("humaneval", "mtbench"):
        prompts = load_prompts(dataset, limit)
        seconds, tokens, taus, same = dict.fromkeys(decoders, 0.0), dict.fromkeys(decoders, 0), [], 0
        for p in tqdm(prompts, desc=f"evaluating on {dataset}", unit="prompt", mininterval=10):
            req = Request(tuple(encode_prompt(tok, p.text, p.chat)), max_new_tokens, stop_token_ids=stops)
            out = {}
            for name, dec in decoders.items():
                t0 = time.perf_counter()
                out[name] = dec.generate([req])[0]
                seconds[name] += time.perf_counter() - t0
                tokens[name] += out[name].num_new_tokens
            taus += out["dflash"].acceptance_lengths
            same += out["dflash"].token_ids == out["ar"].token_ids
        rate = {name: round(tokens[name] / seconds[name], 2) if seconds[name] else 0.0 for name in decoders}
        report["datasets"][dataset] = {
            "prompts": len(prompts), "mean_acceptance_length": round(sum(taus) / len(taus), 3) if taus else 0.0,
            "dflash_tokens_per_second": rate["dflash"], "ar_tokens_per_second": rate["ar"],
            "speedup": round(rate["dflash"] / rate["ar"], 3) if rate["ar"] else 0.0,
            "lossless": same == len(prompts)}
        log.info("%s: τ %.3f, %.2f vs %.2f tok/s (DFlash vs autoregressive), lossless %s", dataset,
                 report["datasets"][dataset]["mean_acceptance_length"], rate["dflash"], rate["ar"], same == len(prompts))
    write_atomic(work / "eval.json", json.dumps(report, indent=2) + "\n")
    return report


def run_training(cfg: TrainConfig, resume: bool, stop_after: str | None, eval_limit: int = 0,
                 eval_max_new_tokens: int = 64) -> dict | None:
    """Every stage in order; returns the evaluation's report (``stage_evaluate``; None with ``eval_limit`` 0 or
    ``stop_after``)."""
    from trtllm_dflash.models.target import TargetModel

    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work = Path(cfg.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    target_spec = TargetSpec.load(cfg.target)
    spec = drafter_spec(cfg, target_spec)
    prompts = stage_prompts(cfg, work)
    if stop_after == "prompts":
        return None
    target = TargetModel.from_pretrained(cfg.target, device=cfg.device)
    shards = stage_taps(cfg, work, target, spec, prompts)
    if stop_after == "taps":
        return None
    from trtllm_dflash.train.trainer import train

    train(cfg, work, target, spec, shards, resume=resume)
    if eval_limit <= 0:
        return None
    return stage_evaluate(cfg, work, target, eval_limit, eval_max_new_tokens)
