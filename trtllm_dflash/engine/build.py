"""``build``: a ``convert`` / ``quantize`` output -> the three TensorRT engines of ``contract.ENGINES``, by running
TensorRT-LLM 1.2.1's ``trtllm-build`` once per engine with our model classes (``--model_cls_file``).

    DIR/target  --trtllm-build (DFlash{Llama,Qwen3}WithTaps, draft_tokens_external, paged KV)-->  OUT/target
    DIR/drafter --trtllm-build (DFlashKVInjectForTRTLLM, no KV cache)------------------------->  OUT/kv_inject
    DIR/drafter --trtllm-build (DFlashDrafterForTRTLLM, no KV cache)-------------------------->  OUT/drafter
    OUT/build_manifest.json: the exact commands, tool versions, checkpoint hashes, resolved limits

The quantization comes from the target's ``config.json`` (``quantization.quant_algo`` / ``kv_cache_quant_algo``), never
from a flag. Every choice is checked before anything runs: the GPU / quantization pair against ``SUPPORT`` (facts in
``tests/data/trtllm_1_2_1/build_flags.json``: NVFP4 GEMMs need SM100), and the limits against the checkpoint and the
block size. Only ``config.json`` files are read to plan, so ``--dry-run`` works on a config-only checkpoint.

Flags (trtllm_triton.md §2, §2.3, §8; each one is in build_flags.json, which the tests enforce):
- target: ``--speculative_decoding_mode draft_tokens_external --max_draft_len B-1`` (the target verifies B tokens per
  step: the bonus token plus B-1 drafts), ``--kv_cache_type paged --use_paged_context_fmha enable`` (KV reuse, needed by
  external draft tokens), ``--gpt_attention_plugin auto``; GEMMs: ``--gemm_plugin auto`` (BF16/FP16 and FP8, the FP8
  recipe of examples/models/core/qwen/README.md) or ``nvfp4``; ``--use_fp8_context_fmha enable`` exactly when the KV
  cache is FP8 (TRT-LLM turns it off otherwise, with a warning).
- kv_inject / drafter: ``--kv_cache_type disabled`` (the context cache lives in the Triton model, contract.py),
  ``--gemm_plugin auto``, ``--use_fp8_context_fmha disable`` (unquantized).
"""

from __future__ import annotations

import enum
import json
import logging
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from trtllm_dflash import staging
from trtllm_dflash.engine import contract, layout
from trtllm_dflash.errors import ArtifactError, ConfigError, require

log = logging.getLogger(__name__)

TRTLLM_BUILD = "trtllm-build"
CONTAINER = "nvcr.io/nvidia/tritonserver:26.07-trtllm-python-py3"  # TensorRT-LLM 1.2.1 (trtllm_triton.md §7.1)
MANIFEST = "build_manifest.json"
FORMAT = "trtllm_dflash.engines/1"
MODELS_DIR = Path(__file__).resolve().parent / "models"
MODEL_FILES = {"target": MODELS_DIR / "target_taps.py", "kv_inject": MODELS_DIR / "drafter.py",
               "drafter": MODELS_DIR / "drafter.py"}
DEFAULT_MAX_SEQ_LEN = 4096  # tokens; capped by the target's max_position_embeddings
DEFAULT_MAX_NUM_TOKENS = 8192  # tokens per engine call (TRT-LLM's BuildConfig default)


class Gpu(enum.Enum):
    HOPPER = "hopper"  # SM90: H100, H200
    BLACKWELL = "blackwell"  # SM100: B200, GB200


@dataclass(frozen=True, slots=True)
class Support:
    sm: int
    quant_algos: dict[str | None, str | None]  # quant_algo -> None if supported, else why not
    kv_cache_quant_algos: tuple[str | None, ...]


_NVFP4_WHY = "NVFP4 GEMMs need SM100+ (Blackwell): TensorRT-LLM's FP4 GEMM plugin refuses older GPUs"
SUPPORT = {
    Gpu.HOPPER: Support(90, {None: None, "FP8": None, "NVFP4": _NVFP4_WHY}, (None, "FP8")),
    Gpu.BLACKWELL: Support(100, {None: None, "FP8": None, "NVFP4": None}, (None, "FP8")),
}


