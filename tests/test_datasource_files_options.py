"""Issue 47: Spark's file sink options on ``twophase-files``: Spark's codec names, the csv and json
writer options, ``maxRecordsPerFile``, S3A and WebHDFS addresses.  Each accepted option is written
as Spark's own writer writes it (the Spark tests write one DataFrame both ways and compare the
bytes); the others are refused naming the option."""

from __future__ import annotations

import bz2
import gzip
import os
import re
import uuid
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from twophase import TransactionContext
from twophase.datasource import FilesDataSource
from twophase.errors import ConfigurationError
from twophase.sinks.files import FileSink

_ROWS_SQL = """
SELECT * FROM VALUES
  (1, 'a,b', 'x;y', NULL, '', '  pad  ', 'q"t', DATE'2024-02-29', TIMESTAMP'2024-03-01 12:34:56.789', 1.5D),
  (2, 'plain', 'c\r', 'n', 'e', 'z', 'back\\\\s', NULL, NULL, NULL),
  (3, '#hash', 'it''s', NULL, ' ', 'tab\t', 'multi\nline', DATE'1999-12-31', TIMESTAMP'2000-01-01 00:00:00', -0.0D)
AS t(id, s1, s2, s3, s4, s5, s6, day, ts, d)
"""

#: Option sets written by Spark's writer and by twophase-files, compared byte for byte.
CSV_CASES = [
    {"sep": ";", "nullValue": "NULL", "emptyValue": "EMPTY", "lineSep": "\r"},
    {"quoteAll": "true", "escape": '"', "header": "true", "delimiter": "|"},
    {"quote": "'", "escapeQuotes": "false", "ignoreLeadingWhiteSpace": "false",
     "ignoreTrailingWhiteSpace": "false", "nullValue": "a;b", "compression": "bzip2"},
    {"dateFormat": "yyyy-MM-dd", "timestampFormat": "yyyy-MM-dd'T'HH:mm:ss[.SSS][XXX]", "encoding": "UTF-8",
     "compression": "gzip"},
]
JSON_CASES = [
    {"ignoreNullFields": "false", "lineSep": "\r\n"},
    {"compression": "bzip2", "encoding": "utf-8"},
]


def _text(folder: Path) -> tuple[str, list[str]]:
    """The folder's part files' text (decompressed), and their suffixes."""
    names = sorted(n for n in os.listdir(folder) if n.startswith("part") and not n.endswith(".crc"))
    out, suffixes = [], []
    for n in names:
        raw = (folder / n).read_bytes()
        if n.endswith(".gz"):
            raw = gzip.decompress(raw)
        elif n.endswith(".bz2"):
            raw = bz2.decompress(raw)
        out.append(raw.decode("utf-8"))
        suffixes.append(n.rsplit(".", 2)[-2] + "." + n.rsplit(".", 1)[-1] if n.count(".") > 1 else n.rsplit(".", 1)[-1])
    return "".join(out), suffixes


def _both(spark, tmp: Path, fmt: str, options: dict[str, str], df=None) -> tuple[Path, Path]:
    import twophase.datasource

    twophase.datasource.register(spark)
    df = (df if df is not None else spark.sql(_ROWS_SQL)).coalesce(1)
    key = uuid.uuid4().hex[:6]
    theirs, ours = tmp / f"spark-{key}", tmp / f"ours-{key}"
    df.write.format(fmt).options(**options).save(str(theirs))
    (df.write.format("twophase-files").option("format", fmt).options(**options)
     .option("twophase.logLocation", str(tmp / f"log-{key}")).option("twophase.batchId", 0).mode("append")
     .save(str(ours)))
    return theirs, ours


@pytest.mark.spark
def test_csv_and_json_writer_options_write_what_sparks_writer_writes(spark, tmp_path):
    old_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    try:
        for fmt, cases in (("csv", CSV_CASES), ("json", JSON_CASES)):
            for options in cases:
                theirs, ours = _both(spark, tmp_path, fmt, options)
                (t, t_suffix), (o, o_suffix) = _text(theirs), _text(ours)
                assert t.count(options.get("lineSep", "\n")) >= 3, (options, t)
                assert o == t, (fmt, options, o, t)
                ext = {"csv": "csv", "json": "jsonl"}[fmt]
                codec = {"gzip": ".gz", "bzip2": ".bz2"}.get(options.get("compression", ""), "")
                assert t_suffix == [{"csv": "csv", "json": "json"}[fmt] + codec] and o_suffix == [ext + codec]
    finally:
        spark.conf.set("spark.sql.session.timeZone", old_tz)


