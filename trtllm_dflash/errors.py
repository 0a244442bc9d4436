"""Typed, actionable errors.

Every user-facing failure names the field, the offending value, the rule it broke and how to fix it, so the CLI can
print one line and exit with code 2 (and the Triton models can answer INVALID_ARGUMENT) without a traceback.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DFlashError(Exception):
    """Base class for errors caused by user input (exit code 2 at the CLI)."""


class ConfigError(DFlashError):
    """A configuration value breaks a rule.

    Args:
        field: dotted name of the offending field, e.g. ``drafter.dflash_config.target_layer_ids[3]``.
        value: the value that was given.
        rule: the rule it breaks, e.g. ``must be < num_hidden_layers of the target (30)``.
        fix: what the user should do about it.
    """

    def __init__(self, field: str, value: object, rule: str, fix: str = "") -> None:
        self.field, self.value, self.rule, self.fix = field, value, rule, fix
        msg = f"{field}={value!r}: {rule}"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)


class ArtifactError(DFlashError):
    """A file or directory on disk is missing, unreadable or malformed."""

    def __init__(self, path: object, problem: str, fix: str = "") -> None:
        self.path, self.problem, self.fix = path, problem, fix
        msg = f"{path}: {problem}"
        if fix:
            msg += f"; {fix}"
        super().__init__(msg)


def require(ok: bool, field: str, value: object, rule: str, fix: str = "") -> None:
    """Raise ``ConfigError(field, value, rule, fix)`` unless ``ok``."""
    if not ok:
        raise ConfigError(field, value, rule, fix)


def read_json(path: str | Path, fix: str) -> dict[str, Any]:
    """A JSON object from ``path``; missing, unreadable or non-object files raise ArtifactError with ``fix``."""
    path = Path(path)
    if not path.is_file():
        raise ArtifactError(path, "missing", fix)
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArtifactError(path, f"unreadable JSON ({exc})", fix) from exc
    if not isinstance(obj, dict):
        raise ArtifactError(path, "top level is not a JSON object", fix)
    return obj
