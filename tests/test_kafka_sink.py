"""KafkaSink: configuration and classification (unit), and exactly-once behaviour on a real Kafka broker.

Broker tests use the session's Kafka 4.x (``kafka_service``) and count records with a
``read_committed`` consumer.  Processes that hold transactions are killed for real
(SIGKILL) before the driver-side commit.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from twophase.context import TransactionContext
from twophase.errors import ConfigurationError
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink
from twophase.sinks.kafka import protocol as kp

PY = sys.executable
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- unit
def test_config_refuses_settings_that_break_the_guarantee():
    for key in ("transactional.id", "enable.idempotence", "acks", "transaction.timeout.ms"):
        with pytest.raises(ConfigurationError, match=key.replace(".", r"\.")):
            KafkaSink("b:9092", "t", "p", producer_config={key: "x"})
    with pytest.raises(ConfigurationError, match="transactional_id_prefix"):
        KafkaSink("b:9092", "t", None)
    with pytest.raises(ConfigurationError, match="transactional_id_prefix"):
        KafkaSink("b:9092", "t", "bad prefix/with slash")


def test_config_round_trip_keeps_secret_references_and_refuses_literals(monkeypatch):
    sink = KafkaSink("b:9092", "out", "app", producer_config={
        "security.protocol": "SASL_SSL", "sasl.mechanism": "PLAIN", "sasl.username": "u",
        "sasl.password": {"env": "KPASS"}, "linger.ms": 20}, transaction_timeout_ms=60_000)
    cfg = sink.to_config()
    assert json.loads(json.dumps(cfg)) == cfg
    assert cfg["producer_config"]["sasl.password"] == {"env": "KPASS"}
    again = KafkaSink.from_config(cfg)
    assert again.to_config() == cfg
    monkeypatch.setenv("KPASS", "s3cret")
    assert again._resolved_config()["sasl.password"] == "s3cret"
    assert "s3cret" not in repr(again)
    literal = KafkaSink("b:9092", "out", "app", producer_config={"sasl.password": "s3cret"})
    with pytest.raises(ConfigurationError) as e:
        literal.to_config()
    assert "s3cret" not in str(e.value)
    # The sink pickles to executors without a driver connection.
    assert pickle.loads(pickle.dumps(again))._client is None


def test_kafka_python_config_translation():
    out = kp.kafka_python_config({"bootstrap.servers": "h:1", "security.protocol": "sasl_ssl",
                                  "sasl.mechanisms": "SCRAM-SHA-512", "sasl.username": "u",
                                  "sasl.password": "p", "ssl.ca.location": "/ca.pem", "linger.ms": 5})
    assert out == {"bootstrap_servers": "h:1", "security_protocol": "SASL_SSL",
                   "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "u",
                   "sasl_plain_password": "p", "ssl_cafile": "/ca.pem"}
    with pytest.raises(ValueError, match="sasl.oauthbearer.config"):
        kp.kafka_python_config({"sasl.oauthbearer.config": "secret-value"})


def test_slots_per_partition_is_bounded_and_kept_in_the_config():
    for bad in (0, 65):
        with pytest.raises(ConfigurationError, match="slots_per_partition"):
            KafkaSink("b:9092", "t", "app", slots_per_partition=bad)
    sink = KafkaSink("b:9092", "t", "app", slots_per_partition=2)
    assert KafkaSink.from_config(sink.to_config()).slots_per_partition == 2
    assert sink.transactional_id(3, 1) == "app-3.1" and sink.plan_fence_id() == "app-plans"
    # An empty batch plans no transaction and asks the broker nothing (there is none at b:9092).
    assert sink.plan_batch("q", 3, 0)["transactional_ids"] == []


def test_pending_age_warning():
    sink = KafkaSink("b:9092", "t", "app", transaction_timeout_ms=100_000)
    h = {"transactional_id": "app-0", "timeout_ms": 100_000, "started_at": time.time()}
    assert sink.pending_age_warning(h) is None
    assert sink.pending_age_warning(h, 49) is None
    assert "commit it soon" in sink.pending_age_warning(h, 60)
    assert "probably aborted" in sink.pending_age_warning(h, 101)
    assert "probably aborted" in sink.pending_age_warning(dict(h, started_at=time.time() - 200))
    assert sink.pending_age_warning({"transactional_id": "x"}) is None


class _FakeClient:
    closed = False

    def __init__(self, code):
        self.code = code

    def end_txn(self, *a, **k):
        return self.code


@pytest.mark.parametrize("code,outcome", [
    (0, CommitOutcome.COMMITTED), (51, CommitOutcome.RETRY_LATER), (16, CommitOutcome.RETRY_LATER),
    (15, CommitOutcome.RETRY_LATER), (7, CommitOutcome.RETRY_LATER), (90, CommitOutcome.LOST),
    (47, CommitOutcome.LOST), (48, CommitOutcome.LOST), (49, CommitOutcome.LOST),
    (53, CommitOutcome.RETRY_LATER)])
def test_commit_classification(code, outcome):
    # Real-broker twins: test_commit_after_sigkill_from_fresh_process (0, 51) and
    # test_expired_transaction_is_data_loss (90).
    sink = KafkaSink("b:9092", "t", "app")
    sink._client = _FakeClient(code)
    res = sink.commit({"transactional_id": "app-0", "producer_id": 1, "producer_epoch": 0})
    assert res.outcome is outcome
    if outcome is not CommitOutcome.COMMITTED:
        assert "app-0" in res.reason


# ------------------------------------------------------------------ broker helpers
def _topic(bootstrap: str, partitions: int = 2, name: str | None = None) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = name or f"ks-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    deadline = time.time() + 30
    while time.time() < deadline:  # wait for leaders, so the first produce does not stall
        md = admin.list_topics(name, timeout=10).topics[name]
        if md.error is None and all(p.leader >= 0 for p in md.partitions.values()):
            break
        time.sleep(0.2)
    return name


def read_committed(bootstrap: str, topic: str, timeout: float = 10.0, idle: float = 2.0) -> list[bytes]:
    """Every value a read_committed consumer sees in ``topic`` (until ``idle`` s without records)."""
    from tests.services.kafka import read_committed as read

    return read(bootstrap, topic, timeout, idle)


def _ctx(sink, batch=0, partition=0, attempt=0, n=1):
    return TransactionContext("q", batch, partition, attempt, sink.plan_batch("q", batch, n))


_CHILD = textwrap.dedent("""
    import json, os, signal, sys
    import pyarrow as pa
    from twophase.context import TransactionContext
    from twophase.sinks.kafka import KafkaSink
    bootstrap, topic, prefix, n, precommit = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    sink = KafkaSink(bootstrap, topic, prefix, transaction_timeout_ms=int(sys.argv[6]))
    ctx = TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1))
    print(json.dumps({"intent": ctx.intent}), flush=True)
    txn = sink.begin_transaction(ctx)
    sink.write(txn, pa.RecordBatch.from_pydict({"value": [f"{prefix}-{i}".encode() for i in range(n)]}))
    if precommit == "1":
        print(json.dumps(sink.pre_commit(txn)), flush=True)
    else:
        txn.producer.flush(30)
        print("{}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def _child_transaction(bootstrap, topic, prefix, n=100, precommit=True, timeout_ms=60_000,
                       with_intent=False):
    """Open (and pre-commit) a transaction in a separate process, which is then SIGKILLed: its handle
    (``{}`` when not pre-committed), and with ``with_intent`` the INTENT its ballot planned."""
    p = subprocess.run([PY, "-c", _CHILD, bootstrap, topic, prefix, str(n), "1" if precommit else "0",
                        str(timeout_ms)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    lines = p.stdout.strip().splitlines()
    handle = json.loads(lines[-1])
    return (handle, json.loads(lines[0])["intent"]) if with_intent else handle


# ----------------------------------------------------------------------- broker
@pytest.mark.kafka
def test_commit_after_sigkill_from_fresh_process(kafka_service):
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"kill-{uuid.uuid4().hex[:8]}"
    handle = _child_transaction(bs, topic, prefix, n=100)
    assert set(handle) >= {"transactional_id", "producer_id", "producer_epoch", "topics"}
    assert handle["topics"] == [topic]
    assert handle["transactional_id"] == f"{prefix}-0.0" and handle["rows"] == 100
    assert handle["txn_start_offsets"] and set(handle["txn_start_offsets"]) <= {f"{topic}:0", f"{topic}:1"}
    assert read_committed(bs, topic, idle=1.0) == []          # pre-committed: invisible
    sink = KafkaSink(bs, topic, prefix)                        # a fresh driver, from the handle only
    sink.open()
    assert sink.commit(handle).outcome is CommitOutcome.COMMITTED
    values = read_committed(bs, topic)
    assert sorted(values) == sorted(f"{prefix}-{i}".encode() for i in range(100))
    # Commit again (a replay after a crash): success, and nothing doubles.
    for _ in range(20):
        res = sink.recover_and_commit(handle)
        if res.outcome is not CommitOutcome.RETRY_LATER:  # 51 while markers are still written
            break
        time.sleep(0.2)
    assert res.done, res
    assert Counter(read_committed(bs, topic)) == Counter(values)
    # A kept handle is never fenced.
    assert sink.abort_lingering("q", 0, sink.plan_batch("q", 0, 1), [handle]) == 0
    sink.close()


@pytest.mark.kafka
def test_abort_lingering_unblocks_read_committed_consumers(kafka_service):
    from confluent_kafka import Producer

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"lso-{uuid.uuid4().hex[:8]}"
    _, intent = _child_transaction(bs, topic, prefix, n=50, precommit=False, with_intent=True)  # a crashed attempt's
    p = Producer({"bootstrap.servers": bs, "transactional.id": f"other-{uuid.uuid4().hex[:6]}"})
    p.init_transactions(30)
    p.begin_transaction()
    p.produce(topic, b"after-the-leftover")
    p.commit_transaction(30)
    # The open leftover holds the LSO: the committed record behind it is not readable.
    assert read_committed(bs, topic, timeout=4, idle=3) == []
    sink = KafkaSink(bs, topic, prefix)
    # The cleanup of the crashed ballot (closed; its INTENT names the id, and no plan came since)
    # aborts it.  A new plan of another sink object would hold it instead: nothing would say whose
    # it is (issue 59, tests/test_backfill_kafka.py).
    t0 = time.time()
    assert sink.abort_lingering("q", 0, intent, []) == 1
    assert read_committed(bs, topic, timeout=10, idle=1.5) == [b"after-the-leftover"]
    assert time.time() - t0 < 10
    assert sink.abort_lingering("q", 0, intent, []) == 0   # idempotent
    sink.close()


@pytest.mark.kafka
def test_a_full_local_queue_delays_rows_and_loses_none(kafka_service):
    """librdkafka's queue holds 50 records here: produce() raises BufferError many times per chunk;
    the sink serves the producer and retries, and every row lands once, in order per key."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"full-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, producer_config={"queue.buffering.max.messages": 50})
    txn = sink.begin_transaction(_ctx(sink))
    values = [f"v{i:05d}".encode() for i in range(3000)]
    sink.write(txn, pa.RecordBatch.from_pydict({"key": [b"k"] * 3000, "value": values}))
    handle = sink.pre_commit(txn)
    assert handle["rows"] == 3000 and handle["topics"] == [topic]
    assert sink.commit(handle).done
    assert read_committed(bs, topic) == values  # one key, one partition: in order
    sink.close()


@pytest.mark.kafka
@pytest.mark.alone("which slots get used depends on the broker ending each abort before the next batch's "
                   "claims: under another worker's load a batch took slot 2 while an id's last transaction was still closing")
def test_plan_batch_is_a_bounded_pool(kafka_service):
    """Every ballot of every batch names the same ids: partitions x slots, plus the plan fence, whose
    epoch each plan moves on by one."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"pool-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, slots_per_partition=3)
    a, b = sink.plan_batch("q", 1, 2), sink.plan_batch("q", 2, 2)
    pool = [f"{prefix}-{p}.{s}" for p in range(2) for s in range(3)]
    assert a["transactional_ids"] == pool == b["transactional_ids"]
    (pid, epoch), (pid_b, epoch_b) = a["pool"]["fence_producer"], b["pool"]["fence_producer"]
    assert (pid_b, epoch_b) == (pid, epoch + 1) and a["pool"]["fence"] == f"{prefix}-plans"
    # Many task attempts, ballots and batches later, the broker knows no other id of this prefix.
    for batch in range(3, 6):
        intent = sink.plan_batch("q", batch, 2)
        handles = []
        for p in range(2):
            for attempt in range(2):  # a failed attempt, then its retry
                txn = sink.begin_transaction(TransactionContext("q", batch, p, attempt, intent))
                sink.write(txn, pa.RecordBatch.from_pydict({"value": [f"{batch}-{p}-{attempt}".encode()]}))
                handles.append(sink.pre_commit(txn))
        for h in handles[1::2]:
            assert sink.commit(h).done
        sink.abort_lingering("q", batch, intent, handles[1::2])
    known = sink._txn_client().describe_transactions(pool + [f"{prefix}-plans", f"{prefix}-0.3", f"{prefix}-2.0"])
    assert sorted(t for t, d in known.items() if d.error_code == 0) == sorted(pool[:2] + pool[3:5] + [f"{prefix}-plans"])
    assert Counter(read_committed(bs, topic)) == Counter(f"{b}-{p}-1".encode() for b in range(3, 6) for p in range(2))
    sink.close()


@pytest.mark.kafka
def test_a_retry_attempt_claims_the_next_id_and_the_failed_ones_leftover_is_aborted(kafka_service):
    """Two attempts of one partition of one ballot: the retry does not initialise (fence) the id of
    the first, which may still be alive; it claims the next id.  The batch's cleanup after the
    commit aborts what the failed attempt left open, and read_committed readers see the retry's rows."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"att-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix)
    intent = sink.plan_batch("q", 0, 1)
    first = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
    sink.write(first, pa.RecordBatch.from_pydict({"value": [b"first"] * 10}))
    first.producer.flush(30)                       # its records are written; then the attempt is lost
    second = sink.begin_transaction(TransactionContext("q", 0, 0, 1, intent))
    assert (first.transactional_id, second.transactional_id) == (f"{prefix}-0.0", f"{prefix}-0.1")
    sink.write(second, pa.RecordBatch.from_pydict({"value": [b"second"] * 10}))
    handle = sink.pre_commit(second)
    assert sink.commit(handle).done
    assert sink.abort_lingering("q", 0, intent, [handle]) == 1   # the first attempt's transaction
    assert Counter(read_committed(bs, topic)) == Counter({b"second": 10})
    sink._release(first)
    sink.close()


@pytest.mark.kafka
def test_a_partition_whose_ids_all_hold_leftovers_aborts_them_and_claims_one(kafka_service):
    """Every id of a partition holds a transaction left open before the next plan (failed attempts
    whose batch was never cleaned up, e.g. its driver died).  The next batch's task aborts them (the
    INTENT lists them as leftovers) and, no id being free otherwise, claims one once its abort is
    complete.  (Found by the conformance harness' ownership machine: the task gave up.)"""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"full-ids-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, slots_per_partition=2)
    intent0 = sink.plan_batch("q", 0, 1)
    for attempt in range(2):
        txn = sink.begin_transaction(TransactionContext("q", 0, 0, attempt, intent0))
        sink.write(txn, pa.RecordBatch.from_pydict({"value": [b"leftover"] * 5}))
        txn.producer.flush(30)
        sink._release(txn)                                      # the attempt dies: its transaction stays
    intent1 = sink.plan_batch("q", 1, 1)                        # the next ballot, no cleanup before it
    assert sorted(intent1["pool"]["open"]) == [f"{prefix}-0.0", f"{prefix}-0.1"]
    txn = sink.begin_transaction(TransactionContext("q", 1, 0, 0, intent1))
    sink.write(txn, pa.RecordBatch.from_pydict({"value": [b"batch-1"] * 5}))
    handle = sink.pre_commit(txn)
    assert handle["transactional_id"] in (f"{prefix}-0.0", f"{prefix}-0.1")
    assert sink.commit(handle).done
    assert Counter(read_committed(bs, topic)) == Counter({b"batch-1": 5})
    sink.close()


@pytest.mark.kafka
def test_an_aborted_transaction_on_a_compacted_topic_is_lost_without_claiming_it_was_never_visible(
        kafka_service):
    """The first-offset check of a commit whose id moved on: on a compacted topic a record that
    read_committed readers skip may have been committed and compacted away, so the loss is
    reported without the claim that the rows were never visible."""
    from confluent_kafka.admin import AdminClient, NewTopic

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = f"ks-compact-{uuid.uuid4().hex[:8]}", f"cmp-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": bs})
    admin.create_topics([NewTopic(topic, 1, 1, config={"cleanup.policy": "compact"})])[topic].result(30)
    deadline = time.time() + 30
    while admin.list_topics(topic, timeout=10).topics[topic].partitions.get(0) is None or \
            admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader < 0:
        assert time.time() < deadline, "the compacted topic has no leader"
        time.sleep(0.2)
    sink = KafkaSink(bs, topic, prefix)
    txn = sink.begin_transaction(_ctx(sink))
    sink.write(txn, pa.RecordBatch.from_pydict({"key": [b"k1", b"k2"], "value": [b"v1", b"v2"]}))
    handle = sink.pre_commit(txn)
    client = sink._txn_client()
    deadline = time.time() + 30
    while client.init_producer_id(handle["transactional_id"], 60_000)[0] != kp.NONE:  # aborts it
        assert time.time() < deadline
        time.sleep(0.1)
    deadline = time.time() + 30
    while (res := sink.commit(handle)).outcome is CommitOutcome.RETRY_LATER:  # markers being written
        assert time.time() < deadline, res
        time.sleep(0.2)
    assert res.outcome is CommitOutcome.LOST, res
    assert "is compacted (cleanup.policy=compact)" in res.reason and "never saw it" not in res.reason
    assert not res.never_visible  # so the batch is data loss, never run again (issue 48)
    sink.close()