@dataclass(frozen=True, slots=True)
class BuildConfig:
    ckpt_dir: Path  # a `convert` / `quantize` output: target/, drafter/, manifest.json
    out_dir: Path
    gpu: Gpu
    max_batch_size: int = 8  # sequences per engine call
    max_seq_len: int | None = None  # tokens per sequence, prompt + output; None: min(4096, max_position_embeddings)
    max_input_len: int | None = None  # prompt tokens; None: max_seq_len
    max_num_tokens: int | None = None  # tokens per call; None: max(8192, max_batch_size * block_size)
    force: bool = False


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What the plan reads from the checkpoint directory (config.json files and the manifest, no weights)."""

    root: Path
    target: dict[str, Any]
    drafter: dict[str, Any]
    manifest: dict[str, Any]

    @property
    def block_size(self) -> int:
        return int(self.drafter["dflash"]["block_size"])

    @property
    def quant_algo(self) -> str | None:
        return (self.target.get("quantization") or {}).get("quant_algo")

    @property
    def kv_cache_quant_algo(self) -> str | None:
        return (self.target.get("quantization") or {}).get("kv_cache_quant_algo")


@dataclass(frozen=True, slots=True)
class Limits:
    max_batch_size: int
    max_seq_len: int
    max_input_len: int
    max_num_tokens: int


@dataclass(frozen=True, slots=True)
class BuildPlan:
    cfg: BuildConfig
    ckpt: Checkpoint
    limits: Limits
    commands: dict[str, list[str]]  # engine -> argv, with --output_dir under cfg.out_dir


@dataclass(frozen=True, slots=True)
class EngineArtifact:
    root: Path
    engine_dirs: dict[str, Path]
    manifest_path: Path


class EngineBuildFailed(RuntimeError):
    """``trtllm-build`` exited non-zero (exit code 1 at the CLI: not an input problem we could have caught)."""


# ----------------------------------------------------------------------------------------------------------------------
# Reading and checking


def read_checkpoint(root: Path) -> Checkpoint:
    root = Path(root)
    for name in (layout.TARGET_DIR, layout.DRAFTER_DIR):
        if not (root / name / "config.json").is_file():
            raise ArtifactError(root, f"has no {name}/config.json",
                                "pass a directory written by `trtllm-dflash convert` or `quantize` as --ckpt")
    target = layout.read_json(root / layout.TARGET_DIR / "config.json")
    drafter = layout.read_json(root / layout.DRAFTER_DIR / "config.json")
    manifest_path = root / layout.MANIFEST
    manifest = layout.read_json(manifest_path) if manifest_path.is_file() else {}
    arch = target.get("architecture")
    require(arch in contract.TARGET_CLASS, "target.architecture", arch, f"must be one of {sorted(contract.TARGET_CLASS)}",
            "convert a Llama or Qwen3 target with `trtllm-dflash convert`")
    require(drafter.get("architecture") == contract.DRAFTER_CLASS, "drafter.architecture", drafter.get("architecture"),
            f"must be {contract.DRAFTER_CLASS}", "convert the drafter with `trtllm-dflash convert`")
    if not isinstance(drafter.get("dflash"), dict) or "block_size" not in drafter["dflash"]:
        raise ArtifactError(root / layout.DRAFTER_DIR / "config.json", "has no dflash.block_size",
                            "re-run `trtllm-dflash convert`")
    return Checkpoint(root, target, drafter, manifest)


def _rotary_factor(cfg: dict[str, Any]) -> float:
    """TensorRT-LLM's rule (builder.py ``_init_max_seq_len``): the scaling factor, except 1 for su/longrope/llama3."""
    scaling = cfg.get("rotary_scaling") or {}
    kind = scaling.get("type", scaling.get("rope_type"))
    return 1.0 if not scaling or kind in ("su", "longrope", "llama3") else float(scaling.get("factor", 1.0))


def check_support(gpu: Gpu, ckpt: Checkpoint) -> None:
    sup = SUPPORT[gpu]
    algo, kv = ckpt.quant_algo, ckpt.kv_cache_quant_algo
    fixes = {"NVFP4": "quantize with --format fp8 for Hopper, or build for --gpu blackwell"}
    require(algo in sup.quant_algos, "target.quantization.quant_algo", algo,
            f"is not one this toolkit builds (supported: {sorted(str(a) for a in sup.quant_algos)})",
            "quantize with `trtllm-dflash quantize --format fp8|nvfp4`")
    why = sup.quant_algos[algo]
    if why is not None:
        raise ConfigError("target.quantization.quant_algo", algo, f"{why}; --gpu {gpu.value} is SM{sup.sm}",
                          fixes.get(algo, "choose another --gpu"))
    require(kv in sup.kv_cache_quant_algos, "target.quantization.kv_cache_quant_algo", kv,
            f"must be one of {[str(k) for k in sup.kv_cache_quant_algos]} on --gpu {gpu.value}",
            "quantize with --kv-cache fp8 or without --kv-cache")
    dq = (ckpt.drafter.get("quantization") or {}).get("quant_algo")
    require(dq is None, "drafter.quantization.quant_algo", dq, "the drafter engines are built unquantized",
            "use the drafter that `convert` / `quantize` wrote")


