"""Adversarial review of the driver path (issue 51, task R2): scenarios where ``task_input="driver"``
does not hand the sink what the task paths would, or fails a batch the task paths write.

Each finding was an xfail(strict=True) test that failed on the driver path as reviewed (commits 70091f7,
ecead8b) and passes since its fix: timestamps cast to the session time zone (the Arrow path's schema),
a collect that fails (a type toArrow() refuses, rows past spark.driver.maxResultSize) falls back to the
Arrow task path, and a sink whose ``prepare_batch`` takes batches over (``prepares_batches()``) never
takes the driver path.  On the ``spark`` fixture (local[2]) and a FileSink on
local disk, except the wide-rows case, which needs a static setting (spark.driver.maxResultSize) and
so runs a Spark application of its own in a subprocess (~20 s); nothing here needs the shared servers.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from twophase.coordinator import Coordinator
from twophase.sink import CommitResult, PreparedBatch, TwoPhaseCommitSink
from twophase.sinks.files import FileSink


def _lines(out: Path) -> list[dict]:
    return [json.loads(line) for p in sorted(out.glob("*.jsonl")) for line in p.read_text().splitlines()]


def _write_one(spark, tmp_path: Path, task_input: str, df, tag: str) -> tuple[dict, Path]:
    out = tmp_path / f"out-{tag}"
    c = Coordinator(FileSink(str(out), format="jsonl"), log_location=str(tmp_path / f"log-{tag}"),
                    name=f"rv{tag}", task_input=task_input, driver_batch_rows=100)
    try:
        progress = dict(c.write(df, batch_id=0))
    finally:
        c.close()
    return progress, out


@pytest.fixture
def new_york(spark):
    """The session time zone set to one that is not UTC, as a pipeline outside UTC has it."""
    key = "spark.sql.session.timeZone"
    before = spark.conf.get(key)
    spark.conf.set(key, "America/New_York")
    yield spark
    spark.conf.set(key, before)


def test_driver_path_writes_timestamps_in_the_session_time_zone_like_the_task_paths(new_york, tmp_path):
    df = new_york.sql("SELECT id, timestamp_seconds(id * 3600) AS ts FROM range(3)")
    seen = {}
    for task_input in ("arrow", "driver"):
        progress, out = _write_one(new_york, tmp_path, task_input, df, task_input)
        assert progress["task_input"] == task_input, progress
        seen[task_input] = sorted((r["id"], r["ts"]) for r in _lines(out))
    # The task path renders the instants in the session's zone, as Spark's own JSON writer does.
    assert seen["arrow"][0] == (0, "1969-12-31T19:00:00.000-05:00"), seen["arrow"]
    assert seen["driver"] == seen["arrow"], seen


class IntervalsAsText(FileSink):
    """A user's sink (FileSink with a conversion of its own): Arrow's month_day_nano_interval, which
    the task paths hand it for Spark's CalendarIntervalType, written as text."""

    def write(self, txn, batch):
        import pyarrow as pa

        cols = [pa.array([None if v is None else str(v) for v in c.to_pylist()], pa.string())
                if pa.types.is_interval(c.type) else c for c in batch.columns]
        super().write(txn, pa.RecordBatch.from_arrays(cols, names=batch.schema.names))


def test_driver_path_falls_back_to_tasks_for_a_type_toArrow_cannot_convert(spark, tmp_path):
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors need not import tests/
    df = spark.sql("SELECT id, make_interval(0, 0, 0, CAST(id AS INT), 0, 0, 0) AS iv FROM range(3)")
    found = {}
    for task_input in ("arrow", "driver"):
        out = tmp_path / f"out-{task_input}"
        c = Coordinator(IntervalsAsText(str(out), format="jsonl"), log_location=str(tmp_path / f"log-{task_input}"),
                        name=f"iv{task_input}", task_input=task_input, driver_batch_rows=100)
        try:
            progress = dict(c.write(df, batch_id=0))  # task_input='driver' raises here today
        finally:
            c.close()
        found[task_input] = (progress["rows"], sorted((r["id"], r["iv"]) for r in _lines(out)))
    assert found["arrow"][0] == 3 and found["arrow"][1][1][0] == 1, found
    assert found["driver"] == found["arrow"], found


