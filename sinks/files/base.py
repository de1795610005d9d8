"""Both sides (driver and executor tasks): what every part of FileSink shares.

The constants of its options, the writer a URL gets by default, the scope token part names carry
(:func:`name_scope`), and :class:`_FileSinkBase`, the class each of FileSink's mixins extends: the
settings its constructor sets (``sink.py``) and the part names and staging paths that follow from
them, which a task names its files by and the driver finds and sweeps them by.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import Any

from twophase.sink import TwoPhaseCommitSink
from twophase.sinks._formats import EXT as _EXT
from twophase.sinks._formats import MIB, TEXT_CODECS, TextOptions
from twophase.sinks.files.transaction import FileTransaction
from twophase.storage import Backend, backend_for, scheme_of
from twophase.storage.parts import PartFiles

log = logging.getLogger("twophase.sinks.files")

#: S3: every part but the last must be at least 5 MiB (and at most 5 GiB).
S3_MIN_PART = 5 * MIB
S3_MAX_PART = 5 * 1024 * MIB
DEFAULT_PART_SIZE = 8 * MIB
#: ``writer``: "arrow" (the sink's own writers in per-task transactions) or "spark" (one
#: ``df.write`` per batch into its staging folder; local disk and HDFS).  Default by backend.
WRITERS = ("arrow", "spark")
DEFAULT_WRITER = {"local": "arrow", "hdfs": "spark", "s3": "arrow"}  # by the numbers: docs/benchmarks.md
#: URL schemes whose default is not their backend's: Spark's writer would reach ``webhdfs://`` with
#: Hadoop's WebHDFS client, which the pyspark wheel cannot run (its shaded Jersey lacks
#: ``RuntimeDelegateImpl``: every call fails "Unexpected HTTP response: code=404 ... GETFILESTATUS").
DEFAULT_WRITER_BY_SCHEME = {"webhdfs": "arrow", "swebhdfs": "arrow"}


def default_writer(url: str) -> str:
    """The writer FileSink uses for ``url`` when none is given: Spark's on ``hdfs://`` (Hadoop's RPC
    client), the sink's Arrow writers on local disk, S3 and ``webhdfs://``/``swebhdfs://``."""
    scheme = scheme_of(url)
    if scheme in DEFAULT_WRITER_BY_SCHEME:
        return DEFAULT_WRITER_BY_SCHEME[scheme]
    spec = backend_for(url)
    return DEFAULT_WRITER.get(spec.name if spec is not None else "", "arrow")


#: The coordinator's scoped query name, ``<name>.<log id, 8 hex>g<generation>``.
_SCOPED_NAME = re.compile(r".*\.([0-9a-f]{8}g\d+)", re.DOTALL)
_PLAIN_SCOPE = re.compile(r"[A-Za-z0-9_]{1,16}")


def name_scope(query_name: str) -> str:
    """The token of ``query_name`` that part names carry: the log identity and generation of a
    coordinator's scoped name (``3f9a2b1cg2``); a short plain name as it is (``q``); else
    the first 8 hex digits of its SHA-1.  Filesystem- and key-safe, without ``-``."""
    m = _SCOPED_NAME.fullmatch(query_name)
    if m:
        return m.group(1)
    if _PLAIN_SCOPE.fullmatch(query_name):
        return query_name
    return hashlib.sha1(query_name.encode("utf-8")).hexdigest()[:8]


class _FileSinkBase(TwoPhaseCommitSink[FileTransaction, dict]):
    """Both sides: the settings of a :class:`~twophase.sinks.files.sink.FileSink` (set by its
    constructor) and the part names and staging paths they give.  FileSink's mixins extend it."""

    url: str
    root: str
    scheme: str
    format: str
    prefix: str
    compression: str | None
    fsync: bool
    storage_options: dict[str, Any]
    partition_by: list[str]
    partition_values: str
    part_size: int
    s3_etags: str
    s3_if_none_match: str
    header: bool
    text: TextOptions
    max_records_per_file: int | None
    writer: str
    _spec: Backend
    _backend: PartFiles

    @property
    def fs(self) -> str:
        """``"local"``, ``"hdfs"`` or ``"s3"``."""
        return self._backend.fs

    # ------------------------------------------------------------------- paths
    def _batch_staging(self, query_name: str, batch_id: int) -> str:
        return self._backend.batch_staging(query_name, batch_id)

    def _ext(self) -> str:
        ext = _EXT[self.format]
        if self.format != "parquet" and self.compression:
            ext += TEXT_CODECS[self.compression]
        return ext

    def _name_prefix(self, batch_id: int) -> str:
        return f"{self.prefix}-{batch_id:08d}-"

    def final_name(self, batch_id: int, partition_id: int, query_name: str | None = None,
                   ballot: str | None = None, file_index: int = 0) -> str:
        """``{prefix}-{batch:08d}-{partition:05d}-{scope}[-{ballot}].{ext}``: the scope token of
        the query name (:func:`name_scope`) keeps two pipelines, or two generations of one, apart
        in one folder or prefix; without a query name, the unscoped name older versions wrote.
        ``ballot`` (S3: the INTENT's token) keeps two executions of one batch apart: their open
        uploads are their staging, and a late cleanup of one must never abort the other's."""
        scope = "" if query_name is None else f"-{name_scope(query_name)}"
        if ballot:
            scope += f"-{ballot}"
        nth = f"-c{file_index:03d}" if file_index else ""  # max_records_per_file: the task's next file
        return f"{self.prefix}-{batch_id:08d}-{partition_id:05d}{nth}{scope}.{self._ext()}"

    def _batch_names(self, batch_id: int, query_name: str, intent: dict[str, Any]) -> re.Pattern[str]:
        """The final names (last key segment) of the files this query's ``batch_id`` may have
        left: its own scope's, and the unscoped names of an INTENT logged before names were
        scoped (no ``scope`` in it), never another pipeline's or generation's."""
        head = re.escape(f"{self.prefix}-{batch_id:08d}-")
        tail = r"\d{5,}(?:-c\d{3,})?"
        ext = re.escape(f".{self._ext()}")
        ballot = f"-{intent['ballot']}" if intent.get("ballot") else ""
        alts = [tail + re.escape(f"-{name_scope(query_name)}{ballot}") + ext]
        if "scope" not in intent:
            alts.append(tail + ext)
        return re.compile(f"{head}(?:{'|'.join(alts)})")

    def _query_names(self, query_name: str) -> re.Pattern[str]:
        """The final names (last key segment) of this query's part files of *any* batch and
        ballot, the batch number in group 1: what a late task attempt of an earlier batch may
        have left.  Only this scope's names: another pipeline's or generation's, and the
        unscoped names of older versions (nobody's to claim), never match."""
        return re.compile(
            re.escape(f"{self.prefix}-") + r"(\d{8,})-\d{5,}(?:-c\d{3,})?"
            + re.escape(f"-{name_scope(query_name)}") + r"(?:-[0-9a-f]+)?" + re.escape(f".{self._ext()}")
        )
