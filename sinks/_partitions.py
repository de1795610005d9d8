"""Hive-style partition directories for FileSink: ``col=value`` names made path-safe, and the
split of an Arrow batch by partition values.  Runs on executors."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from twophase.errors import ConfigurationError

#: Spark/Hive's name for a null (or empty string) partition value.
HIVE_DEFAULT_PARTITION = "__HIVE_DEFAULT_PARTITION__"


# Spark's ExternalCatalogUtils.escapePathName set (Hive's FileUtils): escaped as %XX, and
# unescaped again by Spark's and Hive's readers, so values round-trip.
_ESCAPE = {chr(c) for c in range(0x20)} | set("\"#%'*/:=?\\\x7f{[]^")


def escape_partition_value(value: str) -> str:
    """Hive/Spark path escaping of one partition value (``/`` -> ``%2F``, ``=`` -> ``%3D``, ...)."""
    return "".join(f"%{ord(ch):02X}" if ch in _ESCAPE else ch for ch in value)


def _render_value(v: Any) -> str | None:
    """A partition value as Spark renders it in a path (before escaping); None for null."""
    if v is None:
        return None
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, bytes):
        raise ConfigurationError("binary columns cannot be partition columns")
    if hasattr(v, "isoformat") and not isinstance(v, str):
        return v.isoformat(sep=" ") if hasattr(v, "hour") and hasattr(v, "date") else v.isoformat()
    return str(v)


def partition_segment(column: str, value: Any, mode: str = "escape") -> str:
    """The directory name ``column=value`` for one partition value, path-safe by construction.

    ``mode="escape"`` escapes like Hive/Spark (readers unescape it); ``mode="reject"``
    raises :class:`ValueError` for a value that would need escaping, ``.``/``..``, or
    a value with control characters.  Null and ``""`` become ``__HIVE_DEFAULT_PARTITION__``.
    """
    s = _render_value(value)
    if s is None or s == "":
        return f"{column}={HIVE_DEFAULT_PARTITION}"
    if mode == "reject":
        bad = sorted({c for c in s if c in _ESCAPE})
        if bad or s in (".", ".."):
            shown = ", ".join(repr(c) for c in bad) if bad else repr(s)
            raise ValueError(
                f"partition value {s[:80]!r} of column {column!r} is not path-safe ({shown}); "
                "partition values may not contain '/', '\\', '=', ':', '%', control characters "
                "or be '.'/'..'. Clean the column, or use partition_values='escape' "
                "(Hive-style %XX escaping, which Spark reads back unchanged)"
            )
        seg = f"{column}={s}"
    else:
        seg = f"{column}={escape_partition_value(s)}"
    if len(seg.encode()) > 255:
        raise ValueError(
            f"partition directory for column {column!r} would be {len(seg.encode())} bytes; "
            "path components are limited to 255 bytes"
        )
    return seg


def _split_by_partition(batch: pa.RecordBatch, cols: list[str]):
    """Yield (values tuple, RecordBatch without the partition columns) per distinct value
    combination."""
    import pyarrow.compute as pc

    t = pa.Table.from_batches([batch])
    n = t.num_rows
    if n == 0:
        return
    order = pc.sort_indices(t, sort_keys=[(c, "ascending", "at_end") for c in cols])
    st = t.take(order)
    starts = [0]
    if n > 1:
        change = None
        for c in cols:
            col = st.column(c).combine_chunks()
            a, b = col.slice(1), col.slice(0, n - 1)
            d = pc.or_(
                pc.fill_null(pc.not_equal(a, b), False), pc.not_equal(pc.is_null(a), pc.is_null(b))
            )
            change = d if change is None else pc.or_(change, d)
        starts += [i + 1 for i in pc.indices_nonzero(change).to_pylist()]
    data_cols = [c for c in st.column_names if c not in cols]
    for s, e in zip(starts, starts[1:] + [n]):
        part = st.slice(s, e - s)
        values = tuple(part.column(c)[0].as_py() for c in cols)
        for rb in part.select(data_cols).to_batches():
            if rb.num_rows:
                yield values, rb
