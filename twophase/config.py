"""Rebuild sinks from plain configs so operator tools can recover without the user's Spark job.

A config is a JSON object ``{"sink": KIND, ...parameters}``.  Secrets are given by
reference, ``{"env": "VARIABLE"}`` (or ``{"file": "/path"}``), resolved only where a
connection is made.  Third-party sinks register under the entry-point group
``twophase.sinks`` (name = kind, value = ``module:Class``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import TYPE_CHECKING, Any

from twophase.errors import ConfigurationError

if TYPE_CHECKING:
    from twophase.sink import TwoPhaseCommitSink

BUILTIN_SINKS = {
    "files": "twophase.sinks.files:FileSink",
    "kafka": "twophase.sinks.kafka:KafkaSink",
    "postgres": "twophase.sinks.postgres:PostgresSink",
    "mysql": "twophase.sinks.mysql:MySqlSink",
}


def sink_class(kind: str) -> type[TwoPhaseCommitSink[Any, Any]]:
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
    kind = config["sink"]
    cls = sink_class(kind)
    check_params(cls, kind, {k: v for k, v in config.items() if k != "sink"})
    try:
        return cls.from_config(config)
    except (TypeError, ValueError) as e:  # what the signature check could not see
        raise ConfigurationError(f"{kind} sink config: {e}") from None


_TYPE_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string",
               list: "a list", tuple: "a list", dict: "an object"}


def check_params(
    cls: type[TwoPhaseCommitSink[Any, Any]], kind: str, params: dict[str, Any]
) -> None:
    """Refuse unknown, missing and mistyped parameters of a sink config with one line naming the field.

    Types are checked against the constructor's defaults (a parameter defaulting to ``5``
    takes an integer); a secret reference ``{"env": ...}`` is accepted wherever a value is.
    Values are never echoed (they may be secrets).
    """
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return
    fields = {n: p for n, p in sig.parameters.items() if n != "self"
              and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        for k in params:
            if k not in fields:
                close = difflib.get_close_matches(k, list(fields), n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigurationError(f"{kind} sink config: unknown parameter {k!r}{hint} "
                                         f"(accepted: {', '.join(fields)})")
    for n, p in fields.items():
        if p.default is inspect.Parameter.empty and n not in params:
            raise ConfigurationError(f"{kind} sink config: parameter {n!r} is required")
        if n not in params or p.default in (inspect.Parameter.empty, None):
            continue
        value, want = params[n], type(p.default)
        if value is None or is_secret_ref(value) or want not in _TYPE_NAMES:
            continue
        ok = (isinstance(value, bool) if want is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else
              isinstance(value, int) and not isinstance(value, bool) if want is int else
              isinstance(value, (list, tuple)) if want in (list, tuple) else isinstance(value, want))
        if not ok:
            raise ConfigurationError(f"{kind} sink config: parameter {n!r} must be {_TYPE_NAMES[want]}, "
                                     f"got {_json_type(value)}")


def _json_type(value: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(value), type(value).__name__)


def is_secret_ref(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and next(iter(value)) in ("env", "file")


def _in_spark_task() -> bool:
    """True inside a Spark task (pyspark loaded and a TaskContext current)."""
    pyspark = sys.modules.get("pyspark")
    return pyspark is not None and pyspark.TaskContext.get() is not None


def resolve_secret(value: Any, what: str = "secret") -> Any:
    """Resolve ``{"env": NAME}`` / ``{"file": PATH}``; other values are returned as they are."""
    if not is_secret_ref(value):
        return value
    if "env" in value:
        name = value["env"]
        if name not in os.environ:
            where = ""
            if _in_spark_task():
                where = (f" in this executor's environment (executors do not inherit the driver's: "
                         f"give it to them as spark.executorEnv.{name})")
            raise ConfigurationError(
                f"{what} is configured as environment variable {name!r}, which is not set{where}")
        return os.environ[name]
    path = value["file"]
    try:
        return Path(path).read_text().strip()
    except OSError as e:
        raise ConfigurationError(f"{what} is configured as file {path!r}, which cannot be read: {e.strerror}") from None
