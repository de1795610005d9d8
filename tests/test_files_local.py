"""FileSink on local disk, driven directly (no Spark): staging is invisible, commit is idempotent."""

from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from twophase import CommitOutcome, TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.evidence import Committed
from twophase.sinks.files import FileSink


def batch(ids):
    return pa.RecordBatch.from_pydict({"id": ids, "v": [f"row-{i}" for i in ids]})


def visible(root) -> list[str]:
    return sorted(p for p in os.listdir(root) if not p.startswith(("_", ".")))


def prepare(sink, batch_id, partition, ids, attempt=0, intent=None):
    """One task attempt of one execution (ballot) of the batch: ``intent`` is that ballot's INTENT
    (``sink.plan_batch``, once per execution); without one, the batch's default staging folder."""
    ctx = TransactionContext("q", batch_id, partition, attempt, intent or {})
    txn = sink.begin_transaction(ctx)
    half = max(1, len(ids) // 2)  # two Arrow batches per transaction, neither empty
    for part in (ids[:half], ids[half:]):
        if part:
            sink.write(txn, batch(part))
    return sink.pre_commit(txn)


def test_pre_commit_is_invisible_and_commit_makes_it_visible(tmp_path):
    sink = FileSink(str(tmp_path))
    sink.open()
    h = prepare(sink, 7, 1, [1, 2, 3, 4])
    assert visible(tmp_path) == []
    assert os.path.exists(h["staging"]) and "/_twophase/" in h["staging"]
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    assert visible(tmp_path) == ["part-00000007-00001-q.parquet"]
    assert pq.read_table(tmp_path / "part-00000007-00001-q.parquet").column("id").to_pylist() == [1, 2, 3, 4]
    assert not os.path.exists(h["staging"])


def test_commit_twice_is_a_no_op(tmp_path):
    sink = FileSink(str(tmp_path))
    h = prepare(sink, 0, 0, [1, 2])
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    before = os.stat(tmp_path / "part-00000000-00000-q.parquet")
    assert sink.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED
    assert os.stat(tmp_path / "part-00000000-00000-q.parquet").st_ino == before.st_ino


def test_crash_between_link_and_unlink_is_completed(tmp_path):
    sink = FileSink(str(tmp_path))
    h = prepare(sink, 0, 0, [1, 2])
    os.link(h["staging"], h["final"])  # what a crash right after the link leaves behind
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    assert not os.path.exists(h["staging"]) and visible(tmp_path) == ["part-00000000-00000-q.parquet"]


def test_lost_when_staging_and_target_are_gone(tmp_path):
    sink = FileSink(str(tmp_path))
    h = prepare(sink, 0, 0, [1])
    os.unlink(h["staging"])
    res = sink.commit(h)
    assert res.outcome is CommitOutcome.LOST and "neither the staged file" in res.reason


def test_commit_never_overwrites_a_foreign_file(tmp_path):
    sink = FileSink(str(tmp_path))
    h = prepare(sink, 0, 0, [1, 2])
    (tmp_path / "part-00000000-00000-q.parquet").write_bytes(b"someone else's data")
    with pytest.raises(TwoPhaseError, match="already exists and is another file"):
        sink.commit(h)
    assert (tmp_path / "part-00000000-00000-q.parquet").read_bytes() == b"someone else's data"
    assert os.path.exists(h["staging"])  # nothing lost: the staged file is kept


def test_abort_and_abort_lingering_remove_staging_except_kept(tmp_path):
    sink = FileSink(str(tmp_path))
    intent = sink.plan_batch("q", 3, 2)  # one execution (ballot) of batch 3: every task below is its
    ctx = TransactionContext("q", 3, 0, 0, intent)
    txn = sink.begin_transaction(ctx)
    sink.write(txn, batch([1]))
    sink.abort(txn)
    assert not os.path.exists(txn.staging)
    failed_attempt = prepare(sink, 3, 0, [1, 2], attempt=0, intent=intent)
    winner = prepare(sink, 3, 0, [1, 2], attempt=1, intent=intent)
    assert os.path.dirname(failed_attempt["staging"]) == intent["staging"]  # staged in the ballot's folder
    assert os.path.dirname(winner["staging"]) == intent["staging"]
    assert sink.commit(winner).done
    assert sink.abort_lingering("q", 3, intent, [winner]) == 1
    assert not os.path.exists(failed_attempt["staging"])
    assert visible(tmp_path) == ["part-00000003-00000-q.parquet"]
    assert sink.abort_lingering("q", 3, intent, []) == 0  # idempotent


def test_late_staged_file_of_a_finished_batch_is_swept_by_the_next_cleanup(tmp_path):
    """A writer that died mid-write can leave its staged file after its batch's cleanup (on HDFS
    the DataNode closes the file of a broken upload asynchronously); the next batch's cleanup
    removes the older batches' staging folders, never the current batch's kept files."""
    sink = FileSink(str(tmp_path))
    # batch 2's cleanup already ran; this appeared later (in its ballot's folder)
    late = prepare(sink, 2, 0, [7], attempt=0, intent=sink.plan_batch("q", 2, 1))
    assert sink.abort_lingering("q", 1, sink.plan_batch("q", 1, 1), []) == 0  # older batch: not touched
    assert os.path.exists(late["staging"])
    intent = sink.plan_batch("q", 3, 1)  # batch 3's execution: its task and its cleanup
    winner = prepare(sink, 3, 0, [1, 2], intent=intent)
    assert sink.commit(winner).done
    assert sink.abort_lingering("q", 3, intent, [winner]) == 0  # no evidence: no other batch touched
    assert sink.abort_lingering("q", 3, intent, [winner], settled=Committed("q", 2)) == 1
    assert not os.path.exists(os.path.dirname(late["staging"]))
    other = prepare(sink, 2, 0, [8], attempt=0, intent=sink.plan_batch("q", 2, 1))
    other_query = FileSink(str(tmp_path))           # another query's batch 2 is not this query's
    ctx = TransactionContext("q2", 2, 0, 0, other_query.plan_batch("q2", 2, 1))
    t2 = other_query.begin_transaction(ctx)
    other_query.write(t2, batch([9]))
    h2 = other_query.pre_commit(t2)
    assert sink.abort_lingering("q", 4, sink.plan_batch("q", 4, 1), [], settled=Committed("q", 2, 3)) == 1
    assert not os.path.exists(other["staging"]) and os.path.exists(h2["staging"])


@pytest.mark.parametrize("fmt,reader", [
    ("jsonl", lambda p: [json.loads(x)["id"] for x in open(p) if x.strip()]),
    ("csv", lambda p: pacsv.read_csv(p, read_options=pacsv.ReadOptions(column_names=["id", "v"]))
     .column("id").to_pylist()),
    ("parquet", lambda p: pq.read_table(p).column("id").to_pylist()),
])
def test_formats(tmp_path, fmt, reader):
    sink = FileSink(str(tmp_path), format=fmt)
    h = prepare(sink, 1, 2, [10, 11, 12])
    assert sink.commit(h).done
    (name,) = visible(tmp_path)
    assert name.endswith({"jsonl": ".jsonl", "csv": ".csv", "parquet": ".parquet"}[fmt])
    assert reader(tmp_path / name) == [10, 11, 12]


def test_bad_configuration_is_refused(tmp_path):
    with pytest.raises(ConfigurationError, match="unknown format"):
        FileSink(str(tmp_path), format="xml")
    with pytest.raises(ConfigurationError, match="must be letters"):
        FileSink(str(tmp_path), prefix="../evil")
    with pytest.raises(ConfigurationError, match="readers would ignore"):
        FileSink(str(tmp_path), prefix="_hidden")
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    if os.geteuid() != 0:  # root can write anywhere
        with pytest.raises(ConfigurationError, match="cannot write"):
            FileSink(str(ro)).open()


def test_config_round_trip(tmp_path):
    sink = FileSink(str(tmp_path), format="csv", prefix="out")
    again = FileSink.from_config(sink.to_config())
    assert again.to_config() == sink.to_config()


def test_parquet_batches_are_gathered_into_row_groups(tmp_path):
    """Spark hands over 10,000-row batches; they become one row group, not one group each."""
    sink = FileSink(str(tmp_path))
    ctx = TransactionContext("q", 0, 0, 0, {})
    txn = sink.begin_transaction(ctx)
    for start in range(0, 50_000, 10_000):
        sink.write(txn, batch(list(range(start, start + 10_000))))
    assert sink.commit(sink.pre_commit(txn)).done
    f = pq.ParquetFile(tmp_path / "part-00000000-00000-q.parquet")
    assert f.metadata.num_row_groups == 1
    assert f.read().column("id").to_pylist() == list(range(50_000))


def test_partitioned_parquet_keeps_gathered_rows_within_one_budget(tmp_path, monkeypatch):
    from twophase.sinks import files

    monkeypatch.setattr(files._FormatWriter, "ROW_GROUP_BYTES", 20_000)
    sink = FileSink(str(tmp_path), partition_by=["k"])
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, {}))
    ids = list(range(20_000))
    for start in range(0, len(ids), 1_000):
        part = ids[start:start + 1_000]
        sink.write(txn, pa.RecordBatch.from_pydict({"id": part, "k": [i % 7 for i in part]}))
        assert sum(f.writer.pending_bytes for f in txn.files.values()) <= 20_000
    assert sink.commit(sink.pre_commit(txn)).done
    got = sorted(i for k in range(7) for p in (tmp_path / f"k={k}").iterdir()
                 for i in pq.read_table(p).column("id").to_pylist())
    assert got == ids