def resolve_limits(cfg: BuildConfig, ckpt: Checkpoint) -> Limits:
    t, d = ckpt.target, ckpt.drafter
    b = ckpt.block_size
    positions = int(t["max_position_embeddings"] * _rotary_factor(t))
    tp = (t.get("mapping") or {}).get("tp_size", 1)
    require(tp == 1, "target.mapping.tp_size", tp, "engine builds support single-GPU checkpoints only (the kv_inject "
            "and drafter engines are single-GPU)", "convert with --tp 1")
    require(b >= 2, "drafter.dflash.block_size", b, "must be >= 2 (one bonus token plus at least one draft)",
            "use a DFlash drafter trained with block_size >= 2")
    taps = d["dflash"].get("target_layer_ids", [])
    bad = [i for i in taps if not 0 <= i < t["num_hidden_layers"]]
    require(not bad, "drafter.dflash.target_layer_ids", taps,
            f"must be in [0, {t['num_hidden_layers']}) (the target's decoder layers)",
            "check that the drafter was trained for this target")
    require(d["hidden_size"] == t["hidden_size"], "drafter.hidden_size", d["hidden_size"],
            f"must equal the target's hidden_size ({t['hidden_size']})", "pair the drafter with its own target")

    require(cfg.max_batch_size >= 1, "max_batch_size", cfg.max_batch_size, "must be >= 1")
    max_seq_len = cfg.max_seq_len if cfg.max_seq_len is not None else min(DEFAULT_MAX_SEQ_LEN, positions)
    require(max_seq_len >= b, "max_seq_len", max_seq_len, f"must be >= block_size ({b})")
    require(max_seq_len <= positions, "max_seq_len", max_seq_len,
            f"must be <= the target's max_position_embeddings x rotary factor ({positions})",
            f"pass --max-seq-len {positions} or less")
    max_input_len = cfg.max_input_len if cfg.max_input_len is not None else max_seq_len
    require(1 <= max_input_len <= max_seq_len, "max_input_len", max_input_len,
            f"must be in [1, max_seq_len={max_seq_len}]", "lower --max-input-len or raise --max-seq-len")
    floor = cfg.max_batch_size * b  # one verification step of every sequence: B tokens each
    max_num_tokens = cfg.max_num_tokens if cfg.max_num_tokens is not None else max(DEFAULT_MAX_NUM_TOKENS, floor)
    require(max_num_tokens >= floor, "max_num_tokens", max_num_tokens,
            f"must be >= max_batch_size x block_size ({cfg.max_batch_size} x {b} = {floor}): a verification step "
            "of every sequence carries block_size tokens each", f"pass --max-num-tokens {floor} or more")
    return Limits(cfg.max_batch_size, max_seq_len, max_input_len, max_num_tokens)


# ----------------------------------------------------------------------------------------------------------------------
# Commands


def _common(ckpt_dir: Path, out_dir: Path, engine: str, model_cls: str, limits: Limits) -> list[str]:
    return [TRTLLM_BUILD,
            "--checkpoint_dir", str(ckpt_dir),
            "--output_dir", str(out_dir / engine),
            "--model_cls_file", str(MODEL_FILES[engine]),
            "--model_cls_name", model_cls,
            "--max_batch_size", str(limits.max_batch_size),
            "--max_seq_len", str(limits.max_seq_len),
            "--max_num_tokens", str(limits.max_num_tokens)]


def target_command(ckpt: Checkpoint, out_dir: Path, limits: Limits) -> list[str]:
    algo, kv = ckpt.quant_algo, ckpt.kv_cache_quant_algo
    cmd = _common(ckpt.root.resolve() / layout.TARGET_DIR, out_dir, "target",
                  contract.TARGET_CLASS[ckpt.target["architecture"]], limits)
    cmd += ["--max_input_len", str(limits.max_input_len),
            "--kv_cache_type", "paged",
            "--gpt_attention_plugin", "auto",
            "--use_paged_context_fmha", "enable",
            "--speculative_decoding_mode", "draft_tokens_external",
            "--max_draft_len", str(ckpt.block_size - 1),
            "--gemm_plugin", "nvfp4" if algo == "NVFP4" else "auto",
            "--use_fp8_context_fmha", "enable" if kv == "FP8" else "disable"]
    return cmd


def drafter_command(ckpt: Checkpoint, out_dir: Path, limits: Limits, engine: str) -> list[str]:
    cls = {"kv_inject": contract.KV_INJECT_CLASS, "drafter": contract.DRAFTER_CLASS}[engine]
    cmd = _common(ckpt.root.resolve() / layout.DRAFTER_DIR, out_dir, engine, cls, limits)
    cmd += ["--kv_cache_type", "disabled", "--gemm_plugin", "auto", "--use_fp8_context_fmha", "disable"]
    return cmd


