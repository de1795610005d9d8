"""The coordinator with a real local Spark session: steps 1-6 of the protocol, errors, refusals."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from twophase import CommitResult, DataLossError, HandleError
from twophase.coordinator import Coordinator
from twophase.errors import CommitError, ConfigurationError, CorruptLogError
from twophase.log import PREPARED, TransactionLog
from twophase.sinks.files import FileSink

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]


def output_ids(folder: Path) -> list[int]:
    ids: list[int] = []
    for p in sorted(folder.glob("*.parquet")):
        ids.extend(pq.read_table(p).column("id").to_pylist())
    return ids


def frame(spark, lo, hi, parts=2):
    return spark.range(lo, hi, numPartitions=parts).selectExpr("id", "concat('v', id) as v")


def test_batch_write_is_exactly_once_across_reruns(spark, tmp_path):
    out, log = tmp_path / "out", str(tmp_path / "log")
    c = Coordinator(FileSink(str(out)), log_location=log, name="b")
    p = c.write(frame(spark, 0, 100), batch_id=0)
    assert p["action"] == "committed" and p["rows"] == 100 and p["handles"] == 2
    assert {"prepare_ms", "commit_ms", "log_ms", "total_ms"} <= p.keys()
    # A re-run of the same job with the same batch id: skipped, not written twice.
    c2 = Coordinator(FileSink(str(out)), log_location=log, name="b")
    assert c2.write(frame(spark, 0, 100), batch_id=0)["action"] == "skipped"
    c2.write(frame(spark, 100, 150), batch_id=1)
    assert sorted(output_ids(out)) == list(range(150))
    # No staged file left (a pattern like "*.a*" also matched the query's folder, b.<log id>g1,
    # whenever the log id began with "a": one run in sixteen failed).
    assert not [p for p in (out / "_twophase").rglob("*") if p.is_file()]


def test_streaming_foreach_batch(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    for f in range(3):
        (src / f"f{f}.json").write_text("".join(json.dumps({"id": f * 10 + i}) + "\n" for i in range(10)))
    out, cp = tmp_path / "out", str(tmp_path / "cp")
    c = Coordinator(FileSink(str(out)), checkpoint_location=cp, name="s")
    q = (spark.readStream.schema("id LONG").option("maxFilesPerTrigger", 1).json(str(src))
         .writeStream.foreachBatch(c).option("checkpointLocation", cp).trigger(availableNow=True).start())
    q.awaitTermination()
    assert sorted(output_ids(out)) == list(range(30))
    assert c.last_progress["batch_id"] == 2 and len(c.recent_progress) == 3
    tlog = TransactionLog(cp + "/twophase")
    last = tlog.last_committed()
    assert last.batch_id == 2
    assert last.body["source"]["sources"] == [{"logOffset": 2}]  # Spark's offsets/2 for the file source


def test_checkpoint_given_only_to_the_query_is_found_and_offsets_recorded(spark, tmp_path):
    """Issue 19: the coordinator reads the running query's checkpoint; a different one is refused."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(5)))
    out, cp, log = tmp_path / "out", str(tmp_path / "cp"), str(tmp_path / "log")
    c = Coordinator(FileSink(str(out)), log_location=log, name="found")
    q = (spark.readStream.schema("id LONG").json(str(src)).writeStream.foreachBatch(c)
         .option("checkpointLocation", cp).trigger(availableNow=True).start())
    q.awaitTermination()
    assert sorted(output_ids(out)) == list(range(5))
    assert c.checkpoint_location == os.path.realpath(cp) or c.checkpoint_location == cp
    assert TransactionLog(log).last_committed().body["source"]["sources"] == [{"logOffset": 0}]

    other = tmp_path / "other"
    c2 = Coordinator(FileSink(str(tmp_path / "out2")), log_location=str(tmp_path / "log2"),
                     checkpoint_location=str(other), name="wrong")
    q = (spark.readStream.schema("id LONG").json(str(src)).writeStream.foreachBatch(c2)
         .option("checkpointLocation", str(tmp_path / "cp2")).trigger(availableNow=True).start())
    with pytest.raises(Exception, match="is not the query's checkpoint"):
        q.awaitTermination()
    assert not (tmp_path / "out2").exists() or output_ids(tmp_path / "out2") == []


class FlakyCommit(FileSink):
    """Commit fails ``failures`` times (a transient outage after the decision was logged)."""

    def __init__(self, *a, failures=0, **kw):
        super().__init__(*a, **kw)
        self.failures = failures

    def commit(self, handle):
        if self.failures > 0:
            self.failures -= 1
            raise ConnectionError("target unreachable")
        return super().commit(handle)


