"""FileSink(writer="spark"): one ``df.write`` per batch into the batch's staging folder, through
the coordinator's driver-side hook (``TwoPhaseCommitSink.prepare_batch``)."""

from __future__ import annotations

import os

import pytest

from tests.test_files_remote import (  # noqa: F401 - fixtures (hdfs, hroot) and helpers
    hdfs,
    hopts,
    hroot,
    hstaged,
    hvisible,
)
from twophase import CommitOutcome
from twophase.context import BatchContext
from twophase.errors import ConfigurationError, HandleError
from twophase.sinks.files import FileSink


def local_visible(root) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if not x.startswith(("_", "."))]
        out += [os.path.relpath(os.path.join(d, f), root) for f in files if not f.startswith(("_", "."))]
    return sorted(out)


def local_staged(root) -> list[str]:
    st = os.path.join(root, "_twophase")
    return sorted(os.path.join(d, f) for d, _, files in os.walk(st) for f in files)


def test_writer_option_is_validated(tmp_path):
    with pytest.raises(ConfigurationError, match="writer must be"):
        FileSink(str(tmp_path), writer="pandas")
    with pytest.raises(ConfigurationError, match="local paths and HDFS only"):
        FileSink("s3://bucket/x", writer="spark")
    with pytest.raises(ConfigurationError, match="brotli"):
        FileSink(str(tmp_path), compression="brotli", writer="spark")
    with pytest.raises(ConfigurationError, match="zstd"):
        FileSink(str(tmp_path), "jsonl", compression="zstd", writer="spark")
    s = FileSink(str(tmp_path), writer="spark")
    assert s.to_config()["writer"] == "spark"
    assert FileSink.from_config(s.to_config()).writer == "spark"
    assert "writer" not in FileSink(str(tmp_path)).to_config()  # the backend's default is not written
    # defaults by backend (docs/benchmarks.md): Spark's writer on HDFS, the Arrow writers elsewhere
    assert FileSink(str(tmp_path)).writer == "arrow"
    assert FileSink("hdfs://nn:8020/x").writer == "spark"
    assert FileSink("webhdfs://nn:9870/x").writer == "arrow"  # issue 26: Spark cannot write webhdfs://
    assert FileSink("swebhdfs://nn:9871/x").writer == "arrow"
    assert FileSink("s3://bucket/x").writer == "arrow"
    assert FileSink("hdfs://nn:8020/x", writer="arrow").to_config()["writer"] == "arrow"


def test_a_handle_naming_a_file_outside_the_writer_layout_is_refused(tmp_path):
    root = str(tmp_path)
    s = FileSink(root, writer="spark")
    st = os.path.join(root, "_twophase", "q", "b00000001")
    ok = {"staging": os.path.join(st, "wabc", "k=1", "part-00000-x-c000.snappy.parquet"),
          "final": os.path.join(root, "k=1", "part-00000001-00000.parquet"), "size": 3}
    s._backend.check_entry(ok)
    for staging in (os.path.join(st, "wabc", "k", "p.parquet"),      # not a col=value folder
                    os.path.join(st, "_temporary", "k=1", "p.parquet"),  # not a w<token> folder
                    os.path.join(st, "wabc", "_x=1", "p.parquet")):
        with pytest.raises(HandleError):
            s._backend.check_entry(dict(ok, staging=staging))


@pytest.mark.spark
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_coordinator_with_sparks_writer_on_local_disk(spark, tmp_path, fmt):
    from twophase.coordinator import Coordinator

    root = str(tmp_path / "out")
    sink = FileSink(root, fmt, writer="spark", partition_by=["k"], header=fmt == "csv")
    df = spark.range(0, 300, numPartitions=3).selectExpr("id", "cast(id % 3 as string) AS k")
    c = Coordinator(sink, log_location=str(tmp_path / "log"), name="sw")
    prog = c.write(df, batch_id=0)
    assert (prog["action"], prog["rows"]) == ("committed", 300)
    assert c.write(df, batch_id=0)["action"] == "skipped"
    assert c.write(df.where("id < 30"), batch_id=1)["rows"] == 30
    files = local_visible(root)
    ext = {"parquet": "parquet", "jsonl": "jsonl", "csv": "csv"}[fmt]
    assert files and all(f.split("/")[0] in ("k=0", "k=1", "k=2") for f in files), files
    # part-<batch>-<task>[-c<file>]-<scope>.<ext> (issue 25: scoped by the pipeline and generation)
    assert {"-".join(os.path.basename(f).split("-")[:2]) for f in files} == {"part-00000000", "part-00000001"}
    assert len({os.path.basename(f).rsplit("-", 1)[1] for f in files}) == 1
    assert all(f.endswith("." + ext) for f in files)
    reader = {"parquet": spark.read.parquet, "jsonl": spark.read.json,
              "csv": lambda p: spark.read.option("header", "true").csv(p)}[fmt]
    rows = reader(root).collect() if fmt != "jsonl" else spark.read.json(f"{root}/*/*.jsonl").collect()
    ids = sorted(int(r["id"]) for r in rows)
    assert ids == sorted(list(range(300)) + list(range(30)))
    assert local_staged(root) == []
    assert not os.path.exists(os.path.join(root, "_twophase", "sw", "b00000000"))