_MAX_RESULT_SIZE_RUN = r"""
import json, sys
from twophase.coordinator import Coordinator
from twophase.sink import CommitResult, PreparedBatch, TwoPhaseCommitSink
from twophase.sinks.files import FileSink
from twophase.spark import local_session

out, log = sys.argv[1], sys.argv[2]
spark = local_session("local[2]", app_name="r2-maxresult", conf={"spark.driver.maxResultSize": "1m"})
# 400 rows of 8 KB: far under the driver path's default bound (10,000 rows), 3.2 MB over maxResultSize.
df = spark.range(0, 400, 1, 4).selectExpr("id", "repeat('x', 8000) AS v")
small = spark.range(1000, 1010, 1, 2).selectExpr("id", "'s' AS v")
found = {}
for task_input in ("arrow", "driver", "auto"):
    c = Coordinator(FileSink(out + "-" + task_input), log_location=log + "-" + task_input, name="mrs" + task_input,
                    task_input=task_input)
    try:
        batch = 0
        if task_input == "auto":  # "auto" collects after a small batch (driver_batch_rows' default)
            found["auto-first"] = c.write(small, batch_id=0)["task_input"]
            batch = 1
        p = c.write(df, batch_id=batch)
        found[task_input] = {"rows": p["rows"], "task_input": p["task_input"], "note": p["input_note"][:300]}
        if task_input == "auto":  # a small batch after the failed collect: no collect tried again
            n = c.write(small, batch_id=batch + 1)
            found["auto-next"] = {"task_input": n["task_input"], "collect_ms": n["collect_ms"]}
    except Exception as e:
        text = str(e)
        found[task_input] = {"error": next((ln.strip()[:300] for ln in text.splitlines() if "maxResultSize" in ln),
                                           text.splitlines()[0][:300])}
    finally:
        c.close()
print("RESULT " + json.dumps(found))
"""


def test_wide_rows_under_the_row_bound_fall_back_to_tasks_instead_of_failing_the_batch(tmp_path):
    """spark.driver.maxResultSize is a static setting: a Spark application of its own, in a subprocess."""
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _MAX_RESULT_SIZE_RUN, str(tmp_path / "out"), str(tmp_path / "log")],
                         cwd=repo, capture_output=True, text=True, timeout=600)
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, (run.returncode, run.stdout[-2000:], run.stderr[-4000:])
    found = json.loads(lines[-1][len("RESULT "):])
    assert found["arrow"] == {"rows": 400, "task_input": "arrow", "note": ""}, found  # the task path writes it
    # The collect fails ("Total size of serialized results of N tasks (... MiB) is bigger than
    # spark.driver.maxResultSize"); the batch is written by the Arrow tasks, and its note says why.
    # "auto" by default: its first batch on tasks, the wide one after it tried on the driver, the same way.
    assert found["auto-first"] == "arrow", found
    for task_input in ("driver", "auto"):
        assert "error" not in found[task_input], found
        got = found[task_input]
        assert (got["rows"], got["task_input"]) == (400, "arrow"), found
        assert got["note"].startswith("the driver's collect failed (") and "maxResultSize" in got["note"], found
    # Under "auto" the coordinator's next 10 batches keep to the tasks (then it collects again, and
    # waits twice as long after each failure in a row): the same columns would fail the same collect,
    # each batch paying for it first.
    assert "the coordinator's next 10" in found["auto"]["note"], found
    assert found["auto-next"]["task_input"] in ("rows", "arrow") and found["auto-next"]["collect_ms"] == 0, found


class WholeBatches(TwoPhaseCommitSink):
    """A sink written "the second way" (TwoPhaseCommitSink.prepare_batch): each batch is pre-committed by
    a Spark job of its own into a staging folder, committed by a rename; it has no per-task transactions."""

    kind = "r2-whole-batches"

    def __init__(self, root: str):
        self.root = root

    def target(self) -> str:
        return f"r2:{self.root}"

    def prepare_batch(self, df, ctx):
        staging = os.path.join(self.root, "_staging", f"{ctx.batch_id}-{ctx.run}")
        df.write.parquet(staging)
        return PreparedBatch([{"staging": staging, "final": os.path.join(self.root, f"batch-{ctx.batch_id}")}],
                             df.sparkSession.read.parquet(staging).count())

    def commit(self, handle):
        if os.path.exists(handle["final"]):
            return CommitResult.already_committed()
        os.rename(handle["staging"], handle["final"])
        return CommitResult.committed()

    def recover_and_abort(self, handle):
        shutil.rmtree(handle["staging"], ignore_errors=True)

    def begin_transaction(self, ctx):
        raise NotImplementedError("WholeBatches prepares whole batches (prepare_batch) only")

    def write(self, txn, batch):
        raise NotImplementedError

    def pre_commit(self, txn):
        raise NotImplementedError

    def abort(self, txn):
        raise NotImplementedError


def test_a_sink_that_prepares_whole_batches_keeps_off_the_driver_path(spark, tmp_path):
    found = {}
    for task_input in ("arrow", "driver"):
        root = tmp_path / f"out-{task_input}"
        c = Coordinator(WholeBatches(str(root)), log_location=str(tmp_path / f"log-{task_input}"),
                        name=f"wb{task_input}", task_input=task_input)
        try:
            progress = dict(c.write(spark.range(0, 10, 1, 2), batch_id=0))  # 'driver' raises here today
        finally:
            c.close()
        found[task_input] = (progress["task_input"], progress["rows"],
                             sorted(spark.read.parquet(str(root / "batch-0")).toPandas()["id"].tolist()))
    assert found["arrow"] == ("batch", 10, list(range(10))), found
    assert found["driver"] == found["arrow"], found
