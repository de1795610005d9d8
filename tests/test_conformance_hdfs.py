"""twophase.testing on FileSink's default path on HDFS: ``writer="spark"``, one Spark job per batch.

On ``hdfs://`` a FileSink writes each batch with Spark's own writer (``prepare_batch``), so its
conformance run is given ``make_frame``: each batch run is a real ``df.write`` to the HDFS
minicluster, then decisions, commits, crashes and recovery as for any sink.  (The run in
tests/test_files_remote.py drives the per-task Arrow writers on the same storage.)
"""

from __future__ import annotations

import io

import pyarrow.parquet as pq
import pytest

from tests.test_files_remote import (  # noqa: F401 - fixtures (hdfs, hroot) and helpers
    hdfs,
    hopts,
    hread,
    hroot,
    hstaged,
    hvisible,
)
from twophase.sinks.files import FileSink
from twophase.testing import run_sink_conformance

pytestmark = [pytest.mark.hdfs, pytest.mark.spark, pytest.mark.timeout(600)]


def test_conformance_on_hdfs_with_sparks_writer(hdfs_service, hdfs, hroot, spark):  # noqa: F811
    url, path = hroot
    opts = hopts(hdfs_service)
    assert FileSink(url, storage_options=opts).writer == "spark"  # the default on hdfs://, driven here

    def read():
        rows = []
        for rel in hvisible(hdfs, path):
            rows += pq.read_table(io.BytesIO(hread(hdfs, f"{path}/{rel}")), columns=["id"]).to_pylist()
        return rows

    def reset():
        hdfs.delete(path, recursive=True)
        hdfs.makedirs(path)

    def frame(ids, parts):
        return spark.createDataFrame([(i, f"p{i}") for i in ids], "id long, payload string").repartition(parts)

    stats = run_sink_conformance(lambda: FileSink(url, storage_options=opts), read, reset=reset,
                                 pending=lambda: hstaged(hdfs, path), make_frame=frame, max_examples=3, steps=3)
    # Every batch went through Spark's writer: no per-task transaction of the harness ran.
    assert stats["whole-batch jobs"] >= stats["examples"] and not stats.get("task_attempts"), stats
