"""The layout's dependency rules, enforced by reading every import (README, Layout; DESIGN §2).

Every `import` and `from … import` of our three top-level packages counts, wherever it stands: at module
level, inside a function (a lazy import is still a dependency) or under `if TYPE_CHECKING:` (a type-only
import is still a cycle: the shared type lives in the wrong module). An import of a package's name resolves to
the submodule when it names one (`from harness.run import store` → harness.run.store), else to the package's
`__init__`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("reference", "optimized", "harness")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for top in OURS for p in sorted((ROOT / top).rglob("*.py"))}


def imports_of(path: Path, modules: dict[str, Path], package: str | None = None) -> set[str]:
    """The modules of ours that `path` imports, resolved to submodules where the import names one. `package`
    (default: the file's own) anchors relative imports."""
    tree = ast.parse(path.read_text(), str(path))
    if package is None:
        package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] in OURS:
                while name not in modules and "." in name:  # `import a.b.c` of a module c: depend on a.b.c
                    name = name.rpartition(".")[0]
                found.add(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imports_of(path, modules) - {name} for name, path in modules.items()}


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


RULES = [
    # (importer package, imported package it must not use, why)
    ("reference", "optimized", "the ruler knows nothing of what it measures"),
    ("reference", "harness", "the ruler knows nothing of what it measures"),
    ("optimized", "harness", "the engine is a stack the harness drives, never the other way"),
    ("harness.scenario", "harness.run", "a scenario is what to run; it cannot depend on running"),
    ("harness.scenario", "harness.report", "a scenario is what to run; it cannot depend on pages"),
    ("harness.scenario", "harness.gate", "a scenario names its policy by path; it does not evaluate it"),
    ("harness.scenario", "harness.attribution", "a scenario is upstream of every judgement"),
    ("harness.run", "harness.report", "the run writes numbers; pages read them"),
    ("harness.run", "harness.gate", "the run writes numbers; the gate reads them"),
    ("harness.run", "harness.attribution", "attribution drives runs, not the other way"),
    ("harness.gate", "harness.report", "the gate reads numbers, never pages"),
    ("harness.gate", "harness.run", "the gate reads the run directory's files, not the runner"),
    ("harness.gate", "harness.attribution", "attribution uses the gate, not the other way"),
    ("harness.report", "harness.attribution", "the report reads attribution.json, not the code that wrote it"),
]


@pytest.mark.parametrize("importer,forbidden,why", RULES, ids=[f"{a}-not-{b}" for a, b, _ in RULES])
def test_layer_rule(graph: dict[str, set[str]], importer: str, forbidden: str, why: str) -> None:
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if _in(m, importer)
                 for d in deps if _in(d, forbidden))
    assert not bad, f"{importer} must not import {forbidden} ({why}):\n" + "\n".join(bad)


def test_only_the_cli_imports_the_cli(graph: dict[str, set[str]]) -> None:
    bad = sorted(f"{m} imports {d}" for m, deps in graph.items() if not _in(m, "harness.cli")
                 for d in deps if _in(d, "harness.cli"))
    assert not bad, "the command line sits on top; nothing below may import it:\n" + "\n".join(bad)


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components: any component with more than one module is a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, "import cycles (type-only and function-local imports count):\n" + \
        "\n".join(" ↔ ".join(c) for c in cycles)


def test_the_checker_sees_lazy_and_type_only_imports(tmp_path: Path) -> None:
    """The reader must not miss the two kinds of import the old cycles hid in."""
    source = tmp_path / "probe.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from harness.run.store import RunStore\n"
                      "def f():\n    from optimized import patching\n    import reference.quant\n    from .store import x\n")
    modules = {"harness.run.store": Path(), "optimized.patching": Path(), "reference.quant": Path(),
               "optimized": Path()}
    assert imports_of(source, modules, package="harness.run") == {"harness.run.store", "optimized.patching",
                                                                   "reference.quant"}
