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
    table = _table()
    for kind, cls in SOURCES.items():
        documented = {o.lower() for o, (formats, _) in table.items() if formats.startswith(("all", kind))}
        read = set(_COMMON) | set(cls.known_options) | {f"{p}*" for p in cls.passed_prefixes}
        if kind == "kafka":
            read.add("kafka.bootstrap.servers")  # one of the kafka.* options, required
        assert documented == read, (kind, sorted(documented - read), sorted(read - documented))


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
