"""Rendering ``triton_model_repo/`` into a runnable model repository, strictly.

Each rendered model has an explicit set of keys (``MODELS``, or ``LLMAPI_MODELS`` for ``--backend trtllm-pytorch``);
its template must use exactly those placeholders:
a placeholder without a value or a value without a placeholder is an error, and no ``${`` may survive (the silent
defaults of tensorrtllm_backend's fill_template.py are exactly what this prevents).
"""

from __future__ import annotations

import json
import re
import shutil
from importlib import resources
from dataclasses import asdict, dataclass
from pathlib import Path

from trtllm_dflash.errors import ArtifactError, require
from trtllm_dflash.serve.settings import ModelSettings
from trtllm_dflash.serve.trtllm import compat, token_model

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATES = Path(str(resources.files("trtllm_dflash") / "triton_model_repo"))  # package data (pyproject.toml)
BACKENDS = ("torch", "trtllm-engine", "trtllm-pytorch")

# template directory -> the template directory whose 1/model.py it renders with (one loop model.py serves both)
MODEL_PY_FROM = {"entry": "dflash_bls", "tensorrt_llm": "dflash_bls"}
# rendered model -> (template directory, keys it must be given): backends torch and trtllm-engine
STEP_KEYS = ("backend", "engine_dir")
QUEUE_KEYS = ("max_sequences", "max_queue", "queue_timeout_s")
# the loop's block size (an int or "auto"), its policy file, prompt lookup (on / off), the tree verify (on / off) and
# its datastore file ("" = none), whether its stepper batches the rows of a call (on / off) and the step models' batch
LOOP_KEYS = ("loop_block_size", "adaptive", "ngram", "tree", "datastore", "coalesce", "max_batch_size")
# TensorRT-LLM's ensemble inputs and outputs beyond ours (serve/trtllm/compat.py), in the entry points' configs
TRTLLM_IO_KEYS = ("trtllm_inputs", "trtllm_outputs")
ENTRY_KEYS = ("name", *LOOP_KEYS, "instances", "target_dir", "max_seq_len", *QUEUE_KEYS, "io_nice", *TRTLLM_IO_KEYS)
# TensorRT-LLM's token-level model (serve/trtllm/token_model.py): its inputs and outputs, one instance
TOKEN_KEYS = ("name", *LOOP_KEYS, "target_dir", "max_seq_len", *QUEUE_KEYS, "io_nice", "token_inputs",
              "token_outputs", "decoupled")
MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    # TensorRT-LLM's tokenizer models, with its inputs and outputs (serve/trtllm/text.py)
    "preprocessing": ("preprocessing", ("max_batch_size", "target_dir", "instances", "io_nice")),
    "postprocessing": ("postprocessing", ("max_batch_size", "target_dir", "instances", "io_nice")),
    "target_verify": ("target_verify", ("max_batch_size", "queue_delay_us", "target_dir", "tap_layers",
                                        "max_sequences", "max_seq_len", "block_size", "idle_timeout_s",
                                        "torch_threads", "tree_nodes", "cuda_graphs", *STEP_KEYS)),
    "kv_inject": ("kv_inject", ("max_batch_size", "target_dir", "drafter_dir", "torch_threads", "instances",
                                "block_size", *STEP_KEYS)),
    "drafter": ("drafter", ("max_batch_size", "queue_delay_us", "target_dir", "drafter_dir", "max_sequences",
                            "max_seq_len", "idle_timeout_s", "torch_threads", "block_size", "cuda_graphs",
                            "draft_vocab", *STEP_KEYS)),
    "dflash_bls": ("dflash_bls", ("name", *LOOP_KEYS, "instances", *QUEUE_KEYS, "io_nice")),
    "baseline_bls": ("dflash_bls", ("name", *LOOP_KEYS, "instances", *QUEUE_KEYS, "io_nice")),
    # the entry points: decoupled python models with the ensemble's I/O (a client's cancellation reaches them)
    "dflash": ("entry", ENTRY_KEYS),
    "baseline": ("entry", ENTRY_KEYS),
    # TensorRT-LLM's token-level model name, so its clients run unchanged: the dflash loop on token ids
    "tensorrt_llm": ("tensorrt_llm", TOKEN_KEYS),
    # TensorRT-LLM's text-level model names (TRTLLM_NAMES below): the dflash entry point again
    "ensemble": ("entry", ENTRY_KEYS),
    "tensorrt_llm_bls": ("entry", ENTRY_KEYS),
}
# backend trtllm-pytorch: NVIDIA's LLM-API model twice (DFlash / baseline model.yaml) behind our ensemble I/O
LLMAPI_MODELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "tensorrt_llm_dflash": ("llmapi_model", ("name",)),
    "tensorrt_llm_baseline": ("llmapi_model", ("name",)),
    "dflash_llmapi": ("llmapi_bridge", ("name", "max_batch_size", "llm_model", "max_draft_len", "target_dir",
                                        "instances", *TRTLLM_IO_KEYS)),
    "baseline_llmapi": ("llmapi_bridge", ("name", "max_batch_size", "llm_model", "max_draft_len", "target_dir",
                                          "instances", *TRTLLM_IO_KEYS)),
    "dflash": ("ensemble_llmapi", ("name", "max_batch_size", "bridge_model", *TRTLLM_IO_KEYS, "trtllm_input_map",
                                   "trtllm_output_map")),
    "baseline": ("ensemble_llmapi", ("name", "max_batch_size", "bridge_model", *TRTLLM_IO_KEYS, "trtllm_input_map",
                                     "trtllm_output_map")),
}
# the names TensorRT-LLM's deployments give their text-level models, which its example client
# (end_to_end_grpc_client.py: --model-name ensemble or tensorrt_llm_bls, default ensemble), its quick start
# (POST /v2/models/ensemble/generate) and tools written for it address: rendered as copies of dflash unless
# RepoConfig.trtllm_names is off
TRTLLM_NAMES = ("ensemble", "tensorrt_llm_bls")
LLMAPI_MODELS.update({n: LLMAPI_MODELS["dflash"] for n in TRTLLM_NAMES})


