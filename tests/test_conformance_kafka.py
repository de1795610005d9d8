"""twophase.testing on KafkaSink against the real broker: rows read back by a read_committed consumer."""

from __future__ import annotations

import json
import time
import uuid

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


def test_kafka_sink_conformance(kafka_service):
    from confluent_kafka import Consumer, TopicPartition

    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 2)
    prefix = f"conf-{uuid.uuid4().hex[:8]}"
    consumer = Consumer({"bootstrap.servers": bs, "group.id": f"conf-{uuid.uuid4().hex}",
                         "isolation.level": "read_committed", "enable.auto.commit": False,
                         # Connections up front: with sparse connections each offset query can wait
                         # 50-500 ms for librdkafka's connection timer.
                         "enable.sparse.connections": False,
                         # A fetch with nothing to return answers in 100 ms, not the default 500:
                         # the idle wait below can then be short.
                         "fetch.wait.max.ms": 100})
    tps = [TopicPartition(topic, p) for p in consumer.list_topics(topic, timeout=10).topics[topic].partitions]

    def make_sink() -> KafkaSink:
        return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)

    def read_committed() -> list[bytes]:
        """Everything up to the last stable offset of each partition, as a read_committed consumer sees it.

        librdkafka's position() does not move past a trailing abort marker until a later record is
        fetched, so a partition also counts as read once 0.6 s (six empty fetches) passed without a
        record (a decided row that is still missing then is re-read by the harness: settle_timeout)."""
        ends = {tp.partition: consumer.get_watermark_offsets(tp, timeout=10, cached=False)[1] for tp in tps}
        todo = {p for p, hi in ends.items() if hi > 0}
        consumer.assign([TopicPartition(topic, p, 0) for p in todo])
        out: list[bytes] = []
        last = time.time()
        while todo and time.time() - last < 0.6:
            msgs = consumer.consume(1000, 0.1)
            for m in msgs:
                if m.error() is None:
                    out.append(m.value())
                    last = time.time()
            for p in list(todo):
                if consumer.position([TopicPartition(topic, p)])[0].offset >= ends[p]:
                    todo.discard(p)
        return out

    def pending() -> list[str]:
        sink = make_sink()
        try:
            states = sink._txn_client().describe_transactions(sink.pool_ids(PARTITIONS))
        finally:
            sink.close()
        return [tid for tid, d in states.items() if d.state in ("Ongoing", "PrepareAbort", "PrepareCommit")]

    try:
        run_sink_conformance(make_sink, read_committed, make_batch=make_batch,
                             id_of=lambda v: json.loads(v)["id"], pending=pending, settle_timeout=15,
                             max_partitions=PARTITIONS, max_examples=4, steps=3)
    finally:
        consumer.close()
