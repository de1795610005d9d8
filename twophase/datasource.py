"""Exactly-once sinks by name: ``writeStream.format("twophase-files")`` (issue 28; design and the
facts it rests on: docs/datasource.md).

Spark's Python Data Source API runs a sink's Python in three places, none of them the user's
driver process: a *planner* worker of the driver JVM plans each micro-batch
(``DataSource(options).streamWriter(...)``), each task runs ``write()`` on its copy of that
writer, and another planner worker runs ``commit(messages, batch_id)`` on a writer made afresh.
The coordinator's protocol (:class:`twophase.protocol.TwoPhaseProtocol`) is split the same way:

- plan: recovery of earlier batches, then a ballot of batch *N* opened (its INTENT logged);
  *N* is read from the checkpoint's ``offsets/`` (Spark writes ``offsets/N`` before it plans
  batch *N*) and checked by every task against Spark's own ``streaming.sql.batchId``;
- tasks: one transaction per partition, pre-committed; the handle goes back in the message;
- commit: the decision (the ballot's slot), the commits, COMMITTED.

No process lives across batches, so there is no lease holder: every plan takes a new epoch of
the log, and a deposed run's late writes lose on the ballots' slots as a deposed coordinator's do.

Where each part lives: the plan step, the options every format shares, :class:`Plan` and
:class:`TaskMessage` in :mod:`twophase.datasource_plan`; :class:`TwoPhaseDataSource` and its
writers (the tasks' ``write``, the commit step) in :mod:`twophase.datasource_writer`; here, what
the user's process and Spark's discovery import: the format classes by name (made here by
:func:`data_source`: Spark pickles them by reference to this module), :func:`register`, and the
streaming writer's wrapping that checks a query's options and coalesces its micro-batches at
``start()`` (:func:`wrap_stream_writers`).
"""

from __future__ import annotations

import importlib
import logging
import re
from typing import Any

from twophase.config import (  # formats by kind, found by string: the core never imports a sink module
    BUILTIN_FORMATS,
    format_kinds,
)

# The plan step and the writers live in modules of their own; every name of theirs that code,
# tests and benchmarks import from this module is re-exported here.
from twophase.datasource_plan import _CHECKED as _CHECKED
from twophase.datasource_plan import _COMMON as _COMMON
from twophase.datasource_plan import Plan as Plan
from twophase.datasource_plan import TaskMessage as TaskMessage
from twophase.datasource_plan import _committer as _committer
from twophase.datasource_plan import _current_batch as _current_batch
from twophase.datasource_plan import _open as _open
from twophase.datasource_plan import _plan as _plan
from twophase.datasource_plan import _Settings
from twophase.datasource_writer import TwoPhaseDataSource
from twophase.datasource_writer import _BatchWriter as _BatchWriter
from twophase.datasource_writer import _Steps as _Steps
from twophase.datasource_writer import _StreamWriter as _StreamWriter
from twophase.errors import ConfigurationError, MissingDependencyError
from twophase.sink import TwoPhaseCommitSink

log = logging.getLogger("twophase.datasource")


def _class_name(kind: str) -> str:
    return "".join(p.capitalize() for p in re.split(r"[^0-9A-Za-z]+", kind) if p) + "DataSource"


def data_source(kind: str) -> type[TwoPhaseDataSource]:
    """The data source class of ``format("twophase-<kind>")``, made from the registry's entry the
    first time: a class of this module by name (``FilesDataSource`` for ``files``), as Spark
    pickles it by reference (a worker that imports this module makes it again)."""
    name = _class_name(kind)
    cls = globals().get(name)
    if not (isinstance(cls, type) and issubclass(cls, TwoPhaseDataSource) and cls.kind == kind):
        cls = type(name, (TwoPhaseDataSource,), {"kind": kind, "__module__": __name__, "__qualname__": name})
        globals()[name] = cls
    return cls


