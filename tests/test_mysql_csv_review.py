"""Fresh-context review R5 of MySqlSink's write path (issue 49) after 13fff85 (the LOAD DATA CSV's
pyarrow quoting "needed": text quoted, numbers, dates and times bare) and bc025a5 (the INSERT path
fails on a warning as the LOAD path does; ``SET SESSION max_error_count = 65535`` once per branch).

Each test is a finding, reproduced against the real MariaDB (127.0.0.1:13306); each failed as reviewed
(36e7428, as strict xfails) and passes since the fix: at most 65,535 values a statement and the true
count read past the protocol's cap (R5-1), durations sent to TIME columns as TIME text (R5-2), and
YEAR columns, floats into integer columns and non-text values into text or JSON columns written by
INSERT in insert mode too (R5-3 to R5-5).  Most compare what insert mode stores by LOAD DATA with what the INSERT path
(upsert mode, and insert mode's fallback) stores for the same batch, the INSERT path checked first so
that a test fails on the LOAD path's behaviour; the others compare a stored value with the value
sent.  None depends on 13fff85: quoting every valid value ("all_valid") stores the same (the LOAD
DATA text of a number or date is read as text either way).  Helpers and cleanup (tables dropped,
this test's XA branches rolled back, connections closed) are tests/test_mysql_load.py's ``env``.
"""

# ruff: noqa: F811 - the fixture env comes from tests/test_mysql_load.py

from __future__ import annotations

import datetime as dt
import decimal

import pyarrow as pa
import pytest

from tests.test_mysql_load import env, q, spy_loads, write  # noqa: F401 - env is a fixture
from tests.test_mysql_load_review import _batch
from twophase.sinks.mysql import MySqlSink, MySqlWriteError

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(180)]


def _by_insert(env, ddl: str, batch: pa.RecordBatch) -> tuple:
    """What the INSERT path (upsert mode) stores for ``batch`` in a fresh table of ``ddl``."""
    tbl = env["table"](ddl)
    write(env["make"](tbl, mode="upsert", key_columns=["id"]), [batch])
    return q(env["db"], f"SELECT id, v FROM `{tbl}` ORDER BY id")


def _by_load(env, monkeypatch, ddl: str, batch: pa.RecordBatch, loaded: bool = True) -> tuple:
    """What insert mode stores for ``batch``: by LOAD DATA (checked: one load, no INSERT fallback), or
    (``loaded=False``: columns LOAD DATA reads otherwise than INSERT stores, since the fix) by the
    INSERT path, with no LOAD tried."""
    tbl = env["table"](ddl)
    loads = spy_loads(monkeypatch)
    write(env["make"](tbl), [batch])
    assert loads == ([True] if loaded else [])
    return q(env["db"], f"SELECT id, v FROM `{tbl}` ORDER BY id")


# --------------------------------------------------------------- 1. a warning past 65,535 notes
def test_a_warning_after_65535_notes_in_one_load_still_fails_the_write(env, monkeypatch):
    n = 33_000  # 2 rounded decimals a row: 66,000 notes, then one warning on the last row
    tbl = env["table"]("id BIGINT PRIMARY KEY, a DECIMAL(20,4), b DECIMAL(20,4), s VARCHAR(3)")
    d = pa.array([decimal.Decimal("1.123456789")] * n, pa.decimal128(38, 18))
    batch = pa.record_batch({"id": pa.array(range(n), pa.int64()), "a": d, "b": d,
                             "s": pa.array(["ok"] * (n - 1) + ["toolong"])})
    calls = []
    real = MySqlSink._load

    def load(self, txn, csv, num_rows):  # counted on entry: a fixed load raises
        calls.append(num_rows)
        return real(self, txn, csv, num_rows)

    monkeypatch.setattr(MySqlSink, "_load", load)
    try:
        with pytest.raises(MySqlWriteError, match=r"warning"):
            write(env["make"](tbl), [batch])
    finally:
        # The batch went by LOAD DATA, since the fix in statements of at most 65,535 values (16,383 rows
        # of 4 columns): the third one's warning is listed.
        assert calls == [16_383, 16_383, n - 2 * 16_383], calls
    # Seen (without the raise): the write committed, the last row's 'toolong' stored as 'too'.
    assert q(env["db"], f"SELECT COUNT(*) FROM `{tbl}`")[0][0] == 0