@pytest.mark.spark
def test_sparks_parquet_codec_names_write_the_codec_sparks_writer_writes(spark, tmp_path):
    df = spark.range(50).selectExpr("id", "CAST(id AS STRING) AS s")
    for codec, expected in (("lz4_raw", "LZ4"), ("uncompressed", "UNCOMPRESSED"), ("none", "UNCOMPRESSED"),
                            ("zstd", "ZSTD")):
        theirs, ours = _both(spark, tmp_path, "parquet", {"compression": codec}, df)
        got = []
        for folder in (theirs, ours):
            (f,) = [folder / n for n in os.listdir(folder) if n.endswith(".parquet")]
            got.append(pq.ParquetFile(f).metadata.row_group(0).column(0).compression)
        assert got == [expected, expected], codec


@pytest.mark.spark
def test_max_records_per_file_splits_a_task_as_sparks_writer_does(spark, tmp_path):
    df = spark.range(25).selectExpr("id", "CAST(id AS STRING) AS s")
    theirs, ours = _both(spark, tmp_path, "parquet", {"maxRecordsPerFile": "10"}, df)

    def counts(folder: Path) -> list[int]:
        return sorted(pq.ParquetFile(folder / n).metadata.num_rows for n in os.listdir(folder) if n.endswith(".parquet"))

    assert counts(ours) == counts(theirs) == [5, 10, 10]
    assert sorted(r.id for r in spark.read.parquet(str(ours)).collect()) == list(range(25))


# ------------------------------------------------------------------ without Spark
def _sink(**options) -> FileSink:
    return FilesDataSource({"path": "/tmp/twophase-options-unused", **options}).build_sink()


def test_max_records_per_file_rolls_to_the_tasks_next_file_and_commits_them_all(tmp_path):
    sink = FileSink(str(tmp_path / "out"), format="csv", max_records_per_file=4, partition_by=["p"])
    txn = sink.begin_transaction(TransactionContext("q", 3, 1, 0, sink.plan_batch("q", 3, 2)))
    sink.write(txn, pa.record_batch({"id": list(range(7)), "p": ["a"] * 5 + ["b"] * 2}))
    sink.write(txn, pa.record_batch({"id": list(range(7, 12)), "p": ["a"] * 5}))
    handle = sink.pre_commit(txn)
    assert sink.commit(handle).done
    files = sorted(str(p.relative_to(tmp_path / "out")) for p in (tmp_path / "out").rglob("*.csv"))
    assert files == ["p=a/part-00000003-00001-c001-q.csv", "p=a/part-00000003-00001-c002-q.csv",
                     "p=a/part-00000003-00001-q.csv", "p=b/part-00000003-00001-q.csv"]
    rows = {f: (tmp_path / "out" / f).read_text().split() for f in files}
    assert [len(rows[f]) for f in files] == [4, 2, 4, 2]
    assert sorted(int(v) for f in files if f.startswith("p=a") for v in rows[f]) == [0, 1, 2, 3, 4, 7, 8, 9, 10, 11]
    # The names are the batch's: the cleanup of this batch and query knows every one of them.
    names = sink._batch_names(3, "q", {"staging": "x"})
    assert all(names.fullmatch(f.rsplit("/", 1)[1]) for f in files)


def test_max_records_per_file_abort_leaves_nothing(tmp_path):
    sink = FileSink(str(tmp_path / "out"), format="parquet", max_records_per_file=2)
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)))
    sink.write(txn, pa.record_batch({"id": list(range(5))}))
    sink.abort(txn)
    assert [p for p in (tmp_path / "out").rglob("*") if p.is_file()] == []


@pytest.mark.parametrize("value,limit", [("0", None), ("-1", None), ("1000", 1000)])
def test_max_records_per_file_zero_or_less_is_no_limit_as_in_spark(value, limit):
    assert _sink(maxrecordsperfile=value).max_records_per_file == limit


