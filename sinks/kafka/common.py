"""Both sides of :class:`~twophase.sinks.kafka.KafkaSink` (the driver and the executor tasks): what
the driver's plans, commits and cleanup and the tasks' claims and producers share.

The loggers, the pool's version and the states a claim can take an id in, the executors' client
cache, the librdkafka log handler, :class:`KafkaTransaction` (a task's open transaction), and
:class:`_KafkaSinkBase`, the base of every part of ``KafkaSink``: its settings (set by
``KafkaSink.__init__``, ``sink.py``) and the helpers both sides call (each one's docstring says
which): the resolved producer settings, the driver's and the executors' transaction clients, the
admin client, DescribeTransactions with retries, EndTxn(abort) under an exact producer id and
epoch, the producer id and epoch librdkafka acquired, and a producer's release.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from twophase._deps import require
from twophase.config import resolve_secret
from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, MissingDependencyError, TwoPhaseError

log = logging.getLogger("twophase.sinks.kafka")
_rdlog = logging.getLogger("twophase.sinks.kafka.librdkafka")

#: ``intent["pool"]["version"]`` of INTENTs planned with slots and the plan fence.  INTENTs without
#: "pool" were written by earlier versions (ids ``{prefix}-{partition}``); they are still cleaned up.
POOL_VERSION = 2
#: The "version" of an INTENT whose ballot has ids of its own (pool.py, plan_batch_job): an earlier
#: version's task would claim them by the pool's rules, so it refuses them.
OWN_IDS_VERSION = 3
#: KafkaSink(transactional_ids=...): whose ballots get ids of their own (pool.py, plan_batch_job).
TRANSACTIONAL_IDS = ("auto", "pool", "per-plan")
#: States of a transactional id in which a claim can take it (no transaction open or closing).
_CLAIMABLE = frozenset({"Empty", "CompleteCommit", "CompleteAbort"})
# The executors' transaction clients (claims, DescribeProducers), one per sink setting and Python
# worker: a worker runs task after task, and a client costs a bootstrap (metadata, API versions).
_TASK_CLIENTS: dict[str, Any] = {}
_TASK_CLIENTS_LOCK = threading.Lock()

_ACQUIRED = re.compile(r"Acquired PID\{Id:(\d+),Epoch:(\d+)\}")


class _LibrdkafkaLog(logging.Handler):
    """Receives one producer's librdkafka log lines: keeps 'Acquired PID' and forwards warnings."""

    def __init__(self, label: str):
        super().__init__(logging.DEBUG)
        self.label = label
        self.pid_epoch: tuple[int, int] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "Acquired PID" in msg:
            m = _ACQUIRED.search(msg)
            if m:
                self.pid_epoch = (int(m.group(1)), int(m.group(2)))
        elif record.levelno >= logging.WARNING:
            _rdlog.log(record.levelno, "%s: %s", self.label, msg)


@dataclass
class KafkaTransaction:
    """One partition's Kafka transaction for one batch (executor side)."""

    ctx: TransactionContext
    transactional_id: str
    producer: Any
    logs: _LibrdkafkaLog
    started_at: float
    rows: int = 0
    delivery_errors: list[str] = field(default_factory=list)
    error_count: int = 0
    fatal: list[str] = field(default_factory=list)
    topics: set[str] = field(default_factory=set)
    eos_stats: dict[str, Any] = field(default_factory=dict)
    checked_topics: set[str] = field(default_factory=set)
    done: bool = False
    #: (producer id, epoch) the claim gave this attempt's id; librdkafka's producer holds epoch + 1.
    claimed: tuple[int, int] | None = None


