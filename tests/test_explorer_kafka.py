"""The explorer over the shipped KafkaSink (issue 59): the in-memory broker model
(twophase/testing/kafka_model.py) checked against the real broker, and the ``batch-jobs`` scenario on
KafkaSink over the model.

- The model against the real broker (marker ``kafka``): the same sequence of requests (InitProducerId
  plain and as a claim, a producer's transaction, EndTxn commit and abort, repeated and fenced,
  DescribeTransactions, ListTransactions, DescribeProducers, the uncommitted batch at an offset, a
  transaction's marker, read_committed reads and watermarks) is run on both; every observable
  answer must be the same (producer ids and topic ids named by order of appearance).
- Scenario 2 of issue 59, found by the explorer by itself on KafkaSink's plan of 2c1a611 (its leftover
  snapshot put back: every open transaction of the pool listed as a closed ballot's leftover),
  nothing found on the shipped plan.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from twophase.sinks import _kafka_protocol as kp
from twophase.testing import kafka_model as km


# ============================================================================ the equivalence
class _Names:
    """Producer ids and topic ids by order of appearance (P0, P1, ...; T0, ...)."""

    def __init__(self) -> None:
        self.pids: dict[int, str] = {}
        self.topics: dict[str, str] = {}

    def pid(self, p: int) -> str:
        if p < 0:
            return str(p)
        return self.pids.setdefault(p, f"P{len(self.pids)}")

    def topic(self, t: str) -> str:
        return self.topics.setdefault(t, f"T{len(self.topics)}")


def _sequence(client: Any, ck: Any, bootstrap: str, topic: str, prefix: str, *, real: bool) -> list[str]:
    """The requests KafkaSink sends, in a sequence that reaches each answer it handles; the
    observable answers, one line each."""
    names = _Names()
    out: list[str] = []
    a, b, c = f"{prefix}-0.0", f"{prefix}-0.1", f"{prefix}-plans"

    def note(what: str, answer: Any) -> None:
        out.append(f"{what} -> {answer}")

    def settle(tid: str) -> kp.TxnDescription:
        """DescribeTransactions once the broker has written an EndTxn's markers (the real broker
        answers PrepareCommit/PrepareAbort for a moment; the model has no such window)."""
        deadline = time.time() + 30
        while True:
            d = client.describe_transactions([tid])[tid]
            if not d.state.startswith("Prepare") or time.time() > deadline:
                return d
            time.sleep(0.05)

    def describe(tid: str) -> str:
        d = settle(tid)
        if d.error_code != kp.NONE:
            return kp.error_name(d.error_code)
        parts = [x.replace(topic, "TOPIC") for x in d.partitions]
        return (f"{d.state} {names.pid(d.producer_id)}/{d.producer_epoch} timeout {d.timeout_ms} "
                f"partitions {parts} started {d.start_time_ms > 0}")

    def init(tid: str, pid: int = -1, epoch: int = -1, timeout: int = 60_000) -> tuple[int, int, int]:
        r = client.init_producer_id(tid, timeout, pid, epoch)
        note(f"init {tid.rsplit('-', 1)[1]} from {names.pid(pid)}/{epoch}",
             f"{kp.error_name(r[0])} {names.pid(r[1])}/{r[2]}" if r[0] == 0 else kp.error_name(r[0]))
        return r

    def init_until_done(tid: str) -> tuple[int, int, int]:
        deadline = time.time() + 30
        while True:
            r = client.init_producer_id(tid, 60_000)
            if r[0] != kp.CONCURRENT_TRANSACTIONS or time.time() > deadline:
                note(f"init {tid.rsplit('-', 1)[1]} again until done", f"{kp.error_name(r[0])} {names.pid(r[1])}/{r[2]}")
                return r
            time.sleep(0.1)

    def end(tid: str, pid: int, epoch: int, commit: bool) -> int:
        code = client.end_txn(tid, pid, epoch, commit)
        note(f"end_txn {tid.rsplit('-', 1)[1]} {'commit' if commit else 'abort'} {names.pid(pid)}/{epoch}",
             kp.error_name(code))
        return code

    def producer(tid: str, values: list[bytes], partition: int = 0) -> Any:
        import logging

        from twophase.sinks.kafka import _ACQUIRED, _LibrdkafkaLog
        handler = _LibrdkafkaLog(tid)
        logger = logging.Logger(f"equiv.{tid}")
        logger.setLevel(logging.DEBUG)
        logger.addHandler(handler)
        p = ck.Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "enable.idempotence": True,
                         "acks": "all", "debug": "eos", "logger": logger, "transaction.timeout.ms": 60_000,
                         "enable.sparse.connections": False})
        p.init_transactions(30)
        deadline = time.time() + 10
        while handler.pid_epoch is None and time.time() < deadline:
            p.poll(0.05)
        assert _ACQUIRED is not None
        note(f"producer {tid.rsplit('-', 1)[1]} acquired",
             None if handler.pid_epoch is None else f"{names.pid(handler.pid_epoch[0])}/{handler.pid_epoch[1]}")
        p.begin_transaction()
        for v in values:
            p.produce(topic, v, partition=partition)
        note(f"producer {tid.rsplit('-', 1)[1]} flush", p.flush(30))
        assert handler.pid_epoch is not None
        return p, handler.pid_epoch

    def committed() -> list[str]:
        consumer = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": f"eq-{uuid.uuid4().hex[:8]}",
                                "isolation.level": "read_committed", "enable.auto.commit": False,
                                "enable.partition.eof": True, "auto.offset.reset": "earliest"})
        low_high = consumer.get_watermark_offsets(ck.TopicPartition(topic, 0), timeout=10, cached=False)
        consumer.assign([ck.TopicPartition(topic, 0, 0)])
        got: list[str] = []
        deadline = time.time() + 20
        while time.time() < deadline:
            m = consumer.poll(0.2)
            if m is None:
                continue
            if m.error() is not None:
                if m.error().code() == ck.KafkaError._PARTITION_EOF:
                    got.append(f"EOF@{m.offset()}")
                    break
                got.append(f"error {m.error().code()}")
                break
            got.append(f"{m.offset()}:{m.value().decode()}")
        consumer.close()
        return [f"watermarks {tuple(low_high)}", *got]

    def at(offset: int) -> None:
        kind, what = client.batch_at(f"{topic}:0", offset)
        if kind == "batch":
            what = (names.pid(what[0]), what[1], what[2])
        note(f"batch_at {offset}", f"{kind} {what}")

    note("describe unknown", [describe(a), describe(b)])
    ra = init(a)                                              # a new id, unconditional
    rb = init(b, kp.UNUSED_PRODUCER_ID, 0)                    # a claim of a new id
    init(b, kp.UNUSED_PRODUCER_ID, 0)                         # again: the id exists
    rc = init(c, timeout=3)                                   # the plan fence; timeout = the widest plan
    init(c, timeout=2)
    note("describe fence", describe(c))
    init(a, ra[1], ra[2])                                     # a claim from the current epoch: bumped
    init(a, ra[1], ra[2])                                     # the same claim again: a retry, unbumped
    init(a, ra[1], ra[2] + 5)                                 # from another epoch: fenced
    init(a, rb[1], 0)                                         # from another producer id: fenced
    note("describe a", describe(a))
    pa, pa_pe = producer(a, [b"a0", b"a1", b"a2"])                   # librdkafka's unconditional init, then a txn
    pid_a, ep_a = pa_pe
    note("describe a ongoing", describe(a))
    found = client.describe_producers([f"{topic}:0"])
    note("describe_producers", [(names.pid(e.producer_id), e.producer_epoch, e.txn_start_offset)
                                for e in found[f"{topic}:0"]])
    note("watermarks and read_committed with a open", committed())
    at(0)
    end(a, pid_a, ep_a - 1, True)                             # an older epoch: fenced
    end(a, rb[1], ep_a, True)                                 # another producer id
    end(a, pid_a, ep_a, True)                                 # the commit
    note("describe a committed", describe(a))
    end(a, pid_a, ep_a, True)                                 # a repeat: success
    end(a, pid_a, ep_a, False)                                # the other outcome
    note("marker of a", client.transaction_marker(f"{topic}:0", 0, pid_a))
    del pa
    rb2 = init(b, rb[1], rb[2])                               # the sink's claim of b, then its producer
    pb, pb_pe = producer(b, [b"b0", b"b1"])
    pid_b, ep_b = pb_pe
    note("claim then producer epochs", (rb2[2], ep_b))
    end(b, pid_b, ep_b, False)                                # an abort (the sink's _abort_open)
    note("describe b aborted", describe(b))
    end(b, pid_b, ep_b, True)                                 # commit after the abort
    end(b, pid_b, ep_b, False)                                # abort again: success
    note("marker of b", client.transaction_marker(f"{topic}:0", 4, pid_b))
    note("read_committed after b aborted", committed())
    for off in (3, 4, 6, 7, 50):
        at(off)
    del pb
    pb2, pb2_pe = producer(b, [b"b2"])                                # b open again (offset 7)
    pid_b2, ep_b2 = pb2_pe
    init(b, pid_b2, ep_b2 - 3)                                # a claim of an Ongoing id, matching producer id
    note("describe b fenced by a claim", describe(b))
    init(b, pid_b2, ep_b2 - 3)                                # asked again
    end(b, pid_b2, ep_b2, True)                               # a fenced EndTxn
    note("read_committed after b's claim-fence", committed())
    del pb2
    pb3, pb3_pe = producer(b, [b"b3"])                                # b open again (offset 9)
    pid_b3, ep_b3 = pb3_pe
    init(b)                                                   # unconditional on Ongoing: aborts it
    init_until_done(b)
    note("describe b fenced", describe(b))
    end(b, pid_b3, ep_b3, True)                               # the fenced transaction's commit
    note("marker of b3", client.transaction_marker(f"{topic}:0", 9, pid_b3))
    del pb3
    pa2, pa2_pe = producer(a, [b"a3"])                                # a open, for ListTransactions
    listing = client.list_transactions()
    note("list_transactions", sorted((t.rsplit("-", 1)[1], names.pid(p), s) for t, p, s in listing
                                     if t.startswith(prefix + "-")))
    end(a, pa2_pe[0], pa2_pe[1], True)
    del pa2
    note("read_committed at the end", committed())
    ids = client.topic_ids([topic, f"{topic}-absent"])
    note("topic_ids", {names.topic(k): names.topic(v) for k, v in ids.items()})
    del rc
    return out


class _RealClient:
    """The real TxnClient, with ListTransactions (which KafkaSink does not send) through kafka-python."""

    def __init__(self, bootstrap: str):
        self.inner = kp.TxnClient(kp.kafka_python_config({"bootstrap.servers": bootstrap}))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def list_transactions(self) -> list[tuple[str, int, str]]:
        by_broker = self.inner._admin.list_transactions()
        listing = [t for group in by_broker.values() for t in group]
        return [(t.transactional_id, int(t.producer_id), getattr(t.state, "value", str(t.state))) for t in listing]


def _model_answers(prefix: str) -> list[str]:
    import types

    broker = km.ModelBroker({"eq-topic": 1})
    km.register("model-eq:9092", broker)
    try:
        with km.patched():
            model = km.ModelConfluent()
            client = km.ModelTxnClient({"bootstrap_servers": "model-eq:9092"})
            ck = types.SimpleNamespace(**vars(model.ck))
            return _sequence(client, ck, "model-eq:9092", "eq-topic", prefix, real=False)
    finally:
        km.unregister("model-eq:9092", broker)


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_the_kafka_model_answers_as_the_real_broker(kafka_service):
    import confluent_kafka

    from tests.test_kafka_sink import _topic

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"eq-{uuid.uuid4().hex[:8]}"
    client = _RealClient(bs)
    try:
        real = _sequence(client, confluent_kafka, bs, topic, prefix, real=True)
    finally:
        client.close()
    model = _model_answers(prefix)
    print("\n".join(f"{'  ' if r == m else '!!'} {r}\n{'' if r == m else '   model: ' + m + chr(10)}"
                    for r, m in zip(real, model)))
    assert len(real) == len(model) >= 50, (len(real), len(model))
    assert real == model
