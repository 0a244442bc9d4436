"""The training loop: AdamW over the drafter only (target frozen), deterministic sampling, resumable checkpoints,
a JSON training log and a z-lab-format export at every checkpoint.

Determinism and resume: step t trains on the sequences at slots [t·n, (t+1)·n) of an endless stream of seeded
per-epoch permutations (held-out sequences excluded) with anchors drawn from a generator seeded by (seed, t), so a
resumed run sees exactly the batches an uninterrupted one would have.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import logging
import math
import os
import platform
import shutil
import time
from pathlib import Path

import torch

from trtllm_dflash.assets import cache_dir
from trtllm_dflash.checkpoints import random_drafter_state, write_drafter
from trtllm_dflash.errors import ConfigError, require
from trtllm_dflash.models.drafter import DrafterModel
from trtllm_dflash.models.weights import read_state_dict
from trtllm_dflash.models.target import SCRATCH_POSITIONS, TargetModel
from trtllm_dflash.specs import DrafterSpec
from trtllm_dflash.train.config import TrainConfig
from trtllm_dflash.train.data import Sample, read_shard
from trtllm_dflash.train.init import init_from_target
from trtllm_dflash.train.objective import StepMetrics, collate, dflash_loss, sample_anchors, tap_standardizer

log = logging.getLogger(__name__)

CKPT = "checkpoint.pt"
TRIM_EVERY = 8  # steps between returns of the C heap's free pages to the system (``release_free_memory``); 0 = never
NUM_HELD_OUT = 16  # sequences kept out of training to report a held-out expected τ
HELD_OUT_ANCHORS = 16
# What makes a run the run it is: resuming a checkpoint whose config differs in one of these would silently splice two
# recipes (threads, device, autocast, paths, the step count and the checkpoint cadence may change between the two
# halves; --init matters only at step 0)
RECIPE_KEYS = ("num_layers", "block_size", "target_layer_ids", "mask_token_id", "samples_per_step", "anchors_per_sample",
               "lr", "warmup", "weight_decay", "gamma", "loss_vocab", "loss_negatives", "distill", "tv", "seed")


def check_same_recipe(ck: dict, cfg: TrainConfig, ckpt_path: Path) -> None:
    """Refuse to resume ``ckpt_path`` under another recipe; the GPU job's returned weights (no optimizer state: their
    moments restart anyway) are exempt."""
    if "optimizer" not in ck:
        return
    saved, now = ck["log"].get("config", {}), cfg.to_dict()
    for key in RECIPE_KEYS:
        if key in saved and saved[key] != now[key]:
            raise ConfigError(key, now[key], f"{ckpt_path} was trained with {key}={saved[key]!r}",
                              "resume with the same value, or train in another work directory")


def _malloc_trim():
    """glibc's ``malloc_trim``, or None where the C library has none (macOS, musl)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system. Every training step allocates and frees gigabytes of
    activations whose sizes change with the batch's sequence lengths; glibc keeps the freed blocks, cannot reuse all
    of them for the next step's differently sized ones, so without a trim the process grows every step although
    nothing is live. A trim returns the heap to its live size at a cost in step time, so the trainer trims every
    ``TRIM_EVERY`` steps, not every step (perf/bench_trainer_memory.py at 0620e3a; perf/results/drafter-trainer/)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def resident_mb() -> int | None:
    """This process's resident memory in MB (Linux), for the training log."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 2**20
    except (OSError, ValueError, IndexError):
        return None


def lr_at(step: int, total: int, peak: float, warmup: float) -> float:
    """Linear warm-up over ``warmup · total`` steps, then cosine decay to 10 % of the peak."""
    w = max(1, round(warmup * total))
    if step < w:
        return peak * (step + 1) / w
    t = (step - w) / max(1, total - w)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def scheduled_step(step: int, start: int, total: int, t0: float, deadline: float | None, now: float) -> int:
    """Where the learning-rate schedule stands. With a time box (``deadline``) it also advances with the clock from
    ``t0``, so a run the box stops before ``total`` steps still warms up and decays fully instead of stopping at a
    high rate (a GPU lease ends training at its deadline; how many steps fit is unknown until it runs)."""
    if deadline is None or deadline <= t0:
        return step
    frac = min(1.0, max(0.0, (now - t0) / (deadline - t0)))
    return min(total - 1, max(step, start + round((total - start) * frac)))


def window_entry(m: StepMetrics, grad_norm: torch.Tensor) -> torch.Tensor:
    """One step's numbers for the log, kept on the device: ``[loss, expected τ, grad norm, correct × (B − 1),
    counted × (B − 1)]``. A read per step would make the host wait for every step's kernels before it launches the
    next step's (a GPU idling meanwhile); ``window_record`` reads a window of them at once."""
    return torch.cat([torch.stack([m.loss.detach().float(), m.expected_tau.float(), grad_norm.float()]),
                      m.correct.float(), m.counted.float()])


