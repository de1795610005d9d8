"""An in-memory model of a Kafka broker's transactional ids and topic logs, for the schedule
explorer (issue 59: "the explorer runs the code we ship").

The shipped :class:`twophase.sinks.kafka.KafkaSink` runs over it unchanged: its two client seams are
replaced, inside :func:`patched` only, by ones that talk to a :class:`ModelBroker`:

- ``twophase.sinks.kafka.protocol.TxnClient`` (the driver's and the executors' kafka-python client:
  InitProducerId, EndTxn, DescribeTransactions, DescribeProducers, the topic ids, the uncommitted
  batch-at-offset and transaction-marker reads) by :class:`ModelTxnClient`;
- ``confluent_kafka`` as the modules of ``twophase.sinks.kafka`` get it (``require``): the transactional
  ``Producer`` (``init_transactions``, ``begin_transaction``, ``produce``, ``flush``,
  ``abort_transaction``, its 'Acquired PID' debug line), the ``read_committed`` ``Consumer``
  (watermarks, poll) and the ``AdminClient`` (topic listing, configs), by :class:`ModelConfluent`.

Every broker request is one call of :meth:`ModelBroker.request`, which runs ``broker.before()``
first (the explorer's scheduling point) and ``broker.after(op, key, text)`` after (its trace line).
What the model answers, and the answers of the real broker it was checked against
(tests/test_explorer_kafka.py, ``kafka`` marker: the same sequence on both):

- **InitProducerId** ``(tid, timeout, producer_id=-1, epoch=-1)``: an unknown id is created (a new
  producer id, epoch 0), whatever the expectation; unconditional on a known id: an Ongoing
  transaction is aborted (its abort marker written under the bumped epoch, the answer
  CONCURRENT_TRANSACTIONS: ask again), else the epoch is bumped; conditional (a claim): bumped
  only from exactly the given producer id and epoch, the current epoch answered unbumped for the
  epoch before it (a retry), PRODUCER_FENCED otherwise, and an Ongoing transaction of the given
  producer id is aborted whatever the epoch (CONCURRENT_TRANSACTIONS), as Kafka 4.1 does.
- **EndTxn** under an exact producer id and epoch: commit or abort an Ongoing transaction (its
  markers written at once: no PrepareCommit/PrepareAbort window), a repeat of the same outcome is
  NONE, the other outcome INVALID_TXN_STATE, on an id with no transaction INVALID_TXN_STATE;
  another producer id INVALID_PRODUCER_ID_MAPPING, an older epoch PRODUCER_FENCED.
- **DescribeTransactions**, **ListTransactions**, **DescribeProducers**, **Produce** (with
  AddPartitionsToTxn: the first record of a partition opens the transaction; a fenced epoch is
  refused with PRODUCER_FENCED, which the producer reports as a fatal error), a
  ``read_committed`` view (below the last stable offset, aborted records and markers skipped),
  the uncommitted batch at an offset (``TxnClient.batch_at``) and a transaction's marker, topic ids.

Not modelled: time (the transaction timeout runs only when :meth:`ModelBroker.expire` says so: the
explorer calls it once every actor and the final owner are done), the PrepareCommit/PrepareAbort window (markers are written at
once, so CONCURRENT_TRANSACTIONS follows only a fencing InitProducerId), coordinator moves,
retriable network errors, lost answers, several brokers, retention, compaction, topic deletion
(:meth:`ModelBroker.recreate_topic` exists for tests), transactions v2 (KIP-890), sequence numbers
and idempotence, keys' partitioner (a record without a partition goes to partition 0).
"""

from __future__ import annotations

import builtins
import contextlib
import itertools
import logging
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from twophase.sinks.kafka import protocol as kp

__all__ = ["ModelBroker", "ModelConfluent", "ModelTxnClient", "patched", "register"]

#: bootstrap servers -> the broker a sink with them talks to (inside :func:`patched`).
_BROKERS: dict[str, ModelBroker] = {}
_PRODUCER_ID_BASE = 1000


@dataclass
class Batch:
    """One record batch of a partition's log: data (``records``) or a control batch (``marker``)."""

    base: int
    producer_id: int
    epoch: int
    records: list[tuple[bytes | None, bytes | None]] = field(default_factory=list)
    marker: str | None = None  # "commit" | "abort" for a control batch
    txn: int | None = None      # the transaction (serial) a data batch belongs to

    @property
    def last(self) -> int:
        return self.base + max(1, len(self.records)) - 1


