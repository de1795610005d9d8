"""The clients of the Kafka model (:mod:`twophase.testing.kafka_model`): what replaces KafkaSink's
two client seams inside :func:`~twophase.testing.kafka_model.patched`, each request one call of
:meth:`~twophase.testing.kafka_model_broker.ModelBroker.request` on the broker registered under
its bootstrap servers: the driver's and the executors' ``TxnClient`` (:class:`ModelTxnClient`),
and ``confluent_kafka`` as the sink gets it (:class:`ModelConfluent`: the transactional
:class:`ModelProducer`, the :class:`ModelConsumer`, the :class:`ModelAdminClient`).
"""

from __future__ import annotations

import builtins
import logging
import types
from dataclasses import dataclass
from typing import Any

from twophase.sinks.kafka import protocol as kp
from twophase.testing.kafka_model_broker import ModelBroker, _bootstrap, _broker


# ============================================================================ the driver's client
class ModelTxnClient:
    """:class:`twophase.sinks.kafka.protocol.TxnClient` over a :class:`ModelBroker` (the broker
    registered under its bootstrap servers when each request is sent: a client cached across
    schedules talks to the current one)."""

    def __init__(self, config: dict[str, Any], request_timeout_ms: int = 30000):
        self.bootstrap = _bootstrap(config)
        self.closed = False

    @property
    def broker(self) -> ModelBroker:
        return _broker(self.bootstrap)

    def close(self) -> None:
        self.closed = True

    def forget_coordinator(self, tid: str) -> None:
        pass

    def coordinators(self, tids: list[str]) -> dict[str, Any]:
        return {t: 1 for t in tids}

    def end_txn(self, tid: str, producer_id: int, producer_epoch: int, commit: bool) -> int:
        b = self.broker
        code: int = b.request("end_txn", tid, lambda: b.end_txn(tid, producer_id, producer_epoch, commit),
                              lambda c: f"{tid} {'commit' if commit else 'abort'} (pid {producer_id} epoch "
                                        f"{producer_epoch}) -> {kp.error_name(c)}")
        return code

    def init_producer_id(self, tid: str, transaction_timeout_ms: int, producer_id: int = -1,
                         producer_epoch: int = -1) -> tuple[int, int, int]:
        b = self.broker
        expect = "" if producer_id < 0 else f" from (pid {producer_id} epoch {producer_epoch})"
        out: tuple[int, int, int] = b.request(
            "init_producer_id", tid,
            lambda: b.init_producer_id(tid, transaction_timeout_ms, producer_id, producer_epoch),
            lambda r: f"{tid}{expect} -> {kp.error_name(r[0])}" + (f" pid {r[1]} epoch {r[2]}" if r[0] == 0 else ""))
        return out

    def describe_transactions(self, tids: list[str]) -> dict[str, kp.TxnDescription]:
        b = self.broker
        out: dict[str, kp.TxnDescription] = b.request(
            "describe_transactions", ",".join(tids), lambda: b.describe_transactions(tids), _states_text)
        return out

    def list_transactions(self, states: list[str] | None = None) -> list[tuple[str, int, str]]:
        b = self.broker
        out: list[tuple[str, int, str]] = b.request("list_transactions", "", lambda: b.list_transactions(states),
                                                    lambda r: f"{len(r)} ids")
        return out

    def transaction_marker(self, partition: str, first_offset: int, producer_id: int,
                           timeout_s: float = 120.0, max_bytes: int = 1 << 20) -> str | None:
        b = self.broker
        out: str | None = b.request("transaction_marker", partition,
                                    lambda: b.transaction_marker(partition, first_offset, producer_id),
                                    lambda r: f"{partition}@{first_offset} pid {producer_id} -> {r}")
        return out

    def topic_ids(self, topics: list[str]) -> dict[str, str]:
        b = self.broker
        out: dict[str, str] = b.request("topic_ids", ",".join(topics), lambda: b.topic_ids(topics),
                                        lambda r: ", ".join(f"{k}={v}" for k, v in r.items()))
        return out

    def batch_at(self, partition: str, offset: int, max_bytes: int = 1 << 16) -> tuple[str, Any]:
        b = self.broker
        out: tuple[str, Any] = b.request("batch_at", partition, lambda: b.batch_at(partition, offset),
                                         lambda r: f"{partition}@{offset} -> {r[0]} {r[1]}")
        return out

    def describe_producers(self, partitions: list[str]) -> dict[str, list[kp.ProducerEntry]]:
        b = self.broker
        out: dict[str, list[kp.ProducerEntry]] = b.request(
            "describe_producers", ",".join(partitions), lambda: b.describe_producers(partitions),
            lambda r: "; ".join(f"{k}: " + ", ".join(f"pid {e.producer_id} start {e.txn_start_offset}" for e in v)
                                for k, v in r.items()))
        return out