def sources() -> tuple[type[TwoPhaseDataSource], ...]:
    """The data source of every format in the registry (built in, then entry points'); a
    third-party format that fails to load is left out with a warning (this module must import
    wherever pyspark does: Spark's discovery imports it)."""
    out = []
    for kind in format_kinds():
        try:
            out.append(data_source(kind))
        except Exception as e:  # noqa: BLE001 - a broken plugin must not take the others down
            if kind in BUILTIN_FORMATS:
                raise
            log.warning("twophase: the Spark format twophase-%s cannot be loaded (%s: %s)", kind,
                        type(e).__name__, e)
    return tuple(out)


#: Every registered format's class, made at import: a worker unpickling one by reference finds it.
SOURCES = sources()
#: The built-in formats' classes under their names (discovery/, tests and benchmarks import them).
FilesDataSource, JdbcDataSource, KafkaDataSource = (data_source(k) for k in ("files", "jdbc", "kafka"))


def register(spark) -> None:
    """Register the twophase data sources with ``spark`` (a classic or Spark Connect session), and
    wrap this process's streaming writers (see :func:`wrap_stream_writers`): a query on a
    ``twophase-*`` format gets its ``.partitionBy(...)``, its options checked at ``start()`` and
    its micro-batches coalesced to the application's cores."""
    for cls in sources():
        spark.dataSource.register(cls)
    wrap_stream_writers()


#: The option a streaming writer's ``.partitionBy(...)`` columns reach a twophase format as.
PARTITION_BY_OPTION = "twophase.partitionBy"
#: ``auto`` (default): each micro-batch's partitions are coalesced (no shuffle) to the
#: application's default parallelism (its cores), at most ``twophase.maxPartitions``; an integer N:
#: to N; ``off``: left as Spark made them.
COALESCE_OPTION = "twophase.coalesce"
_WRAPPED: set[Any] = set()


def _source_of(fmt: Any) -> type[TwoPhaseDataSource] | None:
    name = str(fmt or "").lower()
    kind = name[len("twophase-"):] if name.startswith("twophase-") else None
    return data_source(kind) if kind in format_kinds() else None


def _coalesce_to(spark: Any, cls: type[TwoPhaseDataSource], options: dict[str, str],
                 sink: TwoPhaseCommitSink[Any, Any] | None = None) -> int | None:
    """The partition count a query's micro-batches are coalesced to (None: left as they are).

    Spark puts ``spark.sql.shuffle.partitions`` (200 by default) after every aggregation, join and
    deduplication; a Python data source runs one Python task, and so one transaction, per
    partition (about 45 ms each on 2 cores, docs/datasource.md), and cannot ask Spark for fewer
    (pyspark's Python writers request no distribution).  Coalescing the query's DataFrame before
    the write is a narrow dependency: the stateful operators keep their partitions (and state
    stores), computed by fewer tasks.

    At most ``twophase.maxPartitions`` and what the target allows
    (:meth:`~twophase.TwoPhaseCommitSink.max_parallelism`, e.g. PostgreSQL's
    ``max_prepared_transactions / 2``): see :func:`_target_cap`."""
    raw = str(options.get(COALESCE_OPTION.lower(), "auto")).strip().lower()
    if raw in ("off", "false", "none", "no"):
        return None
    settings_max = options.get("twophase.maxpartitions")
    try:
        cap = int(settings_max) if settings_max else cls.default_max_partitions
    except ValueError:
        cap = cls.default_max_partitions  # _Settings refuses it with its own line
    if raw != "auto":
        try:
            n = int(raw)
        except ValueError:
            n = 0
        if n < 1:
            raise ConfigurationError(f"{COALESCE_OPTION} must be auto, off or a positive integer, got {raw!r}")
        if n > cap:
            raise ConfigurationError(f"{COALESCE_OPTION}={n} is more than twophase.maxPartitions={cap} (the "
                                     "transactions a batch's plan allows): lower one or raise the other")
    target = _target_cap(spark, sink)
    if raw != "auto":
        if target is not None and n > target:
            raise ConfigurationError(f"{COALESCE_OPTION}={n} is more than the {target} transactions a batch may "
                                     "open at the target (e.g. PostgreSQL's max_prepared_transactions / 2): lower it")
        return n
    from twophase.spark import default_parallelism

    return max(1, min(default_parallelism(spark), cap, target or cap))