@dataclass
class Partition:
    batches: list[Batch] = field(default_factory=list)
    end: int = 0  # the high watermark: the next offset

    def batch_holding(self, offset: int) -> Batch | None:
        for b in self.batches:
            if b.base <= offset <= b.last:
                return b
        return None


@dataclass
class Topic:
    name: str
    topic_id: str
    partitions: list[Partition]


@dataclass
class Txn:
    """One transaction: a producer id and epoch's writes between AddPartitionsToTxn and EndTxn."""

    serial: int
    producer_id: int
    epoch: int
    start_ms: int
    partitions: dict[str, int] = field(default_factory=dict)  # "topic:p" -> first offset
    outcome: str | None = None  # "commit" | "abort"
    ended_by: str | None = None  # "end_txn" | "init_producer_id" (a fencing bump) | "timeout"


@dataclass
class TxnId:
    """A transactional id's state on its coordinator."""

    tid: str
    producer_id: int
    epoch: int
    timeout_ms: int
    state: str = "Empty"  # Empty | Ongoing | CompleteCommit | CompleteAbort
    txn: Txn | None = None  # the open (Ongoing) or last transaction


class ModelBroker:
    """A Kafka cluster's transaction coordinator and topic logs, in memory (one of them; see the
    module's docstring for what it answers).  Not thread-safe by itself: the explorer runs one actor
    at a time (a lock keeps direct callers from interleaving inside a request)."""

    def __init__(self, topics: dict[str, int] | None = None, *, name: str = "model") -> None:
        self.name = name
        self.topics: dict[str, Topic] = {}
        self.ids: dict[str, TxnId] = {}
        self.txns: list[Txn] = []          # every transaction ever begun, in order
        self._pids = itertools.count(_PRODUCER_ID_BASE)
        self._topic_serial = itertools.count(1)
        self._lock = threading.RLock()
        #: Called before every request (the explorer's scheduling point) and after it (a trace line:
        #: ``after(op, key, text)``, the text a callable: formatted only if shown).
        self.before: Callable[[], None] = lambda: None
        self.after: Callable[[str, str, Callable[[], str]], None] = lambda op, key, text: None
        for name_, n in (topics or {}).items():
            self.create_topic(name_, n)

    # ------------------------------------------------------------ admin (no request: setup)
    def create_topic(self, name: str, partitions: int) -> Topic:
        t = Topic(name, f"{self.name}-topic-{next(self._topic_serial):04d}", [Partition() for _ in range(partitions)])
        self.topics[name] = t
        return t

    def expire(self) -> list[Txn]:
        """Time passes: the transaction timeout aborts every open transaction (as the coordinator's
        abort sweep does, under a bumped epoch).  Returns them."""
        out = []
        with self._lock:
            for st in self.ids.values():
                if st.state == "Ongoing" and st.txn is not None:
                    out.append(st.txn)
                    st.epoch += 1
                    self._end(st, "abort", st.epoch, by="timeout")
        return out

    def recreate_topic(self, name: str) -> Topic:
        """Delete ``name`` and create it again (a new topic id, offsets from 0)."""
        return self.create_topic(name, len(self.topics[name].partitions))

    # ------------------------------------------------------------ one request
    def request(self, op: str, key: str, fn: Callable[[], Any], show: Callable[[Any], str] = repr) -> Any:
        """Run one broker request: the scheduling point, the change, the trace line."""
        self.before()
        with self._lock:
            out = fn()
        self.after(op, key, lambda: show(out))
        return out

    # ------------------------------------------------------------ helpers
    def _partition(self, name: str) -> Partition | None:
        topic, _, part = name.rpartition(":")
        t = self.topics.get(topic)
        if t is None or not part.isdigit() or int(part) >= len(t.partitions):
            return None
        return t.partitions[int(part)]

    def _end(self, st: TxnId, outcome: str, epoch: int, by: str = "end_txn") -> None:
        """Write the markers of ``st``'s open transaction (``outcome``, under ``epoch``) and close it."""
        txn = st.txn
        assert txn is not None and st.state == "Ongoing"
        for name in txn.partitions:
            p = self._partition(name)
            if p is not None:
                p.batches.append(Batch(p.end, st.producer_id, epoch, marker=outcome))
                p.end += 1
        txn.outcome, txn.ended_by = outcome, by
        st.state = "CompleteCommit" if outcome == "commit" else "CompleteAbort"

    # ------------------------------------------------------------ transaction coordinator
    def init_producer_id(self, tid: str, timeout_ms: int, producer_id: int = -1,
                         epoch: int = -1) -> tuple[int, int, int]:
        st = self.ids.get(tid)
        if st is None:  # a new id: any expectation is accepted
            st = self.ids[tid] = TxnId(tid, next(self._pids), 0, int(timeout_ms))
            return kp.NONE, st.producer_id, st.epoch
        conditional = producer_id >= 0
        if conditional and producer_id != st.producer_id:
            return kp.PRODUCER_FENCED, -1, -1
        if st.state == "Ongoing":
            # Fenced: the open transaction is aborted under a bumped epoch; the client asks again.
            st.epoch += 1
            self._end(st, "abort", st.epoch, by="init_producer_id")
            return kp.CONCURRENT_TRANSACTIONS, -1, -1
        if conditional and epoch != st.epoch:
            if epoch == st.epoch - 1:  # a retry of the claim that bumped it
                return kp.NONE, st.producer_id, st.epoch
            return kp.PRODUCER_FENCED, -1, -1
        st.epoch += 1
        st.timeout_ms = int(timeout_ms)
        st.state, st.txn = "Empty", None  # (the real broker too: Empty, no start time)
        return kp.NONE, st.producer_id, st.epoch

    def end_txn(self, tid: str, producer_id: int, epoch: int, commit: bool) -> int:
        st = self.ids.get(tid)
        if st is None or producer_id != st.producer_id:
            return kp.INVALID_PRODUCER_ID_MAPPING
        if epoch < st.epoch:
            return kp.PRODUCER_FENCED
        if epoch > st.epoch:
            return kp.INVALID_PRODUCER_EPOCH
        want = "commit" if commit else "abort"
        if st.state == "Ongoing":
            self._end(st, want, st.epoch)
            return kp.NONE
        if st.state == ("CompleteCommit" if commit else "CompleteAbort"):
            return kp.NONE  # a repeat of the same end
        return kp.INVALID_TXN_STATE

    def describe_transactions(self, tids: list[str]) -> dict[str, kp.TxnDescription]:
        out = {}
        for tid in tids:
            st = self.ids.get(tid)
            if st is None:
                out[tid] = kp.TxnDescription(tid, kp.TRANSACTIONAL_ID_NOT_FOUND, "", -1, -1, -1, -1, ())
                continue
            ongoing = st.state == "Ongoing" and st.txn is not None
            out[tid] = kp.TxnDescription(
                tid, kp.NONE, st.state, st.producer_id, st.epoch, st.timeout_ms,
                st.txn.start_ms if st.txn is not None else -1,  # a completed one keeps its start
                tuple(sorted(st.txn.partitions)) if ongoing and st.txn is not None else ())
        return out

    def list_transactions(self, states: list[str] | None = None) -> list[tuple[str, int, str]]:
        """ListTransactions: (transactional id, producer id, state), ``states`` filtering."""
        return sorted((st.tid, st.producer_id, st.state) for st in self.ids.values()
                      if not states or st.state in states)

    # ------------------------------------------------------------ producing
    def produce(self, tid: str, producer_id: int, epoch: int, topic: str, partition: int,
                records: list[tuple[bytes | None, bytes | None]]) -> tuple[int, int]:
        """AddPartitionsToTxn and Produce of one batch in the transaction of ``tid``: (error, base
        offset).  The first record of the transaction opens it (Ongoing)."""
        st = self.ids.get(tid)
        if st is None or st.producer_id != producer_id:
            return kp.INVALID_PRODUCER_ID_MAPPING, -1
        if epoch != st.epoch:
            return kp.PRODUCER_FENCED, -1
        t = self.topics.get(topic)
        if t is None or not 0 <= partition < len(t.partitions):
            return kp.UNKNOWN_TOPIC_OR_PARTITION, -1
        if st.state != "Ongoing":
            st.txn = Txn(len(self.txns), producer_id, epoch, int(time.time() * 1000))
            self.txns.append(st.txn)
            st.state = "Ongoing"
        assert st.txn is not None
        p = t.partitions[partition]
        name = f"{topic}:{partition}"
        base = p.end
        p.batches.append(Batch(base, producer_id, epoch, list(records), txn=st.txn.serial))
        p.end += max(1, len(records))
        st.txn.partitions.setdefault(name, base)
        return kp.NONE, base

    # ------------------------------------------------------------ reading
    def open_txn_start(self, name: str) -> int | None:
        """The first offset of the oldest open transaction on ``name`` (what holds its LSO)."""
        starts = [st.txn.partitions[name] for st in self.ids.values()
                  if st.state == "Ongoing" and st.txn is not None and name in st.txn.partitions]
        return min(starts) if starts else None

    def watermarks(self, name: str, read_committed: bool) -> tuple[int, int]:
        """(log start, high watermark), or the last stable offset for a read_committed reader."""
        p = self._partition(name)
        if p is None:
            raise KeyError(name)
        if not read_committed:
            return 0, p.end
        start = self.open_txn_start(name)
        return 0, p.end if start is None else start

    def committed_records(self, name: str, offset: int = 0) -> list[tuple[int, bytes | None]]:
        """What a read_committed reader gets from ``offset``: (offset, value), below the LSO."""
        p = self._partition(name)
        if p is None:
            return []
        _, lso = self.watermarks(name, True)
        out = []
        for b in p.batches:
            if b.marker is not None or b.base >= lso or b.last < offset:
                continue
            if b.txn is not None and self.txns[b.txn].outcome != "commit":
                continue  # aborted (or, below the LSO, impossible: open)
            out += [(b.base + i, v) for i, (_, v) in enumerate(b.records) if b.base + i >= offset]
        return out

    def batch_at(self, name: str, offset: int) -> tuple[str, Any]:
        p = self._partition(name)
        if p is None:
            return "no-topic", None
        if offset > p.end:  # Fetch past the high watermark: OFFSET_OUT_OF_RANGE
            return "out-of-range", None
        if offset == p.end:
            return "beyond", p.end
        b = p.batch_holding(offset)
        if b is None:
            nxt = min((x.base for x in p.batches if x.base > offset), default=p.end)
            return "missing", nxt
        return "batch", (b.producer_id, b.epoch, b.marker is not None)

    def transaction_marker(self, name: str, first_offset: int, producer_id: int) -> str | None:
        p = self._partition(name)
        if p is None:
            return None
        b = p.batch_holding(first_offset)
        if b is None or b.marker is not None or b.producer_id != producer_id:
            return None
        for later in p.batches:
            if later.base > b.last and later.producer_id == producer_id and later.marker is not None:
                return later.marker
        return None

    def describe_producers(self, names: list[str]) -> dict[str, list[kp.ProducerEntry]]:
        out: dict[str, list[kp.ProducerEntry]] = {}
        for name in dict.fromkeys(names):
            p = self._partition(name)
            if p is None:
                continue
            last: dict[int, int] = {}
            for b in p.batches:
                if b.marker is None:
                    last[b.producer_id] = max(b.epoch, last.get(b.producer_id, -1))
            open_at = {st.producer_id: st.txn.partitions[name] for st in self.ids.values()
                       if st.state == "Ongoing" and st.txn is not None and name in st.txn.partitions}
            out[name] = [kp.ProducerEntry(pid, ep, open_at.get(pid, -1)) for pid, ep in sorted(last.items())]
        return out

    def topic_ids(self, topics: list[str]) -> dict[str, str]:
        return {t: self.topics[t].topic_id for t in topics if t in self.topics}


