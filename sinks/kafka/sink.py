"""The driver: :class:`KafkaSink`, the class users construct: its options, ``open`` (the broker
checked before the first batch) and its config; assembled from the parts that say where they run:
``pool.py`` (driver: the transactional-id pool, plans, cleanup), ``committer.py`` (driver: verify,
commit, verdicts, recovery), ``claims.py`` and ``writer.py`` (executor tasks: claim an id, produce,
pre-commit, abort).  A sink object is built on the driver and pickled to the executors."""

from __future__ import annotations

import threading
from typing import Any

from twophase._deps import require
from twophase.config import is_secret_ref
from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink
from twophase.sinks.kafka.claims import _Claims
from twophase.sinks.kafka.committer import _Committer
from twophase.sinks.kafka.common import TRANSACTIONAL_IDS, KafkaTransaction, log
from twophase.sinks.kafka.pool import _Pool
from twophase.sinks.kafka.settings import (
    _OWNED,
    _PREFIX_OK,
    _SECRET_KEY,
    DEFAULT_COMMIT_MARGIN_MS,
    DEFAULT_SLOTS_PER_PARTITION,
    DEFAULT_TRANSACTION_TIMEOUT_MS,
    check_producer_settings,
)
from twophase.sinks.kafka.writer import _Writer


class KafkaSink(_Pool, _Committer, _Claims, _Writer, TwoPhaseCommitSink[KafkaTransaction, dict]):
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
    ids for the life of the query.  ``transactional_ids``: ``"auto"`` (the default) plans a
    streaming query's batches on that pool and gives each ballot of a batch job
    (``Coordinator.write``, ``df.write.format("twophase-kafka")``) ids of its own,
    ``{prefix}-{pid}.{epoch}-{partition}.{slot}``, each claimed once, since two runs of a batch
    job may overlap; ``"per-plan"`` does that for streaming batches too (no late claim or
    InitProducerId of another attempt can abort a transaction on them, at the price of new ids
    on the brokers every batch, kept until ``transactional.id.expiration.ms``); ``"pool"`` plans
    batch jobs on the pool too (docs/kafka.md, "How it recovers").
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
                 slots_per_partition: int = DEFAULT_SLOTS_PER_PARTITION,
                 transactional_ids: str = "auto"):
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
        if transactional_ids not in TRANSACTIONAL_IDS:
            raise ConfigurationError(f"transactional_ids must be one of {', '.join(map(repr, TRANSACTIONAL_IDS))}, "
                                     f"got {transactional_ids!r}")
        self.transactional_ids = transactional_ids
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
        state.setdefault("transactional_ids", "auto")  # pickled by a version before the option
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
                "slots_per_partition": self.slots_per_partition,
                "transactional_ids": self.transactional_ids}

    def close(self) -> None:
        """Close the driver's cached connections (optional; a new one opens on demand)."""
        if self._client is not None:
            self._client.close()
            self._client = None

    def executor_modules(self) -> list[str]:
        # kafka-python: a task claims its transactional id (conditional InitProducerId) and reads
        # where its records landed (DescribeProducers), which librdkafka cannot ask.
        return ["pyarrow", "confluent_kafka", "kafka"]

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
