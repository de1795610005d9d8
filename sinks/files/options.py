"""Driver (where the ``twophase-files`` data source builds its sink): the options of Spark's file
sink as FileSink's arguments, each with Spark's meaning or refused naming why (docs/datasource.md)."""

from __future__ import annotations

from typing import Any

from twophase.errors import ConfigurationError
from twophase.sinks._formats import FORMATS, PARQUET_CODECS, TEXT_CODECS
from twophase.storage import scheme_of

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