def _states_text(states: dict[str, kp.TxnDescription]) -> str:
    parts = []
    for tid, d in states.items():
        if d.error_code != kp.NONE:
            parts.append(f"{tid.rsplit('-', 1)[-1]}: {kp.error_name(d.error_code)}")
        else:
            parts.append(f"{tid.rsplit('-', 1)[-1]}: {d.state} {d.producer_id}/{d.producer_epoch}")
    return "; ".join(parts)


# ============================================================================ confluent_kafka
class ModelKafkaError:
    """``confluent_kafka.KafkaError`` (what the sink reads of one: code, str, fatal)."""

    _PARTITION_EOF = -191
    _TRANSPORT = -195

    def __init__(self, code: int, text: str = "", fatal: bool = False):
        self._code, self._text, self._fatal = code, text, fatal

    def code(self) -> int:
        return self._code

    def str(self) -> builtins.str:
        return self._text or kp.error_name(self._code)

    def fatal(self) -> bool:
        return self._fatal

    def __repr__(self) -> builtins.str:
        return f"KafkaError({self.str()})"


class ModelKafkaException(Exception):
    pass


@dataclass
class ModelTopicPartition:
    topic: str
    partition: int = -1
    offset: int = -1001


class _Message:
    def __init__(self, topic: str, partition: int, offset: int, value: bytes | None,
                 error: ModelKafkaError | None = None):
        self._topic, self._partition, self._offset, self._value, self._error = topic, partition, offset, value, error

    def error(self) -> ModelKafkaError | None:
        return self._error

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition


class _Metadata:
    def __init__(self, broker: ModelBroker, topic: str | None):
        names = [topic] if topic else list(broker.topics)
        self.topics = {n: types.SimpleNamespace(error=None if n in broker.topics else ModelKafkaError(3),
                                                partitions={i: types.SimpleNamespace(leader=1) for i in
                                                            range(len(broker.topics[n].partitions))}
                                                if n in broker.topics else {})
                       for n in names}
        self.brokers = {1: types.SimpleNamespace(id=1)}


