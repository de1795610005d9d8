"""Driver-side Kafka transaction protocol for KafkaSink: FindCoordinator, EndTxn, InitProducerId,
DescribeTransactions, sent with kafka-python's connection manager (which brings SSL and SASL).

Nothing here runs on executors.  The client is the only place that touches
kafka-python internals (``KafkaAdminClient._manager``), so a kafka-python upgrade
that moves them breaks one small module.  Answers are returned as Kafka error
codes; :mod:`twophase.sinks.kafka` decides what they mean for a batch.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from twophase._deps import require

log = logging.getLogger("twophase.sinks.kafka")

TRANSACTION_KEY_TYPE = 1  # FindCoordinator key_type for transactional ids

# Kafka protocol error codes (org.apache.kafka.common.protocol.Errors) that matter here.
NONE = 0
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


# librdkafka (confluent-kafka) setting -> kafka-python setting.  Only connection and
# security settings matter to the driver; the rest configure the producer.
_KP_KEYS = {
    "bootstrap.servers": "bootstrap_servers",
    "client.id": "client_id",
    "security.protocol": "security_protocol",
    "sasl.mechanism": "sasl_mechanism",
    "sasl.mechanisms": "sasl_mechanism",
    "sasl.username": "sasl_plain_username",
    "sasl.password": "sasl_plain_password",
    "sasl.kerberos.service.name": "sasl_kerberos_service_name",
    "ssl.ca.location": "ssl_cafile",
    "ssl.certificate.location": "ssl_certfile",
    "ssl.key.location": "ssl_keyfile",
    "ssl.key.password": "ssl_password",
    "ssl.crl.location": "ssl_crlfile",
}
_KP_IGNORED_PREFIXES = ("ssl.", "sasl.")


def kafka_python_config(rdkafka_config: dict[str, Any]) -> dict[str, Any]:
    """Translate resolved librdkafka settings into kafka-python client settings (connection part).

    Security settings kafka-python has no equivalent for raise ValueError (naming the
    setting, never its value): committing with different security than the producers
    would fail later in a less clear way.
    """
    out: dict[str, Any] = {}
    for k, v in rdkafka_config.items():
        if k in _KP_KEYS:
            kp = _KP_KEYS[k]
            out[kp] = v.upper() if kp in ("security_protocol",) else v
        elif k == "ssl.endpoint.identification.algorithm":
            out["ssl_check_hostname"] = str(v).lower() not in ("none", "")
        elif k.startswith(_KP_IGNORED_PREFIXES) and k not in ("ssl.providers",):
            raise ValueError(f"the driver-side Kafka client cannot use the security setting {k!r}; "
                             "supported: " + ", ".join(sorted(_KP_KEYS)))
    return out


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
        self._errors = require("kafka.errors", "KafkaSink")
        self._timeout_ms = request_timeout_ms
        kp = dict(config)
        kp.setdefault("client_id", "twophase-kafka-sink")
        kp["request_timeout_ms"] = request_timeout_ms
        kp.setdefault("bootstrap_timeout_ms", request_timeout_ms)
        self._admin = admin_mod.KafkaAdminClient(**kp)
        self._manager = self._admin._manager
        self._lock = threading.Lock()
        self._coordinators: dict[str, Any] = {}
        self.closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self._admin.close()
            except Exception:  # pragma: no cover - best effort
                log.debug("closing the Kafka admin client failed", exc_info=True)

    # ------------------------------------------------------------ plumbing
    def _send(self, request: Any, node_id: Any = None) -> Any:
        return self._manager.run(self._manager.send, request, node_id, self._timeout_ms)

    def coordinator(self, tid: str) -> Any:
        """Node id of ``tid``'s transaction coordinator (FindCoordinator, cached)."""
        with self._lock:
            node = self._coordinators.get(tid)
        if node is not None:
            return node
        node = self._manager.run(self._admin._find_coordinator_id, tid, TRANSACTION_KEY_TYPE)
        with self._lock:
            self._coordinators[tid] = node
        return node

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
    def end_txn(self, tid: str, producer_id: int, producer_epoch: int, commit: bool) -> int:
        """EndTxn for a transaction that another process (a Spark task) opened; the error code."""
        from kafka.protocol.producer.transaction import EndTxnRequest

        # Version 4 at most: EndTxn v5 means transactions v2 (KIP-890), in which the
        # broker bumps the epoch on every commit and treats a v5 request as coming from
        # the producer that opened the transaction; ours comes from elsewhere.
        def make():
            return EndTxnRequest(transactional_id=tid, producer_id=int(producer_id),
                                 producer_epoch=int(producer_epoch), committed=bool(commit),
                                 max_version=4)

        code, _ = self._coordinator_request(tid, make)
        return code

    def init_producer_id(self, tid: str, transaction_timeout_ms: int) -> tuple[int, int, int]:
        """InitProducerId for ``tid``: aborts its open transaction and bumps its epoch (fencing).

        Returns (error code, producer id, epoch).  CONCURRENT_TRANSACTIONS means the
        abort is still being written: ask again.
        """
        from kafka.protocol.producer.transaction import InitProducerIdRequest

        def make():
            return InitProducerIdRequest(transactional_id=tid,
                                         transaction_timeout_ms=int(transaction_timeout_ms),
                                         producer_id=-1, producer_epoch=-1, max_version=4)

        code, resp = self._coordinator_request(tid, make)
        if resp is None:
            return code, -1, -1
        return code, int(resp.producer_id), int(resp.producer_epoch)

    def describe_transactions(self, tids: list[str]) -> dict[str, TxnDescription]:
        """DescribeTransactions for many ids (one request per coordinator).

        Ids whose coordinator cannot be reached are missing from the answer.
        """
        from kafka.protocol.admin.transactions import DescribeTransactionsRequest

        by_node: dict[Any, list[str]] = {}
        for tid in tids:
            try:
                by_node.setdefault(self.coordinator(tid), []).append(tid)
            except self._errors.KafkaError:
                self.forget_coordinator(tid)
        out: dict[str, TxnDescription] = {}
        for node, ids in by_node.items():
            try:
                resp = self._send(DescribeTransactionsRequest(transactional_ids=ids), node)
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
