"""Import optional dependencies with an error that names the ``pip install`` that fixes it.

The one place a missing optional package is reported: sinks, storage backends and the
testing harness all call :func:`require`, so every such error reads the same and names
the extra (``pip install 'twophase[s3]'``), never a bare ModuleNotFoundError.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from twophase.errors import MissingDependencyError

#: Top-level import name -> the extra of pyproject.toml that installs it.
_EXTRA = {
    "confluent_kafka": "kafka",
    "kafka": "kafka",
    "psycopg2": "postgres",
    "botocore": "s3",
    "hdfs": "hdfs",
    "requests": "hdfs",
    "pyspark": "spark",
    "grpc": "connect",
    "hypothesis": "testing",
}


def install_hint(module: str, extra: str | None = None) -> str:
    """The ``pip install`` line that brings ``module`` (``extra`` overrides the lookup)."""
    return f"pip install 'twophase[{extra or _EXTRA.get(module.split('.')[0], 'all')}]'"


def require(module: str, feature: str, extra: str | None = None) -> ModuleType:
    """Return the imported module, or raise MissingDependencyError naming the extra to install.

    ``feature`` says what needs it ("FileSink on s3://"); ``extra`` names the extra when
    the caller knows it (the storage registry does), else it is looked up by package.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        raise MissingDependencyError(
            f"{feature} needs the Python package {top!r}, which is not installed: "
            f"{install_hint(module, extra)}"
        ) from e