@pytest.mark.spark
def test_an_interrupted_job_leaves_only_staging_that_abort_lingering_removes(spark, tmp_path):
    """What a driver crash after the job (before PREPARED) leaves: staged files only, invisible."""
    root = str(tmp_path / "out")
    sink = FileSink(root, writer="spark")
    sink.open()
    intent = sink.plan_batch("q", 4, 2)
    df = spark.range(0, 100, numPartitions=2)
    done = sink.prepare_batch(df, BatchContext("q", 4, intent, "e1abc"))
    assert done is not None and done.rows == 100 and len(done.handles) == 2
    assert local_visible(root) == []
    assert len(local_staged(root)) >= 2
    assert sink.abort_lingering("q", 4, intent, []) >= 1
    assert local_staged(root) == [] and local_visible(root) == []
    for h in done.handles:  # the handles (never logged) are gone with the staging: LOST, not committed
        assert sink.commit(h).outcome is CommitOutcome.LOST


@pytest.mark.spark
def test_an_empty_batch_commits_nothing(spark, tmp_path):
    root = str(tmp_path / "out")
    sink = FileSink(root, writer="spark")
    sink.open()
    intent = sink.plan_batch("q", 0, 1)
    done = sink.prepare_batch(spark.range(0, 0, numPartitions=1), BatchContext("q", 0, intent, "r"))
    assert done is not None and (done.rows, done.handles) == (0, [])
    assert local_staged(root) == [] and local_visible(root) == []


@pytest.mark.hdfs
@pytest.mark.spark
def test_coordinator_with_sparks_writer_on_hdfs(hdfs_service, hdfs, hroot, spark):  # noqa: F811
    from twophase.coordinator import Coordinator

    url, path = hroot
    opts = hopts(hdfs_service)
    sink = FileSink(f"{url}/out", storage_options=opts, writer="spark", partition_by=["k"])
    df = spark.range(0, 500, numPartitions=2).selectExpr("id", "cast(id % 7 as string) AS k")
    c = Coordinator(sink, log_location=f"{url}/log", storage_options=opts, name="hdfsspark")
    assert c.write(df, batch_id=0)["rows"] == 500
    assert c.write(df, batch_id=0)["action"] == "skipped"
    ids = [r["id"] for r in spark.read.parquet(f"{url}/out").select("id").collect()]
    assert sorted(ids) == list(range(500))
    files = hvisible(hdfs, f"{path}/out")
    assert len(files) == 14 and all(f.startswith("k=") and "/part-00000000-0000" in f for f in files), files
    assert hstaged(hdfs, f"{path}/out") == []


@pytest.mark.hdfs
@pytest.mark.spark
def test_on_hdfs_parquet_rows_come_from_the_footers_and_a_batch_leaves_no_staging_folder(
        hdfs_service, hdfs, hroot, spark):  # noqa: F811
    """Without partition_by, rows are read from the Parquet footers (no Observation pass over the
    rows); Spark leaves no _SUCCESS marker, so the commit's cleanup removes the batch's staging
    folder at once, not at the next batch (it used to leave the emptied writer folder's parent)."""
    from twophase.coordinator import Coordinator

    url, path = hroot
    opts = hopts(hdfs_service)
    sink = FileSink(f"{url}/out", storage_options=opts, writer="spark")
    sink.open()
    intent = sink.plan_batch("q", 3, 3)
    df = spark.range(0, 1000, numPartitions=3)
    done = sink.prepare_batch(df, BatchContext("q", 3, intent, "e1abc"))
    assert done is not None and done.rows == 1000 and len(done.handles) == 3
    assert sorted(h["rows"] for h in done.handles) == [333, 333, 334]
    staged = hstaged(hdfs, f"{path}/out")
    assert len(staged) == 3 and not any(s.rsplit("/", 1)[1].startswith("_") for s in staged), staged
    sink.abort_lingering("q", 3, intent, [])

    c = Coordinator(sink, log_location=f"{url}/log", storage_options=opts, name="footers")
    assert c.write(df, batch_id=0)["rows"] == 1000
    queries = hdfs.list(f"{path}/out/_twophase")
    assert queries and all(hdfs.list(f"{path}/out/_twophase/{q}") == [] for q in queries), \
        [(q, hdfs.list(f"{path}/out/_twophase/{q}")) for q in queries]
    assert sorted(r["id"] for r in spark.read.parquet(f"{url}/out").collect()) == list(range(1000))


