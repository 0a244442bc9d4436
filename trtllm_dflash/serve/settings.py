"""The settings of a rendered Triton model, typed: what ``make-repo`` writes into each model's ``config.pbtxt``
``parameters`` and what every python-backend model reads back.

Triton hands a model its parameters as strings (``{key: {"string_value": ...}}``); ``ModelSettings.from_parameters``
turns them into typed fields once, at the model's ``initialize``, and is the one place that knows their spellings,
defaults and limits. A key the schema does not know is refused by name (a template and its reader out of step), and
so is a value of the wrong shape, naming the key, the value and what it must be. ``serve.triton.render`` checks every
model it renders through the same parser, so a repository that renders also loads.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Mapping

from trtllm_dflash.errors import ConfigError

ON_OFF = ("on", "off")
TRUE = ("true", "1", "t", "y", "yes")  # the boolean spellings TensorRT-LLM's models accept; another value: the
FALSE = ("false", "0", "f", "n", "no")  # setting's default


@dataclass(frozen=True, slots=True)
class ModelSettings:
    """Every parameter any rendered model carries (each model sets its own subset; the others keep these defaults)."""

    model_name: str = ""
    # the step models (target_verify, kv_inject, drafter)
    backend: str = "torch"  # torch (runtime/steps.py) or trtllm-engine (serve/trtllm/engine.py)
    target_dir: str = ""
    drafter_dir: str = ""
    engine_dir: str = ""
    tap_layers: tuple[int, ...] = ()
    max_sequences: int = 0
    max_seq_len: int = 0
    max_block_size: int = 0  # target_verify: the widest verify block
    max_tree_nodes: int = 0  # target_verify: the widest tree verify (0: none)
    idle_timeout_s: float = 120.0
    torch_threads: int = 0  # 0: by load (handlers.CpuThreads)
    max_batch_size: int = 64
    cuda_graphs: str = "auto"  # auto (on with CUDA) | off | on | rehearse (runtime.graphs)
    draft_vocab: str = ""  # drafter: a reduced draft vocabulary file (models.draft_vocab; "" = the drafter's own)
    # the loop models (dflash_bls, baseline_bls, the entry points, tensorrt_llm)
    block_size: int | str = 16  # a fixed block (1: autoregressive) or "auto" (step models: the block they serve)
    adaptive: str = ""  # block_size auto: the policy file make-repo calibrated (render.ADAPTIVE_FILE)
    ngram: bool = False
    tree: bool = False
    datastore: str = ""
    coalesce: bool = True
    step_max_batch_size: int = 64
    max_queue: int = 64
    queue_timeout_s: float = 300.0
    target_verify_model: str = "target_verify"
    kv_inject_model: str = "kv_inject"
    drafter_model: str = "drafter"
    frontend: str = "off"  # off | on (text in, text out) | tokens (TensorRT-LLM's token-level tensorrt_llm)
    metrics: bool = True
    io_nice: int = 0
    # the tokenizer models and the front ends
    tokenizer_dir: str = ""
    add_special_tokens: bool = True
    skip_special_tokens: bool = True
    exclude_input_in_output: bool = False
    decoupled: bool = True
    # the LLM-API bridge (backend trtllm-pytorch)
    llm_model: str = ""
    max_draft_len: int = 0

    @classmethod
    def from_parameters(cls, params: Mapping[str, str]) -> "ModelSettings":
        """The typed settings of a model's ``{key: string}`` parameters (``from_args`` reads them from Triton's
        ``args``); an unknown key or a malformed value raises ``ConfigError`` naming it."""
        types = {f.name: f for f in dataclasses.fields(cls)}
        values = {}
        for key, raw in params.items():
            f = types.get(key)
            if f is None:
                raise ConfigError(f"model parameter {key!r}", raw, "is not a setting any model reads",
                                  f"render the repository again with this version (settings: {', '.join(types)})")
            values[key] = _parse(key, raw, f.default)
        settings = cls(**values)
        settings.validate()
        return settings

    @classmethod
    def from_args(cls, args: Mapping[str, str]) -> "ModelSettings":
        """The settings in the ``args`` Triton passes to a python model's ``initialize``."""
        cfg = json.loads(args["model_config"])
        return cls.from_parameters({k: v["string_value"] for k, v in cfg.get("parameters", {}).items()})

    @classmethod
    def of(cls, params: "ModelSettings | Mapping[str, str]") -> "ModelSettings":
        """``params`` as settings: typed already, or parsed from a ``{key: string}`` mapping (tests, tools)."""
        return params if isinstance(params, cls) else cls.from_parameters(params)

    def validate(self) -> None:
        choices = {"backend": ("torch", "trtllm-engine"), "cuda_graphs": ("off", "on", "rehearse", "auto"),
                   "frontend": ("off", "on", "tokens")}
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"model parameter {key!r}", getattr(self, key), f"must be one of {', '.join(allowed)}",
                                  "render the repository with `trtllm-dflash make-repo`")
        if self.block_size != "auto" and self.block_size < 1:
            raise ConfigError("model parameter 'block_size'", self.block_size, "must be 'auto' or an integer >= 1")
        for key in ("max_sequences", "max_seq_len", "max_block_size", "max_tree_nodes", "torch_threads", "max_queue",
                    "max_draft_len", "io_nice"):
            if getattr(self, key) < 0:
                raise ConfigError(f"model parameter {key!r}", getattr(self, key), "must be >= 0")
        for key in ("max_batch_size", "step_max_batch_size"):
            if getattr(self, key) < 1:
                raise ConfigError(f"model parameter {key!r}", getattr(self, key), "must be >= 1")
        for key in ("idle_timeout_s", "queue_timeout_s"):
            if getattr(self, key) <= 0:
                raise ConfigError(f"model parameter {key!r}", getattr(self, key), "must be > 0")

    @property
    def engine_backend(self) -> bool:
        """The step models run TensorRT-LLM 1.2.1 engines (``backend: trtllm-engine``) instead of torch."""
        return self.backend == "trtllm-engine"

    @property
    def adaptive_block(self) -> bool:
        return self.block_size == "auto"


def _parse(key: str, raw: str, default):
    """One parameter's string as the type of its default, with the spellings the templates and TensorRT-LLM use."""
    text = str(raw).strip()

    def bad(what: str) -> ConfigError:
        return ConfigError(f"model parameter {key!r}", raw, f"must be {what}",
                           "render the repository with `trtllm-dflash make-repo`")

    if key == "block_size":
        if text == "auto":
            return text
        if not text.lstrip("-").isdigit():
            raise bad("'auto' or an integer")
        return int(text)
    if key == "tap_layers":
        parts = [p for p in text.split(",") if p.strip()]
        if not all(p.strip().isdigit() for p in parts):
            raise bad("comma-separated layer indices, e.g. 1,9,17")
        return tuple(int(p) for p in parts)
    if isinstance(default, bool):
        if key in ("ngram", "tree", "coalesce", "metrics"):  # our own on/off switches
            if text not in ON_OFF:
                raise bad("on or off")
            return text == "on"
        lower = text.lower()  # TensorRT-LLM's boolean spellings; empty: the default
        return default if lower not in (*TRUE, *FALSE) else lower in TRUE
    if isinstance(default, int):
        if text == "":
            return default
        if not text.lstrip("-").isdigit():
            raise bad("an integer")
        return int(text)
    if isinstance(default, float):
        try:
            return float(text) if text else default
        except ValueError:
            raise bad("a number") from None
    return text
