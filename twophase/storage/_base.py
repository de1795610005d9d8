"""What every storage backend shares: the transaction log's store interface, a chunking write
stream, and the check that refuses storage options a backend does not understand."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

from twophase.errors import ConfigurationError

#: Option keys (at any depth) that carry credentials: only ``{"env": ...}`` references may be saved
#: (FileSink.to_config, the S3 log store).
SECRET_OPTIONS = {
    "key",
    "secret",
    "token",
    "username",
    "password",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
    "SSECustomerKey",
}


class LogStore(ABC):
    """Byte storage under one root with atomic exclusive create and atomic replace.

    The transaction log's only view of a filesystem.  Implementations live beside the
    storage backend they use (:mod:`twophase.storage.local`, ``.hdfs``, ``.s3``) and are
    picked by URL scheme in :mod:`twophase.storage.registry`.
    """

    url: str

    @classmethod
    def from_url(
        cls, url: str, storage_options: dict[str, Any] | None, exclusive: bool
    ) -> LogStore:
        """Open the store for ``url``.  ``exclusive=False``: the caller only reads, lists and
        deletes (e.g. Spark's checkpoint), so the store need not prove that ``create`` is
        exclusive."""
        return cls(url, storage_options, exclusive)  # type: ignore[call-arg]

    @abstractmethod
    def read(self, name: str) -> bytes | None:
        """The bytes of ``name``, or None if it does not exist."""

    @abstractmethod
    def create(self, name: str, data: bytes) -> bool:
        """Atomically create ``name``; False (and nothing written) if it already exists."""

    @abstractmethod
    def replace(self, name: str, data: bytes) -> None:
        """Atomically set ``name`` to ``data`` (readers see old or new, never a mix)."""

    @abstractmethod
    def list(self, folder: str, hidden: bool = False) -> list[str]:
        """Names of the files directly in ``folder`` ('' = root); [] if it does not exist.

        Names starting with ``.`` (temp files) are left out unless ``hidden``.
        """

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name`` if it exists."""

    def location(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"


class ChunkedWriter:
    """A write-only file object that hands its bytes on in chunks of ``chunk_size`` to :meth:`_emit`
    (a WebHDFS stream, an S3 part upload), so a file is never held in memory whole."""

    chunk_size: int

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0
        self.closed = False

    def _emit(self, data: bytes) -> None:
        raise NotImplementedError

    def write(self, b) -> int:
        n = len(b)
        self._buf += b
        self._pos += n
        if len(self._buf) >= self.chunk_size:
            self._emit(bytes(self._buf))
            self._buf.clear()
        return n

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        pass


def check_options(
    what: str,
    given: Mapping[str, Any] | None,
    accepted: Mapping[str, str],
    refused: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Return ``given`` as a dict, or raise ConfigurationError for a key not in ``accepted``.

    ``accepted`` maps each option to a short meaning (its names are listed in the error);
    ``refused`` maps options users may know from elsewhere (s3fs, fsspec) to why they are not taken
    here.  An option is never silently ignored: a typo or an unsupported setting (say,
    server-side encryption that would not be applied) stops the job before any write.
    """
    so = dict(given or {})
    unknown = sorted(k for k in so if k not in accepted)
    if not unknown:
        return so
    reasons = [f"{k!r}: {refused[k]}" for k in unknown if refused and k in refused]
    plain = [repr(k) for k in unknown if not (refused and k in refused)]
    parts = []
    if plain:
        parts.append(f"unknown storage option{'s' if len(plain) > 1 else ''} {', '.join(plain)}")
    parts += reasons
    listing = ", ".join(accepted) or "none"
    raise ConfigurationError(
        f"{what}: {'; '.join(parts)}. Accepted storage options: {listing} "
        "(docs/files.md, 'Storage options')"
    )
