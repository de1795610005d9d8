"""A deposed coordinator's plan that lands late, after the owner planned its own ballot (Kafka).

Found by the nemesis (tests/nemesis.py, Kafka, driver d5 cut off from the network while it
planned batch 29): d5's InitProducerId on the sink's plan fence was answered only after the heal,
once its successor d6 (epoch 6) had planned batch 40.  The fence then stood one epoch past d6's
INTENT, so every attempt of every batch-40 task refused to claim a transactional id ("this task
attempt is late ... It claims no transactional id and writes nothing"), Spark failed the job, and
the *owner* exited; d5's INTENT was refused right after ("coordinator epoch 6 opened ballot 0
first").  Exactly-once held; the pipeline stopped.

Now the owner, when its ballot fails before its decision, asks the sink whether a later plan
stopped its tasks (``plan_superseded``); if so, and it still owns the log, it runs the batch
again in a new ballot.  That is safe: the refused attempts claimed and wrote nothing, and the
failed ballot is closed (and its names aborted) before the next one opens.  A coordinator whose
heartbeat already found it fenced does not plan at all.

Without Spark (tests/inprocess.py), on a real log and the real broker.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from tests.inprocess import Driver, OneTask, ids
from tests.test_kafka_sink import _topic, read_committed
from twophase import LogOwnershipError, TwoPhaseError
from twophase.protocol import BatchProgress


def values(*numbers: int) -> pa.RecordBatch:
    return pa.record_batch({"value": [f"v{i}".encode() for i in numbers]})


class DeposedPlanLandsFirst(OneTask):
    """The owner's batch, one partition, run in-process; before its task begins (``times`` ballots
    in a row), the deposed coordinator's plan request lands and moves the plan fence."""

    def __init__(self, sink: Any, batch: pa.RecordBatch, late_plan: Any, times: int = 1):
        super().__init__(sink, batch)
        self.late_plan, self.times, self.ballots = late_plan, times, 0

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        self.ballots += 1
        if self.ballots <= self.times:
            self.late_plan()
        return super().prepare(query_name, batch_id, intent, run)


def _drivers(bs: str, topic: str, log_url: str) -> tuple[Driver, Driver]:
    """A commits batch 0; B takes the log over and commits batch 1.  Returns (A, B)."""
    from twophase.sinks.kafka import KafkaSink

    prefix = f"lp-{uuid.uuid4().hex[:8]}"

    def make() -> KafkaSink:
        return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)

    a = Driver(make(), log_url, "q")
    assert a.batch(0, values(1, 2)).action == "committed"
    b = Driver(make(), log_url, "q", takeover=True)
    assert b.tlog.epoch > a.tlog.epoch
    assert b.batch(1, values(3)).action == "committed"
    return a, b


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_deposed_coordinators_late_plan_does_not_fail_the_owners_kafka_batch(kafka_service, tmp_path):
    """A, deposed, was planning batch 1 (its fast path after batch 0) when it was cut off; its plan
    lands just as B's batch-2 task is about to begin.  Before: B's task refused to write (the
    plan fence had moved past B's INTENT) and B's batch failed.  Now B runs the batch again in a
    new ballot and commits it; A's INTENT is refused; every record is read once."""
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, partitions=1)
    a, b = _drivers(bs, topic, str(tmp_path / "log"))
    try:
        work = DeposedPlanLandsFirst(b.sink, values(4, 5), lambda: a.sink.plan_batch(a.query_name, 1, 1))
        prog = BatchProgress("pipe", 2, None, "committed")
        b.protocol.run_batch(2, work, prog)                  # was: TwoPhaseError "this task attempt is late"
        assert prog.action == "committed" and prog.rows == 2
        assert work.ballots == 2
        view = b.tlog.view(2)
        assert [(x.ballot, x.decision is not None and x.decision.aborted) for x in view.ballots] == \
            [(0, True), (1, False)]
        assert view.committed is not None
        with pytest.raises(LogOwnershipError, match="stops without writing"):
            a.batch(1, values(3))                            # A's INTENT, after its plan: refused
        assert Counter(read_committed(bs, topic)) == Counter(f"v{i}".encode() for i in range(1, 6))
    finally:
        a.close()
        b.close()


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_plan_fence_that_keeps_moving_fails_the_batch_after_a_bounded_number_of_ballots(kafka_service, tmp_path):
    """A later plan before every ballot (something keeps planning under this query's prefix): the
    owner does not loop; after its re-runs it raises the tasks' own error, nothing decided."""
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, partitions=1)
    a, b = _drivers(bs, topic, str(tmp_path / "log"))
    try:
        work = DeposedPlanLandsFirst(b.sink, values(4, 5), lambda: a.sink.plan_batch(a.query_name, 1, 1), times=99)
        with pytest.raises(TwoPhaseError, match="this task attempt is late"):
            b.protocol.run_batch(2, work, BatchProgress("pipe", 2, None, "committed"))
        assert work.ballots == 3
        view = b.tlog.view(2)
        assert view.committed is None and all(x.decision is not None and x.decision.aborted for x in view.ballots)
        assert Counter(read_committed(bs, topic)) == Counter(f"v{i}".encode() for i in range(1, 4))
    finally:
        a.close()
        b.close()


def test_a_coordinator_its_heartbeat_found_fenced_does_not_plan(tmp_path):
    """The deposed side: once its log told it a newer coordinator took over, it stops before
    asking the sink for a plan (which, for Kafka, would move the owner's plan fence)."""
    from twophase.sinks.files import FileSink

    out, log_url = str(tmp_path / "out"), str(tmp_path / "log")
    a = Driver(FileSink(out, format="jsonl"), log_url, "q")
    assert a.batch(0, ids(1)).action == "committed"
    b = Driver(FileSink(out, format="jsonl"), log_url, "q", takeover=True)
    try:
        with pytest.raises(LogOwnershipError):
            a.tlog.check_fence()                             # what its heartbeat thread does
        planned = []
        a.sink.plan_batch = lambda *args: planned.append(args) or {}  # type: ignore[method-assign]
        with pytest.raises(LogOwnershipError, match="without planning"):
            a.batch(1, ids(2))
        assert planned == []
        assert b.batch(1, ids(2)).action == "committed"
    finally:
        a.close()
        b.close()
