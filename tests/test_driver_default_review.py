"""Adversarial review (task R4) of "task_input='auto' takes the driver path by default" (issue 51,
commit 68e7a82): every default pipeline now switches between the task paths and the driver path
from batch to batch.  Each finding is an xfail(strict=True) test that fails on the code as reviewed;
each has a control on the task path (driver_batch_rows=0) that passes, which shows the check can fail.

On the ``spark`` fixture (local[2]) with a FileSink on local disk; no shared server is needed.
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
    return ended - fenced_at[0], {"input_note": a._input_note, "task_input": a._batch_input}


def test_control_a_deposed_driver_on_the_task_path_stops_its_batch_at_once(spark, tmp_path):
    lingered, note = _deposed_while_the_batch_runs(spark, tmp_path, driver_batch_rows=0)
    # The heartbeat (every 0.5 s) finds the fence and cancels the job (Coordinator._stop_job).
    assert lingered < SLOW_S / 2, (lingered, note)


@pytest.mark.xfail(strict=True, reason=(
    "a deposed driver's collect on the driver path is not cancelled when the heartbeat finds the "
    "fence (_stop_job cancels self._job, which _driver_rows never sets): the deposed driver runs "
    "the batch's whole plan on (a job waiting for resources: for ever) before it notices"))
def test_a_deposed_driver_on_the_driver_path_stops_its_collect_at_once(spark, tmp_path):
    lingered, note = _deposed_while_the_batch_runs(spark, tmp_path, driver_batch_rows=10000)
    assert lingered < SLOW_S / 2, (lingered, note)
