"""What an executor-side transaction knows about where it runs: query, batch, partition, attempt."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TransactionContext:
    """Identity of one sink transaction: one partition's writes for one batch.

    ``query_name`` is the coordinator's name, ``batch_id`` Spark's micro-batch id,
    ``partition_id`` and ``attempt`` the Spark task's partition and attempt number.
    ``intent`` is the batch's INTENT payload (what transactions this batch may
    open: transactional ids, staging prefixes, gid prefixes), as the sink's
    :meth:`~twophase.TwoPhaseCommitSink.plan_batch` returned it.

    ``run`` is unique to one execution of the batch by one coordinator (a short
    token, letters and digits).  Spark numbers task attempts from 0 in every job, so
    a replay of the batch, or a second coordinator racing on it, reuses
    ``(partition_id, attempt)``; a sink that names transactions after them adds
    ``run`` so that two executions never share a name (and aborting one can never
    touch the other).  Empty when the caller does not know it.

    ``task_attempt_id`` is Spark's ``taskAttemptId()``: unique among the attempts of one
    SparkContext (-1 when unknown).  After a ``FetchFailed`` Spark resubmits the stage while
    the old stage attempt's tasks keep running, and attempt numbers start again at 0 in the
    new one (SPARK-24589), so ``attempt`` alone does not name one attempt of a partition;
    ``(run, task_attempt_id)`` does.  PySpark does not expose the stage attempt number, so an
    attempt cannot tell a failed earlier attempt of its own stage attempt from a live one of
    an older stage attempt that Spark may still accept.
    """

    query_name: str
    batch_id: int
    partition_id: int
    attempt: int = 0
    intent: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    task_attempt_id: int = -1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def label(self) -> str:
        return f"{self.query_name} batch {self.batch_id} partition {self.partition_id} attempt {self.attempt}"


@dataclass(frozen=True)
class BatchContext:
    """Identity of one batch that a sink prepares whole, from the driver
    (:meth:`~twophase.TwoPhaseCommitSink.prepare_batch`): the fields of
    :class:`TransactionContext` that do not name a task."""

    query_name: str
    batch_id: int
    intent: dict[str, Any] = field(default_factory=dict)
    run: str = ""

    @property
    def label(self) -> str:
        return f"{self.query_name} batch {self.batch_id}"


def run_transaction(sink: Any, ctx: TransactionContext, batches: Any) -> tuple[int, str | None]:
    """One task's transaction (executor side), for the coordinator's tasks and the data sources':
    begin at the first non-empty Arrow batch, write every batch, pre-commit; abort what was begun
    if anything fails.  Returns (rows, the handle's envelope as JSON), or (0, None) when the
    partition was empty.  Crash points ``before_begin`` and ``after_pre_commit`` of the batch."""
    import json
    import logging

    from twophase import crash

    txn, rows = None, 0
    try:
        for rb in batches:
            if rb.num_rows == 0:
                continue
            if txn is None:
                # A worker paused here and resumed late is a late task attempt on demand.
                crash.crash_point("before_begin", ctx.batch_id)
                txn = sink.begin_transaction(ctx)
            sink.write(txn, rb)
            rows += rb.num_rows
        if txn is None:
            return 0, None
        handle = sink.pre_commit(txn)
    except BaseException:
        if txn is not None:
            try:
                sink.abort(txn)
            except Exception:  # the original error matters more
                logging.getLogger("twophase.executor").exception("abort failed: %s", ctx.label)
        raise
    envelope = json.dumps(sink.encode_handle(handle))
    crash.crash_point("after_pre_commit", ctx.batch_id)
    return rows, envelope
