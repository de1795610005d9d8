"""Part files held invisibly and made visible on commit: FileSink's view of a storage backend.

:class:`PartFiles` is what FileSink asks of a backend: where a batch's staged files go, how
a part file is opened, finished (its handle entry), committed, recovered and aborted, when a
commit counts as already done, and which paths read back from the log it may touch.  Each
backend module holds its implementation beside its primitives
(:class:`~twophase.storage.local.LocalPartFiles`, :class:`~twophase.storage.hdfs.HdfsPartFiles`,
:class:`~twophase.storage.s3.S3PartFiles`); the registry names it per URL scheme
(``Backend.files``).  The sink keeps the handle format, part names and formats.
"""

from __future__ import annotations

import os
import posixpath
import re
import uuid
from typing import TYPE_CHECKING, Any, Protocol

from twophase.context import TransactionContext
from twophase.errors import HandleError
from twophase.sink import CommitResult

if TYPE_CHECKING:
    from twophase.evidence import Settled

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
#: The folder under a local or HDFS root that holds staged files (readers skip ``_`` names).
STAGING_DIR = "_twophase"


class OpenPart(Protocol):
    """One part file open for writing, as the sink holds it (executor side)."""

    final: str  # local/HDFS: absolute path; S3: object key
    staging: str | None  # local/HDFS: staged path; S3: None (the open upload is the staging)
    stream: Any  # what open_file returned


def safe_name(s: str) -> str:
    """``s`` with every character but letters, digits, ``_``, ``.`` and ``-`` replaced by ``_``."""
    return _SAFE.sub("_", s)


def staging_name(final: str, ctx: TransactionContext, index: int) -> str:
    # Attempt and a random token in the staging name: two attempts never share a file.
    base = posixpath.basename(final) if index == 0 else f"{posixpath.basename(final)}.f{index:04d}"
    return f"{base}.a{ctx.attempt}-{uuid.uuid4().hex[:8]}"


class PartFiles:
    """How FileSink stages, commits and aborts part files on one kind of storage.

    The storage object (``LocalStorage``, ...) does the I/O; this class holds the rules:
    where staged files go, what a handle entry holds, when a commit counts as already done.
    Holds only configuration when pickled (storage objects drop their clients).
    """

    fs = ""
    #: Whether Spark's own writer can write this backend's staged files (FileSink(writer="spark")).
    spark_writer = False

    def __init__(self, storage: Any):
        self.storage = storage
        self.root: str = storage.root

    @classmethod
    def from_url(
        cls,
        url: str,
        storage_options: dict[str, Any] | None,
        *,
        fsync: bool = True,
        part_size: int = 8 << 20,
        etags: str = "md5",
        if_none_match: str = "require",
    ) -> PartFiles:
        """The backend for ``url`` with FileSink's settings (each backend takes the ones it uses:
        ``fsync`` local disk; ``part_size``, ``etags``, ``if_none_match`` S3)."""
        raise NotImplementedError

    def join(self, *parts: str) -> str:
        return self.storage.join(*parts)

    # driver
    def check(self) -> None: ...

    def spark_metadata(self) -> bool:
        """Whether the root holds ``_spark_metadata``: the log of Spark's streaming file sink,
        through which Spark's readers list the folder (only the files named there)."""
        return False

    def batch_staging(self, query_name: str, batch_id: int) -> str:
        return self.join(self.root, STAGING_DIR, safe_name(query_name), f"b{batch_id:08d}")

    # executor
    def open_file(self, ctx: TransactionContext, final: str, index: int) -> tuple[str | None, Any]:
        raise NotImplementedError

    def finish_file(self, f: OpenPart) -> dict[str, Any]:
        raise NotImplementedError

    def abort_file(self, f: OpenPart) -> None:
        raise NotImplementedError

    # driver, FileSink(writer="spark") (spark_writer backends)
    def writer_folder(self, ctx: Any, token: str) -> str:
        raise NotImplementedError

    def hadoop_url(self, path: str) -> str:
        raise NotImplementedError

    def list_files(self, folder: str) -> list[tuple[str, int]]:
        raise NotImplementedError

    def delete_folder(self, folder: str) -> None:
        raise NotImplementedError

    def read_tail(self, path: str, size: int, n: int) -> bytes:
        raise NotImplementedError

    # driver
    def commit_file(self, entry: dict[str, Any]) -> CommitResult:
        raise NotImplementedError

    def recover_file(self, entry: dict[str, Any]) -> CommitResult:
        return self.commit_file(entry)

    def abort_entry(self, entry: dict[str, Any]) -> None:
        raise NotImplementedError

    def abort_lingering(
        self,
        query_name: str,
        batch_id: int,
        intent: dict[str, Any],
        keep: list[dict[str, Any]],
        names: re.Pattern[str],
        *,
        earlier: re.Pattern[str] | None = None,
        settled: Settled | None = None,
    ) -> int:
        """Abort/delete what attempts of ``batch_id`` of ``query_name`` left, except ``keep``,
        and what late task attempts left for this query's other batches that the log says are
        finished (``settled``): local/HDFS, the batch's staging folder (the INTENT's) and this
        query's staging folders of settled batches; S3, in one listing, the open uploads under
        the sink's prefix whose name ``names`` matches in full (this batch and INTENT) or
        ``earlier`` matches in full with a settled batch number (group 1) (this query's scope
        only: another pipeline's or generation's uploads are never touched).  Never by batch-id
        order: a backfill of an older id may be staging now (issue 59).  ``settled=None``: no
        evidence, no other batch is touched."""
        raise NotImplementedError

    def verify_files(self, entries: list[dict[str, Any]]) -> list[str]:
        """What is wrong with the staged data of pre-committed handle entries, one line per
        file ([] when every one is still there, with its size); cheap: a listing per staging
        folder (S3: per batch), not a request per file.  Driver, before the decision."""
        raise NotImplementedError

    def describe(self, entry: dict[str, Any]) -> str:
        return (
            f"{self.fs} file {entry.get('final')} (staged {entry.get('staging')}, "
            f"{entry.get('size')} bytes)"
        )

    # paths read back from the log: never trusted (a tampered or mistaken record must not make
    # commit link, or abort delete, anything outside this sink's root and staging folders)
    def check_entry(self, entry: dict[str, Any]) -> None:
        """HandleError unless every path of a handle's file lies where this sink writes."""

    def check_intent(self, intent: dict[str, Any], batch_id: int) -> None:
        """HandleError unless the INTENT's locations are this sink's, for batch ``batch_id``."""


