"""Exactly-once file sink: part files staged invisibly in the target store, made visible on commit.

One sink, three storage backends chosen by the URL (twophase.storage's registry):
local disk (``/path``, ``file://``) and HDFS (``hdfs://``, ``webhdfs://``, over
WebHDFS) stage files under ``<target>/_twophase/`` and commit by a rename that never
overwrites; S3 (``s3://``) keeps each part file an open multipart upload and commits
with CompleteMultipartUpload.  Part names are deterministic per batch and partition,
so a replay cannot duplicate a file.  This module holds the sink's rules (handles,
staging layout, commit and recovery); the I/O is in twophase.storage and the formats
in ``_formats``.  User docs: docs/files.md.

Delivery guarantee: with the coordinator, every row of a batch appears in exactly
one committed part file, once, after any number of driver crashes.

How it recovers: a staged file (or open upload) is the pre-committed transaction;
its handle is in the log.  Commit is idempotent: "staged file gone and target
present with the expected size" (S3: "object present with the expected ETag or
size") is already committed.  Staged files and uploads of attempts that never
reached the log are deleted/aborted by ``abort_lingering``.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from twophase.config import is_secret_ref
from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, HandleError, TwoPhaseError
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink
from twophase.sinks._formats import EXT as _EXT
from twophase.sinks._formats import FORMATS, MIB, PARQUET_CODECS, TEXT_CODECS
from twophase.sinks._formats import FormatWriter as _FormatWriter
from twophase.sinks._partitions import (  # noqa: F401 - the public names stay importable from here
    _ESCAPE,
    HIVE_DEFAULT_PARTITION,
    _split_by_partition,
    escape_partition_value,
    partition_segment,
)
from twophase.storage import backend_for, scheme_of
from twophase.storage._base import SECRET_OPTIONS as _SECRET_OPTIONS

log = logging.getLogger("twophase.sinks.files")

_SAFE = re.compile(r"[^A-Za-z0-9_.-]")
STAGING_DIR = "_twophase"
#: S3: every part but the last must be at least 5 MiB (and at most 5 GiB).
S3_MIN_PART = 5 * MIB
S3_MAX_PART = 5 * 1024 * MIB
DEFAULT_PART_SIZE = 8 * MIB


def _safe(s: str) -> str:
    return _SAFE.sub("_", s)


# --------------------------------------------------------------------- transactions
@dataclass
class _OpenFile:
    """One part file of a transaction, open for writing (executor side)."""

    final: str  # local/HDFS: absolute path; S3: object key
    staging: str | None  # local/HDFS: staged path; S3: None (the open upload is the staging)
    stream: Any
    writer: _FormatWriter
    rows: int = 0


@dataclass
class FileTransaction:
    """One partition's part file(s) of one batch, open in staging (executor side).

    Without ``partition_by`` there is exactly one file; :attr:`staging` and
    :attr:`final` name it.  With ``partition_by`` there is one file per distinct
    partition-value combination seen by this task.
    """

    ctx: TransactionContext
    files: dict[tuple, _OpenFile] = field(default_factory=dict)
    rows: int = 0
    closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def staging(self) -> str | None:
        return next(iter(self.files.values())).staging if self.files else None

    @property
    def final(self) -> str | None:
        return next(iter(self.files.values())).final if self.files else None


# -------------------------------------------------------------- per-storage commit rules
def _staging_name(final: str, ctx: TransactionContext, index: int) -> str:
    # Attempt and a random token in the staging name: two attempts never share a file.
    base = posixpath.basename(final) if index == 0 else f"{posixpath.basename(final)}.f{index:04d}"
    return f"{base}.a{ctx.attempt}-{uuid.uuid4().hex[:8]}"


class _Files:
    """How FileSink stages, commits and aborts part files on one kind of storage.

    The storage object (twophase.storage.*) does the I/O; this class holds the sink's rules:
    where staged files go, what a handle entry holds, when a commit counts as already done.
    Holds only configuration when pickled (storage objects drop their clients).
    """

    fs = ""

    def __init__(self, storage: Any):
        self.storage = storage
        self.root: str = storage.root

    def join(self, *parts: str) -> str:
        return self.storage.join(*parts)

    # driver
    def check(self) -> None: ...

    def batch_staging(self, query_name: str, batch_id: int) -> str:
        return self.join(self.root, STAGING_DIR, _safe(query_name), f"b{batch_id:08d}")

    # executor
    def open_file(self, ctx: TransactionContext, final: str, index: int) -> tuple[str | None, Any]:
        raise NotImplementedError

    def finish_file(self, f: _OpenFile) -> dict[str, Any]:
        raise NotImplementedError

    def abort_file(self, f: _OpenFile) -> None:
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
        name_prefix: str,
    ) -> int:
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


_BATCH_DIR = re.compile(r"b(\d{8,})")

_TAMPERED = (
    "The transaction log record was changed, or belongs to another sink; nothing was touched. "
    "Recover with the sink configuration the batch was written with."
)


class _StagedFiles(_Files):
    """Local disk and HDFS: staged files under ``<root>/_twophase/<query>/b<batch>/``."""

    def _under(self, path: Any, base: str, what: str, record: str) -> list[str]:
        """The components of ``path`` below ``base``; HandleError unless it is a normalised path
        under it."""
        if not isinstance(path, str) or not path:
            raise HandleError(f"{record} has no {what} path ({path!r}). {_TAMPERED}")
        norm = self.storage.normpath(path)
        sep = "/" if self.fs == "hdfs" else os.sep
        inside = base.rstrip(sep) + sep
        if norm != path or not path.startswith(inside):
            why = " once '..' and repeated separators are resolved" if norm != path else ""
            raise HandleError(
                f"{record} names {what} {path!r}, which is not under {inside!r}{why}. {_TAMPERED}"
            )
        return path[len(inside) :].split(sep)

    def abort_lingering(self, query_name, batch_id, intent, keep, name_prefix):
        self.check_intent(intent, batch_id)
        folder = intent.get("staging") or self.batch_staging(query_name, batch_id)
        n = self.storage.delete_under(folder, {e["staging"] for e in keep})
        return n + self._sweep_older(folder, batch_id)

    def _sweep_older(self, folder: str, batch_id: int) -> int:
        """Delete the staging folders of this query's *older* batches.

        Their batches are finished (the coordinator starts or finishes batch N only when
        no older batch is pending), so anything there is garbage: a staged file that
        appeared after its batch's cleanup, e.g. when a DataNode closed the file of a
        writer that died mid-write only after the folder was deleted.
        """
        sep = "/" if self.fs == "hdfs" else os.sep
        parent = folder.rstrip(sep).rpartition(sep)[0]
        n = 0
        for name in self.storage.list(parent) or []:
            m = _BATCH_DIR.fullmatch(name)
            if m and int(m.group(1)) < batch_id:
                n += self.storage.delete_under(self.join(parent, name), set())
        return n

    def check_entry(self, entry):
        rel = self._under(
            entry.get("staging"), self.join(self.root, STAGING_DIR), "staged file", "a files handle"
        )
        if len(rel) != 3 or not rel[1].startswith("b"):
            raise HandleError(
                f"a files handle names staged file {entry.get('staging')!r}, which is not under "
                f"{self.join(self.root, STAGING_DIR, '<query>', 'b<batch>')!r}. {_TAMPERED}"
            )
        rel = self._under(entry.get("final"), self.root, "target file", "a files handle")
        if (
            rel[0] == STAGING_DIR
            or any(seg.startswith((".", "_")) for seg in rel)
            or not all("=" in seg for seg in rel[:-1])
        ):
            raise HandleError(
                f"a files handle names target file {entry.get('final')!r}, which is not under "
                f"{self.root!r} as a part file (<root>/[col=value/...]<name>). {_TAMPERED}"
            )

    def check_intent(self, intent, batch_id):
        staging = intent.get("staging")
        if staging is None:
            return
        record = f"the INTENT of batch {batch_id}"
        rel = self._under(staging, self.join(self.root, STAGING_DIR), "staging folder", record)
        if len(rel) != 2 or rel[1] != f"b{batch_id:08d}":
            raise HandleError(
                f"{record} names staging folder {staging!r}, which is not under "
                f"{self.join(self.root, STAGING_DIR, '<query>', f'b{batch_id:08d}')!r}: not this "
                f"batch's staging folder. {_TAMPERED}"
            )


# ----- local disk
class _LocalFiles(_StagedFiles):
    """Local (or POSIX-mounted) directory: exclusive create, fsync, hard link + unlink on commit."""

    fs = "local"

    def check(self) -> None:
        self.storage.ensure_writable(self.join(self.root, STAGING_DIR))

    def open_file(self, ctx, final, index):
        self.check_intent(ctx.intent, ctx.batch_id)
        folder = ctx.intent.get("staging") or self.batch_staging(ctx.query_name, ctx.batch_id)
        staging = self.join(folder, _staging_name(final, ctx, index))
        return staging, self.storage.create(staging)

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


# ----- HDFS over WebHDFS
class _HdfsFiles(_StagedFiles):
    """HDFS through WebHDFS: stream to ``_twophase/...`` staging, commit by a rename that never
    overwrites (``rename2`` with ``renameoptions=NONE``)."""

    fs = "hdfs"

    @property
    def base(self) -> str:
        """The WebHDFS base URL."""
        return self.storage.base

    @property
    def user(self) -> str:
        return self.storage.user

    def check(self) -> None:
        from twophase.storage.hdfs import HdfsError, WebHdfsUnreachable, hdfs_exc

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

    def open_file(self, ctx, final, index):
        self.check_intent(ctx.intent, ctx.batch_id)
        folder = ctx.intent.get("staging") or self.batch_staging(ctx.query_name, ctx.batch_id)
        staging = self.join(folder, _staging_name(final, ctx, index))
        return staging, self.storage.create(staging)

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


# ----- S3 multipart uploads
class _S3Files(_Files):
    """S3: one multipart upload per part file, held open (invisible) until commit completes it.

    The upload goes straight to the final key: an open upload is invisible, so no
    staging copy or server-side rename is needed.  Completion carries
    ``If-None-Match: *`` so an existing foreign object is never overwritten; :meth:`check`
    proves at ``open()`` that the endpoint honours it (``s3_if_none_match``) and that its
    ETags follow the MD5 rule the "already committed" check relies on (``s3_etags``).
    """

    fs = "s3"

    def __init__(self, storage: Any, part_size: int, etags: str, if_none_match: str):
        super().__init__(storage)
        self.bucket: str = storage.bucket
        self.part_size = part_size
        self.etags = etags
        self.if_none_match = if_none_match

    def check(self) -> None:
        st = self.storage
        where = f"s3://{self.bucket}/{self.root}"
        st.check_bucket("FileSink")
        # One probe upload, with the configured extra parameters: proves we may write, that
        # completion honours If-None-Match, and what shape the endpoint's ETags have.
        probe = st.probe_multipart("FileSink")
        if not probe.conditional_complete:
            if self.if_none_match == "require":
                raise ConfigurationError(
                    f"FileSink target {where}: this S3 endpoint ignores If-None-Match on "
                    "CompleteMultipartUpload (a probe upload replaced an existing object), so a "
                    "commit could overwrite an object that is not this sink's. Use an endpoint "
                    "with conditional writes (AWS S3, MinIO), or opt in to FileSink(..., "
                    "s3_if_none_match='head-check'): each commit then checks the key with HEAD "
                    "first and refuses an existing object, but an object written between that "
                    "HEAD and the completion is overwritten."
                )
            log.warning(
                "%s ignores If-None-Match on CompleteMultipartUpload; "
                "s3_if_none_match='head-check': commits check the key with HEAD first (an object written in between is "
                "overwritten)",
                where,
            )
        if not probe.md5_etags and self.etags == "md5":
            raise ConfigurationError(
                f"FileSink target {where}: this S3 endpoint's multipart ETags do not follow the "
                f"MD5 rule (probe object {probe.etag or 'without ETag'}, rule "
                f"{probe.expected_etag or 'n/a'}; e.g. SSE-C, some S3-compatible stores), so after "
                "a crash FileSink could not recognise its own objects by ETag. Pass FileSink(..., "
                "s3_etags='opaque') to decide by size and by the upload being gone instead (then "
                "an object of the same size written by someone else after an abort would be "
                "taken for this sink's)."
            )

    def batch_staging(self, query_name, batch_id):
        return ""

    def open_file(self, ctx, final, index):
        self.check_intent(ctx.intent, ctx.batch_id)
        return None, self.storage.hold(final, self.part_size)

    def finish_file(self, f):
        from twophase.storage.s3 import multipart_etag

        size = f.stream.finish()
        up = f.stream
        return {
            "bucket": self.bucket,
            "key": f.final,
            "upload_id": up.upload_id,
            "parts": up.parts,
            "size": size,
            "etag": multipart_etag([p["etag"] for p in up.parts]),
        }

    def abort_file(self, f):
        f.stream.cancel()

    # paths read back from the log
    def check_entry(self, entry):
        where = f"s3://{self.bucket}/{self.storage.prefix}"
        if entry.get("bucket") != self.bucket:
            raise HandleError(
                f"a files handle names bucket {entry.get('bucket')!r}, but this sink writes to "
                f"{where}. {_TAMPERED}"
            )
        key = entry.get("key")
        prefix = self.storage.prefix
        rel = (
            key[len(prefix) :].split("/")
            if isinstance(key, str) and key.startswith(prefix)
            else None
        )
        if (
            rel is None
            or any(not seg or seg in (".", "..") or seg.startswith((".", "_")) for seg in rel)
            or not all("=" in seg for seg in rel[:-1])
        ):
            raise HandleError(
                f"a files handle names key {key!r}, which is not under {where} as a part file "
                f"(<prefix>[col=value/...]<name>, no '..'). {_TAMPERED}"
            )
        if not isinstance(entry.get("upload_id"), str) or not entry["upload_id"]:
            raise HandleError(f"a files handle for {where}{rel[-1]} has no upload id. {_TAMPERED}")

    def check_intent(self, intent, batch_id):
        record = f"the INTENT of batch {batch_id}"
        if intent.get("bucket", self.bucket) != self.bucket:
            raise HandleError(
                f"{record} names bucket {intent.get('bucket')!r}, but this sink writes to "
                f"s3://{self.bucket}/{self.storage.prefix}. {_TAMPERED}"
            )
        if intent.get("prefix", self.storage.prefix) != self.storage.prefix:
            raise HandleError(
                f"{record} names key prefix {intent.get('prefix')!r}, which is not this sink's "
                f"({self.storage.prefix!r} in s3://{self.bucket}). {_TAMPERED}"
            )

    # commit
    def _already(self, entry: dict[str, Any], head: dict[str, Any] | None) -> CommitResult | None:
        """ALREADY_COMMITTED when the object at the key is this upload's, else None."""
        if head is None:
            return None
        if self.etags == "md5":
            # The ETag S3 gives the completed object is predicted in the handle: only that is ours.
            expected = entry.get("etag")
            return (
                CommitResult.already_committed()
                if expected and head.get("ETag") == expected
                else None
            )
        # s3_etags='opaque' (ETags say nothing): Flink S3Committer's size rule, and only once our
        # upload is gone: while it is open, whatever object is at the key cannot be its result.
        if int(head.get("ContentLength", -1)) != int(entry["size"]):
            return None
        if self.storage.upload_alive(entry["key"], entry["upload_id"]):
            return None
        return CommitResult.already_committed(
            f"s3://{self.bucket}/{entry['key']}: decided by size only (s3_etags='opaque'): the "
            f"object has the expected {entry['size']} bytes and upload "
            f"{str(entry['upload_id'])[:16]}… no longer exists"
        )

    def _foreign(self, entry: dict[str, Any], head: dict[str, Any]) -> str:
        hint = (
            ""
            if entry.get("etag") or self.etags != "md5"
            else "; this handle has no expected ETag (the store's part ETags are not MD5s): "
            "see FileSink's s3_etags='opaque'"
        )
        return (
            f"{head.get('ContentLength')} bytes, ETag {head.get('ETag')}; "
            f"expected {entry['size']} bytes, ETag {entry.get('etag') or 'unknown'}{hint}"
        )

    def _not_completed(
        self, entry: dict[str, Any], head: dict[str, Any] | None, why: str
    ) -> CommitResult:
        """The outcome when this call did not complete the upload and the object is not ours."""
        bucket, key, up = self.bucket, entry["key"], entry["upload_id"]
        alive = self.storage.upload_alive(key, up)
        if head is not None:
            if alive:
                raise TwoPhaseError(
                    f"cannot commit s3://{bucket}/{key}: an object with that key already exists "
                    f"and is not this upload's ({self._foreign(entry, head)}). Move it aside and "
                    "restart; the upload is kept open."
                )
            return CommitResult.lost(
                f"upload {up} of s3://{bucket}/{key} no longer exists and the object "
                f"there is not its result ({self._foreign(entry, head)})"
            )
        if alive:
            return CommitResult.retry_later(
                f"CompleteMultipartUpload of s3://{bucket}/{key} failed: {why}"
            )
        return CommitResult.lost(
            f"upload {up} of s3://{bucket}/{key} no longer exists (aborted, or expired "
            "by a bucket lifecycle rule) and the object is absent"
        )

    def commit_file(self, entry):
        from twophase.storage.s3 import BotoCoreError, ClientError, s3_error

        key, up = entry["key"], entry["upload_id"]
        if self.if_none_match == "head-check":
            # The endpoint ignores If-None-Match (proved at open()): look before completing.  An
            # object written between this HEAD and the completion is overwritten (documented race).
            head = self.storage.head(key)
            if head is not None:
                return self._already(entry, head) or self._not_completed(
                    entry, head, "the key is taken"
                )
        try:
            self.storage.complete(key, up, entry["parts"])
            return CommitResult.committed()
        except (ClientError, BotoCoreError) as e:
            why = s3_error(e)
        # Did an earlier call complete it (NoSuchUpload / 412 / moto's 500), or is it foreign?
        head = self.storage.head(key)
        return self._already(entry, head) or self._not_completed(entry, head, why)

    def recover_file(self, entry):
        """After a restart: a file whose object is already there is not completed again."""
        return self._already(entry, self.storage.head(entry["key"])) or self.commit_file(entry)

    def abort_entry(self, entry):
        self.storage.abort(entry["key"], entry["upload_id"])

    def _lists_uploads_by_prefix(self) -> bool:
        return self.storage.lists_uploads_by_prefix()

    def _list_uploads(self, prefix: str | None) -> list[dict[str, Any]]:
        return self.storage._list_uploads(prefix)

    def abort_lingering(self, query_name, batch_id, intent, keep, name_prefix):
        self.check_intent(intent, batch_id)
        prefix = self.storage.prefix
        keep_ids = {e["upload_id"] for e in keep}
        n = 0
        for u in self.storage.open_uploads(prefix):
            rel = u["Key"][len(prefix) :]
            segs = rel.split("/")
            # Only this batch's part files: <k=v/>*<name_prefix>..., never other batches or
            # foreign keys.
            if not segs[-1].startswith(name_prefix) or not all("=" in s for s in segs[:-1]):
                continue
            if u["UploadId"] in keep_ids:
                continue
            self.storage.abort(u["Key"], u["UploadId"])
            n += 1
        return n

    def describe(self, entry):
        return (
            f"s3 object s3://{entry.get('bucket')}/{entry.get('key')} "
            f"(upload {str(entry.get('upload_id'))[:16]}…, "
            f"{len(entry.get('parts', []))} parts, {entry.get('size')} bytes)"
        )


