"""Driver: :class:`FileSink`, the class users construct: its options (checked here), its target
and config, ``open()``'s checks of the target, and the plan of a batch's INTENT.  It is assembled
from mixins, each in the file named by where it runs: ``writer.py`` (executor tasks),
``spark_writer.py`` and ``committer.py`` (driver), on ``base.py`` (both)."""

from __future__ import annotations

import re
import uuid
from dataclasses import asdict
from typing import Any

from twophase.config import is_secret_ref
from twophase.errors import ConfigurationError
from twophase.sinks._formats import (
    DEFAULT_TEXT,
    FORMATS,
    PARQUET_CODECS,
    TEXT_CODECS,
    TextOptions,
)
from twophase.sinks._partitions import _ESCAPE
from twophase.sinks.files.base import (
    DEFAULT_PART_SIZE,
    S3_MAX_PART,
    S3_MIN_PART,
    WRITERS,
    default_writer,
    name_scope,
)
from twophase.sinks.files.committer import _Committer
from twophase.sinks.files.options import spark_file_options
from twophase.sinks.files.spark_writer import (
    _SPARK_PARQUET_CODECS,
    _SPARK_TEXT_CODECS,
    _SparkWriter,
)
from twophase.sinks.files.writer import _Writer
from twophase.storage import backend_for, scheme_of
from twophase.storage._base import SECRET_OPTIONS as _SECRET_OPTIONS
from twophase.storage.parts import PartFiles
from twophase.storage.parts import safe_name as _safe


