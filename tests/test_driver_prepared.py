"""Small batches prepared in the driver (issue 51): ``Coordinator(task_input="driver")`` and the driver
path ``"auto"`` takes after a batch of at most ``driver_batch_rows`` rows (by default 10,000;
``driver_batch_rows=0`` keeps ``"auto"`` on the task paths).

In-process (local[2], FileSink on local disk): the choice per batch, the bound checked by the collect
(a burst falls back to the Arrow task path, and says so), progress and log line, stateful queries kept
on tasks.  Against the real servers: each shipped sink (files, Kafka, PostgreSQL, MySQL) writes a
small batch through the driver path, then a burst through tasks with the same sink object, and each
id lands once.  The kill run (crash points in the driver) is at the end (``chaos``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.test_conformance import fast_path as _fast_path
from twophase.coordinator import Coordinator
from twophase.errors import ConfigurationError
from twophase.sinks.files import FileSink

REPO = Path(__file__).resolve().parents[1]
fast = pytest.fixture(_fast_path.__wrapped__, name="fast")  # tests/test_conformance.py's fast_path


def _frame(spark, lo: int, n: int, parts: int = 2):
    return spark.range(lo, lo + n, numPartitions=parts).selectExpr("id", "concat('v', id) as v")


def _file_ids(out: Path) -> list[int]:
    return sorted(i for p in out.glob("*.parquet") for i in pq.read_table(p).column("id").to_pylist())


def _write_all(c: Coordinator, spark, sizes: list[int]) -> list[dict]:
    progress, lo = [], 0
    for batch_id, n in enumerate(sizes):
        progress.append(dict(c.write(_frame(spark, lo, n), batch_id=batch_id)))
        lo += n
    return progress


def failing_frame(spark, marker: Path, error: str = "a collect that fails once (tests/test_driver_prepared.py)"):
    """``frame(lo, n)``: ids lo..lo+n-1 in one partition, through a column that raises
    ``RuntimeError(error)`` at its first evaluation each time ``marker`` appears (it deletes the
    marker): the driver's collect fails, and the Arrow tasks that write the batch after it succeed."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    def fails_once(x: int) -> int:
        try:
            os.remove(marker)
        except FileNotFoundError:
            return x
        raise RuntimeError(error)

    col = F.udf(fails_once, LongType())

    def frame(lo: int, n: int):
        return spark.range(lo, lo + n, numPartitions=1).select(col("id").alias("id"))

    return frame


# ------------------------------------------------------------------ the choice, in-process
def test_auto_takes_the_driver_path_after_a_small_batch_and_tasks_for_a_burst(spark, tmp_path, caplog):
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="drv", driver_batch_rows=1000,
                    small_batch_rows=2000)
    caplog.set_level(logging.INFO, logger="twophase.coordinator")
    sizes = [100, 100, 5000, 100, 1000, 300]
    progress = _write_all(c, spark, sizes)
    c.close()
    paths = [p["task_input"] for p in progress]
    # First batch: no previous one, Arrow.  After a small one: the driver.  The burst (5,000 rows after
    # 100) is found by the collect's bound and goes to the Arrow tasks, not the rows path the previous
    # batch's size would pick; after it, Arrow again (5,000 > every threshold); 1,000 rows = the bound:
    # the driver (the previous batch had 100 rows).
    assert paths == ["arrow", "driver", "arrow", "arrow", "driver", "driver"], progress
    assert progress[2]["input_note"].startswith("more rows than driver_batch_rows = 1000"), progress[2]
    assert progress[2]["collect_ms"] > 0 and progress[2]["handles"] == 2
    for p in (progress[1], progress[4], progress[5]):
        # One transaction, written by the driver: one handle, every row of the batch.
        assert (p["handles"], p["input_note"]) == (1, ""), p
        assert p["collect_ms"] > 0
    assert [p["rows"] for p in progress] == sizes
    assert _file_ids(out) == list(range(sum(sizes)))
    lines = [r.getMessage() for r in caplog.records if " rows, " in r.getMessage()]
    assert any("batch 1 committed: 100 rows, 1 handles, tasks' input driver," in m for m in lines), lines
    assert any("batch 2 committed: 5000 rows, 2 handles, tasks' input arrow (more rows than driver_batch_rows = "
               "1000" in m for m in lines), lines