def test_abort_drops_rows_not_yet_encoded(tmp_path):
    sink = FileSink(str(tmp_path))
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, {}))
    sink.write(txn, batch([1, 2, 3]))
    sink.abort(txn)
    assert visible(tmp_path) == []
    assert sink.abort_lingering("q", 0, {}, []) == 0


# ---------------------------------------------------------------- JSON lines as Spark writes them
_EVERY_TYPE_SQL = """
SELECT id,
       CAST(id % 2 = 0 AS BOOLEAN) AS flag, CAST(id AS TINYINT) AS b, CAST(id AS SMALLINT) AS s,
       CAST(id AS INT) AS i, id * 10000000000 AS l,
       CAST(id / 10 AS FLOAT) AS f,
       CASE id WHEN 1 THEN double('NaN') WHEN 2 THEN double('Infinity') WHEN 3 THEN double('-Infinity')
               ELSE id * 1e20 END AS d,
       CAST(id / 3 AS DECIMAL(12, 4)) AS dec,
       CASE WHEN id = 4 THEN NULL ELSE concat('é"\\\\', CAST(id AS STRING), char(10)) END AS str,
       CAST(concat('x', CAST(id AS STRING)) AS BINARY) AS bin,
       date_add(DATE'2024-02-28', CAST(id AS INT)) AS day,
       timestamp_micros(1700000000123456 + id * 86400000000) AS ts,
       CAST(timestamp_micros(1700000000123456 + id) AS TIMESTAMP_NTZ) AS ts_ntz,
       array(id, NULL, id + 1) AS arr,
       named_struct('a', id, 'b', CASE WHEN id = 2 THEN NULL ELSE 'x' END) AS st,
       map('k', id, 'n', NULL) AS m
FROM range(0, 6)
"""


