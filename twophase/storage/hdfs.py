"""HDFS over WebHDFS (the ``hdfs`` package): streamed create, rename that never overwrites, listing.

:class:`HdfsStorage` holds the primitives FileSink stages and commits with;
:class:`HdfsLogStore` is the transaction log on HDFS.  Exclusive create and commit are
WebHDFS ``RENAME`` with ``renameoptions=NONE`` (HDFS ``rename2``): it fails with
FileAlreadyExistsException instead of overwriting and never moves a file *into* an
existing directory.  Needs ``pip install 'twophase[hdfs]'``.
"""

from __future__ import annotations

import builtins
import contextlib
import getpass
import logging
import os
import posixpath
import queue
import threading
import time
import uuid
from typing import Any
from urllib.parse import urlsplit

from twophase._deps import require
from twophase.errors import ConfigurationError, LogError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.storage._base import ChunkedWriter, LogStore, check_options
from twophase.storage.parts import STAGING_DIR, StagedPartFiles

_hdfs = require("hdfs", "HDFS storage (hdfs://, webhdfs://)", extra="hdfs")
_requests = require("requests", "HDFS storage (hdfs://, webhdfs://)", extra="hdfs")
HdfsError = _hdfs.HdfsError

log = logging.getLogger("twophase.storage.hdfs")

MIB = 1 << 20
#: Hadoop 3's default NameNode HTTP (WebHDFS) port: ``hdfs://host`` without ``webhdfs_url`` uses it.
DEFAULT_WEBHDFS_PORT = 9870
#: The storage options taken.
OPTIONS = {
    "webhdfs_url": "the NameNode's WebHDFS (HTTP) address, e.g. http://nn:9870; wins over the URL",
    "webhdfs_port": f"the HTTP port for hdfs://host URLs (default {DEFAULT_WEBHDFS_PORT})",
    "user": "user.name sent to WebHDFS (default HADOOP_USER_NAME, then the OS user)",
    "timeout": "seconds per WebHDFS request (default 60)",
}
_NO_KERBEROS = (
    "Kerberos/SPNEGO and delegation tokens are not supported (simple authentication only)"
)
#: Options of fsspec's WebHDFS filesystem that users may pass, and why they are not taken.
REFUSED = {
    "kerberos": _NO_KERBEROS,
    "kerb_kwargs": _NO_KERBEROS,
    "token": _NO_KERBEROS,
    "password": _NO_KERBEROS,
    "proxy_to": "impersonation (doas) is not supported",
    "data_proxy": "use webhdfs_url for a gateway",
    "use_https": "use a swebhdfs:// URL or an https:// webhdfs_url",
    "host": "give the namenode in the URL or as webhdfs_url",
    "port": "give webhdfs_url or webhdfs_port",
    "session_cert": "client certificates are not supported",
    "session_verify": "not supported",
}


class WebHdfsUnreachable(TwoPhaseError):
    """No answer from the WebHDFS address (the message says where that address came from)."""


def webhdfs_origin(url: str, storage_options: dict[str, Any]) -> str:
    """Where the WebHDFS address of ``url`` comes from, for error messages (issue 19: an
    ``hdfs://nn:8020`` URL silently meant ``http://nn:9870``)."""
    if storage_options.get("webhdfs_url"):
        return "storage option webhdfs_url"
    parts = urlsplit(url)
    if parts.scheme.lower() in ("webhdfs", "swebhdfs"):
        return f"the {parts.scheme}:// URL"
    port = storage_options.get("webhdfs_port", DEFAULT_WEBHDFS_PORT)
    why = (
        "storage option webhdfs_port"
        if "webhdfs_port" in storage_options
        else f"Hadoop 3's default NameNode HTTP port {DEFAULT_WEBHDFS_PORT}"
    )
    return (
        f"derived from {parts.scheme}://{parts.netloc}: port {port} is {why}; the RPC port in the "
        "URL is not used. If the NameNode serves HTTP elsewhere, set storage option "
        "webhdfs_url='http://namenode:port' or use a webhdfs://host:port URL"
    )