def test_s3a_settings_given_as_options_reach_the_s3_storage_options():
    sink = FilesDataSource({"path": "s3a://bucket/out", "fs.s3a.endpoint": "minio:9000",
                            "fs.s3a.connection.ssl.enabled": "false", "fs.s3a.path.style.access": "true",
                            "fs.s3a.access.key": "AK", "fs.s3a.secret.key": "SK",
                            "fs.s3a.endpoint.region": "eu-west-1"}).build_sink()
    assert sink.storage_options == {"endpoint_url": "http://minio:9000", "use_ssl": False, "key": "AK",
                                    "secret": "SK", "region_name": "eu-west-1",
                                    "config_kwargs": {"s3": {"addressing_style": "path"}}}
    assert "SK" not in repr(sink) and "SK" not in sink.target()
    with pytest.raises(ConfigurationError, match=r"fs\.s3a\.fast\.upload is not read"):
        FilesDataSource({"path": "s3a://bucket/out", "fs.s3a.fast.upload": "true"}).build_sink()
    with pytest.raises(ConfigurationError, match=r"fs\.s3a\.endpoint is an S3A setting, and the path is not on S3"):
        FilesDataSource({"path": "/tmp/x", "fs.s3a.endpoint": "minio:9000"}).build_sink()


def test_an_hdfs_path_goes_over_webhdfs_at_the_namenodes_http_address():
    sink = FilesDataSource({"path": "hdfs://nn:8020/out", "dfs.namenode.http-address": "nn:9871"}).build_sink()
    assert sink.storage_options == {"webhdfs_url": "http://nn:9871"}
    assert (sink.fs, sink._backend.base) == ("hdfs", "http://nn:9871")
    # Without it, Hadoop 3's default NameNode HTTP port, as before (docs/datasource.md says so).
    assert FilesDataSource({"path": "hdfs://nn:8020/out"}).build_sink()._backend.base == "http://nn:9870"
    with pytest.raises(ConfigurationError, match="dfs.namenode.http-address is the NameNode's WebHDFS address"):
        FilesDataSource({"path": "/tmp/x", "dfs.namenode.http-address": "nn:9871"}).build_sink()


@pytest.mark.parametrize("options,needle", [
    ({"compression": "lz4"}, "compression=lz4 for parquet: Spark's lz4 is Parquet's deprecated Hadoop-framed"),
    ({"compression": "lzo"}, "compression=lzo for parquet"),
    ({"format": "csv", "compression": "snappy"}, "compression=snappy for csv"),
    ({"format": "json", "compression": "deflate"}, "compression=deflate for json"),
    ({"format": "csv", "dateFormat": "dd/MM/yyyy"}, "dateFormat='dd/MM/yyyy' is not supported"),
    ({"format": "csv", "encoding": "UTF-16"}, "encoding='UTF-16' is not supported"),
    ({"format": "csv", "sep": "||"}, "sep='||': only one character"),
    ({"format": "csv", "lineSep": "\r\n"}, "lineSep='\\r\\n': csv takes one character"),
    ({"sep": ";"}, "sep is a csv option; format is parquet"),
    ({"format": "csv", "ignoreNullFields": "false"}, "ignoreNullFields is a json option; format is csv"),
    ({"format": "csv", "quoteAll": "maybe"}, "quoteAll must be true or false"),
])
def test_a_spark_file_option_without_its_meaning_here_is_refused_naming_it(options, needle):
    with pytest.raises(ConfigurationError) as e:
        FilesDataSource({"path": "/tmp/x", **{k.lower(): v for k, v in options.items()}}).build_sink()
    assert needle in str(e.value), str(e.value)


def _write_one_batch(sink: FileSink, rows: int = 3) -> None:
    sink.open()
    intent = sink.plan_batch("opts", 0, 1)
    txn = sink.begin_transaction(TransactionContext("opts", 0, 0, 0, intent))
    sink.write(txn, pa.record_batch({"id": list(range(rows))}))
    assert sink.commit(sink.pre_commit(txn)).done


