"""Issue 47: docs/datasource.md's tables of Spark's own sink options ("Spark's options, sink by
sink") hold what the formats do: for each row, the format's sink is built from the row's option
and value (no Spark, no service) and is accepted where the table says "same", refused with a line
naming the option where it says "refused".

Issue 60 #9: a "same" row must also do what it says, not only build:

- a row that says it changes nothing (``same, no effect``, ``(the default``, what the sink sets
  anyway) leaves the built sink exactly as without the option;
- every other ``twophase-kafka`` and ``twophase-jdbc`` row changes the built sink by what
  :data:`EFFECT` names: the producer setting of the Java client's name with the row's value (the
  table's claim for Kafka: librdkafka takes it under that name), or the connection's field;
- every ``twophase-files`` row is written by Spark's own writer and by ``twophase-files`` with the
  row's option, and the two outputs compared (text byte for byte, Parquet's codec, files per
  task): :func:`test_each_files_row_writes_what_sparks_writer_writes` (Spark, local); its S3A and
  WebHDFS rows reach the storage options (their real servers: tests/test_datasource_files_options.py)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

from twophase.config import BUILTIN_FORMATS
from twophase.datasource import data_source
from twophase.errors import ConfigurationError

REPO = Path(__file__).resolve().parent.parent
SECTION = "\n## Spark's options, sink by sink\n"
#: Every built-in format, read from the sinks' registry: each has its table.
SOURCES = {f"twophase-{kind}": data_source(kind) for kind in BUILTIN_FORMATS}
BASE = {
    "twophase-kafka": {"kafka.bootstrap.servers": "broker:9092", "checkpointlocation": "/tmp/ck"},
    "twophase-jdbc": {"url": "jdbc:postgresql://db/shop", "dbtable": "events", "checkpointlocation": "/tmp/ck"},
    "twophase-files": {"path": "/tmp/twophase-option-table-unused", "checkpointlocation": "/tmp/ck"},
}


def _cells(line: str) -> list[str]:
    return [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def _value(text: str) -> str:
    if text == "(empty)":
        return ""
    m = re.fullmatch(r"`(.*)`", text)
    assert m, f"a tried value must be in backticks or (empty): {text!r}"
    return m.group(1)


def rows() -> list[tuple[str, str, str, dict[str, str], str]]:
    """(format name, option, format cell, options to build with, verdict) per row of the tables."""
    text = (REPO / "docs" / "datasource.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    out = []
    for part in section.split("\n### ")[1:]:
        name = part.split("\n", 1)[0].strip()
        for line in part.splitlines():
            if not line.startswith("| `"):
                continue
            option_cell, fmt, tried, verdict = _cells(line)
            option = _value(option_cell)
            value_text, _, extra = tried.partition(" with ")
            options = {option.lower(): _value(value_text)}
            for pair in re.findall(r"`([^`=]+)=([^`]*)`", extra):
                options[pair[0].lower()] = pair[1]
            if name == "twophase-files":
                options.setdefault("format", fmt)
            out.append((name, option, fmt, options, verdict))
    return out


ROWS = rows()


def test_the_tables_cover_each_format_and_every_verdict_is_same_or_refused():
    assert {r[0] for r in ROWS} == set(SOURCES)
    assert len(ROWS) > 100
    assert all(v.startswith(("same", "refused")) for *_, v in ROWS), [r for r in ROWS if not
                                                                      r[-1].startswith(("same", "refused"))]


@pytest.mark.parametrize("name,option,fmt,options,verdict", ROWS,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{r[3][r[1].lower()][:20]}" for r in ROWS])
def test_each_row_is_what_the_format_does(name, option, fmt, options, verdict):
    ds = SOURCES[name](dict(BASE[name], **options))
    if verdict.startswith("same"):
        ds._check_options()
        ds.build_sink()
    else:
        with pytest.raises(ConfigurationError) as e:
            ds._check_options()
            ds.build_sink()
        assert option.lower() in str(e.value).lower(), str(e.value)


# ------------------------------------------------------------------ issue 60 #9: what "same" does
#: A "same" row's verdict that says the option changes nothing here.
UNCHANGED = ("same, no effect", "same (the default", "same, as the sink sets it", "which the sink sets anyway",
             "same (no timeout)", "(`NONE` and the default")
#: What each other "same" row of Kafka and JDBC changes in the built sink (flattened attributes,
#: see :func:`_state`), by (format, option, value).  {} where the option is the base's already or
#: Spark's meaning is the sink's only one (said in the comment).
EFFECT: dict[tuple[str, str, str], dict[str, Any]] = {
    ("twophase-kafka", "kafka.bootstrap.servers", "broker:9092"): {},  # the base options' own
    ("twophase-kafka", "topic", "events"): {"topic": "events"},
    ("twophase-kafka", "kafka.allow.auto.create.topics", "true"):
        {"auto_create_topics": True, "producer_config.allow.auto.create.topics": "true"},
    **{("twophase-kafka", f"kafka.{k}", v): {f"producer_config.{k}": v} for k, v in (
        ("linger.ms", "5"), ("batch.size", "16384"), ("compression.type", "lz4"), ("retries", "3"),
        ("delivery.timeout.ms", "120000"), ("request.timeout.ms", "30000"),
        ("max.in.flight.requests.per.connection", "5"), ("client.id", "etl"), ("reconnect.backoff.ms", "50"),
        ("metadata.max.age.ms", "300000"), ("connections.max.idle.ms", "540000"),
        ("security.protocol", "SASL_SSL"), ("sasl.mechanism", "SCRAM-SHA-512"),
        ("sasl.kerberos.service.name", "kafka"))},
    ("twophase-kafka", "kafka.sasl.jaas.config",
     'org.apache.kafka.common.security.scram.ScramLoginModule required username="etl" password="secret";'):
        {"producer_config.sasl.username": "etl", "producer_config.sasl.password": "secret"},
    ("twophase-kafka", "kafka.ssl.truststore.location", "/etc/kafka/ca.pem"):
        {"producer_config.ssl.ca.location": "/etc/kafka/ca.pem"},
    ("twophase-kafka", "kafka.ssl.endpoint.identification.algorithm", ""):
        {"producer_config.ssl.endpoint.identification.algorithm": "none"},
    ("twophase-jdbc", "url", "jdbc:postgresql://db:5432/shop?ssl=true&currentSchema=sales"):
        {"params.sslmode": "verify-full", "params.options": "-c search_path=sales"},  # pgjdbc's ssl=true
    ("twophase-jdbc", "dbtable", "public.Events"): {"schema": "public", "_table_home": "public"},  # table "events", as the base
    ("twophase-jdbc", "user", "writer"): {"params.user": "writer"},
    ("twophase-jdbc", "password", "secret"): {"_password_inline": "secret"},
    ("twophase-jdbc", "driver", "org.postgresql.Driver"): {},  # the driver of the url's database: the sink's own
}
#: The MySQL and MariaDB url rows: another sink, at the url's host and database.
MYSQL_URL = {"type": "MySqlSink", "host": "db", "port": 3306, "database": "shop"}


def _state(sink: Any) -> dict[str, Any]:
    """The built sink's settings: its attributes, dicts flattened to ``a.b`` (objects as their repr,
    unless it names an address)."""
    out: dict[str, Any] = {"type": type(sink).__name__}

    def put(key: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                put(f"{key}.{k}", x)
        elif v is None or isinstance(v, (str, int, float, bool, list, tuple)):
            out[key] = v
        elif " at 0x" not in repr(v):
            out[key] = repr(v)
    for k, v in vars(sink).items():
        put(k, v)
    return out


def _diff(name: str, options: dict[str, str], fmt: str) -> dict[str, Any]:
    def build(extra: dict[str, str]) -> dict[str, Any]:
        ds = SOURCES[name](dict(BASE[name], **extra))
        ds._check_options()
        return _state(ds.build_sink())
    base = build({"format": fmt} if name == "twophase-files" else {})
    got = build(options)
    return {k: got.get(k) for k in set(base) | set(got) if base.get(k) != got.get(k)}


SAME = [r for r in ROWS if r[-1].startswith("same")]


@pytest.mark.parametrize("name,option,fmt,options,verdict", [r for r in SAME if r[0] != "twophase-files"],
                         ids=[f"{r[0]}-{r[1]}-{r[3][r[1].lower()][:20]}" for r in SAME if r[0] != "twophase-files"])
def test_each_kafka_and_jdbc_same_row_changes_the_sink_as_it_says(name, option, fmt, options, verdict):
    diff = _diff(name, options, fmt)
    value = options[option.lower()]
    if verdict.startswith(UNCHANGED) or any(u in verdict for u in UNCHANGED):
        assert diff == {}, f"{option}={value!r} says it changes nothing, and changed {diff}"
    elif option == "url" and value.startswith(("jdbc:mysql:", "jdbc:mariadb:")):
        assert {k: diff.get(k) for k in MYSQL_URL} == MYSQL_URL, diff
    else:
        assert (name, option, value) in EFFECT, f"no expected effect for the row {option}={value!r}: {diff}"
        assert diff == EFFECT[(name, option, value)], (option, value, diff)


FILES_SAME = [r for r in SAME if r[0] == "twophase-files"]


@pytest.mark.spark
def test_each_files_row_writes_what_sparks_writer_writes(spark, tmp_path):
    """Each "same" row of twophase-files, written by Spark's writer and by twophase-files with the
    row's options and compared: csv and json text byte for byte (decompressed; a codec the row says
    Spark cannot write here is compared against Spark's uncompressed text), Parquet's files per
    task and column codec, and the files' suffix.  The S3A and WebHDFS rows: their setting reaches
    the storage options (their real servers: tests/test_datasource_files_options.py)."""
    import uuid

    import pyarrow as pa
    import pyarrow.parquet as pq

    import twophase.datasource
    from tests.test_datasource_files_options import _ROWS_SQL

    twophase.datasource.register(spark)
    codecs = {"snappy": "SNAPPY", "gzip": "GZIP", "zstd": "ZSTD", "lz4_raw": "LZ4", "uncompressed": "UNCOMPRESSED",
              "none": "UNCOMPRESSED", "brotli": "BROTLI"}
    suffix = {"gzip": ".gz", "bzip2": ".bz2", "zstd": ".zst"}
    stream = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd"}

    def write(fmt: str, opts: dict[str, str], ours: bool) -> Path:
        df = (spark.range(50).selectExpr("id", "CAST(id AS STRING) AS s") if fmt == "parquet"
              else spark.sql(_ROWS_SQL)).coalesce(1)
        folder = tmp_path / f"{'ours' if ours else 'spark'}-{uuid.uuid4().hex[:6]}"
        if ours:
            (df.write.format("twophase-files").option("format", fmt).options(**opts)
             .option("twophase.logLocation", str(folder) + "-log").option("twophase.batchId", 0).mode("append")
             .save(str(folder)))
        else:
            df.write.format(fmt).options(**opts).save(str(folder))
        return folder

    def text(folder: Path) -> tuple[str, list[str]]:
        out, ends = [], []
        for n in sorted(n for n in os.listdir(folder) if n.startswith("part") and not n.endswith(".crc")):
            raw, end = (folder / n).read_bytes(), os.path.splitext(n)[1]
            if end in stream:
                raw = bytes(pa.CompressedInputStream(pa.BufferReader(raw), stream[end]).read())
            out.append(raw.decode("utf-8"))
            ends.append(end)
        return "".join(out), ends

    def parquet(folder: Path) -> list[tuple[int, str]]:
        return sorted((pq.ParquetFile(folder / n).metadata.num_rows,
                       pq.ParquetFile(folder / n).metadata.row_group(0).column(0).compression)
                      for n in os.listdir(folder) if n.endswith(".parquet"))

    old_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    checked: list[str] = []
    wrong: list[tuple] = []
    try:
        for name, option, fmt, options, verdict in FILES_SAME:
            opts = {k: v for k, v in options.items() if k not in ("format", "path")}
            value = options[option.lower()]
            if option.startswith(("fs.s3a.", "dfs.")):
                want = ({"storage_options.endpoint_url": "https://minio:9000"} if option.startswith("fs.s3a.")
                        else {"storage_options.webhdfs_url": "http://nn:9871"})
                diff = _diff(name, options, fmt)
                assert {k: diff.get(k) for k in want} == want, (option, diff)
                checked.append(option)
                continue
            # A codec the row says Spark cannot write here: Spark's output uncompressed.
            spark_cannot = "Spark needs" in verdict
            theirs = write(fmt, {k: v for k, v in opts.items() if not (spark_cannot and k == "compression")}, False)
            ours = write(fmt, opts, True)
            codec = opts.get("compression", "").lower()
            if fmt == "parquet":
                got, want_pq = parquet(ours), parquet(theirs)
                if spark_cannot:
                    want_pq = [(n, codecs[codec]) for n, _ in want_pq]
                if codec and {c for _, c in got} != {codecs[codec]} or got != want_pq:
                    wrong.append((option, value, got, want_pq))
            else:
                (t, t_ends), (o, o_ends) = text(theirs), text(ours)
                ext = suffix.get(codec, "")
                if o != t or o_ends != [ext or {"csv": ".csv", "json": ".jsonl"}[fmt]] or (
                        not spark_cannot and t_ends != [ext or f".{fmt}"]):
                    wrong.append((option, value, o, t, o_ends, t_ends))
            checked.append(option)
    finally:
        spark.conf.set("spark.sql.session.timeZone", old_tz)
    assert wrong == [], "rows whose output is not Spark's (ours, Spark's):\n" + "\n".join(map(repr, wrong))
    assert len(checked) == len(FILES_SAME) > 30
