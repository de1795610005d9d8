"""Coordinator(task_input=...): the rows path (RDD API) hands sinks what the Arrow path (mapInArrow) does.

The rows path is a cheaper Spark job for small batches (docs/benchmarks.md); a sink must not be
able to tell the two apart. Every test here runs real Spark jobs on the shared local session.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from pyspark import cloudpickle

from twophase import CommitResult, TwoPhaseCommitSink
from twophase.coordinator import Coordinator
from twophase.coordinator.task_input import (
    CONVERSION_FAILED,
    TASK_INPUTS,
    record_batches,
    rows_schema,
)
from twophase.errors import ConfigurationError
from twophase.sinks.files import FileSink

pytestmark = pytest.mark.spark
ROOT = Path(__file__).resolve().parents[1]
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the recording sink runs in Python workers


class RecordingSink(TwoPhaseCommitSink[dict, dict]):
    """Writes every record batch it is handed to an Arrow IPC file, unchanged, to compare paths by."""

    kind = "recording"

    def __init__(self, folder: str):
        self.folder = folder

    def begin_transaction(self, ctx: Any) -> dict:
        return {"path": os.path.join(self.folder, f"p{ctx.partition_id}-{uuid.uuid4().hex}.arrow"), "batches": []}

    def write(self, txn: dict, batch: pa.RecordBatch) -> None:
        txn["batches"].append(batch)

    def pre_commit(self, txn: dict) -> dict:
        batches = txn["batches"]
        with pa.OSFile(txn["path"], "wb") as f, pa.ipc.new_file(f, batches[0].schema) as w:
            for b in batches:
                w.write_batch(b)
        return {"path": txn["path"]}

    def abort(self, txn: dict) -> None:
        pass

    def commit(self, handle: dict) -> CommitResult:
        return CommitResult.committed()


SCHEMA_DDL = (
    "id long, i int, s short, b byte, f float, d double, dec decimal(38,10), small decimal(5,2), "
    "str string, bin binary, bo boolean, ts timestamp, ntz timestamp_ntz, dt date, "
    "arr array<long>, st struct<a:long,b:string>, arrst array<struct<x:double>>"
)


def _rows_strategy():
    opt = lambda s: st.none() | s  # noqa: E731 - every column is nullable in SCHEMA_DDL
    text = st.text(max_size=8)
    when = st.datetimes(min_value=datetime.datetime(1900, 1, 1), max_value=datetime.datetime(2200, 1, 1))
    row = st.tuples(
        opt(st.integers(-2**63, 2**63 - 1)), opt(st.integers(-2**31, 2**31 - 1)), opt(st.integers(-2**15, 2**15 - 1)),
        opt(st.integers(-128, 127)), opt(st.floats(width=32)), opt(st.floats()),
        opt(st.decimals(min_value=-10**27, max_value=10**27, places=10, allow_nan=False)),
        opt(st.decimals(min_value=-999, max_value=999, places=2, allow_nan=False)),
        opt(text), opt(st.binary(max_size=8)), opt(st.booleans()), opt(when), opt(when),
        opt(st.dates(min_value=datetime.date(1, 1, 1), max_value=datetime.date(9999, 12, 31))),
        opt(st.lists(opt(st.integers(-5, 5)), max_size=3)),
        opt(st.tuples(opt(st.integers(-5, 5)), opt(text))),
        opt(st.lists(opt(st.tuples(opt(st.floats()))), max_size=2)),
    )
    return st.lists(row, min_size=1, max_size=40)


def _batches_seen(folder: Path) -> pa.Table:
    tables = [pa.ipc.open_file(str(p)).read_all() for p in sorted(folder.glob("*.arrow"))]
    return pa.concat_tables(tables).sort_by("id") if tables else pa.table({})


def _same(a: Any, b: Any) -> bool:
    """Equal values, NaN equal to NaN (at any depth)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _write(spark, df, tmp: Path, task_input: str) -> tuple[pa.Table, dict]:
    folder = tmp / task_input
    folder.mkdir(parents=True)
    c = Coordinator(RecordingSink(str(folder)), log_location=str(tmp / f"log-{task_input}"),
                    name="ti", task_input=task_input)
    progress = c.write(df, batch_id=0)
    c.close()
    return _batches_seen(folder), progress