@pytest.mark.s3
def test_s3a_options_as_a_spark_job_gives_them_reach_a_real_s3_endpoint(s3_service):
    """Spark's S3A settings (host:port endpoint, no TLS, path-style, access and secret key) as
    options: the sink opens, writes and commits to MinIO with them, and nothing else."""
    from tests.services.s3 import client

    endpoint = s3_service["endpoint_url"].split("://", 1)[1]
    prefix = f"twophase-test/opts-{uuid.uuid4().hex[:8]}"
    sink = FilesDataSource({"path": f"s3a://{s3_service['bucket']}/{prefix}", "fs.s3a.endpoint": endpoint,
                            "fs.s3a.connection.ssl.enabled": "false", "fs.s3a.path.style.access": "true",
                            "fs.s3a.access.key": s3_service["key"], "fs.s3a.secret.key": s3_service["secret"],
                            "fs.s3a.endpoint.region": s3_service["region"]}).build_sink()
    s3 = client(s3_service)
    try:
        _write_one_batch(sink)
        keys = [o["Key"] for o in s3.list_objects_v2(Bucket=s3_service["bucket"], Prefix=prefix).get("Contents", [])]
        assert len([k for k in keys if k.endswith(".parquet")]) == 1, keys
    finally:
        for o in s3.list_objects_v2(Bucket=s3_service["bucket"], Prefix=prefix).get("Contents", []):
            s3.delete_object(Bucket=s3_service["bucket"], Key=o["Key"])


@pytest.mark.hdfs
def test_an_hdfs_path_with_the_namenodes_http_address_writes_over_webhdfs(hdfs_service, monkeypatch):
    """The minicluster serves WebHDFS on another port than Hadoop 3's default 9870: the Hadoop
    setting a Spark job would carry names it, and the hdfs:// path (its RPC port) is written."""
    from hdfs import InsecureClient

    monkeypatch.setenv("HADOOP_USER_NAME", hdfs_service["user"])
    path = f"/twophase-test/opts-{uuid.uuid4().hex[:8]}"
    http = hdfs_service["webhdfs_url"].split("://", 1)[1]
    sink = FilesDataSource({"path": hdfs_service["namenode"] + path, "dfs.namenode.http-address": http}).build_sink()
    hdfs = InsecureClient(hdfs_service["webhdfs_url"], user=hdfs_service["user"])
    try:
        _write_one_batch(sink)
        assert [n for n in hdfs.list(path) if n.endswith(".parquet")] != []
    finally:
        hdfs.delete(path, recursive=True)
    # Without the setting, the default port is tried, and the error says where the address came from.
    with pytest.raises(Exception, match="9870"):
        FilesDataSource({"path": hdfs_service["namenode"] + path}).build_sink().open()


@pytest.mark.spark
def test_writer_spark_passes_the_text_options_and_max_records_per_file_to_sparks_writer(spark, tmp_path):
    """FileSink(writer="spark") writes a batch with Spark's own writer: the same options reach it
    by Spark's names, so both writers give the same bytes and the same split into files."""
    from twophase.coordinator import Coordinator

    old_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "UTC")
    try:
        df = spark.sql(_ROWS_SQL).coalesce(1)
        text = {"sep": ";", "null_value": "NULL", "quote_all": True, "line_sep": "\r"}
        for writer in ("spark", "arrow"):
            sink = FileSink(str(tmp_path / writer), format="csv", text_options=text, max_records_per_file=2,
                            writer=writer)
            Coordinator(sink, log_location=str(tmp_path / f"log-{writer}"), name=f"w{writer}").write(df, batch_id=0)
    finally:
        spark.conf.set("spark.sql.session.timeZone", old_tz)
    by_writer = {}
    for writer in ("spark", "arrow"):
        def nth(f: Path) -> int:  # a task's first file, then -c001, -c002, ...
            m = re.search(r"-c(\d{3,})-", f.name)
            return int(m.group(1)) if m else 0

        files = sorted((tmp_path / writer).glob("*.csv"), key=nth)
        texts = [f.read_bytes().decode("utf-8") for f in files]
        by_writer[writer] = ([t.count("\r") for t in texts], "".join(texts))
    assert by_writer["spark"] == by_writer["arrow"]
    assert by_writer["arrow"][0] == [2, 1] and '"1";"a,b";"x;y";"NULL"' in by_writer["arrow"][1]


def test_the_new_arguments_survive_the_sinks_config_for_twophase_recover(tmp_path):
    from twophase.config import sink_from_config

    sink = _sink(format="csv", sep=";", quoteall="true", maxrecordsperfile="5")
    cfg = sink.to_config()
    assert cfg["text_options"] == {"sep": ";", "quote_all": True} and cfg["max_records_per_file"] == 5
    again = sink_from_config(cfg)
    assert (again.text, again.max_records_per_file) == (sink.text, 5)
