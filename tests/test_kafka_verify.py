"""KafkaSink.verify_prepared on the real broker: a batch is not decided when one of its transactions
is already aborted by the broker's timeout, or has less than ``commit_margin_ms`` of it left.

The broker's ``transaction.timeout.ms`` runs from each transaction's first record, so with
several waves of tasks the first wave ages while the last one runs (issue 14).  The test
broker looks for timed-out transactions every 10 s
(``transaction.abort.timed.out.transaction.cleanup.interval.ms``, Kafka's default), so a
2 s timeout is acted on within about 12 s.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _ctx, _prepared_in_log, _topic, read_committed
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink
from twophase.sinks.kafka import protocol as kp


def _rows(prefix: str, n: int) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"value": [f"{prefix}-{i}".encode() for i in range(n)]})


def _state(sink: KafkaSink, tid: str) -> kp.TxnDescription:
    return sink._txn_client().describe_transactions([tid])[tid]


# ---------------------------------------------------------------------------- unit
def test_commit_margin_defaults_and_bounds():
    assert KafkaSink("b:9092", "t", "p").commit_margin_ms == 100_000          # 5 min timeout
    assert KafkaSink("b:9092", "t", "p", transaction_timeout_ms=900_000).commit_margin_ms == 300_000
    assert KafkaSink("b:9092", "t", "p", transaction_timeout_ms=60_000).commit_margin_ms == 20_000
    assert KafkaSink("b:9092", "t", "p", commit_margin_ms=0).commit_margin_ms == 0
    for bad in (-1, 60_000, 90_000):
        with pytest.raises(ConfigurationError, match="commit_margin_ms"):
            KafkaSink("b:9092", "t", "p", transaction_timeout_ms=60_000, commit_margin_ms=bad)
    sink = KafkaSink("b:9092", "t", "p", transaction_timeout_ms=60_000, commit_margin_ms=5_000)
    assert KafkaSink.from_config(sink.to_config()).commit_margin_ms == 5_000


# ----------------------------------------------------------------------- broker
@pytest.mark.kafka
def test_verify_prepared_refuses_a_transaction_the_broker_already_aborted(kafka_service):
    """Wave 1 of a long batch: its transaction outlived the timeout before the decision."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"vexp-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, transaction_timeout_ms=2000, commit_margin_ms=0)
    started = time.time()
    txn = sink.begin_transaction(_ctx(sink))
    sink.write(txn, _rows(prefix, 20))
    handle = sink.pre_commit(txn)
    deadline = time.time() + 40
    while _state(sink, handle["transactional_id"]).state == "Ongoing":
        assert time.time() < deadline, "the broker did not abort the timed-out transaction"
        time.sleep(0.5)
    with pytest.raises(TwoPhaseError) as e:
        sink.verify_prepared(7, [handle], prepare_started_at=started)
    msg = str(e.value)
    assert "batch 7: not deciding the batch" in msg
    assert f"{prefix}-0" in msg and "already aborted" in msg
    assert "transaction_timeout_ms=2000" in msg and "tasks have run for" in msg
    assert "transaction.max.timeout.ms" in msg and "fewer waves of tasks" in msg
    # Deciding it would have been data loss: EndTxn cannot commit it any more.
    assert sink.commit(handle).outcome is CommitOutcome.LOST
    assert read_committed(bs, topic, idle=1.0) == []
    sink.close()


@pytest.mark.kafka
@pytest.mark.alone("wall-clock: asserts the transaction is 2-3 s old after a 2.5 s sleep")
def test_verify_prepared_refuses_a_young_transaction_without_the_commit_margin(kafka_service):
    """Still open, but less than commit_margin_ms left: refused while it can still be aborted."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"vmar-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, transaction_timeout_ms=10_000, commit_margin_ms=8_000)
    started = time.time()
    txn = sink.begin_transaction(_ctx(sink))
    sink.write(txn, _rows(prefix, 20))
    handle = sink.pre_commit(txn)
    time.sleep(2.5)  # 2.5 s old: 7.5 s of its 10 s left, less than the 8 s margin
    assert _state(sink, handle["transactional_id"]).state == "Ongoing"
    with pytest.raises(TwoPhaseError) as e:
        sink.verify_prepared(3, [handle], prepare_started_at=started)
    msg = str(e.value)
    assert "Less than commit_margin_ms=8000" in msg and f"{prefix}-0" in msg
    assert "transaction_timeout_ms=10000" in msg
    assert f"oldest transaction ({prefix}-0.0) is 2s old" in msg or \
        f"oldest transaction ({prefix}-0.0) is 3s old" in msg, msg
    # The coordinator then aborts it: nothing becomes visible.
    assert sink.abort_lingering("q", 3, sink.plan_batch("q", 3, 1), []) == 1
    assert read_committed(bs, topic, idle=1.0) == []
    sink.close()


@pytest.mark.kafka
def test_verify_prepared_passes_healthy_transactions_which_then_commit_once(kafka_service):
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"vok-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix, transaction_timeout_ms=60_000)
    started = time.time()
    handles = []
    for p in range(3):
        txn = sink.begin_transaction(_ctx(sink, partition=p, n=3))
        sink.write(txn, _rows(f"{prefix}-p{p}", 10))
        handles.append(sink.pre_commit(txn))
    sink.verify_prepared(0, handles, prepare_started_at=started)
    assert all(sink.commit(h).outcome is CommitOutcome.COMMITTED for h in handles)
    counts = Counter(read_committed(bs, topic))
    assert len(counts) == 30 and set(counts.values()) == {1}
    sink.close()


# ----------------------------------------------------------- through the coordinator
@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.alone("wall-clock: a 6 s transaction timeout against a task slowed 4 s on two cores")
def test_batch_outliving_the_timeout_fails_undecided_and_replays_once(kafka_service, spark, tmp_path):
    """Three partitions on two cores: partition 0 pre-commits at once, partition 1 is slow, so
    partition 0's transaction has too little of its timeout left when the tasks are done.  The
    batch fails before its decision; a replay with a longer timeout commits it exactly once."""
    from twophase.coordinator import Coordinator

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"vco-{uuid.uuid4().hex[:8]}"
    log_dir = tmp_path / "log"

    def slow_partition_one(batches):
        from pyspark import TaskContext

        if TaskContext.get().partitionId() == 1:
            time.sleep(4)
        yield from batches

    values = [f"{prefix}-{i}" for i in range(300)]
    df = (spark.createDataFrame([(v,) for v in values], "value string").repartition(3)
          .mapInArrow(slow_partition_one, "value string"))
    short = KafkaSink(bs, topic, prefix, transaction_timeout_ms=6_000, commit_margin_ms=3_000)
    with pytest.raises(TwoPhaseError, match=r"batch 0: not deciding the batch.*commit_margin_ms=3000"):
        Coordinator(short, log_location=str(log_dir), name="verify").write(df, batch_id=0)
    assert _prepared(log_dir) == []
    assert read_committed(bs, topic, idle=1.0) == []      # leftovers aborted, nothing visible
    longer = KafkaSink(bs, topic, prefix, transaction_timeout_ms=60_000)
    progress = Coordinator(longer, log_location=str(log_dir), name="verify", takeover=True).write(
        df, batch_id=0)
    assert progress["rows"] == 300 and len(_prepared(log_dir)) == 1
    assert Counter(read_committed(bs, topic)) == Counter(v.encode() for v in values)
    short.close()
    longer.close()


def _prepared(log_dir: Path) -> list[str]:
    return _prepared_in_log(log_dir)
