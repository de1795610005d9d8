"""Issue 47: the one-word change on the queries users really write.  Each test runs Spark's own sink
and the twophase format side by side on the same query, or the twophase format alone where
Spark's sink has nothing to compare, and is named after the issue's row.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from twophase.errors import ConfigurationError

pytestmark = [pytest.mark.spark]


def _input(folder: Path) -> list[dict]:
    folder.mkdir()
    rows = [{"id": f"r{i:03d}", "day": f"2026-11-{20 + i % 3:02d}", "n": i} for i in range(60)]
    (folder / "rows.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def _stream(spark, src: Path, fmt: str, out: Path, ck: Path, **kw):
    import twophase.datasource

    twophase.datasource.register(spark)
    w = spark.readStream.schema("id STRING, day STRING, n LONG").json(str(src)).writeStream.format(fmt)
    if kw.get("partition_by"):
        w = w.partitionBy(*kw["partition_by"])
    if kw.get("query_name"):
        w = w.queryName(kw["query_name"])
    q = w.option("checkpointLocation", str(ck)).trigger(availableNow=True).start(str(out))
    q.awaitTermination(300)
    assert q.exception() is None, q.exception()


def test_a_named_query_on_twophase_files_runs(spark, tmp_path):
    """Before: the first batch failed with "unknown option(s) queryname" (Spark hands the query's
    name to its sink as an option)."""
    rows = _input(tmp_path / "in")
    _stream(spark, tmp_path / "in", "twophase-files", tmp_path / "out", tmp_path / "ck", query_name="orders")
    got = sorted(r.id for r in spark.read.parquet(str(tmp_path / "out")).collect())
    assert got == sorted(r["id"] for r in rows)


def test_partition_by_on_twophase_files_writes_the_folders_sparks_file_sink_writes(spark, tmp_path):
    """Before: ``.partitionBy("day")`` was silently dropped (Spark hands a Python data source no
    partitioning): one flat folder.  Now the writer carries the columns to the format
    (``twophase.partitionBy``) and FileSink writes Hive-style ``day=.../`` folders, as Spark's
    parquet sink does; a reader of either folder sees the same rows and the same ``day`` column."""
    rows = _input(tmp_path / "in")
    _stream(spark, tmp_path / "in", "parquet", tmp_path / "spark", tmp_path / "ck1", partition_by=["day"])
    _stream(spark, tmp_path / "in", "twophase-files", tmp_path / "ours", tmp_path / "ck2", partition_by=["day"])

    def folders(p: Path) -> list[str]:
        return sorted(d.name for d in p.iterdir() if d.is_dir() and not d.name.startswith(("_", ".")))

    assert folders(tmp_path / "ours") == folders(tmp_path / "spark") == [
        "day=2026-11-20", "day=2026-11-21", "day=2026-11-22"]
    # Spark's streaming file sink is read through its _spark_metadata log; ours by listing.
    theirs = sorted((r.id, str(r.day)) for r in spark.read.parquet(str(tmp_path / "spark")).collect())
    mine = sorted((r.id, str(r.day)) for r in spark.read.parquet(str(tmp_path / "ours")).collect())
    assert mine == theirs == sorted((r["id"], r["day"]) for r in rows)


def test_partition_by_on_twophase_jdbc_is_refused_with_a_line_naming_it():
    from twophase.datasource import JdbcDataSource

    with pytest.raises(ConfigurationError, match=r"partitionBy\(day\) has no meaning for a table"):
        JdbcDataSource({"url": "jdbc:postgresql://h/db", "dbtable": "t", "checkpointlocation": "/tmp/ck",
                        "twophase.partitionby": "day"}).build_sink()


def test_switching_a_folder_written_by_sparks_parquet_sink_to_twophase_files_is_refused(spark, tmp_path):
    """Before: every file twophase-files wrote there was invisible to ``spark.read.parquet(path)``,
    which lists only the files Spark's ``_spark_metadata`` log names.  Now the first batch is
    refused with a line naming the log and what to do; nothing is written."""
    _input(tmp_path / "in")
    out = tmp_path / "out"
    _stream(spark, tmp_path / "in", "parquet", out, tmp_path / "ck1")
    before = sorted(p.name for p in out.iterdir())
    assert "_spark_metadata" in before
    with pytest.raises(Exception, match="holds _spark_metadata, the log of Spark's streaming file sink"):
        _stream(spark, tmp_path / "in", "twophase-files", out, tmp_path / "ck2")
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.mark.hdfs
def test_an_hdfs_folder_with_sparks_file_sink_log_is_refused_at_open(hdfs_service):
    import uuid

    from hdfs import InsecureClient

    from twophase.sinks.files import FileSink

    client = InsecureClient(hdfs_service["webhdfs_url"], user=hdfs_service["user"])
    path = f"/twophase-test/{uuid.uuid4().hex[:10]}"
    opts = {"webhdfs_url": hdfs_service["webhdfs_url"], "user": hdfs_service["user"]}
    try:
        FileSink(f"{hdfs_service['namenode']}{path}", storage_options=opts).open()  # a plain folder: fine
        client.write(f"{path}/_spark_metadata/0", b"v1\n")
        with pytest.raises(ConfigurationError, match="holds _spark_metadata"):
            FileSink(f"{hdfs_service['namenode']}{path}", storage_options=opts).open()
    finally:
        client.delete(path, recursive=True)


@pytest.mark.s3
def test_an_s3_prefix_with_sparks_file_sink_log_is_refused_at_open(s3_service):
    import uuid

    from tests.services.s3 import client
    from twophase.sinks.files import FileSink

    s3, bucket = client(s3_service), s3_service["bucket"]
    prefix = f"twophase-test/{uuid.uuid4().hex[:10]}"
    opts = {"key": s3_service["key"], "secret": s3_service["secret"], "endpoint_url": s3_service["endpoint_url"],
            "region_name": s3_service["region"]}
    try:
        FileSink(f"s3://{bucket}/{prefix}", storage_options=opts).open()
        s3.put_object(Bucket=bucket, Key=f"{prefix}/_spark_metadata/0", Body=b"v1\n")
        with pytest.raises(ConfigurationError, match="holds _spark_metadata") as e:
            FileSink(f"s3://{bucket}/{prefix}", storage_options=opts).open()
        assert s3_service["secret"] not in str(e.value)
    finally:
        for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=o["Key"])


@pytest.mark.kafka
def test_complete_mode_and_null_values_on_twophase_kafka_write_as_sparks_kafka_sink(spark, kafka_service, tmp_path):
    """Spark's Kafka sink writes every row of the result each batch in Complete mode, and a null
    value as a tombstone.  Before: twophase-kafka refused Complete mode ("would replace the target's
    contents", untrue of Kafka) and failed a batch with a null value."""
    import twophase.datasource
    from tests.test_kafka_sink import _topic

    twophase.datasource.register(spark)
    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 1)
    _input(tmp_path / "in")
    counts = (spark.readStream.schema("id STRING, day STRING, n LONG").json(str(tmp_path / "in"))
              .groupBy("day").count()
              .selectExpr("day AS key", "CASE WHEN day = '2026-11-22' THEN NULL ELSE CAST(count AS STRING) END "
                          "AS value"))
    q = (counts.writeStream.format("twophase-kafka").outputMode("complete")
         .option("kafka.bootstrap.servers", bs).option("topic", topic)
         .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None, q.exception()
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bs, "group.id": f"complete-{topic}", "isolation.level": "read_committed",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False})
    c.subscribe([topic])
    got, idle = {}, 0
    while len(got) < 3 and idle < 100:
        m = c.poll(0.2)
        if m is None or m.error() is not None:
            idle += 1
            continue
        got[m.key().decode()] = m.value()
    c.close()
    assert got == {"2026-11-20": b"20", "2026-11-21": b"20", "2026-11-22": None}


