"""KafkaSink under issue 59's fault model: two runs of one batch job that overlap, and evidence
(a topic's records at an offset) that someone else can delete.

- Scenario 2: a run of batch 11 that recovered before a backfill of batch 5 took the log over plans
  after the backfill's tasks pre-committed.  Its plan listed the backfill's open transactions as
  leftovers of closed ballots, and its task aborted one between the backfill's two commits: half
  of batch 5 visible, DataLossError on every later run.
- Scenario 5: a commit whose transactional id moved on reads its transaction's fate from the record
  at its first offset.  After the topic was deleted and recreated under its name, that offset
  holds another transaction's record: a committed batch was judged never visible (run again: a
  duplicate), an aborted one already committed (silent loss).  Handles now name their record
  (topic id, producer id and epoch); another's record is "gone": DataLossError naming the topic.

On the real broker, without Spark (tests/inprocess.py drives the protocol in process).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from typing import Any

import pyarrow as pa
import pytest

from tests.inprocess import Driver, run_attempt
from tests.test_kafka_ownership import _committer, _prepare, _values
from tests.test_kafka_sink import _topic, read_committed
from twophase import TransactionContext
from twophase.errors import BatchVanishedError, DataLossError
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]


def _sink(bs: str, topic: str, prefix: str, transactional_ids: str = "auto") -> KafkaSink:
    return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000, transactional_ids=transactional_ids)


def _other_producer(bs: str, topic: str, *, aborted: int = 0, committed: int = 0) -> None:
    """Another producer's transactions on ``topic``: ``aborted`` records in one aborted transaction,
    then ``committed`` records in one committed transaction."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bs, "transactional.id": f"other-{uuid.uuid4().hex[:8]}"})
    p.init_transactions(30)
    for n, commit in ((aborted, False), (committed, True)):
        if not n:
            continue
        p.begin_transaction()
        for i in range(n):
            p.produce(topic, f"other-{commit}-{i}".encode(), partition=0)
        p.flush(30)
        (p.commit_transaction if commit else p.abort_transaction)(30)


