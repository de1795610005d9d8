"""The table of kill tests (docs/testing.md, "Tests"; README.md's until issue 47 made the README a
landing page): every test it cites exists, and a row that says CI runs a test cites no test that
only ``TWOPHASE_FULL_CHAOS=1`` runs, and the other way round."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CI, FULL_ONLY = "CI", "`TWOPHASE_FULL_CHAOS=1` only"
PAGE = REPO / "docs" / "testing.md"


def _rows() -> list[tuple[str, str]]:
    """(tests cell, run-by cell) of each row of the table whose header is ``| claim | test | run by |``."""
    lines = PAGE.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "| claim | test | run by |")
    rows = []
    for line in lines[start + 2:]:
        line = line.strip()
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split(" | ")]
        assert len(cells) == 3, line
        rows.append((cells[1], cells[2]))
    return rows


def _refs(cell: str, current: str | None) -> tuple[list[tuple[str, str]], str | None]:
    """``tests/x.py::name`` references in ``cell`` (``::name`` continues the last file named; a
    name ending in ``...`` is a prefix), and the last file named."""
    out = []
    for m in re.finditer(r"`(tests/[\w/]+\.py)?::(\w+?)_?(?:\.\.\.)?`", cell):
        current = m.group(1) or current
        assert current, cell
        out.append((current, m.group(2)))
    return out, current


def _function(path: str, prefix: str) -> ast.FunctionDef:
    tree = ast.parse((REPO / path).read_text())
    found = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(prefix)]
    assert len(found) == 1, f"docs/testing.md cites {path}::{prefix}, which names {[n.name for n in found]}"
    return found[0]


def _full_only(fn: ast.FunctionDef) -> bool:
    """Skipped unless TWOPHASE_FULL_CHAOS is set: a ``skipif`` decorator of the function itself on it
    (a parametrize whose one case is skipped is not)."""
    return any(ast.unparse(d).startswith("pytest.mark.skipif(") and "TWOPHASE_FULL_CHAOS" in ast.unparse(d)
               for d in fn.decorator_list)


def test_the_readme_kill_test_table_says_which_tests_ci_runs():
    rows = _rows()
    assert len(rows) >= 10
    checked = 0
    for tests, run_by in rows:
        groups, verdicts = tests.split(" / "), run_by.split(" / ")
        if len(groups) != len(verdicts):  # one verdict for the whole cell
            groups, verdicts = [tests], [run_by]
        current = None
        cited = 0
        for group, verdict in zip(groups, verdicts):
            refs, current = _refs(group, current)
            cited += len(refs)
            for path, name in refs:
                fn = _function(path, name)
                if verdict == CI:
                    assert not _full_only(fn), f"docs/testing.md says CI runs {path}::{fn.name}; only TWOPHASE_FULL_CHAOS=1 does"
                    checked += 1
                elif verdict == FULL_ONLY:
                    assert _full_only(fn), f"docs/testing.md says only TWOPHASE_FULL_CHAOS=1 runs {path}::{fn.name}; CI does"
                    checked += 1
        assert cited, tests
    assert checked >= 10
