"""S3 storage primitives: one bucket and key prefix, objects, held multipart uploads, probes.

:class:`S3Storage` is what FileSink and the log use on S3: conditional puts, listing, deleting,
multipart uploads held open (an open upload is an invisible, durable file: "hold", then
complete or abort; :class:`S3Upload` streams into one) and the probes that prove what an
endpoint honours (:class:`MultipartProbe`).  Its client comes from
:mod:`~twophase.storage.s3_client`.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.storage._base import ChunkedWriter
from twophase.storage.s3_client import (
    BotoCoreError,
    ClientError,
    _botocore,
    _refused_condition,
    _resolved,
    check_s3_options,
    s3_client,
    s3_code,
    s3_error,
    s3_status,
)

log = logging.getLogger("twophase.storage.s3")

MIB = 1 << 20
#: Every part but the last must be at least 5 MiB; at most 10,000 parts per upload.
MIN_PART = 5 * MIB
MAX_PART = 5 * 1024 * MIB
MAX_PARTS = 10_000
#: The prefix (under the sink's root) of probe objects and uploads; removed at once.
PROBE_PREFIX = "_twophase"


def multipart_etag(etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart object: md5 of the parts' binary md5s, ``-N``."""
    try:
        digest = hashlib.md5(
            b"".join(bytes.fromhex(t.strip('"')) for t in etags), usedforsecurity=False
        )
    except ValueError:
        return ""  # ETags that are not MD5s (SSE-KMS, some S3-compatible stores)
    return f'"{digest.hexdigest()}-{len(etags)}"'


class S3Upload(ChunkedWriter):
    """A write-only stream into one S3 multipart upload, uploading parts while the next is encoded.

    Parts are handed to a small thread pool as soon as ``part_size`` bytes are
    buffered, so encoding and uploading overlap; at most ``IN_FLIGHT`` parts are
    uploading at a time (memory: about ``IN_FLIGHT + 1`` parts).  :meth:`finish`
    uploads the last (possibly small) part, waits for all, and does NOT complete the
    upload: an open upload is invisible, survives the writer, and is the held file.
    """

    IN_FLIGHT = 2

    def __init__(self, storage: S3Storage, key: str, part_size: int):
        super().__init__()
        self.storage, self.key, self.part_size = storage, key, part_size
        self.bucket = storage.bucket
        self.chunk_size = part_size
        self.upload_id: str | None = None
        self._next = 1
        self._pending: list[Any] = []  # futures of parts still uploading, in part order
        self._done: list[dict[str, Any]] = []
        self._pool: Any = None

    @property
    def parts(self) -> list[dict[str, Any]]:
        """The uploaded parts so far, in part-number order: ``{"n", "etag"}``."""
        return sorted(self._done, key=lambda p: p["n"])

    def _start(self) -> None:
        if self.upload_id is None:
            self.upload_id = self.storage.call("CreateMultipartUpload", Key=self.key)["UploadId"]

    def _upload_part(self, n: int, data: bytes) -> dict[str, Any]:
        r = self.storage.call(
            "UploadPart", Key=self.key, UploadId=self.upload_id, PartNumber=n, Body=data
        )
        return {"n": n, "etag": r["ETag"]}

    def _reap(self, keep: int) -> None:
        """Wait until at most ``keep`` parts are still uploading; a failed part fails the write."""
        while len(self._pending) > keep:
            self._done.append(self._pending.pop(0).result())

    def _upload(self, data: bytes) -> None:
        self._start()
        n = self._next
        if n > MAX_PARTS:
            raise TwoPhaseError(
                f"s3://{self.bucket}/{self.key} would need more than {MAX_PARTS} parts; "
                "raise part_size"
            )
        self._next += 1
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=self.IN_FLIGHT, thread_name_prefix="twophase-s3-part"
            )
        self._reap(self.IN_FLIGHT - 1)
        self._pending.append(self._pool.submit(self._upload_part, n, data))

    def _emit(self, data: bytes) -> None:
        self._upload(data)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def finish(self) -> int:
        """Upload what is left and wait for every part; the upload stays open.  Returns the size."""
        try:
            if self._buf or self._next == 1:
                self._upload(bytes(self._buf))
                self._buf.clear()
            self._reap(0)
        finally:
            self._shutdown()
        self.closed = True
        return self._pos

    def cancel(self) -> None:
        """Stop and abort the upload (best effort: leftovers are found by listing later)."""
        self.closed = True
        self._buf = bytearray()
        self._pending.clear()
        self._shutdown()  # parts still uploading finish first, so the abort below is the last word
        if self.upload_id is not None:
            try:
                self.storage.call("AbortMultipartUpload", Key=self.key, UploadId=self.upload_id)
            except Exception:
                log.warning(
                    "could not abort upload of s3://%s/%s", self.bucket, self.key, exc_info=True
                )


