"""Rebuild sinks from plain configs so operator tools can recover without the user's Spark job.

A config is a JSON object ``{"sink": KIND, ...parameters}``.  Secrets are given by
reference, ``{"env": "VARIABLE"}`` (or ``{"file": "/path"}``), resolved only where a
connection is made.  Third-party sinks register under the entry-point group
``twophase.sinks`` (name = kind, value = ``module:Class``).
"""

from __future__ import annotations

import importlib
import json
import os
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from twophase.errors import ConfigurationError

BUILTIN_SINKS = {
    "files": "twophase.sinks.files:FileSink",
    "kafka": "twophase.sinks.kafka:KafkaSink",
    "postgres": "twophase.sinks.postgres:PostgresSink",
}


def sink_class(kind: str) -> type:
    target = BUILTIN_SINKS.get(kind)
    if target is None:
        for ep in entry_points(group="twophase.sinks"):
            if ep.name == kind:
                target = ep.value
                break
    if target is None:
        raise ConfigurationError(
            f"unknown sink kind {kind!r}; built in: {', '.join(sorted(BUILTIN_SINKS))} "
            "(third-party sinks register the entry point group 'twophase.sinks')")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def sink_from_config(config: dict[str, Any] | str | Path):
    """Build a sink from a config dict, a JSON string, or a path to a JSON file."""
    if isinstance(config, Path) or (isinstance(config, str) and not config.lstrip().startswith("{")):
        try:
            config = json.loads(Path(config).read_text())
        except OSError as e:
            raise ConfigurationError(f"cannot read sink config {config}: {e.strerror}") from None
        except ValueError as e:
            raise ConfigurationError(f"sink config {config} is not JSON: {e}") from None
    elif isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError as e:
            raise ConfigurationError(f"sink config is not JSON: {e}") from None
    if not isinstance(config, dict) or "sink" not in config:
        raise ConfigurationError('a sink config is a JSON object with a "sink" field (e.g. "files")')
    return sink_class(config["sink"]).from_config(config)


def is_secret_ref(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ("env", "file")


def resolve_secret(value: Any, what: str = "secret") -> Any:
    """Resolve ``{"env": NAME}`` / ``{"file": PATH}``; other values are returned as they are."""
    if not is_secret_ref(value):
        return value
    if "env" in value:
        name = value["env"]
        if name not in os.environ:
            raise ConfigurationError(f"{what} is configured as environment variable {name!r}, which is not set")
        return os.environ[name]
    path = value["file"]
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ConfigurationError(f"{what} is configured as file {path!r}, which cannot be read: {e.strerror}") from None