@pytest.mark.kafka
def test_a_transactions_fate_is_read_from_its_marker_while_another_open_transaction_holds_the_lso(kafka_service):
    """Issue 48: a commit that finds its id moved on reads its first record's fate; read_committed
    cannot while an older open transaction holds the partition's last stable offset back (it said
    "pending" until that one ended: 15 minutes for a decided batch's other transaction).  The
    transaction's own marker, read uncommitted, tells: an abort is never visible, a commit is
    ALREADY_COMMITTED."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, 1), f"mk-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix)

    def pre_committed(p):
        txn = sink.begin_transaction(_ctx(sink, partition=p, n=3))
        sink.write(txn, pa.RecordBatch.from_pydict({"value": [b"p%d" % p]}))
        return sink.pre_commit(txn)

    holder, aborted, committed = pre_committed(0), pre_committed(1), pre_committed(2)  # holder's first
    client = sink._txn_client()
    (tp, first), = holder["txn_start_offsets"].items()
    assert client.transaction_marker(tp, first, holder["producer_id"]) is None  # still open
    assert sink.commit(committed).outcome is CommitOutcome.COMMITTED
    for h in (aborted, committed):  # a zombie's claim: the id moves on (aborting `aborted`)
        deadline = time.time() + 30
        while client.init_producer_id(h["transactional_id"], 60_000)[0] != kp.NONE:
            assert time.time() < deadline
            time.sleep(0.1)
    res = sink.commit(aborted)
    assert res.outcome is CommitOutcome.LOST and res.never_visible, res
    assert "abort marker" in res.reason, res.reason
    res = sink.commit(committed)
    assert res.outcome is CommitOutcome.ALREADY_COMMITTED and "commit marker" in res.reason, res
    assert sink.commit(holder).outcome is CommitOutcome.COMMITTED
    assert Counter(read_committed(bs, topic)) == Counter({b"p0": 1, b"p2": 1})
    sink.close()


@pytest.mark.kafka
def test_an_aborted_transaction_whose_first_record_was_deleted_is_lost_without_claiming_it_was_never_visible(
        kafka_service):
    """Issue 48: "never visible" needs the transaction's first record still in the partition.  Once
    retention (here DeleteRecords) removed it, its fate cannot be read: the loss is reported with
    the reason, and the batch is not run again."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, 1), f"del-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix)
    txn = sink.begin_transaction(_ctx(sink))
    sink.write(txn, pa.RecordBatch.from_pydict({"value": [b"v1", b"v2"]}))
    handle = sink.pre_commit(txn)
    (tp, first), = handle["txn_start_offsets"].items()
    client = sink._txn_client()
    deadline = time.time() + 30
    while client.init_producer_id(handle["transactional_id"], 60_000)[0] != kp.NONE:  # aborts it
        assert time.time() < deadline
        time.sleep(0.1)
    admin = AdminClient({"bootstrap.servers": bs})
    name, _, part = tp.rpartition(":")
    deadline = time.time() + 30
    while True:  # the abort's marker makes offset first + 1 deletable up to
        try:
            admin.delete_records([TopicPartition(name, int(part), first + 1)])[
                TopicPartition(name, int(part), first + 1)].result(30)
            break
        except Exception:
            assert time.time() < deadline
            time.sleep(0.5)
    deadline = time.time() + 30
    while (res := sink.commit(handle)).outcome is CommitOutcome.RETRY_LATER:
        assert time.time() < deadline, res
        time.sleep(0.2)
    assert res.outcome is CommitOutcome.LOST and not res.never_visible, res
    assert f"offset {first}) was deleted (the partition now starts at" in res.reason, res.reason
    sink.close()


