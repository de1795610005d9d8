"""Issue 47: stateful queries through the one-word change.  Spark puts ``spark.sql.shuffle.partitions``
(200 by default) after every aggregation, join and deduplication; a Python data source runs one task,
and so one transaction, per partition.  Before, the streaming deduplication below failed its first
batch on ``twophase-kafka`` ("partition 64 ... beyond the 64 transactions its plan allows") and on
``twophase-jdbc`` (PostgreSQL's ``max_prepared_transactions / 2``), and ran 200 Python tasks a batch on
``twophase-files``.  Now the writer ``register(spark)`` wraps coalesces each micro-batch to the
application's cores (``twophase.coalesce``, default ``auto``), and checks the options at ``start()``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from twophase.errors import ConfigurationError

pytestmark = [pytest.mark.spark]

REPO = Path(__file__).resolve().parent.parent


def _input(folder: Path, files: int = 3, rows: int = 100) -> list[str]:
    folder.mkdir()
    ids = []
    for f in range(files):
        batch = [f"s{f}-{i:03d}" for i in range(rows)]
        ids += batch
        # every id twice in its file: the deduplication keeps one
        (folder / f"f{f}.json").write_text("".join(json.dumps({"id": i, "n": n}) + "\n"
                                                   for n, i in enumerate(batch + batch)))
    return ids


def _dedup(spark, src: Path):
    return (spark.readStream.schema("id STRING, n LONG").option("maxFilesPerTrigger", 1).json(str(src))
            .selectExpr("id", "n", "current_timestamp() AS ts").withWatermark("ts", "10 minutes")
            .dropDuplicatesWithinWatermark(["id"]).select("id"))


@pytest.fixture
def shuffle_200(spark):
    """Spark's default shuffle partitions (the shared test session runs with 2)."""
    import twophase.datasource

    twophase.datasource.register(spark)
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    yield spark
    spark.conf.set("spark.sql.shuffle.partitions", before)


def _run(w, ck: Path, *start_args):
    q = w.option("checkpointLocation", str(ck)).trigger(availableNow=True).start(*start_args)
    q.awaitTermination(600)
    assert q.exception() is None, str(q.exception())[:3000]
    return q


def _state_partitions(ck: Path) -> int:
    return len([p for p in (ck / "state" / "0").iterdir() if p.name.isdigit()])


@pytest.mark.kafka
def test_streaming_dedup_at_sparks_default_200_shuffle_partitions_runs_through_twophase_kafka(
        shuffle_200, kafka_service, tmp_path):
    """The issue's row: "first batch fails: partition 64 ... beyond the 64 transactions its plan
    allows".  Every id once, read_committed; each batch is one transaction per core."""
    from tests.test_kafka_sink import _topic, read_committed

    spark = shuffle_200
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 2)
    ids = _input(tmp_path / "in")
    w = (_dedup(spark, tmp_path / "in").selectExpr("id AS value").writeStream.format("twophase-kafka")
         .option("kafka.bootstrap.servers", bs).option("topic", topic))
    _run(w, tmp_path / "ck")
    got = sorted(v.decode() for v in read_committed(bs, topic, timeout=60, idle=3))
    assert got == sorted(ids)
    assert _state_partitions(tmp_path / "ck") == 200


@pytest.mark.postgres
def test_streaming_dedup_at_sparks_default_200_shuffle_partitions_runs_through_twophase_jdbc(
        shuffle_200, db, postgres_service, tmp_path):
    """PostgreSQL allows ``max_prepared_transactions / 2`` transactions a batch (64 on the test
    server): before, the same query failed its first batch there too."""
    info = postgres_service
    table = f"dedup_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id text NOT NULL)')
    ids = _input(tmp_path / "in")
    w = (_dedup(shuffle_200, tmp_path / "in").writeStream.format("twophase-jdbc")
         .option("url", f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}")
         .option("dbtable", table).option("user", info["user"]).option("password", info["password"]))
    _run(w, tmp_path / "ck")
    with db.cursor() as cur:
        cur.execute(f'SELECT id FROM "{table}"')
        assert sorted(r[0] for r in cur.fetchall()) == sorted(ids)
        cur.execute(f'DROP TABLE "{table}"')
    assert _state_partitions(tmp_path / "ck") == 200


def test_twophase_files_with_coalesce_off_keeps_the_stateful_querys_shuffle_partitions(shuffle_200, tmp_path):
    """``twophase.coalesce=off`` keeps Spark's shuffle partitions (one file per non-empty one), here
    at 8 (each of the default 200 costs a Python task of CI time).  The default, coalesced to at
    most one file per core and batch at 200 shuffle partitions, is tests/test_datasource.py's files
    kill test's query (the same deduplication, under its faults)."""
    import pyarrow.parquet as pq

    spark = shuffle_200
    spark.conf.set("spark.sql.shuffle.partitions", "8")  # the fixture puts its value back
    one = _input(tmp_path / "in-off", files=1)
    _run(_dedup(spark, tmp_path / "in-off").writeStream.format("twophase-files").option("twophase.coalesce", "off"),
         tmp_path / "ck-off", str(tmp_path / "off"))
    off = list((tmp_path / "off").glob("*.parquet"))
    assert sorted(pq.read_table(off).column("id").to_pylist()) == sorted(one)
    assert 2 < len(off) <= 8, len(off)
    assert _state_partitions(tmp_path / "ck-off") == 8


