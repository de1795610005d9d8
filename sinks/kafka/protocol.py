"""Both sides (the driver and the executor tasks): the Kafka transaction protocol for KafkaSink:
FindCoordinator, EndTxn, InitProducerId (conditional or not), DescribeTransactions,
DescribeProducers, sent with kafka-python's connection manager (which brings SSL and SASL).

The driver commits, checks and cleans up with it; the executors claim a transactional id with it
before librdkafka's producer initialises the id (KafkaSink.begin_transaction), and read where their
transaction's records landed.  The client is the only place that touches
kafka-python internals (``KafkaAdminClient._manager``, ``_find_coordinator_id(s)``), so
a kafka-python upgrade that moves them breaks one small module (and
:func:`check_kafka_python_version` refuses versions it was not tested with).  Answers are
returned as Kafka error codes; :mod:`twophase.sinks.kafka` decides what they mean for a batch.

The translation of the sink's librdkafka settings into this client's (kafka-python's), OAUTHBEARER
token providers included, is :mod:`twophase.sinks.kafka.protocol_config`'s; its two functions are
also importable from here.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from twophase._deps import require

# Also importable from here (kp.kafka_python_config), as before they moved to protocol_config.py:
from twophase.sinks.kafka.protocol_config import kafka_python_config as kafka_python_config
from twophase.sinks.kafka.protocol_config import oauth_token_provider as oauth_token_provider

log = logging.getLogger("twophase.sinks.kafka")

TRANSACTION_KEY_TYPE = 1  # FindCoordinator key_type for transactional ids

#: kafka-python versions whose internals this module uses (``KafkaAdminClient._manager``,
#: ``_find_coordinator_id(s)``, ``cluster._coordinators``, the transaction request classes):
#: from (inclusive) .. to (exclusive).  Keep in step with pyproject.toml.
KAFKA_PYTHON_VERSIONS = ((3, 0, 12), (3, 1))

#: Highest EndTxn version the driver sends.  EndTxn v5 means transactions v2 (KIP-890): the
#: broker then bumps the epoch on every commit and treats the request as coming from the
#: producer that opened the transaction, so a v5 retry of a v4 commit answers
#: INVALID_TXN_STATE, which would be reported as data loss.  Ours come from elsewhere.
END_TXN_MAX_VERSION = 4

#: Requests kafka-python may pipeline on one connection.  Its default, 5, made the 6th of
#: the coordinator's concurrent commits fail at once ("Node paused: max_in_flight"), which
#: came back as NETWORK_EXCEPTION and a retry with a fresh coordinator lookup.
MAX_IN_FLIGHT = 32
#: Requests this client has outstanding at once (all connections): callers beyond it wait.
#: Below MAX_IN_FLIGHT, so kafka-python's own metadata requests always fit beside them.
CONCURRENT_REQUESTS = 16
#: How long a partition's leader, looked up for DescribeProducers, is used without asking again.
LEADER_CACHE_S = 60.0

# Kafka protocol error codes (org.apache.kafka.common.protocol.Errors) that matter here.
NONE = 0
OFFSET_OUT_OF_RANGE = 1
UNKNOWN_TOPIC_OR_PARTITION = 3
REQUEST_TIMED_OUT = 7
NETWORK_EXCEPTION = 13
COORDINATOR_LOAD_IN_PROGRESS = 14
COORDINATOR_NOT_AVAILABLE = 15
NOT_COORDINATOR = 16
INVALID_PRODUCER_EPOCH = 47
INVALID_TXN_STATE = 48
INVALID_PRODUCER_ID_MAPPING = 49
INVALID_TRANSACTION_TIMEOUT = 50
CONCURRENT_TRANSACTIONS = 51
TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
PRODUCER_FENCED = 90
TRANSACTIONAL_ID_NOT_FOUND = 105

#: The expected producer id of a claim on a transactional id the broker does not know yet.  The
#: broker creates the id with a new producer id and, since the id is new, accepts any expectation;
#: if the id exists (someone else created it first) the expectation cannot match its producer id
#: and the answer is PRODUCER_FENCED, with nothing changed, whatever the id's state (checked
#: against Kafka 4.1.2, tests/test_kafka_protocol.py).  Producer ids count up from 0.
UNUSED_PRODUCER_ID = 2**63 - 1

#: Answers after which asking again (after a fresh coordinator lookup) can succeed.
RETRIABLE = frozenset({REQUEST_TIMED_OUT, NETWORK_EXCEPTION, COORDINATOR_LOAD_IN_PROGRESS,
                       COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR, CONCURRENT_TRANSACTIONS})
#: Answers that mean the coordinator moved: forget the cached coordinator.
COORDINATOR_MOVED = frozenset({COORDINATOR_NOT_AVAILABLE, NOT_COORDINATOR, NETWORK_EXCEPTION,
                               REQUEST_TIMED_OUT})

ERROR_NAMES = {
    NONE: "NONE", REQUEST_TIMED_OUT: "REQUEST_TIMED_OUT", NETWORK_EXCEPTION: "NETWORK_EXCEPTION",
    COORDINATOR_LOAD_IN_PROGRESS: "COORDINATOR_LOAD_IN_PROGRESS",
    COORDINATOR_NOT_AVAILABLE: "COORDINATOR_NOT_AVAILABLE", NOT_COORDINATOR: "NOT_COORDINATOR",
    INVALID_PRODUCER_EPOCH: "INVALID_PRODUCER_EPOCH", INVALID_TXN_STATE: "INVALID_TXN_STATE",
    INVALID_PRODUCER_ID_MAPPING: "INVALID_PRODUCER_ID_MAPPING",
    INVALID_TRANSACTION_TIMEOUT: "INVALID_TRANSACTION_TIMEOUT",
    CONCURRENT_TRANSACTIONS: "CONCURRENT_TRANSACTIONS",
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED: "TRANSACTIONAL_ID_AUTHORIZATION_FAILED",
    PRODUCER_FENCED: "PRODUCER_FENCED", TRANSACTIONAL_ID_NOT_FOUND: "TRANSACTIONAL_ID_NOT_FOUND",
}


def error_name(code: int) -> str:
    if code in ERROR_NAMES:
        return ERROR_NAMES[code]
    try:
        errors = require("kafka.errors", "KafkaSink")
        return errors.for_code(code).__name__
    except Exception:  # pragma: no cover - unknown code and no kafka-python
        return f"error {code}"


def check_kafka_python_version(version: str) -> None:
    """Raise MissingDependencyError unless ``version`` is in :data:`KAFKA_PYTHON_VERSIONS`.

    Checked before the driver client is built: an upgrade that moved the internals used
    here would otherwise fail later, at a commit, with an AttributeError.
    """
    from twophase.errors import MissingDependencyError

    nums = []
    for part in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        nums.append(int(digits))
    low, high = KAFKA_PYTHON_VERSIONS
    if not low <= tuple(nums) < high:
        want = f"kafka-python>={'.'.join(map(str, low))},<{'.'.join(map(str, high))}"
        raise MissingDependencyError(
            f"KafkaSink's driver-side client needs {want} (it uses that line's internals to commit "
            f"and fence transactions); found kafka-python {version}. Run: pip install '{want}'")


class UnsupportedRequest(Exception):
    """The broker does not speak a request this client needs (DescribeTransactions: Kafka < 3.0)."""


def end_txn_request(tid: str, producer_id: int, producer_epoch: int, commit: bool) -> Any:
    """The EndTxn request the driver sends: capped at :data:`END_TXN_MAX_VERSION`."""
    from kafka.protocol.producer.transaction import EndTxnRequest

    return EndTxnRequest(transactional_id=tid, producer_id=int(producer_id),
                         producer_epoch=int(producer_epoch), committed=bool(commit),
                         max_version=END_TXN_MAX_VERSION)


@dataclass(frozen=True)
class ProducerEntry:
    """One producer's state on one topic partition (DescribeProducers, KIP-664)."""

    producer_id: int
    producer_epoch: int
    txn_start_offset: int  # the first offset of its open transaction on the partition, -1 if none


