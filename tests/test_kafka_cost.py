"""Per-transaction work of KafkaSink on the real broker (issue 15): what each transaction asks the
broker for, and the driver's commit fan-out.  Speed itself is measured by
``python -m benchmarks.kafka --txn-cost``, not here."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _ctx, _topic, read_committed
from twophase.errors import TwoPhaseError
from twophase.sink import CommitOutcome
from twophase.sinks.kafka import KafkaSink
from twophase.sinks.kafka import protocol as kp
from twophase.sinks.kafka import writer as kafka_writer


class _CountingProducer:
    """Wraps a real confluent-kafka Producer and counts its metadata requests."""

    def __init__(self, producer):
        self._producer = producer
        self.list_topics_calls = 0

    def list_topics(self, *a, **k):
        self.list_topics_calls += 1
        return self._producer.list_topics(*a, **k)

    def __getattr__(self, name):
        return getattr(self._producer, name)


def test_producers_connect_to_the_brokers_at_once_unless_told_otherwise():
    sink = KafkaSink("b:9092", "t", "app")
    assert sink._producer_config("app-0", [None])["enable.sparse.connections"] is False
    own = KafkaSink("b:9092", "t", "app", producer_config={"enable.sparse.connections": True})
    assert own._producer_config("app-0", [None])["enable.sparse.connections"] is True


@pytest.mark.kafka
def test_topic_existence_is_checked_once_per_worker_not_per_transaction(kafka_service, monkeypatch):
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"tchk-{uuid.uuid4().hex[:8]}"
    monkeypatch.setattr(kafka_writer, "_TOPICS_SEEN", {}, raising=False)  # a fresh worker
    sink = KafkaSink(bs, topic, prefix)
    calls, handles = [], []
    for b in range(3):
        txn = sink.begin_transaction(_ctx(sink, batch=b))
        txn.producer = counting = _CountingProducer(txn.producer)
        sink.write(txn, pa.RecordBatch.from_pydict({"value": [f"{prefix}-{b}".encode()]}))
        calls.append(counting.list_topics_calls)
        handles.append(sink.pre_commit(txn))
        assert sink.commit(handles[-1]).outcome is CommitOutcome.COMMITTED
    assert calls == [1, 0, 0]
    # A missing topic is still refused before anything is written.
    missing = KafkaSink(bs, f"missing-{uuid.uuid4().hex[:8]}", prefix)
    txn = missing.begin_transaction(_ctx(missing, batch=9))
    with pytest.raises(TwoPhaseError, match="does not exist"):
        missing.write(txn, pa.RecordBatch.from_pydict({"value": [b"x"]}))
    missing.abort(txn)
    assert Counter(read_committed(bs, topic)) == Counter(f"{prefix}-{b}".encode() for b in range(3))
    sink.close()


@pytest.mark.kafka
def test_commit_fan_out_of_200_handles_needs_no_retries(kafka_service):
    """The coordinator commits with 8 threads over one connection per broker.  kafka-python used
    to refuse the 6th request in flight on a connection at once (NETWORK_EXCEPTION), so commits
    and coordinator lookups were retried with backoff."""
    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, 4), f"fan-{uuid.uuid4().hex[:8]}"
    executor = KafkaSink(bs, topic, prefix, transaction_timeout_ms=300_000)
    started = time.time()
    handles = []
    for p in range(200):
        txn = executor.begin_transaction(_ctx(executor, partition=p, n=200))
        executor.write(txn, pa.RecordBatch.from_pydict({"value": [f"{prefix}-{p}".encode()]}))
        handles.append(executor.pre_commit(txn))
    driver = KafkaSink(bs, topic, prefix, transaction_timeout_ms=300_000)
    driver.verify_prepared(0, handles, prepare_started_at=started)  # all 200 described at once
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(driver.commit, handles))
    answers = Counter(r.outcome.value + (f": {r.reason}" if r.reason else "") for r in results)
    assert answers == Counter({"committed": 200}), answers
    # Recovery's DescribeTransactions + EndTxn from 8 threads: no retries either.
    deadline = time.time() + 30
    while True:
        with ThreadPoolExecutor(8) as pool:
            again = list(pool.map(driver.recover_and_commit, handles))
        retried = [r for r in again if r.outcome is CommitOutcome.RETRY_LATER]
        assert all("completing the commit" in r.reason for r in retried), retried[:3]
        if not retried:
            break
        assert time.time() < deadline, retried[:3]   # markers still being written: ask again
        time.sleep(0.2)
    assert Counter(r.outcome for r in again) == Counter({CommitOutcome.ALREADY_COMMITTED: 200})
    counts = Counter(read_committed(bs, topic))
    assert len(counts) == 200 and set(counts.values()) == {1}
    driver.close()


def test_find_coordinator_is_batched_and_falls_back_per_id():
    """Unit twin of test_commit_fan_out_of_200_handles_needs_no_retries (real broker): one
    lookup for many ids; if the batched lookup fails, each id is looked up alone."""

    class _Admin:
        def __init__(self, fail_batch):
            self.fail_batch, self.batches, self.singles = fail_batch, [], []

        def _find_coordinator_ids(self, keys, key_type):
            self.batches.append(list(keys))
            if self.fail_batch:
                raise _errors.CoordinatorNotAvailableError("one key failed")
            return {k: 1 for k in keys}

        def _find_coordinator_id(self, key, key_type):
            self.singles.append(key)
            if key == "bad":
                raise _errors.CoordinatorNotAvailableError("no coordinator")
            return 1

    class _Manager:
        class cluster:
            _coordinators: dict = {}  # noqa: RUF012 - a stand-in for kafka-python's ClusterMetadata

        @staticmethod
        def run(fn, *args):
            return fn(*args)

    import threading

    import kafka.errors as _errors

    for fail in (False, True):
        client = kp.TxnClient.__new__(kp.TxnClient)
        client._admin, client._manager, client._errors = _Admin(fail), _Manager(), _errors
        client._lock, client._slots, client._coordinators = (threading.Lock(),
                                                             threading.BoundedSemaphore(4), {})
        got = client.coordinators(["a", "b", "bad", "a"])
        if not fail:
            assert got == {"a": 1, "b": 1, "bad": 1} and client._admin.batches == [["a", "b", "bad"]]
            assert client.coordinators(["a", "b"]) == {"a": 1, "b": 1}
            assert client._admin.batches == [["a", "b", "bad"]]        # cached: no new request
        else:
            assert got == {"a": 1, "b": 1} and client._admin.singles == ["a", "b", "bad"]
