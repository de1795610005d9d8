"""Any fsspec filesystem as a transaction-log store: ``memory://`` in tests, and read-only use
(Spark's checkpoint) of schemes twophase has no backend of its own for."""

from __future__ import annotations

import uuid
from typing import Any

from twophase.storage._base import LogStore


class FsspecStore(LogStore):
    """Any fsspec filesystem whose ``mv`` is an atomic rename and whose ``open(mode='xb')`` is
    exclusive.

    Used for ``memory://`` in tests, and (``exclusive=False``) to read, list and delete in a
    Spark checkpoint on other schemes; the log itself is refused there.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        import fsspec

        self.fs, self.root = fsspec.core.url_to_fs(url, **(storage_options or {}))
        self.url = url
        self.fs.makedirs(self.root, exist_ok=True)

    @classmethod
    def from_url(
        cls, url: str, storage_options: dict[str, Any] | None, exclusive: bool
    ) -> FsspecStore:
        return cls(url, storage_options)

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def read(self, name: str) -> bytes | None:
        try:
            with self.fs.open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def create(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        try:
            with self.fs.open(path, "xb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True

    def replace(self, name: str, data: bytes) -> None:
        path = self._path(name)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        with self.fs.open(tmp, "wb") as f:
            f.write(data)
        self.fs.mv(tmp, path)

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        path = self._path(folder) if folder else self.root
        try:
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return sorted(n for n in names if hidden or not (n.startswith(".") or n.endswith(".tmp")))

    def delete(self, name: str) -> None:
        try:
            self.fs.rm(self._path(name))
        except FileNotFoundError:
            pass
