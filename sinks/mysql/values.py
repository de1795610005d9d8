"""Executor tasks: an Arrow batch's values as the server gets them, as CSV for
``LOAD DATA LOCAL INFILE`` (made in memory by ``pyarrow.csv``) or as Python values for multi-row
INSERTs."""

from __future__ import annotations

import datetime as _dt
import decimal
import json
from typing import Any

import pyarrow as pa

from twophase.sinks.mysql.common import _MAX_LISTED

_CSV_OPTS: Any = None


def _csv_options() -> Any:
    """``pyarrow.csv.WriteOptions`` of the loads: every valid text value quoted (pyarrow's ``needed`` quotes
    each value of a string column, binary columns viewed as strings included, whatever it holds; a quote
    doubled inside, no escape character), numbers, dates and times bare (their text holds no comma, quote
    or newline), NULL as the bare word NULL, which LOAD DATA reads as NULL (the string "NULL" is quoted).
    Quoting every valid value (``all_valid``) stores the same; bare numbers are fewer bytes for the server
    to read (benchmarks/results/mysql/profile_server.txt)."""
    global _CSV_OPTS
    if _CSV_OPTS is None:
        import pyarrow.csv as pcsv

        _CSV_OPTS = pcsv.WriteOptions(include_header=False, quoting_style="needed", null_string="NULL",
                                      delimiter=",", eol="\n")
    return _CSV_OPTS


def _csv_column(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray | None:
    """A column as ``pyarrow.csv`` writes it the way the INSERT path stores it, or None (no such way)."""
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = col.type
    if (pa.types.is_integer(t) or pa.types.is_float64(t) or pa.types.is_decimal(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_date32(t) or pa.types.is_time(t) or pa.types.is_null(t)):
        return col
    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return col.cast(pa.float64())  # as PyMySQL sends a Python float: its double's digits
    if pa.types.is_boolean(t):
        return col.cast(pa.int8())  # 1 / 0, as PyMySQL sends True / False
    if pa.types.is_date64(t):
        return col.cast(pa.date32())
    if pa.types.is_timestamp(t):
        # Arrow keeps instants in UTC: dropping the zone leaves UTC wall time, as _py_value sends it.
        return col.cast(pa.timestamp(t.unit)) if t.tz is not None else col
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if pa.types.is_fixed_size_binary(t):
            col = col.cast(pa.binary())
        # The bytes as they are (LOAD DATA ... CHARACTER SET binary converts nothing): a view, so that
        # the CSV writer does not check them for UTF-8.
        return col.view(pa.large_string() if pa.types.is_large_binary(col.type) else pa.string())
    return None


def _csv_table(batch: pa.RecordBatch) -> pa.Table | None:
    """The batch with each column as :func:`_csv_column` makes it, or None if one has no CSV form."""
    cols = []
    for i in range(batch.num_columns):
        c = _csv_column(batch.column(i))
        if c is None:
            return None
        cols.append(c)
    return pa.Table.from_arrays(cols, names=[f"c{i}" for i in range(len(cols))])


def _rows_per_statement(columns: int) -> int:
    """Rows one LOAD or INSERT carries at most: a note per value at most, all of them listed."""
    return max(1, _MAX_LISTED // max(1, columns))


def _time_text(v: _dt.timedelta) -> str:
    """A duration as a TIME literal ``[-]H:MM:SS.ffffff`` (hours past 24 kept): a number would be
    read as HHMMSS (two minutes' 120 seconds as 00:01:20)."""
    us = (v.days * 86400 + v.seconds) * 1_000_000 + v.microseconds
    sign, us = ("-", -us) if us < 0 else ("", us)
    secs, frac = divmod(us, 1_000_000)
    h, rem = divmod(secs, 3600)
    return f"{sign}{h}:{rem // 60:02d}:{rem % 60:02d}.{frac:06d}"


def _py_value(v: Any) -> Any:
    """An Arrow value as PyMySQL can send it: nested values as JSON text, tz-aware times in UTC."""
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str, ensure_ascii=False)
    if isinstance(v, _dt.datetime) and v.tzinfo is not None:
        return v.astimezone(_dt.UTC).replace(tzinfo=None)
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (str, int, float, bool, bytes, decimal.Decimal, _dt.date, _dt.time)) or v is None:
        return v
    return str(v)
