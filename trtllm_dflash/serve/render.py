"""Rendering ``triton_model_repo/`` into a runnable model repository, strictly.

Each rendered model has an explicit set of keys (``MODELS``); its template must use exactly those placeholders:
a placeholder without a value or a value without a placeholder is an error, and no ``${`` may survive (the silent
defaults of tensorrtllm_backend's fill_template.py are exactly what this prevents).
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from trtllm_dflash.errors import ArtifactError, require

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATES = Path(__file__).resolve().parents[2] / "triton_model_repo"
BACKENDS = ("torch", "trtllm-engine", "trtllm-pytorch")

# rendered model -> (template directory, keys it must be given)
MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "preprocessing": ("preprocessing", ("max_batch_size", "target_dir", "max_seq_len", "instances")),
    "postprocessing": ("postprocessing", ("max_batch_size", "target_dir", "instances")),
    "target_verify": ("target_verify", ("max_batch_size", "queue_delay_us", "target_dir", "tap_layers",
                                        "max_sequences", "max_seq_len", "block_size", "idle_timeout_s",
                                        "torch_threads")),
    "kv_inject": ("kv_inject", ("max_batch_size", "target_dir", "drafter_dir", "torch_threads", "instances")),
    "drafter": ("drafter", ("max_batch_size", "queue_delay_us", "target_dir", "drafter_dir", "max_sequences",
                            "max_seq_len", "idle_timeout_s", "torch_threads")),
    "dflash_bls": ("dflash_bls", ("name", "max_batch_size", "block_size", "instances")),
    "baseline_bls": ("dflash_bls", ("name", "max_batch_size", "block_size", "instances")),
    "dflash": ("ensemble", ("name", "max_batch_size", "bls_model")),
    "baseline": ("ensemble", ("name", "max_batch_size", "bls_model")),
}


def render_text(template: str, values: dict[str, object], source: str) -> str:
    """Substitute ``${key}`` strictly: every placeholder filled, every given key used, nothing left over."""
    used = set(PLACEHOLDER.findall(template))
    missing, unused = sorted(used - set(values)), sorted(set(values) - used)
    require(not missing, f"{source} placeholders", missing, "have no value", "pass them to the renderer")
    require(not unused, f"{source} values", unused, "are not used by the template", "remove them or fix the template")
    out = PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)
    require("${" not in out and "$" not in PLACEHOLDER.sub("", template), f"{source}", "$",
            "contains a malformed placeholder", "write placeholders as ${name}")
    return out


@dataclass(frozen=True, slots=True)
class RepoConfig:
    target_dir: str
    drafter_dir: str
    backend: str = "torch"
    block_size: int = 16  # tokens per draft block (≤ the drafter's trained block size)
    max_batch_size: int = 64  # requests per dynamically batched step execution
    instances: int = 1  # instances of the stateless models and of each BLS loop model
    max_seq_len: int = 2048  # tokens per sequence (prompt + generated)
    max_sequences: int = 32  # live sequences (KV-cache rows) per step model
    queue_delay_us: int = 200  # dynamic batcher wait for more requests
    idle_timeout_s: float = 120.0  # a sequence's state is freed after this long unused
    torch_threads: int = 0  # torch threads per step model process (0 = torch's default)

    def validate(self) -> "tuple":
        from trtllm_dflash.specs import DrafterSpec, TargetSpec, check_pair

        require(self.backend in BACKENDS, "--backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        require(self.backend == "torch", "--backend", self.backend,
                "is not available in this build yet (TensorRT-LLM backends need NVIDIA's containers)", "use torch")
        target, drafter = TargetSpec.load(self.target_dir), DrafterSpec.load(self.drafter_dir)
        check_pair(target, drafter)
        require(2 <= self.block_size <= drafter.block_size, "--block-size", self.block_size,
                f"must be in [2, {drafter.block_size}] (the drafter's trained block size)")
        for name in ("max_batch_size", "instances", "max_sequences"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')}", getattr(self, name), "must be >= 1")
        require(16 <= self.max_seq_len <= target.max_position_embeddings, "--max-seq-len", self.max_seq_len,
                f"must be in [16, {target.max_position_embeddings}] (the target's context limit)")
        require(self.queue_delay_us >= 0, "--queue-delay-us", self.queue_delay_us, "must be >= 0")
        require(self.idle_timeout_s > 0, "--idle-timeout-s", self.idle_timeout_s, "must be > 0")
        return target, drafter

    def values(self, tap_layers: tuple[int, ...]) -> dict[str, dict[str, object]]:
        common = {
            "max_batch_size": self.max_batch_size, "instances": self.instances,
            "target_dir": str(Path(self.target_dir).resolve()), "drafter_dir": str(Path(self.drafter_dir).resolve()),
            "max_seq_len": self.max_seq_len, "max_sequences": self.max_sequences, "block_size": self.block_size,
            "queue_delay_us": self.queue_delay_us, "idle_timeout_s": self.idle_timeout_s,
            "torch_threads": self.torch_threads, "tap_layers": ",".join(map(str, tap_layers)),
        }
        per_model = {
            "dflash_bls": {"name": "dflash_bls"},
            "baseline_bls": {"name": "baseline_bls", "block_size": 1},
            "dflash": {"name": "dflash", "bls_model": "dflash_bls"},
            "baseline": {"name": "baseline", "bls_model": "baseline_bls"},
        }
        return {m: {k: {**common, **per_model.get(m, {})}[k] for k in keys} for m, (_, keys) in MODELS.items()}


def make_repo(cfg: RepoConfig, out: str | Path, force: bool = False, templates: Path = TEMPLATES) -> Path:
    """Render every model of ``MODELS`` into ``out`` (atomically: a temporary sibling renamed at the end)."""
    from trtllm_dflash.staging import refuse_existing, staged_output

    out = Path(out)
    refuse_existing(out, force)
    _, drafter = cfg.validate()
    values = cfg.values(drafter.target_layer_ids)
    with staged_output(out, force) as tmp:
        for model, (template, _) in MODELS.items():
            src = templates / template
            if not (src / "config.pbtxt").is_file():
                raise ArtifactError(src / "config.pbtxt", "template missing", "restore triton_model_repo/")
            text = render_text((src / "config.pbtxt").read_text(), values[model], f"{template}/config.pbtxt")
            (tmp / model / "1").mkdir(parents=True)
            (tmp / model / "config.pbtxt").write_text(text)
            if (src / "1" / "model.py").is_file():
                shutil.copy2(src / "1" / "model.py", tmp / model / "1" / "model.py")
        manifest = {"repo_config": asdict(cfg), "models": sorted(MODELS), "tap_layers": list(drafter.target_layer_ids)}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out
