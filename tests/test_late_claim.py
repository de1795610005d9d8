"""A zombie task attempt that claims a transactional id from a stale look at it (Kafka).

Found by the nemesis in CI (tests/test_nemesis.py, Kafka, seed 27, ``executor-pause``): d3's
executor on worker-2 was stopped during batch 11 while attempt 0 of partition 0 ran; Spark
declared the executor lost and ran attempt 1 on worker-1.  The executor resumed as attempt 1
began, and both attempts claimed a slot of partition 0 within milliseconds.  Attempt 1 took the
first idle id (``-0.0``), wrote and pre-committed; attempt 0 had described ``-0.0`` as idle just
before, and its claim, sent from that stale look, aborted attempt 1's open transaction (the broker
aborts an open transaction for an InitProducerId of its producer id, whatever epoch it expects).
Spark accepted attempt 1's handle; ``verify_prepared`` found its transaction aborted, so nothing
was decided (exactly-once held), but the driver failed the batch and exited: the pipeline
stopped, and attempt 0's own transaction (on ``-0.1``) stayed open behind it.

Now each attempt number starts on a slot of its own, so a retry and the zombie it replaced never
race for one id; and a batch whose transaction another actor aborted before the decision (long
before its timeout) runs again in a new ballot instead of failing the query.  What stays is the
race of two attempts with the same number (a stage retry's attempt against the old stage
attempt's), which the second test plays: it costs a ballot, never a decided batch's rows while
the claim lands before ``verify_prepared`` (docs/kafka.md, "What is left").

On the real broker, without Spark (tests/inprocess.py); each test failed before the change.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from tests.inprocess import Driver, OneTask, run_attempt
from tests.test_kafka_ownership import _committer, _open, _prepare, _values
from tests.test_kafka_sink import _topic, read_committed
from twophase.context import TransactionContext
from twophase.protocol import BatchProgress
from twophase.sinks.kafka import KafkaSink

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def _rows(tag: str) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"value": _values(tag)})


def _claims_after(sink: KafkaSink, zombie: TransactionContext, meanwhile: Callable[[], Any]) -> tuple[Any, Any]:
    """Begin ``zombie``'s transaction with ``meanwhile()`` run after the attempt described its
    partition's slots and before it claims one (its look at them is then stale, as when its
    executor was stopped there).  Returns (the zombie's transaction, what ``meanwhile`` returned)."""
    check = sink._check_plan_fence
    got: list[Any] = []

    def fence_then_meanwhile(ctx: TransactionContext, client: Any, pool: dict[str, Any]) -> None:
        check(ctx, client, pool)
        if ctx is zombie and not got:
            got.append(meanwhile())

    sink._check_plan_fence = fence_then_meanwhile  # type: ignore[method-assign]
    try:
        txn = sink.begin_transaction(zombie)
    finally:
        del sink._check_plan_fence
    assert got, "the zombie never reached its claim"
    return txn, got[0]


def test_a_zombie_attempt_waking_as_its_retry_claims_leaves_the_retrys_transaction_alone(kafka_service):
    """Batch 1, partition 0: attempt 0's executor was stopped after it described the slots; attempt
    1 (the retry) claims, writes and pre-commits; attempt 0 wakes, claims, writes and pre-commits
    too; Spark keeps attempt 1's handle.  Before: attempt 1 took slot 0, which attempt 0 then
    claimed from its stale look, aborting attempt 1's transaction (verify_prepared: "not deciding
    the batch").  Now attempt 1 starts on slot 1: the batch commits attempt 1's rows once and its
    cleanup aborts the zombie's transaction."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"lc1-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)
    committer = _committer(sink)
    try:
        intent0 = sink.plan_batch("q", 0, 1)                            # batch 0 uses slot 0 (ids reused)
        h0 = _prepare(sink, intent0, 0, 0, 0, _values("b0"))
        committer.commit(0, [h0], recovering=False)
        sink.abort_lingering("q", 0, intent0, [h0])
        intent1 = sink.plan_batch("q", 1, 1)
        started = time.time()
        zombie_ctx = TransactionContext("q", 1, 0, 0, intent1)
        zombie, retry = _claims_after(sink, zombie_ctx, lambda: _prepare(sink, intent1, 1, 0, 1, _values("retry")))
        sink.write(zombie, _rows("zombie"))
        sink.pre_commit(zombie)                                          # its result is lost with its executor
        sink.verify_prepared(1, [retry], prepare_started_at=started)     # was: "not deciding the batch"
        committer.commit(1, [retry], recovering=False)
        assert sink.abort_lingering("q", 1, intent1, [retry]) == 1      # the zombie's transaction
        assert Counter(read_committed(bs, topic)) == Counter(_values("b0") + _values("retry"))
        assert _open(sink, intent1) == []                               # batch 0's ids are batch 1's
    finally:
        sink.close()


class StageRetryRace(OneTask):
    """Batch work, one partition: in the first ``times`` ballots, attempt 0 of the old stage
    attempt (a zombie) describes the slots; then attempt 0 of the stage retry runs whole (Spark
    keeps its handle); then the zombie claims, writes and pre-commits."""

    def __init__(self, sink: Any, batch: pa.RecordBatch, times: int = 1):
        super().__init__(sink, batch)
        self.times, self.ballots = times, 0

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        self.ballots += 1
        if self.ballots > self.times:
            return super().prepare(query_name, batch_id, intent, run)
        zombie_ctx = TransactionContext(query_name, batch_id, 0, 0, intent, run)
        zombie, kept = _claims_after(self.sink, zombie_ctx, lambda: run_attempt(
            self.sink, TransactionContext(query_name, batch_id, 0, 0, intent, run), self.batch))
        self.sink.write(zombie, _rows("zombie"))
        self.sink.pre_commit(zombie)
        return [{"partition": 0, "attempt": 0, "rows": self.batch.num_rows, "handle": self.sink.encode_handle(kept)}]


def test_a_batch_whose_transaction_a_stage_retrys_zombie_aborted_before_the_decision_runs_again(
        kafka_service, tmp_path):
    """The race the slots cannot rule out: the stage retry's attempt 0 and the old stage attempt's
    attempt 0 start on the same slot, and the zombie's stale claim aborts the kept attempt's
    transaction before the decision.  Before: the batch failed ("not deciding the batch") and the
    query with it.  Now ``verify_prepared`` raises TransactionTakenError (the transaction was far
    younger than its timeout), the coordinator closes the ballot, whose cleanup aborts the
    zombie's transaction, and runs the batch again: committed in ballot 1, every row once."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"lc2-{uuid.uuid4().hex[:8]}"
    d = Driver(KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000), str(tmp_path / "log"), "q")
    try:
        assert d.batch(0, _rows("b0")).action == "committed"            # slot 0 is used: ids are reused
        work = StageRetryRace(d.sink, _rows("b1"))
        prog = BatchProgress("pipe", 1, None, "committed")
        d.protocol.run_batch(1, work, prog)                              # was: TwoPhaseError, not decided
        assert prog.action == "committed" and work.ballots == 2
        view = d.tlog.view(1)
        assert [(b.ballot, b.decision is not None and b.decision.aborted) for b in view.ballots] == \
            [(0, True), (1, False)]
        assert Counter(read_committed(bs, topic)) == Counter(_values("b0") + _values("b1"))
        assert _open(d.sink, d.intent(1)) == []
    finally:
        d.close()


def test_a_stage_retrys_zombie_that_keeps_aborting_fails_the_batch_after_a_bounded_number_of_ballots(
        kafka_service, tmp_path):
    """The same race in every ballot: the coordinator does not loop; after its re-runs it raises
    TransactionTakenError, nothing decided, nothing of the batch visible, nothing left open."""
    from twophase import TransactionTakenError

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"lc3-{uuid.uuid4().hex[:8]}"
    d = Driver(KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000), str(tmp_path / "log"), "q")
    try:
        assert d.batch(0, _rows("b0")).action == "committed"
        work = StageRetryRace(d.sink, _rows("b1"), times=99)
        with pytest.raises(TransactionTakenError, match="aborted long before their timeout"):
            d.protocol.run_batch(1, work, BatchProgress("pipe", 1, None, "committed"))
        assert work.ballots == 3
        view = d.tlog.view(1)
        assert view.committed is None and all(b.decision is not None and b.decision.aborted for b in view.ballots)
        assert Counter(read_committed(bs, topic)) == Counter(_values("b0"))
        assert _open(d.sink, d.intent(1)) == []
    finally:
        d.close()
