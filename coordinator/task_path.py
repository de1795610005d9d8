"""The task path: a batch's transactions run by Spark tasks on the executors.  How many (the writer
slots, the batch's DataFrame coalesced to them), the job whose tasks run each partition's
transaction (the functions shipped to them by ``mapInArrow`` or ``mapPartitionsWithIndex``: begin,
write Arrow record batches, pre-commit, return the handle), the tasks' result rows read as handles,
and the wait for a failed job's last tasks.  How a task's rows become record batches is
:mod:`twophase.coordinator.task_input`.
"""

from __future__ import annotations

import json
import time
from typing import Any

from twophase import crash
from twophase.coordinator.base import _CoordinatorBase, _counted_partitions, log
from twophase.coordinator.driver_path import _COLLECT_FAILED, _OVER_BOUND
from twophase.coordinator.task_input import (
    CONVERSION_FAILED,
    arrow_settings,
    record_batches,
    rows_schema,
)
from twophase.errors import ConfigurationError, LogOwnershipError, TwoPhaseError
from twophase.spark import is_connect

_RESULT_SCHEMA = "partition INT, attempt INT, rows LONG, handle STRING"


def _batch_partitions(df, slots: int) -> tuple[int, bool]:
    """(transactions to plan, whether to coalesce the batch to ``slots``) for a batch written with
    at most ``slots`` writer tasks.

    :func:`~twophase.coordinator.base._counted_partitions` counts a batch's partitions without a
    job, except under adaptive query execution, where counting would run the plan's shuffle stages
    to settle the final plan (and the write then runs them again).  Such a plan is coalesced to the
    slots uncounted, unless it ends in the user's
    own coalesce or repartition to at most ``slots`` partitions: Spark's optimizer would merge
    a coalesce of ours into that one and could raise its count, so its count is planned.  Spark
    Connect has no RDDs: a batch is coalesced uncounted unless its plan ends in such a coalesce
    or repartition of the user's.
    """
    if is_connect(df.sparkSession):
        plan = getattr(df, "_plan", None)
        n = getattr(plan, "_num_partitions", getattr(plan, "num_partitions", None))
        if type(plan).__name__ in ("Repartition", "RepartitionByExpression") and isinstance(n, int) and n <= slots:
            return n, False
        return slots, True
    n = _counted_partitions(df)
    if n is not None:
        return (slots, True) if n > slots else (n, False)
    try:  # adaptive (or not counted): the user's own repartition at the plan's root
        root = df._jdf.queryExecution().optimizedPlan()
        if root.nodeName() in ("Repartition", "RepartitionByExpression"):
            n = int(root.numPartitions())
            if n <= slots:
                return n, False
    except Exception:  # noqa: BLE001 - an unusual plan: coalesced uncounted
        pass
    return slots, True