# --------------------------------------------------------------- 2. durations into TIME (INSERT path)
def test_a_duration_into_a_time_column_is_stored_as_the_duration_sent(env, monkeypatch):
    durations = [dt.timedelta(minutes=2), dt.timedelta(hours=25), dt.timedelta(seconds=-5)]
    tbl = env["table"]("id BIGINT PRIMARY KEY, v TIME(6)")
    loads = spy_loads(monkeypatch)
    write(env["make"](tbl), [_batch(pa.array(durations, pa.duration("us")))])
    assert loads == []  # durations have no CSV form: insert mode writes them by INSERT
    assert [r[1] for r in q(env["db"], f"SELECT id, v FROM `{tbl}` ORDER BY id")] == durations


# --------------------------------------------------------------- 3. numbers the LOAD reads as text
def test_year_zero_loads_as_the_insert_path_stores_it(env, monkeypatch):
    ddl = "id BIGINT PRIMARY KEY, v YEAR"
    batch = _batch(pa.array([0, 5, 2024], pa.int16()))
    inserted = _by_insert(env, ddl, batch)
    assert [r[1] for r in inserted] == [0, 2005, 2024]
    assert _by_load(env, monkeypatch, ddl, batch, loaded=False) == inserted  # seen: (1, 2000) by LOAD


def test_a_half_double_into_an_integer_column_loads_as_the_insert_path_stores_it(env, monkeypatch):
    ddl = "id BIGINT PRIMARY KEY, v BIGINT"
    batch = _batch(pa.array([2.5, -3.5, 1e15]))
    inserted = _by_insert(env, ddl, batch)
    assert [r[1] for r in inserted] == [2, -4, 10**15]
    assert _by_load(env, monkeypatch, ddl, batch, loaded=False) == inserted  # seen: (1, 3) by LOAD


TEXT_CASES = {
    # seen: INSERT '1e20', '0.0000001'; LOAD '1e+20', '1e-7'
    "double_exponent": ("VARCHAR(40)", pa.array([1e20, 1e-7, 0.5])),
    # seen: INSERT '0.000000123456789012345678'; LOAD '1.23456789012345678E-7' (Arrow's decimal text)
    "decimal_small": ("VARCHAR(60)", pa.array([decimal.Decimal("0.000000123456789012345678")], pa.decimal128(38, 24))),
    # seen: INSERT '12:00:00'; LOAD '12:00:00.000000'
    "time": ("VARCHAR(30)", pa.array([dt.time(12, 0)], pa.time64("us"))),
    # seen: INSERT '2020-01-01 00:00:00'; LOAD '2020-01-01 00:00:00.000000'
    "timestamp": ("VARCHAR(30)", pa.array([dt.datetime(2020, 1, 1)], pa.timestamp("us"))),
    # seen: INSERT '1e20'; LOAD '1e+20'
    "double_into_json": ("JSON", pa.array([1e20])),
}


@pytest.mark.parametrize("case", list(TEXT_CASES))
def test_numbers_times_and_timestamps_into_a_text_column_load_as_the_insert_path_stores_them(env, monkeypatch,
                                                                                              case):
    ddl_type, values = TEXT_CASES[case]
    ddl = f"id BIGINT PRIMARY KEY, v {ddl_type}"
    batch = _batch(values)
    inserted = _by_insert(env, ddl, batch)
    assert len(inserted) == len(values)
    assert _by_load(env, monkeypatch, ddl, batch, loaded=False) == inserted
