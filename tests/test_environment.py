"""The installed environment is exactly the committed lock, the lock satisfies pyproject.toml, and the test run sees
a newcomer's caches (build_scripts/test.sh gives it a fresh model cache and HOME)."""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
LOCKS = [ROOT / "build_scripts" / "requirements.lock", ROOT / "build_scripts" / "requirements-nodeps.lock"]
# The installer itself (from the interpreter's ensurepip) and this package (installed editable from the tree).
NOT_LOCKED = {"pip", "trtllm-dflash"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")


def locked() -> dict[str, str]:
    """name -> exact version over both locks; every entry must carry hashes (pip's --require-hashes mode)."""
    pins: dict[str, str] = {}
    for lock in LOCKS:
        lines = lock.read_text().splitlines()
        for i, line in enumerate(lines):
            m = PIN.match(line)
            if not m:
                continue
            assert line.rstrip().endswith("\\") and "--hash=sha256:" in lines[i + 1], f"{lock.name}: {line} has no hash"
            name = canonicalize_name(m.group(1))
            assert name not in pins, f"{name} is locked twice"
            pins[name] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    """What pip installed into this environment's site-packages. Not all of sys.path: once setuptools is imported it
    puts its vendored copies (importlib-metadata, zipp, ...) there, which are no installed packages."""
    dirs = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    return {canonicalize_name(d.metadata["Name"]): d.version for d in metadata.distributions(path=dirs)}


def keeps_cuda_torch() -> bool:
    """setup.sh keeps a machine's CUDA torch instead of the locked CPU build."""
    return torch.version.cuda is not None


def test_installed_environment_is_the_lock():
    pins, have = locked(), installed()
    if keeps_cuda_torch():
        pins.pop("torch"), have.pop("torch")
    missing = {n: v for n, v in pins.items() if n not in have}
    wrong = {n: (v, have[n]) for n, v in pins.items() if n in have and have[n] != v}
    extra = sorted(set(have) - set(pins) - NOT_LOCKED)
    assert not missing, f"locked but not installed (run build_scripts/setup.sh): {missing}"
    assert not wrong, f"installed version differs from the lock (name: (locked, installed)): {wrong}"
    assert not extra, f"installed but not in the lock (add them to pyproject.toml and run build_scripts/lock.sh): {extra}"


def test_lock_satisfies_pyproject():
    """A dependency changed in pyproject.toml without re-running build_scripts/lock.sh fails here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project["optional-dependencies"].values() for r in extra]
    pins = locked()
    env = {"python_version": f"{sys.version_info.major}.{sys.version_info.minor}"}
    for req in reqs:
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        name = canonicalize_name(req.name)
        assert name in pins, f"pyproject.toml requires {req}, which the lock lacks: run build_scripts/lock.sh"
        assert req.specifier.contains(pins[name], prereleases=True), \
            f"the lock pins {name}=={pins[name]}, outside pyproject's {req}: run build_scripts/lock.sh"


def test_lock_keeps_the_house_pins():
    pins = locked()
    assert pins["torch"].split("+")[0] == "2.13.0" and pins["torch"].endswith("+cpu"), pins["torch"]
    assert int(pins["numpy"].split(".")[0]) < 2, "the Triton python stub needs numpy<2"
    assert "accelerate" in pins, "transformers' GGUF loader (the demo target's conversion) needs accelerate"


def test_suite_sees_a_fresh_cache():
    """Through build_scripts/test.sh (always in CI) HOME and the model cache are fresh temporary directories, so the
    GGUF conversion runs and no test touches the home directory's caches."""
    from trtllm_dflash.assets import cache_dir

    scratch = os.environ.get("TRTLLM_DFLASH_TEST_SCRATCH")
    if scratch is None:
        assert os.environ.get("CI") != "true", "CI must run the suite through build_scripts/test.sh"
        pytest.skip("pytest run directly, not through build_scripts/test.sh")
    scratch = Path(scratch).resolve()
    assert scratch in Path(os.environ["HOME"]).resolve().parents, "HOME is not test.sh's temporary one"
    if "TRTLLM_DFLASH_TEST_CACHE" not in os.environ:
        assert scratch in cache_dir().resolve().parents, f"model cache {cache_dir()} is not a fresh one"
        assert (cache_dir() / "smollm2-135m-instruct" / "config.json").is_file(), "test.sh converts the target first"
