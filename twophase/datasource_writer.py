"""The Spark side of every twophase format: :class:`TwoPhaseDataSource` (made by Spark's planner
worker, it plans each batch: :func:`~twophase.datasource_plan._plan`) and the writers it makes
(:class:`_StreamWriter` for ``writeStream``, :class:`_BatchWriter` for ``df.write``), whose
steps (:class:`_Steps`) run in each task (``write``: one transaction per partition,
pre-committed) and in the commit step (``commit``: the decision, the commits, COMMITTED;
``abort``).  The format classes by name and their registration: :mod:`twophase.datasource`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict
from typing import Any, ClassVar

from twophase import crash
from twophase._deps import require
from twophase.config import (  # formats by kind, found by string: the core never imports a sink module
    SparkFormat,
    spark_format,
)
from twophase.datasource_plan import (
    _COMMON,
    Plan,
    TaskMessage,
    _committer,
    _current_batch,
    _plan,
    _Settings,
)
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.log import TransactionLog, batch_query_id, open_store
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.sink import TwoPhaseCommitSink

require("pyspark.sql.datasource", "the twophase data sources (format('twophase-...'))", "spark")
from pyspark.sql.datasource import (  # noqa: E402 - after the line that names the extra to install
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
)

log = logging.getLogger("twophase.datasource")


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
