"""Exactly-once Kafka sink: one Kafka transaction per Spark partition and batch, committed by the driver.

Executors produce with confluent-kafka's transactional producer and pre-commit by
flushing with zero delivery errors; the handle is (transactional id, producer id,
epoch, topics, the first offset of the transaction on each topic partition).  The driver
commits with FindCoordinator + EndTxn under that id and epoch, from any process, after
any crash (what Flink does, through public protocol).

Transactional ids come from a bounded pool: ``{prefix}-{partition}.{slot}``, a few slots per
partition (``slots_per_partition``), plus one id that is never used for a transaction, the plan
fence ``{prefix}-plans``.  Every ``plan_batch`` (one execution, a *ballot*, of a batch) bumps the
fence's epoch and records it in the INTENT with the pool's open transactions at that moment.  A
task *claims* a slot of its partition before librdkafka initialises it: it checks
(DescribeTransactions) that the fence is still its ballot's, and that the slot has no open
transaction, then claims it with a conditional InitProducerId (only from the epoch it just saw), and
then librdkafka's unconditional InitProducerId must land exactly one epoch later.  So an attempt of
an older ballot or batch (a stage retry's duplicate, a zombie executor, an orphaned Spark Connect
run) is refused, and no attempt ever initialises an id that holds another one's open transaction:
InitProducerId aborts such a transaction, even a decided one, whatever epoch it expects (verified on
Kafka 4.1.2).  Cleanup is conditional too: ``abort_lingering`` aborts with EndTxn under the exact
producer id and epoch it described, and only what the INTENT's snapshot lists as open before the
ballot, or anything not kept while no newer ballot has been planned.  See docs/kafka.md, including
what is left (a claim sent from a stale look at an id: two attempts of one number racing, or one
that stalls between two of its own requests; caught before the decision, the batch runs again).

Delivery guarantee: with :class:`twophase.coordinator.Coordinator`, every row of
every batch appears exactly once to consumers with ``isolation.level=read_committed``
(read_uncommitted consumers also see records of aborted attempts).

Before the decision is logged, ``verify_prepared`` checks with DescribeTransactions that every
transaction is still open under its producer id and epoch with ``commit_margin_ms`` of its timeout
left; otherwise the batch fails while undecided.  Handles of a decided batch are committed again
with EndTxn (which answers success for a first and a repeated commit alike, so recovery asks
DescribeTransactions first to tell them apart).  When EndTxn says the id moved on (fenced, expired),
the handle's first offsets tell what happened: a record that ``read_committed`` readers see was
committed; one the last stable offset has passed without it was aborted, which can never be
committed: that is reported as data loss.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from twophase._deps import require
from twophase.config import is_secret_ref, resolve_secret
from twophase.context import TransactionContext
from twophase.errors import (
    ConfigurationError,
    MissingDependencyError,
    TransactionTakenError,
    TwoPhaseError,
)
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink

log = logging.getLogger("twophase.sinks.kafka")
_rdlog = logging.getLogger("twophase.sinks.kafka.librdkafka")

#: Default transaction timeout: 5 minutes, a third of the broker's default maximum
#: (``transaction.max.timeout.ms``, 15 min).  It bounds how long a dead driver that nobody
#: restarts holds back ``read_committed`` readers (the timeout plus the broker's abort sweep,
#: ``benchmarks/lso.py``), and no longer loses a decided batch (a batch whose transactions all
#: timed out is proven never visible and runs again).  A batch's prepare phase may take it minus
#: ``commit_margin_ms``.
DEFAULT_TRANSACTION_TIMEOUT_MS = 300_000
#: How long a Python worker trusts that a topic it checked exists (seconds).  The check only
#: gives a clear error before anything is written; a topic deleted meanwhile still fails the
#: batch, at the produce.
TOPIC_CHECK_TTL_S = 60.0
# (bootstrap servers, topic) -> time.monotonic() of the last successful check, per process.
_TOPICS_SEEN: dict[tuple[str, str], float] = {}

#: Transactional ids per partition in the pool (``KafkaSink(slots_per_partition=...)``): Spark's
#: default ``spark.task.maxFailures``, so each attempt of a task can take an id of its own.
DEFAULT_SLOTS_PER_PARTITION = 4
#: ``intent["pool"]["version"]`` of INTENTs planned with slots and the plan fence.  INTENTs without
#: "pool" were written by earlier versions (ids ``{prefix}-{partition}``); they are still cleaned up.
POOL_VERSION = 2
#: States of a transactional id in which a claim can take it (no transaction open or closing).
_CLAIMABLE = frozenset({"Empty", "CompleteCommit", "CompleteAbort"})
# The executors' transaction clients (claims, DescribeProducers), one per sink setting and Python
# worker: a worker runs task after task, and a client costs a bootstrap (metadata, API versions).
_TASK_CLIENTS: dict[str, Any] = {}
_TASK_CLIENTS_LOCK = threading.Lock()

#: Default part of the timeout kept for the commit and a driver restart (see ``commit_margin_ms``):
#: 5 minutes, or a third of ``transaction_timeout_ms`` when that is shorter than 15 minutes (100 s
#: with the default timeout).
DEFAULT_COMMIT_MARGIN_MS = 300_000

_PREFIX_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_ACQUIRED = re.compile(r"Acquired PID\{Id:(\d+),Epoch:(\d+)\}")
_SECRET_KEY = re.compile(r"(password|secret|token|sasl\.jaas|key\.pem|keystore\.key|private)", re.I)

# Producer settings the sink owns: changing them would break the guarantee or the handle.
_OWNED = {
    "transactional.id": "the sink assigns transactional ids from its pool (transactional_id_prefix=...)",
    "enable.idempotence": "transactions need the idempotent producer",
    "acks": "transactions need acks=all",
    "request.required.acks": "transactions need acks=all",
    "transaction.timeout.ms": "use KafkaSink(transaction_timeout_ms=...)",
    "debug": "the sink enables librdkafka's 'eos' debug context to read producer id and epoch",
    "logger": "the sink installs its own librdkafka logger",
    "stats_cb": "the sink reads librdkafka statistics itself",
    "statistics.interval.ms": "the sink reads librdkafka statistics itself",
    "on_delivery": "the sink counts delivery errors itself",
    "delivery.report.only.error": "the sink counts delivery reports itself",
    "error_cb": "the sink records producer errors itself",
    "isolation.level": "a consumer setting: consumers of this topic need isolation.level=read_committed",
}


#: Producer settings of Kafka's Java client (which Spark's Kafka sink runs) that librdkafka, this
#: sink's producers' client, does not know: librdkafka's setting of the same meaning, or why there
#: is none.  Refused naming the setting (librdkafka's own message would not say it is a Java one).
JAVA_ONLY: dict[str, str] = {
    "buffer.memory": "use {p}queue.buffering.max.kbytes (in KiB, not bytes)",
    "max.block.ms": "librdkafka has none: its produce() never blocks (a full queue fails at once, and the "
                    "sink waits for room itself)",
    "max.request.size": "use {p}message.max.bytes",
    "send.buffer.bytes": "use {p}socket.send.buffer.bytes",
    "receive.buffer.bytes": "use {p}socket.receive.buffer.bytes",
    "partitioner.class": "librdkafka takes no Java class; it has {p}partitioner (a built-in name), and the sink "
                         "already uses murmur2_random, the Java client's default placement of keys",
    "partitioner.ignore.keys": "librdkafka has none (its partitioner setting picks how keys are placed)",
    "partitioner.adaptive.partitioning.enable": "librdkafka has none",
    "partitioner.availability.timeout.ms": "librdkafka has none",
    "interceptor.classes": "librdkafka has none (Java classes)",
    "metric.reporters": "librdkafka has none (Java classes); it reports statistics, which the sink reads",
    "metrics.num.samples": "librdkafka has none",
    "metrics.recording.level": "librdkafka has none",
    "metrics.sample.window.ms": "librdkafka has none",
    "auto.include.jmx.reporter": "librdkafka has none (no JMX)",
    "security.providers": "librdkafka has none (Java security providers)",
    "sasl.login.class": "librdkafka has none (Java classes)",
    "sasl.login.callback.handler.class": "librdkafka has none (Java classes); for OAUTHBEARER it has "
                                         "{p}sasl.oauthbearer.method and {p}sasl.oauthbearer.*",
    "sasl.client.callback.handler.class": "librdkafka has none (Java classes)",
    "ssl.protocol": "librdkafka has none: it negotiates TLS with OpenSSL's defaults",
    "ssl.enabled.protocols": "librdkafka has none: it negotiates TLS with OpenSSL's defaults",
    "ssl.keymanager.algorithm": "librdkafka has none (OpenSSL, not Java's key managers)",
    "ssl.trustmanager.algorithm": "librdkafka has none (OpenSSL, not Java's trust managers)",
    "ssl.secure.random.implementation": "librdkafka has none",
    "ssl.engine.factory.class": "librdkafka has none (Java classes); it has {p}ssl.engine.location",
    "ssl.truststore.password": "librdkafka reads no truststore: give PEM CA certificates as {p}ssl.ca.location",
    "metadata.max.idle.ms": "librdkafka has none (it has {p}metadata.max.age.ms)",
    "socket.connection.setup.timeout.max.ms": "librdkafka has none (it has {p}socket.connection.setup.timeout.ms)",
}


def check_producer_settings(config: dict[str, Any], *, option_prefix: str = "") -> None:
    """Refuse, naming it (as ``option_prefix`` + name: ``kafka.`` for the data source's options), a
    producer setting librdkafka does not know: a Java client's one (:data:`JAVA_ONLY`, with
    librdkafka's equivalent where there is one) or another unknown name (librdkafka's own
    check, run on a client made for nothing but the check: it opens no connection)."""
    for k in config:
        if k in JAVA_ONLY:
            raise ConfigurationError(
                f"{option_prefix}{k} is a setting of Kafka's Java client (Spark's Kafka sink's); this sink's "
                f"producers are librdkafka's, which does not know it: {JAVA_ONLY[k].format(p=option_prefix)}")
    try:
        import confluent_kafka as ck
    except ImportError:  # the sink's open() says what to install
        return
    for k, v in config.items():
        try:
            ck.Producer({k: v if isinstance(v, (str, int, float, bool)) else "", "log_level": 0})
        except ck.KafkaException as e:
            err = e.args[0].str() if e.args and hasattr(e.args[0], "str") else str(e)
            if err.startswith("No such configuration property"):
                raise ConfigurationError(
                    f"{option_prefix}{k} is not a producer setting of librdkafka, the client of this sink's "
                    "producers (a setting of Kafka's Java client, which Spark's Kafka sink runs, may have "
                    "another name there: librdkafka's CONFIGURATION.md lists its settings)") from None
        except Exception:  # noqa: BLE001 - a value librdkafka refuses: the producer names it later
            continue


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


def _is_binaryish(t: pa.DataType) -> bool:
    return (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_null(t))


class KafkaSink(TwoPhaseCommitSink[KafkaTransaction, dict]):
    """Write rows shaped like Spark's Kafka sink exactly once to Kafka.

    Columns (as for ``df.write.format("kafka")``): ``value`` (binary or string,
    required), ``key`` (binary or string), ``topic`` (string; required unless
    ``topic=...`` is given, which overrides the column, as in Spark), ``partition``
    (int; null = the producer's partitioner), ``headers`` (array of struct
    ``key: string, value: binary``).

    ``transactional_id_prefix`` must be unique to this query and stable across its
    restarts: transactional ids are ``{prefix}-{partition}.{slot}``, reused batch after batch,
    ``slots_per_partition`` of them per partition (default 4, Spark's ``spark.task.maxFailures``:
    each attempt of a task claims a free one), plus ``{prefix}-plans``, which holds no
    transaction (its epoch marks the latest plan).  The pool stays bounded: partitions x slots + 1
    ids for the life of the query.
    ``producer_config`` passes through to confluent-kafka (librdkafka names, e.g.
    ``security.protocol``, ``sasl.username``, ``linger.ms``); secrets may be given
    as ``{"env": "VAR"}`` references and are never logged nor put in handles.
    ``transaction_timeout_ms`` must cover the whole prepare phase of a batch (every
    wave of tasks, from the first record of the first task) plus the commit and a
    driver restart, and may not exceed the broker's ``transaction.max.timeout.ms``
    (checked by :meth:`open`).  ``commit_margin_ms`` is the part of it kept for the
    commit and a driver restart: a batch whose oldest transaction has less than that
    left when its tasks are done fails before its decision is logged
    (:meth:`verify_prepared`); default 5 minutes, or a third of the timeout if shorter.
    ``tombstones=True`` writes null values as tombstones (as Spark's
    sink does); by default a null value fails the batch.  ``auto_create_topics``
    lets the broker create missing topics (if it is configured to); by default a
    missing topic fails before anything is written.
    """

    kind = "kafka"
    #: The settings check, for callers that name the settings otherwise (the data source: ``kafka.*``).
    check_producer_settings = staticmethod(check_producer_settings)
    supports_speculation = False

    def __init__(self, bootstrap_servers: str, topic: str | None = None,
                 transactional_id_prefix: str | None = None, *,
                 producer_config: dict[str, Any] | None = None,
                 transaction_timeout_ms: int = DEFAULT_TRANSACTION_TIMEOUT_MS,
                 tombstones: bool = False, auto_create_topics: bool = False,
                 flush_timeout_s: float = 300.0, request_timeout_s: float = 30.0,
                 warn_age_fraction: float = 0.5, commit_margin_ms: int | None = None,
                 slots_per_partition: int = DEFAULT_SLOTS_PER_PARTITION):
        if not bootstrap_servers or not isinstance(bootstrap_servers, str):
            raise ConfigurationError("KafkaSink needs bootstrap_servers='host:port[,host:port...]'")
        if not transactional_id_prefix or not _PREFIX_OK.match(transactional_id_prefix):
            raise ConfigurationError(
                f"KafkaSink needs transactional_id_prefix=... (letters, digits, '.', '_', '-'; unique to "
                f"this query and stable across its restarts), got {transactional_id_prefix!r}")
        if topic is not None and not topic:
            raise ConfigurationError("topic must be a topic name or None (then the 'topic' column is used)")
        producer_config = dict(producer_config or {})
        for k in producer_config:
            if k in _OWNED:
                raise ConfigurationError(f"KafkaSink does not accept producer setting {k!r}: {_OWNED[k]}")
        if "bootstrap.servers" in producer_config:
            raise ConfigurationError("give bootstrap_servers=... instead of producer_config['bootstrap.servers']")
        check_producer_settings(producer_config)
        if not (1000 <= int(transaction_timeout_ms) <= 2**31 - 1):
            raise ConfigurationError(f"transaction_timeout_ms must be >= 1000, got {transaction_timeout_ms}")
        if not 0 < warn_age_fraction < 1:
            raise ConfigurationError("warn_age_fraction must be between 0 and 1")
        if commit_margin_ms is None:
            commit_margin_ms = min(DEFAULT_COMMIT_MARGIN_MS, int(transaction_timeout_ms) // 3)
        if not 0 <= int(commit_margin_ms) < int(transaction_timeout_ms):
            raise ConfigurationError(
                f"commit_margin_ms must be at least 0 and less than transaction_timeout_ms="
                f"{int(transaction_timeout_ms)}, got {commit_margin_ms}")
        if not 1 <= int(slots_per_partition) <= 64:
            raise ConfigurationError(f"slots_per_partition must be between 1 and 64, got {slots_per_partition}")
        self.bootstrap_servers = bootstrap_servers
        self.topic = topic
        self.transactional_id_prefix = transactional_id_prefix
        self.producer_config = producer_config
        self.transaction_timeout_ms = int(transaction_timeout_ms)
        self.tombstones = bool(tombstones)
        self.auto_create_topics = bool(auto_create_topics)
        self.flush_timeout_s = float(flush_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self.warn_age_fraction = float(warn_age_fraction)
        self.commit_margin_ms = int(commit_margin_ms)
        self.slots_per_partition = int(slots_per_partition)
        self._client: Any = None
        self._client_lock = threading.Lock()
        #: The latest plan this object made, or whose closed ballot it cleaned up: {"fence":
        #: [producer id, epoch] of the plan fence, "held": the open transactions that plan could
        #: not attribute}.  See plan_batch.
        self._chain: dict[str, Any] | None = None
        #: (producer id, epoch) of a plan -> [producer id, epoch] this object's cleanup closed it with.
        self._fence_closes: dict[tuple[int, int], list[int]] = {}

    def __repr__(self) -> str:  # never the producer config: it may hold secrets
        return (f"KafkaSink(bootstrap_servers={self.bootstrap_servers!r}, topic={self.topic!r}, "
                f"transactional_id_prefix={self.transactional_id_prefix!r})")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_client"] = None
        state["_client_lock"] = None
        state["_chain"] = None  # a copy elsewhere planned nothing: it holds no plan of this object's
        state["_fence_closes"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._client_lock = threading.Lock()

    def target(self) -> str:
        # What is written, not the way there: brokers listed otherwise, or another listener, is the same job.
        return f"kafka topic {self.topic or '(per-record topics)'} (ids {self.transactional_id_prefix})"

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """A config for ``twophase recover`` and friends.  Refuses literal secrets (use ``{"env": ...}``)."""
        for k, v in self.producer_config.items():
            if _SECRET_KEY.search(k) and not is_secret_ref(v):
                raise ConfigurationError(
                    f"producer setting {k!r} is given as a literal value; give it as "
                    f'{{"env": "VARIABLE"}} (or {{"file": "/path"}}) so that configs and logs never hold it')
        return {"sink": self.kind, "bootstrap_servers": self.bootstrap_servers, "topic": self.topic,
                "transactional_id_prefix": self.transactional_id_prefix,
                "producer_config": dict(self.producer_config),
                "transaction_timeout_ms": self.transaction_timeout_ms, "tombstones": self.tombstones,
                "auto_create_topics": self.auto_create_topics, "flush_timeout_s": self.flush_timeout_s,
                "request_timeout_s": self.request_timeout_s,
                "warn_age_fraction": self.warn_age_fraction,
                "commit_margin_ms": self.commit_margin_ms,
                "slots_per_partition": self.slots_per_partition}

    def _resolved_config(self) -> dict[str, Any]:
        conf = {k: resolve_secret(v, f"Kafka producer setting {k!r}") for k, v in self.producer_config.items()}
        conf["bootstrap.servers"] = self.bootstrap_servers
        return conf

    # -------------------------------------------------------------- driver side
    def _txn_client(self):
        """The cached driver-side transaction client (FindCoordinator/EndTxn/InitProducerId)."""
        from twophase.sinks import _kafka_protocol as kp

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

    def close(self) -> None:
        """Close the driver's cached connections (optional; a new one opens on demand)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def _admin(self):
        ck = require("confluent_kafka.admin", "KafkaSink")
        conf = self._resolved_config()
        conf.setdefault("socket.timeout.ms", int(self.request_timeout_s * 1000))
        return ck.AdminClient(conf)

    def executor_modules(self) -> list[str]:
        # kafka-python: a task claims its transactional id (conditional InitProducerId) and reads
        # where its records landed (DescribeProducers), which librdkafka cannot ask.
        return ["pyarrow", "confluent_kafka", "kafka"]

    def _task_client(self):
        """The executor's transaction client for this sink's settings (one per Python worker)."""
        from twophase.sinks import _kafka_protocol as kp

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

    def open(self) -> None:
        """Check reachability, the topic, and the transaction timeout against the broker (driver)."""
        ck = require("confluent_kafka", "KafkaSink")
        admin_mod = require("confluent_kafka.admin", "KafkaSink")
        admin = self._admin()
        try:
            md = admin.list_topics(timeout=self.request_timeout_s)
        except ck.KafkaException as e:
            raise ConfigurationError(
                f"cannot reach Kafka at {self.bootstrap_servers} within {self.request_timeout_s:.0f}s "
                f"({e.args[0].str() if e.args else e}). Check bootstrap_servers, the network and the "
                "security settings.") from None
        if self.topic is not None and (self.topic not in md.topics or md.topics[self.topic].error is not None):
            if not self.auto_create_topics:
                raise ConfigurationError(
                    f"topic {self.topic!r} does not exist on {self.bootstrap_servers}; create it, or pass "
                    "auto_create_topics=True if the broker has auto.create.topics.enable=true")
        broker_ids = sorted(md.brokers)
        if not broker_ids:
            raise ConfigurationError(f"Kafka at {self.bootstrap_servers} reports no brokers")
        res = admin_mod.ConfigResource(admin_mod.ResourceType.BROKER, str(broker_ids[0]))
        try:
            entries = admin.describe_configs([res], request_timeout=self.request_timeout_s)[res].result()
        except Exception as e:
            log.warning("could not read the broker's transaction.max.timeout.ms (%s: %s); "
                        "transaction_timeout_ms=%d is not checked", type(e).__name__, e,
                        self.transaction_timeout_ms)
        else:
            entry = entries.get("transaction.max.timeout.ms")
            if entry is not None and entry.value is not None:
                broker_max = int(entry.value)
                if self.transaction_timeout_ms > broker_max:
                    raise ConfigurationError(
                        f"transaction_timeout_ms={self.transaction_timeout_ms} exceeds the broker's "
                        f"transaction.max.timeout.ms={broker_max}: producers would be refused. Lower "
                        "transaction_timeout_ms, or raise transaction.max.timeout.ms on the brokers.")
        # The driver-side client must work too (commit and fencing go through it).
        self._txn_client()

    def open_for_commit(self) -> None:
        """Only the driver-side client the commits use: the topic and the transaction timeout were
        checked by the plan's :meth:`open` (its topic listing alone is ~66 ms a call)."""
        self._txn_client()

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT of one ballot: the pool's ids for ``num_partitions`` partitions, the plan fence's
        new epoch, and which ids of the pool had an open transaction at this moment (driver).

        Bumps the plan fence ``{prefix}-plans`` (an unconditional InitProducerId on an id that never
        holds a transaction, so it aborts nothing) and records the new (producer id, epoch): a
        task whose INTENT names an older epoch is late and claims nothing, and the cleanup of this
        ballot knows whether a newer one has been planned since.  The fence also keeps, in its
        transaction timeout field (which the broker never acts on for an id without a
        transaction), the widest plan so far, so that ids of partitions an earlier, wider batch
        used are still looked at.  Then one DescribeTransactions (per transaction coordinator) of
        those ids: the ones found ``Ongoing`` are listed ``open`` (leftovers of closed executions,
        whose exact (producer id, epoch) this ballot's tasks and cleanup may abort, however late)
        only with the evidence described below, the fence read again after the describe
        included; else ``held``.  Nothing in the pool is changed here.
        """
        n, r = int(num_partitions), self.slots_per_partition
        ids = self.pool_ids(n)
        pool: dict[str, Any] = {"version": POOL_VERSION, "partitions": n, "slots": r, "widest": n,
                                "fence": self.plan_fence_id(), "fence_producer": None, "open": {}}
        intent = {"transactional_ids": ids, "transaction_timeout_ms": self.transaction_timeout_ms,
                  "pool": pool}
        if not ids:
            return intent
        from twophase.sinks import _kafka_protocol as kp

        client = self._txn_client()
        fence = self.plan_fence_id()
        before = self._describe(client, [fence]).get(fence)
        widest = n
        if before is not None and before.error_code == kp.NONE:
            widest = max(n, int(before.timeout_ms))
        widest = min(widest, self.transaction_timeout_ms)  # a timeout the broker accepts
        pool["widest"] = max(n, widest)
        fence_now = list(self._bump_plan_fence(client, batch_id, max(1, widest)))
        pool["fence_producer"] = fence_now
        # Whose are the transactions open now?  Rule (docs/design.md, issue 59): an open transaction
        # is a leftover (abortable by this ballot's tasks and cleanup) only with evidence that its
        # ballot is closed.  The evidence this sink holds: the plan just before this one (the
        # fence moved from its epoch by exactly this bump: no other plan in between) is one whose
        # ballot is closed: this object's own previous plan (its coordinator opens a ballot only
        # after closing its earlier ones), or one whose closed ballot it cleaned up
        # (abort_lingering, recovery's included).  Then whatever is open was claimed under closed
        # ballots, or was already held by that plan.  Otherwise another run planned in between (a
        # backfill of an older batch id, a run that took the log over) or this object knows no
        # plan (a restart): what is open may be a live, even decided, ballot's, so it is *held*:
        # never aborted by this ballot, left to its owner or to the broker's transaction timeout.
        chain = self._chain
        proven = (chain is not None and chain["fence"][0] == fence_now[0]
                  and chain["fence"][1] + 1 == fence_now[1])
        held_before: dict[str, list[int]] = chain["held"] if proven and chain is not None else {}
        states = self._describe(client, self._scanned_ids(pool))
        found = {t: [d.producer_id, d.producer_epoch] for t, d in states.items()
                 if d.error_code == kp.NONE and d.state == "Ongoing"}
        if proven and found:
            # The bump and the describe are two requests: another run's plan can land between them
            # and its tasks open transactions that the describe then finds (review r9).  So the
            # fence is read again, after the describe's answer: still at this plan's epoch, no plan
            # landed from the bump to after every id was described, and what is open belongs to
            # the plans before (the proof above).  Moved or unknown: no proof, everything is held.
            # A plan landing after this read opens its transactions after it, so not in `found`.
            proven = self._plan_fence_state(client, pool) is True
        pool["open"] = {t: pe for t, pe in found.items() if proven and held_before.get(t) != pe}
        pool["held"] = {t: pe for t, pe in found.items() if t not in pool["open"]}
        self._chain = {"fence": fence_now, "held": dict(pool["held"])}
        if pool["held"]:
            log.info("batch %d: %d open transactions on this query's ids (%s) are left alone by this "
                     "ballot: another plan came before it, and they may be that run's", batch_id,
                     len(pool["held"]), ", ".join(sorted(pool["held"])[:5]))
        return intent

    @staticmethod
    def _scanned_ids(pool: dict[str, Any]) -> list[str]:
        """The ids a ballot looks at for leftovers: its own, and those of wider earlier plans (named
        from the INTENT's plan fence ``{prefix}-plans``, not from this sink's settings)."""
        prefix = str(pool["fence"])[:-len("-plans")]
        return [f"{prefix}-{p}.{s}" for p in range(int(pool.get("widest") or pool["partitions"]))
                for s in range(int(pool["slots"]))]

    def transactional_id(self, partition_id: int, slot: int = 0) -> str:
        """The pool's id for ``slot`` of ``partition_id``: ``{prefix}-{partition}.{slot}``."""
        return f"{self.transactional_id_prefix}-{int(partition_id)}.{int(slot)}"

    def pool_ids(self, num_partitions: int) -> list[str]:
        """Every transactional id a batch of ``num_partitions`` partitions may use (not the plan fence)."""
        return [self.transactional_id(p, s) for p in range(int(num_partitions))
                for s in range(self.slots_per_partition)]

    def plan_fence_id(self) -> str:
        """The id whose epoch marks the latest plan of this query (it never holds a transaction)."""
        return f"{self.transactional_id_prefix}-plans"

    def _bump_plan_fence(self, client, batch_id: int, widest: int) -> tuple[int, int]:
        from twophase.sinks import _kafka_protocol as kp

        fence = self.plan_fence_id()
        deadline = time.monotonic() + max(60.0, 2 * self.request_timeout_s)
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(fence, widest)
            if code == kp.NONE:
                return pid, epoch
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                raise TwoPhaseError(
                    f"batch {batch_id}: cannot plan the batch: InitProducerId on the plan fence {fence} "
                    f"answered {kp.error_name(code)}. Check the broker and the ACLs for transactional ids "
                    "with this prefix (Write), then restart the query.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[dict]) -> int:
        """Abort what this ballot's attempts left open on its ids, never what a newer one opened (driver).

        Describes the INTENT's ids (and those of wider earlier plans, see :meth:`plan_batch`)
        first, then, if an open transaction there depends on it, the plan fence (after a clean
        batch nothing is open: one request).  An open transaction (not one of
        ``keep``) is aborted, by EndTxn under the exact producer id and epoch just described, if
        the INTENT's snapshot lists it as open before this ballot was planned (a leftover of a
        closed execution), or if the plan fence still holds this INTENT's epoch (no execution has
        been planned since, so nothing open on these ids can belong to a newer one).  Otherwise
        (a deposed coordinator's late cleanup) it is left alone: it may be a newer ballot's
        decided transaction, and the newest ballot's own cleanup aborts what is a leftover.  An
        EndTxn that finds another epoch aborts nothing.  INTENTs of earlier versions (ids
        ``{prefix}-{partition}``, no "pool") are fenced as before: no ballot planned now uses those
        ids.  Returns how many open transactions were aborted.
        """
        from twophase.sinks import _kafka_protocol as kp

        pool = intent.get("pool")
        if not isinstance(pool, dict):
            return self._abort_lingering_unpooled(batch_id, intent, keep)
        if not intent.get("transactional_ids"):
            return 0
        tids = self._scanned_ids(pool)
        kept = {(str(h["transactional_id"]), int(h["producer_id"]), int(h["producer_epoch"])) for h in keep}
        client = self._txn_client()
        # A decided ballot (``keep`` names its committed handles) never runs again: close its plan at
        # the fence, before looking at the ids, so that a late attempt of it (a zombie task, a stage
        # retry's duplicate) claims nothing from now on instead of opening a transaction after this
        # cleanup, which another run's plan cannot attribute (it holds it) and which would hold
        # read_committed readers back until its timeout.  An undecided ballot's plan is not closed:
        # the sink's contract lets a caller clean up (keep=[]) before running its INTENT again.
        closed = self._close_plan_fence(client, pool) if kept else None
        states = self._describe(client, tids)
        latest: bool | None = None  # the plan fence, asked after the ids (see the docstring) and
        snapshot = pool.get("open") or {}  # only if an open transaction depends on it
        held = pool.get("held") or {}
        aborted, left = 0, []
        for tid in tids:
            st = states.get(tid)
            if st is None or st.error_code != kp.NONE or st.state != "Ongoing":
                continue
            if (tid, st.producer_id, st.producer_epoch) in kept:
                continue
            if held.get(tid) == [st.producer_id, st.producer_epoch]:
                # Open before this ballot was planned, with no evidence whose: another run's
                # live ballot, maybe decided (rule: no abort without evidence).  Left alone.
                left.append(tid)
                continue
            listed = snapshot.get(tid) == [st.producer_id, st.producer_epoch]
            if not listed and latest is None:
                latest = self._plan_fence_state(client, pool, closed) is True
            if listed or latest:
                # rule: listed = open under a plan of this object's whose ballot it saw closed, with
                # the fence read after the plan's describe still at its epoch (no plan in between);
                # latest = opened after this ballot's plan with no plan since (the fence, read after
                # the describe, still at its epoch, or at the epoch this cleanup closed it with,
                # conditionally from that epoch): this ballot's own.
                if self._abort_open(client, tid, st.producer_id, st.producer_epoch, f"batch {batch_id}"):
                    aborted += 1
            else:
                left.append(tid)
        if left:
            log.info("batch %d: left %d open transactions on this execution's ids alone (%s): another "
                     "execution or batch was planned before or since, and they may be its own; its cleanup "
                     "aborts them if they are leftovers, or the broker's transaction timeout does",
                     batch_id, len(left), ", ".join(left[:5]))
        self._closed_plan(pool, closed)
        return aborted

    def _close_plan_fence(self, client, pool: dict[str, Any]) -> list[int] | None:
        """Bump the plan fence from exactly ``pool``'s epoch (a conditional InitProducerId: the
        broker refuses if another plan moved it): [producer id, epoch] the fence now holds, or None
        if it moved on (or cannot be told).  From then on every task of that ballot is late and
        claims nothing (:meth:`_check_plan_fence`).  The same ballot closed twice (its own cleanup and
        another run's recovery) is answered the same epoch again (the broker takes it for a retry);
        after another plan's (unconditional) bump the answer is PRODUCER_FENCED."""
        from twophase.sinks import _kafka_protocol as kp

        fence, mine = pool.get("fence"), pool.get("fence_producer")
        if not fence or not mine:
            return None
        widest = max(1, min(int(pool.get("widest") or pool.get("partitions") or 1), self.transaction_timeout_ms))
        deadline = time.monotonic() + self.request_timeout_s
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(str(fence), widest, int(mine[0]), int(mine[1]))
            if code == kp.NONE:
                if [pid, epoch] != [int(mine[0]), int(mine[1]) + 1]:
                    return None
                self._fence_closes[(int(mine[0]), int(mine[1]))] = [pid, epoch]
                return [pid, epoch]
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                return None
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _closed_plan(self, pool: dict[str, Any], closed: list[int] | None = None) -> None:
        """Note that the ballot planned as ``pool`` is closed: the protocol calls abort_lingering only
        once the ballot's slot is filled (committed or closed), recovery's included.  The next plan
        of this object, if its bump lands exactly one epoch after that plan's, may then take what is
        open (and was not held by that plan) for leftovers of closed ballots (:meth:`plan_batch`)."""
        fence, chain = pool.get("fence_producer"), self._chain
        if not fence or "held" not in pool:  # INTENTs of earlier versions did not tell what they held
            return
        fence = list(closed) if closed is not None else [int(fence[0]), int(fence[1])]
        if chain is None or chain["fence"][0] != fence[0] or chain["fence"][1] < fence[1]:
            self._chain = {"fence": fence, "held": dict(pool["held"])}

    def plan_superseded(self, intent: dict[str, Any]) -> bool:
        """True if the plan fence has moved past ``intent``'s epoch: a newer plan (a deposed
        coordinator's, landing late) makes every task of that ballot refuse to claim an id.
        A fence that cannot be read is not known to have moved: the failure stands."""
        pool = intent.get("pool")
        if not isinstance(pool, dict) or not intent.get("transactional_ids"):
            return False
        mine = pool.get("fence_producer")
        # This object's own close of that ballot (its cleanup) is no newer plan.
        closed = self._fence_closes.get((int(mine[0]), int(mine[1]))) if mine else None
        return self._plan_fence_state(self._txn_client(), pool, closed) is False

    def _plan_fence_state(self, client, pool: dict[str, Any], closed: list[int] | None = None) -> bool | None:
        """The plan fence against ``pool``'s epoch: True if it still holds it (or ``closed``, the
        epoch this object's cleanup closed that plan with), False if it moved, None if unknown (no
        fence in the INTENT, or no answer)."""
        from twophase.sinks import _kafka_protocol as kp

        fence, mine = pool.get("fence"), pool.get("fence_producer")
        if not fence or mine is None:
            return None
        st = self._describe(client, [str(fence)]).get(str(fence))
        if st is None or st.error_code != kp.NONE:
            return None
        return [st.producer_id, st.producer_epoch] in (list(mine), list(closed or mine))

    def _abort_open(self, client, tid: str, pid: int, epoch: int, label: str, wait: bool = True) -> bool:
        """EndTxn(abort) under exactly (pid, epoch): True if this aborted it.

        The broker refuses (PRODUCER_FENCED, INVALID_PRODUCER_EPOCH) when the id moved on, and
        INVALID_TXN_STATE when it is no longer open: then it is not ours to abort any more.
        ``wait=False`` asks once (an executor's help with a leftover; the cleanup does the rest).
        """
        from twophase.sinks import _kafka_protocol as kp

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

    def _abort_lingering_unpooled(self, batch_id: int, intent: dict[str, Any], keep: list[dict]) -> int:
        """abort_lingering for INTENTs of earlier versions: ids ``{prefix}-{partition}``, fenced.

        Fencing is an unconditional InitProducerId: the broker aborts the open transaction and
        bumps the epoch.  Safe now because no ballot planned by this version uses these ids.
        """
        from twophase.sinks import _kafka_protocol as kp

        tids = list(intent.get("transactional_ids") or [])
        keep_ids = {h["transactional_id"] for h in keep}
        candidates = [t for t in tids if t not in keep_ids]
        if not candidates:
            return 0
        client = self._txn_client()
        try:
            states = client.describe_transactions(candidates)
        except Exception as e:  # e.g. a broker without DescribeTransactions: fence all
            log.debug("DescribeTransactions failed (%s); fencing all %d ids", e, len(candidates))
            states = {}
        to_fence = []
        for t in candidates:
            st = states.get(t)
            if st is None:
                to_fence.append(t)  # unknown answer: fencing an idle id is harmless
            elif st.error_code == kp.TRANSACTIONAL_ID_NOT_FOUND:
                continue
            elif st.error_code == kp.NONE and st.state not in ("Ongoing", "PrepareAbort", "PrepareEpochFence"):
                continue
            else:
                to_fence.append(t)
        aborted = 0
        for t in to_fence:
            was_open = states.get(t) is None or states[t].state != "Empty"
            self._fence(client, t, batch_id)
            aborted += 1 if was_open else 0
        return aborted

    def _fence(self, client, tid: str, batch_id: int) -> None:
        from twophase.sinks import _kafka_protocol as kp

        deadline = time.monotonic() + max(60.0, 2 * self.request_timeout_s)
        delay = 0.02
        while True:
            code, pid, epoch = client.init_producer_id(tid, self.transaction_timeout_ms)
            if code == kp.NONE:
                log.info("batch %d: fenced transactional id %s (now producer id %d epoch %d)",
                         batch_id, tid, pid, epoch)
                return
            if code not in kp.RETRIABLE or time.monotonic() > deadline:
                raise TwoPhaseError(
                    f"batch {batch_id}: cannot fence transactional id {tid} (to abort what a crashed "
                    f"attempt left open): {kp.error_name(code)}. Check the broker and the ACLs for "
                    "transactional ids with this prefix, then restart the query.")
            time.sleep(delay)
            delay = min(delay * 2, 1.0)

    def _describe(self, client, tids: list[str]) -> dict[str, Any]:
        """DescribeTransactions for ``tids``, asking again (within ``request_timeout_s``) for ids
        whose coordinator did not answer or answered a retriable error.  Ids still without an
        answer are missing; the last retriable answer is kept."""
        from twophase.sinks import _kafka_protocol as kp

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

    def verify_prepared(self, batch_id: int, handles: list[dict], *,
                        prepare_started_at: float) -> None:
        """Before the decision: each transaction still open, ``commit_margin_ms`` left (driver).

        The broker aborts a transaction ``transaction.timeout.ms`` after its first record,
        whether or not the batch's other tasks are done: with several waves of tasks, the
        first wave's transactions age while the last wave runs.  Deciding a batch one of
        whose transactions is already aborted (or about to be) turns into data loss at
        the commit.  So this asks DescribeTransactions (one request per transaction
        coordinator) that each handle's transaction is ``Ongoing`` under the handle's
        producer id and epoch, and that it has at least ``commit_margin_ms`` of its
        timeout left.  A transaction's age is the driver's clock minus the broker's
        start time of the transaction, capped at the time since ``prepare_started_at``
        (it cannot be older than the batch).  Raises :class:`TwoPhaseError` otherwise;
        the batch is then undecided and the coordinator aborts its transactions.  When every
        transaction found closed is less than half its timeout old, another actor's
        InitProducerId closed it, not the broker's clock: :class:`TransactionTakenError`, and
        the coordinator runs the batch again in a new ballot.
        """
        from twophase.sinks import _kafka_protocol as kp

        if not handles:
            return
        client = self._txn_client()
        tids = [str(h["transactional_id"]) for h in handles]
        try:
            states: dict[str, Any] | None = self._describe(client, tids)
        except kp.UnsupportedRequest as e:
            log.warning("batch %d: cannot check the Kafka transactions before the decision (%s); "
                        "only the batch's duration is checked against transaction_timeout_ms",
                        batch_id, e)
            states = None
        now = time.time()
        duration = max(0.0, now - float(prepare_started_at))
        margin_s = self.commit_margin_ms / 1000.0
        not_open: list[str] = []
        taken: list[str] = []
        tight: list[tuple[float, str]] = []
        oldest_age, oldest_tid, oldest_timeout_s = -1.0, "", self.transaction_timeout_ms / 1000.0
        for h, tid in zip(handles, tids):
            pid, epoch = int(h["producer_id"]), int(h["producer_epoch"])
            timeout_s = int(h.get("timeout_ms", self.transaction_timeout_ms)) / 1000.0
            # No transaction of this batch can be older than the batch: cap every estimate there.
            started = h.get("started_at")
            age = duration if started is None else min(duration, max(0.0, now - float(started)))
            st = None if states is None else states.get(tid)
            is_open = False
            if states is None:
                is_open = True  # the broker cannot tell: the clock check alone
            elif st is None:
                not_open.append(f"{tid}: its transaction coordinator did not answer "
                                f"DescribeTransactions within {self.request_timeout_s:.0f}s "
                                "(request_timeout_s)")
            elif st.error_code != kp.NONE:
                not_open.append(f"{tid}: DescribeTransactions answered {kp.error_name(st.error_code)}")
            elif st.state != "Ongoing" or st.producer_id != pid or st.producer_epoch != epoch:
                not_open.append(self._not_open_reason(tid, pid, epoch, st, timeout_s))
                if age < timeout_s / 2:
                    # Far younger than its timeout (whatever the clocks' skew): not the broker's
                    # abort but another actor's InitProducerId on the id (a late task attempt).
                    taken.append(not_open[-1])
            else:
                is_open = True
                # The broker's clock started the timeout: prefer its start time to the executor's.
                timeout_s = st.timeout_ms / 1000.0
                if st.start_time_ms > 0:
                    age = min(duration, max(0.0, now - st.start_time_ms / 1000.0))
            if age > oldest_age:
                oldest_age, oldest_tid, oldest_timeout_s = age, tid, timeout_s
            if is_open and timeout_s - age < margin_s:
                tight.append((timeout_s - age, tid))
        if not not_open and not tight:
            return

        def more(items: list[str]) -> str:
            rest = f" (and {len(items) - 5} more)" if len(items) > 5 else ""
            return "; ".join(items[:5]) + rest

        if taken and len(taken) == len(not_open) and not tight:
            raise TransactionTakenError(
                f"batch {batch_id}: not deciding the batch: {len(taken)} of its {len(handles)} Kafka "
                f"transactions were aborted long before their timeout: {more(taken)}. Another actor "
                "initialised the id (a late attempt of one of the batch's tasks, which claimed it from a "
                "stale look at its state). Nothing of this batch is visible; the ballot's transactions "
                "are aborted and the batch runs again in a new ballot.")

        parts = [(f"batch {batch_id}: not deciding the batch: {len(not_open) + len(tight)} of its "
                  f"{len(handles)} Kafka transactions could not be committed safely.")]
        if not_open:
            parts.append(f"Not open any more: {more(not_open)}.")
        if tight:
            parts.append(f"Less than commit_margin_ms={self.commit_margin_ms} ({margin_s:.0f}s) of "
                         f"their timeout left: {more([t for _, t in sorted(tight)])}.")
        age_txt = f"its oldest transaction ({oldest_tid}) is {oldest_age:.0f}s old"
        parts.append(
            "The broker aborts a transaction transaction_timeout_ms="
            f"{int(oldest_timeout_s * 1000)} ms ({oldest_timeout_s:.0f}s) after its first record; "
            f"the batch's tasks have run for {duration:.0f}s so far and {age_txt}. Nothing of this "
            "batch is visible; its transactions are aborted and its replay writes it again. The "
            "timeout must cover the whole prepare phase (every wave of tasks) plus the commit "
            "margin: raise transaction_timeout_ms (up to the brokers' "
            "transaction.max.timeout.ms, default 900000; raise that on the brokers if needed), or "
            "shorten the batch: fewer rows per batch (e.g. maxOffsetsPerTrigger) or fewer waves "
            "of tasks (no more partitions than executor cores).")
        raise TwoPhaseError(" ".join(parts))

    @staticmethod
    def _not_open_reason(tid: str, pid: int, epoch: int, st: Any, timeout_s: float) -> str:
        where = f"{tid} (producer id {pid}, epoch {epoch})"
        seen = f"{st.state} under producer id {st.producer_id} epoch {st.producer_epoch}"
        aborted = st.state in ("PrepareAbort", "CompleteAbort", "PrepareEpochFence")
        if st.producer_id == pid and (st.producer_epoch > epoch
                                      or (aborted and st.producer_epoch == epoch)):
            return (f"{where}: the broker already aborted it ({seen}): it outlived its "
                    f"transaction timeout of {timeout_s:.0f}s, or something else initialised this "
                    "transactional id")
        return f"{where}: the broker reports {seen}, not this handle's open transaction"

    def commit(self, handle: dict) -> CommitResult:
        """EndTxn(commit) with the handle's producer id and epoch (driver; idempotent).

        The broker answers success both for this commit and for a repeated one (so a
        retry after a lost answer also reports COMMITTED); :meth:`recover_and_commit`
        tells them apart.  When the broker says the id moved on (PRODUCER_FENCED,
        INVALID_PRODUCER_EPOCH, INVALID_TXN_STATE, INVALID_PRODUCER_ID_MAPPING), a commit that
        landed earlier cannot be told from an abort by EndTxn: a zombie that initialised the id
        after the commit, or the id's expiry, look the same.  The handle's first offsets can
        (:meth:`_records_fate`): visible to read_committed readers -> ALREADY_COMMITTED; skipped
        by them with the last stable offset past it, on a topic that is not compacted -> LOST
        with ``never_visible`` (the batch, if every handle is so, is void and runs again: the
        broker's transaction timeout no longer loses a decided batch); deleted, or on a compacted
        topic -> LOST (data loss: the record's fate cannot be proven); not decided yet ->
        RETRY_LATER.  Handles without offsets (the executor's read of them is best effort) are
        LOST on those answers.
        """
        from twophase.sinks import _kafka_protocol as kp

        warning = self.pending_age_warning(handle)
        if warning:
            log.warning("%s", warning)
        tid, pid, epoch = handle["transactional_id"], int(handle["producer_id"]), int(handle["producer_epoch"])
        code = self._txn_client().end_txn(tid, pid, epoch, commit=True)
        name = kp.error_name(code)
        if code == kp.NONE:
            return CommitResult.committed()
        if code in kp.RETRIABLE:
            return CommitResult.retry_later(f"{name} from the transaction coordinator of {tid}")
        if code in (kp.INVALID_PRODUCER_EPOCH, kp.PRODUCER_FENCED, kp.INVALID_TXN_STATE,
                    kp.INVALID_PRODUCER_ID_MAPPING) and handle.get("txn_start_offsets"):
            # The id moved on (re-initialised, expired): EndTxn cannot tell a commit that landed
            # earlier from an abort.  The transaction's own records can.
            verdict, where = self._records_fate(handle["txn_start_offsets"], pid, epoch,
                                                handle.get("txn_topic_ids"))
            if verdict == "committed":
                return CommitResult.already_committed(
                    f"EndTxn answered {name} for {tid} (producer id {pid}, epoch {epoch}): the id was "
                    f"initialised again or expired since, but {where} is visible to read_committed readers: "
                    "an earlier commit made the transaction visible")
            if verdict == "pending":
                return CommitResult.retry_later(
                    f"EndTxn answered {name} for {tid}; whether its transaction committed shows once {where}")
            if verdict == "unknown":
                return CommitResult.retry_later(
                    f"EndTxn answered {name} for {tid}, and reading {where} to tell whether its transaction "
                    "committed failed")
            lost = self._lost(handle, code, name)
            if verdict == "aborted":
                # Proof that nothing of it was ever visible: its first record is still in the
                # partition (not deleted), the topic is not compacted (so a committed record is
                # never removed one by one), and read_committed readers, with the last stable
                # offset past it, skip it: its transaction was aborted, everywhere (a transaction
                # commits or aborts as a whole), and an aborted transaction never commits later.
                return CommitResult.lost(f"{lost.reason}; {where}: read_committed readers never saw it",
                                         never_visible=True)
            return CommitResult.lost(f"{lost.reason}; whether it had committed cannot be checked: {where}")
        return self._lost(handle, code, name)

    def _lost(self, handle: dict, code: int, name: str) -> CommitResult:
        from twophase.sinks import _kafka_protocol as kp

        tid, pid, epoch = handle["transactional_id"], int(handle["producer_id"]), int(handle["producer_epoch"])
        age = self.handle_age(handle)
        age_txt = f"{age:.0f}s old" if age is not None else "age unknown"
        timeout = int(handle.get("timeout_ms", self.transaction_timeout_ms))
        if code in (kp.INVALID_PRODUCER_EPOCH, kp.PRODUCER_FENCED):
            return CommitResult.lost(
                f"{name}: the transaction of {tid} (producer id {pid}, epoch {epoch}, {age_txt}) was aborted "
                f"by the broker: it outlived transaction.timeout.ms={timeout} ms, or something else "
                "initialised this transactional id (another query with the same transactional_id_prefix?)")
        if code == kp.INVALID_TXN_STATE:
            return CommitResult.lost(f"{name}: the transaction of {tid} (producer id {pid}, epoch {epoch}, "
                                     f"{age_txt}) was aborted, not committed")
        if code == kp.INVALID_PRODUCER_ID_MAPPING:
            return CommitResult.lost(
                f"{name}: the broker no longer knows transactional id {tid} with producer id {pid} "
                f"({age_txt}): it expired (transactional.id.expiration.ms) or was taken over")
        return CommitResult.retry_later(f"{name} from the transaction coordinator of {tid}")

    def _consumer_config(self) -> dict[str, Any]:
        """Connection and security settings of ``producer_config`` for a read_committed consumer."""
        conf = {k: v for k, v in self._resolved_config().items()
                if k == "bootstrap.servers" or k.startswith(("security.", "ssl.", "sasl.", "enable.ssl",
                                                             "enable.sasl", "socket.", "client.dns",
                                                             "broker.address"))}
        conf.update({"group.id": f"twophase-check-{uuid.uuid4().hex[:12]}", "isolation.level": "read_committed",
                     "enable.auto.commit": False, "enable.partition.eof": True,
                     "auto.offset.reset": "error", "enable.sparse.connections": False})
        return conf

    def _absent(self, topic: str, aborted: str) -> tuple[str, str]:
        """The verdict for a first record a read_committed reader skips: aborted, unless the topic is
        compacted (compaction removes committed records superseded by a later one with the same
        key, which then read exactly like aborted ones)."""
        admin_mod = require("confluent_kafka.admin", "KafkaSink")
        res = admin_mod.ConfigResource(admin_mod.ResourceType.TOPIC, topic)
        admin = self._admin()  # referenced until the answer is in: a dropped client fails its requests
        try:
            entries = admin.describe_configs([res], request_timeout=self.request_timeout_s)[res].result()
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"{aborted}, but the cleanup policy of {topic} could not be read ({type(e).__name__})"
        entry = entries.get("cleanup.policy")
        policy = str(entry.value) if entry is not None and entry.value is not None else "delete"
        if "compact" in policy:
            return "gone", (f"{aborted.replace(' was aborted', ' is not there')}, but {topic} is compacted "
                            f"(cleanup.policy={policy}), which may have removed it after a commit")
        return "aborted", aborted

    def _topic_is_ours(self, name: str, offset: int, topic_ids: dict[str, str] | None) -> tuple[str, str] | None:
        """None if the topic of ``name`` is the incarnation the handle names (or it names none), else
        ("gone", why) or ("unknown", why): see :meth:`_record_is_ours`."""
        topic = name.rpartition(":")[0]
        want = (topic_ids or {}).get(topic)
        if not want:
            return None
        try:
            now = self._txn_client().topic_ids([topic]).get(topic)
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"the topic id of {topic} could not be read ({type(e).__name__}: {e})"
        if now == want:
            return None
        state = "no longer exists" if now is None else f"was deleted and recreated (topic id now {now})"
        return "gone", (f"topic {topic} {state} since the transaction wrote to it (topic id {want}): whatever "
                        f"{name} holds at offset {offset} now is not its record, so whether it committed "
                        "cannot be read")

    def _record_is_ours(self, name: str, offset: int, producer_id: int | None,
                        producer_epoch: int | None) -> tuple[str, str] | None:
        """None if ``name`` (``"topic:partition"``) still holds, at ``offset``, a record of this
        transaction (this producer id and epoch; the topic incarnation is :meth:`_topic_is_ours`'s);
        otherwise the verdict: ("gone", why) when it holds another's or none, ("unknown", why) when
        that cannot be read.

        A handle names its record: the topic id (``txn_topic_ids``, since issue 59) and the producer id
        and epoch.  A topic deleted and recreated under its name, or a log truncated and written
        again (an unclean leader election), holds another transaction's record at that offset, or
        none: what a reader finds there says nothing of this transaction, so it is neither "never
        visible" (void, run again: a duplicate if it had committed) nor "committed" (silent loss if
        it was aborted).  Handles without ``txn_topic_ids`` (written before) are checked by the
        producer id and epoch alone, which a recreated topic's records do not share (producer ids
        are allocated cluster-wide)."""
        topic = name.rpartition(":")[0]
        client = self._txn_client()
        if producer_id is None:
            return None
        try:
            kind, what = client.batch_at(name, offset)
        except Exception as e:  # noqa: BLE001 - asked again later
            return "unknown", f"reading {name} at offset {offset} failed ({type(e).__name__}: {e})"
        if kind == "batch":
            pid, ep, control = what
            if not control and pid == int(producer_id) and (producer_epoch is None or ep == int(producer_epoch)):
                return None
            whose = "a transaction marker" if control else f"a record of producer id {pid} epoch {ep}"
            return "gone", (f"{name} holds {whose} at offset {offset}, not this transaction's (producer id "
                            f"{producer_id} epoch {producer_epoch}): topic {topic} was recreated or its offsets "
                            "reused, so whether the transaction committed cannot be read")
        if kind == "out-of-range":  # the caller saw the partition start at or before it: past the end
            return "gone", (f"{name} now ends before offset {offset}: topic {topic} was recreated or its log "
                            "truncated, so whether the transaction committed cannot be read")
        if kind == "no-topic":
            return "gone", f"topic {topic} no longer exists, so whether the transaction committed cannot be read"
        if kind == "beyond":
            return "gone", (f"{name} now ends at offset {what}, before {offset}: topic {topic} was recreated or "
                            "its log truncated, so whether the transaction committed cannot be read")
        return "gone", (f"{name} holds no record at offset {offset} (the next is at {what}): removed, so whether "
                        "the transaction committed cannot be read")

    def _records_fate(self, offsets: dict[str, int], producer_id: int | None = None,
                      producer_epoch: int | None = None,
                      topic_ids: dict[str, str] | None = None) -> tuple[str, str]:
        """What became of a transaction whose first records are at ``offsets`` (driver).

        First, each partition must still hold this transaction's record at that offset
        (:meth:`_record_is_ours`: same topic incarnation, producer id and epoch); if it holds
        another's, or none, the verdict is ("gone", why): never "aborted", never "committed".

        ("committed", where): a read_committed consumer gets the record at that offset.
        ("aborted", where): the last stable offset is past it and the consumer skips it (the
        next record it gets is later, or it reaches the end) on a topic that is not compacted.
        A transaction commits or aborts as a whole, so one topic partition answers.
        ("pending", where): the last stable offset is not past it yet (a transaction still open
        before or at it) and, with ``producer_id``, the transaction's own marker cannot be read
        either (:meth:`TxnClient.transaction_marker`: read uncommitted, so another open
        transaction holding the last stable offset back does not hide it; a marker answers only
        while the transaction's first record is still there; an abort marker on a compacted topic
        is "gone", as for a skipped record).  ("gone", where): the record was deleted (retention), or is absent
        from a compacted topic.  ("unknown", where): reading it failed.
        """
        ck = require("confluent_kafka", "KafkaSink")
        consumer = ck.Consumer(self._consumer_config())
        verdict, where = "unknown", "no topic partition to read"
        held: str | None = None  # a partition whose last stable offset is held back, its marker unread
        # An absent record proves an abort only where records are not deleted one by one: see _absent.
        try:
            for name, offset in sorted(offsets.items()):
                topic, _, part = name.rpartition(":")
                offset, where = int(offset), f"its first record on {name} (offset {int(offset)})"
                foreign = self._topic_is_ours(name, offset, topic_ids)
                if foreign is None:
                    tp = ck.TopicPartition(topic, int(part))
                    try:
                        low, stable = consumer.get_watermark_offsets(tp, timeout=self.request_timeout_s,
                                                                     cached=False)
                    except ck.KafkaException as e:
                        verdict, where = "unknown", f"{where}: {e.args[0].str() if e.args else e}"
                        continue
                    if offset < low:
                        verdict, where = "gone", f"{where} was deleted (the partition now starts at {low})"
                        continue
                    foreign = self._record_is_ours(name, offset, producer_id, producer_epoch)
                if foreign is not None:  # another partition of the transaction may still tell
                    verdict, where = foreign
                    continue
                if stable <= offset:
                    pending = f"the last stable offset of {name} ({stable}) passes {offset}"
                    marker = None
                    if producer_id is not None:
                        try:
                            marker = self._txn_client().transaction_marker(name, offset, int(producer_id))
                        except Exception as e:  # noqa: BLE001 - then the last stable offset decides
                            log.debug("reading the transaction marker after %s failed: %s", where, e)
                    if marker == "commit":
                        return "committed", f"{where} (its transaction's commit marker)"
                    if marker == "abort":
                        verdict, where = self._absent(topic, f"{where} was aborted (its transaction's abort "
                                                             f"marker, read uncommitted; {pending} yet)")
                        if verdict == "aborted":
                            return verdict, where
                        continue
                    held = held or pending  # another partition of the transaction may answer
                    continue
                consumer.assign([ck.TopicPartition(topic, int(part), offset)])
                deadline = time.monotonic() + self.request_timeout_s
                while time.monotonic() < deadline:
                    m = consumer.poll(0.2)
                    if m is None:
                        continue
                    err = m.error()
                    if err is not None and err.code() != ck.KafkaError._PARTITION_EOF:
                        verdict, where = "unknown", f"{where}: {err.str()}"
                        break
                    if err is None and m.offset() == offset:
                        return "committed", where
                    skipped = (f"the end, offset {m.offset()}, without it" if err is not None else
                               f"offset {m.offset()} next")
                    verdict, where = self._absent(topic, f"{where} was aborted (read_committed readers reach "
                                                         f"{skipped})")
                    if verdict == "aborted":
                        return verdict, where
                    break  # a compacted topic: another partition's record may still tell
                else:
                    verdict, where = "unknown", f"{where}: no answer within {self.request_timeout_s:.0f}s"
            if held is not None:
                return "pending", held
            return verdict, where
        finally:
            consumer.close()

    def recover_and_commit(self, handle: dict) -> CommitResult:
        """Commit a handle found in the log after a restart; tell an earlier commit apart (driver).

        EndTxn answers success for a first commit and for a repeated one alike, so the
        broker's transaction state is asked first: ``CompleteCommit`` under the handle's
        producer id and exact epoch means an earlier call committed it (each producer
        runs one transaction under its epoch, and an abort by timeout or fencing bumps
        the epoch) -> ALREADY_COMMITTED; ``PrepareCommit`` (an earlier commit whose markers
        are being written) -> RETRY_LATER.  Otherwise EndTxn decides; a success after any
        state but ``Ongoing`` (e.g. the state could not be read) is reported as COMMITTED
        with the reason "committed (or already committed: the broker cannot tell)".
        """
        from twophase.sinks import _kafka_protocol as kp

        tid = handle["transactional_id"]
        pid, epoch = int(handle["producer_id"]), int(handle["producer_epoch"])
        try:
            st = self._txn_client().describe_transactions([tid]).get(tid)
        except Exception as e:  # e.g. a broker without DescribeTransactions: EndTxn alone decides
            log.debug("DescribeTransactions for %s failed: %s", tid, e)
            st = None
        ours = (st is not None and st.error_code == kp.NONE and st.producer_id == pid
                and st.producer_epoch == epoch)
        what = f"the transaction of {tid} (producer id {pid}, epoch {epoch})"
        if ours and st.state == "CompleteCommit":
            return CommitResult.already_committed(f"the broker reports {what} committed")
        if ours and st.state == "PrepareCommit":
            # An earlier EndTxn was accepted; the broker is writing its markers.
            return CommitResult.retry_later(f"the broker is completing the commit of {what}")
        res = self.commit(handle)
        if res.outcome is CommitOutcome.COMMITTED and not (ours and st.state == "Ongoing"):
            return CommitResult(CommitOutcome.COMMITTED,
                                "committed (or already committed: the broker cannot tell)")
        return res

    def recover_and_abort(self, handle: dict) -> None:
        """Abort a pre-committed transaction by EndTxn(abort) under its exact producer id and epoch
        (driver).  Returns once the broker confirmed it: aborted now, or no longer open under that
        epoch (ended before, or the id moved on); transient errors are retried for a minute, then
        (and on any other answer) it raises: the transaction may still be open."""
        self._abort_open(self._txn_client(), handle["transactional_id"], int(handle["producer_id"]),
                         int(handle["producer_epoch"]), f"aborting {self.describe_handle(handle)}")

    def describe_handle(self, handle: dict) -> str:
        # "topics" since delivery reports stopped naming partitions; older handles have "partitions"
        where = ", ".join(handle.get("topics") or []) or f"{len(handle.get('partitions') or [])} topic partitions"
        return (f"transactional id {handle.get('transactional_id')} producer id {handle.get('producer_id')} "
                f"epoch {handle.get('producer_epoch')} ({handle.get('rows', '?')} rows to {where})")

    @staticmethod
    def handle_age(handle: dict, now: float | None = None) -> float | None:
        """Seconds since the handle's transaction began (the broker's timeout clock), or None."""
        started = handle.get("started_at")
        if started is None:
            return None
        return max(0.0, (time.time() if now is None else now) - float(started))

    def pending_age_warning(self, handle: dict, age_seconds: float | None = None) -> str | None:
        """A warning for ``twophase status`` and the commit path when a pending transaction nears its timeout.

        The age is the larger of ``age_seconds`` (e.g. time since the decision was
        logged) and the time since the transaction began (recorded in the handle:
        the broker's timeout clock starts there).  None while younger than
        ``warn_age_fraction`` of its timeout.
        """
        ages = [a for a in (self.handle_age(handle), age_seconds) if a is not None]
        if not ages:
            return None
        age = max(float(a) for a in ages)
        timeout_s = int(handle.get("timeout_ms", self.transaction_timeout_ms)) / 1000.0
        tid = handle.get("transactional_id")
        if age >= timeout_s:
            return (f"pending Kafka transaction {tid} is {age:.0f}s old, past its transaction.timeout.ms "
                    f"({timeout_s:.0f}s): the broker has probably aborted it; committing it will report "
                    "data loss")
        if age >= self.warn_age_fraction * timeout_s:
            return (f"pending Kafka transaction {tid} is {age:.0f}s old, {100 * age / timeout_s:.0f}% of its "
                    f"transaction.timeout.ms ({timeout_s:.0f}s): commit it soon (restart the query or run "
                    "'twophase recover') or the broker aborts it")
        return None

    # ------------------------------------------------------------ executor side
    def _producer_config(self, tid: str, txn_box: list) -> dict[str, Any]:
        conf = self._resolved_config()
        conf.update({
            "transactional.id": tid,
            "transaction.timeout.ms": self.transaction_timeout_ms,
            "enable.idempotence": True,
            "acks": "all",
            "debug": "eos",
            "statistics.interval.ms": 1000,
        })
        conf.setdefault("allow.auto.create.topics", self.auto_create_topics)
        # The Java client's partitioner (murmur2 of the key; Spark's Kafka sink, Kafka Streams and
        # every Java producer use it), not librdkafka's default CRC32: a key lands on the partition
        # it lands on from them, so per-key order, compaction and co-partitioning hold across them.
        conf.setdefault("partitioner", "murmur2_random")
        conf.setdefault("linger.ms", 5)
        conf.setdefault("client.id", f"twophase-{tid}")
        # A producer lives for one transaction.  With sparse connections (librdkafka's default)
        # init_transactions found no broker connection up right after creation and waited for
        # librdkafka's coordinator query timer: 50 ms typically, 500 ms for about one in ten.
        # Connecting to the brokers at once makes it a few ms (benchmarks/kafka.py --txn-cost).
        conf.setdefault("enable.sparse.connections", False)

        # Delivery reports for failed records only: a Python callback per delivered record cost
        # about a third of produce time (benchmarks/kafka.py); errors are all the sink needs.
        conf["delivery.report.only.error"] = True

        def on_delivery(err, msg):
            if err is None:
                return
            txn = txn_box[0]
            txn.error_count += 1
            if len(txn.delivery_errors) < 5:
                txn.delivery_errors.append(f"{msg.topic()}[{msg.partition()}]: {err.str()}")

        def on_error(err):
            if err.fatal():
                txn_box[0].fatal.append(err.str())
            else:
                _rdlog.debug("%s: %s", tid, err.str())

        def on_stats(s):
            try:
                txn_box[0].eos_stats = json.loads(s).get("eos") or {}
            except ValueError:
                pass

        conf["on_delivery"] = on_delivery
        conf["error_cb"] = on_error
        conf["stats_cb"] = on_stats
        return conf

    def begin_transaction(self, ctx: TransactionContext) -> KafkaTransaction:
        """Claim a free transactional id of the partition, initialise a producer on it, begin (executor).

        1. Describe the partition's ``slots_per_partition`` ids, then the plan fence.  A fence
           past the INTENT's epoch means a newer execution of this batch, or a later batch, was
           planned: this attempt is late and stops before touching any id.
        2. Take the first id with no transaction open or closing, starting from the slot of the
           attempt's number (so that the attempts of one stage attempt, a retry and the zombie it
           replaced, never race for one id while there are slots enough), and claim it with a
           conditional InitProducerId from the producer id and epoch just described (an id the
           broker does not know yet: from an impossible producer id, which only a new id
           accepts).  The broker refuses if the id moved meanwhile.  An id with an open
           transaction is never claimed: InitProducerId would abort it, whatever epoch it
           expects, and it may be a decided one.  One that the INTENT lists as open before the
           plan is a leftover of a closed execution: it is aborted (EndTxn under its exact epoch),
           and claimed once the abort is complete if no other id is free.
        3. librdkafka's ``init_transactions`` (an unconditional InitProducerId) must then land
           exactly one epoch after the claim; otherwise another attempt initialised the id in
           between, and this one gives the id up (nothing of it is open) and tries the next.

        A fresh producer per transaction; no earlier attempt's transaction is fenced (each attempt
        has an id of its own; the batch's cleanup aborts what failed attempts left open).
        """
        from twophase.sinks import _kafka_protocol as kp

        tids = ctx.intent.get("transactional_ids")
        if tids is None:
            raise TwoPhaseError(f"{ctx.label}: the batch INTENT has no transactional ids (was it planned "
                                "by another sink?)")
        pool = ctx.intent.get("pool")
        if not isinstance(pool, dict) or pool.get("version") != POOL_VERSION:
            raise TwoPhaseError(
                f"{ctx.label}: the batch INTENT was planned by an earlier twophase version (one transactional "
                "id per partition, no claims); nothing was written. Its replay plans the batch again.")
        r, n = int(pool["slots"]), int(pool["partitions"])
        if ctx.partition_id >= n:
            raise TwoPhaseError(f"{ctx.label}: partition {ctx.partition_id} is outside the batch INTENT "
                                f"({n} partitions planned); nothing was written")
        slots = list(tids[ctx.partition_id * r:(ctx.partition_id + 1) * r])
        # Each attempt number starts on a slot of its own: a retry and the zombie attempt it replaced
        # (paused, cut off) are alive at once, and two claimants of one slot can abort each other's
        # transaction (a claim from a stale look at the slot's state, see docs/kafka.md).
        k = ctx.attempt % r
        slots = slots[k:] + slots[:k]
        client = self._task_client()
        states = self._describe(client, slots)
        self._check_plan_fence(ctx, client, pool)  # after the ids: a plan seen here precedes them
        snapshot = pool.get("open") or {}
        tried: list[str] = []
        freed: list[str] = []
        for tid in slots:
            d = states.get(tid)
            if d is None:
                tried.append(f"{tid}: no answer from its transaction coordinator")
                continue
            if d.error_code == kp.TRANSACTIONAL_ID_NOT_FOUND:
                expect = None  # never used: only a new id accepts the impossible producer id
            elif d.error_code != kp.NONE:
                tried.append(f"{tid}: {kp.error_name(d.error_code)}")
                continue
            elif d.state == "Ongoing" and snapshot.get(tid) == [d.producer_id, d.producer_epoch]:
                if self._abort_open(client, tid, d.producer_id, d.producer_epoch, ctx.label, wait=False):
                    freed.append(tid)
                tried.append(f"{tid}: held a transaction left open before this batch was planned (aborted)")
                continue
            elif d.state not in _CLAIMABLE:
                tried.append(f"{tid}: {d.state} under producer id {d.producer_id} epoch {d.producer_epoch}")
                continue
            else:
                expect = (d.producer_id, d.producer_epoch)
            txn = self._claim(ctx, client, tid, expect, tried)
            if txn is not None:
                return txn
        # Every other id is taken: one whose leftover this attempt just aborted is free once the
        # broker has completed the abort (its markers written).  Described again, then claimed.
        deadline, delay = time.monotonic() + self.request_timeout_s, 0.02
        while freed and time.monotonic() < deadline:
            time.sleep(delay)
            delay = min(delay * 2, 0.5)
            states = self._describe(client, freed)
            self._check_plan_fence(ctx, client, pool)
            waiting = []
            for tid in freed:
                d = states.get(tid)
                if d is not None and d.error_code == kp.NONE and d.state in _CLAIMABLE:
                    txn = self._claim(ctx, client, tid, (d.producer_id, d.producer_epoch), tried)
                    if txn is not None:
                        return txn
                elif d is not None and d.error_code == kp.NONE and d.state == "PrepareAbort":
                    waiting.append(tid)
            freed = waiting
        raise TwoPhaseError(
            f"{ctx.label}: none of the {len(slots)} transactional ids of partition {ctx.partition_id} could be "
            f"claimed: {'; '.join(tried)}. Nothing was written. Other attempts of this partition hold them "
            "(raise slots_per_partition above spark.task.maxFailures if task attempts run out of ids); "
            "the batch's cleanup aborts what failed attempts left open.")

    def _check_plan_fence(self, ctx: TransactionContext, client, pool: dict[str, Any]) -> None:
        """Raise unless the plan fence still holds the epoch of this attempt's INTENT (executor)."""
        from twophase.sinks import _kafka_protocol as kp

        fence = str(pool["fence"])
        st = self._describe(client, [fence]).get(fence)
        if st is None or st.error_code != kp.NONE:
            why = "no answer" if st is None else kp.error_name(st.error_code)
            raise TwoPhaseError(f"{ctx.label}: cannot read the plan fence {fence} ({why}); nothing was "
                                "written")
        if [st.producer_id, st.producer_epoch] != list(pool["fence_producer"]):
            raise TwoPhaseError(
                f"{ctx.label}: this task attempt is late: its execution of batch {ctx.batch_id} was closed, or a "
                f"newer one or a later batch was planned after its own (the plan fence {fence} is at producer id {st.producer_id} "
                f"epoch {st.producer_epoch}, its INTENT's at {pool['fence_producer']}). It claims no "
                "transactional id and writes nothing.")

    def _claim(self, ctx: TransactionContext, client, tid: str, expect: tuple[int, int] | None,
               tried: list[str]) -> KafkaTransaction | None:
        """Claim ``tid`` from ``expect`` (None: a new id), then initialise a producer on it; None if lost."""
        from twophase.sinks import _kafka_protocol as kp

        ck = require("confluent_kafka", "KafkaSink")
        pid, epoch = expect if expect is not None else (kp.UNUSED_PRODUCER_ID, 0)
        deadline = time.monotonic() + self.request_timeout_s
        delay = 0.02
        while True:
            code, cpid, cepoch = client.init_producer_id(tid, self.transaction_timeout_ms, pid, epoch)
            if code == kp.NONE:
                break
            if code in (kp.PRODUCER_FENCED, kp.INVALID_PRODUCER_EPOCH, kp.INVALID_PRODUCER_ID_MAPPING,
                        kp.CONCURRENT_TRANSACTIONS):
                tried.append(f"{tid}: taken by another attempt ({kp.error_name(code)})")
                return None
            if code in kp.RETRIABLE and time.monotonic() < deadline:
                # A claim that was applied but whose answer was lost is answered again, unbumped.
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            if code in kp.RETRIABLE:
                tried.append(f"{tid}: {kp.error_name(code)} for {self.request_timeout_s:.0f}s")
                return None
            raise TwoPhaseError(f"{ctx.label}: cannot claim transactional id {tid} on {self.bootstrap_servers}: "
                                f"{kp.error_name(code)}. Check the ACLs for transactional ids with this prefix "
                                "(Write); nothing was written.")
        handler = _LibrdkafkaLog(f"{ctx.label} ({tid})")
        rdk_logger = logging.Logger(f"twophase.rdkafka.{tid}")
        rdk_logger.setLevel(logging.DEBUG)
        rdk_logger.addHandler(handler)
        box: list = [None]
        conf = self._producer_config(tid, box)
        conf["logger"] = rdk_logger
        producer = ck.Producer(conf)
        txn = KafkaTransaction(ctx, tid, producer, handler, started_at=time.time())
        box[0] = txn
        try:
            producer.init_transactions(self.request_timeout_s * 2)
        except ck.KafkaException as e:
            self._release(txn)
            raise TwoPhaseError(f"{ctx.label}: cannot start a Kafka transaction as {tid} on "
                                f"{self.bootstrap_servers}: {e.args[0].str() if e.args else e}") from None
        got = self._producer_id_epoch(txn)
        if got != (cpid, cepoch + 1):
            # Someone else's InitProducerId landed between our claim and librdkafka's: the id is
            # not ours.  Nothing of ours is open on it; the producer goes.
            self._release(txn)
            tried.append(f"{tid}: initialised by another attempt between this one's claim (epoch {cepoch}) and "
                         f"its producer ({'unknown' if got is None else f'producer id {got[0]} epoch {got[1]}'})")
            return None
        txn.claimed = (cpid, cepoch)
        try:
            producer.begin_transaction()
        except ck.KafkaException as e:
            self._release(txn)
            raise TwoPhaseError(f"{ctx.label}: cannot begin a Kafka transaction as {tid}: "
                                f"{e.args[0].str() if e.args else e}") from None
        txn.started_at = time.time()
        return txn

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

    def _check_topic(self, txn: KafkaTransaction, topic: str) -> None:
        """Fail before producing to a topic that does not exist (unless auto_create_topics).

        One metadata request per topic and Python worker every TOPIC_CHECK_TTL_S seconds,
        not one per transaction.
        """
        if topic in txn.checked_topics:
            return
        key = (self.bootstrap_servers, topic)
        seen = _TOPICS_SEEN.get(key)
        if not self.auto_create_topics and (seen is None
                                            or time.monotonic() - seen > TOPIC_CHECK_TTL_S):
            md = txn.producer.list_topics(topic, timeout=self.request_timeout_s)
            t = md.topics.get(topic)
            if t is None or t.error is not None:
                raise TwoPhaseError(
                    f"{txn.ctx.label}: topic {topic!r} does not exist on {self.bootstrap_servers} "
                    "(KafkaSink(auto_create_topics=False)); create it and restart the query. Nothing of this "
                    "batch was committed.")
            _TOPICS_SEEN[key] = time.monotonic()
        txn.checked_topics.add(topic)

    def write(self, txn: KafkaTransaction, batch: pa.RecordBatch) -> None:
        """Produce the rows of one Arrow batch inside the transaction (executor)."""
        ck = require("confluent_kafka", "KafkaSink")
        ctx, names = txn.ctx, batch.schema.names
        if "value" not in names:
            raise TwoPhaseError(f"{ctx.label}: KafkaSink needs a 'value' column (binary or string), as "
                                f"Spark's Kafka sink; columns are {names}")
        for col in ("key", "value"):
            if col in names and not _is_binaryish(batch.schema.field(col).type):
                raise TwoPhaseError(f"{ctx.label}: column {col!r} must be binary or string, not "
                                    f"{batch.schema.field(col).type} (cast it, as for Spark's Kafka sink)")
        value_col = batch.column(names.index("value"))
        if value_col.null_count and not self.tombstones:
            first = value_col.is_null().to_pylist().index(True)
            raise TwoPhaseError(
                f"{ctx.label}: column 'value' is null in row {txn.rows + first} of this partition. Fix the "
                "input (or pass KafkaSink(tombstones=True) to write nulls as tombstones); nothing of this "
                "batch was committed and its replay writes it again.")
        values = value_col.to_pylist()
        n = len(values)
        keys = batch.column(names.index("key")).to_pylist() if "key" in names else None
        if self.topic is not None:
            topics = None
            self._check_topic(txn, self.topic)
            txn.topics.add(self.topic)
        elif "topic" in names:
            topics = batch.column(names.index("topic")).to_pylist()
            for t in set(topics):
                if t is None:
                    raise TwoPhaseError(f"{ctx.label}: column 'topic' is null and KafkaSink has no topic=...")
                self._check_topic(txn, t)
                txn.topics.add(t)
        else:
            raise TwoPhaseError(f"{ctx.label}: no topic: give KafkaSink(topic=...) or a 'topic' column")
        parts = batch.column(names.index("partition")).to_pylist() if "partition" in names else None
        headers = batch.column(names.index("headers")).to_pylist() if "headers" in names else None

        produce, poll = txn.producer.produce, txn.producer.poll
        topic = self.topic

        def refused(i: int, t: str | None, e: Exception) -> TwoPhaseError:
            err = e.args[0] if e.args else e
            return TwoPhaseError(
                f"{ctx.label}: Kafka refused row {txn.rows + i} for topic {t!r}: "
                f"{err.str() if hasattr(err, 'str') else err}. Fix the input; nothing of this batch "
                "was committed.")

        def produce_when_room(i: int, args: tuple, kwargs: dict[str, Any]) -> None:
            while True:  # the local queue is full: serve the producer, then retry
                poll(0.05)
                try:
                    produce(*args, **kwargs)
                    return
                except BufferError:
                    continue
                except ck.KafkaException as e:
                    raise refused(i, args[0], e) from None

        # Rows go in chunks of 1000, with a poll (delivery errors, queue room) after each chunk.
        for start in range(0, n, 1000):
            stop = min(n, start + 1000)
            if topics is None and parts is None and headers is None:  # the common shape: a tight loop
                i = start
                while i < stop:
                    j = i  # the loops leave j at the row that raised
                    try:
                        if keys is None:
                            for j in range(i, stop):
                                produce(topic, values[j])
                        else:
                            for j in range(i, stop):
                                produce(topic, values[j], keys[j])
                        break
                    except BufferError:
                        args: tuple = (topic, values[j], keys[j]) if keys is not None else (topic, values[j])
                        produce_when_room(j, args, {})
                        i = j + 1
                    except ck.KafkaException as e:
                        raise refused(j, topic, e) from None
            else:
                for i in range(start, stop):
                    t = topic if topics is None else topics[i]
                    args = (t, values[i], keys[i] if keys is not None else None)
                    kwargs: dict[str, Any] = {}
                    if parts is not None and parts[i] is not None:
                        kwargs["partition"] = int(parts[i])
                    if headers is not None and headers[i]:
                        kwargs["headers"] = [(h["key"], h["value"]) for h in headers[i]]
                    try:
                        produce(*args, **kwargs)
                    except BufferError:
                        produce_when_room(i, args, kwargs)
                    except ck.KafkaException as e:
                        raise refused(i, t, e) from None
            poll(0)
            if txn.error_count or txn.fatal:
                break
        txn.rows += n
        self._raise_errors(txn)

    def _raise_errors(self, txn: KafkaTransaction) -> None:
        if txn.fatal:
            raise TwoPhaseError(f"{txn.ctx.label}: the producer for {txn.transactional_id} failed: "
                                f"{txn.fatal[0]} (fenced by a newer attempt of this partition?)")
        if txn.error_count:
            raise TwoPhaseError(
                f"{txn.ctx.label}: {txn.error_count} records were not delivered to Kafka, e.g. "
                f"{'; '.join(txn.delivery_errors)}. Nothing of this batch was committed; fix the cause "
                "and its replay writes it again.")

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

    def pre_commit(self, txn: KafkaTransaction) -> dict:
        """Flush with zero delivery errors; return (id, producer id, epoch, topics, first offsets) (executor).

        Then the producer is released (:meth:`_release`): destroyed, never closed, so its
        transaction stays open for the driver's commit and no threads, sockets or
        statistics are left behind in the Python worker.  ``txn_start_offsets`` holds, for each topic
        partition the transaction wrote to, the offset of its first record there
        (DescribeTransactions for the partitions, DescribeProducers for the offsets): if a later
        commit finds the id moved on, that record tells whether the transaction was committed
        (:meth:`commit`).  Best effort: a handle without it is committed the same way.
        """
        remaining = txn.producer.flush(self.flush_timeout_s)
        if remaining:
            raise TwoPhaseError(f"{txn.ctx.label}: {remaining} records still undelivered after "
                                f"{self.flush_timeout_s:.0f}s (flush_timeout_s); nothing was committed")
        txn.producer.poll(0)  # serve remaining log lines and callbacks
        self._raise_errors(txn)
        pid_epoch = (txn.claimed[0], txn.claimed[1] + 1) if txn.claimed is not None else None
        if pid_epoch is None:
            pid_epoch = self._producer_id_epoch(txn)
            if pid_epoch is None:
                raise TwoPhaseError(f"{txn.ctx.label}: could not read the producer id and epoch of "
                                    f"{txn.transactional_id} from librdkafka; nothing was committed")
        offsets = self._first_offsets(txn, pid_epoch)
        txn.done = True
        handle = {"transactional_id": txn.transactional_id, "producer_id": pid_epoch[0],
                  "producer_epoch": pid_epoch[1],
                  "topics": sorted(txn.topics),
                  "rows": txn.rows, "started_at": round(txn.started_at, 3),
                  "timeout_ms": self.transaction_timeout_ms}
        if offsets:
            handle["txn_start_offsets"] = offsets
            # Name the incarnation of each topic the records are in: a topic deleted and recreated
            # under its name holds another transaction's record at the same offset (_records_fate).
            ids = self._topic_ids(txn, sorted({tp.rpartition(":")[0] for tp in offsets}))
            if ids:
                handle["txn_topic_ids"] = ids  # sorts after transactional_id: `twophase status` cuts handles at 200 characters
        self._release(txn)
        return handle

    def _first_offsets(self, txn: KafkaTransaction, pid_epoch: tuple[int, int]) -> dict[str, int]:
        """{"topic:partition": offset of the transaction's first record there} (executor; best effort).

        Raises if the broker shows the transaction is no longer open under this producer id and
        epoch (another actor initialised the id): such a handle could never be committed.
        """
        from twophase.sinks import _kafka_protocol as kp

        tid = txn.transactional_id
        try:
            client = self._task_client()
            st = client.describe_transactions([tid]).get(tid)
            if st is None or st.error_code != kp.NONE:
                return {}
            if st.state != "Ongoing" or (st.producer_id, st.producer_epoch) != tuple(pid_epoch):
                raise TwoPhaseError(
                    f"{txn.ctx.label}: the transaction of {tid} (producer id {pid_epoch[0]}, epoch "
                    f"{pid_epoch[1]}) is no longer open: the broker reports {st.state} under producer id "
                    f"{st.producer_id} epoch {st.producer_epoch} (another actor initialised the id). "
                    "Nothing of it can be committed.")
            found = client.describe_producers(list(st.partitions))
        except TwoPhaseError:
            raise
        except Exception as e:  # noqa: BLE001 - an optional extra of the handle
            log.debug("%s: could not read the first offsets of %s: %s", txn.ctx.label, tid, e)
            return {}
        return {tp: e.txn_start_offset for tp, entries in sorted(found.items()) for e in entries
                if e.producer_id == pid_epoch[0] and e.txn_start_offset >= 0}

    def _topic_ids(self, txn: KafkaTransaction, topics: list[str]) -> dict[str, str]:
        """{topic: its topic id (UUID)} for the handle (executor; best effort, after the flush)."""
        try:
            return self._task_client().topic_ids(topics)
        except Exception as e:  # noqa: BLE001 - an optional extra of the handle
            log.debug("%s: could not read the topic ids of %s: %s", txn.ctx.label, topics, e)
            return {}

    def abort(self, txn: KafkaTransaction) -> None:
        """Abort the open transaction (executor; best effort).  Never called after pre_commit."""
        if txn.done:
            return
        txn.done = True
        try:
            txn.producer.abort_transaction(self.request_timeout_s)
        except Exception as e:  # the next attempt's init_transactions fences it anyway
            log.debug("%s: abort_transaction failed: %s", txn.ctx.label, e)
        self._release(txn)
