"""Review R8 of commit 646547c: after a failed driver collect, ``task_input="auto"`` keeps to the
tasks for a wait (10 batches, doubling per failure in a row up to 1,000) instead of for good.

In-process only (local[2], FileSink on tmp dirs).  The wait's first length is patched to 2 here
(``_COLLECT_RETRY_FIRST``) so that each scenario runs in a handful of batches.  A column fails its
first evaluation after a marker file appears (as in tests/test_driver_prepared.py), which fails the
driver's collect; the Arrow tasks that write the batch afterwards see no marker and succeed.
"""

from __future__ import annotations

import pytest

import twophase.coordinator.driver_path as coordinator_module
from tests.test_driver_prepared import _file_ids, failing_frame
from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink


@pytest.fixture
def short_wait(monkeypatch):
    monkeypatch.setattr(coordinator_module, "_COLLECT_RETRY_FIRST", 2)


def test_driver_input_tries_the_collect_at_every_batch_after_failures(spark, tmp_path, short_wait):
    """task_input="driver" keeps no wait: each batch collects, a failed one goes to the Arrow tasks
    (its note without a wait), and the next batch collects again and takes the driver path."""
    marker = tmp_path / "marker"
    frame = failing_frame(spark, marker)
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="r8drv", task_input="driver",
                    driver_batch_rows=100)
    progress = []
    try:
        for b in range(3):
            if b in (0, 1):
                marker.touch()
            progress.append(dict(c.write(frame(b * 10, 10), batch_id=b)))
    finally:
        c.close()
    assert [p["task_input"] for p in progress] == ["arrow", "arrow", "driver"], progress
    assert all(p["collect_ms"] > 0 for p in progress), progress
    for p in progress[:2]:
        assert p["input_note"].startswith("the driver's collect failed ("), p
        assert "next" not in p["input_note"], p  # no wait under "driver"
    assert not marker.exists()
    assert _file_ids(out) == list(range(30))


def test_skipped_replays_do_not_use_up_the_wait(spark, tmp_path, short_wait):
    """Replays of decided batches (action "skipped") collect nothing and do not count as batches of
    the wait: after a failed collect (wait 2 here), the next two batches written keep to the tasks
    however many replays come between, and the one after them collects."""
    marker = tmp_path / "marker"
    frame = failing_frame(spark, marker)
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="r8skip", driver_batch_rows=100)
    progress, replays = [], []
    try:
        for b in range(5):
            if b == 1:
                marker.touch()
            progress.append(dict(c.write(frame(b * 10, 10), batch_id=b)))
            if b == 1:  # three replays of decided batches right after the failure
                for old in (0, 1, 0):
                    replays.append(dict(c.write(frame(old * 10, 10), batch_id=old)))
    finally:
        c.close()
    assert [(r["action"], r["collect_ms"]) for r in replays] == [("skipped", 0.0)] * 3, replays
    tried = [b for b, p in enumerate(progress) if p["collect_ms"] > 0]
    # 0: the first batch (tasks); 1: collected, failed (wait 2); 2, 3: the wait; 4: collected again.
    assert tried == [1, 4], (tried, progress)
    assert "the coordinator's next 2 (then it collects again)" in progress[1]["input_note"], progress[1]
    assert progress[4]["task_input"] == "driver", progress[4]
    assert [p["rows"] for p in progress] == [10] * 5
    assert _file_ids(out) == list(range(50))


def test_a_collect_over_the_bound_counts_as_a_success(spark, tmp_path, short_wait):
    """A collect that ran (more rows than the bound: the Arrow tasks) ends the failures in a row:
    the next failure waits the first length again (2 here), not twice it."""
    marker = tmp_path / "marker"
    frame = failing_frame(spark, marker)
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="r8over", driver_batch_rows=20)
    sizes = [10, 10, 10, 10, 30, 10, 10]  # 4: a burst over the bound; 5: after it, no collect
    progress, lo = [], 0
    try:
        for b, n in enumerate(sizes):
            if b in (1, 6):
                marker.touch()
            progress.append(dict(c.write(frame(lo, n), batch_id=b)))
            lo += n
    finally:
        c.close()
    tried = [b for b, p in enumerate(progress) if p["collect_ms"] > 0]
    assert tried == [1, 4, 6], (tried, progress)
    assert progress[4]["input_note"].startswith("more rows than driver_batch_rows = 20"), progress[4]
    assert "the coordinator's next 2 (then it collects again)" in progress[6]["input_note"], progress[6]
    assert [p["rows"] for p in progress] == sizes
    assert _file_ids(out) == list(range(sum(sizes)))


def test_a_cast_that_fails_after_the_collect_sends_the_batch_to_the_arrow_tasks(spark, tmp_path, short_wait,
                                                                                monkeypatch):
    """The collect ran but its table does not cast to the Arrow path's schema: a failed collect like
    any other (the Arrow tasks write the batch, every row once, and the wait starts)."""
    import pyarrow as pa
    import pyspark.sql.pandas.types as pandas_types

    real = pandas_types.to_arrow_schema
    calls = []

    def once_wrong(schema, *args, **kwargs):
        calls.append(1)
        got = real(schema, *args, **kwargs)
        if len(calls) == 1:  # the first batch's collect: a schema the table cannot cast to
            return pa.schema([pa.field("other", pa.string())])
        return got

    monkeypatch.setattr(pandas_types, "to_arrow_schema", once_wrong)
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="r8cast", task_input="auto",
                    driver_batch_rows=100)
    progress = []
    try:
        c._last_rows = 0  # as after a small batch: "auto" collects the first batch written here
        for b in range(4):
            progress.append(dict(c.write(spark.range(b * 10, b * 10 + 10, numPartitions=2), batch_id=b)))
    finally:
        c.close()
    assert progress[0]["task_input"] == "arrow", progress[0]
    assert progress[0]["collect_ms"] > 0, progress[0]
    assert progress[0]["input_note"].startswith("the driver's collect failed ("), progress[0]
    assert "the coordinator's next 2 (then it collects again)" in progress[0]["input_note"], progress[0]
    assert [p["collect_ms"] > 0 for p in progress] == [True, False, False, True], progress
    assert progress[3]["task_input"] == "driver", progress[3]
    assert _file_ids(out) == list(range(40))


def test_the_note_of_a_collect_failed_in_a_python_worker_names_the_error(spark, tmp_path, short_wait):
    """The failed collect's note (progress and the warning, the only trace of the failure) should
    name the error, so that an operator can tell a failure that recurs (a UDF that fails on the
    batch's rows) from one that does not (an executor lost), which is what the wait is about."""
    marker = tmp_path / "marker"
    frame = failing_frame(spark, marker)
    c = Coordinator(FileSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="r8note",
                    task_input="driver", driver_batch_rows=100)
    try:
        marker.touch()
        p = dict(c.write(frame(0, 10), batch_id=0))
    finally:
        c.close()
    assert p["input_note"].startswith("the driver's collect failed ("), p
    assert "RuntimeError: a collect that fails once" in p["input_note"], p["input_note"]