def test_driver_input_stays_on_the_driver_up_to_the_bound_and_no_further(spark, tmp_path):
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="bound", task_input="driver",
                    driver_batch_rows=50)
    progress = _write_all(c, spark, [50, 51, 1, 0])
    # The same batch id again: decided before, nothing is collected or written.
    again = c.write(_frame(spark, 0, 50), batch_id=0)
    c.close()
    assert [p["task_input"] for p in progress] == ["driver", "arrow", "driver", "driver"], progress
    assert progress[1]["input_note"].startswith("more rows than driver_batch_rows = 50"), progress[1]
    assert progress[3]["handles"] == 0 and progress[3]["rows"] == 0  # empty: no transaction opened
    assert (again["action"], again["task_input"], again["collect_ms"]) == ("skipped", "", 0.0)
    assert _file_ids(out) == list(range(102))


def test_a_batch_of_few_partitions_is_collected_by_one_task_and_a_wider_one_keeps_its_tasks(spark, tmp_path):
    """The driver path's collect: ``coalesce(1)`` before the limit for a batch of at most two
    partitions (no second stage, issue 63), each partition its own task for a wider batch (a small
    batch may be a selective filter over a large input); the bound holds either way."""
    from twophase.coordinator.driver_path import _few_partitions

    assert _few_partitions(_frame(spark, 0, 10, parts=1)) and _few_partitions(_frame(spark, 0, 10, parts=2))
    assert not _few_partitions(_frame(spark, 0, 10, parts=3))
    # A plan under adaptive query execution is not counted (it would run its shuffle stages).
    assert not _few_partitions(_frame(spark, 0, 10).groupBy("v").count())
    # Nor one with an exchange or a subquery (preparing it runs jobs: a broadcast, the subquery).
    spark.conf.set("spark.sql.adaptive.enabled", "false")
    try:
        assert not _few_partitions(_frame(spark, 0, 10, parts=4).repartition(2))
        assert not _few_partitions(_frame(spark, 0, 10).where("id < (SELECT max(id) FROM range(3))"))
    finally:
        spark.conf.unset("spark.sql.adaptive.enabled")
    for parts in (2, 8):
        out = tmp_path / f"out{parts}"
        c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / f"log{parts}"), name=f"w{parts}",
                        task_input="driver", driver_batch_rows=50)
        progress = [dict(c.write(_frame(spark, lo, n, parts=parts), batch_id=b))
                    for b, (lo, n) in enumerate([(0, 50), (50, 51), (101, 7)])]
        c.close()
        assert [p["task_input"] for p in progress] == ["driver", "arrow", "driver"], (parts, progress)
        assert _file_ids(out) == list(range(108)), parts


def test_a_streaming_batchs_partitions_are_counted_on_the_rdd_foreach_batch_hands_over(spark, tmp_path):
    """Each micro-batch counted (a Kafka batch has a partition per topic partition with new records),
    on the plan over the batch's RDD that foreachBatch hands over: nothing planned again."""
    from twophase.coordinator.driver_path import _few_partitions

    seen = {}
    for parts in (2, 3):
        def each(df, batch_id, parts=parts):
            seen[parts] = (df._jdf.queryExecution().logical().getClass().getSimpleName(), _few_partitions(df))

        q = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 10).option("numPartitions", parts)
             .load().writeStream.foreachBatch(each).option("checkpointLocation", str(tmp_path / f"ck{parts}"))
             .trigger(once=True).start())
        q.awaitTermination(120)
        assert q.exception() is None
    assert seen == {2: ("LogicalRDD", True), 3: ("LogicalRDD", False)}, seen


