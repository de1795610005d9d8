"""Import optional dependencies with an error that names the ``pip install`` that fixes it."""

from __future__ import annotations

import importlib
from types import ModuleType

from twophase.errors import MissingDependencyError

_EXTRA = {
    "confluent_kafka": "kafka",
    "kafka": "kafka",
    "psycopg2": "postgres",
    "s3fs": "s3",
    "hdfs": "hdfs",
    "pyspark": "spark",
    "hypothesis": "testing",
}


def require(module: str, feature: str) -> ModuleType:
    """Return the imported module, or raise MissingDependencyError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        top = module.split(".")[0]
        extra = _EXTRA.get(top, "all")
        raise MissingDependencyError(
            f"{feature} needs the Python package {top!r}, which is not installed: "
            f"pip install 'twophase[{extra}]'"
        ) from e