def models_for(backend: str, trtllm_names: bool = True) -> dict[str, tuple[str, tuple[str, ...]]]:
    models = LLMAPI_MODELS if backend == "trtllm-pytorch" else MODELS
    return {m: v for m, v in models.items() if trtllm_names or m not in TRTLLM_NAMES}


PARAMETER = re.compile(r'parameters\s*\{\s*key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"')


def config_parameters(text: str) -> dict[str, str]:
    """A rendered config.pbtxt's ``parameters`` as {key: string_value}: what Triton hands its model at initialize."""
    return {key: value.replace('\\"', '"').replace("\\\\", "\\") for key, value in PARAMETER.findall(text)}


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
    target_dir: str  # HF target (tokenizer, specs); for trtllm-pytorch defaults to checkpoint_dir
    drafter_dir: str  # z-lab drafter (specs; trtllm-pytorch: speculative_model)
    backend: str = "torch"
    block_size: int | str = 16  # tokens per draft block (≤ the drafter's trained block size), or "auto"
    max_batch_size: int = 64  # requests per dynamically batched step execution
    instances: int = 1  # instances of the stateless models and of each BLS loop model
    max_seq_len: int = 2048  # tokens per sequence (prompt + generated)
    max_sequences: int = 32  # live sequences (KV-cache rows) per step model
    queue_delay_us: int = 200  # dynamic batcher wait for more requests
    idle_timeout_s: float = 120.0  # a sequence's state is freed after this long unused
    torch_threads: int = 0  # torch threads per CPU step model (0 = by load: handlers.CpuThreads)
    coalesce: bool = True  # the loop models send a step's rows of one kind as one batched call
    max_queue: int = 64  # requests per entry model waiting for a sequence slot; beyond: refused (UNAVAILABLE)
    queue_timeout_s: float = 60.0  # longest wait for a sequence slot; then refused (UNAVAILABLE)
    engines_dir: str = ""  # trtllm-engine: output of `trtllm-dflash build`
    checkpoint_dir: str = ""  # trtllm-pytorch: modelopt unified-HF checkpoint or the plain HF target
    max_block_size: int | None = None  # block_size "auto": the longest block (default: the drafter's)
    ngram: bool = False  # dflash also verifies prompt-lookup continuations (runtime.decoder's ``ngram``)
    io_nice: int = 19  # CPU: niceness of the server's and the non-computing models' threads (0 = all equal)
    tree: bool = False  # dflash verifies a tree per step (runtime.tree; torch backend)
    # with tree and ngram: the retrieval datastore its lookup chains propose from: "auto" the drafter directory's
    # (as make_decoder proposes in-process), "none" or "" none, or a file
    datastore: str = "auto"
    # the drafter model drafts over a reduced vocabulary (models.draft_vocab): "auto" the drafter directory's
    # draft_vocab.json with --backend torch (as load_pair drafts in-process), "full" or "" its own, or a file
    draft_vocab: str = "auto"
    # the tensorrt_llm model streams (decoupled, the default); False: unary, as TensorRT-LLM's decoupled_mode false,
    # for clients that call ModelInfer (its example client without --streaming)
    tensorrt_llm_decoupled: bool = True
    trtllm_names: bool = True  # also render dflash as TensorRT-LLM's ensemble and tensorrt_llm_bls (TRTLLM_NAMES)
    # the torch step models' verify and draft forwards replay CUDA graphs (runtime.graphs): "on" (CUDA), "rehearse"
    # (any device: the same static forwards without the capture) or "off"
    cuda_graphs: str = "auto"

    @property
    def adaptive(self) -> bool:
        return self.block_size == "auto"

    def tree_shape(self, drafter):
        """The dflash loop's tree (``runtime.tree.tree_for``), or None without ``tree``."""
        from trtllm_dflash.runtime.tree import tree_for

        return tree_for(self.block(drafter) - 1, self.ngram, bool(self.datastore_file())) if self.tree else None

    def block(self, drafter) -> int:
        """The (longest) block size the step models are built for."""
        return (self.max_block_size or drafter.block_size) if self.adaptive else int(self.block_size)

    def validate(self) -> "tuple":
        from trtllm_dflash.specs import DrafterSpec, TargetSpec, check_pair

        require(self.backend in BACKENDS, "--backend", self.backend, f"must be one of {', '.join(BACKENDS)}")
        require(not self.engines_dir or self.backend == "trtllm-engine", "--engines", self.engines_dir,
                "is only used by --backend trtllm-engine", "drop --engines or pass --backend trtllm-engine")
        require(not self.checkpoint_dir or self.backend == "trtllm-pytorch", "--checkpoint", self.checkpoint_dir,
                "is only used by --backend trtllm-pytorch", "drop --checkpoint or pass --backend trtllm-pytorch")
        require(self.backend != "trtllm-engine" or bool(self.engines_dir), "--engines", None,
                "is required by --backend trtllm-engine", "pass the output directory of `trtllm-dflash build`")
        if self.backend == "trtllm-pytorch":
            require(bool(self.checkpoint_dir), "--checkpoint", None, "is required by --backend trtllm-pytorch",
                    "pass the modelopt unified-HF checkpoint or the HF target directory")
            if not (Path(self.checkpoint_dir) / "config.json").is_file():
                raise ArtifactError(Path(self.checkpoint_dir) / "config.json", "missing (--checkpoint must be a "
                                    "Hugging Face model directory)", "pass the modelopt unified-HF export or HF target")
        target, drafter = TargetSpec.load(self.target_dir), DrafterSpec.load(self.drafter_dir)
        check_pair(target, drafter)
        require(drafter.draft_vocab_size is None or self.backend == "torch", "drafter.draft_vocab_size",
                drafter.draft_vocab_size, f"is a reduced draft vocabulary, which --backend {self.backend} cannot map to "
                "the target's ids (its drafter has no head of its own)", "use --backend torch, or a full-vocabulary "
                "drafter")
        require(drafter.dspark is None or self.backend != "trtllm-engine", "drafter.speculators_model_type",
                "dspark", "the TensorRT-LLM engine drafter has no Markov or confidence head",
                "use --backend torch, or --backend trtllm-pytorch (TensorRT-LLM's own DSpark)")
        if self.backend == "trtllm-pytorch" and drafter.dspark is None:
            from trtllm_dflash.models.speculators import is_speculators_dir

            require(not is_speculators_dir(self.drafter_dir), "--drafter", self.drafter_dir,
                    "is in the speculators format; TensorRT-LLM's DFlash loader reads z-lab's (dflash_config)",
                    "write a z-lab copy first: trtllm-dflash export-drafter --to z-lab --target TARGET "
                    "--drafter DIR --out OUT")
        require(self.max_block_size is None or self.adaptive, "--max-block-size", self.max_block_size,
                "only applies to --block-size auto", "add --block-size auto or drop --max-block-size")
        require(not self.adaptive or self.backend == "torch", "--block-size", self.block_size,
                f"'auto' runs in the BLS loop over the torch step models, not with --backend {self.backend}",
                "use --backend torch or a fixed --block-size")
        require(not self.ngram or self.backend != "trtllm-pytorch", "--ngram", True,
                "runs in the BLS loop over step models, not in TRT-LLM's own speculative decoding (--backend "
                "trtllm-pytorch)", "use --backend torch or trtllm-engine, or drop --ngram")
        require(self.adaptive or isinstance(self.block_size, int), "--block-size", self.block_size,
                "must be an integer or 'auto'")
        require(2 <= self.block(drafter) <= drafter.block_size,
                "--max-block-size" if self.adaptive else "--block-size", self.block(drafter),
                f"must be in [2, {drafter.block_size}] (the drafter's trained block size)")
        for name in ("max_batch_size", "instances", "max_sequences"):
            require(getattr(self, name) >= 1, f"--{name.replace('_', '-')}", getattr(self, name), "must be >= 1")
        require(16 <= self.max_seq_len <= target.max_position_embeddings, "--max-seq-len", self.max_seq_len,
                f"must be in [16, {target.max_position_embeddings}] (the target's context limit)")
        require(self.queue_delay_us >= 0, "--queue-delay-us", self.queue_delay_us, "must be >= 0")
        require(self.idle_timeout_s > 0, "--idle-timeout-s", self.idle_timeout_s, "must be > 0")
        require(self.max_queue >= 0, "--max-queue", self.max_queue, "must be >= 0 (0 = refuse at once when full)")
        require(self.queue_timeout_s > 0, "--queue-timeout-s", self.queue_timeout_s, "must be > 0")
        require(0 <= self.io_nice <= 19, "--io-nice", self.io_nice, "must be in [0, 19] (0 = no priority split)")
        require(self.cuda_graphs in ("auto", "off", "on", "rehearse"), "--cuda-graphs", self.cuda_graphs,
                "must be auto, off, on or rehearse")
        require(self.cuda_graphs in ("auto", "off") or self.backend == "torch", "--cuda-graphs", self.cuda_graphs,
                f"applies to the torch step models, not --backend {self.backend} (its engines bring their own)",
                "drop --cuda-graphs or use --backend torch")
        require(not self.tree or self.backend == "torch", "--tree", True,
                f"runs in the BLS loop over the torch step models, not with --backend {self.backend}",
                "drop --tree, or use --backend torch")
        explicit = self.datastore not in ("", "none", "auto")
        require(not explicit or (self.tree and self.ngram), "--datastore", self.datastore,
                "proposes for the tree's lookup chains only", "add --tree (prompt lookup on), or --datastore none")
        if explicit and not Path(self.datastore).is_file():
            raise ArtifactError(self.datastore, "missing (--datastore)", "pass a file from `trtllm-dflash datastore`, "
                                "or --datastore none")
        require(self.draft_vocab in ("", "full", "auto") or self.backend == "torch", "--draft-vocab",
                self.draft_vocab, f"applies to the torch drafter model, not --backend {self.backend} (its drafter "
                "keeps the target's full head)", "drop --draft-vocab (or pass full), or use --backend torch")
        self.draft_vocab_file(drafter)
        if self.backend == "trtllm-engine":
            from trtllm_dflash.serve.trtllm.engine import load_engine_set

            load_engine_set(self.engines_dir, self.block(drafter), drafter.target_layer_ids)
        return target, drafter

    def draft_vocab_file(self, drafter) -> str:
        """The reduced vocabulary file the drafter model drafts over, or "" (its own): ``draft_vocab`` resolved as
        ``checkpoints.resolve_draft_vocab`` resolves load_pair's, "auto" naming none for the backends whose drafter
        keeps the target's full head."""
        from trtllm_dflash.checkpoints import resolve_draft_vocab

        if self.draft_vocab == "auto" and self.backend != "torch":
            return ""
        path = resolve_draft_vocab(self.draft_vocab, self.drafter_dir, drafter)
        return str(path.resolve()) if path is not None else ""

    def datastore_file(self) -> str:
        """The datastore file the tree's lookup chains propose from, or "" (none): ``datastore`` resolved as
        ``commands.common.datastore_path`` resolves the in-process decoders' ("auto": the drafter directory's, with
        tree and ngram)."""
        from trtllm_dflash.commands.common import datastore_path

        path = datastore_path(self.datastore, self.drafter_dir, self.tree and self.ngram)
        return str(path.resolve()) if path is not None else ""

    def values(self, drafter, adaptive_file: str = "") -> dict[str, dict[str, object]]:
        tap_layers, block = drafter.target_layer_ids, self.block(drafter)
        ngram = "on" if self.ngram else "off"
        no_tree = {"tree": "off", "datastore": ""}
        tree = {"tree": "on", "datastore": self.datastore_file()} if self.tree else no_tree
        common = {
            "max_batch_size": self.max_batch_size, "instances": self.instances,
            "target_dir": str(Path(self.target_dir).resolve()), "drafter_dir": str(Path(self.drafter_dir).resolve()),
            "max_seq_len": self.max_seq_len, "max_sequences": self.max_sequences, "block_size": block,
            "queue_delay_us": self.queue_delay_us, "idle_timeout_s": self.idle_timeout_s,
            "torch_threads": self.torch_threads, "coalesce": "on" if self.coalesce else "off",
            "cuda_graphs": self.cuda_graphs, "draft_vocab": self.draft_vocab_file(drafter),
            "max_queue": self.max_queue, "queue_timeout_s": self.queue_timeout_s, "io_nice": self.io_nice,
            "tap_layers": ",".join(map(str, tap_layers)),
            "tree_nodes": self.tree_shape(drafter).size if self.tree else 0,
            "backend": self.backend, "engine_dir": str(Path(self.engines_dir).resolve()) if self.engines_dir else "",
            **compat.template_values(), **token_model.template_values(),
        }
        per_model = {
            "dflash_bls": {"name": "dflash_bls", "loop_block_size": self.block_size, "adaptive": adaptive_file,
                           "ngram": ngram, **tree},
            "baseline_bls": {"name": "baseline_bls", "loop_block_size": 1, "adaptive": "", "ngram": "off", **no_tree},
            "tensorrt_llm": {"name": "tensorrt_llm", "loop_block_size": self.block_size, "adaptive": adaptive_file,
                             "ngram": ngram, "decoupled": str(self.tensorrt_llm_decoupled).lower(), **tree},
            "dflash": {"name": "dflash", "loop_block_size": self.block_size, "adaptive": adaptive_file,
                       "ngram": ngram, "bridge_model": "dflash_llmapi", **tree},
            "baseline": {"name": "baseline", "loop_block_size": 1, "adaptive": "", "ngram": "off",
                         "bridge_model": "baseline_llmapi", **no_tree},
            "tensorrt_llm_dflash": {"name": "tensorrt_llm_dflash"},
            "tensorrt_llm_baseline": {"name": "tensorrt_llm_baseline"},
            "dflash_llmapi": {"name": "dflash_llmapi", "llm_model": "tensorrt_llm_dflash",
                              "max_draft_len": block - 1},
            "baseline_llmapi": {"name": "baseline_llmapi", "llm_model": "tensorrt_llm_baseline", "max_draft_len": 0},
        }
        per_model.update({n: {**per_model["dflash"], "name": n} for n in TRTLLM_NAMES})
        models = models_for(self.backend, self.trtllm_names)
        return {m: {k: {**common, **per_model.get(m, {})}[k] for k in keys} for m, (_, keys) in models.items()}


