"""Local (or POSIX-mounted) directories: exclusive create, a link that never overwrites, fsync.

:class:`LocalStorage` holds the primitives FileSink stages and commits with;
:class:`LocalStore` is the transaction log on local disk.  Both make a file durable
the same way: write, fsync the file, link or rename it into place, fsync the directory.
"""

from __future__ import annotations

import builtins
import ctypes
import errno
import logging
import os
import shutil
import sys
import uuid
from typing import Any, BinaryIO

from twophase.errors import ConfigurationError, LogError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.storage._base import LogStore
from twophase.storage.parts import STAGING_DIR, StagedPartFiles

log = logging.getLogger("twophase.storage.local")

#: What ``os.link`` answers on a filesystem without hard links: vfat EPERM, FUSE and SMB mounts
#: EOPNOTSUPP or ENOSYS.
NO_HARD_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS})
_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_renameat2: Any = None


def _libc_renameat2() -> Any:
    """glibc's ``renameat2`` (Linux, glibc 2.28+), or None."""
    global _renameat2
    if _renameat2 is None:
        fn: Any = False
        if sys.platform.startswith("linux"):
            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
            except (AttributeError, OSError):
                fn = False
        _renameat2 = fn
    return _renameat2 or None


def rename_noreplace_available() -> bool:
    """Whether this system has ``renameat2(RENAME_NOREPLACE)`` (each filesystem may still refuse it)."""
    return _libc_renameat2() is not None