class _KafkaSinkBase:
    """The settings of :class:`~twophase.sinks.kafka.KafkaSink` (set by its ``__init__``) and the
    helpers of both sides (driver and executor tasks), for every part of the sink (``pool.py``,
    ``committer.py``, ``claims.py``, ``writer.py``)."""

    bootstrap_servers: str
    topic: str | None
    transactional_id_prefix: str
    producer_config: dict[str, Any]
    transaction_timeout_ms: int
    tombstones: bool
    auto_create_topics: bool
    flush_timeout_s: float
    request_timeout_s: float
    warn_age_fraction: float
    commit_margin_ms: int
    slots_per_partition: int
    transactional_ids: str
    _client: Any
    _client_lock: threading.Lock
    _chain: dict[str, Any] | None
    _fence_closes: dict[tuple[int, int], list[int]]

    def _resolved_config(self) -> dict[str, Any]:
        conf = {k: resolve_secret(v, f"Kafka producer setting {k!r}") for k, v in self.producer_config.items()}
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    def _txn_client(self):
        """The cached driver-side transaction client (FindCoordinator/EndTxn/InitProducerId)."""
        from twophase.sinks.kafka import protocol as kp

        with self._client_lock:
            if self._client is None or self._client.closed:
                try:
                    cfg = kp.kafka_python_config(self._resolved_config())
                except ValueError as e:
                    raise ConfigurationError(str(e)) from None
                try:
                    self._client = kp.TxnClient(cfg, request_timeout_ms=int(self.request_timeout_s * 1000))
                except MissingDependencyError:  # e.g. a kafka-python line it was not built for
                    raise
                except Exception as e:
                    raise TwoPhaseError(
                        f"cannot connect to Kafka at {self.bootstrap_servers} to commit or fence "
                        f"transactions: {type(e).__name__}: {e}") from None
            return self._client

    def _admin(self):
        ck = require("confluent_kafka.admin", "KafkaSink")
        conf = self._resolved_config()
        conf.setdefault("socket.timeout.ms", int(self.request_timeout_s * 1000))
        return ck.AdminClient(conf)

    def _task_client(self):
        """The executor's transaction client for this sink's settings (one per Python worker)."""
        from twophase.sinks.kafka import protocol as kp

        key = json.dumps([self.bootstrap_servers, self.producer_config, self.request_timeout_s],
                         sort_keys=True, default=str)
        with _TASK_CLIENTS_LOCK:
            client = _TASK_CLIENTS.get(key)
            if client is None or client.closed:
                try:
                    cfg = kp.kafka_python_config(self._resolved_config())
                except ValueError as e:
                    raise ConfigurationError(str(e)) from None
                try:
                    client = kp.TxnClient(cfg, request_timeout_ms=int(self.request_timeout_s * 1000))
                except MissingDependencyError:
                    raise
                except Exception as e:
                    raise TwoPhaseError(
                        f"cannot connect to Kafka at {self.bootstrap_servers} to claim a transactional "
                        f"id: {type(e).__name__}: {e}") from None
                _TASK_CLIENTS[key] = client
            return client

    def _describe(self, client, tids: list[str]) -> dict[str, Any]:
        """DescribeTransactions for ``tids``, asking again (within ``request_timeout_s``) for ids
        whose coordinator did not answer or answered a retriable error.  Ids still without an
        answer are missing; the last retriable answer is kept."""
        from twophase.sinks.kafka import protocol as kp

        moved = kp.COORDINATOR_MOVED | {kp.COORDINATOR_LOAD_IN_PROGRESS}
        deadline = time.monotonic() + self.request_timeout_s
        out: dict[str, Any] = {}
        todo, delay = list(dict.fromkeys(tids)), 0.05
        while True:
            got = client.describe_transactions(todo)
            retry = []
            for t in todo:
                d = got.get(t)
                if d is not None:
                    out[t] = d
                if d is None or d.error_code in kp.RETRIABLE:
                    if d is not None and d.error_code in moved:
                        client.forget_coordinator(t)
                    retry.append(t)
            if not retry or time.monotonic() > deadline:
                return out
            todo = retry
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _abort_open(self, client, tid: str, pid: int, epoch: int, label: str, wait: bool = True) -> bool:
        """EndTxn(abort) under exactly (pid, epoch): True if this aborted it.

        The broker refuses (PRODUCER_FENCED, INVALID_PRODUCER_EPOCH) when the id moved on, and
        INVALID_TXN_STATE when it is no longer open: then it is not ours to abort any more.
        ``wait=False`` asks once (an executor's help with a leftover; the cleanup does the rest).
        """
        from twophase.sinks.kafka import protocol as kp

        deadline = time.monotonic() + max(60.0, 2 * self.request_timeout_s)
        delay = 0.02
        while True:
            code = client.end_txn(tid, pid, epoch, commit=False)
            if code == kp.NONE:
                log.info("%s: aborted the open transaction of %s (producer id %d, epoch %d)", label, tid, pid,
                         epoch)
                return True
            if code in (kp.PRODUCER_FENCED, kp.INVALID_PRODUCER_EPOCH, kp.INVALID_TXN_STATE,
                        kp.INVALID_PRODUCER_ID_MAPPING):
                return False
            if not wait:
                return False
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                raise TwoPhaseError(
                    f"{label}: cannot abort the open transaction of {tid} (producer id {pid}, epoch "
                    f"{epoch}): {kp.error_name(code)}. Check the broker and the ACLs for transactional ids "
                    "with this prefix, then restart the query.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    @staticmethod
    def _producer_id_epoch(txn: KafkaTransaction, wait_s: float = 10.0) -> tuple[int, int] | None:
        """The producer id and epoch librdkafka acquired: its 'Acquired PID' debug line (served by a
        poll), else its statistics (about once a second)."""
        txn.producer.poll(0)
        if txn.logs.pid_epoch is not None:
            return txn.logs.pid_epoch
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if txn.logs.pid_epoch is not None:
                return txn.logs.pid_epoch
            eos = txn.eos_stats
            if eos.get("producer_id", -1) >= 0 and eos.get("idemp_state") == "Assigned":
                return int(eos["producer_id"]), int(eos["producer_epoch"])
            txn.producer.poll(0.05)
        return None

    @staticmethod
    def _release(txn: KafkaTransaction) -> None:
        """Destroy the transaction's producer without ending its transaction (executor).

        Dropping the last reference to a confluent-kafka ``Producer`` runs
        ``rd_kafka_destroy``: its threads and sockets go, and an open transaction stays
        open on the broker (checked against Kafka 4.1 with confluent-kafka 2.16.1,
        tests/test_kafka_release.py), so the driver can still commit it with EndTxn.
        ``Producer.close()`` is never used: it aborts the open transaction.  The
        delivery and statistics callbacks hold the transaction object, which holds the
        producer: clearing ``txn.producer`` breaks that cycle, so the producer goes now
        rather than at some later garbage collection.
        """
        producer, txn.producer = txn.producer, None
        del producer  # the last reference: rd_kafka_destroy runs here
