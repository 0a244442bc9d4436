"""The CPU kernels this package builds from its own C++ source on the machine at hand: the packed product
(``packed_mm.cpp``) and the decode step over it (``decode_step.cpp``), one library.

A kernel is compiled once per machine kind with the system's C++ compiler against the installed torch, for the
widest vector extension the CPU reports (AVX-512 or AVX2, each with FMA), and kept in the model cache under a name
that digests the source, torch's version and those flags; a later process loads the built library in moments. The
build is written beside its final name and renamed into place, one process at a time (a lock file beside it), so
processes that start together build it once and never load a torn file.

Where there is no compiler, no FMA, or the build fails, the library is unavailable: the product table then never
offers the packed kind, the target never runs the native decode step (the reason is printed once on stderr), and
every product runs one of torch's kernels.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import torch

SOURCES = tuple(Path(__file__).with_name(name) for name in ("packed_mm.cpp", "decode_step.cpp"))
HEADERS = (Path(__file__).with_name("cpu_vec.h"),)
LIBRARY = "trtllm_dflash_cpu"  # the operator namespace the source registers (torch.ops.trtllm_dflash_cpu)


def isa_flags(flags: str | None = None) -> list[str] | None:
    """The compiler's target flags for this CPU's vector extension (from its /proc/cpuinfo flags), or None where
    the kernel has none to use (no AVX2 with FMA, or not x86)."""
    if flags is None:
        from trtllm_dflash.hardware import cpu_flags

        flags = cpu_flags()
    have = set((flags or "").split())
    if {"avx512f", "fma", "avx2"} <= have:
        return ["-mavx512f", "-mavx2", "-mfma"]
    if {"avx2", "fma"} <= have:
        return ["-mavx2", "-mfma"]
    return None


def _cflags(isa: list[str]) -> list[str]:
    # no contraction beyond the source's own fused multiply-adds: the rounding is the source's, whatever the compiler
    return ["-O3", "-fopenmp", "-ffp-contract=off", *isa]


def library_path(isa: list[str]) -> Path:
    """Where the kernel built for ``isa`` with this torch lives in the model cache."""
    from trtllm_dflash.staging import cache_dir

    digest = hashlib.sha256(b"\0".join([*(p.read_bytes() for p in SOURCES + HEADERS), torch.__version__.encode(),
                                        " ".join(_cflags(isa)).encode()])).hexdigest()[:16]
    return cache_dir() / "kernels" / f"packed_mm-{digest}.so"


def build(isa: list[str], out: Path) -> Path:
    """Compile the kernel for ``isa`` into ``out`` (``$CXX``, else ``c++``), through a file beside it renamed into
    place. Raises with the compiler's own message when it fails."""
    import subprocess

    from torch.utils import cpp_extension

    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    os.close(fd)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-std=c++17", *_cflags(isa),
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
           *(f"-I{p}" for p in cpp_extension.include_paths()), *map(str, SOURCES), "-o", tmp,
           *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-fopenmp"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cmd[0]} exited {done.returncode}: {done.stderr.strip()[:2000]}")
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o755 & ~umask)
        os.replace(tmp, out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return out


@functools.cache
def _library() -> bool:
    """Builds or loads the library once per process -> whether its operators are registered here."""
    isa = isa_flags()
    if isa is None:
        return _unavailable("the CPU reports no AVX2 with FMA")
    path = library_path(isa)
    try:
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "w") as lock:  # the step models of one server start together:
                fcntl.flock(lock, fcntl.LOCK_EX)                 # one of them builds, the others wait and load
                if not path.is_file():
                    build(isa, path)
        torch.ops.load_library(str(path))
        torch.library.register_fake(f"{LIBRARY}::packed_mm")(_packed_shape)  # what a compiled graph traces
        return True
    except Exception as exc:  # no compiler, no headers, a failed build: torch's kernels serve instead
        first = str(exc).strip().splitlines()
        return _unavailable(f"{type(exc).__name__}: {first[0] if first else ''}")


def packed_mm():
    """``torch.ops.trtllm_dflash_cpu.packed_mm`` (x [m, k], weight packed [panels, k, 16] -> [m, panels * 16]),
    built or loaded once per process; None where it is unavailable here."""
    return getattr(torch.ops, LIBRARY).packed_mm if _library() else None


def decode_step():
    """``torch.ops.trtllm_dflash_cpu.decode_step``, the target's one-token step through every layer in one call
    (``decode_step.cpp``; ``models.target.NativeDecode`` calls it); None where the library is unavailable here."""
    return getattr(torch.ops, LIBRARY).decode_step if _library() else None


def _packed_shape(x: torch.Tensor, wp: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], wp.shape[0] * wp.shape[2])


def _unavailable(why: str) -> bool:
    print(f"trtllm-dflash: the packed CPU product kernel is unavailable ({why}); products use torch's kernels",
          file=sys.stderr, flush=True)
    return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[n, k] -> [ceil(n / 16), k, 16]: each panel holds 16 output features side by side for every input index
    (the outputs past n are zero)."""
    n, k = weight.shape
    panels = -(-n // 16)
    if panels * 16 != n:
        weight = torch.cat([weight, weight.new_zeros(panels * 16 - n, k)])
    return weight.reshape(panels, 16, k).transpose(1, 2).contiguous()