@pytest.mark.kafka
def test_open_validates_timeout_topic_and_reachability(kafka_service):
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs)
    with pytest.raises(ConfigurationError, match="transaction.max.timeout.ms=900000"):
        KafkaSink(bs, topic, "v", transaction_timeout_ms=900_001).open()
    missing = f"missing-{uuid.uuid4().hex[:8]}"
    with pytest.raises(ConfigurationError, match=f"topic '{missing}' does not exist"):
        KafkaSink(bs, missing, "v").open()
    t0 = time.time()
    with pytest.raises(ConfigurationError, match="cannot reach Kafka at 127.0.0.1:1"):
        KafkaSink("127.0.0.1:1", topic, "v", request_timeout_s=3).open()
    assert time.time() - t0 < 30
    KafkaSink(bs, topic, "v", transaction_timeout_ms=900_000).open()


# ----------------------------------------------------------- through the coordinator
def _prepared_in_log(log_dir: Path) -> list[str]:
    """The commit decisions in a log (a failed ballot's slot holds an abort, which is none)."""
    from twophase.log import TransactionLog

    if not (log_dir / "log.json").exists():
        return []
    tlog = TransactionLog(str(log_dir), readonly=True)
    return sorted(view.decision.location for g in tlog.generations()
                  for view in tlog.views(int(g["generation"])).values() if view.decision is not None)