def test_a_collect_whose_job_is_cancelled_fails_the_batch_instead_of_starting_the_task_path(spark, tmp_path):
    """A stopping query cancels the batch's running job (``q.stop()``: SPARK_JOB_CANCELLED).  If that
    job is the driver path's collect, the batch fails with the cancellation; before, the coordinator
    took it for a collect that cannot work and started the Arrow tasks for a query being stopped
    (seen at the stops of the cluster benchmark's driver-path queries).  Here the running jobs are
    cancelled from another thread while the collect waits on a slow column."""
    import threading

    from pyspark.sql import functions as F
    from pyspark.sql.types import LongType

    slow = F.udf(lambda x: (time.sleep(0.5), x)[1], LongType())
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="cancelled", task_input="driver")
    df = spark.range(0, 40, numPartitions=2).select(slow("id").alias("id"))
    timer = threading.Timer(3.0, spark.sparkContext.cancelAllJobs)
    timer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(Exception, match="SPARK_JOB_CANCELLED|cancelled"):
            c.write(df, batch_id=0)
    finally:
        timer.cancel()
        c.close()
    # 40 rows at 0.5 s over 2 cores is 10 s: the write ended at the cancellation, no task path after it.
    assert time.monotonic() - t0 < 9, time.monotonic() - t0
    assert not list(out.glob("*.parquet"))


def test_auto_collects_again_after_a_collect_that_failed_once(spark, tmp_path):
    """A collect that failed once (here a column that fails its first evaluation after a marker
    file appears, as an executor lost mid-collect would fail it) sends its batch to the tasks and
    keeps "auto" there for the next 10 batches, 20 after a second failure in a row; then the
    driver collects again, and a success starts the count over.  Before, one failure kept a
    long-running query off the driver path until its driver restarted."""
    marker = tmp_path / "fail-the-next-evaluation"
    frame = failing_frame(spark, marker)
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="again", driver_batch_rows=100)
    failing = {1, 12, 34}  # the first collect, the first after its 10 batches, and one after a success
    progress = []
    try:
        for b in range(36):
            if b in failing:
                marker.touch()
            progress.append(dict(c.write(frame(b * 10, 10), batch_id=b)))
    finally:
        c.close()
    paths = [p["task_input"] for p in progress]
    # Collected: batch 1 (failed), 12 after its 10 (failed), 33 after 20 more (the driver path),
    # 34 (failed: 10 more from here, the count started over).  Every other batch: the tasks.
    tried = [b for b, p in enumerate(progress) if p["collect_ms"] > 0]
    assert tried == [1, 12, 33, 34], (tried, paths)
    assert [b for b, p in enumerate(paths) if p == "driver"] == [33], paths
    for b, wait in ((1, 10), (12, 20), (34, 10)):
        note = progress[b]["input_note"]
        assert note.startswith("the driver's collect failed ("), (b, note)
        assert f"the coordinator's next {wait} (then it collects again)" in note, (b, note)
    assert not marker.exists()
    assert [p["rows"] for p in progress] == [10] * 36
    assert _file_ids(out) == list(range(360))


def test_auto_never_collects_again_after_a_collect_out_of_memory(spark, tmp_path, monkeypatch):
    """A collect that failed with an OutOfMemoryError (here a column whose error says so, once) is
    not tried again by that coordinator: the same rows would run the heap out again, and the driver's
    JVM may die of it the next time.  The wait of other failures is cut to 2 batches here."""
    import twophase.coordinator.driver_path as coordinator_module

    monkeypatch.setattr(coordinator_module, "_COLLECT_RETRY_FIRST", 2)
    marker = tmp_path / "fail-the-next-evaluation"
    frame = failing_frame(spark, marker, "java.lang.OutOfMemoryError: Java heap space (tests/test_driver_prepared.py)")
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="oom", driver_batch_rows=100)
    progress = []
    try:
        for b in range(6):
            if b == 1:
                marker.touch()
            progress.append(dict(c.write(frame(b * 10, 10), batch_id=b)))
    finally:
        c.close()
    assert [b for b, p in enumerate(progress) if p["collect_ms"] > 0] == [1], progress
    assert "driver" not in [p["task_input"] for p in progress], progress
    note = progress[1]["input_note"]
    assert "(RuntimeError: java.lang.OutOfMemoryError: Java heap space" in note, note
    assert "out of memory: it does not collect again" in note, note
    assert _file_ids(out) == list(range(60))