@dataclass(frozen=True)
class TxnDescription:
    """One transactional id as DescribeTransactions reports it (error_code 105 = unknown id)."""

    transactional_id: str
    error_code: int
    state: str
    producer_id: int
    producer_epoch: int
    timeout_ms: int
    start_time_ms: int
    partitions: tuple[str, ...]


class TxnClient:
    """A cached connection to a Kafka cluster for transaction-coordinator requests (driver only).

    Thread-safe: the coordinator commits handles from several threads at once.
    Requests that fail on the network come back as error code ``NETWORK_EXCEPTION``
    or ``REQUEST_TIMED_OUT`` rather than raising, so the caller classifies every answer.
    """

    def __init__(self, config: dict[str, Any], request_timeout_ms: int = 30000):
        admin_mod = require("kafka.admin", "KafkaSink")
        check_kafka_python_version(require("kafka", "KafkaSink").__version__)
        self._errors = require("kafka.errors", "KafkaSink")
        self._timeout_ms = request_timeout_ms
        kp = dict(config)
        kp.setdefault("client_id", "twophase-kafka-sink")
        kp["request_timeout_ms"] = request_timeout_ms
        kp["max_in_flight_requests_per_connection"] = MAX_IN_FLIGHT
        kp.setdefault("bootstrap_timeout_ms", request_timeout_ms)
        self._admin = admin_mod.KafkaAdminClient(**kp)
        self._manager = self._admin._manager
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(CONCURRENT_REQUESTS)
        self._coordinators: dict[str, Any] = {}
        self._leaders: dict[Any, tuple[Any, float]] = {}  # partition -> (leader, when looked up)
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._admin.close()
            except Exception:  # pragma: no cover - best effort
                log.debug("closing the Kafka admin client failed", exc_info=True)

    # ------------------------------------------------------------ plumbing
    def _run(self, fn: Any, *args: Any) -> Any:
        """Run a request coroutine on kafka-python's IO thread, CONCURRENT_REQUESTS at most."""
        with self._slots:
            return self._manager.run(fn, *args)

    def _send(self, request: Any, node_id: Any = None) -> Any:
        return self._run(self._manager.send, request, node_id, self._timeout_ms)

    def coordinator(self, tid: str) -> Any:
        """Node id of ``tid``'s transaction coordinator (FindCoordinator, cached)."""
        with self._lock:
            node = self._coordinators.get(tid)
        if node is not None:
            return node
        node = self._run(self._admin._find_coordinator_id, tid, TRANSACTION_KEY_TYPE)
        with self._lock:
            self._coordinators[tid] = node
        return node

    def coordinators(self, tids: list[str]) -> dict[str, Any]:
        """Node ids of many ids' coordinators: one batched FindCoordinator (KIP-699) for the ones
        not cached.  If the batch fails (one key's error fails it), each id is looked up alone;
        ids whose lookup still fails are missing."""
        out: dict[str, Any] = {}
        unknown: list[str] = []
        with self._lock:
            for tid in dict.fromkeys(tids):
                node = self._coordinators.get(tid)
                if node is None:
                    unknown.append(tid)
                else:
                    out[tid] = node
        if not unknown:
            return out
        try:
            found = dict(self._run(self._admin._find_coordinator_ids, unknown,
                                   TRANSACTION_KEY_TYPE))
        except (self._errors.KafkaError, OSError):
            found = {}
            for tid in unknown:
                try:
                    found[tid] = self.coordinator(tid)
                except (self._errors.KafkaError, OSError):
                    self.forget_coordinator(tid)
        found = {t: n for t, n in found.items() if n is not None}
        with self._lock:
            self._coordinators.update(found)
        out.update(found)
        return out

    def forget_coordinator(self, tid: str) -> None:
        """Drop the cached coordinator of ``tid`` (after NOT_COORDINATOR and friends)."""
        with self._lock:
            self._coordinators.pop(tid, None)
        try:
            self._manager.cluster._coordinators.pop((self._coordinator_type(), tid), None)
        except Exception:  # pragma: no cover - internals moved; a lookup still works
            pass

    @staticmethod
    def _coordinator_type() -> Any:
        md = require("kafka.protocol.metadata", "KafkaSink")
        return md.CoordinatorType.build_from(TRANSACTION_KEY_TYPE)

    def _code_of(self, exc: BaseException) -> int:
        errno = getattr(exc, "errno", None)
        if isinstance(errno, int) and errno > 0:
            return errno
        if isinstance(exc, self._errors.KafkaTimeoutError):
            return REQUEST_TIMED_OUT
        return NETWORK_EXCEPTION

    def _coordinator_request(self, tid: str, make_request) -> tuple[int, Any]:
        """Send a request to ``tid``'s coordinator; (error code, response or None)."""
        try:
            node = self.coordinator(tid)
            resp = self._send(make_request(), node)
        except self._errors.KafkaError as e:
            code = self._code_of(e)
            if code in COORDINATOR_MOVED or code == COORDINATOR_LOAD_IN_PROGRESS:
                self.forget_coordinator(tid)
            log.debug("request for transactional id %s failed: %s", tid, type(e).__name__)
            return code, None
        except OSError as e:
            self.forget_coordinator(tid)
            log.debug("request for transactional id %s failed: %s", tid, e)
            return NETWORK_EXCEPTION, None
        code = int(resp.error_code)
        if code in COORDINATOR_MOVED:
            self.forget_coordinator(tid)
        return code, resp

    # ------------------------------------------------------------ requests
    def negotiated_version(self, request: Any) -> int:
        """The version kafka-python would send ``request`` in to this cluster (bootstrapped)."""
        return int(self._manager.broker_version_data.api_version(request))

    def end_txn(self, tid: str, producer_id: int, producer_epoch: int, commit: bool) -> int:
        """EndTxn for a transaction that another process (a Spark task) opened; the error code.

        Sent as version :data:`END_TXN_MAX_VERSION` at most (see there).
        """
        code, _ = self._coordinator_request(
            tid, lambda: end_txn_request(tid, producer_id, producer_epoch, commit))
        return code

    def init_producer_id(self, tid: str, transaction_timeout_ms: int, producer_id: int = -1,
                         producer_epoch: int = -1) -> tuple[int, int, int]:
        """InitProducerId for ``tid``; returns (error code, producer id, epoch).

        Without ``producer_id``/``producer_epoch`` it is unconditional: the broker aborts the
        id's open transaction, if any, and bumps its epoch (fencing).  With them (version 3+,
        KIP-360) it is a claim: the broker bumps the epoch only if the id's current producer id
        and epoch are the ones given; if the given epoch is the one *before* the current one it
        answers the current epoch without bumping (it takes the request for a retry); otherwise
        PRODUCER_FENCED.  One exception, checked against Kafka 4.1.2: when the id has an
        *Ongoing* transaction, a matching producer id is enough, whatever the epoch: the broker
        aborts that transaction (then answers CONCURRENT_TRANSACTIONS, and PRODUCER_FENCED when
        asked again).  So a claim never goes to an id that may hold someone else's open
        transaction (see KafkaSink.begin_transaction).  CONCURRENT_TRANSACTIONS also means an
        abort is still being written: ask again.
        """
        from kafka.protocol.producer.transaction import InitProducerIdRequest

        def make():
            return InitProducerIdRequest(transactional_id=tid,
                                         transaction_timeout_ms=int(transaction_timeout_ms),
                                         producer_id=int(producer_id), producer_epoch=int(producer_epoch),
                                         max_version=4)

        code, resp = self._coordinator_request(tid, make)
        if resp is None:
            return code, -1, -1
        return code, int(resp.producer_id), int(resp.producer_epoch)

    def describe_transactions(self, tids: list[str]) -> dict[str, TxnDescription]:
        """DescribeTransactions for many ids (one request per coordinator).

        Ids whose coordinator cannot be reached are missing from the answer.  Raises
        :class:`UnsupportedRequest` when the broker does not speak DescribeTransactions
        (KIP-664, Kafka 3.0).
        """
        from kafka.protocol.admin.transactions import DescribeTransactionsRequest

        by_node: dict[Any, list[str]] = {}
        for tid, node in self.coordinators(tids).items():
            by_node.setdefault(node, []).append(tid)
        out: dict[str, TxnDescription] = {}
        for node, ids in by_node.items():
            try:
                resp = self._send(DescribeTransactionsRequest(transactional_ids=ids), node)
            except self._errors.IncompatibleBrokerVersion as e:
                raise UnsupportedRequest(f"DescribeTransactions: {e}") from None
            except (self._errors.KafkaError, OSError):
                for tid in ids:
                    self.forget_coordinator(tid)
                continue
            for st in resp.transaction_states:
                parts = tuple(f"{t.topic}:{p}" for t in (st.topics or []) for p in t.partitions)
                out[st.transactional_id] = TxnDescription(
                    st.transactional_id, int(st.error_code), st.transaction_state or "",
                    int(st.producer_id), int(st.producer_epoch), int(st.transaction_timeout_ms),
                    int(st.transaction_start_time_ms), parts)
        return out

    def transaction_marker(self, partition: str, first_offset: int, producer_id: int,
                           timeout_s: float = 120.0, max_bytes: int = 1 << 20) -> str | None:
        """How the transaction of ``producer_id`` whose first record on ``partition``
        (``"topic:partition"``) is at ``first_offset`` ended there: ``"commit"`` or ``"abort"``, read
        from its transaction marker (a control batch), or None when that cannot be told.

        Read uncommitted (Fetch, isolation level 0), so the partition's last stable offset, which
        any other open transaction holds back, does not matter.  The answer counts only when the
        fetch from ``first_offset`` starts with a data batch of ``producer_id`` holding that offset
        (the transaction's records are still there, so its marker is too: the log cleaner removes a
        marker only after every record of its transaction); the marker is then the first control
        batch of ``producer_id`` after it, since a producer runs one transaction at a time.  It reads
        up to the high watermark, however far that is (a big batch, a busy shared topic), for at
        most ``timeout_s``.  None: the record is gone (retention, compaction) or not the
        producer's, no marker up to the high watermark (still open), out of time, or the read failed.
        """
        from kafka import TopicPartition
        from kafka.protocol.consumer import FetchRequest
        from kafka.record import MemoryRecords

        topic, _, part = partition.rpartition(":")
        tp = TopicPartition(topic, int(part))
        leader = dict((t, node) for node, group in self._run(self._admin._async_get_leader_for_partitions, [tp]).items()
                      for t in group).get(tp)
        if leader is None:
            return None
        offset, seen_first = int(first_offset), False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            fp = FetchRequest.FetchTopic.FetchPartition(
                partition=tp.partition, current_leader_epoch=-1, fetch_offset=offset, last_fetched_epoch=-1,
                log_start_offset=-1, partition_max_bytes=max_bytes)
            req = FetchRequest(replica_id=-1, max_wait_ms=0, min_bytes=0, max_bytes=max_bytes, isolation_level=0,
                               session_id=0, session_epoch=-1,
                               topics=[FetchRequest.FetchTopic(topic=topic, partitions=[fp])],
                               forgotten_topics_data=[], rack_id="", max_version=12)
            resp = self._send(req, leader)
            data = resp.responses[0].partitions[0]
            if int(data.error_code) != NONE or not data.records:
                return None
            records = MemoryRecords(bytes(data.records))
            last = None
            while (batch := records.next_batch()) is not None:
                last = batch
                if batch.producer_id != producer_id:
                    if not seen_first:
                        return None  # the first record is not the producer's (compacted away?)
                    continue
                if not seen_first:
                    if batch.is_control_batch or not batch.base_offset <= first_offset <= batch.last_offset:
                        return None
                    seen_first = True
                    continue
                if batch.is_control_batch:
                    for rec in batch:
                        return "commit" if rec.type == 1 else "abort"
            if last is None or last.next_offset >= int(data.high_watermark):
                return None
            offset = last.next_offset
        return None

    def topic_ids(self, topics: list[str]) -> dict[str, str]:
        """The topic id (Kafka's topic UUID, KIP-516) of each topic that exists now, as a string: one
        Metadata request.  A topic the broker does not know, or a broker too old to name ids (the
        all-zero id), is missing from the answer.  Raises what kafka-python raises."""
        if not topics:
            return {}
        md = self._run(self._admin._get_cluster_metadata, list(dict.fromkeys(topics)))
        out: dict[str, str] = {}
        for t in md.get("topics", ()):
            tid, name = t.get("topic_id"), t.get("name")
            if int(t.get("error_code") or 0) != NONE or not name or tid is None:
                continue
            text = str(tid)
            if text.strip("0-") and text != "AAAAAAAAAAAAAAAAAAAAAA":
                out[str(name)] = text
        return out

    def batch_at(self, partition: str, offset: int, max_bytes: int = 1 << 16) -> tuple[str, Any]:
        """What the partition (``"topic:partition"``) holds at ``offset`` now, read uncommitted (Fetch,
        isolation level 0): the record batch of which transaction, or that there is none.

        ``("batch", (producer_id, producer_epoch, is_control))``: the batch holding ``offset``;
        ``("missing", first)``: no batch holds it (the first one from there starts at ``first``:
        removed by compaction, or not a record offset); ``("beyond", high_watermark)``: the partition
        ends before it (a shorter partition: the topic was recreated, or its log truncated);
        ``("no-topic", None)``: the broker does not know the topic partition; ``("out-of-range",
        None)``: before the partition's start (retention) or past its end (the caller, which read the
        partition's start, tells which).  Raises on other errors (the caller cannot tell).
        """
        from kafka import TopicPartition
        from kafka.protocol.consumer import FetchRequest
        from kafka.record import MemoryRecords

        topic, _, part = partition.rpartition(":")
        tp = TopicPartition(topic, int(part))
        try:
            leaders = self._run(self._admin._async_get_leader_for_partitions, [tp])
        except self._errors.UnknownTopicOrPartitionError:
            return "no-topic", None
        leader = dict((t, node) for node, group in leaders.items() for t in group).get(tp)
        if leader is None:
            raise RuntimeError(f"no leader for {partition}")
        fp = FetchRequest.FetchTopic.FetchPartition(
            partition=tp.partition, current_leader_epoch=-1, fetch_offset=int(offset), last_fetched_epoch=-1,
            log_start_offset=-1, partition_max_bytes=max_bytes)
        req = FetchRequest(replica_id=-1, max_wait_ms=0, min_bytes=0, max_bytes=max_bytes, isolation_level=0,
                           session_id=0, session_epoch=-1,
                           topics=[FetchRequest.FetchTopic(topic=topic, partitions=[fp])],
                           forgotten_topics_data=[], rack_id="", max_version=12)
        data = self._send(req, leader).responses[0].partitions[0]
        code = int(data.error_code)
        if code == UNKNOWN_TOPIC_OR_PARTITION:
            return "no-topic", None
        if code == OFFSET_OUT_OF_RANGE:  # the answer's offsets are not filled in then
            return "out-of-range", None
        if code != NONE:
            raise RuntimeError(f"Fetch of {partition} at {offset}: {error_name(code)}")
        if int(offset) >= int(data.high_watermark):
            return "beyond", int(data.high_watermark)
        if not data.records:
            raise RuntimeError(f"Fetch of {partition} at {offset}: no records below the high watermark")
        records = MemoryRecords(bytes(data.records))
        while (batch := records.next_batch()) is not None:
            if batch.last_offset < int(offset):
                continue
            if batch.base_offset > int(offset):
                return "missing", int(batch.base_offset)
            return "batch", (int(batch.producer_id), int(batch.producer_epoch), bool(batch.is_control_batch))
        raise RuntimeError(f"Fetch of {partition} at {offset}: no batch holds it in the answer")

    def describe_producers(self, partitions: list[str]) -> dict[str, list[ProducerEntry]]:
        """DescribeProducers for ``"topic:partition"`` names, asked of each partition's leader.

        Raises what kafka-python raises (unknown partitions, a leader that moved): callers treat
        the answer as an optional extra.
        """
        from kafka import TopicPartition

        tps = []
        for name in dict.fromkeys(partitions):
            topic, _, part = name.rpartition(":")
            tps.append(TopicPartition(topic, int(part)))
        if not tps:
            return {}
        found = self._describe_producers_at_leaders(tps)
        return {f"{tp.topic}:{tp.partition}": [
            ProducerEntry(int(p.producer_id), int(p.producer_epoch), int(p.current_transaction_start_offset))
            for p in state.active_producers] for tp, state in found.items()}

    def _describe_producers_at_leaders(self, tps: list[Any]) -> dict[Any, Any]:
        """DescribeProducers sent to each partition's leader, from leaders cached for
        :data:`LEADER_CACHE_S` (one metadata round trip saved per call: a task asks once per
        transaction).  A cached leader that moved answers an error: the leaders are then looked
        up again and the request sent once more."""
        now = time.monotonic()
        with self._lock:
            cached = {tp: e[0] for tp in tps if (e := self._leaders.get(tp)) is not None
                      and now - e[1] < LEADER_CACHE_S}
        if len(cached) == len(tps):
            try:
                return self._describe_producers_by_leader(cached)
            except (self._errors.KafkaError, OSError):
                pass  # looked up again below
        found = self._run(self._admin._async_get_leader_for_partitions, tps)
        leaders = {tp: node for node, group in found.items() for tp in group}
        with self._lock:
            self._leaders.update((tp, (node, now)) for tp, node in leaders.items())
        return self._describe_producers_by_leader(leaders)

    def _describe_producers_by_leader(self, leaders: dict[Any, Any]) -> dict[Any, Any]:
        """One DescribeProducers per leader, for ``{partition: leader}``."""
        by_leader: dict[Any, list[Any]] = {}
        for tp, node in leaders.items():
            by_leader.setdefault(node, []).append(tp)
        found: dict[Any, Any] = {}
        for node, group in by_leader.items():
            with self._slots:
                found.update(self._admin.describe_producers(group, broker_id=node))
        return found