def test_failed_commit_after_decision_is_recommitted_on_replay(spark, tmp_path):
    out, log = tmp_path / "out", str(tmp_path / "log")
    c = Coordinator(FlakyCommit(str(out), failures=100), log_location=log, name="f", commit_retries=2,
                    retry_backoff=0.01)
    with pytest.raises(CommitError, match="batch 0: committing .* failed 3 times.*decision is logged"):
        c.write(frame(spark, 0, 50), batch_id=0)
    assert output_ids(out) == []
    tlog = TransactionLog(log)
    assert tlog.batches()[0].keys() == {"intent", "prepared"}
    # The replay (a restarted job) re-commits the logged handles; it does not run the executors again.
    c2 = Coordinator(FlakyCommit(str(out), failures=1), log_location=log, name="f", retry_backoff=0.01)
    p = c2.write(frame(spark, 1000, 1001), batch_id=0)  # different rows: proof they are not re-read
    assert p["action"] in ("recommitted", "skipped")
    assert sorted(output_ids(out)) == list(range(50))


class LosingSink(FileSink):
    def commit(self, handle):
        return CommitResult.lost("the transaction expired")


def test_lost_commit_is_reported_as_data_loss(spark, tmp_path):
    c = Coordinator(LosingSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="l")
    with pytest.raises(DataLossError) as e:
        c.write(frame(spark, 0, 10), batch_id=4)
    msg = str(e.value)
    assert "DATA LOSS: batch 4" in msg and "expired" in msg and "part-00000004" in msg
    assert e.value.batch_id == 4
    c2 = Coordinator(LosingSink(str(tmp_path / "out2")), log_location=str(tmp_path / "log2"), name="l",
                     ignore_failures_after_transaction_timeout=True)
    assert c2.write(frame(spark, 0, 10), batch_id=4)["action"] == "committed"


def test_corrupt_decision_stops_the_job(spark, tmp_path):
    log = str(tmp_path / "log")
    c = Coordinator(FlakyCommit(str(tmp_path / "out"), failures=100), log_location=log, name="c",
                    commit_retries=0)
    with pytest.raises(CommitError):
        c.write(frame(spark, 0, 10), batch_id=0)
    rec = tmp_path / "log" / "g0001" / "batch-000000000000.prepared.json"
    rec.write_text(rec.read_text()[:40])  # truncated, as by a torn write or a bad copy
    c2 = Coordinator(FileSink(str(tmp_path / "out")), log_location=log, name="c")
    with pytest.raises(CorruptLogError, match=str(rec)):
        c2.write(frame(spark, 0, 10), batch_id=0)
    assert output_ids(tmp_path / "out") == []


def test_unknown_handle_version_in_log_is_refused(spark, tmp_path):
    log = str(tmp_path / "log")
    c = Coordinator(FlakyCommit(str(tmp_path / "out"), failures=100), log_location=log, name="u",
                    commit_retries=0)
    with pytest.raises(CommitError):
        c.write(frame(spark, 0, 10), batch_id=0)
    # Rewrite the decision as a future twophase would, with a handle format this one does not know.
    tlog = TransactionLog(log)
    prepared = tlog.batches()[0][PREPARED].body
    path = tmp_path / "log" / "g0001" / "batch-000000000000.prepared.json"
    os.unlink(path)
    tlog.acquire(tlog.generations()[0]["query_id"], "u")
    tlog.write(0, PREPARED, {"handles": [dict(h, v=7) for h in prepared["handles"]], "rows": 10})
    c2 = Coordinator(FileSink(str(tmp_path / "out")), log_location=log, name="u")
    with pytest.raises(HandleError, match="version 7"):
        c2.write(frame(spark, 0, 10), batch_id=0)
    assert TransactionLog(log).batches()[0].keys() == {"intent", "prepared"}  # nothing marked committed