@pytest.mark.spark
def test_jsonl_matches_what_sparks_json_writer_writes_for_every_type(spark, tmp_path):
    """Issue 19: bytes as base64 (not Python repr), NaN/Infinity as Spark writes them, ISO
    timestamps in the session zone with 'T', nulls left out, decimals as numbers."""
    from twophase.coordinator import Coordinator

    old_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.sql(_EVERY_TYPE_SQL).coalesce(1)
        df.write.json(str(tmp_path / "spark"))
        Coordinator(FileSink(str(tmp_path / "ours"), format="jsonl"), log_location=str(tmp_path / "log"),
                    name="types").write(df, batch_id=0)
    finally:
        spark.conf.set("spark.sql.session.timeZone", old_tz)

    def rows(folder, suffix):
        out = []
        for name in sorted(os.listdir(folder)):
            if name.endswith(suffix) and not name.startswith(("_", ".")):
                with open(os.path.join(folder, name), encoding="utf-8") as f:
                    out += [json.loads(line) for line in f if line.strip()]
        return sorted(out, key=lambda r: r["id"])

    theirs, ours = rows(tmp_path / "spark", ".json"), rows(tmp_path / "ours", ".jsonl")
    assert len(theirs) == 6
    for t, o in zip(theirs, ours, strict=True):
        assert o == t, (o, t)
    assert ours[1]["d"] == "NaN" and ours[2]["d"] == "Infinity" and "str" not in ours[4]
    assert ours[1]["ts"].endswith("-05:00") and "T" in ours[1]["ts"]