class ModelProducer:
    """confluent-kafka's transactional ``Producer`` over the model: ``init_transactions`` is an
    unconditional InitProducerId (asked again on CONCURRENT_TRANSACTIONS, as librdkafka does), whose
    producer id and epoch it logs as librdkafka's 'eos' debug context does; ``produce`` buffers,
    ``flush`` sends the buffered records (AddPartitionsToTxn and Produce: one request), reporting a
    fenced epoch as a fatal error; ``abort_transaction`` is EndTxn(abort)."""

    def __init__(self, conf: dict[str, Any]):
        self.bootstrap = str(conf["bootstrap.servers"])
        self.tid = conf.get("transactional.id")
        self.timeout_ms = int(conf.get("transaction.timeout.ms", 60000))
        self.logger: logging.Logger | None = conf.get("logger")
        self.on_delivery = conf.get("on_delivery")
        self.error_cb = conf.get("error_cb")
        self.pid_epoch: tuple[int, int] | None = None
        self._pending_log: list[str] = []
        self._buffer: list[tuple[str, int, bytes | None, bytes | None]] = []
        self._in_txn = False

    @property
    def broker(self) -> ModelBroker:
        return _broker(self.bootstrap)

    def _fail(self, code: int, what: str) -> None:
        raise ModelKafkaException(ModelKafkaError(code, f"{what}: {kp.error_name(code)}", fatal=code == kp.PRODUCER_FENCED))

    def init_transactions(self, timeout: float | None = None) -> None:
        b, tid = self.broker, str(self.tid)
        for _ in range(10):
            code, pid, epoch = b.request(
                "producer.init_transactions", tid, lambda: b.init_producer_id(tid, self.timeout_ms),
                lambda r: f"{tid} -> {kp.error_name(r[0])}" + (f" pid {r[1]} epoch {r[2]}" if r[0] == 0 else ""))
            if code == kp.NONE:
                self.pid_epoch = (pid, epoch)
                self._pending_log.append(f"Acquired PID{{Id:{pid},Epoch:{epoch}}}")
                return
            if code != kp.CONCURRENT_TRANSACTIONS:
                self._fail(code, f"init_transactions of {tid}")
        self._fail(kp.CONCURRENT_TRANSACTIONS, f"init_transactions of {tid}")

    def poll(self, timeout: float | None = None) -> int:
        lines, self._pending_log = self._pending_log, []
        if self.logger is not None:
            for line in lines:
                self.logger.debug("%s", f"[thrd:main]: {line} [eos]")
        return 0

    def begin_transaction(self) -> None:
        if self.pid_epoch is None:
            raise ModelKafkaException(ModelKafkaError(-172, "begin_transaction before init_transactions"))
        self._in_txn = True

    def produce(self, topic: str, value: bytes | str | None = None, key: bytes | str | None = None,
                partition: int = -1, headers: Any = None, **kwargs: Any) -> None:
        def raw(x: bytes | str | None) -> bytes | None:
            return x.encode() if isinstance(x, str) else x

        self._buffer.append((topic, 0 if partition is None or partition < 0 else int(partition), raw(key), raw(value)))

    def flush(self, timeout: float | None = None) -> int:
        if not self._buffer:
            return 0
        assert self.pid_epoch is not None and self.tid is not None
        b, tid, (pid, epoch) = self.broker, str(self.tid), self.pid_epoch
        groups: dict[tuple[str, int], list[tuple[bytes | None, bytes | None]]] = {}
        for topic, part, k, v in self._buffer:
            groups.setdefault((topic, part), []).append((k, v))
        buffered, self._buffer = self._buffer, []

        def send() -> list[int]:
            return [b.produce(tid, pid, epoch, topic, part, recs)[0] for (topic, part), recs in groups.items()]

        codes = b.request("producer.produce", tid, send,
                          lambda cs: f"{tid} (pid {pid} epoch {epoch}) {len(buffered)} records to "
                                     f"{', '.join(f'{t}:{p}' for t, p in groups)} -> "
                                     + ", ".join(kp.error_name(c) for c in cs))
        for code in codes:
            if code == kp.NONE:
                continue
            err = ModelKafkaError(code, f"{kp.error_name(code)}: producer fenced", fatal=code == kp.PRODUCER_FENCED)
            if err.fatal() and self.error_cb is not None:
                self.error_cb(err)
            elif self.on_delivery is not None:
                self.on_delivery(err, _Message(buffered[0][0], buffered[0][1], -1, None, err))
        return 0

    def abort_transaction(self, timeout: float | None = None) -> None:
        if self.pid_epoch is None or self.tid is None:
            return
        b, tid, (pid, epoch) = self.broker, str(self.tid), self.pid_epoch
        self._buffer = []
        code = b.request("producer.abort_transaction", tid, lambda: b.end_txn(tid, pid, epoch, False),
                         lambda c: f"{tid} (pid {pid} epoch {epoch}) -> {kp.error_name(c)}")
        if code != kp.NONE:
            self._fail(code, f"abort_transaction of {tid}")

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Metadata:
        return _Metadata(self.broker, topic)  # static metadata: no request modelled