def register(bootstrap: str, broker: ModelBroker) -> None:
    """Make sinks with ``bootstrap_servers=bootstrap`` talk to ``broker`` (inside :func:`patched`)."""
    _BROKERS[bootstrap] = broker


def unregister(bootstrap: str, broker: ModelBroker | None = None) -> None:
    if broker is None or _BROKERS.get(bootstrap) is broker:
        _BROKERS.pop(bootstrap, None)


def _broker(bootstrap: str) -> ModelBroker:
    try:
        return _BROKERS[bootstrap]
    except KeyError:
        raise ConnectionError(f"no model broker registered as {bootstrap!r}") from None


def _bootstrap(config: dict[str, Any]) -> str:
    bs = config.get("bootstrap_servers", config.get("bootstrap.servers"))
    return str(bs)


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


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """Inside it, :class:`twophase.sinks.kafka.KafkaSink` talks to the model brokers registered
    under its bootstrap servers (:func:`register`): its ``confluent_kafka`` and its ``TxnClient``
    are the model's; the executors' client cache and topic checks are fresh, restored after."""
    from twophase.sinks.kafka import claims, committer, common, sink, writer

    model = ModelConfluent()
    # ``require`` is looked up in the module of the code that calls it: every module of the sink that does.
    new: list[tuple[Any, str, Any]] = [*((mod, "require", model.require) for mod in (common, sink, committer, claims, writer)),
                                       (kp, "TxnClient", ModelTxnClient),
                                       (common, "_TASK_CLIENTS", {}), (writer, "_TOPICS_SEEN", {})]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in new]
    for obj, attr, value in new:
        setattr(obj, attr, value)
    try:
        yield
    finally:
        for obj, attr, value in reversed(saved):
            setattr(obj, attr, value)