def test_replaced_checkpoint_is_refused(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text('{"id": 1}\n')
    log = str(tmp_path / "log")

    def run(cp):
        c = Coordinator(FileSink(str(tmp_path / "out")), log_location=log, name="r")
        q = (spark.readStream.schema("id LONG").json(str(src)).writeStream.foreachBatch(c)
             .option("checkpointLocation", str(cp)).trigger(availableNow=True).start())
        q.awaitTermination()

    run(tmp_path / "cp1")
    with pytest.raises(Exception, match="belongs to streaming query"):
        run(tmp_path / "cp2")  # a new checkpoint = a new query id: batch 0 again
    assert output_ids(tmp_path / "out") == [1]


def _interrupted_first_batch(cp: Path) -> list[Path]:
    """What a driver SIGKILLed between Spark's temp write and rename of ``offsets/0`` leaves (seen in CI)."""
    (cp / "offsets").mkdir(parents=True)
    (cp / "commits").mkdir()
    tmp = cp / "offsets" / ".0.fa2423c1-a2cc-40f9-a272-fa6b6ed55718.tmp"
    tmp.write_text('v1\n{"batchWatermarkMs":0}\n{"logOffset":0}\n')
    crc = cp / "offsets" / "..0.fa2423c1-a2cc-40f9-a272-fa6b6ed55718.tmp.crc"
    crc.write_bytes(b"crc")
    return [tmp, crc]


def test_kill_during_the_first_offsets_write_does_not_wedge_the_query(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text("".join(json.dumps({"id": i}) + "\n" for i in range(5)))

    def start(cp, each_batch):
        return (spark.readStream.schema("id LONG").json(str(src)).writeStream.foreachBatch(each_batch)
                .option("checkpointLocation", str(cp)).trigger(availableNow=True).start())

    # Spark alone: the leftover temp file makes every restart fail, forever.
    bare = tmp_path / "bare"
    _interrupted_first_batch(bare)
    with pytest.raises(Exception, match="CHECKPOINT_LOCATION_NOT_EMPTY"):
        start(bare, lambda df, bid: None).awaitTermination()
    # With the coordinator given the checkpoint: the temp files go, the query runs batch 0.
    cp = tmp_path / "cp"
    leftovers = _interrupted_first_batch(cp)
    c = Coordinator(FileSink(str(tmp_path / "out")), checkpoint_location=str(cp), name="k")
    assert not any(p.exists() for p in leftovers)
    start(cp, c).awaitTermination()
    assert sorted(output_ids(tmp_path / "out")) == list(range(5))
    assert (cp / "offsets" / "0").exists() and (cp / "commits" / "0").exists()


def test_clear_interrupted_start_touches_only_temp_files_of_an_unplanned_first_batch(tmp_path):
    from twophase.spark import clear_interrupted_start

    first = tmp_path / "first"
    leftovers = _interrupted_first_batch(first)
    other = first / "offsets" / "notes.txt"  # not Spark's: left for Spark's own check to report
    other.write_text("x")
    (first / "commits" / ".0.0b1e6f0c-0000-4000-8000-000000000000.tmp").write_text("v1")
    removed = clear_interrupted_start(str(first))
    assert sorted(removed) == sorted([str(p) for p in leftovers]
                                     + [str(first / "commits" / ".0.0b1e6f0c-0000-4000-8000-000000000000.tmp")])
    assert os.listdir(first / "offsets") == ["notes.txt"] and os.listdir(first / "commits") == []

    # Once batch 0 is planned, Spark restarts from it: a temp file of batch 1 is Spark's business.
    later = tmp_path / "later"
    later.mkdir()
    tmp1 = _interrupted_first_batch(later)[0].rename(later / "offsets" / ".1.fa2423c1-a2cc-40f9-a272-fa6b6ed55718.tmp")
    (later / "offsets" / "0").write_text("v1")
    assert clear_interrupted_start(str(later)) == [] and tmp1.exists()
    assert clear_interrupted_start(str(tmp_path / "missing")) == []


def test_called_outside_foreach_batch_is_explained(spark, tmp_path):
    c = Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"))
    with pytest.raises(Exception, match="outside a streaming foreachBatch"):
        c(frame(spark, 0, 1), 0)


def _driver(mode, tmp_path):
    r = subprocess.run([sys.executable, "-m", "tests.drivers.files_retry", mode, str(tmp_path / "out"),
                        str(tmp_path / "log")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(lines[-1])


def test_task_retries_never_duplicate(tmp_path):
    res = _driver("retry", tmp_path)
    assert res["ok"], res
    ids = output_ids(tmp_path / "out")
    assert sorted(ids) == list(range(1000))
    # The failed attempt's pre-committed staging file was aborted after the commit.
    assert not [p for p in (tmp_path / "out" / "_twophase").rglob("*") if p.is_file()]


def test_speculation_is_refused(tmp_path):
    res = _driver("speculation", tmp_path)
    assert not res["ok"] and res["error"] == "ConfigurationError"
    assert "spark.speculation=true" in res["message"]
    assert not (tmp_path / "out").exists() or output_ids(tmp_path / "out") == []


def test_async_progress_tracking_is_refused_by_spark_for_foreach_batch(spark, tmp_path):
    # Spark 4.x itself refuses it for foreachBatch ("Sink ForeachBatchSink does not support async
    # progress tracking") before any batch runs: this shows Spark's refusal, the coordinator's own
    # check is never reached here (the next test reaches it).
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text('{"id": 1}\n')
    c = Coordinator(FileSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="a")
    with pytest.raises(Exception) as e:
        q = (spark.readStream.schema("id LONG").json(str(src)).writeStream.foreachBatch(c)
             .option("checkpointLocation", str(tmp_path / "cp"))
             .option("asyncProgressTrackingEnabled", "true").trigger(processingTime="1 second").start())
        q.awaitTermination(60)
        q.stop()
    assert "async progress tracking" in str(e.value).lower() or "asyncprogress" in str(e.value).lower()
    assert not (tmp_path / "out").exists() or output_ids(tmp_path / "out") == []


def test_the_coordinators_own_async_progress_check_refuses_it(spark, tmp_path, monkeypatch):
    """Issue 46: the test above passes on Spark's refusal, so the coordinator's check never ran.
    A Spark that let async progress tracking through to foreachBatch would run the coordinator
    under an ``AsyncProgressTrackingMicroBatchExecution``: here the query the coordinator finds is
    one (a stand-in for the JVM object: the refusal above is this test's real-Spark twin), and its
    check of the Spark session, which runs before a batch's INTENT, refuses it."""
    import twophase.coordinator.environment as cmod

    class JavaClass:
        def getSimpleName(self):
            return "AsyncProgressTrackingMicroBatchExecution"

    class Execution:
        def getClass(self):
            return JavaClass()

        def resolvedCheckpointRoot(self):
            return str(tmp_path / "cp")

    class Query:
        class _jsq:  # noqa: N801 - pyspark's attribute name
            @staticmethod
            def streamingQuery():
                return Execution()

    monkeypatch.setattr(cmod, "_find_query", lambda spark, query_id: Query())
    c = Coordinator(FileSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="a")
    with pytest.raises(ConfigurationError, match="async progress tracking"):
        c._check_spark(spark, "q-1", streaming=True)
    # And with a plain micro-batch execution the same call passes: the check is the class, not the call.
    JavaClass.getSimpleName = lambda self: "MicroBatchExecution"  # type: ignore[method-assign]
    c._check_spark(spark, "q-1", streaming=True)


def test_replayed_decided_batch_of_a_stateful_query(spark, tmp_path):
    """A decided batch is re-committed, not re-written, on replay; its state must still commit."""
    src = tmp_path / "in"
    src.mkdir()
    (src / "a.json").write_text("".join(json.dumps({"k": i % 3}) + "\n" for i in range(30)))
    out, cp, log = tmp_path / "out", str(tmp_path / "cp"), str(tmp_path / "log")

    def run(sink, **kw):
        c = Coordinator(sink, log_location=log, name="agg", **kw)
        q = (spark.readStream.schema("k LONG").json(str(src)).groupBy("k").count()
             .writeStream.outputMode("update").foreachBatch(c).option("checkpointLocation", cp)
             .trigger(availableNow=True).start())
        q.awaitTermination()
        return c

    with pytest.raises(Exception, match="failed 1 times"):
        run(FlakyCommit(str(out), failures=100), commit_retries=0)  # decided, commit fails: the query stops
    c = run(FileSink(str(out)))  # replay of the decided batch 0: re-committed, state committed
    assert c.recent_progress[0]["action"] in ("recommitted", "skipped")
    rows = [r for p in sorted(out.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]
    assert sorted((r["k"], r["count"]) for r in rows) == [(0, 10), (1, 10), (2, 10)]


def test_checkpoint_spellings_that_name_the_same_location():
    from twophase.coordinator.coordinator import _same_location

    assert _same_location("/chk/events", "file:/chk/events")
    assert _same_location("/chk/events/", "file:/chk/events")
    # Scheme-less or authority-less paths resolve against the default filesystem (HDFS on a cluster).
    assert _same_location("/chk/events", "hdfs://nn:8020/chk/events")
    assert _same_location("hdfs:///chk/events", "hdfs://nn:8020/chk/events")
    assert _same_location("hdfs://nn:8020/chk/events", "hdfs://nn:8020/chk/events")
    assert _same_location("s3://bucket/chk", "s3a://bucket/chk")
    assert not _same_location("/chk/other", "file:/chk/events")
    assert not _same_location("/chk/other", "hdfs://nn:8020/chk/events")
    assert not _same_location("hdfs://other:8020/chk/events", "hdfs://nn:8020/chk/events")


def test_creating_a_coordinator_logs_each_temp_file_it_removes_with_the_reason(tmp_path, caplog):
    """Issue 19: the clean-up stays before start() (Spark refuses the query before any batch
    runs), but it is not silent: one INFO line per removed file, saying why."""
    cp = tmp_path / "cp"
    leftovers = _interrupted_first_batch(cp)
    with caplog.at_level(logging.INFO, logger="twophase"):
        Coordinator(FileSink(str(tmp_path / "out")), checkpoint_location=str(cp), name="k")
    assert not any(p.exists() for p in leftovers)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "removed" in r.getMessage()]
    assert len(infos) == 2, infos
    for p, msg in zip(sorted(leftovers), sorted(infos)):
        assert str(p) in msg and "interrupted before its first batch was planned" in msg
        assert "refuses to start a query at batch 0" in msg
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_file_that_will_stop_spark_from_starting_is_kept_and_explained(tmp_path, caplog):
    cp = tmp_path / "cp"
    _interrupted_first_batch(cp)
    stray = cp / "offsets" / "notes.txt"
    stray.write_text("x")
    with caplog.at_level(logging.INFO, logger="twophase"):
        Coordinator(FileSink(str(tmp_path / "out")), checkpoint_location=str(cp), name="k")
    assert stray.exists()
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY" in warning and "notes.txt" in warning
    assert "move them out of that directory and start the query again" in warning
    # Once batch 0 is planned, nothing is said: Spark restarts from it.
    (cp / "offsets" / "0").write_text("v1")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="twophase"):
        Coordinator(FileSink(str(tmp_path / "out")), checkpoint_location=str(cp), name="k")
    assert not [r for r in caplog.records if "STATE_STORE" in r.getMessage() or "removed" in r.getMessage()]


def test_a_checkpoint_that_cannot_be_checked_is_explained_not_fatal(tmp_path, caplog, monkeypatch):
    import twophase.log

    def unreachable(*a, **k):
        raise OSError("connection refused")

    monkeypatch.setattr(twophase.log, "open_store", unreachable)
    cp = str(tmp_path / "cp")
    with caplog.at_level(logging.WARNING, logger="twophase"):
        Coordinator(FileSink(str(tmp_path / "out")), checkpoint_location=cp, name="k")
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "connection refused" in warning and "STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY" in warning
    assert f"clear_interrupted_start({cp!r})" in warning


@pytest.mark.spark
def test_a_batch_ending_in_a_shuffle_computes_its_input_once(spark, tmp_path):
    """Under adaptive query execution ``df.rdd`` runs a plan's shuffle stages to settle its final
    form; the coordinator used it to count the batch's partitions, and the write then ran the
    stages again: every row before the shuffle was computed twice."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    assert spark.conf.get("spark.sql.adaptive.enabled") == "true"
    seen = spark.sparkContext.accumulator(0)

    @F.udf(LongType())
    def counted(x):
        seen.add(1)
        return x

    df = (spark.range(0, 1000, numPartitions=4).select(counted("id").alias("id"))
          .groupBy((F.col("id") % 10).alias("k")).agg(F.count("*").alias("n"), F.sum("id").alias("total")))
    # driver_batch_rows=0: batch 1 (after 10 rows) must plan its partitions for tasks, not take the
    # driver path's one transaction, which writes one file whatever the plan.
    c = Coordinator(FileSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="aqe",
                    driver_batch_rows=0)
    prog = c.write(df, batch_id=0)
    assert (prog["action"], prog["rows"]) == ("committed", 10)
    assert seen.value == 1000  # was 2000
    rows = pq.read_table(str(tmp_path / "out")).to_pylist()
    assert sorted((r["k"], r["n"], r["total"]) for r in rows) == [
        (k, 100, sum(range(k, 1000, 10))) for k in range(10)]
    assert prog["handles"] <= 2  # the writer slots of local[2]
    # A batch that ends in the user's own coalesce(1) keeps it: a coalesce of ours on top would be
    # merged into it by Spark's optimizer and write two files.
    prog = c.write(df.repartition(4).coalesce(1), batch_id=1)
    assert (prog["rows"], prog["handles"]) == (10, 1)
    assert len(list((tmp_path / "out").glob("*-00000001-*.parquet"))) == 1