def test_jsonl_refuses_a_type_it_cannot_write_naming_the_column(tmp_path):
    sink = FileSink(str(tmp_path), format="jsonl")
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, {}))
    bad = pa.RecordBatch.from_pydict({"id": [1], "wait": pa.array([5], pa.duration("s"))})
    with pytest.raises(TypeError, match=r"column 'wait': cannot write Arrow type duration\[s\] as JSON"):
        sink.write(txn, bad)
    sink.abort(txn)
    assert visible(tmp_path) == []


def test_jsonl_of_bytes_nan_and_timestamps_is_valid_json(tmp_path):
    import datetime as dt

    sink = FileSink(str(tmp_path), format="jsonl")
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, {}))
    sink.write(txn, pa.RecordBatch.from_pydict({
        "id": [1], "raw": [b"\x00ab"], "x": [float("nan")],
        "at": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5, 600000)], pa.timestamp("us", tz="UTC"))}))
    assert sink.commit(sink.pre_commit(txn)).done
    (name,) = visible(tmp_path)
    text = (tmp_path / name).read_text()
    assert json.loads(text) == {"id": 1, "raw": "AGFi", "x": "NaN", "at": "2024-01-02T03:04:05.600Z"}, text


# ---------------------------------------------------------------- CSV as Spark writes it
# Every type Spark's CSV writer takes (it refuses arrays, structs, maps and NULL-typed columns).
# The first column is a string: a value starting with '#' (the comment char) is quoted there
# only.  Strings cover quoting, escaping, whitespace trimming and the empty string.  Floats
# are ones whose Java Double/Float.toString is the shortest form on every JDK (JDK 17 spells
# some others with more digits; see docs/files.md).
_CSV_EVERY_TYPE_SQL = """
SELECT CASE id WHEN 0 THEN '#hash' WHEN 1 THEN ' #lead' WHEN 2 THEN '' WHEN 3 THEN NULL
               ELSE concat('  pad ', CAST(id AS STRING), '  ') END AS first,
       id,
       CAST(id % 2 = 0 AS BOOLEAN) AS flag, CAST(id AS TINYINT) AS b, CAST(id AS SMALLINT) AS s,
       CAST(id AS INT) AS i, id * 10000000000 AS l,
       CAST(id / 10 AS FLOAT) AS f,
       CASE id WHEN 1 THEN double('NaN') WHEN 2 THEN double('Infinity') WHEN 3 THEN double('-Infinity')
               WHEN 4 THEN -0.0D WHEN 5 THEN 0.00025D WHEN 6 THEN 12345678.5D ELSE id * 1e20 END AS d,
       CAST(id / 3 AS DECIMAL(12, 4)) AS dec, CAST(id AS DECIMAL(20, 10)) / 1e9 AS tiny,
       CASE id WHEN 4 THEN NULL WHEN 5 THEN '   ' WHEN 6 THEN '#x'
               ELSE concat('é"\\\\', CAST(id AS STRING), ',', char(10), 'z', char(13), ' ') END AS str,
       CASE WHEN id = 3 THEN X'' ELSE CAST(concat('x', CAST(id AS STRING), char(0), char(171)) AS BINARY) END AS bin,
       date_add(DATE'2024-02-28', CAST(id AS INT)) AS day,
       timestamp_micros(1700000000123456 + id * 86400000000 * 60) AS ts,
       CAST(timestamp_micros(1700000000123456 + id) AS TIMESTAMP_NTZ) AS ts_ntz
FROM range(0, 7)
"""


def _spark_text(folder, suffix) -> str:
    names = [n for n in sorted(os.listdir(folder)) if n.endswith(suffix) and not n.startswith(("_", "."))]
    parts = []
    for n in names:
        with open(os.path.join(folder, n), encoding="utf-8", newline="") as f:
            parts.append(f.read())
    return "".join(parts)