@pytest.mark.kafka
@pytest.mark.spark
def test_bad_input_fails_before_the_decision_and_replay_is_exactly_once(kafka_service, spark, tmp_path):
    from twophase.coordinator import Coordinator

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs)
    log_dir = tmp_path / "log"
    sink = KafkaSink(bs, topic, f"bad-{uuid.uuid4().hex[:8]}", request_timeout_s=10)
    coord = Coordinator(sink, log_location=str(log_dir), name="bad-input", commit_retries=2)
    good = [(f"id-{i}",) for i in range(200)]

    # 1. A null value.
    df = spark.createDataFrame(good + [(None,)], "value string").repartition(2)
    with pytest.raises(Exception, match="column 'value' is null"):
        coord.write(df, batch_id=0)
    # 2. A record above message.max.bytes (1 MB by default).
    df = spark.createDataFrame(good + [("x" * 2_000_000,)], "value string").repartition(2)
    with pytest.raises(Exception, match="(?i)too large|message size"):
        coord.write(df, batch_id=0)
    # 3. An unknown topic in the topic column, auto-create off.
    tsink = KafkaSink(bs, None, f"badt-{uuid.uuid4().hex[:8]}")
    tcoord = Coordinator(tsink, log_location=str(tmp_path / "log2"), name="bad-topic")
    df = spark.createDataFrame([(v, f"missing-{uuid.uuid4().hex[:6]}") for (v,) in good[:5]],
                               "value string, topic string")
    with pytest.raises(Exception, match="does not exist"):
        tcoord.write(df, batch_id=0)
    assert _prepared_in_log(log_dir) == [] and _prepared_in_log(tmp_path / "log2") == []
    assert read_committed(bs, topic, idle=1.0) == []

    # The fixed input, replayed under the same batch id: exactly once.
    df = spark.createDataFrame(good, "value string").repartition(2)
    progress = coord.write(df, batch_id=0)
    assert progress["rows"] == 200
    assert coord.write(df, batch_id=0)["action"] == "skipped"
    assert Counter(read_committed(bs, topic)) == Counter(v.encode() for (v,) in good)