def _llmapi_files(cfg: RepoConfig, drafter) -> dict[str, str]:
    """model -> rendered 1/model.yaml text for the two LLM-API models."""
    from trtllm_dflash.serve.trtllm.llmapi import dump_yaml, model_yaml

    base = model_yaml(cfg.checkpoint_dir, cfg.max_batch_size)
    spec = model_yaml(cfg.checkpoint_dir, cfg.max_batch_size, cfg.drafter_dir, cfg.block(drafter) - 1,
                      drafter.target_layer_ids, drafter.mask_token_id, dspark=drafter.dspark,
                      trained_block_size=drafter.trained_block_size)
    out = {"tensorrt_llm_dflash": dump_yaml(spec), "tensorrt_llm_baseline": dump_yaml(base)}
    for model, text in out.items():
        require("${" not in text, f"{model}/1/model.yaml", "${", "contains a placeholder")
    return out


def _manifest(cfg: RepoConfig, drafter, models) -> dict:
    manifest = {"repo_config": asdict(cfg), "backend": cfg.backend, "models": sorted(models),
                "tap_layers": list(drafter.target_layer_ids)}
    if cfg.backend == "trtllm-engine":
        manifest["engines"] = {n: str(Path(cfg.engines_dir, n).resolve()) for n in ("target", "kv_inject", "drafter")}
        manifest["plugin_preload"] = ("import trtllm_dflash.plugin.trt before deserializing (QDP aot_impl ops, "
                                      "kernels embedded in the engines; no .so to LD_PRELOAD)")
    if cfg.backend == "trtllm-pytorch":
        from trtllm_dflash.serve.trtllm.llmapi import DERIVED_OUTPUTS, LLMAPI_MODEL_PY_SOURCE, UNAVAILABLE_INPUTS

        manifest["model_py_source"] = {m: LLMAPI_MODEL_PY_SOURCE for m in ("tensorrt_llm_dflash",
                                                                           "tensorrt_llm_baseline")}
        manifest["requires"] = "TensorRT-LLM >= 1.3 (DFlashDecodingConfig); NVIDIA container with the llmapi model"
        manifest["derived_outputs"] = DERIVED_OUTPUTS
        manifest["unavailable_inputs"] = UNAVAILABLE_INPUTS
    return manifest