# No shrinking: each example is two Spark jobs, and a shrink ran for five minutes.
@settings(max_examples=12, deadline=None, suppress_health_check=list(HealthCheck),
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(rows=_rows_strategy())
def test_both_task_inputs_hand_the_sink_the_same_record_batches(spark, tmp_path_factory, rows):
    tmp = tmp_path_factory.mktemp("same")
    # Unique ids sort the rows the same way for both paths.
    rows = [(i,) + r[1:] for i, r in enumerate(rows)]
    df = spark.createDataFrame(rows, SCHEMA_DDL).repartition(2)
    by_arrow, p_arrow = _write(spark, df, tmp, "arrow")
    by_rows, p_rows = _write(spark, df, tmp, "rows")
    assert (p_arrow["task_input"], p_rows["task_input"]) == ("arrow", "rows")
    assert by_rows.schema.equals(by_arrow.schema, check_metadata=True), (by_rows.schema, by_arrow.schema)
    assert by_rows.num_rows == by_arrow.num_rows == len(rows)
    for name in by_arrow.column_names:
        a, r = by_arrow.column(name).to_pylist(), by_rows.column(name).to_pylist()
        assert _same(a, r), (name, a, r)


def test_both_task_inputs_keep_the_session_time_zone_and_nullability(spark, tmp_path):
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.sql("select id, timestamp'2024-11-03 01:30:00' + make_interval(0,0,0,0,0,id,0) ts, "
                       "cast(id as decimal(10,2)) dec, named_struct('k', id) st from range(0, 120, 1, 2)")
        by_arrow, _ = _write(spark, df, tmp_path, "arrow")
        by_rows, _ = _write(spark, df, tmp_path, "rows")
    finally:
        spark.conf.unset("spark.sql.session.timeZone")
    assert by_arrow.schema.field("ts").type == pa.timestamp("us", tz="America/New_York")
    assert not by_arrow.schema.field("id").nullable
    assert by_rows.schema.equals(by_arrow.schema, check_metadata=True)
    assert by_rows.equals(by_arrow)


def test_a_timestamp_in_a_repeated_local_hour_survives_the_rows_path():
    """The rows path sees timestamps as the worker's local naive datetimes (PySpark's Row): the
    second 01:30 of a fall-back night must come back as the same instant, not the first."""
    from pyspark.sql.types import StructField, StructType, TimestampType

    schema = StructType([StructField("ts", TimestampType())])
    target = rows_schema(schema, "UTC", False)
    first = 1730611800 * 10**6  # 2024-11-03 01:30 EDT = 05:30 UTC
    second = first + 3600 * 10**6  # 01:30 EST = 06:30 UTC, the same wall time
    old = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    try:
        rows = [(TimestampType().fromInternal(us),) for us in (first, second)]
        [batch] = list(record_batches(rows, schema, target, 10))
    finally:
        if old is None:
            os.environ.pop("TZ")
        else:
            os.environ["TZ"] = old
        time.tzset()
    assert batch.column(0).cast(pa.int64()).to_pylist() == [first, second]


def test_auto_takes_rows_after_a_small_batch_and_arrow_after_a_large_one(spark, tmp_path):
    out = tmp_path / "out"
    # driver_batch_rows=0: the task paths' own choice is the point (by default "auto" would write
    # the batches after a small one from the driver: tests/test_driver_prepared.py).
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="auto", small_batch_rows=1000,
                    driver_batch_rows=0)
    sizes = [100, 100, 5000, 100, 100]
    paths, lo = [], 0
    for batch_id, n in enumerate(sizes):
        df = spark.range(lo, lo + n, numPartitions=2).selectExpr("id", "concat('v', id) as v")
        paths.append(c.write(df, batch_id=batch_id)["task_input"])
        lo += n
    c.close()
    # The first batch has no previous one: Arrow. After a small one: rows, even for the large one.
    assert paths == ["arrow", "rows", "rows", "arrow", "rows"]
    ids = sorted(i for p in out.glob("*.parquet") for i in pq.read_table(p).column("id").to_pylist())
    assert ids == list(range(lo))