def plan_build(cfg: BuildConfig) -> BuildPlan:
    """Validate everything and produce the commands; reads config.json files only."""
    ckpt = read_checkpoint(cfg.ckpt_dir)
    check_support(cfg.gpu, ckpt)
    limits = resolve_limits(cfg, ckpt)
    out = cfg.out_dir.resolve()
    commands = {"target": target_command(ckpt, out, limits),
                "kv_inject": drafter_command(ckpt, out, limits, "kv_inject"),
                "drafter": drafter_command(ckpt, out, limits, "drafter")}
    assert tuple(commands) == contract.ENGINES
    return BuildPlan(cfg, ckpt, limits, commands)


def shell_lines(plan: BuildPlan) -> list[str]:
    """One shell-quoted command per engine, in contract.ENGINES order (what --dry-run prints)."""
    return [shlex.join(plan.commands[e]) for e in contract.ENGINES]


# ----------------------------------------------------------------------------------------------------------------------
# Running


def _require_trtllm_build() -> str:
    exe = shutil.which(TRTLLM_BUILD)
    if exe is None:
        raise ConfigError(TRTLLM_BUILD, "not on PATH",
                          f"it exists only inside NVIDIA's {CONTAINER} container (TensorRT-LLM 1.2.1)",
                          "run this command in that container (see docker/), or pass --dry-run to print the commands")
    return exe


def _versions() -> dict[str, str | None]:
    from trtllm_dflash.convert import manifest as mf

    out = mf.tool_versions()
    for dist in ("tensorrt_llm", "tensorrt"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def _restage(cmd: list[str], final: Path, staged: Path) -> list[str]:
    i = cmd.index("--output_dir")
    return cmd[:i + 1] + [str(staged / Path(cmd[i + 1]).relative_to(final))] + cmd[i + 2:]


def run_build(plan: BuildPlan) -> EngineArtifact:
    """Run the three builds into a staging directory next to OUT, write the manifest, rename into place."""
    from trtllm_dflash.convert import manifest as mf  # imports torch (via trtllm_dflash.convert): only when running

    exe = _require_trtllm_build()
    cfg, ckpt = plan.cfg, plan.ckpt
    for name in (layout.TARGET_DIR, layout.DRAFTER_DIR):
        if not (ckpt.root / name / "rank0.safetensors").is_file():
            raise ArtifactError(ckpt.root / name, "has no rank0.safetensors", "build from a complete convert output")
    out = cfg.out_dir.resolve()
    t0 = time.perf_counter()
    with staging.staged_output(out, cfg.force) as tmp:
        seconds = {}
        for engine in contract.ENGINES:
            argv = [exe] + _restage(plan.commands[engine], out, tmp)[1:]
            log.info("building %s: %s", engine, shlex.join(argv))
            t = time.perf_counter()
            done = subprocess.run(argv, check=False)
            if done.returncode != 0:
                raise EngineBuildFailed(f"{TRTLLM_BUILD} failed for the {engine} engine (exit {done.returncode}); "
                                        f"its log is above; command: {shlex.join(argv)}")
            seconds[engine] = round(time.perf_counter() - t, 1)
        mf_path = tmp / MANIFEST
        ckpt_manifest = ckpt.root / layout.MANIFEST
        mf_path.write_text(json.dumps({
            "format": FORMAT,
            "config": mf.jsonable(cfg),
            "limits": mf.jsonable(plan.limits),
            "quantization": {"quant_algo": ckpt.quant_algo, "kv_cache_quant_algo": ckpt.kv_cache_quant_algo},
            "block_size": ckpt.block_size,
            "target_layer_ids": ckpt.drafter["dflash"].get("target_layer_ids"),
            "commands": {e: plan.commands[e] for e in contract.ENGINES},
            "build_seconds": seconds,
            "checkpoint": {"dir": str(ckpt.root.resolve()),
                           "manifest_sha256": mf.sha256_file(ckpt_manifest) if ckpt_manifest.is_file() else None,
                           "outputs": ckpt.manifest.get("outputs")},
            "tools": _versions(),
            "git": mf.git_state(),
            "created_unix_s": round(time.time()),
        }, indent=2) + "\n")
    log.info("built %s in %.0f s", out, time.perf_counter() - t0)
    return EngineArtifact(out, {e: out / e for e in contract.ENGINES}, out / MANIFEST)


def build(cfg: BuildConfig, dry_run: bool = False) -> BuildPlan | EngineArtifact:
    plan = plan_build(cfg)
    if not dry_run:
        staging.refuse_existing(cfg.out_dir, cfg.force)
        return run_build(plan)
    return plan