# ------------------------------------------------------------------------------ sink
class FileSink(_Committer, _Writer, _SparkWriter):
    """Write each batch as part files under ``url`` (a directory or S3 prefix), exactly once.

    ``url``: a local path or ``file://``; ``hdfs://namenode:8020/path`` or
    ``webhdfs://namenode:9870/path`` (storage options ``webhdfs_url``, ``webhdfs_port``,
    ``user``, ``timeout``; an ``hdfs://`` URL reaches WebHDFS on port 9870 unless
    ``webhdfs_url`` says otherwise); ``s3://bucket/prefix`` (storage options with s3fs's
    names: ``key``, ``secret``, ``token`` (best as ``{"env": "VAR"}``), ``anon``,
    ``endpoint_url``, ``region_name``, ``profile``, ``use_ssl``, ``requester_pays``,
    ``client_kwargs``, ``config_kwargs``, ``s3_additional_kwargs`` such as
    ``{"ServerSideEncryption": "aws:kms"}``).  An option a backend does not take is refused.

    ``format``: ``parquet`` (default), ``jsonl`` or ``csv`` (both as Spark's JSON and CSV
    writers write them with their defaults; ``header=True`` starts each csv file with the column
    names, as Spark's ``header`` option does).  ``compression``: the
    Parquet codec (``snappy`` default, ``zstd``, ``gzip``, ``lz4``, ``brotli``, ``none``)
    or, for jsonl/csv, a whole-file codec (``gzip``, ``bz2``, ``zstd``) that adds
    ``.gz``/``.bz2``/``.zst``.  ``prefix`` starts every part name:
    ``{prefix}-{batch:08d}-{partition:05d}-{scope}.{ext}``, where ``scope`` names the pipeline
    (its log) and generation, so that they never share a file name.  ``fsync`` (local disk, default
    on) makes a pre-committed part survive a machine crash, not only a process crash.

    ``text_options``: the csv and json writer options of Spark this sink honours, as a
    :class:`~twophase.sinks._formats.TextOptions` or a dict of its fields (``sep``, ``quote``,
    ``escape``, ``null_value``, ``empty_value``, ``quote_all``, ``escape_quotes``,
    ``ignore_leading``, ``ignore_trailing``, ``line_sep``, ``ignore_null_fields``), written as
    Spark's writers write them.  ``max_records_per_file``: at most this many rows per file; a
    task's further rows go into its next file (``...-c001-...``), as Spark's ``maxRecordsPerFile``;
    all files of a task commit together.  The by-name format ``twophase-files`` reads both from
    Spark's option names (:func:`spark_file_options`; docs/datasource.md).

    ``partition_by``: Hive-style output ``col=value/...`` (partition columns are not
    written into the files).  ``partition_values``: ``"escape"`` (default; Hive/Spark
    ``%XX`` escaping, read back unchanged by Spark) or ``"reject"`` (a value that needs
    escaping, or ``.``/``..``, fails the task with an error naming it).

    S3 only: ``part_size``, bytes per uploaded part, at least 5 MiB (each open part file
    holds one part in memory).  ``s3_etags``: ``"md5"`` (default) recognises an object as
    this sink's after a crash by its multipart ETag, and ``open()`` refuses an endpoint
    whose ETags do not follow that rule; ``"opaque"`` decides by size once the upload is
    gone.  ``s3_if_none_match``: ``"require"`` (default) refuses at ``open()`` an endpoint
    that ignores ``If-None-Match`` on completion; ``"head-check"`` accepts it and checks the
    key with HEAD before each completion (an object written in between is overwritten).

    ``writer``: ``"spark"`` (default on ``hdfs://``; local disk too) writes each batch with one
    ``df.write`` into the batch's staging folder from the driver (:meth:`prepare_batch`;
    Spark's output committer settles task retries), then commits by rename as usual;
    ``"arrow"`` (default on local disk, S3 and ``webhdfs://``, which Spark's Hadoop client in
    the pyspark wheel cannot write) writes in per-task transactions with the sink's Arrow
    writers.  docs/files.md, "writer".
    """

    kind = "files"
    #: Spark's file sink options as this sink's arguments (the data source ``twophase-files``).
    spark_file_options = staticmethod(spark_file_options)
    #: v1: local single file ``{"staging","final","size","rows"}`` (still written for that case);
    #: v2: ``{"fs": "local"|"hdfs"|"s3", "rows", "files": [...]}``.
    handle_version = 2
    handle_versions = frozenset({1, 2})

    def __init__(
        self,
        url: str,
        format: str = "parquet",
        *,
        prefix: str = "part",
        compression: str | None = None,
        fsync: bool = True,
        storage_options: dict[str, Any] | None = None,
        partition_by: list[str] | None = None,
        partition_values: str = "escape",
        part_size: int = DEFAULT_PART_SIZE,
        s3_etags: str = "md5",
        s3_if_none_match: str = "require",
        header: bool = False,
        writer: str | None = None,
        text_options: TextOptions | dict[str, Any] | None = None,
        max_records_per_file: int | None = None,
    ):
        if format not in FORMATS:
            raise ConfigurationError(f"unknown format {format!r}; use one of parquet, jsonl, csv")
        if not prefix or _safe(prefix) != prefix or prefix.startswith(("_", ".")):
            raise ConfigurationError(
                f"prefix {prefix!r} must be letters, digits, '-', '_' or '.', "
                "and not start with '_' or '.' (readers would ignore the files)"
            )
        fmt = FORMATS[format]
        if compression is not None:
            compression = compression.lower()
            allowed = PARQUET_CODECS if fmt == "parquet" else set(TEXT_CODECS)
            if compression not in allowed:
                raise ConfigurationError(
                    f"compression {compression!r} is not available for {fmt}; use one of "
                    f"{', '.join(sorted(allowed))}"
                )
        if header and fmt != "csv":
            raise ConfigurationError(f"header=True is a csv option; format is {fmt}")
        text = TextOptions(**text_options) if isinstance(text_options, dict) else (text_options or DEFAULT_TEXT)
        if text != DEFAULT_TEXT and fmt == "parquet":
            raise ConfigurationError("text_options are csv and json options; format is parquet")
        if max_records_per_file is not None and (not isinstance(max_records_per_file, int)
                                                 or max_records_per_file < 1):
            raise ConfigurationError(f"max_records_per_file must be a positive integer or None, got "
                                     f"{max_records_per_file!r}")
        if partition_values not in ("escape", "reject"):
            raise ConfigurationError(
                "partition_values must be 'escape' (Hive-style %XX) or 'reject'"
            )
        cols = list(partition_by or [])
        for c in cols:
            if (
                not isinstance(c, str)
                or not c
                or _ESCAPE.intersection(c)
                or c in (".", "..")
                or c.startswith(("_", "."))
            ):
                raise ConfigurationError(
                    f"partition_by column {c!r} cannot name a directory: use a plain "
                    "column name without '/', '=', '%', control characters or a leading "
                    "'_'/'.'"
                )
        if len(set(cols)) != len(cols):
            raise ConfigurationError(f"partition_by lists a column twice: {cols}")
        if not isinstance(part_size, int) or not S3_MIN_PART <= part_size <= S3_MAX_PART:
            raise ConfigurationError(
                f"part_size must be between 5 MiB and 5 GiB (S3 limits), got {part_size!r}"
            )
        if s3_etags not in ("md5", "opaque"):
            raise ConfigurationError(
                f"s3_etags must be 'md5' (the default: an object is recognised as this "
                f"sink's by its multipart ETag) or 'opaque' (by size, for stores whose "
                f"ETags are not MD5-based), got {s3_etags!r}"
            )
        if s3_if_none_match not in ("require", "head-check"):
            raise ConfigurationError(
                f"s3_if_none_match must be 'require' (the default) or 'head-check', got "
                f"{s3_if_none_match!r}"
            )
        so = dict(storage_options or {})
        self.scheme = scheme_of(url)
        spec = backend_for(url)
        if spec is None or spec.files is None:
            raise ConfigurationError(
                f"FileSink does not support {self.scheme}:// (local paths, file://, hdfs://, "
                "webhdfs://, s3://)"
            )
        self._spec = spec
        if writer is not None and writer not in WRITERS:
            raise ConfigurationError(f"writer must be 'arrow' or 'spark', got {writer!r}")
        self._backend: PartFiles = spec.load(spec.files).from_url(
            url,
            so,
            fsync=fsync,
            part_size=part_size,
            etags=s3_etags,
            if_none_match=s3_if_none_match,
        )
        self.url = url
        self.root = self._backend.root
        self.format = fmt
        self.prefix = prefix
        self.compression = compression
        self.fsync = fsync
        self.storage_options = so
        self.partition_by = cols
        self.partition_values = partition_values
        self.part_size = part_size
        self.s3_etags = s3_etags
        self.s3_if_none_match = s3_if_none_match
        self.header = bool(header)
        self.text = text
        self.max_records_per_file = max_records_per_file
        self.writer = writer or default_writer(url)
        if self.writer == "spark":
            if not self._backend.spark_writer:
                raise ConfigurationError(
                    f"writer='spark' writes local paths and HDFS only, not {self.scheme}:// "
                    "(S3: the default writer='arrow', multipart uploads completed on commit)"
                )
            codecs = _SPARK_PARQUET_CODECS if fmt == "parquet" else _SPARK_TEXT_CODECS
            if codecs.get(compression) is None and compression is not None:
                raise ConfigurationError(
                    f"writer='spark' cannot write {fmt} with compression {compression!r} (Spark "
                    "has no codec for it without native Hadoop libraries); use writer='arrow'"
                )
        # Per instance: with writer="spark" the batch is one Spark job whose output committer lets one
        # attempt of each task commit its files, so speculative attempts cannot both become visible;
        # the Arrow writers' per-task transactions cannot tell two attempts apart.
        self.supports_speculation = self.writer == "spark"

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"FileSink({self.url!r}, format={self.format!r})"

    def target(self) -> str:
        """What this sink writes: the folder, and the settings that make its files another data set
        there (prefix, format, partition columns); not how it reaches them (credentials, hosts,
        compression, fsync).  A batch job is its name and this target (:func:`twophase.log.batch_query_id`):
        with the folder alone, a second job of one name and log writing another prefix, format or
        partitioning into it was the first job to the log, and its batch 0 was "skipped" (issue 59,
        scenario 4).  The default settings add nothing, so a job bound by an older version with the
        folder-only target keeps its log.  A job with other settings whose log an older version bound
        is refused, naming both targets: that log cannot tell it from a job with the default settings
        bound by this version (the same folder-only target), so it is never taken over
        (PostgresSink's :func:`twophase.log.remember_former_target` has no such twin)."""
        url = re.sub(r"://[^/@]*@", "://", self.url)  # no user:password@ of a URL
        url = url[len("file://"):] if url.startswith("file://") else url
        what = []
        if self.prefix != "part":
            what.append(f"prefix={self.prefix}")
        if self.format != "parquet":
            what.append(f"format={self.format}")
        if self.partition_by:
            what.append("partitionBy=" + "/".join(self.partition_by))  # the folders, in order
        return "files " + (url.rstrip("/") or "/") + (f" ({' '.join(what)})" if what else "")

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """The config for ``twophase recover``; credentials only as ``{"env": ...}`` references.

        Raises ConfigurationError if a credential was given by value: write it as
        ``{"env": "VAR"}`` (or rely on the default AWS credential chain).
        """
        cfg: dict[str, Any] = {
            "sink": self.kind,
            "url": self.url,
            "format": self.format,
            "prefix": self.prefix,
            "compression": self.compression,
            "fsync": self.fsync,
        }
        if self.partition_by:
            cfg["partition_by"] = list(self.partition_by)
            cfg["partition_values"] = self.partition_values
        if self.part_size != DEFAULT_PART_SIZE:
            cfg["part_size"] = self.part_size
        if self.s3_etags != "md5":
            cfg["s3_etags"] = self.s3_etags
        if self.s3_if_none_match != "require":
            cfg["s3_if_none_match"] = self.s3_if_none_match
        if self.header:
            cfg["header"] = True
        if self.text != DEFAULT_TEXT:
            cfg["text_options"] = {k: v for k, v in asdict(self.text).items() if getattr(DEFAULT_TEXT, k) != v}
        if self.max_records_per_file is not None:
            cfg["max_records_per_file"] = self.max_records_per_file
        if self.writer != default_writer(self.url):
            cfg["writer"] = self.writer
        if self.storage_options:
            cfg["storage_options"] = _config_options(self.storage_options)
        return cfg

    # ---------------------------------------------------------------- driver
    def open(self) -> None:
        """Check, before anything is decided, that the target can take this sink's commits
        (driver): local disk, writable and able to publish a staged file without overwriting (a
        hard link, else a no-replace rename; a probe file); S3, the probe upload of
        docs/files.md ("S3: what is checked at open()"); HDFS, reachable and writable.  And that
        the folder is no output of Spark's streaming file sink: its readers list only the files
        its ``_spark_metadata`` log names, so this sink's files would be invisible to them."""
        try:  # before check(), which leaves a probe's folder behind on local disk
            spark_log = self._backend.spark_metadata()
        except Exception:  # noqa: BLE001 - unreachable, no bucket...: check() says it clearly
            self._backend.check()
            raise
        if spark_log:
            raise ConfigurationError(
                f"FileSink target {re.sub(r'://[^/@]*@', '://', self.url)}: it holds _spark_metadata, the log of Spark's streaming file "
                "sink, and Spark's readers of this folder list only the files that log names: the files "
                "this sink writes would be invisible to spark.read. Write to a new folder (readers of the "
                "old one keep its files), or, if nothing reads it through that log any more, remove "
                "_spark_metadata (Spark then lists the folder, and sees both). Nothing was written.")
        self._backend.check()

    def open_for_commit(self) -> None:
        """Nothing: :meth:`open`'s checks (on S3 a probe upload) leave no state that commits use,
        and an equal sink's open() passed them for this configuration."""

    def executor_modules(self) -> list[str]:
        return ["pyarrow", *self._spec.packages]

    def local_paths(self) -> list[str]:
        return [self.root] if self.fs == "local" else []

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT: where this execution (ballot) of the batch stages its files (driver).

        A token drawn per INTENT names the staging folder (local, HDFS) or goes into the upload
        keys (S3), so that aborting a closed ballot's leftovers, however late, never touches a
        later ballot of the same batch.
        """
        token = uuid.uuid4().hex[:6]
        if self.fs == "s3":
            b = self._backend
            return {
                "fs": "s3",
                "bucket": b.storage.bucket,
                "prefix": b.storage.prefix,
                "names": self._name_prefix(batch_id),
                "scope": name_scope(query_name),
                "ballot": token,
            }
        intent = {"staging": f"{self._batch_staging(query_name, batch_id)}.{token}"}
        if self.fs != "local":
            intent["fs"] = self.fs
        return intent


def _config_options(so: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in so.items():
        if k in _SECRET_OPTIONS and v is not None and not is_secret_ref(v):
            raise ConfigurationError(
                f"storage option {k!r} is given by value; the sink config is written to disk and "
                f'shown by tools, so give it as {{"env": "VARIABLE"}} (or leave it out and use the default '
                "credential chain) to make this sink rebuildable for 'twophase recover'"
            )
        out[k] = _config_options(v) if isinstance(v, dict) and not is_secret_ref(v) else v
    return out