ADAPTIVE_FILE = "adaptive.json"


def adaptive_settings(cfg: RepoConfig, drafter) -> dict:
    """What the dflash_bls loop needs for ``--block-size auto``: the longest block, the acceptance prior (the
    drafter's training log) and a starting cost model, calibrated here on the step models' device (CPU; cached on
    disk by device, dtype, threads and model, so a second make-repo is instant). The loop keeps it honest with the
    step times it observes through Triton."""
    import torch

    from trtllm_dflash.checkpoints import load_pair
    from trtllm_dflash.runtime.acceptance import prior_from_training_log
    from trtllm_dflash.runtime.decoder import SpeculativeDecoder, calibrated_policy

    block = cfg.block(drafter)
    target, drafter_model = load_pair(cfg.target_dir, cfg.drafter_dir, dtype=torch.float32,
                                      draft_vocab=cfg.draft_vocab_file(drafter) or "full")
    decoder = SpeculativeDecoder(target, drafter_model, block)
    policy = calibrated_policy(decoder, max_rows=1)
    # a DSpark drafter's confidence head on the torch step models: the drafter model returns its estimates and the
    # loop feeds them to the policy as each sequence's forecast (the TensorRT-LLM engines return drafts only)
    scored = cfg.backend == "torch" and drafter.dspark is not None and drafter.dspark.confidence_head
    return {"max_block_size": block, "prior": prior_from_training_log(cfg.drafter_dir, block - 1),
            "cost": policy.cost.to_json(), "ngram": cfg.ngram, "confidence": bool(scored)}


