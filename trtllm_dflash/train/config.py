"""``TrainConfig``: every setting of a drafter training run, resolved and validated once at the edge."""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

from trtllm_dflash.errors import require


def default_gamma(block_size: int) -> float:
    """Loss-decay γ: 7 for B = 16 and 4 for B = 8 (dflash.md §3, ModelOpt's paper recommendation), else B / 2."""
    return {16: 7.0, 8: 4.0}.get(block_size, block_size / 2)


@dataclass(frozen=True, slots=True)
class TrainConfig:
    target: str
    out: str
    work_dir: str
    num_layers: int
    block_size: int
    target_layer_ids: tuple[int, ...] | None  # None = the default tap rule
    intermediate_size: int | None
    mask_token_id: int
    data: str  # "mined" | path to a JSONL of prompts
    num_code_prompts: int
    num_chat_prompts: int
    max_new_tokens: int
    max_prompt_len: int
    gen_batch_size: int
    max_shards: int | None  # None = regenerate every prompt
    steps: int | None
    epochs: float | None
    samples_per_step: int
    anchors_per_sample: int
    lr: float
    warmup: float
    weight_decay: float
    gamma: float
    loss_vocab: str  # "full" | "data" (softmax over the tokens present in the training sequences + negatives)
    loss_negatives: int  # with loss_vocab "data": random absent tokens added to the softmax each step
    init: str  # "target" (layers copied from the target, train/init.py) | "random" | an exported drafter directory
    seed: int
    device: str
    threads: int
    log_every: int
    ckpt_every: int
    distill: float = 0.0  # self-distillation weight (objective.dflash_loss)
    tv: float = 0.0  # total-variation weight against the target's top-k distribution (objective.dflash_loss)
    autocast: str = "none"  # "none" | "bf16": the objective under torch.autocast (weights and optimizer stay fp32)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrainConfig":
        from trtllm_dflash.assets import MASK_TOKEN_ID

        fields = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in fields}
        values["work_dir"] = args.work_dir or str(Path("artifacts") / "train" / Path(args.out).name)
        values["mask_token_id"] = MASK_TOKEN_ID if args.mask_token_id is None else args.mask_token_id
        values["gamma"] = args.gamma or default_gamma(args.block_size)
        values["target_layer_ids"] = tuple(args.target_layer_ids) if args.target_layer_ids else None
        if args.steps is None and args.epochs is None:
            values["steps"] = 1000
        cfg = cls(**values)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        require(self.num_layers >= 1, "num_layers", self.num_layers, "must be >= 1")
        require(self.block_size >= 2, "block_size", self.block_size, "must be >= 2 (a bonus slot and one draft)")
        for name in ("num_code_prompts", "num_chat_prompts"):
            require(getattr(self, name) >= 0, name, getattr(self, name), "must be >= 0")
        for name in ("max_new_tokens", "max_prompt_len", "gen_batch_size", "samples_per_step", "anchors_per_sample",
                     "threads", "log_every", "ckpt_every"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "must be >= 1")
        require(self.max_shards is None or self.max_shards >= 1, "max_shards", self.max_shards, "must be >= 1")
        require(self.steps is None or self.steps >= 0, "steps", self.steps, "must be >= 0")
        require(self.epochs is None or self.epochs > 0, "epochs", self.epochs, "must be > 0")
        require(self.lr > 0, "lr", self.lr, "must be > 0")
        require(0 <= self.warmup < 1, "warmup", self.warmup, "must be in [0, 1)")
        require(self.gamma > 0 and math.isfinite(self.gamma), "gamma", self.gamma, "must be a positive number")
        require(self.loss_vocab in ("full", "data"), "loss_vocab", self.loss_vocab, "must be 'full' or 'data'")
        require(self.init in ("target", "random") or (Path(self.init) / "model.safetensors").is_file(), "init",
                self.init, "must be 'target', 'random' or a drafter directory holding model.safetensors",
                "pass --init target, or the directory of an exported drafter to continue training it")
        require(0.0 <= self.distill <= 1.0, "distill", self.distill, "must be in [0, 1]")
        require(self.distill == 0 or self.loss_vocab == "full", "distill", self.distill,
                "needs the full-vocabulary loss", "pass --loss-vocab full or --distill 0")
        require(0.0 <= self.tv <= 1.0 - self.distill, "tv", self.tv,
                f"must be in [0, 1 - distill = {1.0 - self.distill:g}] (the hard-label CE keeps 1 - distill - tv)",
                "lower --tv or --distill")
        require(self.tv == 0 or self.loss_vocab == "full", "tv", self.tv,
                "needs the full-vocabulary loss", "pass --loss-vocab full or --tv 0")
        require(self.autocast in ("none", "bf16"), "autocast", self.autocast, "must be 'none' or 'bf16'")
        require(self.loss_negatives >= 0, "loss_negatives", self.loss_negatives, "must be >= 0")
        require(self.mask_token_id >= 0, "mask_token_id", self.mask_token_id, "must be >= 0")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids) if self.target_layer_ids else None
        return d