def test_driver_path_settings_are_checked(tmp_path):
    with pytest.raises(ConfigurationError, match="task_input must be one of auto, arrow, rows, driver"):
        Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"), task_input="pickle")
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigurationError, match="driver_batch_rows"):
            Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"), driver_batch_rows=bad)


@pytest.mark.parametrize("driver_batch_rows", ["not given", None, 0])
def test_auto_takes_the_driver_path_by_default_and_driver_batch_rows_0_keeps_tasks(spark, tmp_path,
                                                                                    driver_batch_rows):
    from twophase.coordinator.coordinator import DRIVER_BATCH_ROWS

    out = tmp_path / "out"
    given = {} if driver_batch_rows == "not given" else {"driver_batch_rows": driver_batch_rows}
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="zero", **given)
    progress = _write_all(c, spark, [100, 100])
    c.close()
    # The first batch has no previous size: tasks.  The default bound (None means it) sends the
    # second to the driver; driver_batch_rows=0 keeps "auto" on the task paths (rows: 100 <= 2,000).
    expected = ["arrow", "rows"] if driver_batch_rows == 0 else ["arrow", "driver"]
    assert [p["task_input"] for p in progress] == expected, progress
    assert c.driver_batch_rows == (0 if driver_batch_rows == 0 else DRIVER_BATCH_ROWS)
    assert DRIVER_BATCH_ROWS == 10000  # the measured bound (docs/benchmarks.md)
    assert _file_ids(out) == list(range(200))


def _stream(spark, src: Path, ck: Path, coordinator: Coordinator, stateful: bool) -> None:
    df = spark.readStream.schema("id LONG").option("maxFilesPerTrigger", 1).json(str(src))
    if stateful:
        df = df.dropDuplicates(["id"])
    q = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", str(ck))
         .trigger(availableNow=True).start())
    q.awaitTermination(300)
    assert q.exception() is None, q.exception()


def test_streaming_stateless_takes_the_driver_path_and_a_stateful_query_keeps_tasks(spark, tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    base = int(time.time()) - 10
    for f in range(3):
        path = src / f"part-{f}.json"
        path.write_text("".join(json.dumps({"id": f * 100 + i}) + "\n" for i in range(100)))
        os.utime(path, (base + f, base + f))
    found = {}
    for stateful in (False, True):
        out = tmp_path / f"out-{stateful}"
        c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / f"log-{stateful}"), name=f"st{int(stateful)}",
                        task_input="driver")
        _stream(spark, src, tmp_path / f"ck-{stateful}", c, stateful)
        c.close()
        found[stateful] = [(p["task_input"], p["input_note"]) for p in c.recent_progress]
        assert _file_ids(out) == list(range(300))
    assert found[False] == [("driver", "")] * 3, found
    # dropDuplicates keeps a state store per shuffle partition: a limit could leave some unrun.
    assert found[True] == [("arrow", "a stateful query keeps the task path")] * 3, found


# ------------------------------------------------------------------ every shipped sink, real servers
def _small_then_burst(spark, sink, tmp_path, frame) -> list[dict]:
    """Batches of 100 (Arrow: no previous batch), 100 (driver), 100 again under batch 1 (skipped),
    600 (over the bound of 500: Arrow tasks, the same sink object shipped), 100 (rows tasks: 600 is over
    the driver's bound, under small_batch_rows)."""
    c = Coordinator(sink, log_location=str(tmp_path / "log"), name=f"d{uuid.uuid4().hex[:6]}", driver_batch_rows=500)
    progress = []
    try:
        for batch_id, (lo, n) in enumerate([(0, 100), (100, 100), (100, 100), (200, 600), (800, 100)]):
            progress.append(dict(c.write(frame(lo, n), batch_id=batch_id if batch_id < 2 else batch_id - 1)))
    finally:
        c.close()
    assert [(p["action"], p["task_input"]) for p in progress] == [
        ("committed", "arrow"), ("committed", "driver"), ("skipped", ""), ("committed", "arrow"),
        ("committed", "rows")], progress
    assert progress[1]["handles"] == 1
    return progress