def test_rows_input_refuses_a_schema_it_cannot_hand_over_unchanged(spark, tmp_path):
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="refuse", task_input="rows")
    df = spark.sql("select id, make_ym_interval(1, 2) as span from range(3)")
    with pytest.raises(ConfigurationError, match="task_input='rows' cannot hand the sink"):
        c.write(df, batch_id=0)
    c.close()
    assert not list(out.glob("*.parquet"))


def test_task_input_misconfiguration_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="task_input must be one of auto, arrow, rows"):
        Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"), task_input="pickle")
    with pytest.raises(ConfigurationError, match="small_batch_rows"):
        Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"), small_batch_rows=-1)


def test_a_row_that_does_not_convert_is_named_without_its_values():
    from pyspark.sql.types import LongType, StructField, StructType

    schema = StructType([StructField("n", LongType())])
    rows = [(1,), ("secret-token-value",)]
    with pytest.raises(ValueError) as e:
        list(record_batches(rows, schema, rows_schema(schema, "UTC", False), 10))
    assert CONVERSION_FAILED in str(e.value) and "secret" not in str(e.value)


def test_rows_schema_keeps_the_arrow_path_for_what_it_cannot_match():
    from pyspark.sql.types import (
        DayTimeIntervalType,
        LongType,
        MapType,
        StringType,
        StructField,
        StructType,
        YearMonthIntervalType,
    )

    plain = StructType([StructField("a", LongType()), StructField("b", StringType())])
    assert rows_schema(plain, "UTC", False) is not None
    assert rows_schema(plain, "UTC", True) is None  # useLargeVarTypes
    for odd in (DayTimeIntervalType(), YearMonthIntervalType(), MapType(StringType(), LongType()),
                StructType([StructField("x", LongType()), StructField("x", LongType())])):
        assert rows_schema(StructType([StructField("a", LongType()), StructField("odd", odd)]), "UTC", False) is None
    assert rows_schema(StructType([]), "UTC", False) is None


def test_a_row_the_rows_path_cannot_build_runs_the_batch_again_on_the_arrow_path(tmp_path):
    """A timestamp at 0001-01-01 UTC has no local datetime west of UTC (year 0): PySpark's Row
    fails on the rows path, Arrow carries it. The batch's tasks fail, its ballot is closed, and
    the batch runs again in a new ballot on the Arrow path: committed once, in the same call."""
    out, log = tmp_path / "out", tmp_path / "log"
    r = subprocess.run([sys.executable, "-m", "tests.drivers.rows_refused", str(out), str(log)], cwd=ROOT,
                       env=dict(os.environ, TZ="America/New_York"), capture_output=True, text=True, timeout=300)
    lines = [x for x in r.stdout.splitlines() if x.startswith("{")]
    assert lines, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(lines[-1])
    assert res["error"] is None and res["paths"] == ["arrow", "arrow"], res
    assert "Running the batch again in a new ballot" in r.stderr and CONVERSION_FAILED in r.stderr
    table = pa.concat_tables(pq.read_table(p) for p in sorted(out.glob("*.parquet")))
    assert sorted(table.column("id").to_pylist()) == list(range(20))
    year_one = [t for i, t in zip(table.column("id").to_pylist(), table.column("ts").cast(pa.int64()).to_pylist())
                if i == 15]
    assert year_one == [-62135596800 * 10**6]
    assert not [p for p in (out / "_twophase").rglob("*") if p.is_file()]  # ballot 0's staged files aborted


def test_the_demos_task_input_choices_are_the_coordinators():
    from twophase import demo

    assert demo.TASK_INPUTS == TASK_INPUTS