def hdfs_location(url: str, storage_options: dict[str, Any]) -> tuple[str, str, str]:
    """(WebHDFS base URL, user, absolute path) for an ``hdfs://`` or ``webhdfs://`` URL.

    ``storage_options["webhdfs_url"]`` (e.g. ``http://namenode:9870``) wins; otherwise
    ``webhdfs://host:port`` means that HTTP endpoint and ``hdfs://host[:port]`` means
    ``http://host:9870`` (the RPC port in the URL is not the HTTP port).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    path = posixpath.normpath(parts.path or "/")
    if not path.startswith("/"):
        path = "/" + path
    base = storage_options.get("webhdfs_url")
    if not base:
        if not parts.hostname:
            raise ConfigurationError(
                f"{url}: give the namenode in the URL (hdfs://host:port/path) or "
                "storage_options={'webhdfs_url': 'http://namenode:9870'}"
            )
        if scheme in ("webhdfs", "swebhdfs"):
            proto = "https" if scheme == "swebhdfs" else "http"
            base = f"{proto}://{parts.hostname}:{parts.port or DEFAULT_WEBHDFS_PORT}"
        else:
            port = storage_options.get("webhdfs_port", DEFAULT_WEBHDFS_PORT)
            base = f"http://{parts.hostname}:{port}"
    user = storage_options.get("user") or os.environ.get("HADOOP_USER_NAME") or getpass.getuser()
    return str(base).rstrip("/"), str(user), path


def hdfs_client(base: str, user: str, timeout: float):
    return _hdfs.InsecureClient(base, user=user, timeout=timeout)


def hdfs_exc(e: Exception) -> str:
    """The Java exception name of a WebHDFS error (``FileNotFoundException``, ...), or ''."""
    return getattr(e, "exception", None) or ""


class HdfsUpload(ChunkedWriter):
    """A write-only stream into one new HDFS file over WebHDFS, without holding the file in memory.

    A background thread runs the WebHDFS CREATE with a generator fed by a bounded
    queue of ~1 MiB chunks; :meth:`finish` returns when the DataNode has closed the
    file (HTTP 201), which is when HDFS makes it durable and visible to ``getFileStatus``.

    The constructor returns only once the file exists on the NameNode. Otherwise a
    writer that stops right after opening (its task killed or abandoned, its upload
    thread still on its way to the DataNode) could create the file *after* the
    coordinator's cleanup listed the staging folder, and it would be left behind.
    """

    chunk_size = MIB
    DEPTH = 8
    CREATE_WAIT = 60.0  # seconds for the DataNode to create the file

    def __init__(self, client, path: str, reach: Any = None):
        super().__init__()
        self.client, self.path = client, path
        self._reach = reach or contextlib.nullcontext
        self._q: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self._err: BaseException | None = None
        self._t = threading.Thread(target=self._run, name="twophase-webhdfs-write", daemon=True)
        self._t.start()
        self._await_created()

    def _await_created(self) -> None:
        deadline = time.monotonic() + self.CREATE_WAIT
        pause = 0.002
        try:
            while True:
                if self._err is not None or not self._t.is_alive():
                    raise TwoPhaseError(f"creating staged file {self.path} on HDFS failed: {self._err}")
                with self._reach():
                    if self.client.status(self.path, strict=False) is not None:
                        return
                if time.monotonic() >= deadline:
                    raise TwoPhaseError(
                        f"creating staged file {self.path} on HDFS: the file did not appear "
                        f"within {self.CREATE_WAIT:.0f} s"
                    )
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
        except BaseException:
            self.cancel()
            raise

    def _gen(self):
        while True:
            item = self._q.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def _run(self) -> None:
        try:
            with self._reach():
                self.client.write(self.path, data=self._gen(), overwrite=False)
        except BaseException as e:  # noqa: BLE001 - reported by write()/finish() in the writing thread
            self._err = e

    def _put(self, item: Any) -> None:
        while True:
            if self._err is not None:
                raise TwoPhaseError(
                    f"writing staged file {self.path} to HDFS failed: {self._err}"
                ) from None
            try:
                self._q.put(item, timeout=0.5)
                return
            except queue.Full:
                if not self._t.is_alive():
                    raise TwoPhaseError(
                        f"writing staged file {self.path} to HDFS failed: the upload "
                        f"ended early ({self._err})"
                    ) from None

    def _emit(self, data: bytes) -> None:
        self._put(data)

    def finish(self) -> int:
        """Send the rest and wait until the DataNode closed the file; returns its size."""
        if self._buf:
            self._put(bytes(self._buf))
            self._buf.clear()
        self._put(None)
        self._t.join()
        self.closed = True
        if self._err is not None:
            raise TwoPhaseError(f"writing staged file {self.path} to HDFS failed: {self._err}")
        return self._pos

    def cancel(self) -> None:
        """End the upload cleanly (the caller deletes the file next).

        Not by breaking the HTTP request: the DataNode would then create and close the
        file asynchronously, possibly *after* the caller's delete, leaving it behind.
        """
        self.closed = True
        self._buf.clear()
        deadline = time.monotonic() + 60
        while self._t.is_alive() and time.monotonic() < deadline:
            try:
                self._q.put(None, timeout=0.5)
                break
            except queue.Full:
                continue
        self._t.join(timeout=max(0.0, deadline - time.monotonic()))


class HdfsStorage:
    """One HDFS directory tree over WebHDFS, as FileSink uses it (paths are absolute HDFS paths).

    Holds only configuration when pickled (the client is rebuilt on executors).
    """

    name = "hdfs"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        so = check_options(f"HDFS storage options for {url}", storage_options, OPTIONS, REFUSED)
        self.url = url
        self.base, self.user, self.root = hdfs_location(url, so)
        self.origin = webhdfs_origin(url, so)
        self.timeout = float(so.get("timeout", 60))

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_c_")}

    @staticmethod
    def join(*parts: str) -> str:
        return posixpath.join(*parts)

    @staticmethod
    def normpath(path: str) -> str:
        return posixpath.normpath(path)

    @property
    def client(self):
        c = getattr(self, "_c_client", None)
        if c is None:
            c = self._c_client = hdfs_client(self.base, self.user, self.timeout)
        return c

    @contextlib.contextmanager
    def reach(self):
        """Turn "no answer from WebHDFS" into :class:`WebHdfsUnreachable` naming the address and
        where it came from (every call to the NameNode or a DataNode goes through this)."""
        try:
            yield
        except _requests.RequestException as e:
            raise WebHdfsUnreachable(
                f"cannot reach WebHDFS at {self.base} ({self.origin}): {type(e).__name__}"
            ) from None

    def status(self, path: str) -> dict[str, Any] | None:
        """WebHDFS FileStatus of ``path`` (``type``, ``length``, ...), or None if absent."""
        with self.reach():
            return self.client.status(path, strict=False)

    def makedirs(self, path: str) -> None:
        with self.reach():
            self.client.makedirs(path)

    def list(self, folder: str) -> list[str] | None:
        """Names in ``folder``; None if it does not exist."""
        entries = self._list_status(folder)
        return None if entries is None else [name for name, _ in entries]

    def _list_status(self, folder: str) -> builtins.list[tuple[str, dict[str, Any]]] | None:
        """(name, FileStatus) of each entry of the folder ``folder``; None if it does not exist.

        One LISTSTATUS.  (``hdfs``'s ``Client.list`` adds a GETFILESTATUS whenever a folder holds
        exactly one entry, against an HttpFS quirk with files; every caller here lists folders,
        and a batch's staging folders often hold one entry, so that was a round trip per call.)
        """
        try:
            with self.reach():
                statuses = self.client._list_status(folder).json()["FileStatuses"]["FileStatus"]
        except HdfsError as e:
            if hdfs_exc(e) == "FileNotFoundException":
                return None
            raise
        if len(statuses) == 1 and not statuses[0].get("pathSuffix"):
            raise HdfsError(f"{folder!r} is not a directory")
        return [(st["pathSuffix"], st) for st in statuses]

    def sizes(self, folder: str) -> dict[str, int] | None:
        """The size of every file directly in ``folder`` by name (one LISTSTATUS); None if it
        does not exist."""
        entries = self._list_status(folder)
        if entries is None:
            return None
        return {name: int(st["length"]) for name, st in entries if st.get("type") == "FILE"}

    def read(self, path: str) -> bytes | None:
        try:
            with self.reach(), self.client.read(path) as r:
                return r.read()
        except HdfsError as e:
            if hdfs_exc(e) == "FileNotFoundException":
                return None
            raise

    def read_tail(self, path: str, size: int, n: int) -> bytes:
        """The last ``n`` bytes of the ``size``-byte file ``path`` (one ranged OPEN)."""
        off = max(0, size - n)
        with self.reach(), self.client.read(path, offset=off, length=size - off) as r:
            return r.read()

    def delete(self, path: str, recursive: bool = False) -> bool:
        """Delete ``path``; False if it did not exist.  HdfsError for a non-empty directory
        unless ``recursive``."""
        with self.reach():
            return self.client.delete(path, recursive=recursive)

    def hadoop_url(self, path: str) -> str:
        """``path`` as Spark (Hadoop) names it: the sink URL's scheme and authority (``hdfs://nn:8020``
        reaches the NameNode by RPC, ``webhdfs://`` by Hadoop's WebHDFS client)."""
        parts = urlsplit(self.url)
        return f"{parts.scheme}://{parts.netloc}{path}"

    def list_files(self, folder: str) -> builtins.list[tuple[str, int]]:
        """(path, size) of every file under ``folder``, at any depth, leaving out names (of files
        and folders) that start with ``_`` or ``.`` (Spark's ``_SUCCESS``, ``_temporary``)."""
        out: builtins.list[tuple[str, int]] = []
        entries = self._list_status(folder)
        if entries is None:
            raise HdfsError(f"{folder!r} does not exist")
        for name, st in sorted(entries, key=lambda e: e[0]):
            if name.startswith(("_", ".")):
                continue
            path = posixpath.join(folder, name)
            if st.get("type") == "DIRECTORY":
                out += self.list_files(path)
            else:
                out.append((path, int(st["length"])))
        return out

    def create(self, path: str) -> HdfsUpload:
        """Exclusive create, streamed: the file appears when :meth:`HdfsUpload.finish` returns."""
        return HdfsUpload(self.client, path, self.reach)

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create ``path`` with ``data`` (parents created); HdfsError if it exists."""
        with self.reach():
            self.client.write(path, data=data, overwrite=False)

    def rename(self, src: str, dst: str, overwrite: bool = False) -> None:
        """HDFS ``rename2``: atomic; with ``overwrite=False`` FileAlreadyExistsException rather than
        replacing ``dst``, and never into an existing directory."""
        with self.reach():
            self.client._rename(
                src, destination=dst, renameoptions="OVERWRITE" if overwrite else "NONE"
            )

    def rename_no_overwrite(self, src: str, dst: str) -> bool:
        """Rename ``src`` to ``dst`` (creating ``dst``'s parent); False if HDFS refused because
        ``dst`` exists or ``src`` is gone.  Other errors are raised."""
        for attempt in range(2):
            try:
                self.rename(src, dst)
                return True
            except HdfsError as e:
                kind = hdfs_exc(e)
                if (
                    kind == "FileNotFoundException"
                    and "destination parent" in str(e)
                    and attempt == 0
                ):
                    self.makedirs(posixpath.dirname(dst))
                    continue
                if kind not in (
                    "FileAlreadyExistsException",
                    "FileNotFoundException",
                    "IOException",
                ):
                    raise
                return False
        return False

    def delete_under(self, folder: str, keep: set[str]) -> int:
        """Delete everything directly in ``folder`` (recursively) except the paths in ``keep``,
        and the folder itself when nothing kept is in it.  Returns how many entries went."""
        return self._delete_under(folder, {posixpath.normpath(p) for p in keep})[0]

    def _delete_under(self, folder: str, keep_paths: set[str]) -> tuple[int, bool]:
        """:meth:`delete_under`, and whether ``folder`` is gone afterwards."""
        # After a batch's commits its staging folder is normally empty (every staged file
        # was renamed away): one non-recursive DELETE, which HDFS refuses on a non-empty
        # directory, then does all the work in one round trip.
        try:
            self.delete(folder)  # False when the folder does not exist: nothing lingers
            return 0, True
        except HdfsError:
            pass  # not empty: leftovers of failed attempts, or kept files not yet committed
        names = self.list(folder)
        if names is None:
            return 0, True
        n = 0
        kept_here = False
        for name in names:
            path = posixpath.join(folder, name)
            if posixpath.normpath(path) in keep_paths:
                kept_here = True
            elif any(p.startswith(posixpath.normpath(path) + "/") for p in keep_paths):
                # A kept file inside: only the rest goes (and the folder, once nothing is left,
                # as with a FileSink(writer="spark") folder whose files were all committed).
                m, gone = self._delete_under(path, keep_paths)
                n += m
                kept_here = kept_here or not gone
            else:
                self.delete(path, recursive=True)
                n += 1
        if not kept_here:
            try:
                self.delete(folder)  # not recursive: only if empty
                return n, True
            except HdfsError:
                pass
        return n, False


class HdfsLogStore(LogStore):
    """The transaction log on HDFS over WebHDFS: write a hidden temp file, then ``rename2``.

    Create is rename with ``renameoptions=NONE`` (atomic, fails if the name exists);
    replace is ``renameoptions=OVERWRITE`` (atomic).  The NameNode syncs its edit log
    before answering, so a rename that returned is durable.  File contents are
    durable once the DataNode has closed the file (HDFS close semantics).
    """

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None = None, exclusive: bool = True
    ):
        # rename2 with NONE is always exclusive: nothing to prove when exclusive=True
        self.storage = HdfsStorage(url, storage_options)
        self.url = url
        self.root = self.storage.root
        self.client = self.storage.client
        if not exclusive:
            return  # read, list, delete only (a read-only command, Spark's checkpoint): create nothing
        try:
            self.storage.makedirs(self.root)
        except HdfsError as e:
            raise LogError(f"cannot create the transaction log directory {url}: {e}") from None
        except WebHdfsUnreachable as e:
            raise LogError(f"cannot open the transaction log {url}: {e}") from None

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name)

    def read(self, name: str) -> bytes | None:
        return self.storage.read(self._path(name))

    def _put(self, path: str, data: bytes, overwrite: bool) -> bool:
        tmp = posixpath.join(
            posixpath.dirname(path), f".{posixpath.basename(path)}.{uuid.uuid4().hex}.tmp"
        )
        self.storage.write_bytes(tmp, data)  # creates parent directories
        try:
            self.storage.rename(tmp, path, overwrite=overwrite)
            return True
        except HdfsError as e:
            self.storage.delete(tmp)
            # Exists: another writer's record.  Not found (the source: the target's folder is the
            # temp file's): the owner's prune swept the temp file of a batch it pruned, so this is
            # a late write; either way not created, and the caller reads the slot again.
            if hdfs_exc(e) in ("FileAlreadyExistsException", "FileNotFoundException") and not overwrite:
                return False
            raise

    def create(self, name: str, data: bytes) -> bool:
        return self._put(self._path(name), data, overwrite=False)

    def replace(self, name: str, data: bytes) -> None:
        self._put(self._path(name), data, overwrite=True)

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        names = self.storage.list(self._path(folder) if folder else self.root) or []
        return sorted(n for n in names if hidden or not n.startswith("."))

    def delete(self, name: str) -> None:
        self.storage.delete(self._path(name))


# ------------------------------------------------------------ FileSink's part files
class HdfsPartFiles(StagedPartFiles):
    """HDFS through WebHDFS: stream to ``_twophase/...`` staging, commit by a rename that never
    overwrites (``rename2`` with ``renameoptions=NONE``)."""

    fs = "hdfs"

    @classmethod
    def from_url(cls, url, storage_options, **_):
        return cls(HdfsStorage(url, storage_options))

    @property
    def base(self) -> str:
        """The WebHDFS base URL."""
        return self.storage.base

    @property
    def user(self) -> str:
        return self.storage.user

    def spark_metadata(self) -> bool:
        return self.storage.status(self.join(self.root, "_spark_metadata")) is not None

    def check(self) -> None:
        try:
            self.storage.makedirs(self.join(self.root, STAGING_DIR))
            st = self.storage.status(self.root)
        except HdfsError as e:
            raise ConfigurationError(
                f"FileSink cannot write to hdfs path {self.root} ({self.base}): "
                f"{hdfs_exc(e) or 'error'}: {e}"
            ) from None
        except WebHdfsUnreachable as e:
            raise ConfigurationError(f"FileSink {e}") from None
        if st is None or st.get("type") != "DIRECTORY":
            raise ConfigurationError(f"FileSink target hdfs path {self.root} is not a directory")

    def finish_file(self, f):
        size = f.stream.finish()
        st = self.storage.status(f.staging)
        if st is None or int(st["length"]) != size:
            raise TwoPhaseError(
                f"staged HDFS file {f.staging} has {None if st is None else st['length']} "
                f"bytes after close, expected {size}; the task fails and is retried"
            )
        return {"staging": f.staging, "final": f.final, "size": size}

    def abort_file(self, f):
        if not f.stream.closed:
            f.stream.cancel()
        try:
            self.storage.delete(f.staging)
        except Exception:  # best effort: abort_lingering removes it later
            log.warning("could not delete staged HDFS file %s", f.staging, exc_info=True)

    def commit_file(self, entry):
        staging, final, size = entry["staging"], entry["final"], int(entry["size"])
        if self.storage.rename_no_overwrite(staging, final):
            return CommitResult.committed()
        # The rename did not happen: done before (a replayed commit), or a foreign target.
        st_final, st_staging = self.storage.status(final), self.storage.status(staging)
        if st_staging is None:
            if st_final is None:
                return CommitResult.lost(
                    f"neither the staged file {staging} nor the target {final} exists"
                )
            if st_final.get("type") == "FILE" and int(st_final["length"]) == size:
                return CommitResult.already_committed()
            return CommitResult.lost(
                f"staged file {staging} is gone and {final} has "
                f"{st_final.get('length')} bytes, expected {size}"
            )
        raise TwoPhaseError(
            f"cannot commit {staging}: the target {final} already exists and is another "
            f"{'directory' if st_final and st_final.get('type') == 'DIRECTORY' else 'file'} "
            "(written by something else?). Move it aside and restart; the staged file is kept."
        )

    def abort_entry(self, entry):
        self.storage.delete(entry["staging"])
