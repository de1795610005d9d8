"""Where a :class:`~twophase.sinks.kafka.KafkaSink` is built (the driver, or an operator tool from a
config): the defaults of its options, the checks of its transactional id prefix and producer
settings (the settings the sink owns, the Java client's settings librdkafka does not know), and
:func:`check_producer_settings`, which the ``twophase-kafka`` data source also runs on its
``kafka.*`` options (``sinks/spark_kafka.py``)."""

from __future__ import annotations

import re
from typing import Any

from twophase.errors import ConfigurationError

#: Default transaction timeout: 5 minutes, a third of the broker's default maximum
#: (``transaction.max.timeout.ms``, 15 min).  It bounds how long a dead driver that nobody
#: restarts holds back ``read_committed`` readers (the timeout plus the broker's abort sweep,
#: ``benchmarks/lso.py``), and no longer loses a decided batch (a batch whose transactions all
#: timed out is proven never visible and runs again).  A batch's prepare phase may take it minus
#: ``commit_margin_ms``.
DEFAULT_TRANSACTION_TIMEOUT_MS = 300_000

#: Transactional ids per partition in the pool (``KafkaSink(slots_per_partition=...)``): Spark's
#: default ``spark.task.maxFailures``, so each attempt of a task can take an id of its own.
DEFAULT_SLOTS_PER_PARTITION = 4

#: Default part of the timeout kept for the commit and a driver restart (see ``commit_margin_ms``):
#: 5 minutes, or a third of ``transaction_timeout_ms`` when that is shorter than 15 minutes (100 s
#: with the default timeout).
DEFAULT_COMMIT_MARGIN_MS = 300_000

_PREFIX_OK = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
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
