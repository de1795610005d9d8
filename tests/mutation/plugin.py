"""A pytest plugin that runs the suite with one mutant of a safety line applied in memory.

``TWOPHASE_MUTANT=<id>`` names a mutant of ``tests/mutation/mutants.toml``; this plugin, loaded
with ``-p tests.mutation.plugin`` (before anything imports twophase), puts an import hook first on
``sys.meta_path`` that compiles the mutated module from its source with the one replacement made.
No file is touched: the checkout stays as it is, other processes see the real code, and the
module's ``__file__`` is the real path.  The replacement must match exactly once, else the module
fails to import with :class:`StaleMutant` (the list is out of date with the code: fix the list).

Only this process is mutated: a test that runs the code in another process (a driver
subprocess, a Spark worker) does not see the mutant, so the list names in-process tests.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

from tests.mutation.mutants import Mutant, load

REPO = Path(__file__).resolve().parents[2]


class StaleMutant(ImportError):
    """The mutant's text is not found exactly once in its file."""


class _MutatedLoader(importlib.machinery.SourceFileLoader):
    def __init__(self, fullname: str, path: str, mutant: Mutant) -> None:
        super().__init__(fullname, path)
        self.mutant = mutant

    def get_code(self, fullname: str) -> Any:
        source = Path(self.path).read_text()
        count = source.count(self.mutant.find)
        if count != 1:
            raise StaleMutant(f"mutant {self.mutant.id}: its text occurs {count} times in {self.mutant.file}, "
                              "not once; update tests/mutation/mutants.toml")
        mutated = source.replace(self.mutant.find, self.mutant.replace)
        return compile(mutated, self.path, "exec", dont_inherit=True)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, mutant: Mutant) -> None:
        self.mutant = mutant
        self.path = str((REPO / mutant.file).resolve())
        self.applied = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.mutant.module:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.origin is None or str(Path(spec.origin).resolve()) != self.path:
            raise StaleMutant(f"mutant {self.mutant.id}: {fullname} resolves to {spec and spec.origin}, "
                              f"not {self.path}")
        self.applied = True
        return importlib.util.spec_from_file_location(
            fullname, spec.origin, loader=_MutatedLoader(fullname, spec.origin, self.mutant),
            submodule_search_locations=spec.submodule_search_locations)


_finder: _Finder | None = None


def _install() -> None:
    global _finder
    ident = os.environ.get("TWOPHASE_MUTANT")
    if not ident:
        return
    mutants = {m.id: m for m in load()}
    if ident not in mutants:
        raise SystemExit(f"TWOPHASE_MUTANT={ident}: no such mutant in tests/mutation/mutants.toml")
    mutant = mutants[ident]
    if mutant.module in sys.modules:
        raise SystemExit(f"mutant {ident}: {mutant.module} was imported before the mutation plugin loaded")
    _finder = _Finder(mutant)
    sys.meta_path.insert(0, _finder)


_install()


def pytest_report_header(config: Any) -> str | None:
    if _finder is None:
        return None
    m = _finder.mutant
    return f"mutant {m.id}: {m.file}: {m.find.strip()[:60]!r} -> {m.replace.strip()[:60]!r}"


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if _finder is not None and not _finder.applied:
        # The tests never imported the mutated module: they cannot have killed it.
        sys.stderr.write(f"\nmutant {_finder.mutant.id}: {_finder.mutant.module} was never imported\n")
        session.exitstatus = 3