@pytest.mark.spark
def test_csv_matches_what_sparks_csv_writer_writes_for_every_type(spark, tmp_path):
    """Issue 19: no header by default, Spark's value spellings and quoting, byte for byte;
    header=True as Spark's header option."""
    from twophase.coordinator import Coordinator

    old_tz = spark.conf.get("spark.sql.session.timeZone")
    spark.conf.set("spark.sql.session.timeZone", "America/New_York")
    try:
        df = spark.sql(_CSV_EVERY_TYPE_SQL).coalesce(1)
        df.write.csv(str(tmp_path / "spark"))
        df.write.option("header", True).csv(str(tmp_path / "spark_header"))
        Coordinator(FileSink(str(tmp_path / "ours"), format="csv"), log_location=str(tmp_path / "log"),
                    name="types").write(df, batch_id=0)
        Coordinator(FileSink(str(tmp_path / "ours_header"), format="csv", header=True),
                    log_location=str(tmp_path / "log_header"), name="types_header").write(df, batch_id=0)
    finally:
        spark.conf.set("spark.sql.session.timeZone", old_tz)

    theirs, ours = _spark_text(tmp_path / "spark", ".csv"), _spark_text(tmp_path / "ours", ".csv")
    assert theirs.count("\n") >= 7 and ours == theirs, (ours, theirs)
    assert ours.startswith('"#hash",0,true,0,0,0,0,0.0,0.0,0.0000,')
    assert "2023-11-14T17:13:20.123-05:00" in ours and ",NaN," in ours and ",[78 31 00 C2 AB]," in ours
    theirs, ours = _spark_text(tmp_path / "spark_header", ".csv"), _spark_text(tmp_path / "ours_header", ".csv")
    assert ours.startswith("first,id,flag,") and ours == theirs, (ours, theirs)


def test_csv_refuses_a_type_spark_cannot_write_naming_the_column(tmp_path):
    sink = FileSink(str(tmp_path), format="csv")
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, {}))
    bad = pa.RecordBatch.from_pydict({"id": [1], "tags": pa.array([["a"]], pa.list_(pa.string()))})
    with pytest.raises(TypeError, match=r"column 'tags': cannot write Arrow type list<item: string> as CSV"):
        sink.write(txn, bad)
    sink.abort(txn)
    assert visible(tmp_path) == []


def test_csv_header_is_written_once_per_file_and_only_for_csv(tmp_path):
    sink = FileSink(str(tmp_path), format="csv", header=True)
    assert FileSink.from_config(sink.to_config()).header is True
    assert "header" not in FileSink(str(tmp_path), format="csv").to_config()
    h = prepare(sink, 0, 0, [1, 2, 3])  # two Arrow batches, one file
    assert sink.commit(h).done
    (name,) = visible(tmp_path)
    assert (tmp_path / name).read_text() == "id,v\n1,row-1\n2,row-2\n3,row-3\n"
    with pytest.raises(ConfigurationError, match="header=True is a csv option"):
        FileSink(str(tmp_path), format="jsonl", header=True)


def test_csv_values_as_spark_spells_them():
    import datetime as dt
    import decimal

    from twophase.sinks._formats import csv_lines

    b = pa.RecordBatch.from_pydict({
        "s": [" a,b ", "q\"\\", "", None, "# first column"],
        "d": [1e20, 1e-5, 1e7, 123.0, float("-inf")],
        "f": pa.array([0.1, 1e10, 3.0, 2.5e-4, None], pa.float32()),
        "dec": pa.array([decimal.Decimal(x) for x in ("1E-10", "0", "0", "12.5", "-1")],
                        pa.decimal128(20, 10)).to_pylist()[:2] + [None, decimal.Decimal("12.5000000000"),
                                                                  decimal.Decimal("-1.0000000000")],
        "t": pa.array([dt.datetime(2024, 1, 2, 3, 4, 5, 600000)] * 5, pa.timestamp("us", tz="UTC")),
        "day": [dt.date(1, 2, 3)] * 5,
        "s2": ["# not first", "x", "  ", "\ty\t", None],
    })
    assert csv_lines(b).splitlines() == [
        '"a,b",1.0E20,0.1,1E-10,2024-01-02T03:04:05.600Z,0001-02-03,# not first',
        '"q\\"\\\\",1.0E-5,1.0E10,0E-10,2024-01-02T03:04:05.600Z,0001-02-03,x',
        '"",1.0E7,3.0,,2024-01-02T03:04:05.600Z,0001-02-03,""',
        ',123.0,2.5E-4,12.5000000000,2024-01-02T03:04:05.600Z,0001-02-03,y',
        '"# first column",-Infinity,,-1.0000000000,2024-01-02T03:04:05.600Z,0001-02-03,',
    ]
