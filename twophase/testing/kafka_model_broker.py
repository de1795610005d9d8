"""The broker of the Kafka model (:mod:`twophase.testing.kafka_model`, whose docstring lists what it
answers and what it does not model): the partitions' logs and the transactional ids' states
(:class:`Batch`, :class:`Partition`, :class:`Topic`, :class:`Txn`, :class:`TxnId`), the broker's
answer to every request (:class:`ModelBroker`), and the table of brokers by bootstrap servers that
the model's clients look theirs up in (:func:`register`, :func:`unregister`).  The clients:
:mod:`twophase.testing.kafka_model_clients`.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twophase.sinks.kafka import protocol as kp

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
    #: The epoch a conditional InitProducerId bumped from (a retry of it is answered unbumped); -1
    #: after any other bump, as Kafka's lastProducerEpoch (a conditional one from the epoch before
    #: an unconditional bump is PRODUCER_FENCED on the real broker: the third review).
    last_epoch: int = -1


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
            st.last_epoch = -1
            self._end(st, "abort", st.epoch, by="init_producer_id")
            return kp.CONCURRENT_TRANSACTIONS, -1, -1
        if conditional and epoch != st.epoch:
            if epoch == st.last_epoch:  # a retry of the conditional claim that bumped it
                return kp.NONE, st.producer_id, st.epoch
            return kp.PRODUCER_FENCED, -1, -1
        st.last_epoch = st.epoch if conditional else -1
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
