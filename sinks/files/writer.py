"""Executor tasks: FileSink's transactions with the sink's own Arrow writers (``writer="arrow"``):
part files opened in staging, rows split by partition and written in the sink's format, the files
finished at ``pre_commit`` into the handle the driver logs and commits, or removed at ``abort``."""

from __future__ import annotations

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sinks._formats import FormatWriter as _FormatWriter
from twophase.sinks._partitions import _split_by_partition, partition_segment
from twophase.sinks.files.base import _FileSinkBase, log
from twophase.sinks.files.transaction import FileTransaction, _OpenFile


class _Writer(_FileSinkBase):
    """Executor tasks: FileSink's ``begin_transaction``, ``write``, ``pre_commit`` and ``abort``."""

    # -------------------------------------------------------------- executor
    def _open_file(self, txn: FileTransaction, key: tuple, nth: int = 0) -> _OpenFile:
        ctx = txn.ctx
        b = self._backend
        name = self.final_name(ctx.batch_id, ctx.partition_id, ctx.query_name, ctx.intent.get("ballot"), nth)
        if self.partition_by:
            final = b.join(b.root, *key, name)  # key: the partition directory names
        else:
            final = b.join(b.root, name)
        full = txn.extra.setdefault("full", [])  # files that reached max_records_per_file
        staging, stream = b.open_file(ctx, final, len(txn.files) + len(full))
        writer = _FormatWriter(self.format, stream, self.compression, self.header, self.text)
        f = _OpenFile(final, staging, stream, writer)
        txn.files[key] = f
        txn.extra.setdefault("nth", {})[key] = nth
        return f

    def _write_to(self, txn: FileTransaction, key: tuple, batch: pa.RecordBatch) -> None:
        """``batch`` into the open file of ``key``; with ``max_records_per_file``, a file that is full
        is closed and the rest goes to the task's next file (``-c001``, ...), as Spark's writer does."""
        f = txn.files.get(key) or self._open_file(txn, key)
        limit = self.max_records_per_file
        while limit is not None and f.rows + batch.num_rows > limit:
            room = limit - f.rows
            if room:
                f.writer.write(batch.slice(0, room))
                f.rows += room
                batch = batch.slice(room)
            f.writer.close()  # encoded; the stream is finished with the others at pre_commit
            txn.extra["full"].append(txn.files.pop(key))
            f = self._open_file(txn, key, txn.extra["nth"][key] + 1)
        if batch.num_rows:
            f.writer.write(batch)
            f.rows += batch.num_rows

    def begin_transaction(self, ctx: TransactionContext) -> FileTransaction:
        txn = FileTransaction(ctx)
        if not self.partition_by:
            self._open_file(txn, ())
        return txn

    def write(self, txn: FileTransaction, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:  # an empty batch may carry null-typed columns; it adds nothing
            return
        if not self.partition_by:
            self._write_to(txn, (), batch)
        else:
            missing = [c for c in self.partition_by if c not in batch.schema.names]
            if missing:
                raise ConfigurationError(
                    f"partition_by column(s) {missing} are not in the data "
                    f"(columns: {batch.schema.names})"
                )
            if len(self.partition_by) == batch.num_columns:
                raise ConfigurationError(
                    "every column is a partition column: nothing would be left to "
                    "write into the files"
                )
            for values, rb in _split_by_partition(batch, self.partition_by):
                try:
                    # Keyed by directory, not raw value: null and "" share the default partition.
                    segs = tuple(
                        partition_segment(c, v, self.partition_values)
                        for c, v in zip(self.partition_by, values)
                    )
                except ValueError as e:
                    raise TwoPhaseError(f"{txn.ctx.label}: {e}") from None
                self._write_to(txn, segs, rb)
            self._bound_pending(txn)
        txn.rows += batch.num_rows

    @staticmethod
    def _bound_pending(txn: FileTransaction) -> None:
        """With many open files (partition_by), keep the rows gathered for Parquet row groups
        within one row group's budget per task: encode the biggest pending ones first."""
        limit = _FormatWriter.ROW_GROUP_BYTES
        total = sum(f.writer.pending_bytes for f in txn.files.values())
        if total <= limit:
            return
        for f in sorted(txn.files.values(), key=lambda f: f.writer.pending_bytes, reverse=True):
            if total <= limit // 2:
                break
            total -= f.writer.pending_bytes
            f.writer.flush_row_group()

    def pre_commit(self, txn: FileTransaction) -> dict:
        entries = []
        for f in [*txn.extra.get("full", []), *txn.files.values()]:
            f.writer.close()
            e = self._backend.finish_file(f)
            e["rows"] = f.rows
            entries.append(e)
        txn.closed = True
        if self.fs == "local" and len(entries) == 1 and not self.partition_by:
            e = entries[0]
            return {
                "staging": e["staging"],
                "final": e["final"],
                "size": e["size"],
                "rows": txn.rows,
            }
        return {"fs": self.fs, "rows": txn.rows, "files": entries}

    def abort(self, txn: FileTransaction) -> None:
        for f in [*txn.extra.get("full", []), *txn.files.values()]:
            if not txn.closed:
                try:
                    f.writer.discard()
                except Exception:
                    pass
            try:
                self._backend.abort_file(f)
            except Exception:  # best effort; abort_lingering finds leftovers by the batch's INTENT
                log.warning("abort of %s failed", f.final, exc_info=True)
        txn.closed = True