@pytest.mark.kafka
@pytest.mark.spark
def test_spark_rows_shaped_like_the_kafka_sink(kafka_service, spark, tmp_path):
    """key, value, topic, partition and headers columns, as for df.write.format("kafka")."""
    from confluent_kafka import Consumer, TopicPartition

    from twophase.coordinator import Coordinator

    bs = kafka_service["bootstrap_servers"]
    t1, t2 = _topic(bs, 3), _topic(bs, 1)
    rows = [(f"k{i}", f"v{i}", t1 if i % 2 else t2, (i % 3) if i % 2 else None) for i in range(60)]
    df = spark.createDataFrame(rows, "key string, value string, topic string, partition int")
    df = df.selectExpr("key", "cast(value as binary) as value", "topic", "partition",
                       "array(named_struct('key', 'src', 'value', cast(key as binary))) as headers")
    Coordinator(KafkaSink(bs, None, f"shape-{uuid.uuid4().hex[:8]}"),
                log_location=str(tmp_path / "log"), name="shape").write(df, batch_id=0)
    c = Consumer({"bootstrap.servers": bs, "group.id": uuid.uuid4().hex, "isolation.level": "read_committed"})
    c.assign([TopicPartition(t1, p, 0) for p in range(3)] + [TopicPartition(t2, 0, 0)])
    got, deadline = [], time.time() + 15
    while len(got) < 60 and time.time() < deadline:
        got += [m for m in c.consume(100, 0.5) if m.error() is None]
    c.close()
    assert len(got) == 60
    for m in got:
        i = int(m.value()[1:])
        assert m.key() == f"k{i}".encode() and m.headers() == [("src", f"k{i}".encode())]
        assert m.topic() == (t1 if i % 2 else t2)
        if i % 2:
            assert m.partition() == i % 3


