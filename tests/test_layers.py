"""The layers point one way: the core package (``twophase/``: protocol, log, recovery, storage)
never imports a sink or the coordinator, not even lazily inside a function.

Checked by parsing every module under ``twophase/`` with ``ast`` (so imports inside
functions count), without importing anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parent.parent / "twophase"
#: The upper layers, also by their source folders' names (``sinks``, ``coordinator`` import as
#: top-level packages when the checkout is on ``sys.path``).
UPPER = ("twophase.sinks", "twophase.coordinator", "sinks", "coordinator")
#: Applications on top of the whole stack that still live in the core directory.  ``demo.py``
#: is the ``twophase demo`` command (Spark + FileSink + Coordinator); it is not imported by
#: any core module but the CLI's ``demo`` subcommand.  Remove it from here when it moves out.
#: ``testing/explorer/`` (a package: every module in it) and ``testing/kafka_model.py`` (with its
#: ``kafka_model_broker.py`` and ``kafka_model_clients.py``) run the schedule
#: explorer over the *shipped* FileSink and KafkaSink (issue 59: the explorer checks the code we ship)
#: and a model of the broker behind KafkaSink's client seams; no core module imports them.
APPLICATIONS = {"demo.py", "testing/explorer/", "testing/kafka_model.py", "testing/kafka_model_broker.py",
                "testing/kafka_model_clients.py"}


def _module_name(path: Path) -> str:
    rel = path.relative_to(CORE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, module: str | None = None) -> list[tuple[int, str]]:
    """Every module an ``import`` statement in ``path`` names, at any depth, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = module or _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                mod = f"{base}.{node.module}" if node.module else base
            else:
                mod = node.module or ""
            out.append((node.lineno, mod))
            # ``from twophase import sinks`` names the sink package as an attribute
            out += [(node.lineno, f"{mod}.{a.name}") for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id in ("import_module", "__import__"))
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):  # importlib.import_module("twophase.sinks.files"), __import__(...)
            out.append((node.lineno, node.args[0].value))
    return out


def _application(rel: str) -> bool:
    """``rel`` (a path under ``twophase/``) is an application's: an entry ending in ``/`` is a folder."""
    return any(rel == a or (a.endswith("/") and rel.startswith(a)) for a in APPLICATIONS)


def core_modules() -> list[Path]:
    return sorted(
        p for p in CORE.rglob("*.py") if not _application(p.relative_to(CORE).as_posix())
    )


def test_core_never_imports_a_sink_or_the_coordinator():
    bad = [
        f"{p.relative_to(CORE.parent)}:{line}: imports {mod}"
        for p in core_modules()
        for line, mod in _imports(p)
        if any(mod == u or mod.startswith(u + ".") for u in UPPER)
    ]
    assert not bad, "the core must not depend on sinks or the coordinator:\n" + "\n".join(bad)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    """The parse finds a lazy import (as log.py once had for the HDFS and S3 stores)."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "def f():\n    from twophase.sinks import files\n    from ..coordinator import x\n"
    )
    found = _imports(sample, "twophase.storage.probe")
    assert (2, "twophase.sinks.files") in found
    assert (3, "twophase.coordinator") in found


def test_the_checker_sees_imports_by_name(tmp_path):
    """``importlib.import_module`` and ``__import__`` with a literal module name count too, and so
    does the source folder's own name."""
    sample = tmp_path / "probe.py"
    sample.write_text(
        "import importlib\n"
        "def f():\n"
        "    importlib.import_module('twophase.sinks.files')\n"
        "    __import__('coordinator.coordinator')\n"
        "    import sinks.files\n"
    )
    found = _imports(sample, "twophase.storage.probe")
    bad = [m for _, m in found if any(m == u or m.startswith(u + ".") for u in UPPER)]
    assert sorted(bad) == ["coordinator.coordinator", "sinks.files", "twophase.sinks.files"]


def test_the_storage_table_names_only_storage_modules():
    """The backend table (log, FileSink, CLI all pick their backend there) imports by name: every
    module it names is in twophase.storage, and FileSink's part files live beside each backend."""
    from twophase.storage import BACKENDS
    from twophase.storage.parts import PartFiles

    for scheme, b in BACKENDS.items():
        assert b.module.startswith("twophase.storage."), (scheme, b.module)
        if b.files is not None:
            assert issubclass(b.load(b.files), PartFiles), (scheme, b.files)
    assert {b.name for b in BACKENDS.values() if b.files} == {"local", "hdfs", "s3"}


def test_storage_never_imports_the_log():
    """Storage backends sit below the log: the log imports them, never the other way round."""
    bad = [
        f"{p.relative_to(CORE.parent)}:{line}: imports {mod}"
        for p in sorted((CORE / "storage").rglob("*.py"))
        for line, mod in _imports(p)
        if mod in ("twophase.log", "twophase.recovery") or mod.startswith(("twophase.log.", "twophase.log_"))
    ]
    assert not bad, "\n".join(bad)
