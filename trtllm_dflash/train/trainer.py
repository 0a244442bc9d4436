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
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass
class _LossVocab:
    """The tokens the loss scores. With ``loss_vocab: data`` ``vocab`` holds the data's tokens (sorted) and
    ``others`` the rest of the target's vocabulary; with the full vocabulary both are None."""

    vocab: torch.Tensor | None
    others: torch.Tensor | None  # [V − V'] tokens absent from the data
    negatives: int
    device: str

    def candidates(self, g: torch.Generator) -> torch.Tensor | None:
        """The data's tokens plus ``negatives`` random absent ones: without those, nothing would keep the
        absent tokens' logits down and the drafter's full-vocabulary argmax at inference would pick them."""
        if self.vocab is None:
            return None
        pick = torch.randperm(len(self.others), generator=g)[: self.negatives].to(self.device)
        return torch.cat([self.vocab, self.others[pick]]).sort().values


def _loss_vocab(cfg: TrainConfig, samples: list[Sample], target: TargetModel, data_summary: dict) -> _LossVocab:
    """The loss vocabulary ``cfg.loss_vocab`` asks for; a data vocabulary's size goes into ``data_summary``."""
    vocab = None
    if cfg.loss_vocab == "data":
        vocab = torch.unique(torch.cat([t for s in samples for t in (s.ids, s.label_ids)])).to(cfg.device)  # sorted
        data_summary["loss_vocab_size"] = len(vocab)
    others = None if vocab is None else torch.ones(target.spec.vocab_size, dtype=torch.bool, device=cfg.device)
    if others is not None:
        others[vocab] = False
        others = others.nonzero()[:, 0]  # [V − V'] tokens absent from the data
    return _LossVocab(vocab, others, cfg.loss_negatives, cfg.device)


@dataclass
class _TrainData:
    """A run's sequences, split into training and held-out sets, with what they determine: the step count, the
    summary written into the log and the export, the tap standardiser and the loss vocabulary."""

    train_set: list[Sample]
    held_out: list[Sample]  # with their taps
    steps: int
    summary: dict
    tap_scale: torch.Tensor  # [K·H]; a resumed checkpoint's replaces the data's
    loss_vocab: _LossVocab
    tapped: Callable[[list[Sample]], list[Sample]]  # the sequences with their taps (from the target when online)


def _prepare_data(cfg: TrainConfig, target: TargetModel, spec: DrafterSpec, shards: list[Path],
                  samples: list[Sample] | None) -> _TrainData:
    """The training data from ``samples`` or, without them, from ``shards``: sequences with a response of at least
    two tokens, split, summarised and tapped where they carry no taps (the held-out set once, here; the training
    sequences at each step through ``tapped``)."""
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
    loss_vocab = _loss_vocab(cfg, samples, target, data_summary)
    return _TrainData(train_set, held_out, steps, data_summary, tap_scale, loss_vocab, tapped)


def _resume(ckpt_path: Path, resume: bool, cfg: TrainConfig, drafter: DrafterModel, opt: torch.optim.Optimizer,
            data: _TrainData) -> tuple[int, dict]:
    """Load the checkpoint at ``ckpt_path`` into ``drafter`` and ``opt`` (fresh AdamW moments where it has no
    optimizer state) and its tap standardiser into ``data``; returns its step and training log. Without ``resume`` an
    existing checkpoint is an error: a new run would overwrite it."""
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
        data.tap_scale = ck["tap_scale"].to(cfg.device)
    log_doc["total_steps"] = data.steps
    log.info("resumed from %s at step %d", ckpt_path, start)
    return start, log_doc


def _initial_state(cfg: TrainConfig, target: TargetModel, spec: DrafterSpec,
                   data: _TrainData) -> dict[str, torch.Tensor]:
    """A new run's starting weights as ``cfg.init`` names them: random, initialised from the target (``target``) or
    an exported drafter's (a directory)."""
    init = random_drafter_state(spec, cfg.seed)
    if cfg.init == "target":
        init = init_from_target(init, target, spec, data.tap_scale, data.train_set[0].ids[:512].to(cfg.device))
    elif cfg.init != "random":
        init = warm_start_state(Path(cfg.init), spec, data.tap_scale)
        log.info("warm start from the drafter in %s", cfg.init)
    return init


@dataclass
class _Schedule:
    """The learning rate of a run that starts at step ``start``: ``lr_at`` of where ``scheduled_step`` puts each step
    at the moment it is asked (the clock counts from ``t0`` towards ``deadline``)."""

    start: int
    total: int
    t0: float
    deadline: float | None
    peak: float
    warmup: float

    def lr(self, step: int) -> float:
        at = scheduled_step(step, self.start, self.total, self.t0, self.deadline, time.monotonic())
        return lr_at(at, self.total, self.peak, self.warmup)