def test_file_sink_driver_path(spark, tmp_path):
    out = tmp_path / "out"
    _small_then_burst(spark, FileSink(str(out)), tmp_path, lambda lo, n: _frame(spark, lo, n))
    assert _file_ids(out) == list(range(900))


@pytest.mark.kafka
def test_kafka_sink_driver_path(spark, kafka_service, tmp_path):
    from tests.test_kafka_sink import _topic, read_committed
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, 2)
    sink = KafkaSink(bs, topic, f"drv-{uuid.uuid4().hex[:8]}")
    _small_then_burst(spark, sink, tmp_path, lambda lo, n: _frame(spark, lo, n).selectExpr(
        "cast(id as string) as key", "cast(id as string) as value"))
    got = sorted(int(v) for v in read_committed(bs, topic, timeout=60, idle=3))
    assert got == list(range(900))


@pytest.mark.postgres
def test_postgres_sink_driver_path(spark, postgres_service, db, tmp_path):
    from twophase.sinks.postgres import PostgresSink

    t = f"drv_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{t}" (id bigint NOT NULL, v text)')
    _small_then_burst(spark, PostgresSink(postgres_service["dsn"], table=t), tmp_path,
                      lambda lo, n: _frame(spark, lo, n))
    with db.cursor() as cur:
        cur.execute(f'SELECT id FROM "{t}" ORDER BY id')
        assert [r[0] for r in cur.fetchall()] == list(range(900))


@pytest.mark.mysql
def test_mysql_sink_driver_path(spark, mariadb_service, mdb, tmp_path):
    from twophase.sinks.mysql import MySqlSink

    s, uid = mariadb_service, uuid.uuid4().hex[:8]
    tbl = f"drv_{uid}"
    with mdb.cursor() as cur:
        cur.execute(f"CREATE TABLE `{tbl}` (id BIGINT PRIMARY KEY, v VARCHAR(100)) ENGINE=InnoDB")
    try:
        sink = MySqlSink(s["host"], s["port"], s["database"], tbl, user=s["user"], password=s["password"],
                         gid_prefix=f"dm{uid}", marker_table=f"m_{uid}")
        _small_then_burst(spark, sink, tmp_path, lambda lo, n: _frame(spark, lo, n))
        with mdb.cursor() as cur:
            cur.execute(f"SELECT id FROM `{tbl}` ORDER BY id")
            assert [r[0] for r in cur.fetchall()] == list(range(900))
    finally:
        with mdb.cursor() as cur:
            cur.execute(f"DROP TABLE IF EXISTS `{tbl}`, `m_{uid}`")


# ------------------------------------------------------------------ the conformance harness drives the path
class _DriverObjectDuplicates(FileSink):
    """A sink broken only where the driver path runs it: its executor-side methods on the driver's own
    object (never pickled) write every record batch twice; a task's unpickled copy writes it once."""

    _copy = False

    def __setstate__(self, state):
        self.__dict__.update(state)
        self._copy = True

    def write(self, txn, batch):
        super().write(txn, batch)
        if not self._copy:
            super().write(txn, batch)


def test_the_conformance_harness_drives_the_driver_path(fast):
    from tests.test_conformance import _empty_dir, _read_parts, _staged_files
    from twophase.testing import run_sink_conformance

    root = str(fast / "out")
    stats = run_sink_conformance(
        lambda: FileSink(root, "parquet"), lambda: _read_parts(root), pending=lambda: _staged_files(root),
        reset=lambda: _empty_dir(root), max_partitions=2, max_examples=20, ownership=False, seed=51)
    # Batches written by the driver's own sink object, some of them failing or cut by a driver crash.
    print(stats)
    assert stats["driver-prepared batches"] > 0, stats
    assert stats["crashes"] > 0 and stats["committed_batches"] > 0, stats