def window_record(window: list[torch.Tensor], lr: float) -> dict:
    """A log record from a window of ``window_entry`` rows, read back to the host once."""
    w = torch.stack(window).cpu().double()  # [steps, 3 + 2 (B − 1)]
    loss, tau, grad_norm = (w[:, :3].sum(0) / len(window)).tolist()
    correct, counted = w[:, 3:].sum(0).chunk(2)
    return {"loss": round(loss, 4), "expected_tau": round(tau, 3),
            "accuracy": [round(a, 3) for a in (correct / counted.clamp(min=1)).tolist()],
            "lr": lr, "grad_norm": round(grad_norm, 3)}


def split(samples: list[Sample], seed: int) -> tuple[list[Sample], list[Sample]]:
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(seed)).tolist()
    held = min(NUM_HELD_OUT, len(samples) // 10)
    return [samples[i] for i in order[held:]], [samples[i] for i in order[:held]]


def step_indices(step: int, per_step: int, num: int, seed: int) -> list[int]:
    out = []
    for slot in range(step * per_step, (step + 1) * per_step):
        epoch, pos = divmod(slot, num)
        perm = torch.randperm(num, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
        out.append(int(perm[pos]))
    return out


def total_steps(cfg: TrainConfig, num_train: int) -> int:
    if cfg.steps is not None:
        return cfg.steps
    return math.ceil(cfg.epochs * num_train / cfg.samples_per_step)


@torch.no_grad()
def evaluate(drafter: DrafterModel, target: TargetModel, samples: list[Sample], cfg: TrainConfig,
             tap_scale: torch.Tensor) -> dict:
    """Held-out loss, per-slot accuracy and expected τ over fixed anchors."""
    if not samples:
        return {}
    g = torch.Generator().manual_seed(cfg.seed + 7)
    anchors = [sample_anchors(s.prompt_len, len(s.ids), HELD_OUT_ANCHORS, g) for s in samples]
    batch = collate(samples, anchors, target.device, tap_scale=tap_scale)
    m = dflash_loss(drafter, target.embed, target.lm_head, batch, cfg.gamma)
    acc = (m.correct.float() / m.counted.clamp(min=1)).tolist()
    return {"loss": round(float(m.loss), 4), "expected_tau": round(float(m.expected_tau), 3),
            "accuracy": [round(a, 3) for a in acc]}


def exported_state(drafter: DrafterModel, tap_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """The drafter's weights for raw taps: the training-time tap standardisation folded into ``fc``."""
    state = {k: v.detach().cpu().clone() for k, v in drafter.state_dict().items()}
    state["fc.weight"] = state["fc.weight"] * tap_scale.cpu()[None, :]
    return state


def warm_start_state(drafter_dir: Path, spec: DrafterSpec, tap_scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """An exported drafter's weights as this run's starting point (continued training): the inverse of
    ``exported_state`` under this run's tap standardiser. The drafter must be the architecture being trained."""
    have = DrafterSpec.load(drafter_dir)
    for field in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "block_size", "mask_token_id", "target_layer_ids"):
        require(getattr(have, field) == getattr(spec, field), f"init ({drafter_dir}).{field}", getattr(have, field),
                f"differs from the drafter being trained ({getattr(spec, field)})",
                "train with the same --num-layers/--block-size/--target-layer-ids/--mask-token-id, or --init target")
    state = {k: v.float().clone() for k, v in read_state_dict(drafter_dir).items()}
    state["fc.weight"] = state["fc.weight"] / tap_scale.cpu()[None, :]
    return state


def export(cfg: TrainConfig, spec: DrafterSpec, target: TargetModel, drafter: DrafterModel, log_doc: dict,
           data_summary: dict, work: Path, tap_scale: torch.Tensor) -> None:
    """The z-lab checkpoint plus its provenance: resolved config, training log and the exact training prompts."""
    out = Path(cfg.out)
    state = exported_state(drafter, tap_scale)
    write_drafter(out, spec, target.spec, state)
    training_config = cfg.to_dict() | {
        "target_layer_ids": list(spec.target_layer_ids),
        "data": data_summary,
        "command": "python -m trtllm_dflash.train.cli " + " ".join(_cli_flags(cfg)),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
    }
    (out / "training_config.json").write_text(_portable(json.dumps(training_config, indent=2)) + "\n")
    (out / "training_log.json").write_text(_portable(json.dumps(log_doc, indent=1)) + "\n")
    if (work / "prompts.jsonl").is_file():
        shutil.copyfile(work / "prompts.jsonl", out / "training_prompts.jsonl")
    out.chmod(0o755)  # write_drafter's atomic temp dir is private (mkdtemp); the export is meant to be shared
    for f in out.iterdir():
        f.chmod(0o644)


def _portable(text: str) -> str:
    """Provenance without this machine's paths: the asset cache (``$TRTLLM_DFLASH_CACHE`` included) is written as its
    default ``~/.cache/trtllm_dflash``, anything else under the home directory as ``~``."""
    text = text.replace(str(cache_dir()) + "/", "~/.cache/trtllm_dflash/")
    return text.replace(str(Path.home()) + "/", "~/")


def _cli_flags(cfg: TrainConfig) -> list[str]:
    flags = []
    for k, v in cfg.to_dict().items():
        if v is None or k == "work_dir":
            continue
        flag = "--" + k.replace("_", "-")
        flags += [flag, *map(str, v)] if isinstance(v, list) else [flag, str(v)]
    return flags


def train(cfg: TrainConfig, work: Path, target: TargetModel, spec: DrafterSpec, shards: list[Path],
          resume: bool, deadline: float | None = None, samples: list[Sample] | None = None,
          on_save=None) -> DrafterModel:
    """``deadline``: a ``time.monotonic()`` instant after which the run checkpoints and stops early (the GPU
    pipeline's time box); a later call with ``resume`` continues it. A checkpoint without an ``optimizer`` entry (the
    GPU pipeline's returned weights, build_scripts/gpu_pipeline.py) resumes the weights and step with fresh AdamW moments.
    ``samples`` instead of ``shards``: sequences whose taps are None get them from the target at every step
    (``regen.with_taps``; the tap standardiser then comes from the first 64 training sequences). ``on_save(step,
    train_set)`` runs after every checkpoint's export (``trtllm-dflash learning-curve`` keeps each one)."""
    from tqdm import tqdm

    from trtllm_dflash.train.regen import with_taps

    if samples is None:
        samples = [s for p in shards for s in read_shard(p)]
    samples = [s for s in samples if len(s.ids) - s.prompt_len >= 2]
    online = bool(samples) and samples[0].taps is None

    def tapped(xs: list[Sample]) -> list[Sample]:
        return with_taps(target, xs, spec.target_layer_ids) if online and xs else xs

    if not samples:
        raise ConfigError("data", len(samples), "no sequence has a response of >= 2 tokens")
    train_set, held_out = split(samples, cfg.seed)
    steps = total_steps(cfg, len(train_set))
    data_summary = {
        "num_sequences": len(samples), "num_train": len(train_set), "num_held_out": len(held_out),
        "num_response_tokens": sum(len(s.ids) - s.prompt_len for s in samples),
        "num_prompt_tokens": sum(s.prompt_len for s in samples),
    }
    held_out = tapped(held_out)
    tap_scale = tap_standardizer(tapped(train_set[:64]) if online else train_set).to(cfg.device)  # [K·H]
    vocab = None
    if cfg.loss_vocab == "data":
        vocab = torch.unique(torch.cat([t for s in samples for t in (s.ids, s.label_ids)])).to(cfg.device)  # sorted
        data_summary["loss_vocab_size"] = len(vocab)
    others = None if vocab is None else torch.ones(target.spec.vocab_size, dtype=torch.bool, device=cfg.device)
    if others is not None:
        others[vocab] = False
        others = others.nonzero()[:, 0]  # [V − V'] tokens absent from the data

    def candidates(vocab, g):
        """The data's tokens plus ``loss_negatives`` random absent ones: without those, nothing would keep the
        absent tokens' logits down and the drafter's full-vocabulary argmax at inference would pick them."""
        if vocab is None:
            return None
        pick = torch.randperm(len(others), generator=g)[: cfg.loss_negatives].to(cfg.device)
        return torch.cat([vocab, others[pick]]).sort().values
    drafter = DrafterModel(spec, device=cfg.device,
                           max_positions=target.spec.max_position_embeddings + SCRATCH_POSITIONS)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt_path = work / CKPT
    log_doc = {"config": cfg.to_dict(), "data": data_summary, "total_steps": steps, "records": [], "held_out": []}
    start = 0
    if ckpt_path.is_file():
        if not resume:
            raise ConfigError("--resume", False, f"{ckpt_path} exists", "pass --resume to continue it or delete it")
        ck = torch.load(ckpt_path, map_location=cfg.device, weights_only=False)
        check_same_recipe(ck, cfg, ckpt_path)
        drafter.load_state_dict(ck["drafter"])
        if "optimizer" in ck:
            opt.load_state_dict(ck["optimizer"])
        else:
            log.warning("%s holds no optimizer state: AdamW moments restart from zero", ckpt_path)
        start, log_doc = ck["step"], ck["log"]
        if "tap_scale" in ck:  # the scale the weights were trained with, whatever the data now give
            tap_scale = ck["tap_scale"].to(cfg.device)
        log_doc["total_steps"] = steps
        log.info("resumed from %s at step %d", ckpt_path, start)
    else:
        init = random_drafter_state(spec, cfg.seed)
        if cfg.init == "target":
            init = init_from_target(init, target, spec, tap_scale, train_set[0].ids[:512].to(cfg.device))
        elif cfg.init != "random":
            init = warm_start_state(Path(cfg.init), spec, tap_scale)
            log.info("warm start from the drafter in %s", cfg.init)
        drafter.load_state_dict(init)
    drafter.train()
    log.info("training %d steps on %d sequences (%d held out): %s", steps, len(train_set), len(held_out), data_summary)

    def save(step: int) -> None:
        ev = evaluate(drafter, target, held_out, cfg, tap_scale)
        log_doc["held_out"].append({"step": step, **ev})
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"drafter": drafter.state_dict(), "optimizer": opt.state_dict(), "step": step, "log": log_doc,
                    "tap_scale": tap_scale.cpu()}, tmp)
        os.replace(tmp, ckpt_path)
        export(cfg, spec, target, drafter, log_doc, data_summary, work, tap_scale)
        log.info("step %d: checkpoint + export to %s; held-out %s", step, cfg.out, ev)
        if on_save is not None:
            on_save(step, train_set)

    autocast = (torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16) if cfg.autocast == "bf16"
                else contextlib.nullcontext())
    window: list = []
    t_last, t_box = time.perf_counter(), time.monotonic()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc="train-drafter", mininterval=30)
    for step in bar:
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        picked = tapped([train_set[i] for i in step_indices(step, cfg.samples_per_step, len(train_set), cfg.seed)])
        anchors = [sample_anchors(s.prompt_len, len(s.ids), cfg.anchors_per_sample, g) for s in picked]
        lr = lr_at(scheduled_step(step, start, steps, t_box, deadline, time.monotonic()), steps, cfg.lr, cfg.warmup)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = collate(picked, anchors, cfg.device, tap_scale=tap_scale)
        with autocast:
            m = dflash_loss(drafter, target.embed, target.lm_head, batch, cfg.gamma, candidates(vocab, g),
                            distill=cfg.distill, tv=cfg.tv)
        opt.zero_grad(set_to_none=True)
        m.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        del batch
        if TRIM_EVERY and (step + 1) % TRIM_EVERY == 0:
            release_free_memory()
        window.append(window_entry(m, grad_norm))
        done = step + 1
        if done % cfg.log_every == 0 or done == steps:
            record = window_record(window, lr)
            now = time.perf_counter()
            record["seconds_per_step"] = round((now - t_last) / len(window), 3)
            record["resident_mb"] = resident_mb()
            log_doc["records"].append({"step": done, **record})
            bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}", refresh=False)
            log.info("step %d %s", done, {k: v for k, v in log_doc["records"][-1].items() if k != "accuracy"})
            window, t_last = [], now
        out_of_time = deadline is not None and time.monotonic() > deadline
        if done % cfg.ckpt_every == 0 or done == steps or out_of_time:
            drafter.eval()
            save(done)
            drafter.train()
        if out_of_time and done < steps:
            log.info("time box reached at step %d of %d: checkpointed; resume to continue", done, steps)
            break
    bar.close()
    if start >= steps and not (Path(cfg.out) / "model.safetensors").is_file():
        save(steps)
    return drafter.eval()
