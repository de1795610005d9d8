"""The file formats FileSink writes (Parquet, JSON lines, CSV) and their compression.

A :class:`FormatWriter` streams Arrow record batches into one open binary stream (a
local file, a WebHDFS upload, an S3 multipart upload); it knows nothing of staging
or commit.  Runs on executors.
"""

from __future__ import annotations

import base64
import datetime as dt
import functools
import io
import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

MIB = 1 << 20
#: Accepted ``format`` names -> the format written.
FORMATS = {"parquet": "parquet", "jsonl": "jsonl", "json": "jsonl", "csv": "csv"}
#: File-name extension per format.
EXT = {"parquet": "parquet", "jsonl": "jsonl", "csv": "csv"}
#: Parquet codecs (inside the file) and stream codecs for text formats (whole file, with a suffix).
PARQUET_CODECS = {"snappy", "gzip", "zstd", "lz4", "brotli", "none"}
TEXT_CODECS = {"gzip": ".gz", "gz": ".gz", "bz2": ".bz2", "zstd": ".zst"}


@dataclass(frozen=True)
class TextOptions:
    """The options of Spark's CSV and JSON writers that these writers honour, with Spark's
    defaults (its option names in the comments).  Written as Spark writes them; checked against
    Spark's own writer by tests/test_datasource_parity.py."""

    sep: str = ","  # sep / delimiter (csv): one character
    quote: str = '"'  # quote (csv): one character
    escape: str = "\\"  # escape (csv): one character, inside quoted values
    null_value: str = ""  # nullValue (csv)
    empty_value: str = '""'  # emptyValue (csv), written as it is
    quote_all: bool = False  # quoteAll (csv)
    escape_quotes: bool = True  # escapeQuotes (csv): a value holding the quote char is quoted
    ignore_leading: bool = True  # ignoreLeadingWhiteSpace (csv, written)
    ignore_trailing: bool = True  # ignoreTrailingWhiteSpace (csv, written)
    line_sep: str = "\n"  # lineSep (csv: one character; json)
    ignore_null_fields: bool = True  # ignoreNullFields (json): null fields left out


DEFAULT_TEXT = TextOptions()


class _NoClose(io.RawIOBase):
    """Passes writes through; ``close()`` only marks it closed, so pyarrow wrappers cannot close
    the real stream before it is fsynced / its upload finished."""

    def __init__(self, target: Any):
        self.target = target

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        return self.target.write(b)

    def tell(self) -> int:
        return self.target.tell()

    def flush(self) -> None:
        pass


class FormatWriter:
    """Streams Arrow batches into one open binary stream in one format (runs on executors).

    Parquet: batches are gathered into row groups of up to :attr:`ROW_GROUP_BYTES`
    of Arrow data (or :attr:`ROW_GROUP_ROWS` rows) before they are encoded.  Spark
    hands ``mapInArrow`` batches of 10,000 rows; written one by one they would each
    be a row group, every one re-trying dictionary encoding from scratch: measured
    0.55 s vs 0.36 s to encode 1M rows x 100 B, and larger files.  Memory: one row
    group of Arrow data per open file (Spark's own Parquet writer holds 128 MB).
    """

    ROW_GROUP_BYTES = 64 * MIB
    ROW_GROUP_ROWS = 1 << 20

    def __init__(self, fmt: str, f: Any, compression: str | None, header: bool = False,
                 text: TextOptions = DEFAULT_TEXT):
        self.fmt, self.compression, self.header, self.text = fmt, compression, header, text
        self._writer: Any = None
        self._compressed: Any = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = self._pending_bytes = 0
        self._header_written = False
        if fmt != "parquet" and compression:
            codec = {"gz": "gzip"}.get(compression, compression)
            self._compressed = pa.CompressedOutputStream(
                pa.PythonFile(_NoClose(f), mode="w"), codec
            )
            self.f = self._compressed
        else:
            self.f = f

    def write(self, batch: pa.RecordBatch) -> None:
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            if self._writer is None:
                codec = self.compression or "snappy"
                self._writer = pq.ParquetWriter(self.f, batch.schema, compression=codec)
            self._pending.append(batch)
            self._pending_rows += batch.num_rows
            self._pending_bytes += batch.nbytes
            if (
                self._pending_bytes >= self.ROW_GROUP_BYTES
                or self._pending_rows >= self.ROW_GROUP_ROWS
            ):
                self.flush_row_group()
        elif self.fmt == "csv":
            self.f.write(csv_lines(batch, header=self.header and not self._header_written, options=self.text)
                         .encode())
            self._header_written = True
        else:
            self.f.write(json_lines(batch, self.text).encode())

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def discard(self) -> None:
        """Drop the rows not yet encoded and close (abort: they are not wanted)."""
        self._pending, self._pending_rows, self._pending_bytes = [], 0, 0
        self.close()

    def flush_row_group(self) -> None:
        """Encode the rows gathered so far as one row group (Parquet; a no-op otherwise)."""
        if self._pending:
            self._writer.write_table(
                pa.Table.from_batches(self._pending), row_group_size=self.ROW_GROUP_ROWS
            )
            self._pending, self._pending_rows, self._pending_bytes = [], 0, 0

    def close(self) -> None:
        if self._writer is not None:
            if self.fmt == "parquet":
                self.flush_row_group()
            self._writer.close()
            self._writer = None
        if self._compressed is not None:
            self._compressed.close()
            self._compressed = None


