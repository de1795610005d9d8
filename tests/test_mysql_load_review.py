"""Fresh-context review R3 of MySqlSink's LOAD DATA LOCAL INFILE write path (issue 49).

Each test is a finding, reproduced against the real MariaDB (127.0.0.1:13306); each failed on the
LOAD path as reviewed (commit 8194413, as strict xfails) and passes since the fix: text columns of
a character set other than utf8 and BIT columns keep insert mode on INSERT, notes no longer fail a
load (warnings still do), and two DataFrame columns for one table column are refused on both paths.  Each
compares what insert mode stores by LOAD DATA with what the INSERT path (upsert mode, the previous
behaviour and the fallback) stores for the same batch; the INSERT path is checked first, so a test
fails on the LOAD path's behaviour, not on its set-up.  Helpers and cleanup (tables dropped, this
test's XA branches rolled back, connections closed) are tests/test_mysql_load.py's ``env``.
"""

# ruff: noqa: F811 - the fixture env comes from tests/test_mysql_load.py

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest

from tests.test_mysql_load import env, q, spy_loads, write  # noqa: F401 - env is a fixture
from twophase.sinks.mysql import MySqlWriteError

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(120)]


def _batch(v: pa.Array) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(range(1, len(v) + 1), pa.int64()), "v": v})


def _by_insert(env, ddl: str, batch: pa.RecordBatch) -> tuple:
    """What the INSERT path (upsert mode) stores for ``batch`` in a fresh table of ``ddl``."""
    tbl = env["table"](ddl)
    write(env["make"](tbl, mode="upsert", key_columns=["id"]), [batch])
    return q(env["db"], f"SELECT id, v, HEX(v) FROM `{tbl}` ORDER BY id")


def _by_load(env, monkeypatch, ddl: str, batch: pa.RecordBatch, loaded: bool = True) -> tuple:
    """What insert mode stores for ``batch``: by LOAD DATA, or (``loaded=False``: columns LOAD DATA
    cannot write as INSERT does) by the INSERT path, with no LOAD tried."""
    tbl = env["table"](ddl)
    loads = spy_loads(monkeypatch)
    write(env["make"](tbl), [batch])
    assert loads == ([True] if loaded else [])
    return q(env["db"], f"SELECT id, v, HEX(v) FROM `{tbl}` ORDER BY id")


# --------------------------------------------------------------- 1. text columns not in utf8mb4
@pytest.mark.parametrize("charset,values", [("latin1", ["Müller", "naïve café"]), ("utf16", ["ab", "ü"])])
def test_text_into_a_latin1_or_utf16_column_is_stored_as_the_insert_path_stores_it(env, monkeypatch, charset,
                                                                                     values):
    ddl = f"id BIGINT PRIMARY KEY, v VARCHAR(20) CHARACTER SET {charset}"
    batch = _batch(pa.array(values))
    inserted = _by_insert(env, ddl, batch)
    assert [r[1] for r in inserted] == values  # the INSERT path converts utf8mb4 to the column's charset
    # Fixed: such a column keeps insert mode on INSERT (the load copied the UTF-8 bytes unconverted).
    assert _by_load(env, monkeypatch, ddl, batch, loaded=False) == inserted


def test_non_latin_text_into_a_latin1_column_is_refused_as_the_insert_path_refuses_it(env, monkeypatch):
    ddl = "id BIGINT PRIMARY KEY, v VARCHAR(20)) DEFAULT CHARSET=latin1 -- ("  # the table's default charset
    batch = _batch(pa.array(["Müller", "日本"]))
    with pytest.raises(MySqlWriteError, match=r"Incorrect string value.*\[error 1366\]"):
        _by_insert(env, ddl, batch)
    tbl = env["table"](ddl)
    with pytest.raises(MySqlWriteError):
        write(env["make"](tbl), [batch])
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0


# --------------------------------------------------------------- 2. BIT columns
@pytest.mark.parametrize("ddl_type,values", [("BIT(1)", pa.array([True, False])),
                                             ("BIT(8)", pa.array([5, 255], pa.int32()))])
def test_booleans_and_integers_into_a_bit_column_load_as_the_insert_path_stores_them(env, monkeypatch, ddl_type,
                                                                                       values):
    ddl = f"id BIGINT PRIMARY KEY, v {ddl_type}"
    batch = _batch(values)
    inserted = _by_insert(env, ddl, batch)
    assert [r[1] for r in inserted] == [bytes([int(x)]) for x in values.to_pylist()]
    # Fixed: a BIT column keeps insert mode on INSERT (the load failed every batch with 1264).
    assert _by_load(env, monkeypatch, ddl, batch, loaded=False) == inserted


# --------------------------------------------------------------- 3. notes fail the load
@pytest.mark.parametrize("ddl_type,values,want", [
    ("DECIMAL(20,4)", pa.array([decimal.Decimal("1.123456789012345678"), decimal.Decimal("2.5")],
                               pa.decimal128(38, 18)), [decimal.Decimal("1.1235"), decimal.Decimal("2.5000")]),
    ("DATE", pa.array([dt.datetime(2020, 1, 1, 12), dt.datetime(2021, 2, 3)], pa.timestamp("us")),
     [dt.date(2020, 1, 1), dt.date(2021, 2, 3)]),
])
def test_a_value_the_insert_path_rounds_with_a_note_loads_as_the_insert_path_stores_it(env, monkeypatch, ddl_type,
                                                                                       values, want):
    ddl = f"id BIGINT PRIMARY KEY, v {ddl_type}"
    batch = _batch(values)
    inserted = _by_insert(env, ddl, batch)
    assert [r[1] for r in inserted] == want
    assert _by_load(env, monkeypatch, ddl, batch) == inserted


# --------------------------------------------------------------- 4. two DataFrame columns, one table column
def test_two_dataframe_columns_for_one_table_column_fail_the_load_as_they_fail_the_insert(env, monkeypatch):
    ddl = "id BIGINT PRIMARY KEY, v VARCHAR(10)"
    batch = pa.RecordBatch.from_arrays([pa.array([1, 2], pa.int64()), pa.array(["A1", "A2"]), pa.array(["a1", "a2"])],
                                       names=["id", "V", "v"])
    with pytest.raises(MySqlWriteError):  # today: "Column 'v' specified twice [error 1110]"
        _by_insert(env, ddl, batch)
    tbl = env["table"](ddl)
    loads = spy_loads(monkeypatch)
    with pytest.raises(MySqlWriteError):
        write(env["make"](tbl), [batch])
    assert q(env["db"], f"SELECT id, v FROM `{tbl}` ORDER BY id") == ()
    assert loads == []  # it raised (inside or before the load)
