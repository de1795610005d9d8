"""S3 through botocore: conditional puts, held multipart uploads, listing, and the probes
that prove what an endpoint honours.

:class:`S3Storage` holds the primitives FileSink uses (an open multipart upload is an
invisible, durable file: "hold", then complete or abort); :class:`S3LogStore` is the
transaction log on S3, only where the endpoint honours ``If-None-Match: *``.  Storage
options follow s3fs.  Needs ``pip install 'twophase[s3]'``.

This module is the S3 backend the registry loads: it holds :class:`S3LogStore` and
re-exports the rest, which lives in :mod:`~twophase.storage.s3_client` (storage
options, the botocore client, errors), :mod:`~twophase.storage.s3_storage` (:class:`S3Storage`,
:class:`S3Upload`, the probes) and :mod:`~twophase.storage.s3_parts` (:class:`S3PartFiles`).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from twophase.errors import ConfigurationError, LogError
from twophase.storage._base import LogStore
from twophase.storage.s3_client import (
    OPERATIONS,
    OPTIONS,
    REFUSED,
    BotoCoreError,
    ClientError,
    check_s3_options,
    s3_client,
    s3_code,
    s3_error,
    s3_status,
)
from twophase.storage.s3_parts import COMPLETE_BACKOFF, COMPLETE_TRIES, S3PartFiles
from twophase.storage.s3_storage import (
    MAX_PART,
    MAX_PARTS,
    MIB,
    MIN_PART,
    PROBE_PREFIX,
    MultipartProbe,
    S3Storage,
    S3Upload,
    multipart_etag,
)

log = logging.getLogger("twophase.storage.s3")


class S3LogStore(LogStore):
    """The transaction log on S3, only where the store honours conditional writes.

    Create is PutObject with ``If-None-Match: *`` (exclusive: 412 if the key exists),
    replace is a plain PutObject (atomic per object; S3 reads are strongly consistent).
    On opening, a probe object is written twice with ``If-None-Match: *``: if the
    second write is not refused, the store ignores the condition and two coordinators
    could both "create" the same decision, so the log is refused.  Storage options as
    for :class:`S3Storage` (``s3_additional_kwargs`` apply to the records too).
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, exclusive: bool = True
    ):
        self.storage = S3Storage(url, storage_options)
        self.url = url
        self.bucket = self.storage.bucket
        self.root = self.storage.root
        self.client = self.storage.client
        if exclusive:
            self._probe()

    def _key(self, name: str) -> str:
        return f"{self.root}/{name}" if self.root else name

    def _probe(self) -> None:
        try:
            honoured = self.storage.honours_conditional_put(self._key(f".probe-{uuid.uuid4().hex}"))
        except ClientError as e:
            raise LogError(
                f"cannot write the transaction log at {self.url}: {s3_error(e)}"
            ) from None
        if not honoured:
            raise ConfigurationError(
                f"the transaction log cannot live at {self.url}: this S3 endpoint does not honour "
                "conditional writes (PutObject with If-None-Match: *), so creating a log record is "
                "not exclusive and two coordinators could both decide a batch. Use a store with "
                "conditional writes (AWS S3 has them), or put the log on local disk or HDFS "
                "(log_location=...) and keep the data on S3."
            )

    def read(self, name: str) -> bytes | None:
        return self.storage.get(self._key(name))

    def create(self, name: str, data: bytes) -> bool:
        return self.storage.put_if_absent(self._key(name), data)

    def replace(self, name: str, data: bytes) -> None:
        self.storage.put(self._key(name), data)

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        prefix = self._key(folder).rstrip("/") + "/" if (folder or self.root) else ""
        names = self.storage.list_names(prefix)
        return sorted(n for n in names if n and (hidden or not n.startswith(".")))

    def delete(self, name: str) -> None:
        self.storage.delete(self._key(name))


__all__ = [
    "COMPLETE_BACKOFF",
    "COMPLETE_TRIES",
    "MAX_PART",
    "MAX_PARTS",
    "MIB",
    "MIN_PART",
    "OPERATIONS",
    "OPTIONS",
    "PROBE_PREFIX",
    "REFUSED",
    "BotoCoreError",
    "ClientError",
    "MultipartProbe",
    "S3LogStore",
    "S3PartFiles",
    "S3Storage",
    "S3Upload",
    "check_s3_options",
    "log",
    "multipart_etag",
    "s3_client",
    "s3_code",
    "s3_error",
    "s3_status",
]
