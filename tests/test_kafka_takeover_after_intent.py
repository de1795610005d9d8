"""KafkaSink: a late attempt of a closed ballot must not open a transaction that another run's plan holds.

Found by the Kafka ownership conformance run (tests/test_conformance_kafka.py): "row ... is missing
although the log decided its batch" after a takeover (A deposed after its INTENT), after a second
pipeline, after a new generation.  Each time an open transaction of the pool held the topic
partition's last stable offset back: a late task attempt of a ballot that was committed and cleaned
up (a zombie executor, a stage retry's duplicate) still found the plan fence at its INTENT's epoch,
claimed a free id and wrote.  The next plan, another run's (a fresh sink object: another pipeline,
the run that took the log over), cannot tell whose that transaction is, so it holds it (issue 59's
rule: no abort without evidence), and nobody aborts it before the broker's transaction timeout:
read_committed readers do not see the next decided batch for that long.  Now the cleanup of a decided
ballot closes its plan at the fence (a bump conditional on the plan's epoch): a late attempt of it
claims nothing.  (Before: the late attempt claimed ``-0.1`` and run Y's committed rows stayed
invisible; the reader's last assertion failed.)
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from tests.test_kafka_ownership import _committer, _open, _prepare, _sink, _values
from tests.test_kafka_sink import _topic, read_committed
from twophase import TransactionContext
from twophase.errors import TwoPhaseError

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def test_a_late_attempt_after_the_ballots_cleanup_claims_nothing_so_another_runs_batch_is_readable(kafka_service):
    """Run X commits batch 0 and cleans up; a late attempt of batch 0 starts after that; run Y (another
    sink object: another pipeline, or the run that took the log over) plans, commits and cleans up
    batch 0 of its own.  Readers must see both runs' rows at once."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"tai-{uuid.uuid4().hex[:8]}"
    x, y = _sink(bs, topic, prefix), _sink(bs, topic, prefix)
    late = None
    try:
        intent_x = x.plan_batch("q", 0, 1)
        hx = _prepare(x, intent_x, 0, 0, 0, _values("x"))
        _committer(x).commit(0, [hx], recovering=False)
        assert x.abort_lingering("q", 0, intent_x, [hx]) == 0          # X's ballot is closed
        assert not x.plan_superseded(intent_x)                          # its own close is no newer plan
        try:
            late = x.begin_transaction(TransactionContext("q", 0, 0, 1, intent_x))  # the zombie
        except TwoPhaseError as e:
            assert "late" in str(e), e
        if late is not None:  # before: it claimed an id, wrote, and paused there
            x.write(late, pa.RecordBatch.from_pydict({"value": _values("late")}))
            late.producer.flush(30)
        intent_y = y.plan_batch("q", 0, 1)
        started = time.time()
        hy = _prepare(y, intent_y, 0, 0, 0, _values("y"))
        y.verify_prepared(0, [hy], prepare_started_at=started)
        _committer(y).commit(0, [hy], recovering=False)
        y.abort_lingering("q", 0, intent_y, [hy])
        assert Counter(read_committed(bs, topic)) == Counter(_values("x") + _values("y")), \
            "run Y's committed rows are not readable: an open transaction holds the last stable offset back"
        assert late is None and _open(y, intent_y) == []
    finally:
        if late is not None:
            x._release(late)
        x.close()
        y.close()


def test_an_undecided_ballots_cleanup_leaves_its_plan_open_for_a_replay_under_the_same_intent(kafka_service):
    """Only a decided ballot's cleanup closes its plan at the fence.  abort_lingering(keep=[]) may
    come before the same INTENT runs again (the sink's contract; the crash conformance machine's
    replay): its tasks still claim, and plan_superseded stays False; another run's plan after it
    supersedes it.  A decided ballot's cleanup closes the plan, which is not a newer plan for the
    object that closed it."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"tai2-{uuid.uuid4().hex[:8]}"
    x, y = _sink(bs, topic, prefix), _sink(bs, topic, prefix)
    try:
        intent = x.plan_batch("q", 0, 1)
        txn = x.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
        x.write(txn, pa.RecordBatch.from_pydict({"value": _values("failed")}))
        txn.producer.flush(30)
        x._release(txn)                                                 # the attempt died, left open
        assert x.abort_lingering("q", 0, intent, []) == 1               # undecided: cleaned up, not closed
        assert not x.plan_superseded(intent)
        h = _prepare(x, intent, 0, 0, 0, _values("replay"))             # the replay under the same INTENT
        _committer(x).commit(0, [h], recovering=False)
        assert x.abort_lingering("q", 0, intent, [h]) == 0              # decided: closed
        assert not x.plan_superseded(intent)
        assert _open(x, intent) == []
        assert Counter(read_committed(bs, topic)) == Counter(_values("replay"))
        y.plan_batch("q", 1, 1)
        assert x.plan_superseded(intent)
    finally:
        x.close()
        y.close()
