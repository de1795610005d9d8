"""``format("twophase-kafka")``: Spark's Kafka sink options as :class:`~twophase.sinks.kafka.KafkaSink`'s
configuration, the Java client's security settings translated to librdkafka's (the data source
machinery is ``twophase.datasource``; the registry entry is ``twophase.config.BUILTIN_FORMATS``)."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

from twophase.config import SparkFormat, local_location
from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink

#: Producer settings KafkaSink owns, with the values it sets itself (lower case): given so, accepted.
_AGREEING = {"acks": ("all", {"all", "-1"}), "request.required.acks": ("all", {"all", "-1"}),
             "enable.idempotence": ("true", {"true"})}

#: Producer settings KafkaSink owns that a by-name user sets with an option of its own.
_BY_NAME = {"transaction.timeout.ms": "twophase.transactionTimeoutMs",
            "transactional.id": "twophase.transactionalIdPrefix"}


def build(options: Mapping[str, str]) -> TwoPhaseCommitSink[Any, Any]:
    """A KafkaSink from Spark's Kafka sink options; what it cannot mean is refused by name."""
    from twophase.sinks.kafka import KafkaSink, check_producer_settings

    servers = options.get("kafka.bootstrap.servers")
    if not servers:
        raise ConfigurationError("twophase-kafka needs .option('kafka.bootstrap.servers', 'host:port')")
    producer = {k[len("kafka."):]: v for k, v in options.items()
                if k.startswith("kafka.") and k != "kafka.bootstrap.servers"}
    spark_only = sorted(k for k in producer if k in ("key.serializer", "value.serializer"))
    if spark_only:
        raise ConfigurationError(f"twophase-kafka: kafka.{spark_only[0]} is not supported (as in Spark's "
                                 "Kafka sink, key and value are written as bytes)")
    for key, option in _BY_NAME.items():  # KafkaSink's refusal names a constructor argument
        if key in producer:
            raise ConfigurationError(f"twophase-kafka: kafka.{key} is the sink's own setting; use "
                                     f".option('{option}', ...) instead")
    # Settings the sink owns, given with the value the sink sets anyway (a job that set them for
    # Spark's sink): the same meaning, so accepted.  Another value is refused, naming the option.
    for key, (value, agree) in _AGREEING.items():
        if key in producer:
            if str(producer[key]).strip().lower() not in agree:
                raise ConfigurationError(
                    f"twophase-kafka: kafka.{key}={producer[key]} cannot be: Kafka transactions need "
                    f"{key}={value}, which the sink sets itself; drop the option")
            del producer[key]
    # Spark's sink writes a null value as a tombstone; kafka.allow.auto.create.topics=true lets the
    # producer create a missing topic, so the sink's own missing-topic check is lifted with it.
    auto_create = str(producer.get("allow.auto.create.topics", "false")).strip().lower() == "true"
    producer = java_security_to_librdkafka(producer)
    try:  # librdkafka's own message would not name the option, nor say it is a Java client's setting
        check_producer_settings(producer, option_prefix="kafka.")
    except ConfigurationError as e:
        raise ConfigurationError(f"twophase-kafka: {e}") from None
    prefix = options.get("twophase.transactionalidprefix")
    if not prefix:  # stable across restarts, one per query (or per log, for batch writes)
        where = local_location(options.get("checkpointlocation") or options.get("twophase.loglocation") or "")
        prefix = f"twophase-{hashlib.sha256(where.encode()).hexdigest()[:12]}"
    timeout = options.get("twophase.transactiontimeoutms")
    extra: dict[str, Any] = {}
    if timeout:
        try:
            extra["transaction_timeout_ms"] = int(timeout)
        except ValueError:
            raise ConfigurationError(f"twophase.transactionTimeoutMs must be milliseconds, got {timeout!r}") from None
    ids = options.get("twophase.transactionalids")
    if ids:
        from twophase.sinks.kafka.common import TRANSACTIONAL_IDS

        if ids.strip().lower() not in TRANSACTIONAL_IDS:
            raise ConfigurationError(f"twophase.transactionalIds must be one of {', '.join(TRANSACTIONAL_IDS)}, "
                                     f"got {ids!r}")
        extra["transactional_ids"] = ids.strip().lower()
    return KafkaSink(servers, options.get("topic"), prefix, producer_config=producer or None,
                     tombstones=True, auto_create_topics=auto_create, **extra)


_JAAS_VALUE = re.compile(r'(\w+)\s*=\s*"((?:[^"\\]|\\.)*)"')