def _recreate(bs: str, topic: str) -> None:
    """Delete ``topic`` and create it again under its name (one partition): a new topic id, offsets
    from 0 again."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bs})
    admin.delete_topics([topic])[topic].result(30)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            _topic(bs, partitions=1, name=topic)
            return
        except Exception:  # noqa: BLE001 - the deletion is still under way
            time.sleep(0.5)
    raise AssertionError(f"{topic} could not be created again")


def _move_on(sink: KafkaSink, tid: str) -> None:
    """Initialise ``tid`` again (as the next batch's claim does): an open transaction is aborted."""
    deadline = time.time() + 30
    while True:  # CONCURRENT_TRANSACTIONS while a commit's or an abort's markers are written
        code, _, _ = sink._txn_client().init_producer_id(tid, 60_000)
        if code == 0 or time.time() > deadline:
            break
        time.sleep(0.2)
    assert code == 0


@pytest.mark.parametrize("fate", ["committed", "aborted"])
def test_scenario_5_a_decided_batch_on_a_recreated_topic_is_reported_lost_naming_the_topic(kafka_service, fate):
    """Batch 0 is decided; its transaction committed (the driver died before COMMITTED) or was aborted
    (another actor's InitProducerId); the id moves on; the topic is deleted and recreated, and
    another producer writes there, at the offsets the handle names.  The commit after the restart
    finds its id moved on and reads the record at its first offset.  Before: the committed batch was
    judged never visible (BatchVanishedError: void, run again, every row twice), the aborted one
    already committed (its rows silently lost).  Now: DataLossError naming the recreated topic."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"s5a-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    try:
        intent = sink.plan_batch("q", 0, 1)
        started = time.time()
        h = _prepare(sink, intent, 0, 0, 0, _values("b0"))
        assert h["txn_start_offsets"] == {f"{topic}:0": 0}
        sink.verify_prepared(0, [h], prepare_started_at=started)
        # -- decided --
        if fate == "committed":
            assert sink.commit(h).outcome is CommitOutcome.COMMITTED      # COMMITTED not logged: a crash
        _move_on(sink, h["transactional_id"])                             # aborts it if still open
        _recreate(bs, topic)
        if fate == "committed":   # at the handle's offset: an aborted record, then a committed one
            _other_producer(bs, topic, aborted=5, committed=3)
        else:                     # at the handle's offset: a committed record
            _other_producer(bs, topic, committed=30)
        with pytest.raises(DataLossError) as lost:
            _committer(sink).commit(0, [h], recovering=False)   # was: BatchVanishedError / ALREADY_COMMITTED
        assert not isinstance(lost.value, BatchVanishedError), lost.value
        assert topic in str(lost.value) and "recreated" in str(lost.value), lost.value
        assert h["txn_topic_ids"].get(topic)                                  # the handle named the topic
    finally:
        sink.close()


def test_scenario_5_b_an_aborted_transaction_followed_by_another_producers_commit_is_not_already_committed(
        kafka_service):
    """The read_committed verdict: a transaction aborted (its id initialised again) whose first record
    is followed by another producer's committed record.  A read_committed reader from the first
    offset gets that later record: the transaction is aborted, never visible, whatever comes after.
    Kills the mutant ``m.offset() == offset`` -> ``>=`` in ``_records_fate`` (which reads the later
    record as this transaction's: ALREADY_COMMITTED, the batch's rows silently lost)."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"s5b-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    try:
        _other_producer(bs, topic, committed=2)                            # the first offset is not 0
        intent = sink.plan_batch("q", 0, 1)
        h = _prepare(sink, intent, 0, 0, 0, _values("b0"))
        (tp, first), = h["txn_start_offsets"].items()
        assert first == 3                                                  # 2 records and their marker
        _move_on(sink, h["transactional_id"])                              # aborts it
        _other_producer(bs, topic, committed=1)
        res = sink.commit(h)
        assert res.outcome is CommitOutcome.LOST and res.never_visible, res
        assert f"{tp} (offset {first}) was aborted" in res.reason, res.reason
        assert Counter(read_committed(bs, topic)) == Counter([b"other-True-0", b"other-True-1", b"other-True-0"])
    finally:
        sink.close()


def _rows(tag: str) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"value": _values(tag)})