@dataclass
class _Run:
    """What the steps and checkpoints of one training run share: its configuration and work directory, the frozen
    target, the drafter being trained with its optimizer, the data and the training log being written."""

    cfg: TrainConfig
    work: Path
    target: TargetModel
    spec: DrafterSpec
    data: _TrainData
    drafter: DrafterModel
    opt: torch.optim.Optimizer
    log_doc: dict
    on_save: Callable[[int, list[Sample]], None] | None

    def step(self, step: int, schedule: _Schedule, autocast) -> tuple[torch.Tensor, float]:
        """One AdamW step on step ``step``'s batch (``step_indices``, anchors from a generator seeded by the seed and
        the step); returns its ``window_entry`` and its learning rate. Every ``TRIM_EVERY`` steps it also gives the
        C heap's free pages back (``release_free_memory``)."""
        cfg, data = self.cfg, self.data
        g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        picked = data.tapped([data.train_set[i]
                              for i in step_indices(step, cfg.samples_per_step, len(data.train_set), cfg.seed)])
        anchors = [sample_anchors(s.prompt_len, len(s.ids), cfg.anchors_per_sample, g) for s in picked]
        lr = schedule.lr(step)
        for group in self.opt.param_groups:
            group["lr"] = lr
        batch = collate(picked, anchors, cfg.device, tap_scale=data.tap_scale)
        with autocast:
            m = dflash_loss(self.drafter, self.target.embed, self.target.lm_head, batch, cfg.gamma,
                            data.loss_vocab.candidates(g), distill=cfg.distill, tv=cfg.tv)
        self.opt.zero_grad(set_to_none=True)
        m.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), 1.0)
        self.opt.step()
        del batch
        if TRIM_EVERY and (step + 1) % TRIM_EVERY == 0:
            release_free_memory()
        return window_entry(m, grad_norm), lr

    def record(self, done: int, window: list[torch.Tensor], lr: float, t_last: float, bar) -> float:
        """Append the log record of the window of steps that ends at step ``done`` (begun at ``t_last``, a
        ``time.perf_counter()`` instant) and show it on the progress bar; returns the instant the next window begins."""
        record = window_record(window, lr)
        now = time.perf_counter()
        record["seconds_per_step"] = round((now - t_last) / len(window), 3)
        record["resident_mb"] = resident_mb()
        self.log_doc["records"].append({"step": done, **record})
        bar.set_postfix(loss=f"{record['loss']:.3f}", tau=f"{record['expected_tau']:.2f}", refresh=False)
        log.info("step %d %s", done, {k: v for k, v in self.log_doc["records"][-1].items() if k != "accuracy"})
        return now

    def save(self, step: int) -> None:
        """Evaluate the held-out set into the log, checkpoint atomically (weights, optimizer, step, log, tap
        standardiser), export the drafter to ``cfg.out``, then call ``on_save``."""
        cfg, data, ckpt_path = self.cfg, self.data, self.work / CKPT
        ev = evaluate(self.drafter, self.target, data.held_out, cfg, data.tap_scale)
        self.log_doc["held_out"].append({"step": step, **ev})
        tmp = ckpt_path.with_suffix(".tmp")
        torch.save({"drafter": self.drafter.state_dict(), "optimizer": self.opt.state_dict(), "step": step,
                    "log": self.log_doc, "tap_scale": data.tap_scale.cpu()}, tmp)
        os.replace(tmp, ckpt_path)
        export(cfg, self.spec, self.target, self.drafter, self.log_doc, data.summary, self.work, data.tap_scale)
        log.info("step %d: checkpoint + export to %s; held-out %s", step, cfg.out, ev)
        if self.on_save is not None:
            self.on_save(step, data.train_set)


def _run_steps(run: _Run, start: int, deadline: float | None, progress) -> None:
    """Train from step ``start`` to the last, logging every ``log_every`` steps and checkpointing every
    ``ckpt_every``, at the last step and when the time box ends (which stops the run early). ``progress`` is the
    progress bar's class (tqdm, which ``train`` imports before it reads any data)."""
    cfg, steps = run.cfg, run.data.steps
    autocast = (torch.autocast(torch.device(cfg.device).type, dtype=torch.bfloat16) if cfg.autocast == "bf16"
                else contextlib.nullcontext())
    window: list = []
    t_last, t_box = time.perf_counter(), time.monotonic()
    schedule = _Schedule(start, steps, t_box, deadline, cfg.lr, cfg.warmup)
    bar = progress(range(start, steps), initial=start, total=steps, desc="train-drafter", mininterval=30)
    for step in bar:
        entry, lr = run.step(step, schedule, autocast)
        window.append(entry)
        done = step + 1
        if done % cfg.log_every == 0 or done == steps:
            t_last = run.record(done, window, lr, t_last, bar)
            window = []
        out_of_time = deadline is not None and time.monotonic() > deadline
        if done % cfg.ckpt_every == 0 or done == steps or out_of_time:
            run.drafter.eval()
            run.save(done)
            run.drafter.train()
        if out_of_time and done < steps:
            log.info("time box reached at step %d of %d: checkpointed; resume to continue", done, steps)
            break
    bar.close()


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

    data = _prepare_data(cfg, target, spec, shards, samples)
    drafter = DrafterModel(spec, device=cfg.device,
                           max_positions=target.spec.max_position_embeddings + SCRATCH_POSITIONS)
    opt = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    ckpt_path = work / CKPT
    log_doc = {"config": cfg.to_dict(), "data": data.summary, "total_steps": data.steps, "records": [],
               "held_out": []}
    start = 0
    if ckpt_path.is_file():
        start, log_doc = _resume(ckpt_path, resume, cfg, drafter, opt, data)
    else:
        drafter.load_state_dict(_initial_state(cfg, target, spec, data))
    drafter.train()
    log.info("training %d steps on %d sequences (%d held out): %s", data.steps, len(data.train_set),
             len(data.held_out), data.summary)
    run = _Run(cfg, work, target, spec, data, drafter, opt, log_doc, on_save)
    _run_steps(run, start, deadline, tqdm)
    if start >= data.steps and not (Path(cfg.out) / "model.safetensors").is_file():
        run.save(data.steps)
    return drafter.eval()
