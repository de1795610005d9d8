"""Exactly-once file sink: part files staged invisibly in the target store, made visible on commit.

One sink, three storage backends chosen by the URL (twophase.storage's registry):
local disk (``/path``, ``file://``) and HDFS (``hdfs://``, ``webhdfs://``, over
WebHDFS) stage files under ``<target>/_twophase/`` and commit by a rename that never
overwrites; S3 (``s3://``) keeps each part file an open multipart upload and commits
with CompleteMultipartUpload.  Part names are deterministic per batch, partition and
query scope (pipeline and generation), so a replay cannot duplicate a file and two
pipelines or generations on one folder never meet.  This module holds the sink alone: options, part
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
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from twophase.config import is_secret_ref
from twophase.context import BatchContext, TransactionContext
from twophase.errors import ConfigurationError, HandleError, TwoPhaseError
from twophase.sink import CommitOutcome, CommitResult, PreparedBatch, TwoPhaseCommitSink
from twophase.sinks._formats import (
    DEFAULT_TEXT,
    FORMATS,
    MIB,
    PARQUET_CODECS,
    TEXT_CODECS,
    TextOptions,
)
from twophase.sinks._formats import EXT as _EXT
from twophase.sinks._formats import FormatWriter as _FormatWriter
from twophase.sinks._partitions import (  # noqa: F401 - the public names stay importable from here
    _ESCAPE,
    HIVE_DEFAULT_PARTITION,
    _split_by_partition,
    escape_partition_value,
    partition_segment,
)
from twophase.storage import backend_for, scheme_of
from twophase.storage._base import SECRET_OPTIONS as _SECRET_OPTIONS
from twophase.storage.parts import (
    STAGING_DIR,  # noqa: F401 - importable from here, as before
    PartFiles,
)
from twophase.storage.parts import safe_name as _safe

if TYPE_CHECKING:
    from twophase.evidence import Settled

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

# ------------------------------------------------------------ Spark's file sink options, by name
#: Spark's ``compression`` values per format -> this sink's codec (None: uncompressed text), or why not.
SPARK_CODECS: dict[str, dict[str, str | None]] = {
    "parquet": {"none": "none", "uncompressed": "none", "snappy": "snappy", "gzip": "gzip", "zstd": "zstd",
                "lz4_raw": "lz4", "brotli": "brotli"},
    "text": {"none": None, "uncompressed": None, "gzip": "gzip", "bzip2": "bz2", "zstd": "zstd"},
}
SPARK_CODECS_REFUSED: dict[str, dict[str, str]] = {
    "parquet": {
        "lz4": "Spark's lz4 is Parquet's deprecated Hadoop-framed LZ4 codec, which pyarrow cannot write; "
               "lz4_raw (Parquet's current LZ4 codec) can",
        "lzo": "pyarrow cannot write LZO (nor can Spark without the LZO codec installed)",
    },
    "text": {
        "lz4": "Spark's lz4 writes Hadoop's block-framed LZ4 (.lz4), which pyarrow cannot write",
        "snappy": "Spark's snappy writes Hadoop's block-framed Snappy (.snappy), which pyarrow cannot write",
        "deflate": "pyarrow has no zlib (.deflate) stream writer; gzip is the same compression in a "
                   "gzip container",
    },
}
#: csv/json writer options of Spark taken with one value only (their default), lower case -> the
#: accepted spellings and why another is refused.
_DEFAULT_ONLY = {
    "dateformat": ({"yyyy-mm-dd"}, "dates are written as Spark's default yyyy-MM-dd"),
    "timestampformat": ({"yyyy-mm-dd't'hh:mm:ss[.sss][xxx]"},
                        "timestamps are written as Spark's default yyyy-MM-dd'T'HH:mm:ss[.SSS][XXX]"),
    "timestampntzformat": ({"yyyy-mm-dd't'hh:mm:ss[.sss]"},
                           "timestamps without zone are written as Spark's default yyyy-MM-dd'T'HH:mm:ss[.SSS]"),
    "encoding": ({"utf-8", "utf8"}, "files are written in UTF-8"),
    "charset": ({"utf-8", "utf8"}, "files are written in UTF-8"),
    "locale": ({"en-us"}, "values are written as Spark's default locale en-US writes them"),
    "chartoescapequoteescaping": ({"\\"}, "inside quotes the escape character is escaped with itself, "
                                  "Spark's default"),
    "writenonasciicharacterascodepoint": ({"false"}, "non-ASCII characters are written as they are"),
}
#: Spark's csv (C) and json (J) writer options this sink honours (lower case) -> TextOptions field.
_TEXT_OPTIONS = {"sep": ("C", "sep"), "delimiter": ("C", "sep"), "quote": ("C", "quote"),
                 "escape": ("C", "escape"), "nullvalue": ("C", "null_value"), "emptyvalue": ("C", "empty_value"),
                 "quoteall": ("C", "quote_all"), "escapequotes": ("C", "escape_quotes"),
                 "ignoreleadingwhitespace": ("C", "ignore_leading"),
                 "ignoretrailingwhitespace": ("C", "ignore_trailing"),
                 "linesep": ("CJ", "line_sep"), "ignorenullfields": ("J", "ignore_null_fields")}
_FORMAT_OF_DEFAULT_ONLY = {"dateformat": "CJ", "timestampformat": "CJ", "timestampntzformat": "CJ",
                           "encoding": "CJ", "charset": "CJ", "locale": "CJ", "chartoescapequoteescaping": "C",
                           "writenonasciicharacterascodepoint": "J"}
#: Spark's S3A (Hadoop) settings, given as options (Spark puts a file sink's options into its
#: Hadoop configuration), -> this sink's S3 storage options.
_S3A = {"fs.s3a.endpoint": "endpoint_url", "fs.s3a.access.key": "key", "fs.s3a.secret.key": "secret",
        "fs.s3a.session.token": "token", "fs.s3a.endpoint.region": "region_name",
        "fs.s3a.path.style.access": None, "fs.s3a.connection.ssl.enabled": None,
        "fs.s3a.aws.credentials.provider": None}
#: Option names (lower case) :func:`spark_file_options` reads.
SPARK_FILE_OPTIONS = frozenset({"format", "compression", "header", "maxrecordsperfile", "dfs.namenode.http-address",
                                *_TEXT_OPTIONS, *_DEFAULT_ONLY, *_S3A})


#: Spark's spelling of the option names (options arrive lower-cased), for messages.
_SPELLING = {n.lower(): n for n in (
    "maxRecordsPerFile", "nullValue", "emptyValue", "quoteAll", "escapeQuotes", "ignoreLeadingWhiteSpace",
    "ignoreTrailingWhiteSpace", "lineSep", "ignoreNullFields", "dateFormat", "timestampFormat",
    "timestampNTZFormat", "charToEscapeQuoteEscaping", "writeNonAsciiCharacterAsCodePoint")}


def _spelt(opt: str) -> str:
    return _SPELLING.get(opt, opt)


def _formats_named(letters: str) -> str:
    return " and ".join({"C": "csv", "J": "json"}[f] for f in letters)


def _flag(name: str, value: Any) -> bool:
    text = str(value).strip().lower()
    if text not in ("true", "false"):
        raise ConfigurationError(f"{name} must be true or false, got {value!r}")
    return text == "true"


def spark_file_options(path: str, options: dict[str, Any], label: str = "twophase-files") -> dict[str, Any]:
    """FileSink's arguments for the options of Spark's file sink (lower-case names, as Spark hands
    them to a data source): each has Spark's meaning or is refused with a line naming it and why.
    Options it does not know are left to the caller."""
    def refuse(why: str) -> ConfigurationError:
        return ConfigurationError(f"{label}: {why}; nothing was written")

    raw_fmt = str(options.get("format", "parquet")).lower()
    fmt = FORMATS.get(raw_fmt)
    if fmt is None:
        raise refuse(f"format {raw_fmt!r} is not written: parquet, json or csv")
    letter = {"parquet": "P", "jsonl": "J", "csv": "C"}[fmt]
    out: dict[str, Any] = {"format": fmt}
    codec = options.get("compression")
    if codec is not None:
        family = "parquet" if fmt == "parquet" else "text"
        name = str(codec).strip().lower()
        if name in SPARK_CODECS_REFUSED[family]:
            raise refuse(f"compression={name} for {raw_fmt}: {SPARK_CODECS_REFUSED[family][name]}")
        if name not in SPARK_CODECS[family] and name not in (PARQUET_CODECS if family == "parquet" else TEXT_CODECS):
            raise refuse(f"compression={name} is not a {raw_fmt} codec; use one of "
                         f"{', '.join(sorted(SPARK_CODECS[family]))}")
        out["compression"] = SPARK_CODECS[family].get(name, name)
    if "header" in options:
        if fmt != "csv":
            raise refuse(f"header is a csv option; format is {raw_fmt}")
        out["header"] = _flag("header", options["header"])
    text: dict[str, Any] = {}
    for opt, (formats, fld) in _TEXT_OPTIONS.items():
        if opt not in options:
            continue
        if letter not in formats:
            raise refuse(f"{_spelt(opt)} is a {_formats_named(formats)} option; format is {raw_fmt}")
        value = options[opt]
        if fld in ("quote_all", "escape_quotes", "ignore_leading", "ignore_trailing", "ignore_null_fields"):
            text[fld] = _flag(_spelt(opt), value)
            continue
        value = str(value)
        if fld in ("sep", "quote", "escape") and len(value) != 1:
            raise refuse(f"{opt}={value!r}: only one character is written here (Spark also takes a longer "
                         "separator or an empty quote, which this writer does not)")
        if fld == "line_sep" and (not value or (fmt == "csv" and len(value) != 1)):
            raise refuse(f"lineSep={value!r}: csv takes one character (as Spark's csv writer), json a non-empty "
                         "string")
        text[fld] = value
    if "sep" in options and "delimiter" in options and options["sep"] != options["delimiter"]:
        raise refuse("sep and delimiter are one option (Spark's two names) and are given two values")
    for opt, (allowed, why) in _DEFAULT_ONLY.items():
        if opt not in options:
            continue
        if letter not in _FORMAT_OF_DEFAULT_ONLY[opt]:
            raise refuse(f"{_spelt(opt)} is a {_formats_named(_FORMAT_OF_DEFAULT_ONLY[opt])} option; format is "
                         f"{raw_fmt}")
        if str(options[opt]).strip().lower() not in allowed:
            raise refuse(f"{_spelt(opt)}={options[opt]!r} is not supported: {why}")
    if text:
        out["text_options"] = text
    if "maxrecordsperfile" in options:
        try:
            limit = int(str(options["maxrecordsperfile"]).strip())
        except ValueError:
            raise refuse(f"maxRecordsPerFile must be an integer, got {options['maxrecordsperfile']!r}") from None
        if limit > 0:  # as in Spark, 0 or less: no limit
            out["max_records_per_file"] = limit
    so: dict[str, Any] = {}
    scheme = scheme_of(path)
    s3a = {k: v for k, v in options.items() if k.startswith("fs.s3a.")}
    if s3a and scheme not in ("s3", "s3a"):
        raise refuse(f"{sorted(s3a)[0]} is an S3A setting, and the path is not on S3 (s3a:// or s3://)")
    for k, v in s3a.items():
        if k not in _S3A:
            raise refuse(f"{k} is not read: the S3A settings taken are {', '.join(sorted(_S3A))}")
        taken = _S3A[k]
        if taken:
            so[taken] = str(v)
    ssl = _flag("fs.s3a.connection.ssl.enabled", s3a.get("fs.s3a.connection.ssl.enabled", "true"))
    if "endpoint_url" in so and "://" not in so["endpoint_url"]:  # Hadoop's form: host[:port]
        so["endpoint_url"] = ("https://" if ssl else "http://") + so["endpoint_url"]
    if "fs.s3a.connection.ssl.enabled" in s3a:
        so["use_ssl"] = ssl
    if _flag("fs.s3a.path.style.access", s3a.get("fs.s3a.path.style.access", "false")):
        so["config_kwargs"] = {"s3": {"addressing_style": "path"}}
    provider = s3a.get("fs.s3a.aws.credentials.provider")
    if provider is not None:
        if str(provider).strip().rsplit(".", 1)[-1] != "AnonymousAWSCredentialsProvider":
            raise refuse("fs.s3a.aws.credentials.provider: only AnonymousAWSCredentialsProvider is taken (no "
                         "credentials); give fs.s3a.access.key and fs.s3a.secret.key, or none for the default "
                         "AWS credential chain")
        so["anon"] = True
    http = options.get("dfs.namenode.http-address")
    if http is not None:
        if scheme != "hdfs":
            raise refuse("dfs.namenode.http-address is the NameNode's WebHDFS address for an hdfs:// path; the "
                         "path is not one")
        http = str(http).strip()
        so["webhdfs_url"] = http if "://" in http else f"http://{http}"
    if so:
        out["storage_options"] = so
    return out


#: The name Spark's file writer gives a part file: part-<task>-<job uuid>[-c<file>]<ext>
_SPARK_PART = re.compile(r"part-(\d+)-.*?(?:-c(\d+))?\.[^-]*$")
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


# --------------------------------------------------------------------- transactions
@dataclass
class _OpenFile:
    """One part file of a transaction, open for writing (executor side)."""

    final: str  # local/HDFS: absolute path; S3: object key
    staging: str | None  # local/HDFS: staged path; S3: None (the open upload is the staging)
    stream: Any
    writer: _FormatWriter
    rows: int = 0


@dataclass
class FileTransaction:
    """One partition's part file(s) of one batch, open in staging (executor side).

    Without ``partition_by`` there is exactly one file; :attr:`staging` and
    :attr:`final` name it.  With ``partition_by`` there is one file per distinct
    partition-value combination seen by this task.
    """

    ctx: TransactionContext
    files: dict[tuple, _OpenFile] = field(default_factory=dict)
    rows: int = 0
    closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def staging(self) -> str | None:
        return next(iter(self.files.values())).staging if self.files else None

    @property
    def final(self) -> str | None:
        return next(iter(self.files.values())).final if self.files else None



# ------------------------------------------------------------------------------ sink
class FileSink(TwoPhaseCommitSink[FileTransaction, dict]):
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

    @property
    def fs(self) -> str:
        """``"local"``, ``"hdfs"`` or ``"s3"``."""
        return self._backend.fs

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

    # ---------------------------------------------------------------- handles
    def _entries(self, handle: dict) -> list[dict[str, Any]]:
        fs = handle.get("fs", "local")
        if fs != self.fs:
            raise HandleError(
                f"handle is for a {fs} FileSink but this sink writes to {self.fs} ({self.url}); "
                "recover with the sink configuration the batch was written with"
            )
        entries = list(handle["files"]) if "files" in handle else [handle]
        for e in entries:
            if not isinstance(e, dict):
                raise HandleError(f"a files handle entry is not an object: {str(e)[:80]!r}")
            self._backend.check_entry(e)
        return entries

    def encode_handle(self, handle: dict) -> dict[str, Any]:
        from twophase import handles as _handles

        version = 1 if "files" not in handle else 2
        return _handles.encode(self.kind, version, self.handle_to_json(handle))

    def handle_from_json(self, data: dict[str, Any], version: int) -> dict:
        if version == 1 and not {"staging", "final", "size"} <= data.keys():
            raise HandleError(f"files handle v1 needs staging, final and size: {sorted(data)}")
        if version == 2 and not isinstance(data.get("files"), list):
            raise HandleError("files handle v2 needs a 'files' list")
        return data

    # ---------------------------------------------------------------- driver
    def commit(self, handle: dict) -> CommitResult:
        """Make every file of the handle visible; idempotent, file by file (driver)."""
        return _combine([self._backend.commit_file(e) for e in self._entries(handle)])

    def recover_and_commit(self, handle: dict) -> CommitResult:
        """After a restart: on S3, a file whose object is already there is not completed again."""
        return _combine([self._backend.recover_file(e) for e in self._entries(handle)])

    def verify_prepared(
        self, batch_id: int, handles: list[dict], *, prepare_started_at: float
    ) -> None:
        """Before the decision: every staged file of the batch is still there with the size its
        handle records (S3: every upload is still open), else TwoPhaseError naming what is
        missing, so that the batch fails undecided and its replay writes it again rather than
        being decided and lost.  One listing per staging folder (S3: one ListMultipartUploads
        per batch), not a request per file."""
        entries = [e for h in handles for e in self._entries(h)]
        if not entries:
            return
        problems = self._backend.verify_files(entries)
        if problems:
            shown = "; ".join(problems[:5])
            if len(problems) > 5:
                shown += f"; and {len(problems) - 5} more"
            raise TwoPhaseError(
                f"batch {batch_id}: not deciding the batch: {len(problems)} of its "
                f"{len(entries)} pre-committed files are no longer staged ({shown}). Something "
                "removed them after the tasks pre-committed them (a cleanup of the staging "
                "folder, a bucket lifecycle rule aborting incomplete multipart uploads, another "
                "pipeline's sweep); the batch fails undecided and its replay writes it again."
            )

    def recover_and_abort(self, handle: dict) -> None:
        for e in self._entries(handle):
            self._backend.abort_entry(e)

    def abort_lingering(
        self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict], *,
        settled: Settled | None = None,
    ) -> int:
        """Abort what attempts of ``batch_id`` left under this INTENT, except ``keep``, and what
        late task attempts left for this query's *other* batches that the log says are finished
        (``settled``: a COMMITTED record, or a pruned range; local/HDFS: their staging folders;
        S3: their open uploads, found by the same one listing): no ballot of such a batch is
        decided again, so what is still staged under its name is nobody's decision to commit.

        Never by batch-id order (docs/design.md, "What may justify a destructive action"): batch
        jobs pick their ids, and a backfill of batch 5 may be staging while a run of batch 11
        cleans up (issue 59).  ``settled=None`` (no log at hand: a user's call, the CLI's
        ``abort-lingering``): only this batch's ballot is cleaned up."""
        kept = [e for h in keep for e in self._entries(h)]
        return self._backend.abort_lingering(
            query_name, batch_id, intent, kept, self._batch_names(batch_id, query_name, intent),
            earlier=self._query_names(query_name), settled=settled,
        )

    def describe_handle(self, handle: dict) -> str:
        try:
            entries = self._entries(handle)
        except (HandleError, KeyError):
            return super().describe_handle(handle)
        if len(entries) == 1 and "files" not in handle:
            e = entries[0]
            return f"file {e.get('final')} (staged {e.get('staging')}, {e.get('size')} bytes)"
        first = self._backend.describe(entries[0]) if entries else "no files"
        return first if len(entries) == 1 else f"{len(entries)} {self.fs} files, first {first}"


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


def _combine(results: list[CommitResult]) -> CommitResult:
    """One outcome for a handle's files: the first not-done outcome, else committed/already."""
    for r in results:
        if not r.done:
            return r
    if all(r.outcome is CommitOutcome.ALREADY_COMMITTED for r in results):
        # keep what each file's decision rested on (e.g. "decided by size only")
        return CommitResult.already_committed("; ".join(r.reason for r in results if r.reason))
    return CommitResult.committed()


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


def __getattr__(name: str) -> Any:
    # The log's HDFS and S3 stores lived here before twophase.storage; old imports keep working.
    if name in ("HdfsLogStore", "S3LogStore"):
        from twophase.storage import hdfs, s3

        return getattr(hdfs if name == "HdfsLogStore" else s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