class ModelConsumer:
    """A ``read_committed`` (or read_uncommitted) consumer over the model: watermarks (the last
    stable offset for read_committed), assign, poll (one Fetch per poll: the next record it may
    read, or a partition-EOF event at the end)."""

    def __init__(self, conf: dict[str, Any]):
        self.bootstrap = str(conf["bootstrap.servers"])
        self.committed = conf.get("isolation.level", "read_committed") == "read_committed"
        self.eof = str(conf.get("enable.partition.eof", False)).lower() in ("true", "1")
        self._assigned: list[ModelTopicPartition] = []
        self._eof_sent: set[tuple[str, int]] = set()

    @property
    def broker(self) -> ModelBroker:
        return _broker(self.bootstrap)

    def get_watermark_offsets(self, tp: ModelTopicPartition, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        b, name = self.broker, f"{tp.topic}:{tp.partition}"

        def ask() -> tuple[int, int] | None:
            try:
                return b.watermarks(name, self.committed)
            except KeyError:
                return None

        out = b.request("consumer.watermarks", name, ask, lambda r: f"{name} -> {r}")
        if out is None:
            raise ModelKafkaException(ModelKafkaError(kp.UNKNOWN_TOPIC_OR_PARTITION, "Unknown topic or partition"))
        return out

    def assign(self, partitions: list[ModelTopicPartition]) -> None:
        self._assigned = [ModelTopicPartition(p.topic, p.partition, p.offset) for p in partitions]
        self._eof_sent.clear()

    def poll(self, timeout: float | None = None) -> _Message | None:
        b = self.broker
        for tp in self._assigned:
            name = f"{tp.topic}:{tp.partition}"

            def fetch(tp: ModelTopicPartition = tp, name: str = name) -> tuple[int, bytes | None] | int:
                if self.committed:
                    recs = b.committed_records(name, max(0, tp.offset))
                    if recs:
                        return recs[0]
                    return b.watermarks(name, True)[1]
                p = b._partition(name)
                for batch in (p.batches if p is not None else []):
                    if batch.marker is None and batch.last >= tp.offset:
                        i = max(0, tp.offset - batch.base)
                        return batch.base + i, batch.records[i][1]
                return p.end if p is not None else 0

            def show(r: Any, tp: ModelTopicPartition = tp, name: str = name) -> str:
                return f"{name}@{tp.offset} -> {r if isinstance(r, int) else r[0]}"

            got = b.request("consumer.poll", name, fetch, show)
            if isinstance(got, tuple):
                tp.offset = got[0] + 1
                return _Message(tp.topic, tp.partition, got[0], got[1])
            tp.offset = max(tp.offset, got)
            if self.eof and (tp.topic, tp.partition) not in self._eof_sent:
                self._eof_sent.add((tp.topic, tp.partition))
                return _Message(tp.topic, tp.partition, got, None,
                                ModelKafkaError(ModelKafkaError._PARTITION_EOF, "Broker: No more messages"))
        return None

    def close(self) -> None:
        self._assigned = []


class _Future:
    def __init__(self, value: Any):
        self._value = value

    def result(self, timeout: float | None = None) -> Any:
        return self._value


@dataclass(frozen=True)
class ModelConfigResource:
    restype: Any
    name: str


class ModelAdminClient:
    """confluent-kafka's ``AdminClient``: the topic listing and the configs the sink reads (the
    broker's ``transaction.max.timeout.ms``, a topic's ``cleanup.policy``: delete).  No request
    modelled: static."""

    def __init__(self, conf: dict[str, Any]):
        self.bootstrap = str(conf["bootstrap.servers"])

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Metadata:
        return _Metadata(_broker(self.bootstrap), topic)

    def describe_configs(self, resources: list[ModelConfigResource], request_timeout: float | None = None
                         ) -> dict[ModelConfigResource, _Future]:
        out = {}
        for r in resources:
            entries = ({"transaction.max.timeout.ms": types.SimpleNamespace(value="900000")}
                       if r.restype == "BROKER" else {"cleanup.policy": types.SimpleNamespace(value="delete")})
            out[r] = _Future(entries)
        return out


class ModelConfluent:
    """The ``confluent_kafka`` and ``confluent_kafka.admin`` modules as the sink uses them."""

    def __init__(self) -> None:
        self.ck = types.SimpleNamespace(
            Producer=ModelProducer, Consumer=ModelConsumer, TopicPartition=ModelTopicPartition,
            KafkaException=ModelKafkaException, KafkaError=ModelKafkaError)
        self.admin = types.SimpleNamespace(
            AdminClient=ModelAdminClient, ConfigResource=ModelConfigResource,
            ResourceType=types.SimpleNamespace(BROKER="BROKER", TOPIC="TOPIC"))

    def require(self, module: str, feature: str) -> Any:
        if module == "confluent_kafka":
            return self.ck
        if module == "confluent_kafka.admin":
            return self.admin
        from twophase._deps import require

        return require(module, feature)
