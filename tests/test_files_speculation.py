"""FileSink(writer="spark") under ``spark.speculation=true`` (issue 26, item 4): Spark's output
committer lets only one attempt of a task commit its files, so the sink accepts speculation per
instance (``supports_speculation``); the Arrow writers' per-task transactions still refuse it."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from twophase.sinks.files import FileSink


def test_only_the_spark_writer_supports_speculation(tmp_path):
    assert FileSink(str(tmp_path), writer="spark").supports_speculation is True
    assert FileSink(str(tmp_path), writer="arrow").supports_speculation is False
    assert FileSink("hdfs://nn:8020/x").supports_speculation is True  # the default writer there
    assert FileSink("s3://bucket/x").supports_speculation is False
    assert FileSink.supports_speculation is False  # the class default, for sinks built otherwise


@pytest.mark.cluster
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_sparks_writer_writes_every_row_once_with_speculation_on_and_two_attempts_of_a_task(cluster_driver,
                                                                                           tmp_path):
    """On the test cluster with spark.speculation=true: the Arrow writers are refused, Spark's writer
    is accepted and a task whose first attempt wrote every row before failing is committed once.
    (The test cluster cannot show a speculative copy: Spark never runs one on the host of the
    original attempt, and both workers are 127.0.0.1; tests/drivers/files_speculation.py.)"""
    root, log, markers = tmp_path / "out", tmp_path / "log", tmp_path / "markers"
    markers.mkdir()
    drv = cluster_driver("tests.drivers.files_speculation", str(root), str(log), str(markers))
    result = drv.result(timeout=500)
    assert result["refused"] and "spark.speculation=true" in result["refused"], result
    assert result["supports_speculation"] is True
    assert (result["action"], result["rows"]) == ("committed", 1000), result
    # Two attempts of partition 0 wrote its rows; one attempt's files were committed.
    assert {"p0-a0", "p0-a1"} <= set(os.listdir(markers)), sorted(os.listdir(markers))
    parts = [p for p in root.iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    ids = [i for p in parts for i in pq.read_table(p).column("id").to_pylist()]
    assert sorted(ids) == list(range(1000))
    staged = [p for p in (root / "_twophase").rglob("*") if p.is_file()] if (root / "_twophase").exists() else []
    assert staged == []