@pytest.mark.postgres
def test_dataframe_columns_differing_in_case_from_the_tables_land_as_with_sparks_jdbc_writer(spark, db,
                                                                                            postgres_service,
                                                                                            tmp_path):
    """Spark's JDBC writer puts a DataFrame column ``ID`` into the table column ``id`` (names match
    ignoring case, ``spark.sql.caseSensitive=false``).  Before: twophase-jdbc failed the batch
    ("names are case-sensitive").  Both write one DataFrame into twin tables; a reader sees the same
    rows."""
    import uuid

    import psycopg2.extensions

    import twophase.datasource
    from tests.services.maven import resolve

    twophase.datasource.register(spark)
    for jar in resolve(["org.postgresql:postgresql:42.7.8"], "postgresql-jdbc"):  # the driver and its deps
        spark.sql(f"ADD JAR {jar}")  # Spark's JDBC writer needs them; the shared session has none
    p = psycopg2.extensions.parse_dsn(postgres_service["dsn"])
    url = f"jdbc:postgresql://{p['host']}:{p['port']}/{p['dbname']}"
    tables = [f"case_spark_{uuid.uuid4().hex[:6]}", f"case_ours_{uuid.uuid4().hex[:6]}"]
    with db.cursor() as cur:
        for t in tables:
            cur.execute(f"CREATE TABLE {t} (id bigint PRIMARY KEY, amount int NOT NULL, note text)")
    try:
        df = spark.sql("SELECT * FROM VALUES (1L, 5, 'a'), (2L, 6, NULL) AS t(ID, Amount, Note)").coalesce(1)
        (df.write.format("jdbc").option("url", url).option("dbtable", tables[0]).option("user", p["user"])
         .option("password", p.get("password", "")).option("driver", "org.postgresql.Driver").mode("append").save())
        (df.write.format("twophase-jdbc").option("url", url).option("dbtable", tables[1]).option("user", p["user"])
         .option("password", p.get("password", "")).option("twophase.logLocation", str(tmp_path / "log"))
         .option("twophase.batchId", 0).mode("append").save())
        got = []
        with db.cursor() as cur:
            for t in tables:
                cur.execute(f"SELECT id, amount, note FROM {t} ORDER BY id")
                got.append(cur.fetchall())
        assert got[0] == got[1] == [(1, 5, "a"), (2, 6, None)]
    finally:
        with db.cursor() as cur:
            for t in tables:
                cur.execute(f"DROP TABLE IF EXISTS {t}")