def _target_cap(spark: Any, sink: TwoPhaseCommitSink[Any, Any] | None) -> int | None:
    """What the target allows a batch (``max_parallelism()``, known after ``open()``), where the
    sink has such a limit and this process is a classic driver (Spark's planner workers, which
    open the sink at each plan, run beside it: it reaches the target).  A Spark Connect client may
    not reach it: there the plan's own check stands (a task beyond it fails naming the remedy)."""
    from twophase.spark import is_connect

    if sink is None or type(sink).max_parallelism is TwoPhaseCommitSink.max_parallelism or is_connect(spark):
        return None
    sink.open()
    try:
        return sink.max_parallelism()
    finally:
        close = getattr(sink, "close", None)
        if close is not None:
            close()


def _check_at_start(cls: type[TwoPhaseDataSource], options: dict[str, str],
                    output_mode: str | None) -> TwoPhaseCommitSink[Any, Any] | None:
    """What the plan of the first micro-batch would refuse, refused by ``start()`` instead (a query
    that gets no data would otherwise never fail): unknown options, the output mode, the sink's
    own settings.  Nothing here connects to the target (a Spark Connect client may not reach it,
    nor have its driver); the first plan checks the target itself (``open()``).  Returns the sink
    built from the options (None where this process lacks its driver)."""
    source = cls(dict(options))
    source._check_options()
    if (output_mode or "append").lower() == "complete" and not cls.appends_in_complete_mode:
        raise ConfigurationError(
            f"twophase-{cls.kind} writes in Append output mode only (Complete would replace the "
            "target's contents each batch); use outputMode('append')")
    if options.get("checkpointlocation"):
        _Settings(options, cls.kind, cls.default_max_partitions)
    try:
        return source.build_sink()
    except MissingDependencyError as e:
        # A Spark Connect client need not have the target's driver (psycopg2, ...): its server's
        # planner workers build the sink, and the first plan checks it there.
        log.info("twophase-%s: the sink's settings are checked by the first plan (%s)", cls.kind, e)
        return None


def _coalesced(writer: Any, n: int) -> bool:
    """Make ``writer`` (a classic or Spark Connect DataStreamWriter, options set) write its
    DataFrame coalesced to ``n`` partitions.  False where this pyspark's writer cannot be changed
    (the query then runs on Spark's partitions; more than the plan allows fail with a line that
    names the remedy)."""
    try:
        if hasattr(writer, "_write_stream"):  # Spark Connect: the command's input plan
            from pyspark.sql.connect import plan as connect_plan

            op = writer._write_stream
            op._child = connect_plan.Repartition(op._child, num_partitions=n, shuffle=False)
            return True
        # Classic: the JVM writer keeps its Dataset in a final field; every setting made so far
        # (format, options, trigger, mode, ...) lives in the others, so only the Dataset changes.
        coalesced = writer._df.coalesce(n)
        field = writer._jwrite.getClass().getDeclaredField("ds")
        field.setAccessible(True)
        field.set(writer._jwrite, coalesced._jdf)
        writer._df = coalesced
        return True
    except Exception as e:  # noqa: BLE001 - another pyspark: say so, and run uncoalesced
        log.warning("twophase: cannot coalesce this query's micro-batches (%s: %s); give df.coalesce(N) "
                    "before writeStream if Spark makes more partitions than twophase.maxPartitions",
                    type(e).__name__, e)
        return False


