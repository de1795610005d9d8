"""Driver: ``writer="spark"``, each batch written by one ``df.write`` into its own staging folder,
the files Spark's writer left there made the batch's handles (one per Spark task), and their rows
counted from the Parquet footers.  The commit is the committer's, as for the Arrow writers."""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import asdict
from typing import Any

import pyarrow as pa

from twophase.context import BatchContext
from twophase.errors import TwoPhaseError
from twophase.sink import PreparedBatch
from twophase.sinks._formats import DEFAULT_TEXT
from twophase.sinks.files.base import _FileSinkBase, log, name_scope

#: writer="spark": Spark's format and codec names for the sink's (None: not with that writer).
_SPARK_FORMAT = {"parquet": "parquet", "jsonl": "json", "csv": "csv"}
_SPARK_PARQUET_CODECS = {
    None: "snappy", "snappy": "snappy", "none": "none", "gzip": "gzip", "zstd": "zstd",
    "lz4": "lz4_raw", "brotli": None,
}
_SPARK_TEXT_CODECS = {None: None, "gzip": "gzip", "bz2": "bzip2", "zstd": None}
#: TextOptions' fields by Spark's option names (writer="spark" passes them on).
_SPARK_TEXT_OPTION = {"sep": "sep", "quote": "quote", "escape": "escape", "null_value": "nullValue",
                      "empty_value": "emptyValue", "quote_all": "quoteAll", "escape_quotes": "escapeQuotes",
                      "ignore_leading": "ignoreLeadingWhiteSpace", "ignore_trailing": "ignoreTrailingWhiteSpace",
                      "line_sep": "lineSep", "ignore_null_fields": "ignoreNullFields"}

#: The name Spark's file writer gives a part file: part-<task>-<job uuid>[-c<file>]<ext>
_SPARK_PART = re.compile(r"part-(\d+)-.*?(?:-c(\d+))?\.[^-]*$")