def test_scenario_2_a_run_planning_after_a_backfills_tasks_leaves_its_decided_transactions_alone(
        kafka_service, tmp_path):
    """Two runs of one batch job.  Y (batch 11) has recovered and pauses before its plan; X, a
    backfill of batch 5 over two partitions, takes the log over, pre-commits on ``-0.0`` and
    ``-1.0`` and passes verify_prepared.  Y resumes and plans batch 11: its snapshot of open ids
    finds X's two transactions.  X decides and commits its first transaction; Y's partition-1 task
    runs; X commits its second.  Before: Y's plan listed X's transactions as leftovers of closed
    ballots, Y's task aborted ``-1.0`` and claimed ``-1.1``, and X's second commit was
    INVALID_TXN_STATE: DataLossError, partition 1's rows lost.  Now Y's plan cannot prove the ballot
    before it was its own and closed (another plan landed in between), so it holds them as
    someone else's: its task takes another slot, its cleanup leaves them, X commits whole.  On the
    pool (``transactional_ids="pool"``): batch jobs plan on ids of their own by default (below)."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=2), f"s2-{uuid.uuid4().hex[:8]}"
    log_url = str(tmp_path / "log")

    def sink() -> KafkaSink:
        return _sink(bs, topic, prefix, "pool")

    qid = batch_query_id("daily", sink().target())
    y = Driver(sink(), log_url, qid, takeover=True)
    xs: dict[str, Any] = {}

    def y_partitions(planned: int | None) -> int:
        # Y is between its recovery and its plan: the backfill X runs up to its verified handles.
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
        return 2

    y_opened = y.protocol.open_ballot(11, y_partitions, BatchProgress("pipe", 11, None, "committed"))
    assert y_opened is not None
    x, opened, results = xs["x"], xs["opened"], xs["results"]
    assert sorted(x.sink.decode_handle(r["handle"])["transactional_id"] for r in results) == \
        [f"{prefix}-0.0", f"{prefix}-1.0"]
    commit, y_handles = x.sink.commit, []

    def commit_then_y_task(handle: dict) -> Any:
        res = commit(handle)
        if not y_handles:  # after X's first commit, before the others: Y's partition-1 task
            ctx = TransactionContext(y_opened.query_name, 11, 1, 0, y_opened.intent, y_opened.run)
            y_handles.append(run_attempt(y.sink, ctx, _rows("b11-p1")))
        return res

    x.sink.commit = commit_then_y_task  # type: ignore[method-assign]
    try:
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))  # was DataLossError
        assert y_handles and y_handles[0]["transactional_id"] != f"{prefix}-1.0"
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0") + _values("b5-p1"))
        assert x.tlog.view(5).committed is not None
        # Y's ballot is given up (it was deposed): its cleanup aborts its own transaction alone.
        y.protocol.give_up(y_opened, RuntimeError("deposed"))
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0") + _values("b5-p1"))
    finally:
        del x.sink.commit
        for d in (x, y):
            d.sink.close()
            d.close()


@pytest.mark.parametrize("ids", ["pool", "auto"])
def test_a_task_paused_between_its_claim_and_its_producers_init_beside_a_backfill(kafka_service, tmp_path, ids):
    """The explorer's ``decided-fenced`` (docs/explorer.md) on the real broker.  Y (batch 11) planned;
    its partition-1 task claims an id (a conditional InitProducerId) and pauses before its producer's
    InitProducerId (librdkafka's ``init_transactions``, unconditional).  X, a backfill of batch 5,
    takes the log over, pre-commits both partitions, decides and commits its first transaction.  Y
    resumes.  On the pool, X's partition-1 task claimed the very id Y claimed (Empty, so claimable):
    Y's InitProducerId aborts X's decided transaction, X's second commit fails, DataLossError, half of
    batch 5 visible.  By default a batch job's ballot plans on ids of its own: Y's InitProducerId
    lands on an id X never names, X commits whole."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=2), f"ci-{uuid.uuid4().hex[:8]}"
    log_url = str(tmp_path / "log")

    def sink() -> KafkaSink:
        return _sink(bs, topic, prefix, ids)

    qid = batch_query_id("daily", sink().target())
    y = Driver(sink(), log_url, qid, takeover=True)
    y_opened = y.protocol.open_ballot(11, lambda p: 2, BatchProgress("pipe", 11, None, "committed"))
    assert y_opened is not None
    claimed, resume = threading.Event(), threading.Event()
    y_out: dict[str, Any] = {}
    conf = y.sink._producer_config

    def paused_after_the_claim(tid: str, box: list) -> dict[str, Any]:
        y_out.setdefault("claimed", tid)  # the claim landed; the producer's InitProducerId has not
        claimed.set()
        assert resume.wait(120)
        return conf(tid, box)

    y.sink._producer_config = paused_after_the_claim  # type: ignore[method-assign]

    def y_task() -> None:
        try:
            ctx = TransactionContext(y_opened.query_name, 11, 1, 0, y_opened.intent, y_opened.run)
            y_out["handle"] = run_attempt(y.sink, ctx, _rows("b11-p1"))
        except BaseException as e:  # noqa: BLE001 - reported below
            y_out["error"] = e

    thread = threading.Thread(target=y_task, daemon=True)
    thread.start()
    assert claimed.wait(60), y_out
    x = Driver(sink(), log_url, qid, takeover=True)
    try:
        opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None
        started, results = time.time(), []
        for part in (0, 1):
            ctx = TransactionContext(opened.query_name, 5, part, 0, opened.intent, opened.run)
            h = run_attempt(x.sink, ctx, _rows(f"b5-p{part}"))
            results.append({"partition": part, "attempt": 0, "rows": 20, "handle": x.sink.encode_handle(h)})
        x.protocol.check_prepared(opened, results, started_at=started)
        x_ids = sorted(x.sink.decode_handle(r["handle"])["transactional_id"] for r in results)
        commit = x.sink.commit

        def commit_then_y_resumes(handle: dict) -> Any:
            res = commit(handle)
            if not resume.is_set():  # after X's first commit: Y's producer initialises its id
                resume.set()
                thread.join(120)
            return res

        x.sink.commit = commit_then_y_resumes  # type: ignore[method-assign]
        if ids == "pool":
            assert y_out["claimed"] == f"{prefix}-1.0" and f"{prefix}-1.0" in x_ids, (y_out, x_ids)
            with pytest.raises(DataLossError):
                x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
            assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0")), "half of batch 5"
            return
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        # X's takeover closed Y's ballot, and its cleanup closed Y's plan and bumped Y's claimed id:
        # Y's producer lands one epoch off, Y's claim of another id finds the plan closed: nothing written.
        assert not thread.is_alive() and "handle" not in y_out, y_out
        assert "this task attempt is late" in str(y_out["error"]), y_out  # its next id: the fence read after the claim
        y_ids = {t for t in y_opened.intent["transactional_ids"]}
        own_y, own_x = y_opened.intent["pool"]["ids"], opened.intent["pool"]["ids"]
        assert own_y != own_x and all(t.startswith(f"{prefix}-{own_y}-") for t in y_ids), (y_ids, own_y)
        assert all(t.startswith(f"{prefix}-{own_x}-") for t in x_ids) and not set(x_ids) & y_ids, (x_ids, y_ids)
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0") + _values("b5-p1"))
        assert x.tlog.view(5).committed is not None
        # Y was deposed: giving its ballot up aborts its own transaction alone.
        y.protocol.give_up(y_opened, RuntimeError("deposed"))
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0") + _values("b5-p1"))
        states = x.sink._txn_client().describe_transactions(sorted(y_ids | set(x_ids)))
        assert all(d.state != "Ongoing" for d in states.values()), states
    finally:
        resume.set()
        thread.join(60)
        for d in (x, y):
            d.sink.close()
            d.close()


@pytest.mark.parametrize("ids", ["auto", "per-plan", "pool"])
def test_a_stage_retrys_duplicate_attempt_claiming_from_a_stale_look_beside_a_decided_transaction(
        kafka_service, tmp_path, ids):
    """Found by the fresh-context review of the batch jobs' own ids.  One run of batch job 5.
    Partition 1, attempt 0 (A) claims ``-1.0`` and initialises its producer: the id is Empty under
    (pid, e).  The old stage attempt's task of partition 1, also attempt 0 (C: a stage retry's
    duplicate), describes its slots, finds ``-1.0`` Empty and pauses before its claim.  A writes
    and pre-commits; the batch is verified, decided, and its first transaction committed.  Then C
    goes on.  On the pool (``"pool"``, the streaming default) C's claim (InitProducerId expecting
    (pid, e)) lands while A's decided transaction is open: the broker aborts it, the second commit
    fails, DataLossError (docs/kafka.md, "What is left").  Own ids (a batch job's by default,
    ``"per-plan"``) are claimed only while the broker does not know them: C passes over ``-1.0``
    and claims another; the batch commits whole."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=2), f"rv-{uuid.uuid4().hex[:8]}"
    x = Driver(_sink(bs, topic, prefix, ids), str(tmp_path / "log"),
               batch_query_id("daily", _sink(bs, topic, prefix).target()), takeover=True)
    c_sink = _sink(bs, topic, prefix, ids)
    c_sink.open()
    described, resume = threading.Event(), threading.Event()
    c_out: dict[str, Any] = {}
    claim = c_sink._claim

    def paused_before_the_claim(ctx, client, tid, expect, tried, **kw):
        c_out.setdefault("slot", (tid, expect))
        described.set()
        assert resume.wait(120)
        return claim(ctx, client, tid, expect, tried, **kw)

    c_sink._claim = paused_before_the_claim  # type: ignore[method-assign]
    thread = None
    try:
        opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None and bool(opened.intent["pool"].get("ids")) == (ids != "pool")
        ctx_a = TransactionContext(opened.query_name, 5, 1, 0, opened.intent, opened.run)
        txn_a = x.sink.begin_transaction(ctx_a)            # claimed and initialised; nothing produced yet

        def c_task() -> None:
            try:
                ctx_c = TransactionContext(opened.query_name, 5, 1, 0, opened.intent, "stale-stage")
                c_out["handle"] = run_attempt(c_sink, ctx_c, _rows("dup-p1"))
            except BaseException as e:  # noqa: BLE001 - reported below
                c_out["error"] = e

        thread = threading.Thread(target=c_task, daemon=True)
        thread.start()
        assert described.wait(60), c_out
        if ids == "pool":  # C claims A's id from what it described: Empty, the epoch A's init left
            assert c_out["slot"][0] == txn_a.transactional_id, (c_out, txn_a.transactional_id)
        else:  # C passes over A's id (the broker knows it) and claims a new one
            assert c_out["slot"][0] != txn_a.transactional_id and c_out["slot"][1] is None, c_out
        x.sink.write(txn_a, _rows("b5-p1"))
        h1 = x.sink.pre_commit(txn_a)
        started = time.time()
        h0 = run_attempt(x.sink, TransactionContext(opened.query_name, 5, 0, 0, opened.intent, opened.run),
                         _rows("b5-p0"))
        results = [{"partition": p, "attempt": 0, "rows": 20, "handle": x.sink.encode_handle(h)}
                   for p, h in ((0, h0), (1, h1))]
        x.protocol.check_prepared(opened, results, started_at=started)
        commit = x.sink.commit

        def commit_then_c_claims(handle: dict) -> Any:
            res = commit(handle)
            if not resume.is_set():  # after the decision and the first commit: C's stale claim lands
                resume.set()
                thread.join(120)
            return res

        x.sink.commit = commit_then_c_claims  # type: ignore[method-assign]
        if ids == "pool":
            with pytest.raises(DataLossError):
                x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
            assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0")), "half of batch 5"
            return
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5-p0") + _values("b5-p1"))
        thread.join(60)
        assert "error" not in c_out and c_out["handle"]["transactional_id"] != txn_a.transactional_id, c_out
    finally:
        resume.set()
        if thread is not None:
            thread.join(60)
        c_sink.close()
        x.sink.close()
        x.close()


def test_a_batch_job_ballots_close_keeps_the_plan_fences_widest(kafka_service):
    """Found by the same review: a batch job's ballot (one partition) closed after its decision wrote
    its own width back to the plan fence, so the next pool plan of the prefix stopped looking at
    the ids of the wider partitions (a leftover there held readers back until its timeout)."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=4), f"rw-{uuid.uuid4().hex[:8]}"
    sink = _sink(bs, topic, prefix)
    try:
        wide = sink.plan_batch("q", 1, 4)
        assert wide["pool"]["widest"] == 4
        own = sink.plan_batch_job("q", 2, 1)
        h = _prepare(sink, own, 2, 0, 0, _values("b2"))
        assert sink.commit(h).outcome.name == "COMMITTED"
        sink.abort_lingering("q", 2, own, [h])  # decided: closes its plan at the fence
        narrow = sink.plan_batch("q", 3, 1)
        assert narrow["pool"]["widest"] == 4, narrow["pool"]
    finally:
        sink.close()



@pytest.mark.parametrize("ids", ["pool", "auto", "per-plan"])
def test_a_late_attempt_that_read_the_plan_fence_before_the_close_leaves_nothing_open_after_the_next_batch(
        kafka_service, tmp_path, ids):
    """Found by the second fresh-context review.  One partition.  A late attempt C of batch 5
    (attempt 1: a slot of its own) reads the plan fence while the ballot is open, then pauses before
    its claim.  Attempt 0 writes; batch 5 is decided, committed, and its cleanup closes the plan.  C
    resumes and claims.  Then batch 6 runs and commits on the same driver.  On the pool, batch 6's
    plan lists C's transaction as a closed ballot's leftover and aborts it.  On ids of their own
    (batch jobs by default, and streaming with ``"per-plan"``) no later plan looks at batch 5's ids:
    before, C wrote and left its transaction open, and read_committed readers did not see batch 6
    until the transaction timeout.  Now C reads the plan fence again after its claim, finds the
    ballot closed and writes nothing."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"f1-{uuid.uuid4().hex[:8]}"

    def sink() -> KafkaSink:
        return _sink(bs, topic, prefix, ids)

    # "per-plan": a streaming query's log (its query id is Spark's, not a batch job's)
    qid = str(uuid.uuid4()) if ids == "per-plan" else batch_query_id("daily", sink().target())
    x = Driver(sink(), str(tmp_path / "log"), qid, takeover=True)
    c_sink = sink()
    c_sink.open()
    described, resume = threading.Event(), threading.Event()
    c_out: dict[str, Any] = {}
    claim = c_sink._claim

    def paused_before_the_claim(ctx, client, tid, expect, tried, **kw):
        described.set()
        assert resume.wait(120)
        return claim(ctx, client, tid, expect, tried, **kw)

    c_sink._claim = paused_before_the_claim  # type: ignore[method-assign]
    thread = None
    try:
        opened = x.protocol.open_ballot(5, lambda p: 1, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None and bool(opened.intent["pool"].get("ids")) == (ids != "pool")

        def c_task() -> None:
            try:
                ctx_c = TransactionContext(opened.query_name, 5, 0, 1, opened.intent, "late")
                c_out["handle"] = run_attempt(c_sink, ctx_c, _rows("late-b5"))
            except BaseException as e:  # noqa: BLE001 - reported below
                c_out["error"] = e

        thread = threading.Thread(target=c_task, daemon=True)
        thread.start()
        assert described.wait(60), c_out
        started = time.time()
        h = run_attempt(x.sink, TransactionContext(opened.query_name, 5, 0, 0, opened.intent, opened.run),
                        _rows("b5"))
        results = [{"partition": 0, "attempt": 0, "rows": 20, "handle": x.sink.encode_handle(h)}]
        x.protocol.check_prepared(opened, results, started_at=started)
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        x.protocol.committed(5)
        resume.set()
        thread.join(120)
        if ids == "pool":
            assert "handle" in c_out, c_out  # C claimed after the cleanup, wrote and pre-committed
        else:
            assert "handle" not in c_out and "this task attempt is late" in str(c_out.get("error")), c_out
        x.batch(6, _rows("b6"))
        assert Counter(read_committed(bs, topic, timeout=15, idle=5)) == Counter(_values("b5") + _values("b6"))
        if "handle" in c_out:
            st = x.sink._txn_client().describe_transactions([c_out["handle"]["transactional_id"]])
            assert all(d.state != "Ongoing" for d in st.values()), st
    finally:
        resume.set()
        if thread is not None:
            thread.join(60)
        left = c_out.get("handle")
        if left:  # never leave the topic held for the timeout
            x.sink._abort_open(x.sink._txn_client(), left["transactional_id"], left["producer_id"],
                               left["producer_epoch"], "test cleanup", wait=False)
        c_sink.close()
        x.sink.close()
        x.close()


def test_a_batch_job_ballots_cleanup_aborts_a_failed_attempts_transaction_after_another_run_planned(kafka_service):
    """A decided batch-job ballot whose failed attempt (its task died after its pre-commit) left a
    transaction open on one of the ballot's own ids; another run plans before the ballot's cleanup,
    so the cleanup cannot close the plan and the fence no longer holds its epoch.  On the pool that
    transaction would be left to its timeout (it may be the other run's); on ids only this ballot
    names it is garbage: aborted, and readers see the batch at once."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"ol-{uuid.uuid4().hex[:8]}"
    sink, other = _sink(bs, topic, prefix), _sink(bs, topic, prefix)
    try:
        own = sink.plan_batch_job("q", 5, 1)
        dead = _prepare(sink, own, 5, 0, 1, _values("dead"))  # attempt 1: pre-committed, never reported
        h = _prepare(sink, own, 5, 0, 0, _values("b5"))
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        other.plan_batch_job("q", 6, 1)  # another run's plan: the fence moved on
        assert sink.abort_lingering("q", 5, own, [h]) == 1
        st = sink._txn_client().describe_transactions([dead["transactional_id"]])[dead["transactional_id"]]
        assert st.state in ("PrepareAbort", "CompleteAbort"), st
        assert Counter(read_committed(bs, topic)) == Counter(_values("b5"))
    finally:
        sink.close()
        other.close()


def test_a_late_attempts_init_between_the_cleanups_describe_and_its_bump_leaves_nothing_open(kafka_service, tmp_path):
    """Found by the third fresh-context review.  A late attempt C claimed an own id (Empty, epoch 0)
    and read the plan fence (still open) before the ballot's cleanup closed the plan; C's producer
    InitProducerId (librdkafka's, unconditional) lands between the cleanup's describe and its bump.
    Before: the bump from epoch 0 was refused (PRODUCER_FENCED), C wrote and pre-committed after the
    cleanup, on an id no later plan looks at: batch 6 unread until the transaction timeout.  Now the
    cleanup describes the id again and bumps it from where it is: C's producer is fenced."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"r3-{uuid.uuid4().hex[:8]}"
    x = Driver(_sink(bs, topic, prefix), str(tmp_path / "log"),
               batch_query_id("daily", _sink(bs, topic, prefix).target()), takeover=True)
    c_sink = _sink(bs, topic, prefix)
    c_sink.open()
    checked, go_init, inited, go_write = (threading.Event() for _ in range(4))
    c_out: dict[str, Any] = {}
    conf = c_sink._producer_config

    def paused_after_the_check(tid, box):  # after the claim and the post-claim fence check
        c_out["tid"] = tid
        checked.set()
        assert go_init.wait(120)
        return conf(tid, box)

    c_sink._producer_config = paused_after_the_check  # type: ignore[method-assign]
    write = c_sink.write

    def paused_before_produce(txn, batch):  # init_transactions done, nothing produced yet
        inited.set()
        assert go_write.wait(120)
        return write(txn, batch)

    c_sink.write = paused_before_produce  # type: ignore[method-assign]
    fence_own = x.sink._fence_own_ids
    seen: dict[str, Any] = {}

    def cleanup_bump_after_c_init(client, pool, tids, states, kept, closed, batch_id):
        seen["described"] = {t: (d.state, d.producer_id, d.producer_epoch) for t, d in states.items()
                             if t == c_out.get("tid")}
        seen["closed"] = closed
        go_init.set()               # C's producer InitProducerId lands now
        assert inited.wait(60)
        return fence_own(client, pool, tids, states, kept, closed, batch_id)

    x.sink._fence_own_ids = cleanup_bump_after_c_init  # type: ignore[method-assign]
    thread = None
    try:
        opened = x.protocol.open_ballot(5, lambda p: 1, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None and opened.intent["pool"].get("ids")

        def c_task() -> None:
            try:
                ctx = TransactionContext(opened.query_name, 5, 0, 1, opened.intent, "late")
                c_out["handle"] = run_attempt(c_sink, ctx, _rows("late-b5"))
            except BaseException as e:  # noqa: BLE001
                c_out["error"] = e

        thread = threading.Thread(target=c_task, daemon=True)
        thread.start()
        assert checked.wait(60), c_out
        started = time.time()
        h = run_attempt(x.sink, TransactionContext(opened.query_name, 5, 0, 0, opened.intent, opened.run),
                        _rows("b5"))
        results = [{"partition": 0, "attempt": 0, "rows": 20, "handle": x.sink.encode_handle(h)}]
        x.protocol.check_prepared(opened, results, started_at=started)
        x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        x.protocol.committed(5)
        go_write.set()
        thread.join(120)
        print("cleanup described C's id:", seen)
        print("C:", {k: (v if k != "error" else repr(v)) for k, v in c_out.items()})
        st = x.sink._txn_client().describe_transactions([c_out["tid"]])[c_out["tid"]]
        print("after cleanup and C:", st.state, st.producer_id, st.producer_epoch)
        x.batch(6, _rows("b6"))
        got = Counter(read_committed(bs, topic, timeout=15, idle=5))
        print("read_committed sees", sum(got.values()), "records; expected", 40)
        assert "handle" not in c_out, f"late attempt C pre-committed after the cleanup: {c_out.get('handle')}"
        assert st.state != "Ongoing", st
        assert got == Counter(_values("b5") + _values("b6"))
    finally:
        go_init.set()
        go_write.set()
        if thread is not None:
            thread.join(60)
        left = c_out.get("handle")
        if left:
            x.sink._abort_open(x.sink._txn_client(), left["transactional_id"], left["producer_id"],
                               left["producer_epoch"], "test cleanup", wait=False)
        c_sink.close()
        x.sink.close()
        x.close()


def test_a_late_attempt_claiming_beside_an_undecided_ballots_cleanup_leaves_nothing_open(kafka_service, tmp_path):
    """Found by the third fresh-context review.  An undecided ballot's cleanup (give_up) did not close
    the plan, and claimed the ids the broker did not know one by one after a single describe: a late
    attempt C that claimed one in between passed both its reads of the plan fence and wrote, on an
    id no later plan looks at (batch 6 unread until the transaction timeout).  Now an own-id
    ballot's cleanup closes the plan first: C finds the fence moved after its claim and writes nothing."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"r3u-{uuid.uuid4().hex[:8]}"
    x = Driver(_sink(bs, topic, prefix), str(tmp_path / "log"),
               batch_query_id("daily", _sink(bs, topic, prefix).target()), takeover=True)
    c_sink = _sink(bs, topic, prefix)
    c_sink.open()
    before_produce, go_write = threading.Event(), threading.Event()
    c_out: dict[str, Any] = {}
    write = c_sink.write

    def paused_before_produce(txn, batch):
        c_out["tid"] = txn.transactional_id
        before_produce.set()  # (never reached now: C stops at its read of the plan fence)
        assert go_write.wait(120)
        return write(txn, batch)

    c_sink.write = paused_before_produce  # type: ignore[method-assign]
    fence_own = x.sink._fence_own_ids
    seen: dict[str, Any] = {}
    thread = None
    try:
        opened = x.protocol.open_ballot(5, lambda p: 1, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None and opened.intent["pool"].get("ids")

        def c_task() -> None:
            try:
                ctx = TransactionContext(opened.query_name, 5, 0, 1, opened.intent, "late")
                c_out["handle"] = run_attempt(c_sink, ctx, _rows("late-b5"))
            except BaseException as e:  # noqa: BLE001
                c_out["error"] = e

        def cleanup_claims_after_c(client, pool, tids, states, kept, closed, batch_id):
            nonlocal thread
            seen["closed"] = closed
            seen["unknown_at_describe"] = sorted(t for t, d in states.items() if d.error_code != 0)
            thread = threading.Thread(target=c_task, daemon=True)  # C: describe, claim, check, init
            thread.start()
            deadline = time.time() + 60  # C runs to its end (before: to its first produce) between the describe and the claims
            while thread.is_alive() and not before_produce.is_set() and time.time() < deadline:
                time.sleep(0.05)
            return fence_own(client, pool, tids, states, kept, closed, batch_id)

        x.sink._fence_own_ids = cleanup_claims_after_c  # type: ignore[method-assign]
        # Attempt 0 failed; the ballot is given up (closed as aborted, then cleaned up with keep=[]).
        x.protocol.give_up(opened, RuntimeError("attempt 0 failed"))
        x.sink._fence_own_ids = fence_own  # type: ignore[method-assign]
        go_write.set()
        thread.join(120)
        print("cleanup:", seen)
        print("C:", {k: (v if k != "error" else repr(v)) for k, v in c_out.items()})
        assert seen["closed"] is not None  # the undecided own-id ballot's plan closed by its cleanup
        assert "this task attempt is late" in str(c_out.get("error")), c_out
        # The failed job is not re-run at once; the next run is batch 6 (a re-run of batch 5 would look
        # at the given-up ballot's ids again in _close_earlier_ballots, but only if C wrote before it).
        x.batch(6, _rows("b6"))
        got = Counter(read_committed(bs, topic, timeout=15, idle=5))
        print("read_committed sees", sum(got.values()), "records; expected", 20)
        assert "handle" not in c_out, f"late attempt C pre-committed after the cleanup: {c_out.get('handle')}"
        assert got == Counter(_values("b6"))
    finally:
        go_write.set()
        if thread is not None:
            thread.join(60)
        left = c_out.get("handle")
        if left:
            x.sink._abort_open(x.sink._txn_client(), left["transactional_id"], left["producer_id"],
                               left["producer_epoch"], "test cleanup", wait=False)
        c_sink.close()
        x.sink.close()
        x.close()
