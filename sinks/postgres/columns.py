"""Both sides: the target table's columns as PostgreSQL's catalog describes them (read by
``open()`` on the driver and by ``begin_transaction`` on executor tasks), and, on executor tasks,
the checks and the encoding of Arrow batches into the CSV that ``COPY ... FROM STDIN`` reads.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa


# ------------------------------------------------------------------------ catalog
@dataclass(frozen=True)
class _Column:
    name: str
    typname: str  # pg_type.typname, e.g. int8, text, _int4 (arrays start with "_")
    category: str  # pg_type.typcategory: N numeric, S string, B bool, D date/time, A array, U user, ...
    sqltype: str  # format_type(): "bigint", "numeric(10,2)", "timestamp with time zone"
    not_null: bool
    has_default: bool
    generated: bool


_COLUMNS_SQL = """
SELECT a.attname, t.typname, t.typcategory, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       a.atthasdef OR a.attidentity <> '', a.attgenerated <> ''
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def _fetch_columns(cur: Any, oid: int) -> dict[str, _Column]:
    cur.execute(_COLUMNS_SQL, (oid,))
    return {r[0]: _Column(*r) for r in cur.fetchall()}


def _arrow_fits(at: pa.DataType, col: _Column) -> bool:
    """Whether Arrow type ``at`` can be written to ``col`` through COPY text (coarse, before any I/O).

    Strings go anywhere (the server parses them and names the column if it cannot);
    other types must land in a column of a matching family.
    """
    t = pa.types
    if t.is_dictionary(at):
        at = at.value_type
    if t.is_null(at) or t.is_string(at) or t.is_large_string(at):
        return True
    if col.category == "S" and not (t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at)):
        return True  # text, varchar, char: every scalar and nested value renders as text
    if col.typname in ("int2", "int4", "int8") and (t.is_floating(at) or (t.is_decimal(at) and at.scale > 0)):
        return False  # "1.5" is no integer: cast (and round) in Spark, explicitly
    if t.is_integer(at) or t.is_floating(at) or t.is_decimal(at):
        return col.category == "N"
    if t.is_boolean(at):
        return col.category == "B"
    if t.is_date(at):
        return col.typname in ("date", "timestamp", "timestamptz")
    if t.is_timestamp(at):
        return col.typname in ("timestamp", "timestamptz", "date")
    if t.is_time(at):
        return col.typname in ("time", "timetz")
    if t.is_duration(at):
        return col.typname == "interval"
    if t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at):
        return col.typname == "bytea"
    if t.is_list(at) or t.is_large_list(at) or t.is_fixed_size_list(at):
        return col.category == "A" or col.typname in ("json", "jsonb")
    if t.is_struct(at) or t.is_map(at):
        return col.typname in ("json", "jsonb")
    return False


def _pg_array_literal(value: Any) -> str:
    """A Python list as a PostgreSQL array literal: {1,2,NULL,"a \\"b\\""}."""
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return "{" + ",".join(_pg_array_literal(v) for v in value) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (bytes, bytearray)):
        value = "\\x" + bytes(value).hex()
    s = str(value)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        # Arrow maps come back as lists of (key, value) tuples.
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): _jsonable(v) for k, v in value}
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return value


def _to_text_friendly(arr: pa.Array, col: _Column) -> pa.Array:
    """Convert one Arrow column to something Arrow's CSV writer renders the way COPY reads it."""
    t = pa.types
    if t.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    at = arr.type
    if t.is_null(at):
        return pa.array([None] * len(arr), pa.string())
    if t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at):
        return pa.array([None if v is None else "\\x" + v.hex() for v in arr.to_pylist()], pa.string())
    if t.is_duration(at):
        unit = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "microseconds"}[at.unit]
        vals = arr.cast(pa.int64()).to_pylist()
        if at.unit == "ns":
            vals = [None if v is None else v // 1000 for v in vals]
        return pa.array([None if v is None else f"{v} {unit}" for v in vals], pa.string())
    if t.is_list(at) or t.is_large_list(at) or t.is_fixed_size_list(at) or t.is_struct(at) or t.is_map(at):
        if col.category == "A":
            return pa.array([None if v is None else _pg_array_literal(v) for v in arr.to_pylist()], pa.string())
        return pa.array([None if v is None else json.dumps(_jsonable(v), default=str, ensure_ascii=False)
                         for v in arr.to_pylist()], pa.string())
    if t.is_boolean(at) or t.is_integer(at) or t.is_floating(at) or t.is_decimal(at) or t.is_string(at) \
            or t.is_large_string(at) or t.is_date(at) or t.is_timestamp(at) or t.is_time(at):
        return arr
    return pa.array([None if v is None else str(v) for v in arr.to_pylist()], pa.string())


def encode_csv(batch: pa.RecordBatch, columns: list[_Column] | None = None) -> bytes:
    """Encode a RecordBatch as COPY-compatible CSV (no header; NULL = empty unquoted field).

    Arrow quotes every string (so an empty string is ``""`` and a lone ``\\.`` is
    not COPY's end-of-data marker) and writes timestamps as ISO text, tz-aware
    ones in UTC with ``Z``.  ``columns`` (the target columns, same order) drive
    conversions for bytea, intervals, arrays and JSON; without them nested values
    become JSON text.
    """
    import pyarrow.csv as pacsv

    arrays, names = [], []
    for i, name in enumerate(batch.schema.names):
        col = columns[i] if columns else _Column(name, "text", "S", "text", False, False, False)
        arrays.append(_to_text_friendly(batch.column(i), col))
        names.append(f"c{i}")  # header is not written; unique names keep Arrow happy
    buf = io.BytesIO()
    pacsv.write_csv(pa.RecordBatch.from_arrays(arrays, names=names), buf,
                    pacsv.WriteOptions(include_header=False))
    return buf.getvalue()

