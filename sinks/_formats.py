"""The file formats FileSink writes (Parquet, JSON lines, CSV) and their compression.

A :class:`FormatWriter` streams Arrow record batches into one open binary stream (a
local file, a WebHDFS upload, an S3 multipart upload); it knows nothing of staging
or commit.  Runs on executors.
"""

from __future__ import annotations

import io
import json
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

    def __init__(self, fmt: str, f: Any, compression: str | None):
        self.fmt, self.compression = fmt, compression
        self._writer: Any = None
        self._compressed: Any = None
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = self._pending_bytes = 0
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
            import pyarrow.csv as pacsv

            if self._writer is None:
                self._writer = pacsv.CSVWriter(self.f, batch.schema)
            self._writer.write_batch(batch)
        else:
            lines = [json.dumps(row, default=str, ensure_ascii=False) for row in batch.to_pylist()]
            self.f.write(("\n".join(lines) + "\n").encode())

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
