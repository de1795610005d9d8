"""The data sources' options as docs/datasource.md lists them ("Options"), and the by-name refusal
of the Kafka producer settings that have an option of their own."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from twophase.datasource import _COMMON, FilesDataSource, JdbcDataSource, KafkaDataSource
from twophase.errors import ConfigurationError

REPO = Path(__file__).resolve().parent.parent
SOURCES = {"files": FilesDataSource, "jdbc": JdbcDataSource, "kafka": KafkaDataSource}


def _table() -> dict[str, tuple[str, str]]:
    """option -> (formats cell, default cell) of the table under "## Options"."""
    text = (REPO / "docs" / "datasource.md").read_text()
    section = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)` \| ([^|]+) \| ([^|]+) \|", line)
        if m:
            rows[m.group(1)] = (m.group(2).strip(), m.group(3).strip())
    return rows


def test_the_options_table_lists_every_option_each_format_reads():
    """Every option a format reads is in "Options" or in its table of Spark's options (the csv and
    json writer options are there), and every option "Options" lists is read."""
    from tests.test_datasource_option_table import ROWS

    table = _table()
    for kind, cls in SOURCES.items():
        documented = {o.lower() for o, (formats, _) in table.items() if formats.startswith(("all", kind))}
        spark_rows = {option.lower() for name, option, *_ in ROWS if name == f"twophase-{kind}"}
        read = set(_COMMON) | set(cls.known_options) | {f"{p}*" for p in cls.passed_prefixes}
        if kind == "kafka":
            read.add("kafka.bootstrap.servers")  # one of the kafka.* options, required
        assert documented <= read, (kind, sorted(documented - read))
        assert read <= documented | spark_rows, (kind, sorted(read - documented - spark_rows))


def test_the_files_format_reads_the_options_its_sink_translates():
    from twophase.sinks.files import SPARK_FILE_OPTIONS

    own = {o for o in SPARK_FILE_OPTIONS if not o.startswith("fs.s3a.")}
    assert set(FilesDataSource.known_options) == own | {"prefix"}
    assert FilesDataSource.passed_prefixes == ("fs.s3a.",)


def test_the_options_table_gives_max_partitions_default_as_the_code_has_it():
    _, default = _table()["twophase.maxPartitions"]
    assert default == (f"{FilesDataSource.default_max_partitions} "
                       f"(`twophase-kafka`: {KafkaDataSource.default_max_partitions})")
    assert FilesDataSource.default_max_partitions == JdbcDataSource.default_max_partitions


KAFKA = {"kafka.bootstrap.servers": "broker:9092", "checkpointlocation": "/tmp/ck"}


@pytest.mark.parametrize("setting,option", [("transaction.timeout.ms", "twophase.transactionTimeoutMs"),
                                            ("transactional.id", "twophase.transactionalIdPrefix")])
def test_a_kafka_setting_the_sink_owns_is_refused_naming_the_option_that_sets_it(setting, option):
    with pytest.raises(ConfigurationError) as e:
        KafkaDataSource(dict(KAFKA, **{f"kafka.{setting}": "60000"})).build_sink()
    assert f"kafka.{setting}" in str(e.value) and f".option('{option}', ...)" in str(e.value)
    assert "KafkaSink(" not in str(e.value)


def test_the_by_name_options_reach_the_kafka_sink():
    sink = KafkaDataSource(dict(KAFKA, **{"twophase.transactiontimeoutms": "60000",
                                          "twophase.transactionalidprefix": "mine"})).build_sink()
    assert (sink.transaction_timeout_ms, sink.transactional_id_prefix) == (60000, "mine")


def test_kafka_settings_that_agree_with_the_sinks_own_are_accepted_and_others_refused_by_name():
    """Issue 47: a job written for Spark's Kafka sink often sets kafka.acks=all and
    kafka.enable.idempotence=true, which the transactions need anyway: accepted (before: refused)."""
    sink = KafkaDataSource(dict(KAFKA, **{"kafka.acks": "all", "kafka.enable.idempotence": "true",
                                          "kafka.linger.ms": "5"})).build_sink()
    assert sink.producer_config == {"linger.ms": "5"}
    KafkaDataSource(dict(KAFKA, **{"kafka.acks": "-1"})).build_sink()
    for setting, value in (("acks", "1"), ("enable.idempotence", "false")):
        with pytest.raises(ConfigurationError, match=rf"kafka\.{setting}={value} cannot be"):
            KafkaDataSource(dict(KAFKA, **{f"kafka.{setting}": value})).build_sink()


def test_the_kafka_format_writes_tombstones_and_lets_allow_auto_create_topics_create_as_sparks_sink():
    """Spark's sink writes a null value as a tombstone, and a producer allowed to create topics
    creates a missing one: the by-name form does the same (before: the batch failed, naming
    KafkaSink arguments no option reaches)."""
    sink = KafkaDataSource(dict(KAFKA)).build_sink()
    assert sink.tombstones and not sink.auto_create_topics
    sink = KafkaDataSource(dict(KAFKA, **{"kafka.allow.auto.create.topics": "true"})).build_sink()
    assert sink.auto_create_topics and sink.producer_config == {"allow.auto.create.topics": "true"}


def test_include_headers_is_accepted_as_sparks_kafka_sink_ignores_it():
    KafkaDataSource(dict(KAFKA, includeheaders="true"))._check_options()
    with pytest.raises(ConfigurationError, match="unknown option"):
        FilesDataSource({"path": "/tmp/x", "includeheaders": "true"})._check_options()


JDBC = {"url": "jdbc:postgresql://db1:5432,db2:5433/shop?ssl=true&currentSchema=sales&ApplicationName=etl"
               "&reWriteBatchedInserts=true", "dbtable": "public.Events", "checkpointlocation": "/tmp/ck"}


def test_the_jdbc_url_is_read_as_pgjdbc_reads_it_by_the_sinks_own_reader():
    """Issue 47: a second, naive translator refused ?ssl=true, currentSchema, ApplicationName,
    reWriteBatchedInserts and multi-host URLs (or raised a raw ValueError); the sink's own reader
    handles them, and names a property it refuses."""
    sink = JdbcDataSource(dict(JDBC, user="writer")).build_sink()
    assert sink.target() == "postgres database shop table public.events"
    p = sink.params
    assert (p["host"], p["port"], p["user"], p["sslmode"], p["application_name"]) == (
        "db1,db2", "5432,5433", "writer", "verify-full", "etl")
    assert p["options"] == "-c search_path=sales"
    with pytest.raises(ConfigurationError, match="'loginTimeoutX'"):
        JdbcDataSource(dict(JDBC, url="jdbc:postgresql://db/shop?loginTimeoutX=3")).build_sink()
    with pytest.raises(ConfigurationError, match="not in the url") as e:
        JdbcDataSource(dict(JDBC, url="jdbc:postgresql://db/shop?password=s3cret")).build_sink()
    assert "s3cret" not in str(e.value)


def test_dbtable_is_folded_as_postgresql_folds_an_unquoted_name():
    from twophase.sinks.spark_jdbc import jdbc_table

    assert jdbc_table("public.Events") == ("public", "events")
    assert jdbc_table('"Sales"."Events"') == ("Sales", "Events")
    assert jdbc_table("Events") == (None, "events")
    with pytest.raises(ConfigurationError, match=r"\[schema\.\]table"):
        jdbc_table("a.b.c")


@pytest.mark.parametrize("option,value,accepted", [
    ("batchsize", "5000", True), ("isolationlevel", "READ_COMMITTED", True), ("isolationlevel", "NONE", True),
    ("isolationlevel", "SERIALIZABLE", False), ("querytimeout", "0", True), ("querytimeout", "30", False),
    ("numpartitions", "8", False)])
def test_sparks_jdbc_writer_options_have_their_meaning_or_a_line_naming_them(option, value, accepted):
    ds = JdbcDataSource(dict(JDBC, **{option: value}))
    ds._check_options()
    if accepted:
        ds.build_sink()
    else:
        with pytest.raises(ConfigurationError, match=option.replace("level", "Level").replace("timeout", "Timeout")
                           .replace("partitions", "Partitions")):
            ds.build_sink()


@pytest.mark.parametrize("setting,advice", [
    ("buffer.memory", "use kafka.queue.buffering.max.kbytes (in KiB, not bytes)"),
    ("max.block.ms", "librdkafka has none"),
    ("max.request.size", "use kafka.message.max.bytes"),
    ("partitioner.class", "kafka.partitioner (a built-in name)"),
    ("ssl.truststore.password", "kafka.ssl.ca.location")])
def test_a_java_client_only_kafka_setting_is_refused_naming_the_option_and_librdkafkas_equivalent(setting, advice):
    """Issue 47: before, these failed at the first batch with librdkafka's 'No such configuration
    property' and without the option's name."""
    with pytest.raises(ConfigurationError) as e:
        KafkaDataSource(dict(KAFKA, **{f"kafka.{setting}": "1000"})).build_sink()
    assert str(e.value).startswith(f"twophase-kafka: kafka.{setting} is a setting of Kafka's Java client")
    assert advice in str(e.value)


def test_an_unknown_kafka_setting_is_refused_naming_the_option_and_librdkafkas_known_ones_pass():
    with pytest.raises(ConfigurationError, match=r"^twophase-kafka: kafka\.no\.such\.thing is not a producer "
                                                 r"setting of librdkafka"):
        KafkaDataSource(dict(KAFKA, **{"kafka.no.such.thing": "1"})).build_sink()
    # Settings both clients know by one name go on (the Java client's batch.size, linger.ms, ...).
    common = {"batch.size": "16384", "linger.ms": "5", "retries": "3", "compression.type": "lz4",
              "request.timeout.ms": "30000", "client.id": "etl", "delivery.timeout.ms": "120000",
              "max.in.flight.requests.per.connection": "5", "queue.buffering.max.kbytes": "1024"}
    sink = KafkaDataSource(dict(KAFKA, **{f"kafka.{k}": v for k, v in common.items()})).build_sink()
    assert sink.producer_config == common


def test_the_java_only_table_holds_only_names_librdkafka_lacks_and_its_advice_names_settings_it_has():
    """The table is checked against librdkafka itself: a name it does know would be refused
    wrongly, an equivalent it does not know would be wrong advice."""
    ck = pytest.importorskip("confluent_kafka")
    from twophase.sinks.kafka import JAVA_ONLY

    def known(name: str) -> bool:
        try:
            ck.Producer({name: "1", "log_level": 0})
        except ck.KafkaException as e:
            return not e.args[0].str().startswith("No such configuration property")
        return True

    assert [k for k in JAVA_ONLY if known(k)] == []
    advised = {m for v in JAVA_ONLY.values() for m in re.findall(r"\{p\}([a-z][a-z.]*[a-z](?:\.\*)?)", v)}
    assert advised and [a for a in sorted(advised) if not a.endswith(".*") and not known(a)] == []