def java_security_to_librdkafka(config: dict[str, str]) -> dict[str, str]:
    """Spark's Kafka sink takes the Java client's security settings (``kafka.sasl.jaas.config``, a
    truststore); KafkaSink's producers are librdkafka's.  Translate those a Spark user sets, and
    refuse, naming the option (never its value), what librdkafka cannot read:

    - ``sasl.jaas.config`` with ``PlainLoginModule`` or ``ScramLoginModule``: its ``username`` and
      ``password`` become ``sasl.username`` / ``sasl.password``;
    - ``ssl.truststore.location`` of type PEM becomes ``ssl.ca.location`` (JKS and PKCS12 refused);
    - ``ssl.keystore.location`` of type PEM becomes ``ssl.certificate.location`` and
      ``ssl.key.location`` (a PKCS12 keystore goes on as is: the sink says what it needs);
    - ``ssl.endpoint.identification.algorithm`` empty (the Java client's "no check") becomes ``none``.

    Every other setting goes on unchanged (``security.protocol``, ``sasl.mechanism``,
    ``ssl.key.password`` and most producer settings have the same names in both clients).
    """
    out = dict(config)
    jaas = out.pop("sasl.jaas.config", None)
    if jaas is not None:
        module = (jaas.split() or [""])[0].rsplit(".", 1)[-1]
        if module not in ("PlainLoginModule", "ScramLoginModule"):
            raise ConfigurationError(
                f"twophase-kafka: kafka.sasl.jaas.config with {module or 'no login module'} is not translated "
                "(the producers are librdkafka's): give librdkafka's settings instead, e.g. "
                "kafka.sasl.oauthbearer.method and kafka.sasl.oauthbearer.* for OAUTHBEARER")
        values = {k: re.sub(r"\\(.)", r"\1", v) for k, v in _JAAS_VALUE.findall(jaas)}  # \" and \\ unescaped
        if "username" not in values or "password" not in values:
            raise ConfigurationError(f"twophase-kafka: kafka.sasl.jaas.config ({module}) needs username=\"...\" "
                                     "and password=\"...\"")
        out.setdefault("sasl.username", values["username"])
        out.setdefault("sasl.password", values["password"])
    store = out.pop("ssl.truststore.location", None)
    store_type = (out.pop("ssl.truststore.type", None) or "JKS").upper()
    if store is not None:
        if store_type != "PEM":
            raise ConfigurationError(
                f"twophase-kafka: kafka.ssl.truststore.location is a {store_type} truststore, which librdkafka "
                "(the producers' client) cannot read: export its CA certificates as PEM (keytool -exportcert -rfc "
                "-keystore ...) and give kafka.ssl.ca.location instead")
        out.setdefault("ssl.ca.location", store)
        out.pop("ssl.truststore.password", None)  # a PEM file has none
    key_type = (out.get("ssl.keystore.type") or "").upper()
    if key_type == "PEM" and "ssl.keystore.location" in out:
        out.pop("ssl.keystore.type")
        pem = out.pop("ssl.keystore.location")
        out.setdefault("ssl.certificate.location", pem)
        out.setdefault("ssl.key.location", pem)
    elif key_type == "JKS":
        raise ConfigurationError("twophase-kafka: kafka.ssl.keystore.location is a JKS keystore, which librdkafka "
                                 "cannot read: convert it to PEM (or PKCS12) and give kafka.ssl.certificate.location "
                                 "and kafka.ssl.key.location")
    else:
        out.pop("ssl.keystore.type", None)
    if out.get("ssl.endpoint.identification.algorithm") == "":
        out["ssl.endpoint.identification.algorithm"] = "none"
    return out


FORMAT = SparkFormat(
    kind="kafka",
    build=build,
    #: ``includeheaders``: Spark's Kafka *source* option, which its sink ignores (a ``headers``
    #: column is written when the rows have one); so does this one.
    known_options=frozenset({"topic", "twophase.transactionalidprefix", "twophase.transactiontimeoutms",
                             "twophase.transactionalids",
                             "includeheaders"}),
    passed_prefixes=("kafka.",),
    appends_in_complete_mode=True,
    #: Each planned partition is a few pooled transactional ids described at every plan.
    default_max_partitions=64,
    doc="""``format("twophase-kafka")``: Kafka transactions, with the options of Spark's Kafka sink:
    ``kafka.bootstrap.servers``, ``topic`` (else a ``topic`` column), every other ``kafka.*``
    option to the producer (security settings included); the rows' ``value`` (and ``key``)
    columns, binary or string, as Spark's Kafka sink.  Transactional ids come from a pool named
    ``twophase.transactionalIdPrefix`` (default: derived from checkpointLocation, so stable
    across restarts and unique per query).""",
)