def rename_noreplace(src: str, dst: str) -> bool:
    """Rename ``src`` to ``dst`` atomically unless ``dst`` exists: False then, and nothing moved.
    OSError where the system or the filesystem has no such rename (EINVAL, ENOSYS, ...)."""
    fn = _libc_renameat2()
    if fn is None:
        raise OSError(errno.ENOSYS, "renameat2 is not available on this system")
    if fn(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.EEXIST:
        return False
    raise OSError(err, os.strerror(err), src, None, dst)


def _no_publish(root: str, where: str, link_error: OSError, rename_error: OSError) -> str:
    """Why part files cannot be published into ``root`` (for errors): neither a hard link nor a
    rename that never replaces works on its filesystem."""
    return (
        f"the filesystem of {root} has no hard links (os.link {where}: {link_error.strerror}) and "
        f"no rename that refuses to replace a file (renameat2 RENAME_NOREPLACE: "
        f"{rename_error.strerror}); vfat and exFAT have no hard links, nor have some FUSE and SMB "
        "mounts"
    )


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

    def publish(self, src: str, dst: str) -> bool:
        """Make ``src`` visible as ``dst`` without ever replacing ``dst``: a hard link (``src``
        stays; the caller removes it), or, on a filesystem without hard links, an atomic rename
        that refuses an existing target (``renameat2(RENAME_NOREPLACE)``: ``src`` is gone).  False
        if ``dst`` exists (nothing changed).  Durable when it returns True.  TwoPhaseError when
        the filesystem offers neither (``open()`` refuses such a target: :meth:`probe_publish`)."""
        try:
            return self.link_no_overwrite(src, dst)
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
            link_error = e
        try:
            renamed = rename_noreplace(src, dst)
        except OSError as e:
            raise TwoPhaseError(
                f"cannot commit {src}: "
                + _no_publish(self.root, f"to {dst}", link_error, e)
                + ". FileSink publishes a part file without ever overwriting one, which needs "
                "one of the two. FileSink.open() refuses such a target; this batch was decided without that "
                "check (an older version, or 'twophase recover'). The staged file is kept: to "
                "publish it by hand, move it to the target name yourself, then recover again (a "
                "target with the expected size and no staged file counts as committed)."
            ) from None
        if renamed and self.fsync:
            fsync_dir(os.path.dirname(dst))
            fsync_dir(os.path.dirname(src))
        return renamed

    def probe_publish(self, staging_folder: str) -> str:
        """Prove that a file in ``staging_folder`` can be published into the root as commits do it
        (:meth:`publish`), with a probe file linked or renamed and removed: ``"link"``, or
        ``"rename"`` on a filesystem without hard links that has ``RENAME_NOREPLACE`` (checked
        to refuse an existing target).  ConfigurationError, naming the folders and what to do,
        where neither works (vfat, some FUSE and SMB mounts) or the staging folder is on another
        filesystem than the root: there every commit would fail after the batch was decided."""
        token = uuid.uuid4().hex[:12]
        src = os.path.join(staging_folder, f".probe-{token}")
        dst = os.path.join(self.root, f".twophase-probe-{token}")
        second = f"{src}.2"
        where = f"from {staging_folder} to {self.root}"
        try:
            with open(src, "xb") as f:
                f.write(b"twophase probe")
            try:
                os.link(src, dst)
                return "link"
            except OSError as e:
                link_error = e
            if link_error.errno == errno.EXDEV:
                raise ConfigurationError(
                    f"FileSink cannot commit into {self.root}: its staging folder {staging_folder} is "
                    "on another filesystem (a mount point inside the target?), and a part file is "
                    "published by a hard link from there, which works within one filesystem only. "
                    "Do not mount anything at the staging folder."
                ) from None
            if link_error.errno not in NO_HARD_LINKS:
                raise ConfigurationError(
                    f"FileSink cannot commit into {self.root}: a hard link {where} failed: "
                    f"{link_error.strerror}"
                ) from None
            try:
                if not rename_noreplace(src, dst):
                    raise OSError(errno.EEXIST, "the probe's target name exists")
                with open(second, "xb") as f:
                    f.write(b"twophase probe 2")
                if rename_noreplace(second, dst):  # it replaced the target: not what it promises
                    raise OSError(errno.EINVAL, "it replaced an existing file")
            except OSError as e:
                raise ConfigurationError(
                    f"FileSink cannot commit into {self.root}: "
                    + _no_publish(self.root, where, link_error, e)
                    + ". FileSink publishes a part file without ever overwriting one, which needs "
                    "one of the two: here every commit of a decided batch would fail. Write to a filesystem with "
                    "hard links (ext4, xfs, btrfs, tmpfs, most NFS), or to HDFS or S3."
                ) from None
            log.warning(
                "FileSink target %s: its filesystem has no hard links (%s); part files are "
                "published by rename with RENAME_NOREPLACE instead, which never overwrites either",
                self.root, link_error.strerror,
            )
            return "rename"
        finally:
            for p in (src, dst, second):
                unlink_quiet(p)

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
        except FileNotFoundError:
            # The temp file is gone: the owner's prune swept it (TransactionLog.prune deletes the
            # temp files of the batches it prunes), so this is a late write to a pruned batch.  Not
            # created; the caller reads the slot again and finds its record or that it was pruned.
            return False
        except OSError as e:
            if e.errno not in NO_HARD_LINKS:
                raise
            # No hard links (vfat, exFAT): a rename that refuses an existing name is just as
            # exclusive and atomic, where the filesystem has it.
            try:
                if not rename_noreplace(tmp, path):
                    return False
            except FileNotFoundError:
                return False  # the temp file swept, as above
            except OSError as e2:
                raise LogError(
                    f"cannot write the transaction log record {path}: "
                    + _no_publish(self.root, f"to {path}", e, e2)
                    + ". Creating a record must be exclusive (two coordinators must never both "
                    "decide a batch), which needs one of the two: put the log on a filesystem with "
                    "hard links, or on HDFS."
                ) from None
        finally:
            unlink_quiet(tmp)  # gone already after a rename
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

    def spark_metadata(self) -> bool:
        return os.path.isdir(os.path.join(self.root, "_spark_metadata"))

    def check(self) -> None:
        """The target is writable, and a staged file can be published into it the way commits
        do it (a hard link, or a rename that never replaces): proved now, before anything is
        decided, rather than found out by the first commit of a decided batch."""
        staging = self.join(self.root, STAGING_DIR)
        self.storage.ensure_writable(staging)
        self.storage.probe_publish(staging)

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
            if not st.publish(staging, final):  # a hard link, or a no-replace rename
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
