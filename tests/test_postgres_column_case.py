"""Issue 47: DataFrame columns go into a PostgreSQL table's columns as Spark's JDBC writer puts them
(``spark.sql.caseSensitive=false``, its default): by exact name, else ignoring case; a name that
matches several table columns only ignoring case, or two DataFrame columns that land in one table
column, are refused naming them.  Before: ``ID`` into the column ``id`` failed ("names are
case-sensitive") where Spark's own writer wrote it."""

from __future__ import annotations

import uuid

import pyarrow as pa
import pytest

from twophase import TransactionContext
from twophase.sink import CommitOutcome
from twophase.sinks.postgres import PostgresSink, PostgresWriteError

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(120)]


def _table(db, cols: str) -> str:
    name = f"case_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{name}" ({cols})')
    return name


def _rows(db, sql: str) -> list[tuple]:
    with db.cursor() as cur:
        cur.execute(sql)
        return sorted(cur.fetchall())


def _write(sink: PostgresSink, batch: pa.RecordBatch, batch_id: int = 0) -> dict:
    name = f"case-{uuid.uuid4().hex[:6]}"
    intent = sink.plan_batch(name, batch_id, 1)
    txn = sink.begin_transaction(TransactionContext(name, batch_id, 0, 0, intent))
    try:
        sink.write(txn, batch)
        return sink.pre_commit(txn)
    except BaseException:
        sink.abort(txn)
        raise


@pytest.mark.parametrize("mode", ["insert", "upsert"])
def test_dataframe_columns_match_table_columns_ignoring_case_as_sparks_jdbc_writer(db, postgres_service, mode):
    t = _table(db, "id bigint PRIMARY KEY, amount int NOT NULL, note text")
    sink = PostgresSink(postgres_service["dsn"], table=t, mode=mode, key_columns=["id"] if mode == "upsert" else None)
    sink.open()
    handle = _write(sink, pa.record_batch({"ID": pa.array([1, 2], pa.int64()), "Amount": pa.array([5, 6], pa.int32()),
                                           "note": ["a", "b"]}))
    assert sink.commit(handle).outcome is CommitOutcome.COMMITTED
    assert _rows(db, f'SELECT id, amount, note FROM "{t}"') == [(1, 5, "a"), (2, 6, "b")]


def test_an_ambiguous_or_doubled_column_is_refused_naming_it(db, postgres_service):
    t = _table(db, 'id bigint, "ID" bigint, v text')
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    # The exact name wins (no ambiguity): "ID" into "ID", v into v.
    assert sink.commit(_write(sink, pa.record_batch({"ID": pa.array([7], pa.int64()), "v": ["x"]}))).done
    assert _rows(db, f'SELECT id, "ID", v FROM "{t}"') == [(None, 7, "x")]
    with pytest.raises(PostgresWriteError, match=r"'Id' matches the table columns 'id', 'ID' when case is "
                                                 r"ignored") as e:
        _write(sink, pa.record_batch({"Id": pa.array([1], pa.int64())}))
    assert e.value.column == "Id"
    with pytest.raises(PostgresWriteError, match=r"the DataFrame columns 'v', 'V' all go into the table column "
                                                 r"'v'") as e:
        _write(sink, pa.record_batch({"v": ["a"], "V": ["b"]}))
    assert e.value.column == "V"
    assert _rows(db, f'SELECT id, "ID", v FROM "{t}"') == [(None, 7, "x")]


def test_an_unknown_column_is_still_refused(db, postgres_service):
    t = _table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    with pytest.raises(PostgresWriteError, match=r"'idx' is not a column of the table; table columns: id"):
        _write(sink, pa.record_batch({"idx": pa.array([1], pa.int64())}))