def test_the_conformance_harness_catches_a_sink_broken_on_the_driver_path_only(fast):
    from tests.test_conformance import _empty_dir, _read_parts, _staged_files
    from twophase.testing import ConformanceError, run_sink_conformance

    root = str(fast / "out")
    with pytest.raises(ConformanceError, match="more than once|twice|duplicat"):
        run_sink_conformance(
            lambda: _DriverObjectDuplicates(root, "parquet"), lambda: _read_parts(root),
            pending=lambda: _staged_files(root), reset=lambda: _empty_dir(root), max_partitions=2,
            max_examples=20, ownership=False, seed=51)


# ------------------------------------------------------------------ the kill run: crash points in the driver
@pytest.mark.postgres
@pytest.mark.spark
@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_driver_path_exactly_once_under_crash_points_and_a_sigkill(tmp_path, postgres_service):
    """tests/drivers/postgres_pipeline.py with ``task_input="driver"``: 100-row files, one per batch,
    every batch written by the driver.  The executor-side crash points fire in the driver here:
    ``after_pre_commit`` (the driver dies with the batch's one transaction pre-committed and
    undecided: the state ``before_prepared_logged`` leaves, reached one step earlier, not a failed
    task attempt Spark retries), ``after_prepared_logged`` and ``after_commit`` (``mid_commit``'s
    nearest with one handle), then a SIGKILL at a random moment.  Every id lands once; no prepared transaction is left."""
    from tests.cluster import checkpoint_batches
    from tests.test_postgres_chaos import _leftovers, _new_table, _table_ids, _write_input
    from twophase import chaos

    info = postgres_service
    table = _new_table(info, "drvchaos")
    name = f"pgdrv-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=16, rows=100, keys=50)
    dsn = f"host={info['host']} port={info['port']} dbname={info['dbname']} user={info['user']}"
    cmd = [sys.executable, str(REPO / "tests" / "drivers" / "postgres_pipeline.py"), "--input", str(tmp_path / "in"),
           "--checkpoint", str(tmp_path / "ck"), "--dsn", dsn, "--table", table, "--name", name,
           "--task-input", "driver"]
    # mid_commit ("after the first handle committed", while others are not) has no moment on this path:
    # a batch has one handle.  after_commit is its nearest: the handle committed, COMMITTED not logged.
    # CI time: the three points whose meaning the path changes; before_begin (= after_intent) and
    # before_prepared_logged (= after_pre_commit, one step later) leave the states the task paths' kill
    # tests leave.
    points = ["after_pre_commit", "after_prepared_logged", "after_commit"]
    log_path = tmp_path / "driver.log"
    t0 = time.time()
    try:
        # Each crash point fires at the first batch of its run (batch 0 or 1, replayed); the SIGKILL
        # lands 1-6 s after the run's first batch commits (its clock starts then), among the dozen
        # batches left (about 1-2 s each on a loaded machine); check_runs checks it landed mid-work.
        runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=1, kill_window=(1.0, 6.0), seed=51,
                                     env={"PGPASSWORD": info["password"], "TWOPHASE_SPARK_DRIVER_MEMORY": "512m"},
                                     log_path=str(log_path), timeout=300,
                                     progress_probe=lambda: checkpoint_batches(tmp_path / "ck"))
    except BaseException:
        sys.stderr.write(log_path.read_text(errors="replace")[-6000:])
        raise
    print(f"{len(runs)} runs in {time.time() - t0:.0f}s: {[(r.fault, r.exit_code, r.outcome) for r in runs]}")
    assert [r.fault for r in runs[:len(points)]] == [f"crash:{p}" for p in points], runs
    # No point is an executor's here: each one fired in the driver, which exited 137 there.
    chaos.check_runs(runs, executor_points=())
    text = log_path.read_text(errors="replace")
    assert " handles, tasks' input driver, " in text
    assert " input arrow" not in text and " input rows" not in text
    verdict = chaos.verify(expected, _table_ids(info, table))
    assert verdict.exactly_once, verdict.to_dict()
    assert verdict.records_out == len(expected) == 1600
    assert _leftovers(info, name) == []
