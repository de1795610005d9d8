"""The one table of storage backends by URL scheme, and the log's store for a URL.

Like fsspec's ``known_implementations``: each scheme names a module and class paths,
the packages the backend needs and the extra that installs them; nothing is imported
until a URL of that scheme is opened.  The transaction log (:func:`open_store`),
FileSink (:func:`backend_for`, then ``Backend.files``) and the ``twophase`` command (through the log) all
choose their backend here.  Third-party backends plug in through the entry-point
group ``twophase.storage`` (name = scheme, value = ``module:LogStoreClass``) or
:func:`register_store`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from twophase._deps import install_hint, require
from twophase.errors import ConfigurationError
from twophase.storage._base import LogStore


@dataclass(frozen=True)
class Backend:
    """One storage backend: where its code lives and what it needs to import."""

    name: str
    """``"local"``, ``"hdfs"``, ``"s3"`` or ``"fsspec"``; FileSink's handles carry it as ``fs``."""
    module: str
    storage: str | None
    """Class of the storage primitives FileSink uses (None: the log only)."""
    log_store: str | None
    """Class of the transaction log's :class:`LogStore` (None: no atomic exclusive create)."""
    packages: tuple[str, ...] = ()
    extra: str | None = None
    """The pyproject extra that installs ``packages``."""
    what: str = ""
    files: str | None = None
    """Class of FileSink's part files on this backend (a :class:`~twophase.storage.parts.PartFiles`;
    None: FileSink cannot write there)."""

    @property
    def install_hint(self) -> str:
        return install_hint(self.packages[0], self.extra) if self.packages else ""

    def load(self, attr: str) -> Any:
        """Import the backend's module (after checking its packages) and return ``attr``."""
        for pkg in self.packages:
            require(pkg, f"{self.what or self.name} storage", extra=self.extra)
        return getattr(importlib.import_module(self.module), attr)


_LOCAL = Backend(
    "local",
    "twophase.storage.local",
    "LocalStorage",
    "LocalStore",
    what="local disk",
    files="LocalPartFiles",
)
_HDFS = Backend(
    "hdfs",
    "twophase.storage.hdfs",
    "HdfsStorage",
    "HdfsLogStore",
    ("hdfs", "requests"),
    "hdfs",
    what="HDFS (hdfs://, webhdfs://)",
    files="HdfsPartFiles",
)
_S3 = Backend(
    "s3",
    "twophase.storage.s3",
    "S3Storage",
    "S3LogStore",
    ("botocore",),
    "s3",
    what="S3 (s3://)",
    files="S3PartFiles",
)
_FSSPEC = Backend(
    "fsspec", "twophase.storage.fsspec_store", None, "FsspecStore", ("fsspec",), what="fsspec"
)

#: URL scheme -> backend.  A path without a scheme is ``file``.
BACKENDS: dict[str, Backend] = {
    "file": _LOCAL,
    "hdfs": _HDFS,
    "webhdfs": _HDFS,
    "swebhdfs": _HDFS,
    "s3": _S3,
    "s3a": _S3,
    "memory": _FSSPEC,  # tests: fsspec's in-memory filesystem, whose ``open('xb')`` is exclusive
}

#: Schemes fsspec can read but where twophase has no atomic exclusive create: the log refuses
#: them, and a Spark checkpoint there is only read (through fsspec).
NO_EXCLUSIVE_CREATE = {
    "gs": "Google Cloud Storage",
    "gcs": "Google Cloud Storage",
    "abfs": "Azure Data Lake",
    "abfss": "Azure Data Lake",
    "az": "Azure Blob Storage",
}

_FACTORIES: dict[str, Callable[..., LogStore]] = {}


def scheme_of(url: str) -> str:
    """The URL's scheme, lower-case; ``file`` for a plain path."""
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def backend_for(url: str) -> Backend | None:
    """The built-in backend for ``url``'s scheme, or None."""
    return BACKENDS.get(scheme_of(url))


def register_store(scheme: str, factory: Callable[..., LogStore]) -> None:
    """Register a :class:`LogStore` factory ``(url, storage_options, exclusive) -> LogStore``
    for a URL scheme.

    It takes precedence over the built-in table.  ``exclusive=False`` opens a location only
    to read, list and delete (Spark's checkpoint), so the store need not prove that its
    ``create`` is exclusive.
    """
    _FACTORIES[scheme.lower()] = factory


def _plugin(scheme: str) -> Callable[..., LogStore] | None:
    for ep in entry_points(group="twophase.storage"):
        if ep.name == scheme:
            cls = ep.load()
            return getattr(cls, "from_url", cls)
    return None


def open_store(
    url: str, storage_options: dict[str, Any] | None = None, exclusive: bool = True
) -> LogStore:
    """The transaction log's store for ``url``, chosen by scheme from :data:`BACKENDS`.

    ``exclusive=False``: the caller will not ``create`` records (see :func:`register_store`);
    then any filesystem fsspec knows will do.
    """
    scheme = scheme_of(url)
    factory = _FACTORIES.get(scheme)
    if factory is not None:
        return factory(url, storage_options, exclusive)
    b = BACKENDS.get(scheme)
    if b is not None and b.log_store:
        return b.load(b.log_store).from_url(url, storage_options, exclusive)
    plugin = _plugin(scheme)
    if plugin is not None:
        return plugin(url, storage_options, exclusive)
    if not exclusive:  # reading Spark's checkpoint elsewhere: any fsspec filesystem will do
        assert _FSSPEC.log_store is not None
        return _FSSPEC.load(_FSSPEC.log_store).from_url(url, storage_options, exclusive)
    if scheme in NO_EXCLUSIVE_CREATE:
        raise ConfigurationError(
            f"the transaction log cannot live on {scheme}:// ({NO_EXCLUSIVE_CREATE[scheme]}): "
            "twophase has no store with atomic exclusive create for it, so two writers could both "
            "believe they decided a batch. Put the log on local disk, HDFS or S3 with conditional "
            "writes (log_location=...)."
        )
    known = ", ".join(sorted(BACKENDS))
    raise ConfigurationError(
        f"no transaction-log store for URL scheme {scheme!r} ({url}); "
        f"known schemes: {known} (and plain paths)"
    )
