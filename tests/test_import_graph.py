"""The package's import graph has no cycle.

Every module of ``trtllm_dflash`` is parsed with ``ast`` and every ``import`` / ``from ... import`` statement counts,
wherever it stands: at the top, inside a function (a deferred import still closes a circle, only later), under ``if
TYPE_CHECKING``. Relative imports are resolved against the importing module's package, and ``from pkg import name``
is an edge to the submodule ``pkg.name`` where one exists, else to ``pkg``. Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``, so an import from outside a package is an edge to the package too. A cycle means
some module is used before it has finished loading, or an import hidden in a function to dodge that: the shared part
belongs in a lower module both import.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trtllm_dflash"


def module_files(root: Path, package: str) -> dict[str, Path]:
    """{dotted module name: file} of every module and package under ``root / package``."""
    mods = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, mods: dict[str, Path]) -> list[str]:
    """The dotted names one import statement of ``module`` loads (not yet resolved to modules)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        anchor = module.split(".") if is_package else module.split(".")[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    return [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The package module ``name`` is or lives in (``a.b.func`` -> ``a.b``); None outside the package."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT, package: str = PACKAGE) -> dict[str, dict[str, int]]:
    """{module: {module it imports: line of the first such import}} over the package's own modules."""
    mods = module_files(root, package)
    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(node, module, is_package, mods):
                target = _resolve(name, mods)
                if target is None or target == module:
                    continue
                parts = target.split(".")
                ancestors = [".".join(parts[:i]) for i in range(1, len(parts))]
                # the packages the import initialises on the way: not the importer nor those it lives in
                for dep in [a for a in ancestors if a in mods and not (module + ".").startswith(a + ".")] + [target]:
                    graph[module][dep] = min(graph[module].get(dep, node.lineno), node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as [m0, m1, ..., m0], or None (depth-first search, iterative)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, {}))))
    return None


def describe(cycle: list[str], graph: dict[str, dict[str, int]]) -> str:
    return "\n".join(f"  {a} (line {graph[a][b]}) imports {b}" for a, b in zip(cycle, cycle[1:]))


def test_the_package_imports_form_no_cycle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle in trtllm_dflash:\n" + describe(cycle, graph)


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    # a top-level absolute import, a function-local one, and `from pkg import module`
    assert "trtllm_dflash.models.drafter" in graph["trtllm_dflash.checkpoints"]
    assert "trtllm_dflash.runtime.text" in graph["trtllm_dflash.train.regen"]
    assert "trtllm_dflash.models.draft_vocab" in graph["trtllm_dflash.checkpoints"]
    assert sum(len(deps) for deps in graph.values()) > 200


def test_cycles_are_found_through_relative_local_and_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import thing\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import c\n")
    (pkg / "sub" / "b.py").write_text("thing = 1\n")
    (pkg / "sub" / "c.py").write_text("from .. import d\n")
    (pkg / "d.py").write_text("import os\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.a"] == {"pkg.sub": 2, "pkg.sub.c": 2}
    assert graph["pkg.sub"] == {"pkg.sub.b": 1}
    assert graph["pkg.sub.c"] == {"pkg.d": 1}
    assert find_cycle(graph) is None

    (pkg / "d.py").write_text("import pkg.a as a\n")  # d -> a -> sub.c -> d
    graph = import_graph(tmp_path, "pkg")
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert set(cycle) == {"pkg.a", "pkg.sub.c", "pkg.d"}
    assert "pkg.d (line 1) imports pkg.a" in describe(cycle, graph)

    (pkg / "d.py").write_text("import os\n")  # through a package's __init__: e -> sub (its __init__) -> b -> e
    (pkg / "e.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..e import x\n")
    assert set(find_cycle(import_graph(tmp_path, "pkg"))) == {"pkg.e", "pkg.sub", "pkg.sub.b"}