class _SparkWriter(_FileSinkBase):
    """Driver: FileSink's ``writer="spark"`` (:meth:`prepare_batch`)."""

    # ------------------------------------------------- driver: writer="spark"
    def prepares_batches(self) -> bool:
        """Only ``writer="spark"`` prepares whole batches (:meth:`prepare_batch`)."""
        return self.writer == "spark"

    def prepare_batch(self, df: Any, ctx: BatchContext) -> PreparedBatch[dict] | None:
        """writer="spark": write the batch with one ``df.write`` into its own staging folder and
        return the files Spark left there as handles (one per Spark task); None otherwise.

        Spark's output committer settles task retries and speculation inside the job; the
        folder (``<root>/_twophase/<query>/b<batch>/w<token>/``) is invisible to readers, and
        what an interrupted job leaves there is removed by :meth:`abort_lingering`.
        """
        if self.writer != "spark":
            return None
        from pyspark.sql import Observation
        from pyspark.sql import functions as F

        b = self._backend
        folder = b.writer_folder(ctx, f"{ctx.run}{uuid.uuid4().hex[:8]}")
        # Rows are counted from the Parquet footers Spark wrote (a few reads per file) rather
        # than by an Observation, which costs a pass over every row: about 12% of a 2,000,000-row
        # local write.  With partition_by (possibly a file per value and task) or a text format,
        # the Observation counts them.
        observed = None
        if self.format != "parquet" or self.partition_by:
            observed = Observation(f"twophase_rows_{uuid.uuid4().hex[:8]}")
            df = df.observe(observed, F.count(F.lit(1)).alias("rows"))
        w = df.write.format(_SPARK_FORMAT[self.format])
        # No _SUCCESS marker: the folder is the batch's own, and a marker left behind after the
        # commit's renames would cost the staging cleanup a listing and a delete per batch.
        w = w.option("mapreduce.fileoutputcommitter.marksuccessfuljobs", "false")
        codec = (
            _SPARK_PARQUET_CODECS if self.format == "parquet" else _SPARK_TEXT_CODECS
        ).get(self.compression)
        if codec is not None:
            w = w.option("compression", codec)
        if self.header:
            w = w.option("header", "true")
        for k, v in asdict(self.text).items():  # Spark's own names for them
            if v != getattr(DEFAULT_TEXT, k):
                w = w.option(_SPARK_TEXT_OPTION[k], str(v).lower() if isinstance(v, bool) else v)
        if self.max_records_per_file is not None:
            w = w.option("maxRecordsPerFile", str(self.max_records_per_file))
        if self.partition_by:
            w = w.partitionBy(*self.partition_by)
        t0 = time.perf_counter()
        w.mode("error").save(b.hadoop_url(folder))  # "error", not "errorifexists": Spark Connect knows only that spelling
        observed_rows = None if observed is None else int(observed.get["rows"])
        t1 = time.perf_counter()
        try:
            handles = self._spark_handles(folder, ctx) if observed_rows != 0 else []
            rows = self._footer_rows(handles) if observed_rows is None else observed_rows
            if not rows:
                handles = []
        except BaseException:
            b.delete_folder(folder)
            raise
        if not handles:  # an empty batch: Spark's first task still writes a file with the schema
            b.delete_folder(folder)
        log.debug(
            "%s: Spark's write %.0f ms, listing %.0f ms: %d rows in %d handles",
            ctx.label,
            (t1 - t0) * 1000,
            (time.perf_counter() - t1) * 1000,
            rows,
            len(handles),
        )
        return PreparedBatch(handles, rows)

    def _footer_rows(self, handles: list[dict]) -> int:
        """Rows of a batch Spark wrote as Parquet, from its files' footers (read in parallel);
        each handle records its own."""
        from concurrent.futures import ThreadPoolExecutor

        files = [f for h in handles for f in h["files"]]
        if not files:
            return 0
        read = self._backend.read_tail
        with ThreadPoolExecutor(max_workers=min(8, len(files)), thread_name_prefix="twophase-footer") as pool:
            counts = list(pool.map(lambda f: parquet_footer_rows(read, f["staging"], f["size"]), files))
        by_file = {f["staging"]: n for f, n in zip(files, counts)}
        for h in handles:
            h["rows"] = sum(by_file[f["staging"]] for f in h["files"])
        return sum(counts)

    def _spark_handles(self, folder: str, ctx: BatchContext) -> list[dict]:
        """One handle per Spark task, for the files Spark's writer left in ``folder``."""
        b = self._backend
        batch_id, scope = ctx.batch_id, name_scope(ctx.query_name)
        sep = os.sep if self.fs == "local" else "/"
        by_task: dict[int, list[dict[str, Any]]] = {}
        for path, size in b.list_files(folder):
            rel = path[len(folder) :].lstrip(sep).split(sep)
            m = _SPARK_PART.fullmatch(rel[-1])
            if m is None:
                raise TwoPhaseError(
                    f"Spark's writer left {path}, which is not named like its part files"
                )
            if self.partition_values == "reject" and any("%" in seg for seg in rel[:-1]):
                raise TwoPhaseError(
                    f"{path}: a partition value needed escaping and partition_values='reject'"
                )
            task, nfile = int(m.group(1)), int(m.group(2) or 0)
            name = f"{self.prefix}-{batch_id:08d}-{task:05d}"
            name += f"-c{nfile:03d}" if nfile else ""
            name += f"-{scope}.{self._ext()}"
            final = b.join(b.root, *rel[:-1], name)
            by_task.setdefault(task, []).append({"staging": path, "final": final, "size": size})
        return [
            {"fs": self.fs, "rows": None, "files": files} for _, files in sorted(by_task.items())
        ]


#: Bytes read from the end of a Parquet file for its footer (one read when the footer fits).
_FOOTER_READ = 64 * 1024


def parquet_footer_rows(read_tail: Any, path: str, size: int) -> int:
    """The row count in the footer of the ``size``-byte Parquet file ``path``;
    ``read_tail(path, size, n)`` returns its last ``n`` bytes."""
    import pyarrow.parquet as pq

    tail = read_tail(path, size, min(size, _FOOTER_READ))
    if size < 12 or len(tail) < 12 or tail[-4:] != b"PAR1":
        raise TwoPhaseError(f"Spark's writer left {path}, which has no Parquet footer ({size} bytes)")
    flen = int.from_bytes(tail[-8:-4], "little")
    if flen + 12 > size:
        raise TwoPhaseError(f"{path}: its Parquet footer length ({flen}) exceeds the file ({size} bytes)")
    if flen + 8 > len(tail):
        tail = read_tail(path, size, flen + 8)
    # The footer alone, framed as a file: pyarrow reads metadata from the end and no data pages.
    return int(pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(flen + 8):])).num_rows)