def test_parquet_footer_rows_reads_a_footer_larger_than_its_first_read_and_refuses_other_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from twophase.errors import TwoPhaseError
    from twophase.sinks.files import parquet_footer_rows

    wide = pa.table({f"column_with_a_long_name_{i:04d}": [i, i + 1, i + 2] for i in range(1500)})
    path = str(tmp_path / "wide.parquet")
    pq.write_table(wide, path)
    size = os.path.getsize(path)
    reads: list[int] = []

    def read_tail(p, sz, n):
        reads.append(n)
        with open(p, "rb") as f:
            f.seek(sz - n)
            return f.read()

    assert parquet_footer_rows(read_tail, path, size) == 3
    assert len(reads) == 2 and reads[1] > 64 * 1024, reads  # the footer did not fit the first read
    other = tmp_path / "part-00000-x.parquet"
    other.write_bytes(b"not parquet at all, but long enough")
    with pytest.raises(TwoPhaseError, match="no Parquet footer"):
        parquet_footer_rows(read_tail, str(other), other.stat().st_size)


#: docs/files.md's HDFS URL forms, on the test service: (URL form, storage options, the default writer).
#: webhdfs:// defaults to the Arrow writers: Hadoop's WebHDFS client in the pyspark wheel cannot run
#: (its shaded Jersey lacks RuntimeDelegateImpl: "Unexpected HTTP response: code=404 ...
#: op=GETFILESTATUS"), so Spark's writer is the default only where Spark reaches HDFS by RPC.
_HDFS_FORMS = {
    "hdfs-webhdfs_url": ("{namenode}{path}", lambda i: {"webhdfs_url": i["webhdfs_url"]}, "spark"),
    "hdfs-webhdfs_port": ("{namenode}{path}", lambda i: {"webhdfs_port": int(i["webhdfs_url"].rsplit(":", 1)[1])},
                          "spark"),
    "webhdfs": ("{webhdfs}{path}", lambda i: {}, "arrow"),
}


@pytest.mark.hdfs
@pytest.mark.spark
@pytest.mark.parametrize("form", sorted(_HDFS_FORMS))
def test_every_documented_hdfs_url_form_writes_with_the_default_writer(form, hdfs_service, hdfs, spark):  # noqa: F811
    """Issue 26: FileSink("webhdfs://nn:9870/path") with the default writer stopped at its first
    batch (Spark's Hadoop client cannot use WebHDFS from the pyspark wheel).  Each URL form of
    docs/files.md, sink and log, through the coordinator, with the default writer."""
    import uuid

    from twophase.coordinator import Coordinator

    pattern, options, writer = _HDFS_FORMS[form]
    path = f"/twophase-test/{uuid.uuid4().hex[:10]}"
    url = pattern.format(namenode=hdfs_service["namenode"], path=path,
                         webhdfs=hdfs_service["webhdfs_url"].replace("http://", "webhdfs://"))
    opts = dict(options(hdfs_service), user=hdfs_service["user"])
    try:
        sink = FileSink(f"{url}/out", storage_options=opts)
        assert sink.writer == writer
        assert "writer" not in sink.to_config()
        df = spark.range(0, 300, numPartitions=2).selectExpr("id", "cast(id % 3 as string) AS k")
        c = Coordinator(sink, log_location=f"{url}/log", storage_options=opts, name=f"forms-{form}")
        assert c.write(df, batch_id=0)["action"] == "committed"
        assert c.write(df, batch_id=0)["action"] == "skipped"
        c.close()
        ids = [r["id"] for r in spark.read.parquet(f"{hdfs_service['namenode']}{path}/out").collect()]
        assert sorted(ids) == list(range(300))
        assert hstaged(hdfs, f"{path}/out") == []
    finally:
        hdfs.delete(path, recursive=True)
