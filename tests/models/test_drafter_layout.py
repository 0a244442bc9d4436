"""Drafter-directory hygiene: every drafter directory this project ships or writes loads unchanged wherever a z-lab
DFlash drafter loads (z-lab's reference code through transformers, vLLM's ``"method": "dflash"``, SGLang). A z-lab
drafter holds one config (config.json) and one weight file (model.safetensors); vLLM's default loader takes every
top-level ``*.safetensors`` of the directory as weights and stops at the first tensor its model lacks (a retrieval
datastore saved as safetensors stops it: ``There is no module or parameter named 'tokens' in DFlashQwen3Model``),
and other loaders glob ``*.bin``/``*.pt`` the same way, so nothing else in a drafter directory may look like weights or
a config those loaders read. The datastore lives beside the weights as ``runtime.datastore.DATASTORE_FILE``."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from trtllm_dflash.assets import SHIPPED_DRAFTER
from trtllm_dflash.runtime.datastore import DATASTORE_FILE, LEGACY_DATASTORE_FILE, Datastore

# Suffixes some loader takes as weights: safetensors (vLLM, SGLang, TRT-LLM, transformers), PyTorch pickles (vLLM's
# and transformers' fallback), GGUF, Flax/TF/numpy checkpoints; a *.index.json names shards to load.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".npz", ".index.json")
# Config files loaders read by name beside config.json: generation defaults, Mistral's format (vLLM switches to it
# when params.json exists), PEFT adapters, quantization configs (vLLM, ModelOpt).
CONFIG_NAMES = ("generation_config.json", "params.json", "adapter_config.json", "quant_config.json",
                "hf_quant_config.json", "quantize_config.json")
ZLAB_FILES = {"config.json", "model.safetensors"}


def zlab_layout_problems(drafter_dir: Path) -> list[str]:
    """What keeps ``drafter_dir`` from being a z-lab drafter as the loaders see it (empty: none): its weights and
    configs, anywhere below it, must be exactly config.json and model.safetensors at the top."""
    found = {str(p.relative_to(drafter_dir)) for p in drafter_dir.rglob("*")
             if p.is_file() and (p.name.endswith(WEIGHT_SUFFIXES) or p.name in CONFIG_NAMES or p.name == "config.json")}
    problems = [f"{name}: looks like weights or a loader's config" for name in sorted(found - ZLAB_FILES)]
    problems += [f"{name}: missing" for name in sorted(ZLAB_FILES - found)]
    return problems


def test_layout_check_catches_a_top_level_datastore(tmp_path):
    # the check itself: the layout vLLM refused (the datastore under its old name) is caught, the fixed one passes
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "training_log.json").write_text("{}")
    (tmp_path / LEGACY_DATASTORE_FILE).write_bytes(b"")
    assert zlab_layout_problems(tmp_path) == [f"{LEGACY_DATASTORE_FILE}: looks like weights or a loader's config"]
    (tmp_path / LEGACY_DATASTORE_FILE).rename(tmp_path / DATASTORE_FILE)
    assert zlab_layout_problems(tmp_path) == []


@pytest.mark.skipif(not (SHIPPED_DRAFTER / "model.safetensors").is_file(), reason="no shipped drafter")
def test_shipped_drafter_holds_zlab_files_only():
    assert zlab_layout_problems(SHIPPED_DRAFTER) == []
    assert (SHIPPED_DRAFTER / DATASTORE_FILE).is_file()  # the datastore is shipped, under a name no loader globs
    assert Datastore.load(SHIPPED_DRAFTER / DATASTORE_FILE).num_tokens > 0


def test_written_drafter_holds_zlab_files_only(tiny_dirs):
    # checkpoints.write_drafter (the trainer's export and every test drafter go through it)
    for _, drafter_dir in tiny_dirs.values():
        assert zlab_layout_problems(Path(drafter_dir)) == []


def test_datastore_cli_and_merged_drafter_hold_zlab_files_only(tmp_path):
    # the two other writers into a drafter directory: `trtllm-dflash datastore --out DRAFTER/DATASTORE_FILE` as the
    # README says, and the GPU pipeline's `merge` of returned parts (which carries the run's datastore along)
    from trtllm_dflash.cli import main as cli
    from trtllm_dflash.models.weights import write_state_dict
    from conftest import repo_script

    gp = repo_script("build_scripts/gpu_pipeline.py")
    from trtllm_dflash.train.regen import Regenerated, write_regen_shard

    regen = tmp_path / "regen"
    regen.mkdir()
    (regen / "meta.json").write_text(json.dumps({"pool": "p.jsonl", "num_prompts": 1}))
    write_regen_shard(regen / "regen-00000.safetensors", [
        Regenerated(torch.tensor([1, 2, 3, 4]), 1, torch.zeros(4, 2, dtype=torch.int32),
                    torch.zeros(4, 2, dtype=torch.bfloat16))])
    parts = tmp_path / "parts"
    parts.mkdir()
    write_state_dict({"fc.weight": torch.ones(2, 4), "tap_scale": torch.ones(4)},
                     parts / f"{gp.STATE_PREFIX}-00001-of-00001.safetensors")
    (parts / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
    assert cli(["datastore", "--from", str(regen), "--out", str(parts / DATASTORE_FILE)]) == 0
    merged = gp.merge(parts, tmp_path / "merged")
    assert zlab_layout_problems(merged) == []
    assert Datastore.load(merged / DATASTORE_FILE).num_tokens == 4


def test_a_datastore_under_its_old_name_is_not_used_and_says_how_to_rename(tmp_path, caplog):
    from trtllm_dflash.commands.common import drafter_datastore, resolve_datastore

    Datastore(torch.tensor([1, 2, 3]).numpy(), {}).save(tmp_path / LEGACY_DATASTORE_FILE)
    with caplog.at_level(logging.WARNING):
        assert drafter_datastore(tmp_path) is None
        assert resolve_datastore("auto", tmp_path, tree_lookup=True) is None
    assert f"mv {tmp_path / LEGACY_DATASTORE_FILE} {tmp_path / DATASTORE_FILE}" in caplog.text
    (tmp_path / LEGACY_DATASTORE_FILE).rename(tmp_path / DATASTORE_FILE)
    assert drafter_datastore(tmp_path) == tmp_path / DATASTORE_FILE
    assert resolve_datastore("auto", tmp_path, tree_lookup=True).num_tokens == 3
