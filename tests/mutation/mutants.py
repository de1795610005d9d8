"""The curated list of mutants of safety lines (``mutants.toml`` beside this file), read and checked."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The list; ``TWOPHASE_MUTANTS`` names another (the gate's own tests use one of their own).
LIST = Path(os.environ.get("TWOPHASE_MUTANTS") or HERE / "mutants.toml")

#: Where each top folder of the checkout is imported from (pyproject's package-dir).
_PACKAGES = {"twophase": "twophase", "sinks": "twophase.sinks", "coordinator": "twophase.coordinator",
             "tests": "tests"}


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str
    find: str
    replace: str
    tests: tuple[str, ...]
    why: str
    #: Tests that also kill it but need what the gate does not run (Spark, a subprocess): named, for
    #: the reader; they run in the normal suite.
    also: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        parts = Path(self.file).with_suffix("").parts
        if parts[0] not in _PACKAGES:
            raise ValueError(f"mutant {self.id}: {self.file} is not under {', '.join(_PACKAGES)}")
        name = ".".join((_PACKAGES[parts[0]], *parts[1:]))
        return name[: -len(".__init__")] if name.endswith(".__init__") else name


def load(path: Path = LIST) -> list[Mutant]:
    data = tomllib.loads(path.read_text())
    out: list[Mutant] = []
    seen: set[str] = set()
    for entry in data.get("mutant", []):
        missing = {"id", "file", "find", "replace", "tests", "why"} - set(entry)
        if missing:
            raise ValueError(f"{path}: a mutant lacks {sorted(missing)}: {entry}")
        m = Mutant(id=entry["id"], file=entry["file"], find=entry["find"], replace=entry["replace"],
                   tests=tuple(entry["tests"]), why=entry["why"], also=tuple(entry.get("also", ())))
        if m.id in seen:
            raise ValueError(f"{path}: mutant id {m.id} twice")
        if m.find == m.replace or not m.tests:
            raise ValueError(f"{path}: mutant {m.id} changes nothing or names no test")
        seen.add(m.id)
        out.append(m)
    return out