@pytest.mark.kafka
@pytest.mark.spark
def test_a_decided_batch_the_broker_timed_out_runs_again(kafka_service, spark, tmp_path):
    """Issue 48: a batch decided, the driver dead until the broker's transaction timeout aborted
    every transaction of it.  Before, every restart stopped with ``DataLossError ... PRODUCER_FENCED
    ... it outlived transaction.timeout.ms`` and the batch could only be dropped.  Nothing of it was
    ever visible (its first records are still in the topic, which is not compacted, and read as
    aborted): the decision is void and the batch runs again, every row once."""
    from twophase.coordinator import Coordinator

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs)
    prefix = f"exp-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path / "log"
    rows = [f"e{i}" for i in range(20)]
    script = textwrap.dedent(f"""
        from twophase.coordinator import Coordinator
        from twophase.sinks.kafka import KafkaSink
        from twophase.spark import local_session
        spark = local_session("local[1]", "expire")
        df = spark.createDataFrame([(v,) for v in {rows!r}], "value string").coalesce(1)
        # No commit margin: the batch is decided with a transaction that then times out.
        Coordinator(KafkaSink({bs!r}, {topic!r}, {prefix!r}, transaction_timeout_ms=5000,
                              commit_margin_ms=0),
                    log_location={str(log_dir)!r}, name="expire").write(df, batch_id=0)
    """)
    env = dict(os.environ, TWOPHASE_CRASH_AT="after_prepared_logged")
    p = subprocess.run([PY, "-c", script], env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert p.returncode == 137, p.stderr[-3000:]
    assert len(_prepared_in_log(log_dir)) == 1
    # Wait until the broker has aborted the timed-out transaction.
    client = kp.TxnClient({"bootstrap_servers": bs})
    deadline = time.time() + 60
    tid = _decided_ids(log_dir, KafkaSink(bs, topic, prefix))[0]  # a batch job's ballot: ids of its own, {prefix}-{pid}.{epoch}-0.{slot}
    assert tid.startswith(f"{prefix}-") and tid.endswith("-0.0"), tid
    while client.describe_transactions([tid])[tid].state != "CompleteAbort":
        assert time.time() < deadline, "the broker did not abort the transaction"
        time.sleep(0.5)
    client.close()
    assert read_committed(bs, topic, idle=1.0) == []
    df = spark.createDataFrame([(v,) for v in rows], "value string").coalesce(1)
    sink = KafkaSink(bs, topic, prefix, transaction_timeout_ms=5000, commit_margin_ms=0)
    Coordinator(sink, log_location=str(log_dir), name="expire", takeover=True).write(df, batch_id=0)
    assert Counter(v.decode() for v in read_committed(bs, topic, idle=2.0)) == Counter(rows)
    assert any(f.name.startswith("batch-000000000000.void") for f in log_dir.rglob("*.json")), \
        sorted(f.name for f in log_dir.rglob("*.json"))  # the first decision, recorded void


def _decided_ids(log_dir: Path, sink: KafkaSink) -> list[str]:
    """The transactional ids the commit decisions of a log name."""
    from twophase.log import TransactionLog

    tlog = TransactionLog(str(log_dir), readonly=True)
    return sorted(sink.decode_handle(h)["transactional_id"]
                  for g in tlog.generations() for view in tlog.views(int(g["generation"])).values()
                  if view.decision is not None for h in view.decision.handles)


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_task_retries_do_not_duplicate(kafka_service, tmp_path, mode):
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs)
    p = subprocess.run([PY, "-m", "tests.drivers.kafka_retry", bs, topic, f"retry-{uuid.uuid4().hex[:8]}",
                        str(tmp_path / "log"), mode], capture_output=True, text=True, timeout=400, cwd=REPO)
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["ok"], out
    values = read_committed(bs, topic, timeout=30)
    counts = Counter(values)
    assert len(counts) == 4000 and set(counts.values()) == {1}, \
        f"{len(counts)} distinct, {sum(c - 1 for c in counts.values())} duplicates"