class _TaskPath(_CoordinatorBase):
    """The task path of :class:`~twophase.coordinator.Coordinator`: the driver plans the batch's
    transactions and runs its job; the executors' tasks begin, write and pre-commit them."""

    def _slots(self, spark) -> int:
        """Writer tasks (= transactions) per batch: ``parallelism``, else Spark's default parallelism,
        capped by what the sink's target allows."""
        slots = self.parallelism
        if slots is None:
            slots = self._default_parallelism(spark)
        cap = self.sink.max_parallelism()
        if cap is not None and slots > cap:
            if not self._slots_capped:
                log.warning("%s: %s allows at most %d transactions per batch; writing with %d tasks "
                            "instead of %d", self.name, type(self.sink).__name__, cap, cap, slots)
                self._slots_capped = True
            slots = cap
        return max(1, slots)

    # ---------------------------------------------------------------- executors
    def _prepare(self, df, name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        """Run every partition's transaction on the executors; return their handles (envelopes)."""
        from twophase.context import BatchContext

        # A sink that prepares the whole batch with a Spark job of its own (prepare_batch) does it here.
        whole = self.sink.prepare_batch(df, BatchContext(name, batch_id, intent, run))
        if whole is not None:
            self._batch_input = "batch"
            crash.crash_point("after_pre_commit", batch_id)  # the batch's pre-commit is its job
            return [{"partition": i, "attempt": 0, "rows": whole.rows if i == 0 else 0,
                     "handle": self.sink.encode_handle(h)} for i, h in enumerate(whole.handles)]
        import pyarrow as pa

        sink = self.sink
        out_schema = pa.schema([("partition", pa.int32()), ("attempt", pa.int32()),
                                ("rows", pa.int64()), ("handle", pa.string())])

        crash_env = crash.carried_env()  # fault-injection runs: executors on a cluster arm the same plan

        def run_task(batches):
            """The partition's transaction over ``batches``: (ctx, rows, envelope or None)."""
            from pyspark import TaskContext

            from twophase import crash as _crash
            from twophase.context import TransactionContext, run_transaction

            if crash_env:
                _crash.adopt(crash_env)

            tc = TaskContext.get()
            ctx = TransactionContext(name, batch_id, tc.partitionId(), tc.attemptNumber(), intent, run,
                                     task_attempt_id=tc.taskAttemptId())
            rows, envelope = run_transaction(sink, ctx, batches)
            return ctx, rows, envelope

        def run_partition(batches):
            ctx, rows, envelope = run_task(batches)
            if envelope is None:
                return
            yield pa.RecordBatch.from_pydict(
                {"partition": [ctx.partition_id], "attempt": [ctx.attempt], "rows": [rows],
                 "handle": [envelope]}, schema=out_schema)

        target = self._rows_target(df)
        if target is not None:
            schema, max_records = df.schema, self._max_records(df.sparkSession)

            def run_rows(_index, rows_in):
                ctx, rows, envelope = run_task(record_batches(rows_in, schema, target, max_records))
                if envelope is not None:
                    yield {"partition": ctx.partition_id, "attempt": ctx.attempt, "rows": rows, "handle": envelope}

            def job():
                return df.rdd.mapPartitionsWithIndex(run_rows).collect()
        else:
            def job():
                return df.mapInArrow(run_partition, _RESULT_SCHEMA).collect()
        self._batch_input = "arrow" if target is None else "rows"

        if is_connect(df.sparkSession):
            # Spark Connect has no status tracker to wait for a failed job's last tasks with: a task
            # that pre-commits after the abort below leaves a transaction that the batch's replay
            # aborts (by its INTENT) before it opens any of its own.
            return self._handles(batch_id, job())
        # Our job must be findable after a failure (see _wait_for_tasks), and cancelled by a fence.
        with self._cancellable(df, f"{batch_id}-") as (sc, group):
            try:
                rows = job()
            except BaseException as e:
                if target is not None and self.task_input == "auto" and CONVERSION_FAILED in str(e):
                    self._rows_refused = True
                    log.warning("%s: batch %d: a row did not convert to Arrow on the rows path; this "
                                "coordinator's batches take the Arrow path from now on, this one included",
                                self.name, batch_id)
                # collect() fails as soon as one task fails, while sibling tasks may still be finishing
                # and could pre-commit after the caller aborted leftovers. Let them end first.
                self._wait_for_tasks(sc, group)
                if self.log is not None and self.log.fenced and not isinstance(e, LogOwnershipError):
                    raise LogOwnershipError(
                        f"{self.name}: batch {batch_id}: this coordinator (epoch {self.log.epoch}) was fenced by a "
                        f"newer one while its Spark job ran; the job was cancelled and the newer coordinator "
                        "finishes the batch") from e
                raise
        return self._handles(batch_id, rows)

    def _handles(self, batch_id: int, rows) -> list[dict[str, Any]]:
        results = self._results(batch_id, rows)
        self._last_rows = sum(int(r["rows"]) for r in results)  # task_input="auto" picks the next path by it
        return results

    def _rows_target(self, df) -> Any | None:
        """The Arrow schema for the rows path (``task_input``) if this batch's tasks take it, else None."""
        if self.task_input in ("arrow", "driver") or is_connect(df.sparkSession):
            return None
        if self._input_note.startswith((_OVER_BOUND, _COLLECT_FAILED)):
            return None  # a burst the driver path's collect found, or a collect that failed: the columnar path
        if self.task_input == "auto" and (self._rows_refused or self._last_rows is None
                                          or self._last_rows > self.small_batch_rows):
            return None
        target = rows_schema(df.schema, *arrow_settings(df.sparkSession))
        if target is None and self.task_input == "rows":
            raise ConfigurationError(
                f"{self.name}: task_input='rows' cannot hand the sink the record batches the Arrow path "
                f"would for this schema ({df.schema.simpleString()[:300]}): it has an interval, variant or "
                "user-defined type, a struct with repeated field names, or useLargeVarTypes is on. "
                "Use task_input='arrow' or 'auto'")
        return target

    def _max_records(self, spark) -> int:
        """Rows per record batch, as the Arrow path cuts them (``maxRecordsPerBatch``; <= 0: no limit)."""
        try:
            n = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
        except ValueError:
            n = 10000
        return n if n > 0 else 2**62

    @staticmethod
    def _results(batch_id: int, rows) -> list[dict[str, Any]]:
        """The tasks' result rows as handles by partition; two handles for one partition refused."""
        seen: dict[int, int] = {}
        results = []
        for r in rows:
            if r["partition"] in seen:
                # Two successful attempts of one partition: both pre-committed, only one may commit.
                raise TwoPhaseError(
                    f"batch {batch_id}: partition {r['partition']} returned two handles (attempts "
                    f"{seen[r['partition']]} and {r['attempt']}); is speculation on? Nothing was committed.")
            seen[r["partition"]] = r["attempt"]
            results.append({"partition": r["partition"], "attempt": r["attempt"], "rows": r["rows"],
                            "handle": json.loads(r["handle"])})
        results.sort(key=lambda r: r["partition"])
        return results

    def _wait_for_tasks(self, sc, group: str, timeout: float = 60.0) -> None:
        """Wait (bounded) until no task of the job group is running: a failed job's other tasks are
        killed by Spark, but one may still pre-commit before it notices."""
        try:
            tracker = sc.statusTracker()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                active = 0
                for job_id in tracker.getJobIdsForGroup(group):
                    info = tracker.getJobInfo(job_id)
                    for stage_id in (info.stageIds if info is not None else []):
                        stage = tracker.getStageInfo(stage_id)
                        active += stage.numActiveTasks if stage is not None else 0
                if active == 0:
                    return
                time.sleep(0.1)
            log.warning("%s: tasks of a failed job still run after %.0fs; their leftovers are aborted "
                        "when the batch is replayed", self.name, timeout)
        except Exception:  # best effort: the replay aborts leftovers anyway
            log.debug("could not wait for the tasks of job group %s", group, exc_info=True)