@pytest.mark.parametrize("option, value, message", [
    ("fromat", "json", "unknown option(s) fromat (did you mean format?)"),
    ("twophase.coalesce", "some", "twophase.coalesce must be auto, off or a positive integer"),
    ("twophase.coalesce", "300", "twophase.coalesce=300 is more than twophase.maxPartitions=200"),
    ("twophase.maxPartitions", "0", "twophase.maxPartitions must be a positive integer"),
])
def test_a_misconfigured_query_fails_at_start_even_when_no_data_ever_arrives(spark, tmp_path, option, value,
                                                                            message):
    """Before, every option was checked when the first batch was planned: a query over a source
    that gets no data never failed.  Now ``start()`` raises, and no query runs."""
    import twophase.datasource

    twophase.datasource.register(spark)
    (tmp_path / "in").mkdir()
    before = len(spark.streams.active)
    w = (spark.readStream.schema("id STRING").json(str(tmp_path / "in")).writeStream.format("twophase-files")
         .option("checkpointLocation", str(tmp_path / "ck")).option(option, value))
    with pytest.raises(ConfigurationError) as info:
        q = w.start(str(tmp_path / "out"))
        q.stop()
    assert message in str(info.value)
    assert len(spark.streams.active) == before
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.parquet"))


_CONNECT = r"""
import json, sys, glob
from pyspark.sql import SparkSession
import twophase
src, ck, out, url = sys.argv[1:5]
spark = SparkSession.builder.remote(url).getOrCreate()
twophase.register(spark)
spark.conf.set("spark.sql.shuffle.partitions", "200")
df = (spark.readStream.schema("id STRING, n LONG").option("maxFilesPerTrigger", 1).json(src)
      .selectExpr("id", "n", "current_timestamp() AS ts").withWatermark("ts", "10 minutes")
      .dropDuplicatesWithinWatermark(["id"]).select("id"))
q = (df.writeStream.format("twophase-files").option("checkpointLocation", ck).trigger(availableNow=True)
     .start(out))
q.awaitTermination()
print("DONE", json.dumps(q.exception() is None))
"""


def test_over_spark_connect_a_stateful_query_is_coalesced_too(spark_connect_service, tmp_path):
    """A Spark Connect client's writer is wrapped the same way (its command's input plan is
    coalesced): the server's application has 2 cores, so at most 2 files a batch."""
    import pyarrow.parquet as pq

    ids = _input(tmp_path / "in")
    r = subprocess.run([sys.executable, "-c", _CONNECT, str(tmp_path / "in"), str(tmp_path / "ck"),
                        str(tmp_path / "out"), spark_connect_service["url"]],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert "DONE true" in r.stdout, (r.stdout[-2000:], r.stderr[-3000:])
    files = list((tmp_path / "out").glob("*.parquet"))
    assert sorted(pq.read_table(files).column("id").to_pylist()) == sorted(ids)
    assert len(files) <= 2 * 3, len(files)
    assert _state_partitions(tmp_path / "ck") == 200


def test_a_windowed_count_in_append_mode_at_200_shuffle_partitions_writes_what_sparks_parquet_sink_writes(
        shuffle_200, tmp_path):
    """The issue's other stateful query: a count per 1-minute event-time window, in append mode
    (a window is written once the watermark passes it, by a batch of its own or a no-data batch).
    Spark's parquet sink and ``twophase-files`` on the same input write the same windows."""
    spark = shuffle_200
    src = tmp_path / "in"
    src.mkdir()
    # Two minutes of events, then one far later that moves the watermark past both.
    for f, (start, n) in enumerate([(0, 60), (120, 30), (600, 1)]):
        (src / f"f{f}.json").write_text("".join(json.dumps({"id": f"w{start + i}", "t": start + i}) + "\n"
                                                for i in range(n)))

    def windows(fmt: str, out: Path, ck: Path) -> list[tuple[str, int]]:
        df = (spark.readStream.schema("id STRING, t LONG").option("maxFilesPerTrigger", 1).json(str(src))
              .selectExpr("id", "CAST(t AS TIMESTAMP) AS ts").withWatermark("ts", "10 seconds")
              .groupBy(F.window("ts", "1 minute")).count()
              .selectExpr("CAST(window.start AS STRING) AS w", "count"))
        _run(df.writeStream.format(fmt).outputMode("append"), ck, str(out))
        return sorted((r.w, r["count"]) for r in spark.read.parquet(str(out)).collect())

    from pyspark.sql import functions as F

    theirs = windows("parquet", tmp_path / "spark", tmp_path / "ck1")
    mine = windows("twophase-files", tmp_path / "ours", tmp_path / "ck2")
    assert len(theirs) == 2 and [c for _, c in theirs] == [60, 30], theirs
    assert mine == theirs
    assert _state_partitions(tmp_path / "ck2") == 200