# ---------------------------------------------------------------- JSON lines, as Spark writes them
# Spark's JSON writer (Jackson, default options): null fields left out, NaN and infinities as
# the strings "NaN" / "Infinity" / "-Infinity", binary as base64, dates yyyy-MM-dd, timestamps
# yyyy-MM-dd'T'HH:mm:ss.SSSXXX in the session time zone (the zone of Spark's Arrow batches),
# timestamps without zone yyyy-MM-dd'T'HH:mm:ss.SSS, decimals as plain numbers, floats by their
# shortest decimal form, maps as objects. tests/test_files_local.py compares with Spark's output.
Encoder = Callable[[Any], str]


def _float(v: float) -> str:
    if math.isnan(v):
        return '"NaN"'
    if math.isinf(v):
        return '"Infinity"' if v > 0 else '"-Infinity"'
    return repr(v)


def _float32(v: float) -> str:
    import numpy as np

    if math.isnan(v) or math.isinf(v):
        return _float(v)
    return str(np.float32(v))  # the shortest form that round-trips a 32-bit float, like Java's


def _millis(t: dt.datetime | dt.time) -> str:
    return f"{t.microsecond // 1000:03d}"


def _timestamp(tz: str | None) -> Encoder:
    if tz is None:
        return lambda v: f'"{v.strftime("%Y-%m-%dT%H:%M:%S")}.{_millis(v)}"'

    def enc(v: dt.datetime) -> str:
        off = v.utcoffset() or dt.timedelta(0)
        if off == dt.timedelta(0):
            zone = "Z"
        else:
            sign = "-" if off < dt.timedelta(0) else "+"
            mins = abs(int(off.total_seconds())) // 60
            zone = f"{sign}{mins // 60:02d}:{mins % 60:02d}"
        return f'"{v.strftime("%Y-%m-%dT%H:%M:%S")}.{_millis(v)}{zone}"'

    return enc


def _string(v: str) -> str:
    return json.dumps(v, ensure_ascii=False)


def json_encoder(t: pa.DataType, nulls: bool = False) -> Encoder:
    """The JSON text of one non-null value of Arrow type ``t`` (from ``to_pylist``), as Spark writes it
    (``nulls``: a struct's null fields written as ``null``, Spark's ``ignoreNullFields=false``)."""
    if pa.types.is_null(t):
        return lambda v: "null"  # never called: null fields are left out
    if pa.types.is_boolean(t):
        return lambda v: "true" if v else "false"
    if pa.types.is_integer(t):
        return str
    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return _float32
    if pa.types.is_floating(t):
        return _float
    if pa.types.is_decimal(t):
        return str
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return _string
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return lambda v: '"' + base64.b64encode(v).decode("ascii") + '"'
    if pa.types.is_date(t):
        return lambda v: f'"{v.isoformat()}"'
    if pa.types.is_timestamp(t):
        return _timestamp(t.tz)
    if pa.types.is_struct(t):
        fields = [(f.name, _string(f.name), json_encoder(f.type, nulls)) for f in t]
        return lambda v: _object(((k, enc, v[name]) for name, k, enc in fields), nulls)
    if pa.types.is_map(t):
        kenc, venc = json_encoder(t.key_type, nulls), json_encoder(t.item_type, nulls)
        as_key = (lambda k: _string(k)) if pa.types.is_string(t.key_type) else (lambda k: _string(kenc(k)))
        return lambda v: "{" + ",".join(f"{as_key(k)}:{'null' if x is None else venc(x)}" for k, x in v) + "}"
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        enc = json_encoder(t.value_type, nulls)
        return lambda v: "[" + ",".join("null" if x is None else enc(x) for x in v) + "]"
    raise TypeError(f"cannot write Arrow type {t} as JSON")


