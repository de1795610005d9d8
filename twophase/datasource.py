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
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from twophase import crash
from twophase._deps import require
from twophase.config import (  # formats by kind, found by string: the core never imports a sink module
    BUILTIN_FORMATS,
    SparkFormat,
    format_kinds,
    local_location,
    spark_format,
)
from twophase.errors import ConfigurationError, MissingDependencyError, TwoPhaseError
from twophase.log import TransactionLog, batch_query_id, open_store
from twophase.protocol import BatchProgress, OpenedBallot, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink

require("pyspark.sql.datasource", "the twophase data sources (format('twophase-...'))", "spark")
from pyspark.sql.datasource import (  # noqa: E402 - after the line that names the extra to install
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

log = logging.getLogger("twophase.datasource")

#: Options every twophase data source reads (lower case: Spark hands options over lower-cased).
#: ``queryname``: Spark hands a streaming query's ``.queryName(...)`` to its sink as an option; it
#: names the query in Spark's UI and metrics and changes nothing here.
_COMMON = {"checkpointlocation", "path", "twophase.name", "twophase.loglocation", "twophase.maxpartitions",
           "twophase.batchid", "queryname", "twophase.partitionby", "twophase.coalesce"}


@dataclass
class Plan:
    """What the plan of one micro-batch decided, carried to every task (in the pickled writer) and
    back to the commit step (in every task's message)."""

    batch_id: int
    action: str  # "write": a ballot of ours is open; "skipped" / "recommitted": decided before
    query_id: str
    log_location: str
    name: str
    query_name: str = ""
    number: int = 0
    intent: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    epoch: int | None = None
    owner: str = ""
    generation: int | None = None
    partitions: int = 0
    planned_at: float = 0.0

    def opened(self) -> OpenedBallot:
        return OpenedBallot(self.batch_id, self.number, self.intent, self.run, self.query_name)


@dataclass
class TaskMessage(WriterCommitMessage):
    """One task's result: its transaction's handle (the sink's envelope, JSON), or None when it
    wrote nothing (an empty partition, or a batch decided before)."""

    plan: dict[str, Any]
    partition: int
    attempt: int
    rows: int
    handle: str | None


class _Settings:
    """The options every twophase data source shares, checked once.  A streaming write keeps its
    log in ``<checkpointLocation>/twophase`` and learns each batch's id from Spark; a batch write
    (``df.write``) names both: ``twophase.logLocation`` and ``twophase.batchId``."""

    def __init__(self, options: Any, kind: str, default_max_partitions: int = 200, *, streaming: bool = True):
        self.streaming = streaming
        #: These options' fingerprint (a hash: they may hold secrets), for _open.
        self.fingerprint = hashlib.sha256(json.dumps([kind, sorted((str(k), str(v)) for k, v in options.items())])
                                          .encode()).hexdigest()
        self.checkpoint = local_location(options["checkpointlocation"]) if options.get("checkpointlocation") else None
        log_location = options.get("twophase.loglocation")
        self.batch_id: int | None = None
        if streaming:
            if not self.checkpoint:
                raise ConfigurationError(
                    f"twophase-{kind} needs .option('checkpointLocation', ...): its transaction log lives "
                    "there (<checkpointLocation>/twophase) and it reads each micro-batch's id from Spark's "
                    "offsets log there")
            log_location = log_location or self.checkpoint.rstrip("/") + "/twophase"
        else:
            raw_id = options.get("twophase.batchid")
            if not log_location or raw_id is None:
                raise ConfigurationError(
                    f"a batch write to twophase-{kind} needs .option('twophase.logLocation', ...) (its "
                    "transaction log) and .option('twophase.batchId', N): a write repeated with the same "
                    "batch id is written once")
            try:
                self.batch_id = int(raw_id)
            except ValueError:
                raise ConfigurationError(f"twophase.batchId must be an integer >= 0, got {raw_id!r}") from None
            if self.batch_id < 0:
                raise ConfigurationError(f"twophase.batchId must be an integer >= 0, got {raw_id!r}")
        self.log_location = local_location(str(log_location))
        self.name = options.get("twophase.name") or "twophase"
        raw = options.get("twophase.maxpartitions") or str(default_max_partitions)
        try:
            self.max_partitions = int(raw)
        except ValueError:
            raise ConfigurationError(f"twophase.maxPartitions must be a positive integer, got {raw!r}") from None
        if self.max_partitions < 1:
            raise ConfigurationError(f"twophase.maxPartitions must be a positive integer, got {raw!r}")


def _committer(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> Committer:
    return Committer(sink, parallelism=8, retries=5, backoff=0.2, max_backoff=10.0, ignore_lost=False,
                     where=settings.log_location, name=settings.name)


def _current_batch(checkpoint: str) -> tuple[int, str]:
    """(the micro-batch Spark is planning, the query's id), from its checkpoint: Spark writes
    ``metadata`` when the query first starts and ``offsets/N`` before it plans batch N."""
    store = open_store(checkpoint, None, exclusive=False)
    raw = store.read("metadata")
    try:
        query_id = json.loads(raw.decode("utf-8"))["id"] if raw is not None else None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        query_id = None
    batches = [int(n) for n in (store.list("offsets") or []) if n.isdigit()]
    if not query_id or not batches:
        raise ConfigurationError(
            f"{store.location('offsets')}: no micro-batch there while Spark plans one. twophase data sources "
            "write micro-batches only (a continuous trigger is not supported: use processingTime or "
            "availableNow), and checkpointLocation must be the query's own. Nothing was written.")
    return max(batches), str(query_id)


#: Configurations whose sink passed open() in this (planner) process: Spark reuses planner workers
#: across micro-batches, so later plans only get the sink ready (open_for_commit).
_CHECKED: set[str] = set()


def _open(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> None:
    if settings.fingerprint in _CHECKED:
        sink.open_for_commit()
        return
    sink.open()
    _CHECKED.add(settings.fingerprint)


def _plan(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> Plan:
    """The planner's part of micro-batch N: recovery, then a ballot of ours for N (or nothing to
    write: N was decided before, and is committed now if it was not)."""
    t0 = time.perf_counter()
    if settings.streaming:
        assert settings.checkpoint is not None
        batch_id, query_id = _current_batch(settings.checkpoint)
    else:
        assert settings.batch_id is not None
        batch_id, query_id = settings.batch_id, batch_query_id(settings.name, sink.target())
    _open(sink, settings)
    tlog = TransactionLog(settings.log_location)
    # No process outlives a batch: each plan is a new epoch; the ballots' slots are the fence.
    tlog.acquire(query_id, settings.name, takeover=True, target=sink.target())
    protocol = TwoPhaseProtocol(sink, tlog, name=settings.name, query_name=f"{settings.name}.{tlog.scope()}",
                                committer=lambda: _committer(sink, settings))
    prog = BatchProgress(settings.name, batch_id, query_id, "committed")
    sized: list[int] = []

    cap = sink.max_parallelism()  # e.g. PostgreSQL's max_prepared_transactions // 2

    def partitions(planned: int | None) -> int:  # the task count is unknown while Spark plans
        # What this run allows, and at least what the batch's earlier ballot planned: a replay runs
        # with as many tasks as this run's query makes (another core count, twophase.coalesce, or
        # no register() at all), which the plan cannot change.  Sinks' pools follow the widest
        # plan (Kafka's plan fence records it); PostgreSQL's gids are named per ballot.
        wanted = max(planned or 0, settings.max_partitions)
        sized.append(wanted if cap is None else min(cap, wanted))
        return sized[-1]

    opened = protocol.open_ballot(batch_id, partitions, prog)
    plan = Plan(batch_id, "write", query_id, settings.log_location,
                settings.name, epoch=tlog.epoch, owner=tlog.owner, generation=tlog.generation,
                planned_at=time.time())
    if opened is None:
        plan.action = prog.action
    else:
        plan.query_name, plan.number, plan.intent, plan.run = (opened.query_name, opened.number, opened.intent,
                                                               opened.run)
        plan.partitions = sized[-1]
    log.info("%s: batch %d planned (%s) in %.0f ms", settings.name, batch_id, plan.action,
             (time.perf_counter() - t0) * 1000)
    return plan


class _Steps:
    """A writer's three steps (tasks, commit, abort), for the streaming and the batch writer."""

    sink: TwoPhaseCommitSink[Any, Any]
    settings: _Settings
    plan: Plan | None

    def __init__(self, sink: TwoPhaseCommitSink[Any, Any], settings: _Settings, plan: Plan | None):
        self.sink, self.settings, self.plan = sink, settings, plan
        # Fault-injection runs: executors on a cluster arm the plan's crash points too.
        self.crash_env = crash.carried_env() if plan is not None else {}

    # ----------------------------------------------------------------- executors
    def write(self, iterator):
        from pyspark import TaskContext

        from twophase import crash as _crash
        from twophase.context import TransactionContext, run_transaction

        if self.crash_env:
            _crash.adopt(self.crash_env)
        plan = self.plan
        if plan is None:  # cannot be: Spark pickles the writer of the plan for its tasks
            raise TwoPhaseError("twophase: a task got a writer without a plan")
        tc = TaskContext.get()
        spark_batch = tc.getLocalProperty("streaming.sql.batchId")
        if spark_batch is not None and int(spark_batch) != plan.batch_id:
            raise TwoPhaseError(
                f"twophase: this task writes Spark's micro-batch {spark_batch}, but the plan read batch "
                f"{plan.batch_id} from {self.settings.checkpoint}/offsets: is checkpointLocation the query's "
                "own? Nothing was written.")
        message = TaskMessage(asdict(plan), tc.partitionId(), tc.attemptNumber(), 0, None)
        if plan.action != "write":
            return message  # decided before: its rows are in the target already
        if tc.partitionId() >= plan.partitions:
            raise ConfigurationError(
                f"twophase: partition {tc.partitionId()} of batch {plan.batch_id} is beyond the {plan.partitions} "
                f"transactions its plan allows (twophase.maxPartitions={self.settings.max_partitions}, capped by "
                "what the target allows; Spark makes spark.sql.shuffle.partitions=200 after every aggregation, "
                "join and deduplication): start the query after twophase.register(spark), which coalesces each "
                "micro-batch to the application's cores (twophase.coalesce=auto), or give df.coalesce(N) before "
                "writeStream. Nothing of this partition was written.")
        sink = self.sink
        ctx = TransactionContext(plan.query_name, plan.batch_id, tc.partitionId(), tc.attemptNumber(), plan.intent,
                                 plan.run, task_attempt_id=tc.taskAttemptId())
        message.rows, message.handle = run_transaction(sink, ctx, iterator)
        return message

    # ----------------------------------------------------------------- commit
    def _protocol(self, plan: Plan) -> TwoPhaseProtocol:
        tlog = TransactionLog(plan.log_location)
        tlog.resume(owner=plan.owner, epoch=plan.epoch, generation=plan.generation, query_id=plan.query_id)
        protocol = TwoPhaseProtocol(self.sink, tlog, name=plan.name, query_name=plan.query_name,
                                    committer=lambda: _committer(self.sink, self.settings))
        protocol.dirty = False
        return protocol

    @staticmethod
    def _plan_of(messages: list[TaskMessage | None], batch_id: int) -> Plan | None:
        plans = {json.dumps(m.plan, sort_keys=True) for m in messages if m is not None}
        if not plans:
            return None
        if len(plans) > 1:
            raise TwoPhaseError(f"twophase: the tasks of batch {batch_id} wrote under {len(plans)} different "
                                "plans; nothing is committed")
        plan = Plan(**json.loads(plans.pop()))
        if plan.batch_id != batch_id:
            raise TwoPhaseError(f"twophase: Spark commits batch {batch_id} but its tasks wrote batch "
                                f"{plan.batch_id}; nothing is committed")
        return plan

    def _commit(self, messages, batchId):  # noqa: N803 - Spark's name
        plan = self._plan_of(messages, batchId)
        if plan is None or plan.action != "write":
            return  # decided before: the plan committed it (recommitted) or found it committed
        t0 = time.perf_counter()
        self.sink.open_for_commit()  # the plan checked this configuration
        protocol = self._protocol(plan)
        opened = plan.opened()
        results = [{"partition": m.partition, "attempt": m.attempt, "rows": m.rows, "handle": json.loads(m.handle)}
                   for m in messages if m is not None and m.handle is not None]
        results.sort(key=lambda r: r["partition"])
        try:
            protocol.check_prepared(opened, results, started_at=plan.planned_at)
        except BaseException as e:
            protocol.give_up(opened, e)
            raise
        prog = BatchProgress(plan.name, batchId, plan.query_id, "committed")
        source = None
        if self.settings.checkpoint is not None:  # Spark's offsets of this batch, for `twophase offsets`
            from twophase.spark import source_offsets

            try:
                source = source_offsets(open_store(self.settings.checkpoint, None, exclusive=False), batchId)
            except Exception as e:  # noqa: BLE001 - a record for operators, not part of the decision's safety
                log.warning("%s: batch %d: Spark's offsets are not recorded in its decision: %s", plan.name,
                            batchId, e)
        protocol.decide_and_commit(opened, results, prog, source=source)
        protocol.committed(batchId)  # old records pruned now and then
        log.info("%s: batch %d committed: %d rows, %d handles, commit %.0f ms, log %.0f ms (%.0f ms)", plan.name,
                 batchId, prog.rows, prog.handles, prog.commit_ms, prog.log_ms, (time.perf_counter() - t0) * 1000)

    def _abort(self, messages, batchId):  # noqa: N803 - Spark's name
        plan = self._plan_of(messages, batchId)
        if plan is None:
            self._recover_now(batchId)
            return
        if plan.action != "write":
            return  # decided before: nothing of this run's to abort
        self.sink.open_for_commit()
        self._protocol(plan).give_up(plan.opened(), TwoPhaseError(f"Spark aborted batch {batchId}"))

    def _recover_now(self, batch_id: int) -> None:
        """Spark aborted batch N and no task's message names its ballot: the job was cancelled (a
        stopped query) or failed before any task finished.  Tasks that did finish may have left
        transactions prepared (in PostgreSQL they hold their locks), so recovery runs now, as the
        next plan would: it closes the batch's open ballot and aborts what it names; then the log's
        lease is released, so that `twophase recover` needs no takeover.  A task that the
        cancellation has not stopped yet may still pre-commit after this: the next plan's recovery
        aborts it."""
        settings = self.settings
        try:
            query_id = _current_batch(settings.checkpoint)[1] if settings.streaming and settings.checkpoint \
                else batch_query_id(settings.name, self.sink.target())
            self.sink.open_for_commit()
            tlog = TransactionLog(settings.log_location)
            tlog.acquire(query_id, settings.name, takeover=True, target=self.sink.target())
            try:
                TwoPhaseProtocol(self.sink, tlog, name=settings.name, query_name=f"{settings.name}.{tlog.scope()}",
                                 committer=lambda: _committer(self.sink, settings)).recover()
            finally:
                tlog.close()
        except Exception as e:  # noqa: BLE001 - best effort: the next plan recovers all the same
            log.warning("%s: batch %d was aborted by Spark; recovering its transactions now failed (%s): the "
                        "next run recovers them", settings.name, batch_id, e)


class _StreamWriter(_Steps, DataSourceStreamArrowWriter):
    """``writeStream``: a plan per micro-batch; ``commit``/``abort`` on a writer made afresh."""

    def commit(self, messages, batchId):  # noqa: N803 - Spark's name
        self._commit(messages, batchId)

    def abort(self, messages, batchId):  # noqa: N803 - Spark's name
        self._abort(messages, batchId)


class _BatchWriter(_Steps, DataSourceArrowWriter):
    """``df.write``: one plan; ``commit``/``abort`` on this writer, pickled from the plan."""

    def commit(self, messages):
        assert self.plan is not None
        self._commit(messages, self.plan.batch_id)

    def abort(self, messages):
        if self.plan is not None:
            self._abort(messages, self.plan.batch_id)


class TwoPhaseDataSource(DataSource):
    """A twophase sink as a Spark data source, ``format("twophase-<kind>")``.  A subclass names its
    ``kind``; the rest (the options it reads, how they become a sink) is that kind's
    :class:`~twophase.config.SparkFormat` in the sinks' registry, set on the class when it is
    made: this module names no sink (:func:`data_source` makes the classes)."""

    kind: ClassVar[str] = ""
    #: The format's registry entry (None on this base class).
    spec: ClassVar[SparkFormat | None] = None
    #: Options this source reads beyond the common ones (lower case).
    known_options: ClassVar[frozenset[str]] = frozenset()
    #: Prefixes of options passed through to the target's client (lower case), e.g. "kafka.".
    passed_prefixes: ClassVar[tuple[str, ...]] = ()
    #: Transactions a batch's plan allows, unless twophase.maxPartitions says otherwise.
    default_max_partitions: ClassVar[int] = 200
    #: Complete output mode (Spark hands the writer ``overwrite=True``) appends every row of the
    #: result each batch, as Spark's Kafka sink does; the others refuse it (it would replace the
    #: target's contents).
    appends_in_complete_mode: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__dict__.get("kind"):
            return
        spec = spark_format(cls.kind)
        cls.spec = spec
        cls.known_options = spec.known_options
        cls.passed_prefixes = spec.passed_prefixes
        cls.default_max_partitions = spec.default_max_partitions
        cls.appends_in_complete_mode = spec.appends_in_complete_mode
        if not cls.__doc__:
            cls.__doc__ = spec.doc

    @classmethod
    def name(cls) -> str:
        return f"twophase-{cls.kind}"

    def __init__(self, options):
        super().__init__(options)
        # Made here: Spark is planning a micro-batch.  Unpickled (see __setstate__): Spark's commit
        # step, which must never open a ballot.
        self._planning = True

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._planning = False

    def build_sink(self) -> TwoPhaseCommitSink[Any, Any]:
        """The sink these options configure (the format's translation, which owns their meaning)."""
        if self.spec is None:
            raise NotImplementedError("a TwoPhaseDataSource subclass names its kind")
        return self.spec.build(self.options)

    def _check_options(self) -> None:
        unknown = sorted(k for k in self.options if k not in _COMMON and k not in self.known_options
                         and not k.startswith(self.passed_prefixes))
        if unknown:
            import difflib

            known = sorted(_COMMON | self.known_options)
            hints = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, known, 1)) else k
                     for k in unknown]
            raise ConfigurationError(f"twophase-{self.kind}: unknown option(s) {', '.join(hints)}; it reads "
                                     f"{', '.join(known)}")

    def streamWriter(self, schema, overwrite):  # noqa: N802 - Spark's name
        self._check_options()
        if overwrite and not self.appends_in_complete_mode:
            raise ConfigurationError(
                f"twophase-{self.kind} writes in Append output mode only (Complete would replace the "
                "target's contents each batch); use outputMode('append')")
        settings = _Settings(self.options, self.kind, self.default_max_partitions)
        sink = self.build_sink()
        plan = _plan(sink, settings) if self._planning else None
        return _StreamWriter(sink, settings, plan)

    def writer(self, schema, overwrite):
        self._check_options()
        if overwrite:
            raise ConfigurationError(
                f"twophase-{self.kind} appends (mode('overwrite') would replace the target's contents); use "
                "mode('append')")
        settings = _Settings(self.options, self.kind, self.default_max_partitions, streaming=False)
        sink = self.build_sink()
        return _BatchWriter(sink, settings, _plan(sink, settings))


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