@dataclass(frozen=True)
class MultipartProbe:
    """What a probe upload showed about an endpoint (:meth:`S3Storage.probe_multipart`)."""

    conditional_complete: bool
    """CompleteMultipartUpload with ``If-None-Match: *`` over an existing object was refused."""
    md5_etags: bool
    """The completed object's ETag is the MD5 rule's (md5 of the parts' MD5s, ``-N``)."""
    etag: str
    expected_etag: str


class S3Storage:
    """One bucket and key prefix, as FileSink and the log use it (paths are object keys).

    Storage options are s3fs's (:data:`OPTIONS`), checked when built; ``s3_additional_kwargs``
    and ``requester_pays`` are added to every call whose input takes them, as s3fs does.
    Holds only configuration when pickled (clients are rebuilt, and cached, on executors).
    """

    name = "s3"

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        parts = urlsplit(url)
        if not parts.netloc:
            raise ConfigurationError(f"{url}: an S3 URL is s3://bucket/prefix")
        self.url = url
        self.bucket = parts.netloc
        self.root = parts.path.strip("/")  # key prefix without slashes ('' = bucket root)
        self.storage_options = check_s3_options(f"S3 storage options for {url}", storage_options)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_c_")}

    @staticmethod
    def join(*parts: str) -> str:
        return "/".join(p.strip("/") for p in parts if p.strip("/"))

    @property
    def prefix(self) -> str:
        """The key prefix of everything under the root: ``root/`` ('' at the bucket root)."""
        return self.root + "/" if self.root else ""

    @property
    def client(self):
        c = getattr(self, "_c_client", None)
        if c is None:
            c = self._c_client = s3_client(self.storage_options)
        return c

    @property
    def commit_client(self):
        """A client that tries each call once.  moto answers HTTP 500 (not NoSuchUpload) for an
        unknown upload id and botocore would retry 500s; the caller decides by HEAD and ListParts
        what to do next, and retries a completion that got no answer itself."""
        c = getattr(self, "_c_commit", None)
        if c is None:
            c = self._c_commit = s3_client(self.storage_options, max_attempts=0)
        return c

    def _extra(self, op: str) -> dict[str, Any]:
        """The ``s3_additional_kwargs`` (and ``RequestPayer``) that ``op`` takes (s3fs's filter)."""
        cache: dict[str, dict[str, Any]] | None = getattr(self, "_c_extra", None)
        if cache is None:
            cache = {}
            self._c_extra = cache
        if op not in cache:
            extra = _resolved(
                dict(self.storage_options.get("s3_additional_kwargs") or {}),
                "S3 storage option s3_additional_kwargs",
            )
            if self.storage_options.get("requester_pays"):
                extra.setdefault("RequestPayer", "requester")
            members = self.client.meta.service_model.operation_model(op).input_shape.members
            cache[op] = {k: v for k, v in extra.items() if k in members}
        return cache[op]

    def call(self, op: str, *, once: bool = False, **kwargs: Any) -> dict[str, Any]:
        """Call S3 operation ``op`` (e.g. ``"PutObject"``) on this bucket with the configured extra
        parameters; ``once``: no retries (see :attr:`commit_client`)."""
        client = self.commit_client if once else self.client
        return getattr(client, _botocore.xform_name(op))(
            Bucket=self.bucket, **self._extra(op), **kwargs
        )

    # ---------------------------------------------------------------- objects
    def check_bucket(self, who: str) -> None:
        """ConfigurationError unless the bucket exists and answers (``who`` names the user)."""
        where = f"s3://{self.bucket}/{self.root}"
        try:
            self.call("HeadBucket")
        except ClientError as e:
            status = s3_status(e)
            if status == 404 or s3_code(e) in ("NoSuchBucket", "404"):
                raise ConfigurationError(
                    f"{who} target {where}: bucket {self.bucket!r} does not exist; create it first"
                ) from None
            raise ConfigurationError(
                f"{who} target {where}: bucket {self.bucket!r} is not accessible "
                f"({s3_code(e)}, HTTP {status}); check credentials and permissions"
            ) from None
        except BotoCoreError as e:
            raise ConfigurationError(
                f"{who} cannot reach S3 for {where}: {type(e).__name__}: {e}"
            ) from None

    def head(self, key: str) -> dict[str, Any] | None:
        try:
            return self.call("HeadObject", Key=key)
        except ClientError as e:
            if s3_status(e) == 404:
                return None
            raise

    def get(self, key: str) -> bytes | None:
        try:
            return self.call("GetObject", Key=key)["Body"].read()
        except ClientError as e:
            if s3_status(e) == 404:
                return None
            raise

    def put(self, key: str, data: bytes) -> None:
        self.call("PutObject", Key=key, Body=data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        """PutObject with ``If-None-Match: *``: False if the key exists (HTTP 412).  Only exclusive
        where the endpoint honours the condition (:meth:`honours_conditional_put`)."""
        for attempt in range(5):
            try:
                self.call("PutObject", Key=key, Body=data, IfNoneMatch="*")
                return True
            except ClientError as e:
                if s3_status(e) == 412:
                    return False
                if (
                    s3_status(e) == 409 and attempt < 4
                ):  # ConditionalRequestConflict: a racing write
                    time.sleep(0.2 * (attempt + 1))
                    continue
                raise
        return False

    def delete(self, key: str) -> None:
        self.call("DeleteObject", Key=key)

    def list_names(self, prefix: str) -> list[str]:
        """Names directly under ``prefix`` (a ``/``-ended key prefix, or '')."""
        names: list[str] = []
        kwargs: dict[str, Any] = {"Prefix": prefix, "Delimiter": "/"}
        while True:
            r = self.call("ListObjectsV2", **kwargs)
            names += [o["Key"][len(prefix) :] for o in r.get("Contents", [])]
            if not r.get("IsTruncated"):
                return names
            kwargs["ContinuationToken"] = r["NextContinuationToken"]

    def honours_conditional_put(self, key: str) -> bool:
        """Write ``key`` twice with ``If-None-Match: *`` and delete it: True if the second write
        was refused, as it must be for create to be exclusive."""
        self.call("PutObject", Key=key, Body=b"1", IfNoneMatch="*")
        honoured = False
        try:
            self.call("PutObject", Key=key, Body=b"2", IfNoneMatch="*")
        except ClientError as e:
            honoured = _refused_condition(e)
            if not honoured:
                raise
        finally:
            self.delete(key)
        return honoured

    # ------------------------------------------------------ multipart uploads
    def hold(self, key: str, part_size: int) -> S3Upload:
        """A stream into a new multipart upload at ``key`` that stays open (invisible) until
        :meth:`complete` or :meth:`abort`."""
        return S3Upload(self, key, part_size)

    def complete(
        self, key: str, upload_id: str, parts: list[dict[str, Any]], if_none_match: bool = True
    ) -> None:
        """CompleteMultipartUpload, tried once; with ``if_none_match`` (``If-None-Match: *``) an
        existing object is not replaced where the endpoint honours it.  Raises ClientError /
        BotoCoreError."""
        cond = {"IfNoneMatch": "*"} if if_none_match else {}
        self.call(
            "CompleteMultipartUpload",
            once=True,
            Key=key,
            UploadId=upload_id,
            MultipartUpload={"Parts": [{"PartNumber": p["n"], "ETag": p["etag"]} for p in parts]},
            **cond,
        )

    def abort(self, key: str, upload_id: str) -> None:
        """Abort an upload; one that no longer exists is fine."""
        try:
            self.call("AbortMultipartUpload", Key=key, UploadId=upload_id)
        except ClientError as e:
            if s3_code(e) != "NoSuchUpload" and s3_status(e) != 404:
                raise

    def upload_alive(self, key: str, upload_id: str) -> bool:
        """Does the upload still exist (neither completed nor aborted)?"""
        try:
            self.call("ListParts", Key=key, UploadId=upload_id, MaxParts=1)
            return True
        except ClientError as e:
            if s3_code(e) == "NoSuchUpload" or s3_status(e) == 404:
                return False
            raise

    def _list_uploads(self, prefix: str | None) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {}
        if prefix:
            kwargs["Prefix"] = prefix
        while True:
            r = self.call("ListMultipartUploads", **kwargs)
            out += r.get("Uploads", [])
            if not r.get("IsTruncated"):
                return out
            kwargs.update(
                KeyMarker=r.get("NextKeyMarker"), UploadIdMarker=r.get("NextUploadIdMarker")
            )

    def lists_uploads_by_prefix(self) -> bool:
        """Does the endpoint filter ListMultipartUploads by a key *prefix*?  S3 and moto do; MinIO
        matches ``prefix`` only against whole keys (a directory prefix lists nothing) but lists
        every upload of the bucket without one.  Probed once per process with an upload of our
        own under the staging prefix, aborted at once."""
        known = getattr(self, "_c_prefix_listing", None)
        if known is not None:
            return known
        folder = self.join(self.root, PROBE_PREFIX) if self.root else PROBE_PREFIX
        key = f"{folder}/probe-{uuid.uuid4().hex}"
        up = self.call("CreateMultipartUpload", Key=key)["UploadId"]
        try:
            seen = self._list_uploads(folder + "/")
            works = any(u["UploadId"] == up for u in seen)
        finally:
            self.abort(key, up)
        if not works:
            log.info(
                "s3://%s: this endpoint lists multipart uploads only by whole key (as MinIO does); "
                "leftover uploads are found by listing the bucket's uploads and filtering them",
                self.bucket,
            )
        self._c_prefix_listing = works
        return works

    def open_uploads(self, prefix: str) -> list[dict[str, Any]]:
        """Every open multipart upload under ``prefix`` in the bucket (Key, UploadId, Initiated)."""
        if not prefix or self.lists_uploads_by_prefix():
            return self._list_uploads(prefix)
        return [u for u in self._list_uploads(None) if u["Key"].startswith(prefix)]

    def probe_multipart(self, who: str) -> MultipartProbe:
        """Prove what the endpoint does with our uploads, with the configured extra parameters
        (encryption, metadata ...): one probe object under the root, completed, then a second
        upload completed over it with ``If-None-Match: *`` (which must be refused); both removed.

        ConfigurationError if we may not create, complete or delete uploads under the root.
        """
        key = self.join(self.root, f"{PROBE_PREFIX}-probe-{uuid.uuid4().hex}")
        where = f"s3://{self.bucket}/{self.root}"

        def upload(body: bytes) -> tuple[str, list[dict[str, Any]]]:
            up = self.call("CreateMultipartUpload", Key=key)["UploadId"]
            try:
                etag = self.call("UploadPart", Key=key, UploadId=up, PartNumber=1, Body=body)[
                    "ETag"
                ]
            except BaseException:
                self.abort(key, up)
                raise
            return up, [{"n": 1, "etag": etag}]

        try:
            up, parts = upload(b"twophase probe 1")
            try:
                self.complete(key, up, parts)
            except BaseException:
                self.abort(key, up)
                raise
            try:
                head = self.head(key) or {}
                expected = multipart_etag([p["etag"] for p in parts])
                actual = str(head.get("ETag", ""))
                up2, parts2 = upload(b"twophase probe 2")
                try:
                    self.complete(key, up2, parts2)
                    conditional = False  # completed over the existing object: nothing left to abort
                except ClientError as e:
                    self.abort(key, up2)
                    if not _refused_condition(e):
                        raise
                    conditional = True
            finally:
                self.delete(key)
        except ClientError as e:
            raise ConfigurationError(f"{who} cannot write to {where}: {s3_error(e)}") from None
        return MultipartProbe(conditional, bool(expected) and actual == expected, actual, expected)