def _object(items, nulls: bool = False) -> str:
    if nulls:
        return "{" + ",".join(f"{k}:{'null' if v is None else enc(v)}" for k, enc, v in items) + "}"
    return "{" + ",".join(f"{k}:{enc(v)}" for k, enc, v in items if v is not None) + "}"


def _json_fields(schema: pa.Schema, nulls: bool = False) -> list[tuple[str, Encoder]]:
    fields = []
    for f in schema:
        try:
            fields.append((_string(f.name), json_encoder(f.type, nulls)))
        except TypeError as e:
            raise TypeError(f"column {f.name!r}: {e}; cast it (e.g. to string) before writing jsonl") from None
    return fields


def json_lines(batch: pa.RecordBatch, options: TextOptions = DEFAULT_TEXT) -> str:
    """The rows of ``batch`` as JSON lines (each ending in ``lineSep``), as Spark's JSON writer writes them."""
    nulls = not options.ignore_null_fields
    fields = _json_fields(batch.schema, nulls)
    cols = [c.to_pylist() for c in batch.columns]
    out = []
    for i in range(batch.num_rows):
        out.append(_object(((k, enc, col[i]) for (k, enc), col in zip(fields, cols)), nulls))
    sep = options.line_sep
    return sep.join(out) + sep if out else ""


# ---------------------------------------------------------------- CSV, as Spark writes it
# Spark's CSV writer (univocity, default options): no header; separator ","; null as nothing and
# the empty string as ""; leading and trailing whitespace (chars <= ' ') of a value dropped; a value
# quoted with " when what remains after its leading whitespace holds , " \n or \r (or, in the first
# column, when it starts with the comment char #), inside quotes " and \ escaped with \; lines end
# in \n.  Values: booleans true/false, floats as Java's Double/Float.toString (1.0E20, NaN,
# Infinity), decimals as Java's BigDecimal.toString, binary as [AB CD] (hex bytes), dates
# yyyy-MM-dd, timestamps yyyy-MM-dd'T'HH:mm:ss.SSSXXX in the session time zone, timestamps without
# zone yyyy-MM-dd'T'HH:mm:ss.SSS.  Like Spark, arrays, structs, maps and nulls-only columns are
# refused.  tests/test_files_local.py compares with Spark's output.
_CSV_BLANK = "".join(chr(i) for i in range(33))
_CSV_QUOTE_IF = frozenset(',"\n\r')


def csv_field(v: str, first: bool = False, o: TextOptions = DEFAULT_TEXT) -> str:
    """One string value as a field of Spark's CSV writer (``first``: in the first column)."""
    if o is DEFAULT_TEXT:
        lead = v.lstrip(_CSV_BLANK)
        text = lead.rstrip(_CSV_BLANK)
        if not text:
            return '""'
        if (first and v[0] == "#") or not _CSV_QUOTE_IF.isdisjoint(lead):
            return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'
        return text
    lead = v.lstrip(_CSV_BLANK) if o.ignore_leading else v
    text = lead.rstrip(_CSV_BLANK) if o.ignore_trailing else lead
    if not text:
        return o.empty_value
    special = {o.sep, "\n", "\r", *o.line_sep}
    if o.escape_quotes:
        special.add(o.quote)
    if o.quote_all or (first and v[0] == "#") or not special.isdisjoint(lead):
        q, e = o.quote, o.escape
        body = text.replace(q, q + q) if e == q else text.replace(e, e + e).replace(q, e + q)
        return q + body + q
    return text


def _java_number(v: float, shortest: str) -> str:
    """``v`` as Java's Double/Float.toString, from the shortest decimal that reads back as ``v``."""
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "Infinity" if v > 0 else "-Infinity"
    if v == 0:
        return "-0.0" if math.copysign(1.0, v) < 0 else "0.0"
    mantissa, _, exp = shortest.lower().partition("e")
    sign = "-" if mantissa.startswith("-") else ""
    whole, _, frac = mantissa.lstrip("-").partition(".")
    digits = (whole + frac).lstrip("0")
    point = len(whole.lstrip("0")) if whole.strip("0") else -(len(frac) - len(frac.lstrip("0")))
    point += int(exp or 0)  # value = 0.DIGITS * 10**point
    digits = digits.rstrip("0")
    if 1e-3 <= abs(v) < 1e7:
        if point <= 0:
            return f"{sign}0.{'0' * -point}{digits}"
        digits = digits.ljust(point, "0")
        return f"{sign}{digits[:point]}.{digits[point:] or '0'}"
    return f"{sign}{digits[0]}.{digits[1:] or '0'}E{point - 1}"


