"""The table of kill tests (docs/testing.md, "Tests"; README.md's until issue 47 made the README a
landing page): every test it cites exists, and what a row says of who runs each cited test, and
each of its parameters, is what pytest does with and without ``TWOPHASE_FULL_CHAOS=1``.

A "run by" cell is one or more claims separated by ``; `` (per group of tests where the tests
cell has groups separated by `` / `` and the cell as many): a claim starting with ``CI``, or one
naming `` `TWOPHASE_FULL_CHAOS=1` `` (only that runs it), followed by the parameters it is about in
backticks (`` CI (`hdfs`); `TWOPHASE_FULL_CHAOS=1` only (`kafka`, `files`) ``); a claim with no
parameters covers every parameter no other claim names.  What pytest does is read, not guessed:
the cited files are collected twice (tests/skipmap.py), with the variable set and without it,
each test's ``skipif`` marks evaluated as pytest evaluates them; a parameter not collected without
it (``test_ownership_processes.py``'s Kafka cases) is not run by CI either.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGE = REPO / "docs" / "testing.md"
FULL = "`TWOPHASE_FULL_CHAOS=1`"


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


def _claims(cell: str) -> list[tuple[bool, set[str]]]:
    """(run by CI?, the parameters it is about) of each claim of a run-by cell."""
    out = []
    for claim in cell.split("; "):
        if claim.startswith("CI"):
            ci = True
        elif FULL in claim:
            ci = False
        else:
            raise AssertionError(f"docs/testing.md: a run-by claim that says neither CI nor {FULL}: {claim!r}")
        out.append((ci, {p for p in re.findall(r"`([^`]+)`", claim) if p != FULL.strip("`")}))
    return out


def _collect(env_full: bool, files: list[str], tmp: Path) -> dict[str, bool]:
    """node id -> skipped by its marks, of the tests pytest collects from ``files``."""
    out = tmp / f"skipmap-{int(env_full)}.json"
    env = {k: v for k, v in os.environ.items() if k != "TWOPHASE_FULL_CHAOS"}
    if env_full:
        env["TWOPHASE_FULL_CHAOS"] = "1"
    p = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.skipmap", "-p", "no:cacheprovider",
                        "--collect-only", "-q", *files], cwd=REPO, env=dict(env, TWOPHASE_SKIPMAP=str(out)),
                       capture_output=True, text=True, timeout=600)
    assert out.exists(), p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> tuple[dict[str, bool], dict[str, bool]]:
    files = sorted({path for tests, _ in _rows() for path in re.findall(r"tests/[\w/]+\.py", tests)})
    tmp = tmp_path_factory.mktemp("skipmap")
    return _collect(False, files, tmp), _collect(True, files, tmp)


def _param(nodeid: str) -> str | None:
    m = re.search(r"\[(.*)\]$", nodeid)
    return m.group(1) if m else None


def test_the_kill_test_table_says_which_tests_and_parameters_ci_runs(collected):
    in_ci, in_full = collected
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
            claims = _claims(verdict)
            cited += len(refs)
            for path, name in refs:
                nodes = sorted(n for n in in_full if re.match(rf"{re.escape(path)}::{re.escape(name)}\w*(\[|$)", n))
                functions = {n.split("[")[0] for n in nodes}
                assert len(functions) == 1, f"docs/testing.md cites {path}::{name}, which names {sorted(functions)}"
                named = set().union(*(ps for _, ps in claims))
                for node in nodes:
                    param = _param(node)
                    said = [ci for ci, ps in claims if param in ps] or [ci for ci, ps in claims if not ps]
                    assert said, f"docs/testing.md: {run_by!r} says nothing of {node}"
                    runs = node in in_ci and not in_ci[node]
                    who = "CI" if said[0] else "only TWOPHASE_FULL_CHAOS=1"
                    assert said[0] == runs, f"docs/testing.md says {who} runs {node}; pytest " + (
                        "runs it in CI" if runs else "skips it (or does not collect it) without TWOPHASE_FULL_CHAOS")
                    checked += 1
                params = {_param(n) for n in nodes}
                assert named <= params, f"docs/testing.md names parameters {sorted(named - params)} of {functions}: none such"
        assert cited, tests
    assert checked >= 30
