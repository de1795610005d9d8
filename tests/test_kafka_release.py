"""KafkaSink releases each pre-committed producer at once, on the real broker (issue 14).

A Spark Python worker runs partition after partition, batch after batch.  A producer whose
transaction is pre-committed must not be kept alive until its transactional id comes back
to the same worker: its librdkafka threads, sockets and statistics would pile up
(partitions x workers).  Destroying a confluent-kafka ``Producer`` (dropping its last
reference: ``rd_kafka_destroy``) leaves its flushed transaction open on the broker, where
the driver commits it with EndTxn; ``Producer.close()`` would abort it.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _topic, read_committed
from twophase.context import TransactionContext
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink

BATCHES = 30


def _resources() -> tuple[int, int, int]:
    """(Python threads, OS threads, open file descriptors) of this process."""
    return (threading.active_count(), len(os.listdir("/proc/self/task")),
            len(os.listdir("/proc/self/fd")))


@pytest.mark.kafka
def test_precommitted_producers_are_released_and_their_transactions_commit_once(kafka_service):
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, 2), f"rel-{uuid.uuid4().hex[:8]}"
    executor = KafkaSink(bs, topic, prefix, transaction_timeout_ms=60_000)
    driver = KafkaSink(bs, topic, prefix, transaction_timeout_ms=60_000)
    client = driver._txn_client()
    expected: Counter[bytes] = Counter()
    baseline = None
    for b in range(BATCHES):
        # A different partition every batch: the worker meets a new transactional id each time,
        # as Spark hands any partition to any worker.
        ctx = TransactionContext("q", b, b, 0, executor.plan_batch("q", b, BATCHES))
        txn = executor.begin_transaction(ctx)
        values = [f"{prefix}-b{b}-{i}".encode() for i in range(20)]
        executor.write(txn, pa.RecordBatch.from_pydict({"value": values}))
        handle = executor.pre_commit(txn)
        expected.update(values)
        assert txn.producer is None                      # released, not parked
        tid = handle["transactional_id"]
        state = client.describe_transactions([tid])[tid]
        assert (state.state, state.producer_id, state.producer_epoch) == \
            ("Ongoing", handle["producer_id"], handle["producer_epoch"]), state
        assert driver.commit(handle).outcome is CommitOutcome.COMMITTED
        now = _resources()
        if baseline is None:
            baseline = now       # the driver client's thread and sockets exist from here on
            continue
        py_threads, os_threads, fds = now
        # A parked producer keeps ~4 librdkafka threads and ~4 descriptors: 29 of them would add
        # ~100 of each.  Allow a little slack for sockets the driver client opens or closes.
        assert py_threads <= baseline[0] + 1, (b, baseline, now)
        assert os_threads <= baseline[1] + 2, (b, baseline, now)
        assert fds <= baseline[2] + 4, (b, baseline, now)
    counts = Counter(read_committed(bs, topic))
    assert counts == expected, (f"{len(expected - counts)} missing, "
                                f"{sum((counts - expected).values())} duplicated")
    driver.close()