#: A batch's staging folder: ``b<batch>``, with ``.<token>`` for one ballot of it.
_BATCH_DIR = re.compile(r"b(\d{8,})(?:\.[0-9a-f]{6})?")

TAMPERED = (
    "The transaction log record was changed, or belongs to another sink; nothing was touched. "
    "Recover with the sink configuration the batch was written with."
)


class StagedPartFiles(PartFiles):
    """Local disk and HDFS: staged files under ``<root>/_twophase/<query>/b<batch>/``."""

    def _under(self, path: Any, base: str, what: str, record: str) -> list[str]:
        """The components of ``path`` below ``base``; HandleError unless it is a normalised path
        under it."""
        if not isinstance(path, str) or not path:
            raise HandleError(f"{record} has no {what} path ({path!r}). {TAMPERED}")
        norm = self.storage.normpath(path)
        sep = "/" if self.fs == "hdfs" else os.sep
        inside = base.rstrip(sep) + sep
        if norm != path or not path.startswith(inside):
            why = " once '..' and repeated separators are resolved" if norm != path else ""
            raise HandleError(
                f"{record} names {what} {path!r}, which is not under {inside!r}{why}. {TAMPERED}"
            )
        return path[len(inside) :].split(sep)

    spark_writer = True

    def staging_folder(self, intent: dict[str, Any], query_name: str, batch_id: int) -> str:
        """The batch's staging folder: the one its INTENT names (checked), else the default."""
        self.check_intent(intent, batch_id)
        return intent.get("staging") or self.batch_staging(query_name, batch_id)

    def open_file(self, ctx: TransactionContext, final: str, index: int) -> tuple[str | None, Any]:
        staging = self.join(self.staging_folder(ctx.intent, ctx.query_name, ctx.batch_id),
                            staging_name(final, ctx, index))
        return staging, self.storage.create(staging)

    def writer_folder(self, ctx: Any, token: str) -> str:
        """The folder Spark's writer fills for one execution of a batch:
        ``<batch staging>/w<token>/`` (``ctx``: a :class:`~twophase.context.BatchContext`).
        Inside the batch's staging folder, so ``abort_lingering`` removes what an interrupted job
        left there."""
        return self.join(self.staging_folder(ctx.intent, ctx.query_name, ctx.batch_id), "w" + safe_name(token))

    def hadoop_url(self, path: str) -> str:
        return self.storage.hadoop_url(path)

    def list_files(self, folder: str) -> list[tuple[str, int]]:
        """(path, size) of the data files Spark's writer left under ``folder``."""
        return self.storage.list_files(folder)

    def delete_folder(self, folder: str) -> None:
        self.storage.delete_under(folder, set())

    def read_tail(self, path: str, size: int, n: int) -> bytes:
        """The last ``n`` bytes of a file Spark's writer left (``size`` bytes long)."""
        return self.storage.read_tail(path, size, n)

    def abort_lingering(self, query_name, batch_id, intent, keep, names, *, earlier=None, settled=None):
        # ``earlier`` is for S3: here another batch's leftovers are in its own staging folder.
        folder = self.staging_folder(intent, query_name, batch_id)
        # rule: this ballot's INTENT names the folder and the ballot is being cleaned up (closed, or
        # committed and ``keep`` holds what it committed): its other files are no decision's.
        n = self.storage.delete_under(folder, {e["staging"] for e in keep})
        return n + self._sweep_settled(query_name, batch_id, settled)

    def verify_files(self, entries):
        sep = "/" if self.fs == "hdfs" else os.sep
        by_folder: dict[str, list[dict[str, Any]]] = {}
        for e in entries:
            by_folder.setdefault(e["staging"].rpartition(sep)[0], []).append(e)
        folders = list(by_folder)
        if len(folders) > 1 and self.fs == "hdfs":  # a round trip each: list them side by side
            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(min(8, len(folders)), thread_name_prefix="twophase-verify") as pool:
                listed = list(pool.map(self.storage.sizes, folders))
        else:
            listed = [self.storage.sizes(f) for f in folders]
        problems = []
        for folder, sizes in zip(folders, listed):
            for e in by_folder[folder]:
                actual = (sizes or {}).get(e["staging"][len(folder) + 1 :])
                if actual is None:
                    problems.append(f"staged file {e['staging']} is gone")
                elif actual != int(e["size"]):
                    problems.append(
                        f"staged file {e['staging']} has {actual} bytes, expected {e['size']}"
                    )
        return problems

    def _sweep_settled(self, query_name: str, batch_id: int, settled: Settled | None) -> int:
        """Delete this query's staging folders of *other* batches that the log says are finished.

        What is in them is garbage: a staged file that appeared after its batch's cleanup (a late
        task attempt; on HDFS a DataNode closing a dead writer's file after the folder was deleted).
        Only batches ``settled`` names (COMMITTED, or pruned after it): never by batch-id order, a
        batch job's backfill of an older id may be staging there now (issue 59, scenario 1); with
        no evidence (``settled`` None) nothing.
        """
        if settled is None:
            return 0
        # This query's folder (the one ``settled`` answers for), whatever folder the INTENT named.
        parent = self.join(self.root, STAGING_DIR, safe_name(query_name))
        n = 0
        for name in self.storage.list(parent) or []:
            m = _BATCH_DIR.fullmatch(name)
            # rule: the log holds a COMMITTED record (or a pruned range) of that batch: no ballot of
            # it is opened or decided again, so nothing under its name is any decision's.
            if m and int(m.group(1)) != batch_id and settled(query_name, int(m.group(1))):
                n += self.storage.delete_under(self.join(parent, name), set())
        return n

    def check_entry(self, entry):
        rel = self._under(
            entry.get("staging"), self.join(self.root, STAGING_DIR), "staged file", "a files handle"
        )
        # <query>/b<batch>/<staged name>, or a file Spark's writer left under
        # <query>/b<batch>/w<token>/[col=value/...]<name>
        spark = (
            len(rel) >= 4
            and rel[2].startswith("w")
            and all("=" in seg for seg in rel[3:-1])
            and not any(seg.startswith((".", "_")) for seg in rel[2:])
        )
        if not (len(rel) == 3 or spark) or not rel[1].startswith("b"):
            raise HandleError(
                f"a files handle names staged file {entry.get('staging')!r}, which is not under "
                f"{self.join(self.root, STAGING_DIR, '<query>', 'b<batch>')!r}. {TAMPERED}"
            )
        rel = self._under(entry.get("final"), self.root, "target file", "a files handle")
        if (
            rel[0] == STAGING_DIR
            or any(seg.startswith((".", "_")) for seg in rel)
            or not all("=" in seg for seg in rel[:-1])
        ):
            raise HandleError(
                f"a files handle names target file {entry.get('final')!r}, which is not under "
                f"{self.root!r} as a part file (<root>/[col=value/...]<name>). {TAMPERED}"
            )

    def check_intent(self, intent, batch_id):
        staging = intent.get("staging")
        if staging is None:
            return
        record = f"the INTENT of batch {batch_id}"
        rel = self._under(staging, self.join(self.root, STAGING_DIR), "staging folder", record)
        m = _BATCH_DIR.fullmatch(rel[1]) if len(rel) == 2 else None
        if m is None or int(m.group(1)) != batch_id:
            raise HandleError(
                f"{record} names staging folder {staging!r}, which is not under "
                f"{self.join(self.root, STAGING_DIR, '<query>', f'b{batch_id:08d}')!r}: not this "
                f"batch's staging folder. {TAMPERED}"
            )
