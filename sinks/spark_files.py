"""``format("twophase-files")``: Spark's file sink options as :class:`~twophase.sinks.files.FileSink`'s
configuration (the data source machinery is ``twophase.datasource``; the registry entry is
``twophase.config.BUILTIN_FORMATS``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from twophase.config import SparkFormat, local_location
from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink


def build(options: Mapping[str, str]) -> TwoPhaseCommitSink[Any, Any]:
    from twophase.sinks.files import FileSink, spark_file_options

    path = options.get("path")
    if not path:
        raise ConfigurationError("twophase-files needs a path: .start(path) or .option('path', ...)")
    path = local_location(path)
    args = spark_file_options(path, dict(options))
    cols = [c.strip() for c in str(options.get("twophase.partitionby") or "").split(",") if c.strip()]
    return FileSink(path, prefix=options.get("prefix", "part"), writer="arrow", partition_by=cols or None, **args)


FORMAT = SparkFormat(
    kind="files",
    build=build,
    #: FileSink's ``SPARK_FILE_OPTIONS`` (tests/test_datasource_options.py checks they agree) and
    #: ``prefix``; ``fs.s3a.*`` reaches the sink, which names the S3A settings it takes.
    known_options=frozenset({
        "format", "compression", "header", "prefix", "maxrecordsperfile", "dfs.namenode.http-address",
        "sep", "delimiter", "quote", "escape", "nullvalue", "emptyvalue", "quoteall", "escapequotes",
        "ignoreleadingwhitespace", "ignoretrailingwhitespace", "linesep", "ignorenullfields",
        "dateformat", "timestampformat", "timestampntzformat", "encoding", "charset", "locale",
        "chartoescapequoteescaping", "writenonasciicharacterascodepoint"}),
    passed_prefixes=("fs.s3a.",),
    doc="""``format("twophase-files")``: files in ``path`` (local, ``hdfs://``, ``s3://``), by
    temp-file-rename or multipart upload; ``format`` parquet (default), json or csv, with the
    options of Spark's file sink and its writers (``compression``, the csv and json writer options,
    ``maxRecordsPerFile``, S3A and WebHDFS addresses): each has Spark's meaning or is refused by
    name (``FileSink``'s ``spark_file_options``; the table in docs/datasource.md).""",
)
