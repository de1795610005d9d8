"""KafkaSink: late task attempts and deposed drivers never destroy a decided transaction (issue 25,
scenario 3), and a committed transaction whose id moved on is not reported lost.

Each test plays one scenario of the issue on the real broker, driving the sink's executor side
(begin_transaction, write, pre_commit) and driver side (plan_batch, verify_prepared, the
coordinator's Committer, abort_lingering) in the order the coordinator and Spark would, with the
late actor slotted in where the issue puts it.  No Spark: a "late attempt" is a task attempt whose
context carries its (older) ballot's INTENT.

Each failed on the sink before transactional ids were claimed (one id ``{prefix}-{partition}`` per
partition, which every attempt, ballot and batch initialised unconditionally, aborting whatever it
held): ``DataLossError`` for a decided batch, or a read_committed reader held back for good.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _topic, read_committed
from twophase.context import TransactionContext
from twophase.errors import DataLossError, TwoPhaseError
from twophase.recovery import Committer
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def _values(tag: str, n: int = 20) -> list[bytes]:
    return [f"{tag}-{i}".encode() for i in range(n)]


def _prepare(sink: KafkaSink, intent: dict, batch: int, partition: int, attempt: int, values: list[bytes]) -> dict:
    """One task attempt of one ballot, as on an executor: begin, write, pre-commit."""
    txn = sink.begin_transaction(TransactionContext("q", batch, partition, attempt, intent))
    sink.write(txn, pa.RecordBatch.from_pydict({"value": values}))
    return sink.pre_commit(txn)


def _committer(sink: KafkaSink) -> Committer:
    """The coordinator's committer: a handle the sink reports LOST raises DataLossError; RETRY_LATER
    (e.g. transaction markers still being written) is asked again."""
    return Committer(sink, retries=10, backoff=0.1, max_backoff=1.0)


def _open(sink: KafkaSink, intent: dict) -> list[str]:
    """The ids an INTENT names that hold an open transaction."""
    tids = list(intent["transactional_ids"])
    states = sink._txn_client().describe_transactions(tids)
    return sorted(t for t, d in states.items() if d.state in ("Ongoing", "PrepareAbort", "PrepareCommit"))


def _sink(bs: str, topic: str, prefix: str) -> KafkaSink:
    return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)


def test_a_late_attempt_beginning_between_the_decision_and_the_commit_leaves_the_batch_committed(kafka_service):
    """The issue's reproduction: batch 0 is decided; before its commit, a late attempt of one of its
    partitions (a stage retry's duplicate) begins its Kafka transaction.  Before: its
    init_transactions aborted the decided transaction of that partition, and the batch raised
    DataLossError.  Now it claims a free id of its own; the batch commits, every row once, and the
    batch's cleanup aborts the late attempt's transaction, whose pre-commit then fails."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"own1-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    intent = sink.plan_batch("q", 0, 2)                                  # batch 0's ballot
    started = time.time()
    handles = [_prepare(sink, intent, 0, p, 0, _values(f"b0-p{p}")) for p in (0, 1)]
    sink.verify_prepared(0, handles, prepare_started_at=started)
    # -- the decision (PREPARED) is logged here; the commit has not started --
    late = sink.begin_transaction(TransactionContext("q", 0, 0, 1, intent))
    sink.write(late, pa.RecordBatch.from_pydict({"value": _values("late")}))
    late.producer.flush(30)                                              # written, open, then it pauses
    _committer(sink).commit(0, handles, recovering=False)                # was: DataLossError (p0 fenced)
    assert sink.abort_lingering("q", 0, intent, handles) == 1            # the late attempt's transaction
    assert Counter(read_committed(bs, topic)) == Counter(_values("b0-p0") + _values("b0-p1"))
    assert late.transactional_id not in {h["transactional_id"] for h in handles}
    # The late attempt goes on: its pre-commit fails (its transaction is gone), nothing stays open.
    with pytest.raises(TwoPhaseError, match="no longer open"):
        sink.pre_commit(late)
    sink.abort(late)
    assert _open(sink, intent) == []
    sink.close()


def test_a_late_attempt_of_an_older_batch_is_refused_while_a_later_batch_is_decided(kafka_service):
    """A zombie task of batch 0 starts after batch 1 was planned and decided.  Before: it initialised
    the partition's id, aborting batch 1's decided transaction (DataLossError).  Now it reads the plan
    fence, sees a later plan, and stops before touching any id."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"own2-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    intent0 = sink.plan_batch("q", 0, 1)
    h0 = _prepare(sink, intent0, 0, 0, 0, _values("b0"))
    _committer(sink).commit(0, [h0], recovering=False)
    sink.abort_lingering("q", 0, intent0, [h0])
    intent1 = sink.plan_batch("q", 1, 1)
    started = time.time()
    h1 = _prepare(sink, intent1, 1, 0, 0, _values("b1"))
    sink.verify_prepared(1, [h1], prepare_started_at=started)
    # -- batch 1 is decided; batch 0's late attempt starts now --
    client = sink._txn_client()

    def epochs() -> dict:  # batch 1's commit changes states, never producer ids or epochs
        states = client.describe_transactions(intent0["transactional_ids"])
        return {t: (d.error_code, d.producer_id, d.producer_epoch) for t, d in states.items()}

    before = epochs()
    try:
        late = sink.begin_transaction(TransactionContext("q", 0, 0, 1, intent0))
    except TwoPhaseError as e:
        refused = str(e)
    else:
        refused = ""
        sink.abort(late)
    _committer(sink).commit(1, [h1], recovering=False)                   # was: DataLossError
    assert "this task attempt is late" in refused and "writes nothing" in refused, refused
    assert epochs() == before                                            # no id was initialised
    assert Counter(read_committed(bs, topic)) == Counter(_values("b0") + _values("b1"))
    sink.close()


def test_a_deposed_drivers_cleanup_leaves_the_newer_ballots_decided_transactions_alone(kafka_service):
    """Driver A runs ballot 0 of batch 0 and pauses with partition 0 pre-committed (partition 1 never
    ran).  B takes the batch over: closes A's ballot, aborts what it left, runs ballot 1 over both
    partitions and decides it.  A wakes and cleans up its own (closed) ballot before B commits.
    Before: A's cleanup fenced every id A's INTENT named, B's decided transactions included
    (DataLossError).  Now A sees a newer plan and aborts only what its INTENT recorded as open
    before its own ballot: nothing of B's, not even B's partition 1, on an id A never used."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"own3-{uuid.uuid4().hex[:8]}"
    a, b = _sink(bs, topic, prefix), _sink(bs, topic, prefix)
    intent_a = a.plan_batch("q", 0, 2)
    _prepare(a, intent_a, 0, 0, 0, _values("a-p0"))                      # A pauses here
    assert b.abort_lingering("q", 0, intent_a, []) == 1                  # B: A's ballot is closed
    intent_b = b.plan_batch("q", 0, 2)
    started = time.time()
    handles = [_prepare(b, intent_b, 0, p, 0, _values(f"b-p{p}")) for p in (0, 1)]
    b.verify_prepared(0, handles, prepare_started_at=started)
    # -- B's decision is logged; A wakes up and cleans up its ballot --
    aborted_by_a = a.abort_lingering("q", 0, intent_a, [])               # was: 2, B's transactions
    _committer(b).commit(0, handles, recovering=False)                   # was: DataLossError
    assert aborted_by_a == 0
    assert b.abort_lingering("q", 0, intent_b, handles) == 0
    assert Counter(read_committed(bs, topic)) == Counter(_values("b-p0") + _values("b-p1"))
    assert _open(b, intent_b) == [] and _open(b, intent_a) == []
    a.close()
    b.close()


def test_a_late_attempts_open_transaction_is_aborted_within_the_next_batch(kafka_service):
    """Batch 0 ran over two partitions and is committed and cleaned up; then a late attempt of its
    partition 1 claims an id, writes and pauses, holding back every read_committed reader of the
    topic partition.  Batch 1 runs over one partition only.  Before: batch 1 never looked at
    partition 1's id, so readers stayed held back until the transaction timed out.  Now batch 1's
    plan sees the open transaction on the pool (ids of wider earlier plans included) and batch 1's
    cleanup aborts it: at the end of batch 1, readers see both batches and none of the late rows."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"own4-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    intent0 = sink.plan_batch("q", 0, 2)
    handles0 = [_prepare(sink, intent0, 0, p, 0, _values(f"b0-p{p}")) for p in (0, 1)]
    _committer(sink).commit(0, handles0, recovering=False)
    # The late attempt checked the plan fence before batch 0's cleanup closed the plan there (since
    # that close, an attempt of batch 0 that checks it claims nothing: test_kafka_takeover_after_intent.py),
    # and claims after the cleanup looked at the ids: its check is played before the cleanup.
    check = sink._check_plan_fence
    sink._check_plan_fence(TransactionContext("q", 0, 1, 1, intent0), sink._task_client(), intent0["pool"])
    assert sink.abort_lingering("q", 0, intent0, handles0) == 0
    sink._check_plan_fence = lambda *a: None  # type: ignore[method-assign]  # (checked above)
    late = sink.begin_transaction(TransactionContext("q", 0, 1, 1, intent0))
    sink._check_plan_fence = check  # type: ignore[method-assign]
    sink.write(late, pa.RecordBatch.from_pydict({"value": _values("late")}))
    late.producer.flush(30)                                              # open, then the attempt pauses
    intent1 = sink.plan_batch("q", 1, 1)
    started = time.time()
    h1 = _prepare(sink, intent1, 1, 0, 0, _values("b1"))
    sink.verify_prepared(1, [h1], prepare_started_at=started)
    _committer(sink).commit(1, [h1], recovering=False)
    sink.abort_lingering("q", 1, intent1, [h1])                          # the end of batch 1
    seen = Counter(read_committed(bs, topic))
    assert seen == Counter(_values("b0-p0") + _values("b0-p1") + _values("b1")), \
        f"{len(seen)} rows visible: readers are held back by the late attempt's transaction"
    assert _open(sink, intent0) == [] and _open(sink, intent1) == []
    sink._release(late)
    sink.close()


def test_a_committed_transaction_whose_id_was_initialised_again_is_recovered_as_committed_not_lost(
        kafka_service):
    """The decided batch 0 was committed, then a zombie initialised its transactional id, and the
    driver died before COMMITTED was logged.  Recovery commits again: EndTxn answers PRODUCER_FENCED.
    Before: reported LOST (DataLossError), though every row was visible.  Now the handle's first
    offsets show the records are visible: already committed.  A transaction that was really aborted
    (its id initialised while it was open) is still reported lost, saying so."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"own5-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    client = sink._txn_client()

    def initialise(tid: str) -> None:  # a zombie producer's InitProducerId: aborts what is open
        deadline = time.time() + 30
        while client.init_producer_id(tid, 60_000)[0] != 0:
            assert time.time() < deadline, f"InitProducerId on {tid} kept failing"
            time.sleep(0.1)

    h0 = _prepare(sink, sink.plan_batch("q", 0, 1), 0, 0, 0, _values("b0"))
    _committer(sink).commit(0, [h0], recovering=False)
    initialise(h0["transactional_id"])
    restarted = _sink(bs, topic, prefix)                                 # a new driver, from the log
    result = _committer(restarted).commit(0, [h0], recovering=True)[0]   # was: DataLossError
    assert result.outcome is CommitOutcome.ALREADY_COMMITTED, result
    assert "visible to read_committed readers" in result.reason
    h1 = _prepare(sink, sink.plan_batch("q", 1, 1), 1, 0, 0, _values("b1"))
    initialise(h1["transactional_id"])                                   # aborts the open transaction
    with pytest.raises(DataLossError, match="was aborted.*read_committed readers never saw it"):
        _committer(restarted).commit(1, [h1], recovering=True)
    assert Counter(read_committed(bs, topic)) == Counter(_values("b0"))
    sink.close()
    restarted.close()
