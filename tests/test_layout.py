"""The house rules of the product code (twophase/, sinks/, coordinator/), checked on the tree:
no module over MAX_LINES lines, and no import circle between product modules.

An import counts where it is written at a module's top level, inside ``if TYPE_CHECKING:`` too (a
circle only type checkers follow is still one a reader must untangle); imports inside functions
are left out (they run late, by design).  ``sinks/`` and ``coordinator/`` install as
``twophase.sinks`` and ``twophase.coordinator`` (pyproject.toml), so they are named so here.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where product code lives, and the package name each folder installs as.
ROOTS = {"twophase": "twophase", "sinks": "twophase.sinks", "coordinator": "twophase.coordinator"}
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in ROOTS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = list(path.relative_to(REPO / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


def _top_level_imports(tree: ast.Module, module: str, is_package: bool, modules: set[str] | None = None) -> set[str]:
    """Modules named by the imports at ``tree``'s top level (and in its top-level if/try blocks).
    ``from pkg import sub`` names ``pkg.sub`` alone where ``pkg.sub`` is one of ``modules`` (a
    submodule: its package's ``__init__`` runs first in any case, but nothing of it is read), and
    ``pkg`` for any other name (read from the package's ``__init__``)."""
    names: set[str] = set()
    stack: list[ast.stmt] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base + ([node.module] if node.module else []))
            else:
                prefix = node.module or ""
            for a in node.names:
                sub = f"{prefix}.{a.name}"
                names.add(sub if modules is not None and sub in modules else prefix)
                if modules is None:
                    names.add(sub)
        elif isinstance(node, (ast.If, ast.Try)):
            for block in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", [])),
                          getattr(node, "finalbody", [])):
                stack.extend(block)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        imported = _top_level_imports(ast.parse(path.read_text()), name, path.name == "__init__.py", set(modules))
        graph[name] = {m for m in imported if m in modules and m != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_product_module_is_over_the_line_limit():
    long = {str(p.relative_to(REPO)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"product modules over {MAX_LINES} lines (split them by where their code runs): {long}"


def test_no_import_circle_between_product_modules():
    assert _circles(_graph()) == []


def test_the_circle_check_finds_a_circle_through_a_type_checking_import_and_a_package():
    graph = {"a": {"b"}, "b": {"c.d"}, "c.d": {"a"}, "e": {"a"}}
    assert _circles(graph) == [["a", "b", "c.d"]]
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import x\n"
                     "from .y import z\ndef f():\n    import twophase.late\n")
    assert _top_level_imports(tree, "twophase.sinks", True) == {
        "typing", "typing.TYPE_CHECKING", "twophase.sinks", "twophase.sinks.x", "twophase.sinks.y",
        "twophase.sinks.y.z"}
    assert "twophase.late" not in _top_level_imports(tree, "twophase.sinks.kafka", False)
    known = {"twophase.sinks", "twophase.sinks.x", "twophase.sinks.y"}
    assert _top_level_imports(tree, "twophase.sinks", True, known) == {
        "typing", "twophase.sinks.x", "twophase.sinks.y"}
