"""Local (or POSIX-mounted) directories: exclusive create, a link that never overwrites, fsync.

:class:`LocalStorage` holds the primitives FileSink stages and commits with;
:class:`LocalStore` is the transaction log on local disk.  Both make a file durable
the same way: write, fsync the file, link or rename it into place, fsync the directory.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import uuid
from typing import Any, BinaryIO

from twophase.errors import ConfigurationError, LogError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.storage._base import LogStore
from twophase.storage.parts import STAGING_DIR, StagedPartFiles


def local_root(url: str) -> str:
    """The absolute directory of a plain path or a ``file://`` URL."""
    return os.path.abspath(url.split("://", 1)[1] if "://" in url else url)


def write_all(fd: int, data: bytes) -> None:
    """``os.write`` until every byte is written (it may write fewer, e.g. on a nearly full disk)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno.ENOSPC, "no byte written")
        view = view[n:]


def fsync_dir(folder: str) -> None:
    """Make the directory entries in ``folder`` (a new link, a rename) durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quiet(path: str) -> None:
    """Remove ``path``; a missing file is fine (deletes are replayed after crashes)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class LocalStorage:
    """One local directory tree, as FileSink uses it (paths are absolute OS paths)."""

    name = "local"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None, fsync: bool = True):
        if storage_options:
            raise ConfigurationError(
                f"local path {url} takes no storage options (got "
                f"{', '.join(sorted(map(repr, storage_options)))}); they are for remote "
                "URLs (hdfs://, s3://)"
            )
        self.root = local_root(url)
        self.fsync = fsync

    @staticmethod
    def join(*parts: str) -> str:
        return os.path.join(*parts)

    @staticmethod
    def normpath(path: str) -> str:
        return os.path.normpath(path)

    def ensure_writable(self, folder: str) -> None:
        """Create ``folder`` (and parents); ConfigurationError if the root is not writable."""
        try:
            os.makedirs(folder, exist_ok=True)
        except OSError as e:
            raise ConfigurationError(
                f"FileSink cannot write to {self.root}: {e.strerror}"
            ) from None
        if not os.access(self.root, os.W_OK):
            raise ConfigurationError(f"FileSink cannot write to {self.root}: permission denied")

    def create(self, path: str) -> BinaryIO:
        """Exclusive create: a new file open for writing; FileExistsError if ``path`` exists."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        return open(path, "xb")

    def close_durably(self, f: BinaryIO, path: str) -> int:
        """Flush and close a file from :meth:`create`, fsync'd with its directory when ``fsync``;
        returns its size."""
        f.flush()
        if self.fsync:
            os.fsync(f.fileno())
        f.close()
        if self.fsync:
            fsync_dir(os.path.dirname(path))
        return os.path.getsize(path)

    def link_no_overwrite(self, src: str, dst: str) -> bool:
        """Hard-link ``src`` to ``dst`` (parents created); False if ``dst`` exists, which is never
        replaced.  The link is durable (directory fsync) when it returns True."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            os.link(src, dst)  # EEXIST instead of overwriting
        except FileExistsError:
            return False
        if self.fsync:
            fsync_dir(os.path.dirname(dst))
        return True

    def sync_dir(self, path: str) -> None:
        """fsync the directory holding ``path`` (when ``fsync``)."""
        if self.fsync:
            fsync_dir(os.path.dirname(path))

    @staticmethod
    def exists(path: str) -> bool:
        return os.path.exists(path)

    @staticmethod
    def size(path: str) -> int | None:
        try:
            return os.path.getsize(path)
        except FileNotFoundError:
            return None

    @staticmethod
    def same_file(a: str, b: str) -> bool:
        return os.path.samefile(a, b)

    @staticmethod
    def delete(path: str) -> None:
        unlink_quiet(path)

    @staticmethod
    def list(folder: str) -> list[str] | None:
        """Names in ``folder``; None if it does not exist."""
        try:
            return sorted(os.listdir(folder))
        except FileNotFoundError:
            return None

    @staticmethod
    def sizes(folder: str) -> dict[str, int] | None:
        """The size of every file directly in ``folder`` by name; None if it does not exist."""
        try:
            with os.scandir(folder) as it:
                return {e.name: e.stat().st_size for e in it if e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return None

    @staticmethod
    def hadoop_url(path: str) -> str:
        """``path`` as Spark (Hadoop) names it."""
        return "file://" + path

    @staticmethod
    def list_files(folder: str) -> builtins.list[tuple[str, int]]:
        """(path, size) of every file under ``folder``, at any depth, leaving out names (of files
        and folders) that start with ``_`` or ``.`` (Spark's ``_SUCCESS``, checksum files)."""
        out = []
        for d, dirs, files in os.walk(folder):
            dirs[:] = sorted(x for x in dirs if not x.startswith(("_", ".")))
            for name in sorted(files):
                if not name.startswith(("_", ".")):
                    path = os.path.join(d, name)
                    out.append((path, os.path.getsize(path)))
        return out

    @staticmethod
    def read_tail(path: str, size: int, n: int) -> bytes:
        """The last ``n`` bytes of the ``size``-byte file ``path``."""
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            return f.read()

    def delete_under(self, folder: str, keep: set[str]) -> int:
        """Delete everything in ``folder`` (folders in it recursively) except the paths in ``keep``;
        remove the folder when nothing kept is left in it.  Returns how many entries went."""
        keep_paths = {os.path.abspath(p) for p in keep}
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return 0
        n = 0
        for name in names:
            path = os.path.join(folder, name)
            full = os.path.abspath(path)
            if full in keep_paths:
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                if any(p.startswith(full + os.sep) for p in keep_paths):
                    n += self.delete_under(path, keep)  # a kept file inside: only the rest goes
                else:
                    shutil.rmtree(path, ignore_errors=True)
                    n += 1
            else:
                unlink_quiet(path)
                n += 1
        if not keep_paths or not any(os.path.exists(p) for p in keep_paths):
            try:
                os.rmdir(folder)
            except OSError:
                pass
        return n


class LocalStore(LogStore):
    """The transaction log in a local (or POSIX-mounted) directory: temp file + fsync +
    link/rename + directory fsync."""

    def __init__(self, root: str):
        self.root = os.path.abspath(root)
        self.url = self.root
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise LogError(
                f"cannot create the transaction log directory {self.root}: {e.strerror}"
            ) from None

    @classmethod
    def from_url(
        cls, url: str, storage_options: dict[str, Any] | None, exclusive: bool
    ) -> LocalStore:
        # storage_options are not checked here: the coordinator passes one dict for its log and
        # Spark's checkpoint, and they describe the remote one when the other is local.
        return cls(local_root(url))

    def _path(self, name: str) -> str:
        return os.path.join(self.root, name)

    def read(self, name: str) -> bytes | None:
        try:
            with open(self._path(name), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None

    def _write_tmp(self, path: str, data: bytes) -> str:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            try:
                write_all(fd, data)
                os.fsync(fd)
            finally:
                os.close(fd)
            if os.path.getsize(tmp) != len(data):
                raise OSError(errno.EIO, f"wrote {os.path.getsize(tmp)} of {len(data)} bytes")
        except OSError as e:
            # Nothing half-written may ever be linked into place: a truncated PREPARED
            # record would make the log unreadable for good.
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise LogError(
                f"cannot write the transaction log record {path}: "
                f"{e.strerror or e} (disk full?). Nothing was recorded; free space and "
                "restart the query."
            ) from None
        return tmp

    @staticmethod
    def _fsync_dir(folder: str) -> None:
        fsync_dir(folder)

    def create(self, name: str, data: bytes) -> bool:
        path = self._path(name)
        tmp = self._write_tmp(path, data)
        try:
            os.link(tmp, path)  # fails with EEXIST instead of overwriting: exclusive and atomic
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
        self._fsync_dir(os.path.dirname(path))
        return True

    def replace(self, name: str, data: bytes) -> None:
        path = self._path(name)
        tmp = self._write_tmp(path, data)
        os.replace(tmp, path)
        self._fsync_dir(os.path.dirname(path))

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        try:
            return sorted(
                n for n in os.listdir(self._path(folder)) if hidden or not n.startswith(".")
            )
        except FileNotFoundError:
            return []

    def delete(self, name: str) -> None:
        unlink_quiet(self._path(name))


# ------------------------------------------------------------ FileSink's part files
class LocalPartFiles(StagedPartFiles):
    """Local (or POSIX-mounted) directory: exclusive create, fsync, hard link + unlink on commit."""

    fs = "local"

    @classmethod
    def from_url(cls, url, storage_options, *, fsync=True, **_):
        return cls(LocalStorage(url, storage_options, fsync=fsync))

    def check(self) -> None:
        self.storage.ensure_writable(self.join(self.root, STAGING_DIR))

    def finish_file(self, f):
        size = self.storage.close_durably(f.stream, f.staging)
        return {"staging": f.staging, "final": f.final, "size": size}

    def abort_file(self, f):
        if not f.stream.closed:
            f.stream.close()
        self.storage.delete(f.staging)

    def commit_file(self, entry):
        st = self.storage
        staging, final, size = entry["staging"], entry["final"], int(entry["size"])
        if st.exists(staging):
            if not st.link_no_overwrite(staging, final):
                if not st.same_file(staging, final):
                    raise TwoPhaseError(
                        f"cannot commit {staging}: the target {final} already exists and is "
                        "another file (written by something else?). Move it aside and restart; "
                        "the staged file is kept."
                    )
                st.sync_dir(final)  # linked before a crash: make sure the link is durable
            st.delete(staging)
            return CommitResult.committed()
        actual = st.size(final)
        if actual is not None:
            if actual == size:
                return CommitResult.already_committed()
            return CommitResult.lost(
                f"staged file {staging} is gone and {final} has {actual} bytes, expected {size}"
            )
        return CommitResult.lost(f"neither the staged file {staging} nor the target {final} exists")

    def abort_entry(self, entry):
        self.storage.delete(entry["staging"])
