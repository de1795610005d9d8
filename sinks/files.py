"""Exactly-once file sink: stage part files in the target filesystem, rename them on commit.

Local disk (this module) commits by hard link + unlink, which never overwrites;
staging lives under ``<target>/_twophase/`` so Spark and Hadoop readers ignore it.
Part names are deterministic per batch and partition, so a replay cannot
duplicate a file.

Delivery guarantee: with the coordinator, every row of a batch appears in
exactly one committed part file, once, after any number of driver crashes.

How it recovers: a staged file is the pre-committed transaction; its handle
(staging path, final path, size) is in the log.  Commit is idempotent: "final
exists with the expected size and staging is gone" is already committed.
Staged files of attempts that never reached the log are deleted by
``abort_lingering``.
"""

from __future__ import annotations

import io
import json
import os
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sink import CommitResult, TwoPhaseCommitSink

FORMATS = {"parquet": "parquet", "jsonl": "jsonl", "json": "jsonl", "csv": "csv"}
_EXT = {"parquet": "parquet", "jsonl": "jsonl", "csv": "csv"}
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
STAGING_DIR = "_twophase"


def _safe(s: str) -> str:
    return _SAFE.sub("_", s)


class _FormatWriter:
    """Streams Arrow batches into one open binary file in one format."""

    def __init__(self, fmt: str, f: io.RawIOBase, compression: str | None):
        self.fmt, self.f, self.compression = fmt, f, compression
        self._writer: Any = None

    def write(self, batch: pa.RecordBatch) -> None:
        if self.fmt == "parquet":
            import pyarrow.parquet as pq

            if self._writer is None:
                self._writer = pq.ParquetWriter(self.f, batch.schema, compression=self.compression or "snappy")
            self._writer.write_batch(batch)
        elif self.fmt == "csv":
            import pyarrow.csv as pacsv

            if self._writer is None:
                self._writer = pacsv.CSVWriter(self.f, batch.schema)
            self._writer.write_batch(batch)
        else:
            lines = [json.dumps(row, default=str, ensure_ascii=False) for row in batch.to_pylist()]
            self.f.write(("\n".join(lines) + "\n").encode())

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass
class FileTransaction:
    """One partition's part file of one batch, open in staging (executor side)."""

    ctx: TransactionContext
    staging: str
    final: str
    file: Any
    writer: _FormatWriter
    rows: int = 0
    closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class FileSink(TwoPhaseCommitSink[FileTransaction, dict]):
    """Write each batch as part files under ``url`` (a directory), exactly once.

    ``format``: ``parquet`` (default), ``jsonl`` or ``csv``; ``compression`` is the
    Parquet codec.  ``prefix`` starts every part name:
    ``{prefix}-{batch:08d}-{partition:05d}.{ext}``.  ``fsync`` (default on) makes a
    pre-committed part survive a machine crash, not only a process crash.
    """

    kind = "files"

    def __init__(self, url: str, format: str = "parquet", *, prefix: str = "part",
                 compression: str | None = None, fsync: bool = True,
                 storage_options: dict[str, Any] | None = None):
        if format not in FORMATS:
            raise ConfigurationError(f"unknown format {format!r}; use one of parquet, jsonl, csv")
        if not prefix or _safe(prefix) != prefix or prefix.startswith(("_", ".")):
            raise ConfigurationError(f"prefix {prefix!r} must be letters, digits, '-', '_' or '.', "
                                     "and not start with '_' or '.' (readers would ignore the files)")
        scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
        if scheme != "file":
            raise ConfigurationError(f"FileSink does not support {scheme}:// yet (local paths and file://)")
        self.url = url
        self.root = os.path.abspath(url.split("://", 1)[1] if "://" in url else url)
        self.format = FORMATS[format]
        self.prefix = prefix
        self.compression = compression
        self.fsync = fsync
        self.storage_options = storage_options or {}

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        return {"sink": self.kind, "url": self.url, "format": self.format, "prefix": self.prefix,
                "compression": self.compression, "fsync": self.fsync}

    # ------------------------------------------------------------------- paths
    def _batch_staging(self, query_name: str, batch_id: int) -> str:
        return os.path.join(self.root, STAGING_DIR, _safe(query_name), f"b{batch_id:08d}")

    def final_name(self, batch_id: int, partition_id: int) -> str:
        return f"{self.prefix}-{batch_id:08d}-{partition_id:05d}.{_EXT[self.format]}"

    # ---------------------------------------------------------------- driver
    def open(self) -> None:
        try:
            os.makedirs(os.path.join(self.root, STAGING_DIR), exist_ok=True)
        except OSError as e:
            raise ConfigurationError(f"FileSink cannot write to {self.root}: {e.strerror}") from None
        if not os.access(self.root, os.W_OK):
            raise ConfigurationError(f"FileSink cannot write to {self.root}: permission denied")

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        return {"staging": self._batch_staging(query_name, batch_id)}

    # -------------------------------------------------------------- executor
    def begin_transaction(self, ctx: TransactionContext) -> FileTransaction:
        folder = self._batch_staging(ctx.query_name, ctx.batch_id)
        os.makedirs(folder, exist_ok=True)
        final = os.path.join(self.root, self.final_name(ctx.batch_id, ctx.partition_id))
        # Attempt and a random token in the staging name: two attempts never share a file.
        staging = os.path.join(folder, f"{os.path.basename(final)}.a{ctx.attempt}-{uuid.uuid4().hex[:8]}")
        f = open(staging, "xb")
        return FileTransaction(ctx, staging, final, f, _FormatWriter(self.format, f, self.compression))

    def write(self, txn: FileTransaction, batch: pa.RecordBatch) -> None:
        txn.writer.write(batch)
        txn.rows += batch.num_rows

    def pre_commit(self, txn: FileTransaction) -> dict:
        txn.writer.close()
        txn.file.flush()
        if self.fsync:
            os.fsync(txn.file.fileno())
        txn.file.close()
        txn.closed = True
        if self.fsync:
            _fsync_dir(os.path.dirname(txn.staging))
        return {"staging": txn.staging, "final": txn.final, "size": os.path.getsize(txn.staging),
                "rows": txn.rows}

    def abort(self, txn: FileTransaction) -> None:
        if not txn.closed:
            try:
                txn.writer.close()
            except Exception:
                pass
            txn.file.close()
            txn.closed = True
        _unlink(txn.staging)

    # ---------------------------------------------------------------- driver
    def commit(self, handle: dict) -> CommitResult:
        staging, final, size = handle["staging"], handle["final"], int(handle["size"])
        if os.path.exists(staging):
            try:
                os.link(staging, final)  # never overwrites: EEXIST instead
            except FileExistsError:
                if not os.path.samefile(staging, final):
                    raise TwoPhaseError(
                        f"cannot commit {staging}: the target {final} already exists and is another "
                        "file (written by something else?). Move it aside and restart; the staged "
                        "file is kept.") from None
            if self.fsync:
                _fsync_dir(os.path.dirname(final))
            _unlink(staging)
            return CommitResult.committed()
        if os.path.exists(final):
            actual = os.path.getsize(final)
            if actual == size:
                return CommitResult.already_committed()
            return CommitResult.lost(f"staged file {staging} is gone and {final} has {actual} bytes, "
                                     f"expected {size}")
        return CommitResult.lost(f"neither the staged file {staging} nor the target {final} exists")

    def recover_and_abort(self, handle: dict) -> None:
        _unlink(handle["staging"])

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[dict]) -> int:
        folder = intent.get("staging") or self._batch_staging(query_name, batch_id)
        keep_paths = {os.path.abspath(h["staging"]) for h in keep}
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return 0
        n = 0
        for name in names:
            path = os.path.join(folder, name)
            if os.path.abspath(path) not in keep_paths:
                _unlink(path)
                n += 1
        if not keep_paths or not any(os.path.exists(p) for p in keep_paths):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        return n

    def describe_handle(self, handle: dict) -> str:
        return f"file {handle.get('final')} (staged {handle.get('staging')}, {handle.get('size')} bytes)"


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