def _java_float32(v: float) -> str:
    if math.isnan(v) or math.isinf(v) or v == 0:
        return _java_number(v, "")
    for precision in range(9):  # 9 significant digits always read back as the same 32-bit float
        text = f"{v:.{precision}e}"
        if struct.unpack("<f", struct.pack("<f", float(text)))[0] == v:
            break
    return _java_number(v, text)


def _iso_timestamp(tz: str | None) -> Encoder:
    def enc(v: dt.datetime) -> str:
        text = (f"{v.year:04d}-{v.month:02d}-{v.day:02d}T{v.hour:02d}:{v.minute:02d}:"
                f"{v.second:02d}.{_millis(v)}")
        if tz is None:
            return text
        secs = int((v.utcoffset() or dt.timedelta(0)).total_seconds())
        if secs == 0:
            return text + "Z"
        sign, secs = ("-" if secs < 0 else "+"), abs(secs)
        zone = f"{sign}{secs // 3600:02d}:{secs // 60 % 60:02d}"
        return text + zone + (f":{secs % 60:02d}" if secs % 60 else "")

    return enc


def csv_encoder(t: pa.DataType) -> Encoder:
    """The CSV text of one non-null value of Arrow type ``t`` (from ``to_pylist``), as Spark writes it
    (strings before :func:`csv_field`)."""
    if pa.types.is_boolean(t):
        return lambda v: "true" if v else "false"
    if pa.types.is_integer(t) or pa.types.is_decimal(t):
        return str  # Python's Decimal prints as Java's BigDecimal.toString does
    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return _java_float32
    if pa.types.is_floating(t):
        return lambda v: _java_number(v, repr(v))
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return str
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return lambda v: "[" + " ".join(f"{b:02X}" for b in v) + "]"
    if pa.types.is_date(t):
        return lambda v: f"{v.year:04d}-{v.month:02d}-{v.day:02d}"
    if pa.types.is_timestamp(t):
        return _iso_timestamp(t.tz)
    raise TypeError(f"cannot write Arrow type {t} as CSV (Spark's CSV writer refuses it too)")


def _quoted(enc: Encoder, first: bool, o: TextOptions) -> Encoder:
    return lambda v: csv_field(enc(v), first, o)


def _csv_columns(schema: pa.Schema, o: TextOptions = DEFAULT_TEXT) -> list[Encoder]:
    encoders: list[Encoder] = []
    for i, f in enumerate(schema):
        try:
            enc = csv_encoder(f.type)
        except TypeError as e:
            raise TypeError(f"column {f.name!r}: {e}; cast it (e.g. to string) before writing csv") from None
        if pa.types.is_string(f.type) or pa.types.is_large_string(f.type):
            encoders.append(functools.partial(csv_field, first=i == 0, o=o))
        elif o is DEFAULT_TEXT:
            encoders.append(enc)
        else:  # another separator or quoteAll may quote any value's text
            encoders.append(_quoted(enc, i == 0, o))
    return encoders


def csv_lines(batch: pa.RecordBatch, header: bool = False, options: TextOptions = DEFAULT_TEXT) -> str:
    """The rows of ``batch`` as CSV lines, as Spark's CSV writer writes them with ``options`` (default:
    its defaults), and ``header``: the column names first, as Spark's ``header=true`` writes them."""
    o = options
    encoders = _csv_columns(batch.schema, o)
    if o.null_value:
        nulls = [csv_field(o.null_value, i == 0, o) for i in range(batch.num_columns)]
    else:
        nulls = [o.quote * 2 if o.quote_all else ""] * batch.num_columns
    out = [o.sep.join(csv_field(n, i == 0, o) for i, n in enumerate(batch.schema.names))] if header else []
    cols = [c.to_pylist() for c in batch.columns]
    for i in range(batch.num_rows):
        out.append(o.sep.join(null if col[i] is None else enc(col[i]) for enc, col, null in zip(encoders, cols, nulls)))
    return o.line_sep.join(out) + o.line_sep if out else ""
