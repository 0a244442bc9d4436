"""No function or method in the ``trtllm_dflash`` package spans more than ``MAX_LINES`` lines.

Every module is parsed with ``ast``; every ``def`` and ``async def`` counts, methods and nested functions included,
from its ``def`` line to its last line (``end_lineno - lineno + 1``; decorators are not counted). A long function is
split into named steps (a helper per phase, a small dataclass for the state they share) rather than allowlisted.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trtllm_dflash"
MAX_LINES = 80

# "path relative to trtllm_dflash/::function name" -> why it may be longer
ALLOWED = {
    # a Triton JIT kernel is compiled from one function's body: it cannot call Python helpers, so it stays one function
    "plugin/triton_kernels.py::_block_attention_kernel": "Triton JIT kernel",
}


def _long_functions() -> list[tuple[str, str]]:
    """``(path::name, "path:line name (N lines)")`` for every function over ``MAX_LINES`` lines (a list: one file may
    hold several long functions of one name, e.g. two classes' ``__init__``)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    where = f"trtllm_dflash/{rel}:{node.lineno} {node.name} ({lines} lines)"
                    found.append((f"{rel}::{node.name}", where))
    return found


def test_no_function_is_longer_than_the_limit():
    too_long = [where for key, where in _long_functions() if key not in ALLOWED]
    assert not too_long, (f"functions over {MAX_LINES} lines (split them into named steps):\n  "
                          + "\n  ".join(too_long))


def test_allowlist_holds_only_long_functions():
    """An entry whose function got shorter (or was renamed or removed) leaves the allowlist."""
    stale = sorted(set(ALLOWED) - {key for key, _ in _long_functions()})
    assert not stale, f"allowlisted but not over {MAX_LINES} lines: {stale}"
