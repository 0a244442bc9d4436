"""What CPU this is, read from ``/proc/cpuinfo`` (one place for the model name and the bf16 question).

Our development machines are x86-64, Intel or AMD. Numerics never depend on which (the runtime is float32 on a CPU),
but speed does: bfloat16 matmuls are fast only where the CPU has bf16 units (``avx512_bf16`` or ``amx_bf16``), and
there bf16 regeneration and bf16-autocast training outrun float32. Without them PyTorch emulates bf16, which runs
several times slower than float32: asking for bf16 on such a CPU draws a warning (``slow_bf16_warning``).
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def _cpuinfo(text: str | None) -> str:
    if text is not None:
        return text
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def _field(text: str, name: str) -> str | None:
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == name:
            return value.strip()
    return None


def cpu_model(cpuinfo: str | None = None) -> str:
    """The CPU's model name (``platform`` when there is no /proc/cpuinfo)."""
    return _field(_cpuinfo(cpuinfo), "model name") or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> str | None:
    """The CPU's feature flags as /proc/cpuinfo lists them (space-separated), or None where they cannot be read."""
    return _field(_cpuinfo(cpuinfo), "flags")


def has_bf16_units(cpuinfo: str | None = None) -> bool | None:
    """True/False from the CPU's flags; None where they cannot be read (not Linux, or not x86)."""
    flags = cpu_flags(cpuinfo)
    if flags is None:
        return None
    return any(f in flags.split() for f in BF16_FLAGS)


def slow_bf16_warning(option: str, fix: str, cpuinfo: str | None = None) -> str | None:
    """The one-line advice to print when ``option`` asks for bf16 on a CPU that would emulate it, else None."""
    text = _cpuinfo(cpuinfo)  # read once for both questions
    if has_bf16_units(text) is not False:
        return None
    return (f"warning: {option} on a CPU without bf16 units ({cpu_model(text)}: no {' or '.join(BF16_FLAGS)}) "
            f"runs at about a quarter of float32's speed here; pass {fix}")


def warn_slow_bf16(value: str, option: str, fix: str) -> None:
    """Print ``slow_bf16_warning`` on stderr when ``option``'s ``value`` is bf16 (only then is /proc/cpuinfo read)."""
    if value in ("bfloat16", "bf16") and (msg := slow_bf16_warning(f"{option} {value}", fix)):
        print(msg, file=sys.stderr)
