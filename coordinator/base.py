"""The base of :class:`~twophase.coordinator.Coordinator`'s parts, all on the driver: the attributes
``Coordinator.__init__`` sets (coordinator.py), and what its set-up, its driver path and its task
path share: the coordinator's logger, a failed Spark job's cause in one line, the running
streaming query and whether it keeps state, Spark's default parallelism, and the job group that a
fence cancels.
"""

from __future__ import annotations

import contextlib
import logging
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

from twophase.log import TransactionLog
from twophase.sink import TwoPhaseCommitSink
from twophase.spark import default_parallelism, is_connect

log = logging.getLogger("twophase.coordinator")

# Physical operators that keep state across micro-batches (their state stores must commit each batch).
_STATEFUL_MARKERS = ("StateStore", "WithState", "StreamingDeduplicate", "StreamingSymmetricHashJoin",
                     "StreamingGlobalLimit")


_PY_ERROR_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$")


def _python_worker_error(text: str) -> str | None:
    """The error a Python worker raised (its traceback's last line, ``RuntimeError: ...``) if a
    Python worker failed the job, else None: Spark's own first line says only "An exception was
    thrown from the Python worker"."""
    if "Traceback (most recent call last)" not in text:
        return None
    found = None
    for line in text.split("JVM stacktrace:", 1)[0].splitlines():
        m = _PY_ERROR_LINE.match(line.strip())
        if m:
            found = m.group(1)
    return found[:300] if found else None


def _job_failure(e: BaseException) -> str:
    """The cause of a failed Spark job in one line: py4j's first line only names the call
    (``An error occurred while calling ...collectAndServe``); the task's failure is below."""
    text = str(e)
    m = re.search(r"Cannot run program \"[^\"]*\"[^\n)]*", text)
    if m:
        return m.group(0).strip()
    python = _python_worker_error(text)
    if python:
        return python
    for line in text.splitlines():
        line = line.strip().lstrip(": ")
        if "Exception:" in line and "An error occurred while calling" not in line:
            return line[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


def _find_query(spark, query_id: str):
    """The running streaming query ``query_id``.  Inside ``foreachBatch`` the batch's DataFrame
    has a cloned session whose query manager does not list it; the session that started the
    query (the active one in this thread) does."""
    q = spark.streams.get(query_id)
    if q is None:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None and active is not spark:
            q = active.streams.get(query_id)
    return q


def _counted_partitions(df, *, unprepared: bool = False) -> int | None:
    """A batch's partitions, counted without a job; None where they cannot be: Spark Connect (no
    RDDs), adaptive query execution (settling the plan runs its shuffle stages), a plan Spark cannot
    execute into its RDD here, and with ``unprepared`` a plan with an exchange or a subquery
    (executing it into its RDD prepares them: broadcasts and subqueries run jobs).

    ``foreachBatch``'s batch is a plan over the micro-batch's RDD, built before the call: its
    partitions are read off that RDD, nothing planned (0.5 ms; planning and executing it took 8-12).
    """
    if is_connect(df.sparkSession):
        return None
    try:
        qe = df._jdf.queryExecution()
        logical = qe.logical()
        if logical.getClass().getSimpleName() == "LogicalRDD":
            return int(logical.rdd().getNumPartitions())
        plan = qe.executedPlan()
        if plan.getClass().getSimpleName() == "AdaptiveSparkPlanExec":
            return None
        if unprepared and ("Exchange" in (text := plan.toString()) or "Subquery" in text):
            return None
        return int(qe.toRdd().getNumPartitions())
    except Exception:  # noqa: BLE001 - an unusual plan: not counted
        log.debug("could not count the batch's partitions", exc_info=True)
        return None


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class _CoordinatorBase:
    """What the parts of :class:`~twophase.coordinator.Coordinator` share.  Its attributes are set
    by ``Coordinator.__init__`` (coordinator.py)."""

    sink: TwoPhaseCommitSink[Any, Any]
    name: str
    checkpoint_location: str | None
    storage_options: dict[str, Any] | None
    parallelism: int | None
    shared_storage: bool
    task_input: str
    small_batch_rows: int
    driver_batch_rows: int
    _batch_query: tuple[str, bool]
    _input_note: str
    _collect_ms: float
    _last_rows: int | None
    _rows_refused: bool
    _collect_failures: int
    _collect_wait: int
    _unsafe_collect: str | None
    _batch_input: str
    _probed: bool
    _job: tuple[Any, str] | None
    _connect_said: bool
    _parallelism_seen: int | None
    log: TransactionLog | None
    _stateful: bool | None
    _slots_capped: bool

    def _default_parallelism(self, spark) -> int:
        """Spark's ``defaultParallelism`` (the cores the application has).  Spark Connect offers no
        SparkContext: there it is measured once, as the partitions of ``spark.range`` without a
        partition count (which Spark sizes by the default parallelism)."""
        if not is_connect(spark):
            return default_parallelism(spark)
        if self._parallelism_seen is None:
            self._parallelism_seen = default_parallelism(spark)
            log.info("%s: Spark Connect: the application's default parallelism is %d", self.name,
                     self._parallelism_seen)
        return self._parallelism_seen

    def _is_stateful(self, df, query_id: str) -> bool:
        """Does the streaming query keep state across batches (state stores)?  Asked once per query;
        True when it cannot be told (Spark Connect shows no physical plan)."""
        if self._stateful is None and is_connect(df.sparkSession):
            self._stateful = True  # Connect shows no physical plan: recomputing is always safe
        if self._stateful is None:
            try:
                q = _find_query(df.sparkSession, query_id)
                plan = q._jsq.streamingQuery().lastExecution().executedPlan().toString()
                self._stateful = any(m in plan for m in _STATEFUL_MARKERS)
            except Exception:  # cannot tell: recomputing is always safe
                log.debug("could not inspect the plan of query %s; assuming it is stateful", query_id,
                          exc_info=True)
                self._stateful = True
        return bool(self._stateful)

    @contextlib.contextmanager
    def _cancellable(self, df, tag: str = "") -> Iterator[tuple[Any, str]]:
        """Run the batch's Spark actions (the task job, the driver path's collect) in a job group that
        a fence found by the heartbeat cancels (:meth:`_stop_job`): a streaming query's own group
        (its run id: query.stop() cancels by it), else one of ours.  Yields (SparkContext, group);
        the fence is looked at once the group is set, so a fence found later cancels the job."""
        sc = df.sparkSession.sparkContext
        group = sc.getLocalProperty("spark.jobGroup.id")
        own_group = None
        if not group:
            own_group = group = f"twophase-{self.name}-{tag}{uuid.uuid4().hex[:8]}"
            sc.setLocalProperty("spark.jobGroup.id", group)
        self._job = (sc, group)
        try:
            if self.log is not None and self.log.fenced:
                self.log.check_fence()  # raises: fenced before the job started
            yield sc, group
        finally:
            self._job = None
            if own_group is not None:
                sc.setLocalProperty("spark.jobGroup.id", None)