def wrap_stream_writers() -> None:
    """Wrap ``DataStreamWriter`` (classic and Spark Connect) for the ``twophase-*`` formats; other
    formats are untouched.  Idempotent; :func:`register` calls it.  A query started on a
    twophase format:

    - gets its ``.partitionBy(...)`` columns as the option ``twophase.partitionBy`` (Spark drops
      a streaming writer's partitioning before a Python data source sees it; ``twophase-files``
      would silently write unpartitioned);
    - has its options checked by ``start()`` (see :func:`_check_at_start`);
    - has its micro-batches coalesced to ``twophase.coalesce`` partitions (:func:`_coalesce_to`),
      and the plan sized to that many transactions (``twophase.maxPartitions``).
    """
    import functools

    classes: list[Any] = []
    for mod in ("pyspark.sql.streaming.readwriter", "pyspark.sql.connect.streaming.readwriter"):
        try:
            classes.append(importlib.import_module(mod).DataStreamWriter)
        except Exception:  # noqa: BLE001 - e.g. Connect's extra not installed
            continue
    for cls in classes:
        if cls in _WRAPPED:
            continue
        _WRAPPED.add(cls)

        def recorder(name: str, record: Any, cls: Any = cls) -> None:
            orig = getattr(cls, name)

            @functools.wraps(orig)
            def recording(self, *args, _orig=orig, **kwargs):
                record(self, *args, **kwargs)
                return _orig(self, *args, **kwargs)

            setattr(cls, name, recording)

        def set_format(self, source):
            self._twophase_format = source

        def set_option(self, key, value):
            self.__dict__.setdefault("_twophase_options", {})[str(key).lower()] = value

        def set_options(self, **options):
            for k, v in options.items():
                set_option(self, k, v)

        def set_mode(self, mode):
            self._twophase_mode = str(mode)

        def set_trigger(self, *args, **kwargs):
            self._twophase_continuous = bool(kwargs.get("continuous"))

        def set_partition_by(self, *cols):
            self._twophase_partition_by = list(cols[0] if len(cols) == 1 and isinstance(cols[0], (list, tuple))
                                               else cols)

        for name, record in (("format", set_format), ("option", set_option), ("options", set_options),
                             ("outputMode", set_mode), ("partitionBy", set_partition_by), ("trigger", set_trigger)):
            recorder(name, record)

        orig_start = cls.start

        @functools.wraps(orig_start)
        def start(self, path=None, format=None, outputMode=None, partitionBy=None, queryName=None,  # noqa: A002, N803
                  _orig=orig_start, **options):
            source = _source_of(format or getattr(self, "_twophase_format", None))
            if source is not None:
                if getattr(self, "_twophase_continuous", False):
                    raise ConfigurationError(
                        f"twophase-{source.kind} writes micro-batches only (a continuous trigger is not supported: "
                        "use processingTime or availableNow)")
                opts = {k: str(v) for k, v in getattr(self, "_twophase_options", {}).items()}
                opts.update({k.lower(): str(v) for k, v in options.items()})
                if path is not None:
                    opts["path"] = str(path)
                cols = [partitionBy] if isinstance(partitionBy, str) else partitionBy
                cols = cols if cols is not None else getattr(self, "_twophase_partition_by", None)
                if cols:
                    self.option(PARTITION_BY_OPTION, ",".join(str(c) for c in cols))
                    opts[PARTITION_BY_OPTION.lower()] = ",".join(str(c) for c in cols)
                sink = _check_at_start(source, opts, outputMode or getattr(self, "_twophase_mode", None))
                spark = getattr(self, "_spark", None) or getattr(self, "_session", None)
                n = _coalesce_to(spark, source, opts, sink)
                if n is not None and _coalesced(self, n):
                    log.info("twophase-%s: each micro-batch is coalesced to %d partitions (%s)", source.kind, n,
                             COALESCE_OPTION)
                    if "twophase.maxpartitions" not in opts:
                        self.option("twophase.maxPartitions", str(n))  # the plan: n transactions, not the default
            return _orig(self, path, format, outputMode, partitionBy, queryName, **options)

        cls.start = start


#: Earlier name of :func:`wrap_stream_writers`.
carry_partition_by = wrap_stream_writers