_FILES: dict[str, type[_Files]] = {"local": _LocalFiles, "hdfs": _HdfsFiles, "s3": _S3Files}


# ------------------------------------------------------------------------------ sink
class FileSink(TwoPhaseCommitSink[FileTransaction, dict]):
    """Write each batch as part files under ``url`` (a directory or S3 prefix), exactly once.

    ``url``: a local path or ``file://``; ``hdfs://namenode:8020/path`` or
    ``webhdfs://namenode:9870/path`` (storage options ``webhdfs_url``, ``webhdfs_port``,
    ``user``, ``timeout``; an ``hdfs://`` URL reaches WebHDFS on port 9870 unless
    ``webhdfs_url`` says otherwise); ``s3://bucket/prefix`` (storage options with s3fs's
    names: ``key``, ``secret``, ``token`` (best as ``{"env": "VAR"}``), ``anon``,
    ``endpoint_url``, ``region_name``, ``profile``, ``use_ssl``, ``requester_pays``,
    ``client_kwargs``, ``config_kwargs``, ``s3_additional_kwargs`` such as
    ``{"ServerSideEncryption": "aws:kms"}``).  An option a backend does not take is refused.

    ``format``: ``parquet`` (default), ``jsonl`` or ``csv`` (both as Spark's JSON and CSV
    writers write them with their defaults; ``header=True`` starts each csv file with the column
    names, as Spark's ``header`` option does).  ``compression``: the
    Parquet codec (``snappy`` default, ``zstd``, ``gzip``, ``lz4``, ``brotli``, ``none``)
    or, for jsonl/csv, a whole-file codec (``gzip``, ``bz2``, ``zstd``) that adds
    ``.gz``/``.bz2``/``.zst``.  ``prefix`` starts every part name:
    ``{prefix}-{batch:08d}-{partition:05d}.{ext}``.  ``fsync`` (local disk, default
    on) makes a pre-committed part survive a machine crash, not only a process crash.

    ``partition_by``: Hive-style output ``col=value/...`` (partition columns are not
    written into the files).  ``partition_values``: ``"escape"`` (default; Hive/Spark
    ``%XX`` escaping, read back unchanged by Spark) or ``"reject"`` (a value that needs
    escaping, or ``.``/``..``, fails the task with an error naming it).

    S3 only: ``part_size``, bytes per uploaded part, at least 5 MiB (each open part file
    holds one part in memory).  ``s3_etags``: ``"md5"`` (default) recognises an object as
    this sink's after a crash by its multipart ETag, and ``open()`` refuses an endpoint
    whose ETags do not follow that rule; ``"opaque"`` decides by size once the upload is
    gone.  ``s3_if_none_match``: ``"require"`` (default) refuses at ``open()`` an endpoint
    that ignores ``If-None-Match`` on completion; ``"head-check"`` accepts it and checks the
    key with HEAD before each completion (an object written in between is overwritten).
    """

    kind = "files"
    #: v1: local single file ``{"staging","final","size","rows"}`` (still written for that case);
    #: v2: ``{"fs": "local"|"hdfs"|"s3", "rows", "files": [...]}``.
    handle_version = 2
    handle_versions = frozenset({1, 2})

    def __init__(
        self,
        url: str,
        format: str = "parquet",
        *,
        prefix: str = "part",
        compression: str | None = None,
        fsync: bool = True,
        storage_options: dict[str, Any] | None = None,
        partition_by: list[str] | None = None,
        partition_values: str = "escape",
        part_size: int = DEFAULT_PART_SIZE,
        s3_etags: str = "md5",
        s3_if_none_match: str = "require",
        header: bool = False,
    ):
        if format not in FORMATS:
            raise ConfigurationError(f"unknown format {format!r}; use one of parquet, jsonl, csv")
        if not prefix or _safe(prefix) != prefix or prefix.startswith(("_", ".")):
            raise ConfigurationError(
                f"prefix {prefix!r} must be letters, digits, '-', '_' or '.', "
                "and not start with '_' or '.' (readers would ignore the files)"
            )
        fmt = FORMATS[format]
        if compression is not None:
            compression = compression.lower()
            allowed = PARQUET_CODECS if fmt == "parquet" else set(TEXT_CODECS)
            if compression not in allowed:
                raise ConfigurationError(
                    f"compression {compression!r} is not available for {fmt}; use one of "
                    f"{', '.join(sorted(allowed))}"
                )
        if header and fmt != "csv":
            raise ConfigurationError(f"header=True is a csv option; format is {fmt}")
        if partition_values not in ("escape", "reject"):
            raise ConfigurationError(
                "partition_values must be 'escape' (Hive-style %XX) or 'reject'"
            )
        cols = list(partition_by or [])
        for c in cols:
            if (
                not isinstance(c, str)
                or not c
                or _ESCAPE.intersection(c)
                or c in (".", "..")
                or c.startswith(("_", "."))
            ):
                raise ConfigurationError(
                    f"partition_by column {c!r} cannot name a directory: use a plain "
                    "column name without '/', '=', '%', control characters or a leading "
                    "'_'/'.'"
                )
        if len(set(cols)) != len(cols):
            raise ConfigurationError(f"partition_by lists a column twice: {cols}")
        if not isinstance(part_size, int) or not S3_MIN_PART <= part_size <= S3_MAX_PART:
            raise ConfigurationError(
                f"part_size must be between 5 MiB and 5 GiB (S3 limits), got {part_size!r}"
            )
        if s3_etags not in ("md5", "opaque"):
            raise ConfigurationError(
                f"s3_etags must be 'md5' (the default: an object is recognised as this "
                f"sink's by its multipart ETag) or 'opaque' (by size, for stores whose "
                f"ETags are not MD5-based), got {s3_etags!r}"
            )
        if s3_if_none_match not in ("require", "head-check"):
            raise ConfigurationError(
                f"s3_if_none_match must be 'require' (the default) or 'head-check', got "
                f"{s3_if_none_match!r}"
            )
        so = dict(storage_options or {})
        self.scheme = scheme_of(url)
        spec = backend_for(url)
        if spec is None or spec.name not in _FILES or spec.storage is None:
            raise ConfigurationError(
                f"FileSink does not support {self.scheme}:// (local paths, file://, hdfs://, "
                "webhdfs://, s3://)"
            )
        storage_cls = spec.load(spec.storage)
        if spec.name == "local":
            self._backend: _Files = _LocalFiles(storage_cls(url, so, fsync=fsync))
        elif spec.name == "hdfs":
            self._backend = _HdfsFiles(storage_cls(url, so))
        else:
            self._backend = _S3Files(storage_cls(url, so), part_size, s3_etags, s3_if_none_match)
        self.url = url
        self.root = self._backend.root
        self.format = fmt
        self.prefix = prefix
        self.compression = compression
        self.fsync = fsync
        self.storage_options = so
        self.partition_by = cols
        self.partition_values = partition_values
        self.part_size = part_size
        self.s3_etags = s3_etags
        self.s3_if_none_match = s3_if_none_match
        self.header = bool(header)

    def __repr__(self) -> str:  # never the storage options: they may hold credentials
        return f"FileSink({self.url!r}, format={self.format!r})"

    @property
    def fs(self) -> str:
        """``"local"``, ``"hdfs"`` or ``"s3"``."""
        return self._backend.fs

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """The config for ``twophase recover``; credentials only as ``{"env": ...}`` references.

        Raises ConfigurationError if a credential was given by value: write it as
        ``{"env": "VAR"}`` (or rely on the default AWS credential chain).
        """
        cfg: dict[str, Any] = {
            "sink": self.kind,
            "url": self.url,
            "format": self.format,
            "prefix": self.prefix,
            "compression": self.compression,
            "fsync": self.fsync,
        }
        if self.partition_by:
            cfg["partition_by"] = list(self.partition_by)
            cfg["partition_values"] = self.partition_values
        if self.part_size != DEFAULT_PART_SIZE:
            cfg["part_size"] = self.part_size
        if self.s3_etags != "md5":
            cfg["s3_etags"] = self.s3_etags
        if self.s3_if_none_match != "require":
            cfg["s3_if_none_match"] = self.s3_if_none_match
        if self.header:
            cfg["header"] = True
        if self.storage_options:
            cfg["storage_options"] = _config_options(self.storage_options)
        return cfg

    # ------------------------------------------------------------------- paths
    def _batch_staging(self, query_name: str, batch_id: int) -> str:
        return self._backend.batch_staging(query_name, batch_id)

    def _ext(self) -> str:
        ext = _EXT[self.format]
        if self.format != "parquet" and self.compression:
            ext += TEXT_CODECS[self.compression]
        return ext

    def _name_prefix(self, batch_id: int) -> str:
        return f"{self.prefix}-{batch_id:08d}-"

    def final_name(self, batch_id: int, partition_id: int) -> str:
        return f"{self.prefix}-{batch_id:08d}-{partition_id:05d}.{self._ext()}"

    # ---------------------------------------------------------------- driver
    def open(self) -> None:
        """Check that the target exists or can be created and is writable (driver)."""
        self._backend.check()

    def executor_modules(self) -> list[str]:
        extra = {"s3": ["botocore"], "hdfs": ["hdfs", "requests"]}.get(self.fs, [])
        return ["pyarrow", *extra]

    def local_paths(self) -> list[str]:
        return [self.root] if self.fs == "local" else []

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        if self.fs == "s3":
            b = self._backend
            assert isinstance(b, _S3Files)
            return {
                "fs": "s3",
                "bucket": b.bucket,
                "prefix": b.storage.prefix,
                "names": self._name_prefix(batch_id),
            }
        intent = {"staging": self._batch_staging(query_name, batch_id)}
        if self.fs != "local":
            intent["fs"] = self.fs
        return intent

    # -------------------------------------------------------------- executor
    def _open_file(self, txn: FileTransaction, key: tuple) -> _OpenFile:
        ctx = txn.ctx
        b = self._backend
        name = self.final_name(ctx.batch_id, ctx.partition_id)
        if self.partition_by:
            final = b.join(b.root, *key, name)  # key: the partition directory names
        else:
            final = b.join(b.root, name)
        staging, stream = b.open_file(ctx, final, len(txn.files))
        writer = _FormatWriter(self.format, stream, self.compression, self.header)
        f = _OpenFile(final, staging, stream, writer)
        txn.files[key] = f
        return f

    def begin_transaction(self, ctx: TransactionContext) -> FileTransaction:
        txn = FileTransaction(ctx)
        if not self.partition_by:
            self._open_file(txn, ())
        return txn

    def write(self, txn: FileTransaction, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:  # an empty batch may carry null-typed columns; it adds nothing
            return
        if not self.partition_by:
            f = txn.files[()]
            f.writer.write(batch)
            f.rows += batch.num_rows
        else:
            missing = [c for c in self.partition_by if c not in batch.schema.names]
            if missing:
                raise ConfigurationError(
                    f"partition_by column(s) {missing} are not in the data "
                    f"(columns: {batch.schema.names})"
                )
            if len(self.partition_by) == batch.num_columns:
                raise ConfigurationError(
                    "every column is a partition column: nothing would be left to "
                    "write into the files"
                )
            for values, rb in _split_by_partition(batch, self.partition_by):
                try:
                    # Keyed by directory, not raw value: null and "" share the default partition.
                    segs = tuple(
                        partition_segment(c, v, self.partition_values)
                        for c, v in zip(self.partition_by, values)
                    )
                except ValueError as e:
                    raise TwoPhaseError(f"{txn.ctx.label}: {e}") from None
                f = txn.files.get(segs) or self._open_file(txn, segs)
                f.writer.write(rb)
                f.rows += rb.num_rows
            self._bound_pending(txn)
        txn.rows += batch.num_rows

    @staticmethod
    def _bound_pending(txn: FileTransaction) -> None:
        """With many open files (partition_by), keep the rows gathered for Parquet row groups
        within one row group's budget per task: encode the biggest pending ones first."""
        limit = _FormatWriter.ROW_GROUP_BYTES
        total = sum(f.writer.pending_bytes for f in txn.files.values())
        if total <= limit:
            return
        for f in sorted(txn.files.values(), key=lambda f: f.writer.pending_bytes, reverse=True):
            if total <= limit // 2:
                break
            total -= f.writer.pending_bytes
            f.writer.flush_row_group()

    def pre_commit(self, txn: FileTransaction) -> dict:
        entries = []
        for f in txn.files.values():
            f.writer.close()
            e = self._backend.finish_file(f)
            e["rows"] = f.rows
            entries.append(e)
        txn.closed = True
        if self.fs == "local" and not self.partition_by:
            e = entries[0]
            return {
                "staging": e["staging"],
                "final": e["final"],
                "size": e["size"],
                "rows": txn.rows,
            }
        return {"fs": self.fs, "rows": txn.rows, "files": entries}

    def abort(self, txn: FileTransaction) -> None:
        for f in txn.files.values():
            if not txn.closed:
                try:
                    f.writer.discard()
                except Exception:
                    pass
            try:
                self._backend.abort_file(f)
            except Exception:  # best effort; abort_lingering finds leftovers by the batch's INTENT
                log.warning("abort of %s failed", f.final, exc_info=True)
        txn.closed = True

    # ---------------------------------------------------------------- handles
    def _entries(self, handle: dict) -> list[dict[str, Any]]:
        fs = handle.get("fs", "local")
        if fs != self.fs:
            raise HandleError(
                f"handle is for a {fs} FileSink but this sink writes to {self.fs} ({self.url}); "
                "recover with the sink configuration the batch was written with"
            )
        entries = list(handle["files"]) if "files" in handle else [handle]
        for e in entries:
            if not isinstance(e, dict):
                raise HandleError(f"a files handle entry is not an object: {str(e)[:80]!r}")
            self._backend.check_entry(e)
        return entries

    def encode_handle(self, handle: dict) -> dict[str, Any]:
        from twophase import handles as _handles

        version = 1 if "files" not in handle else 2
        return _handles.encode(self.kind, version, self.handle_to_json(handle))

    def handle_from_json(self, data: dict[str, Any], version: int) -> dict:
        if version == 1 and not {"staging", "final", "size"} <= data.keys():
            raise HandleError(f"files handle v1 needs staging, final and size: {sorted(data)}")
        if version == 2 and not isinstance(data.get("files"), list):
            raise HandleError("files handle v2 needs a 'files' list")
        return data

    # ---------------------------------------------------------------- driver
    def commit(self, handle: dict) -> CommitResult:
        """Make every file of the handle visible; idempotent, file by file (driver)."""
        return _combine([self._backend.commit_file(e) for e in self._entries(handle)])

    def recover_and_commit(self, handle: dict) -> CommitResult:
        """After a restart: on S3, a file whose object is already there is not completed again."""
        return _combine([self._backend.recover_file(e) for e in self._entries(handle)])

    def recover_and_abort(self, handle: dict) -> None:
        for e in self._entries(handle):
            self._backend.abort_entry(e)

    def abort_lingering(
        self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict]
    ) -> int:
        kept = [e for h in keep for e in self._entries(h)]
        return self._backend.abort_lingering(
            query_name, batch_id, intent, kept, self._name_prefix(batch_id)
        )

    def describe_handle(self, handle: dict) -> str:
        try:
            entries = self._entries(handle)
        except (HandleError, KeyError):
            return super().describe_handle(handle)
        if len(entries) == 1 and "files" not in handle:
            e = entries[0]
            return f"file {e.get('final')} (staged {e.get('staging')}, {e.get('size')} bytes)"
        first = self._backend.describe(entries[0]) if entries else "no files"
        return first if len(entries) == 1 else f"{len(entries)} {self.fs} files, first {first}"


def _combine(results: list[CommitResult]) -> CommitResult:
    """One outcome for a handle's files: the first not-done outcome, else committed/already."""
    for r in results:
        if not r.done:
            return r
    if all(r.outcome is CommitOutcome.ALREADY_COMMITTED for r in results):
        # keep what each file's decision rested on (e.g. "decided by size only")
        return CommitResult.already_committed("; ".join(r.reason for r in results if r.reason))
    return CommitResult.committed()


def _config_options(so: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in so.items():
        if k in _SECRET_OPTIONS and v is not None and not is_secret_ref(v):
            raise ConfigurationError(
                f"storage option {k!r} is given by value; the sink config is written to disk and "
                f'shown by tools, so give it as {{"env": "VARIABLE"}} (or leave it out and use the default '
                "credential chain) to make this sink rebuildable for 'twophase recover'"
            )
        out[k] = _config_options(v) if isinstance(v, dict) and not is_secret_ref(v) else v
    return out


def __getattr__(name: str) -> Any:
    # The log's HDFS and S3 stores lived here before twophase.storage; old imports keep working.
    if name in ("HdfsLogStore", "S3LogStore"):
        from twophase.storage import hdfs, s3

        return getattr(hdfs if name == "HdfsLogStore" else s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
