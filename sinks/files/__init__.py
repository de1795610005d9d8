"""Exactly-once file sink: part files staged invisibly in the target store, made visible on commit.

One sink, three storage backends chosen by the URL (twophase.storage's registry):
local disk (``/path``, ``file://``) and HDFS (``hdfs://``, ``webhdfs://``, over
WebHDFS) stage files under ``<target>/_twophase/`` and commit by a rename that never
overwrites; S3 (``s3://``) keeps each part file an open multipart upload and commits
with CompleteMultipartUpload.  Part names are deterministic per batch, partition and
query scope (pipeline and generation), so a replay cannot duplicate a file and two
pipelines or generations on one folder never meet.  This package holds the sink alone: options, part
names, the executor-side transaction, handles and their commit.  How each backend
stages, commits and recovers one part file is its ``PartFiles`` in twophase.storage
(picked by the registry), and the formats are in ``_formats``.  User docs: docs/files.md.

Delivery guarantee: with the coordinator, every row of a batch appears in exactly
one committed part file, once, after any number of driver crashes.

How it recovers: a staged file (or open upload) is the pre-committed transaction;
its handle is in the log.  Commit is idempotent: "staged file gone and target
present with the expected size" (S3: "object present with the expected ETag or
size") is already committed.  Staged files and uploads of attempts that never
reached the log are deleted/aborted by ``abort_lingering``.

Its files, by where their code runs: ``sink.py`` (driver: :class:`FileSink`, its options, ``open()``,
the INTENT's plan), ``writer.py`` and ``transaction.py`` (executor tasks: the part files of a
transaction and their formats), ``spark_writer.py`` (driver: ``writer="spark"``, one ``df.write`` per
batch), ``committer.py`` (driver: handles, commit, verdicts, the sweeps of staging), ``options.py``
(driver: Spark's file sink options as FileSink's), ``base.py`` (both: constants, part names and
staging paths).  This module re-exports the names importable from ``twophase.sinks.files`` before.
"""

from __future__ import annotations

from typing import Any

from twophase.sinks._formats import (  # the format names and options, importable from here as before
    DEFAULT_TEXT,
    FORMATS,
    MIB,
    PARQUET_CODECS,
    TEXT_CODECS,
    TextOptions,
)
from twophase.sinks._formats import FormatWriter as _FormatWriter  # noqa: F401 - importable from here, as before
from twophase.sinks._partitions import (  # noqa: F401 - the public names stay importable from here
    _ESCAPE,
    HIVE_DEFAULT_PARTITION,
    _split_by_partition,
    escape_partition_value,
    partition_segment,
)
from twophase.sinks.files.base import (
    DEFAULT_PART_SIZE,
    DEFAULT_WRITER,
    DEFAULT_WRITER_BY_SCHEME,
    S3_MAX_PART,
    S3_MIN_PART,
    WRITERS,
    default_writer,
    log,
    name_scope,
)
from twophase.sinks.files.options import (
    SPARK_CODECS,
    SPARK_CODECS_REFUSED,
    SPARK_FILE_OPTIONS,
    spark_file_options,
)
from twophase.sinks.files.sink import FileSink
from twophase.sinks.files.spark_writer import parquet_footer_rows
from twophase.sinks.files.transaction import FileTransaction
from twophase.storage.parts import STAGING_DIR, PartFiles

__all__ = [
    "DEFAULT_TEXT",
    "FORMATS",
    "MIB",
    "PARQUET_CODECS",
    "PartFiles",
    "TEXT_CODECS",
    "TextOptions",
    "DEFAULT_PART_SIZE",
    "DEFAULT_WRITER",
    "DEFAULT_WRITER_BY_SCHEME",
    "HIVE_DEFAULT_PARTITION",
    "S3_MAX_PART",
    "S3_MIN_PART",
    "SPARK_CODECS",
    "SPARK_CODECS_REFUSED",
    "SPARK_FILE_OPTIONS",
    "STAGING_DIR",
    "WRITERS",
    "FileSink",
    "FileTransaction",
    "default_writer",
    "escape_partition_value",
    "log",
    "name_scope",
    "parquet_footer_rows",
    "partition_segment",
    "spark_file_options",
]


def __getattr__(name: str) -> Any:
    # The log's HDFS and S3 stores lived here before twophase.storage; old imports keep working.
    if name in ("HdfsLogStore", "S3LogStore"):
        from twophase.storage import hdfs, s3

        return getattr(hdfs if name == "HdfsLogStore" else s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