def make_repo(cfg: RepoConfig, out: str | Path, force: bool = False, templates: Path = TEMPLATES) -> Path:
    """Render every model of the backend's model table into ``out`` (atomically: a temporary sibling renamed at the
    end). trtllm-pytorch models without a model.py of ours get the model.yaml instead (see the manifest)."""
    from trtllm_dflash.staging import refuse_existing, staged_output

    out = Path(out)
    refuse_existing(out, force)
    _, drafter = cfg.validate()
    adaptive_file = str(out.resolve() / "dflash_bls" / "1" / ADAPTIVE_FILE) if cfg.adaptive else ""
    values = cfg.values(drafter, adaptive_file)
    models = models_for(cfg.backend, cfg.trtllm_names)
    adaptive_doc = adaptive_settings(cfg, drafter) if cfg.adaptive else None
    extra = _llmapi_files(cfg, drafter) if cfg.backend == "trtllm-pytorch" else {}
    with staged_output(out, force) as tmp:
        for model, (template, _) in models.items():
            src = templates / template
            if not (src / "config.pbtxt").is_file():
                raise ArtifactError(src / "config.pbtxt", "template missing", "restore triton_model_repo/")
            text = render_text((src / "config.pbtxt").read_text(), values[model], f"{template}/config.pbtxt")
            if (templates / MODEL_PY_FROM.get(template, template) / "1" / "model.py").is_file():
                ModelSettings.from_parameters(config_parameters(text))  # what the model will read back, checked now
            (tmp / model / "1").mkdir(parents=True)
            (tmp / model / "config.pbtxt").write_text(text)
            model_py = templates / MODEL_PY_FROM.get(template, template) / "1" / "model.py"
            if model_py.is_file():
                shutil.copy2(model_py, tmp / model / "1" / "model.py")
            if model in extra:
                (tmp / model / "1" / "model.yaml").write_text(extra[model])
            if model == "dflash_bls" and adaptive_doc is not None:
                (tmp / model / "1" / ADAPTIVE_FILE).write_text(json.dumps(adaptive_doc, indent=1) + "\n")
        manifest = _manifest(cfg, drafter, models)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return out
