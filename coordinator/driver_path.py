"""The driver path (``task_input="driver"``, and ``"auto"`` after a small batch): whether a batch
takes it, the bounded collect of its rows to the driver as Arrow record batches (the Arrow task
path instead for a batch over the bound or a collect that failed, and the wait ``"auto"`` keeps
after a failed collect), and the batch's one transaction, run in the driver process.  See
docs/usage.md "Small batches: the driver path".
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from twophase.coordinator.base import (
    _CoordinatorBase,
    _counted_partitions,
    _job_failure,
    _ms,
    _python_worker_error,
    log,
)
from twophase.coordinator.task_input import arrow_settings
from twophase.errors import LogOwnershipError
from twophase.spark import is_connect

#: ``driver_batch_rows``' default, the driver path's bound in rows (docs/benchmarks.md, "Latency per
#: micro-batch": 10,000-row batches gain on it; 200,000 rows stay on tasks).  ``task_input="auto"``
#: takes the driver path after a batch of at most this many rows; ``driver_batch_rows=0`` keeps it
#: on the task paths.
DRIVER_BATCH_ROWS = 10000
#: How the driver path's log line and progress note begin for a batch over its bound, and for a
#: batch whose collect failed (spark.driver.maxResultSize, a type toArrow() refuses): both then take
#: the Arrow task path.
_OVER_BOUND = "more rows than driver_batch_rows ="
_COLLECT_FAILED = "the driver's collect failed"
#: After a failed collect, ``task_input="auto"`` keeps to the tasks for this many batches, then tries
#: the driver path again; each further failure in a row doubles the wait, up to
#: :data:`_COLLECT_RETRY_MAX`.  A failure that recurs (a type toArrow() refuses, rows past
#: maxResultSize) then costs one failed collect in 1,000 batches; one that does not (an executor lost
#: mid-collect, a fetch failure) no longer keeps a long-running query off the driver path for good.
_COLLECT_RETRY_FIRST = 10
_COLLECT_RETRY_MAX = 1000
#: A batch of at most this many partitions is collected by one task (``coalesce(1)`` before the
#: limit): a limit over more partitions is a second stage (a shuffle of each partition's first rows
#: to one), which cost a 100-row batch about 25-30 of its 100 ms of collect on ``local[2]``
#: (docs/benchmarks.md).  Over more partitions the collect keeps their parallelism: a small batch
#: may be a selective filter over a large input, which one task would read alone.  Counted every
#: batch: a Kafka micro-batch has a partition per topic partition with new records, so its count
#: changes from batch to batch (``foreachBatch`` hands a plan over the batch's RDD, built before
#: the call: counting it plans nothing).
_COLLECT_IN_ONE_TASK = 2


def _few_partitions(df) -> bool:
    """Whether the batch has at most :data:`_COLLECT_IN_ONE_TASK` partitions, counted without a job
    (:func:`~twophase.coordinator.base._counted_partitions`, plans with an exchange or a subquery
    left uncounted); False when they are not counted."""
    n = _counted_partitions(df, unprepared=True)
    return n is not None and n <= _COLLECT_IN_ONE_TASK


def _cancelled(e: BaseException) -> bool:
    """Whether a Spark action failed because its job was cancelled (a stopping query's, a cancelled
    job group's), not because of the batch."""
    text = str(e)
    return "SPARK_JOB_CANCELLED" in text or "cancelled because SparkContext was shut down" in text


class _DriverPath(_CoordinatorBase):
    """The driver path of :class:`~twophase.coordinator.Coordinator`: no task runs."""

    # ------------------------------------------------------------ the driver path
    def _driver_rows(self, df) -> Any | None:
        """The batch's rows as an Arrow table when it takes the driver path, else None (tasks).

        Checked before anything of the batch is planned: the path (``task_input``, the previous
        batch's rows under "auto"), then the bound, by the collect itself: at most
        ``driver_batch_rows + 1`` rows come to the driver, and that one more sends the batch to the
        Arrow task path (a burst after small batches), its plan run again there."""
        bound = self.driver_batch_rows
        if self.task_input == "auto":
            if self._collect_wait > 0:  # a collect failed lately: the tasks, for a while
                self._collect_wait -= 1
                return None
            if bound <= 0 or self._last_rows is None or self._last_rows > bound:
                # driver_batch_rows=0, the first batch, or after a large one
                return None
        elif self.task_input != "driver" or bound <= 0:
            return None
        if self.sink.prepares_batches():
            self._input_note = "the sink prepares batches with a Spark job of its own"
            return None
        if self.task_input == "auto":
            unsafe = self._collect_unsafe(df.sparkSession)
            if unsafe:
                self._input_note = unsafe
                return None
        query_id, streaming = self._batch_query
        if streaming and self._is_stateful(df, query_id):
            # The collect's limit may stop reading a partition before its end (past the bound), and a
            # state store commits when its partition is read to the end; the fallback would then run
            # the stateful plan a second time in the batch.  Not tried: such queries keep the tasks.
            self._input_note = "a stateful query keeps the task path"
            return None
        # The record batches the Arrow task path would hand the sink: the same schema (timestamps in
        # the session time zone: toArrow() gives UTC; nullability as Spark's), else tasks.
        tz, large = arrow_settings(df.sparkSession)
        try:
            from pyspark.sql.pandas.types import to_arrow_schema

            target = to_arrow_schema(df.schema, timezone=tz, prefers_large_types=large)
        except Exception as e:  # noqa: BLE001 - a type the driver's Arrow conversion lacks: tasks
            self._input_note = f"the driver cannot collect this schema as Arrow ({type(e).__name__}): the Arrow task path"
            return None
        t0 = time.perf_counter()
        try:
            rows = (df.coalesce(1) if _few_partitions(df) else df).limit(bound + 1)
            if is_connect(df.sparkSession):  # no job groups to cancel by (as the Connect task path)
                table = rows.toArrow()
            else:
                with self._cancellable(df):  # a fence found while it runs cancels the collect
                    table = rows.toArrow()
            if table.num_rows <= bound:
                table = table.cast(target)
        except LogOwnershipError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing of the batch was planned yet: the tasks write it
            if self.log is not None and self.log.fenced:
                raise LogOwnershipError(
                    f"{self.name}: this coordinator (epoch {self.log.epoch}) was fenced by a newer one while the "
                    "driver collected its batch; the collect was cancelled and the newer coordinator finishes "
                    "the batch") from e
            if _cancelled(e):
                # The query is being stopped (or its job group cancelled): no fallback job for it.
                raise
            # A type toArrow() refuses (the Arrow tasks convert it), rows past spark.driver.maxResultSize
            # (the bound counts rows, not bytes), ...: the batch takes the Arrow task path, which reads
            # it again.  A failure of the batch's own (its source) fails there too.  Under "auto" the
            # next batches keep to the tasks for a while (the same columns would fail the same collect;
            # a lost executor would not), for good after an OutOfMemoryError.
            # The cause, not py4j's "An error occurred while calling ..." nor a wrapper's "awaitResult".
            text = str(e)
            first = _python_worker_error(text) or next(
                (ln.strip()[:300] for ln in text.splitlines()
                 if "Exception:" in ln and "awaitResult" not in ln and "error occurred while" not in ln),
                _job_failure(e))
            self._input_note = f"{_COLLECT_FAILED} ({first}): the Arrow task path"
            if self.task_input == "auto" and "OutOfMemoryError" in text:
                # The driver's heap (or an executor's) ran out on this collect: the same rows would run
                # it out again, and the next time the driver's JVM may die of it.  Never again here.
                self._collect_wait = sys.maxsize
                self._input_note += (", for this batch and all the coordinator's next ones (out of memory: "
                                     "it does not collect again)")
            elif self.task_input == "auto":
                self._collect_failures += 1
                self._collect_wait = min(_COLLECT_RETRY_FIRST << min(self._collect_failures - 1, 20),
                                         _COLLECT_RETRY_MAX)
                self._input_note += (f", for this batch and the coordinator's next {self._collect_wait} "
                                     "(then it collects again)")
            log.warning("%s: %s", self.name, self._input_note)
            return None
        finally:
            self._collect_ms += _ms(t0)
        self._collect_failures = 0
        if table.num_rows > bound:
            self._input_note = f"{_OVER_BOUND} {bound} rows: the Arrow task path"
            log.info("%s: %s %d rows: this batch takes the Arrow task path", self.name, _OVER_BOUND, bound)
            return None
        return table

    def _collect_unsafe(self, spark) -> str:
        """Why "auto" must not collect batches into this driver ("" if it may), asked once.

        The collect's bytes are bounded by ``spark.driver.maxResultSize`` alone (the row bound counts
        rows: 6,000 rows of 100 KB are under both defaults): past it the collect fails and the batch
        takes the tasks.  A limit the driver's heap cannot hold (0, unlimited; or more than 1.25x
        the heap, e.g. the default 1g with ``spark.driver.memory=512m``) lets a batch of wide rows end
        the driver with OutOfMemoryError instead.  Spark's defaults (1g and a 1g driver) pass."""
        if self._unsafe_collect is None:
            self._unsafe_collect = ""
            if not is_connect(spark):
                try:
                    sc = spark.sparkContext
                    heap = int(sc._jvm.java.lang.Runtime.getRuntime().maxMemory())
                    text = sc.getConf().get("spark.driver.maxResultSize", "1g")
                    limit = int(sc._jvm.org.apache.spark.network.util.JavaUtils.byteStringAsBytes(text))
                except Exception:  # noqa: BLE001 - cannot tell: the task paths, which are always safe
                    log.debug("cannot read the driver's heap or maxResultSize", exc_info=True)
                    self._unsafe_collect = "the driver's heap and spark.driver.maxResultSize cannot be read"
                else:
                    if limit <= 0 or limit > 1.25 * heap:
                        self._unsafe_collect = (
                            f"spark.driver.maxResultSize={text} does not fit the driver's heap ({heap // 2**20} MiB): "
                            "a batch of wide rows collected here could end the driver, so auto keeps to the tasks "
                            "(set it under the heap, or task_input='driver')")
                        log.warning("%s: %s", self.name, self._unsafe_collect)
        return self._unsafe_collect

    def _prepare_in_driver(self, table, name: str, batch_id: int, intent: dict[str, Any],
                           run: str) -> list[dict[str, Any]]:
        """The driver path: the batch's one transaction, run here (partition 0, attempt 0) over the
        collected rows.  The crash points ``before_begin`` and ``after_pre_commit`` fire in this
        process, the driver."""
        from twophase.context import TransactionContext, run_transaction

        self._batch_input = "driver"
        if self.log is not None and self.log.fenced:
            self.log.check_fence()  # raises: fenced before anything was begun
        # task_attempt_id -1: no Spark task; ``run`` is the ballot's own, and no task writes in a
        # ballot the driver writes, so (partition 0, attempt 0, run) names one transaction.
        ctx = TransactionContext(name, batch_id, 0, 0, intent, run, task_attempt_id=-1)
        # The record batches as the JVM cut them (maxRecordsPerBatch, per partition), as tasks get them.
        rows, envelope = run_transaction(self.sink, ctx, table.to_batches())
        self._last_rows = rows
        if envelope is None:
            return []
        return [{"partition": 0, "attempt": 0, "rows": rows, "handle": json.loads(envelope)}]
