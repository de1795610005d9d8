"""The sinks' registry: rebuild sinks from plain configs so operator tools can recover without the
user's Spark job, and find the Spark formats (``format("twophase-<kind>")``) the sinks serve.

A config is a JSON object ``{"sink": KIND, ...parameters}``.  Secrets are given by
reference, ``{"env": "VARIABLE"}`` (or ``{"file": "/path"}``), resolved only where a
connection is made.  Third-party sinks register under the entry-point group
``twophase.sinks`` (name = kind, value = ``module:Class``), their Spark formats under
``twophase.formats`` (name = kind, value = ``module:SparkFormat object``).

Both tables name modules by string: the core (``twophase/``) never imports a sink module.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
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


#: The Spark formats by kind (``format("twophase-<kind>")``): each sink owns the translation of
#: Spark's option names into its own configuration, one :class:`SparkFormat` per format.
BUILTIN_FORMATS = {
    "files": "twophase.sinks.spark_files:FORMAT",
    "jdbc": "twophase.sinks.spark_jdbc:FORMAT",
    "kafka": "twophase.sinks.spark_kafka:FORMAT",
}


@dataclass(frozen=True)
class SparkFormat:
    """One Spark format, ``format("twophase-<kind>")``, as its sink serves it: the options it reads
    and how they become a sink.  The data source module (``twophase.datasource``) is generic: it
    checks the options against these, plans, writes and commits; ``build`` is the translation.

    Option names are lower case (Spark hands options over lower-cased); ``build`` gets Spark's
    options (a mapping, lower-case keys) and refuses what it cannot mean with a
    :class:`~twophase.errors.ConfigurationError` naming the option."""

    kind: str
    build: Callable[[Mapping[str, str]], TwoPhaseCommitSink[Any, Any]]
    #: Options this format reads beyond the ones every format reads.
    known_options: frozenset[str] = frozenset()
    #: Prefixes of options passed through to the target's client, e.g. ``"kafka."``.
    passed_prefixes: tuple[str, ...] = ()
    #: Transactions a batch's plan allows, unless ``twophase.maxPartitions`` says otherwise.
    default_max_partitions: int = 200
    #: Complete output mode appends every row of the result each batch (as Spark's Kafka sink
    #: does); False: refused (it would replace the target's contents).
    appends_in_complete_mode: bool = False
    #: What the format is, for its data source class's docstring.
    doc: str = ""

    @property
    def name(self) -> str:
        return f"twophase-{self.kind}"


def _registered(table: dict[str, str], group: str, kind: str, what: str) -> Any:
    """``module:attr`` of ``kind`` in ``table``, else in the entry-point ``group``, imported."""
    target = table.get(kind)
    if target is None:
        for ep in entry_points(group=group):
            if ep.name == kind:
                target = ep.value
                break
    if target is None:
        raise ConfigurationError(
            f"unknown {what} {kind!r}; built in: {', '.join(sorted(table))} "
            f"(third-party sinks register the entry point group {group!r})")
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def sink_class(kind: str) -> type[TwoPhaseCommitSink[Any, Any]]:
    return _registered(BUILTIN_SINKS, "twophase.sinks", kind, "sink kind")


def format_kinds() -> list[str]:
    """The kinds of every Spark format: the built-in ones, then those of entry points."""
    return list(BUILTIN_FORMATS) + [ep.name for ep in entry_points(group="twophase.formats")
                                    if ep.name not in BUILTIN_FORMATS]


def spark_format(kind: str) -> SparkFormat:
    """The :class:`SparkFormat` of ``format("twophase-<kind>")``."""
    spec = _registered(BUILTIN_FORMATS, "twophase.formats", kind, "Spark format")
    if not isinstance(spec, SparkFormat) or spec.kind != kind:
        raise ConfigurationError(f"the Spark format registered as {kind!r} is not a SparkFormat of that kind")
    return spec


def local_location(location: str) -> str:
    """Hadoop's qualified ``file:/x`` (how Spark hands over a local path) as a plain local path;
    other URLs unchanged."""
    if location.startswith("file:"):
        path = location[len("file:"):]
        return "/" + path.lstrip("/") if path.startswith("/") else path
    return location


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
