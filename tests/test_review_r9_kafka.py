"""Review r9 (issue 59's fault model) of KafkaSink's plan evidence ("open" vs "held").

A plan's snapshot of open transactions counts as leftovers of closed ballots when the plan fence
moved by exactly one from this object's previous plan.  But the bump and the DescribeTransactions
that follows are two requests: another run's plan (and its tasks' transactions) can land between
them, and were then listed as "open" (abortable by this ballot's cleanup, without any fence check).
Fixed: plan_batch reads the fence again after the describe and holds everything if it moved.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import pytest

from tests.inprocess import Driver, run_attempt
from tests.test_backfill_kafka import _rows, _sink
from tests.test_kafka_ownership import _values
from tests.test_kafka_sink import _topic, read_committed
from twophase import TransactionContext
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def test_r9_a_plan_landing_between_the_fence_bump_and_the_describe_is_not_proven(kafka_service, tmp_path):
    """Y (one sink object) runs batch 10, then plans batch 11: it bumps the plan fence (exactly one
    past its previous plan: 'proven') and pauses before describing the pool's ids.  X, a backfill of
    batch 5 over two partitions, takes the log over, plans (fence +1 again), pre-commits on -0.0 and
    -1.0 and verifies.  Y resumes: its describe finds X's two transactions and lists them as "open"
    (leftovers of closed ballots).  Y's INTENT lands (a deposed driver's write); its task refuses (the
    fence moved) and Y gives its ballot up: abort_lingering aborts what its snapshot lists, without
    asking the fence.  X commits -0.0, Y's cleanup runs, X's commit of -1.0 fails: half of batch 5."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=2), f"r9k-{uuid.uuid4().hex[:8]}"
    log_url = str(tmp_path / "log")

    def sink():  # the pool's proof is what this tests: batch jobs on the pool (they have ids of their own by default)
        return _sink(bs, topic, prefix, "pool")

    qid = batch_query_id("daily", sink().target())
    y = Driver(sink(), log_url, qid, takeover=True)
    y.batch(10, _rows("b10"))                                  # Y's object planned and closed batch 10
    xs: dict[str, Any] = {}
    bump = y.sink._bump_plan_fence

    def bump_then_backfill(client, batch_id, widest):
        got = bump(client, batch_id, widest)
        if batch_id == 11 and not xs:                          # Y paused between its bump and its describe
            x = Driver(sink(), log_url, qid, takeover=True)
            opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
            assert opened is not None
            started, results = time.time(), []
            for part in (0, 1):
                ctx = TransactionContext(opened.query_name, 5, part, 0, opened.intent, opened.run)
                h = run_attempt(x.sink, ctx, _rows(f"b5-p{part}"))
                results.append({"partition": part, "attempt": 0, "rows": 20, "handle": x.sink.encode_handle(h)})
            x.protocol.check_prepared(opened, results, started_at=started)
            xs.update(x=x, opened=opened, results=results)
        return got

    y.sink._bump_plan_fence = bump_then_backfill  # type: ignore[method-assign]
    y_opened = y.protocol.open_ballot(11, lambda p: 2, BatchProgress("pipe", 11, None, "committed"))
    assert y_opened is not None
    x, opened, results = xs["x"], xs["opened"], xs["results"]
    commit, gave_up = x.sink.commit, []

    def commit_then_y_gives_up(handle: dict) -> Any:
        res = commit(handle)
        if not gave_up:  # after X's first commit: Y's task fails (its fence moved), Y gives its ballot up
            ctx = TransactionContext(y_opened.query_name, 11, 1, 0, y_opened.intent, y_opened.run)
            with pytest.raises(Exception, match="late"):
                run_attempt(y.sink, ctx, _rows("b11-p1"))
            y.protocol.give_up(y_opened, RuntimeError("task failed"))
            gave_up.append(True)
        return res

    x.sink.commit = commit_then_y_gives_up  # type: ignore[method-assign]
    try:
        print("Y's snapshot:", y_opened.intent["pool"].get("open"), "held:", y_opened.intent["pool"].get("held"))
        # X's plan landed between Y's bump and Y's describe: nothing proves X's transactions a closed
        # ballot's leftovers, so Y holds them (its fence, read again after the describe, moved).
        assert y_opened.intent["pool"]["open"] == {}, y_opened.intent["pool"]
        assert sorted(y_opened.intent["pool"]["held"]) == [f"{prefix}-0.0", f"{prefix}-1.0"], y_opened.intent["pool"]
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        assert gave_up
        got = Counter(read_committed(bs, topic))
        assert got == Counter(_values("b10") + _values("b5-p0") + _values("b5-p1")), got
    finally:
        del x.sink.commit
        for d in (x, y):
            d.sink.close()
            d.close()
