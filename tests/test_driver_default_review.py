"""Adversarial review (task R4) of "task_input='auto' takes the driver path by default" (issue 51,
commit 68e7a82, and 6835e51): every default pipeline now switches between the task paths and the
driver path from batch to batch.  Each finding is an xfail(strict=True) test that fails on the code as
reviewed (and passes since its fix); each has a control on the task path (driver_batch_rows=0) that passes.

Findings: a deposed driver's driver-path collect was not cancelled when its heartbeat found the fence
(``_stop_job`` cancelled ``self._job``, which ``_driver_rows`` never set; fixed by ccddc2c); the default
bound counts rows, not bytes, so a small-but-wide batch (under spark.driver.maxResultSize) killed a
512 MB driver's JVM (a strict xfail in fccee4d; fixed: "auto" collects only where maxResultSize, the
collect's byte bound, fits the driver's heap, Coordinator._collect_unsafe).

The first pair runs on the ``spark`` fixture (local[2], a FileSink on local disk, ~15 s: the slow row
sleeps up to 25 s, cut short by the fence); the second runs one Spark application of its own in a subprocess (a static
setting, spark.driver.memory; ~20 s).  No shared server is needed.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from twophase.coordinator import Coordinator
from twophase.errors import LogOwnershipError
from twophase.log import TransactionLog, batch_query_id
from twophase.sinks.files import FileSink

SLOW_S = 25.0  # how long the batch's one slow row takes (its UDF sleeps)


def _slow_frame(spark, marker: Path):
    """One row whose UDF touches ``marker`` and then sleeps SLOW_S seconds: a batch whose plan
    runs long (a slow source, an executor waiting for resources)."""
    from pyspark import cloudpickle
    from pyspark.sql import functions as F

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the executors need not import tests/
    path = str(marker)

    def slow(x):
        import pathlib
        import time as _t

        pathlib.Path(path).touch()
        _t.sleep(SLOW_S)
        return x

    return spark.range(1, numPartitions=1).select(F.udf(slow, "long")("id").alias("id"))


def _deposed_while_the_batch_runs(spark, tmp_path: Path, driver_batch_rows: int) -> tuple[float, dict]:
    """Coordinator A writes batch 0 (10 rows, tasks), then batch 1 (slow).  While batch 1's plan
    runs, a newer driver takes the log over (takeover=True, as a driver started after A paused past
    its lease does).  Returns how long A went on after it was fenced, and A's last note."""
    out, logdir, marker = tmp_path / "out", str(tmp_path / "log"), tmp_path / "started"
    sink = FileSink(str(out))
    a = Coordinator(sink, log_location=logdir, name="deposed", lease_timeout=2.0,
                    driver_batch_rows=driver_batch_rows)
    a.write(spark.range(10, numPartitions=2), batch_id=0)
    newer = TransactionLog(logdir)
    fenced_at: list[float] = []

    def take_over():
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        newer.acquire(batch_query_id("deposed", sink.target()), "deposed", takeover=True, target=sink.target())
        fenced_at.append(time.monotonic())

    t = threading.Thread(target=take_over, daemon=True)
    t.start()
    try:
        with pytest.raises(LogOwnershipError):
            a.write(_slow_frame(spark, marker), batch_id=1)
        ended = time.monotonic()
    finally:
        t.join(60)
        a.close()
        newer.close()
    assert fenced_at, "the newer driver never took the log over"
    return ended - fenced_at[0], {"input_note": a._input_note, "task_input": a._batch_input,
                                   "collect_ms": a._collect_ms}


def test_control_a_deposed_driver_on_the_task_path_stops_its_batch_at_once(spark, tmp_path):
    lingered, note = _deposed_while_the_batch_runs(spark, tmp_path, driver_batch_rows=0)
    assert note["collect_ms"] == 0 and note["task_input"] == "rows", note  # batch 1 on the task path
    # The heartbeat (every 0.5 s) finds the fence and cancels the job (Coordinator._stop_job).
    assert lingered < SLOW_S / 2, (lingered, note)


def test_a_deposed_driver_on_the_driver_path_stops_its_collect_at_once(spark, tmp_path):
    """Finding 1 (a strict xfail in 23430a2: the deposed driver lingered 25.0 s, the slow row's whole
    sleep, and failed only at _prepare_in_driver's look at the fence); passes since ccddc2c (the
    collect runs in a job group the fence cancels)."""
    lingered, note = _deposed_while_the_batch_runs(spark, tmp_path, driver_batch_rows=10000)
    assert note["collect_ms"] > 0, note  # batch 1 was on the driver path: its collect ran (and was cancelled)
    assert lingered < SLOW_S / 2, (lingered, note)





_WIDE_RUN = r"""
import json, sys
from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink
from twophase.spark import local_session

base = sys.argv[1]
spark = local_session("local[2]", app_name="r4-wide")  # spark.driver.memory: TWOPHASE_SPARK_DRIVER_MEMORY
# 6,000 rows of 100 KB (600 MB): under the driver path's default bound (10,000 rows) and under
# spark.driver.maxResultSize's default (1g), over what a 512 MB driver holds at once.
wide = spark.range(0, 6000, 1, 16).selectExpr("id", "repeat(cast(id as string), 100000 div length(cast(id as string))) AS v")
small = spark.range(10000, 10010, 1, 2).selectExpr("id", "'s' AS v")
for label, bound in (("tasks", 0), ("default", None)):
    c = Coordinator(FileSink(base + "/out-" + label, format="jsonl"), log_location=base + "/log-" + label,
                    name="wide" + label, driver_batch_rows=bound)
    first = c.write(small, batch_id=0)["task_input"]
    try:
        p = c.write(wide, batch_id=1)
        got = {"first": first, "rows": p["rows"], "task_input": p["task_input"]}
    except Exception as e:
        got = {"first": first, "error": type(e).__name__ + ": " + (str(e).splitlines() or [""])[0][:200]}
    print("RESULT " + label + " " + json.dumps(got), flush=True)
    c.close()
"""


@pytest.fixture(scope="module")
def wide_run(tmp_path_factory) -> dict:
    """One Spark application with a 512 MB driver, in a subprocess (spark.driver.memory is static):
    a small batch, then 6,000 rows of 100 KB, on the task paths and then with the default."""
    import json
    import os
    import subprocess

    base = tmp_path_factory.mktemp("wide")
    env = dict(os.environ, TWOPHASE_SPARK_DRIVER_MEMORY="512m")
    run = subprocess.run([sys.executable, "-c", _WIDE_RUN, str(base)], cwd=Path(__file__).resolve().parents[1],
                         env=env, capture_output=True, text=True, timeout=600)
    found = {line.split(" ", 2)[1]: json.loads(line.split(" ", 2)[2])
             for line in run.stdout.splitlines() if line.startswith("RESULT ")}
    found["oom"] = "OutOfMemoryError" in run.stderr
    found["rc"] = run.returncode
    return found


def test_control_wide_rows_under_the_row_bound_are_written_by_the_task_paths(wide_run):
    assert wide_run.get("tasks") == {"first": "arrow", "rows": 6000, "task_input": "rows"}, wide_run


def test_wide_rows_under_the_row_bound_do_not_kill_the_driver_by_default(wide_run):
    assert not wide_run["oom"], wide_run
    assert wide_run.get("default", {}).get("rows") == 6000, wide_run
