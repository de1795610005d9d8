"""twophase.testing on KafkaSink against the real broker: rows read back by a read_committed consumer."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pytest

from twophase.testing import run_sink_conformance

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(300)]

PARTITIONS = 3  # the harness' max_partitions: transactional ids prefix-0 .. prefix-2


def _topic(bootstrap: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"conf-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, partitions, 1)])[name].result(30)
    deadline = time.time() + 30
    while time.time() < deadline:  # leaders elected, so the first produce does not stall
        md = admin.list_topics(name, timeout=10).topics[name]
        if md.error is None and all(p.leader >= 0 for p in md.partitions.values()):
            return name
        time.sleep(0.2)
    raise AssertionError(f"topic {name} has no leaders after 30 s")


def make_batch(ids: list[int]) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"key": [str(i) for i in ids],
                                       "value": [json.dumps({"id": i}) for i in ids]})


#: librdkafka's settings for every reader here: connections up front (with sparse connections each
#: offset query can wait 50-500 ms for its connection timer); an empty fetch answers in 100 ms.
READER = {"isolation.level": "read_committed", "enable.auto.commit": False, "enable.sparse.connections": False,
          "fetch.wait.max.ms": 100}


class CommittedReader:
    """What a read_committed consumer sees of a topic, read to a known end, never to an idle timeout.

    The end of each partition is its last stable offset, asked after the transactions' markers
    were written (no transactional id of ``tids()`` in PrepareCommit/PrepareAbort: a commit
    returns before its markers land, and the offset moves only when they do).  The consumer then
    reads until librdkafka reports the partition's end (a PARTITION_EOF event at that offset or
    beyond: its fetch passed every record, aborted ones and control markers included, which
    position() does not move past).  A reader that cannot get there within ``timeout`` raises
    instead of returning what it has so far: a duplicate in an unread tail would pass unseen.
    """

    def __init__(self, bootstrap: str, topic: str, tids: Callable[[], list[str]] | None = None,
                 describe: Callable[[list[str]], dict[str, Any]] | None = None, timeout: float = 60.0,
                 **config: Any):
        from confluent_kafka import Consumer, TopicPartition

        self.topic, self.tids, self.describe, self.timeout = topic, tids, describe, timeout
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"conf-{uuid.uuid4().hex}",
                                  **READER, **config, "enable.partition.eof": True})
        self.tps = [TopicPartition(topic, p)
                    for p in self.consumer.list_topics(topic, timeout=10).topics[topic].partitions]

    def _markers_written(self, deadline: float) -> None:
        if self.tids is None or self.describe is None:
            return
        while True:
            busy = {t: d.state for t, d in self.describe(self.tids()).items()
                    if d.state in ("PrepareCommit", "PrepareAbort")}
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"transaction markers still being written after {self.timeout} s: {busy}")
            time.sleep(0.05)

    def __call__(self) -> list[bytes]:
        from confluent_kafka import KafkaError, TopicPartition

        deadline = time.monotonic() + self.timeout
        self._markers_written(deadline)
        ends = {tp.partition: self.consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1]
                for tp in self.tps}  # read_committed: the last stable offset
        todo = {p for p, end in ends.items() if end > 0}
        self.consumer.assign([TopicPartition(self.topic, p, 0) for p in todo])
        out: list[bytes] = []
        try:
            while todo:
                if time.monotonic() > deadline:
                    raise AssertionError(f"partitions {sorted(todo)} of {self.topic} not read to their last "
                                         f"stable offsets {ends} within {self.timeout} s")
                for m in self.consumer.consume(1000, 0.1):
                    err = m.error()
                    if err is None:
                        out.append(m.value())
                    elif err.code() == KafkaError._PARTITION_EOF:
                        if m.offset() >= ends[m.partition()]:
                            todo.discard(m.partition())
                    else:
                        raise AssertionError(f"reading {self.topic}: {err}")
        finally:
            self.consumer.unassign()
        return out

    def close(self) -> None:
        self.consumer.close()


def test_kafka_sink_conformance(kafka_service):
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 2)
    prefix = f"conf-{uuid.uuid4().hex[:8]}"

    def make_sink() -> KafkaSink:
        return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)

    admin = make_sink()  # its transaction client describes the pool's transactions
    read_committed = CommittedReader(bs, topic, lambda: admin.pool_ids(PARTITIONS),
                                     lambda tids: admin._txn_client().describe_transactions(tids))

    def pending() -> list[str]:
        states = admin._txn_client().describe_transactions(admin.pool_ids(PARTITIONS))
        return [tid for tid, d in states.items() if d.state in ("Ongoing", "PrepareAbort", "PrepareCommit")]

    try:
        run_sink_conformance(make_sink, read_committed, make_batch=make_batch,
                             id_of=lambda v: json.loads(v)["id"], pending=pending, settle_timeout=15,
                             max_partitions=PARTITIONS, max_examples=4, steps=3)
    finally:
        read_committed.close()
        admin.close()


def _transaction(bs: str, topic: str, tid: str, values: list[int], commit: bool) -> None:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bs, "transactional.id": tid})
    p.init_transactions(30)
    p.begin_transaction()
    for v in values:
        p.produce(topic, json.dumps({"id": v}).encode(), partition=0)
    p.flush(30)
    (p.commit_transaction if commit else p.abort_transaction)(30)


def test_the_reader_sees_a_duplicate_written_last_behind_slow_fetches(kafka_service):
    """The conformance run's reader must see a duplicate in the last committed transaction, also
    behind an aborted transaction's marker and when every fetch takes a second (a broker under
    load): the reader it replaces stopped after 0.6 s without a record and returned without it."""
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 1)
    tid = f"conf-reader-{uuid.uuid4().hex[:8]}"
    _transaction(bs, topic, tid, [1, 2], commit=True)
    _transaction(bs, topic, tid, [3], commit=True)
    _transaction(bs, topic, tid, [2], commit=True)  # the duplicate, last of what is committed
    _transaction(bs, topic, tid, [4], commit=False)  # then a trailing abort marker
    # Every fetch waits a second for bytes that never come.
    read = CommittedReader(bs, topic, **{"fetch.min.bytes": 10 << 20, "fetch.wait.max.ms": 1000})
    try:
        for _ in range(2):  # the same reader again: the end is reported on every read
            seen = Counter(json.loads(v)["id"] for v in read())
            assert seen == {1: 1, 2: 2, 3: 1}, seen
    finally:
        read.close()
