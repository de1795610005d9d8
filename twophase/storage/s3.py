"""S3 through botocore: conditional puts, held multipart uploads, listing, and the probes
that prove what an endpoint honours.

:class:`S3Storage` holds the primitives FileSink uses (an open multipart upload is an
invisible, durable file: "hold", then complete or abort); :class:`S3LogStore` is the
transaction log on S3, only where the endpoint honours ``If-None-Match: *``.  Storage
options follow s3fs.  Needs ``pip install 'twophase[s3]'``.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import posixpath
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from twophase._deps import require
from twophase.config import is_secret_ref, resolve_secret
from twophase.errors import ConfigurationError, HandleError, LogError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.storage._base import ChunkedWriter, LogStore, check_options
from twophase.storage.parts import TAMPERED, PartFiles

_botocore = require("botocore", "S3 storage (s3://)", extra="s3")
_exc = require("botocore.exceptions", "S3 storage (s3://)", extra="s3")
_config = require("botocore.config", "S3 storage (s3://)", extra="s3")
_session = require("botocore.session", "S3 storage (s3://)", extra="s3")
ClientError = _exc.ClientError
BotoCoreError = _exc.BotoCoreError

log = logging.getLogger("twophase.storage.s3")

MIB = 1 << 20
#: Every part but the last must be at least 5 MiB; at most 10,000 parts per upload.
MIN_PART = 5 * MIB
MAX_PART = 5 * 1024 * MIB
MAX_PARTS = 10_000
#: The prefix (under the sink's root) of probe objects and uploads; removed at once.
PROBE_PREFIX = "_twophase"

#: The storage options taken, with s3fs's names and meaning (``s3fs.S3FileSystem``'s arguments).
OPTIONS = {
    "key": "access key id (best as {'env': 'VAR'})",
    "secret": "secret access key (best as {'env': 'VAR'})",
    "token": "session token",
    "username": "same as key",
    "password": "same as secret",
    "anon": "unsigned requests, no credentials",
    "endpoint_url": "an S3-compatible endpoint",
    "region_name": "the region (twophase's shorthand for client_kwargs={'region_name': ...})",
    "profile": "a profile of the AWS config files",
    "use_ssl": "HTTPS (default true)",
    "requester_pays": "pay for requests to a requester-pays bucket",
    "client_kwargs": "arguments of botocore's create_client (region_name, verify, ...)",
    "config_kwargs": "arguments of botocore.config.Config (retries, connect_timeout, s3, ...)",
    "s3_additional_kwargs": "parameters added to every S3 call that takes them "
    "(ServerSideEncryption, "
    "SSEKMSKeyId, Metadata, ...)",
}
_S3FS_CACHES = "an s3fs cache setting; twophase keeps no such cache, so it would have no effect"
#: s3fs (and botocore) options users may pass, and why they are not taken.
REFUSED = {
    "session": "a botocore session cannot be saved in the sink's config; use profile or key/secret",
    "default_block_size": "FileSink's upload part size is its part_size argument",
    "fixed_upload_size": "FileSink's upload part size is its part_size argument",
    "max_concurrency": "each part file uploads at most two parts at a time",
    "version_aware": "FileSink only creates objects and never reads versions",
    "cache_regions": "give the bucket's region as region_name",
    "asynchronous": "twophase's S3 client is synchronous",
    "loop": "twophase's S3 client is synchronous",
    "default_fill_cache": _S3FS_CACHES,
    "default_cache_type": _S3FS_CACHES,
    "use_listings_cache": _S3FS_CACHES,
    "listings_expiry_time": _S3FS_CACHES,
    "max_paths": _S3FS_CACHES,
    "skip_instance_cache": _S3FS_CACHES,
    "aws_access_key_id": "s3fs calls it key (or put it in client_kwargs)",
    "aws_secret_access_key": "s3fs calls it secret (or put it in client_kwargs)",
    "aws_session_token": "s3fs calls it token (or put it in client_kwargs)",
    "region": "use region_name (or client_kwargs={'region_name': ...})",
}
#: Every S3 operation twophase calls; s3_additional_kwargs go to those whose input takes them.
OPERATIONS = (
    "HeadBucket",
    "HeadObject",
    "GetObject",
    "PutObject",
    "DeleteObject",
    "ListObjectsV2",
    "CreateMultipartUpload",
    "UploadPart",
    "CompleteMultipartUpload",
    "AbortMultipartUpload",
    "ListParts",
    "ListMultipartUploads",
)
#: Parameters FileSink and the log set themselves: not overridable through s3_additional_kwargs.
_OWN_PARAMETERS = {
    "Bucket",
    "Key",
    "Body",
    "UploadId",
    "PartNumber",
    "MultipartUpload",
    "IfNoneMatch",
    "IfMatch",
    "Prefix",
    "Delimiter",
    "MaxParts",
    "MaxUploads",
    "KeyMarker",
    "UploadIdMarker",
    "ContinuationToken",
    "ContentLength",
    "ContentMD5",
    "Range",
    "VersionId",
    "PartNumberMarker",
}

_CLIENTS: dict[str, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _model():
    return _session.get_session().get_service_model("s3")


def check_s3_options(what: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    """The options as a dict, or ConfigurationError naming what is not understood (no request)."""
    so = check_options(what, storage_options, OPTIONS, REFUSED)
    if so.get("key") is not None and so.get("username") is not None:
        raise ConfigurationError(f"{what}: give key or username, not both (s3fs's rule)")
    if so.get("secret") is not None and so.get("password") is not None:
        raise ConfigurationError(f"{what}: give secret or password, not both (s3fs's rule)")
    for name in ("client_kwargs", "config_kwargs", "s3_additional_kwargs"):
        if not isinstance(so.get(name) or {}, dict):
            raise ConfigurationError(
                f"{what}: storage option {name} must be a dict, got {type(so[name]).__name__}"
            )
    allowed = set(inspect.signature(_session.Session.create_client).parameters) - {
        "self",
        "service_name",
        "config",
    }
    bad = sorted(set(so.get("client_kwargs") or {}) - allowed)
    if bad:
        raise ConfigurationError(
            f"{what}: client_kwargs {', '.join(map(repr, bad))} are not arguments of botocore's "
            f"create_client; it takes {', '.join(sorted(allowed))} (use config_kwargs for "
            "botocore.config.Config)"
        )
    known = set(_config.Config.OPTION_DEFAULTS)
    bad = sorted(set(so.get("config_kwargs") or {}) - known)
    if bad:
        raise ConfigurationError(
            f"{what}: config_kwargs {', '.join(map(repr, bad))} are not options of "
            f"botocore.config.Config; it takes {', '.join(sorted(known))}"
        )
    extra = so.get("s3_additional_kwargs") or {}
    model = _model()
    members = set().union(*(model.operation_model(op).input_shape.members for op in OPERATIONS))
    own = sorted(set(extra) & _OWN_PARAMETERS)
    if own:
        raise ConfigurationError(
            f"{what}: s3_additional_kwargs {', '.join(map(repr, own))} are set by twophase "
            "itself and cannot be given"
        )
    bad = sorted(set(extra) - members)
    if bad:
        raise ConfigurationError(
            f"{what}: s3_additional_kwargs {', '.join(map(repr, bad))} are not parameters of any "
            f"S3 call twophase makes ({', '.join(OPERATIONS)}); e.g. ServerSideEncryption, "
            "SSEKMSKeyId, Metadata, "
            "StorageClass, ACL, Tagging, SSECustomerAlgorithm/SSECustomerKey, ExpectedBucketOwner"
        )
    return so


def _resolved(value: Any, what: str) -> Any:
    """``value`` with every ``{"env": ...}`` / ``{"file": ...}`` reference in it resolved."""
    if is_secret_ref(value):
        return resolve_secret(value, what)
    if isinstance(value, dict):
        return {k: _resolved(v, f"{what}.{k}") for k, v in value.items()}
    return value


def s3_client(storage_options: dict[str, Any], max_attempts: int = 5):
    """A botocore S3 client from s3fs-style storage options, cached per process (Python workers are
    reused across tasks, and building a client costs about a second of CPU)."""
    ck = json.dumps([storage_options, max_attempts], sort_keys=True, default=str)
    with _CLIENTS_LOCK:
        c = _CLIENTS.get(ck)
        if c is None:
            c = _CLIENTS[ck] = _new_client(storage_options, max_attempts)
        return c


def _new_client(storage_options: dict[str, Any], max_attempts: int):
    """A botocore S3 client from s3fs-style storage options, built as s3fs builds it; secrets are
    resolved only here."""
    so = storage_options
    ck = _resolved(dict(so.get("client_kwargs") or {}), "S3 storage option client_kwargs")
    cfg_kwargs = dict(so.get("config_kwargs") or {})
    cfg_kwargs.setdefault("retries", {"max_attempts": max_attempts, "mode": "standard"})
    if max_attempts == 0:
        # The commit client tries once, whatever the options say (botocore's max_attempts counts
        # retries: 1 would be two tries); the commit decides itself what to retry and how.
        retries = {k: v for k, v in cfg_kwargs["retries"].items() if k != "max_attempts"}
        cfg_kwargs["retries"] = dict(retries, total_max_attempts=1)
    # Checksums only where the API requires them: S3-compatible stores differ on the newer defaults.
    cfg_kwargs.setdefault("request_checksum_calculation", "when_required")
    cfg_kwargs.setdefault("response_checksum_validation", "when_required")
    cfg_kwargs.setdefault("max_pool_connections", 16)
    session = _session.Session(profile=so.get("profile"))

    def secret(*names: str) -> Any:
        for n in names:
            if so.get(n) is not None:
                return resolve_secret(so[n], f"S3 storage option {n!r}")
        return None

    args: dict[str, Any] = {
        "region_name": so.get("region_name"),
        "endpoint_url": so.get("endpoint_url"),
        "use_ssl": so.get("use_ssl", True),
        "aws_access_key_id": secret("key", "username"),
        "aws_secret_access_key": secret("secret", "password"),
        "aws_session_token": secret("token"),
    }
    args.update({k: v for k, v in ck.items() if v is not None})  # client_kwargs win, as in s3fs
    if so.get("anon"):
        for k in ("aws_access_key_id", "aws_secret_access_key", "aws_session_token"):
            args.pop(k, None)
        cfg_kwargs["signature_version"] = _botocore.UNSIGNED
    return session.create_client("s3", config=_config.Config(**cfg_kwargs), **args)


def s3_code(e: Exception) -> str:
    resp = getattr(e, "response", None) or {}
    return str(resp.get("Error", {}).get("Code", "")) or type(e).__name__


def s3_status(e: Exception) -> int | None:
    resp = getattr(e, "response", None) or {}
    return resp.get("ResponseMetadata", {}).get("HTTPStatusCode")


def s3_error(e: Exception) -> str:
    """``Code (HTTP n): message`` of a botocore error, for error messages (it holds no secret)."""
    if not isinstance(e, ClientError):
        return f"{type(e).__name__}: {e}"
    msg = (getattr(e, "response", None) or {}).get("Error", {}).get("Message")
    return f"{s3_code(e)} (HTTP {s3_status(e)})" + (f": {msg}" if msg else "")


def _refused_condition(e: Exception) -> bool:
    return s3_status(e) == 412 or s3_code(e) == "PreconditionFailed"


def multipart_etag(etags: list[str]) -> str:
    """The ETag S3 gives a completed multipart object: md5 of the parts' binary md5s, ``-N``."""
    try:
        digest = hashlib.md5(
            b"".join(bytes.fromhex(t.strip('"')) for t in etags), usedforsecurity=False
        )
    except ValueError:
        return ""  # ETags that are not MD5s (SSE-KMS, some S3-compatible stores)
    return f'"{digest.hexdigest()}-{len(etags)}"'


#: CompleteMultipartUpload tries per commit of a file: one that got no answer is sent again (and
#: one answered with a server error while the upload is still open), after COMPLETE_BACKOFF
#: seconds, doubled each time.  The coordinator's own retries (with backoff) come on top.
COMPLETE_TRIES = 3
COMPLETE_BACKOFF = 0.5


def _no_answer(e: Exception) -> bool:
    """No HTTP answer came back (a read timeout, a reset or refused connection): the request may
    or may not have reached S3, and S3 may still be acting on it."""
    return isinstance(e, (_exc.HTTPClientError, _exc.ConnectionError))


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


# ------------------------------------------------------------ FileSink's part files
class S3PartFiles(PartFiles):
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

    @classmethod
    def from_url(
        cls, url, storage_options, *, part_size=8 << 20, etags="md5", if_none_match="require", **_
    ):
        return cls(S3Storage(url, storage_options), part_size, etags, if_none_match)

    def spark_metadata(self) -> bool:
        return bool(self.storage.list_names(self.storage.prefix + "_spark_metadata/"))

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
                f"{where}. {TAMPERED}"
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
                f"(<prefix>[col=value/...]<name>, no '..'). {TAMPERED}"
            )
        if not isinstance(entry.get("upload_id"), str) or not entry["upload_id"]:
            raise HandleError(f"a files handle for {where}{rel[-1]} has no upload id. {TAMPERED}")

    def check_intent(self, intent, batch_id):
        record = f"the INTENT of batch {batch_id}"
        if intent.get("bucket", self.bucket) != self.bucket:
            raise HandleError(
                f"{record} names bucket {intent.get('bucket')!r}, but this sink writes to "
                f"s3://{self.bucket}/{self.storage.prefix}. {TAMPERED}"
            )
        if intent.get("prefix", self.storage.prefix) != self.storage.prefix:
            raise HandleError(
                f"{record} names key prefix {intent.get('prefix')!r}, which is not this sink's "
                f"({self.storage.prefix!r} in s3://{self.bucket}). {TAMPERED}"
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

    def _resolve(
        self, entry: dict[str, Any], head: dict[str, Any] | None
    ) -> CommitResult | None:
        """What a completion this call did not see succeed left, ``head`` being the key's HEAD
        taken after it: ALREADY_COMMITTED (the object is this upload's), LOST, or None when the
        upload is still open and the key free, so completing it again may still work.  Raises
        when another object holds the key while our upload is open (nothing is lost: kept)."""
        res = self._already(entry, head)
        if res is not None:
            return res
        bucket, key, up = self.bucket, entry["key"], entry["upload_id"]
        if not self.storage.upload_alive(key, up):
            # Gone: completed or aborted.  A completion still running when ``head`` was taken (S3
            # assembles a large object for minutes; a timed-out request goes on without its
            # client) may have finished since: only the upload gone *and* no object of ours at
            # the key, looked at after, is a loss.
            head = self.storage.head(key)
            res = self._already(entry, head)
            if res is not None:
                return res
            if head is not None:
                return CommitResult.lost(
                    f"upload {up} of s3://{bucket}/{key} no longer exists and the object "
                    f"there is not its result ({self._foreign(entry, head)})"
                )
            return CommitResult.lost(
                f"upload {up} of s3://{bucket}/{key} no longer exists (aborted, or expired "
                "by a bucket lifecycle rule) and the object is absent"
            )
        if head is not None:
            raise TwoPhaseError(
                f"cannot commit s3://{bucket}/{key}: an object with that key already exists "
                f"and is not this upload's ({self._foreign(entry, head)}). Move it aside and "
                "restart; the upload is kept open."
            )
        return None

    def _not_completed(
        self, entry: dict[str, Any], head: dict[str, Any] | None, why: str
    ) -> CommitResult:
        """The outcome when this call did not complete the upload: as :meth:`_resolve`, and
        RETRY_LATER while the upload is open and the key free."""
        return self._resolve(entry, head) or CommitResult.retry_later(
            f"CompleteMultipartUpload of s3://{self.bucket}/{entry['key']} failed: {why}"
        )

    def commit_file(self, entry):
        """Complete the upload; idempotent.  A completion that gets no answer (the read timeout
        fired while S3 still assembles a large object, a reset connection) is sent again, as is
        one answered with a server error while the upload is still open: completing an upload
        that exists is idempotent.  Any other outcome is decided by looking: an object at the key
        with this upload's multipart ETag is ours (already committed), the upload gone and no
        such object is a loss, another object while the upload is open is an error."""
        key, up = entry["key"], entry["upload_id"]
        if self.if_none_match == "head-check":
            # The endpoint ignores If-None-Match (proved at open()): look before completing.  An
            # object written between this HEAD and the completion is overwritten (documented race).
            head = self.storage.head(key)
            if head is not None:
                return self._not_completed(entry, head, "the key is taken")
        why = ""
        for attempt in range(1, COMPLETE_TRIES + 1):
            try:
                self.storage.complete(key, up, entry["parts"])
                return CommitResult.committed()
            except (ClientError, BotoCoreError) as e:
                why = s3_error(e)
                no_answer = _no_answer(e)
                server_error = (s3_status(e) or 0) >= 500
            last = attempt == COMPLETE_TRIES
            delay = COMPLETE_BACKOFF * 2 ** (attempt - 1)
            if no_answer and not last:
                # S3 may have completed it, be assembling it, or never have seen the request:
                # completing again is safe, and its answer (or the HEAD after) tells which.
                log.warning(
                    "CompleteMultipartUpload of s3://%s/%s got no answer (%s); sending it again "
                    "(%d/%d) in %.1fs", self.bucket, key, why, attempt + 1, COMPLETE_TRIES, delay,
                )
                time.sleep(delay)
                continue
            # An answer (NoSuchUpload after an earlier completion, 412, moto's 500 for an unknown
            # upload id) or, on the last try, still none: did an earlier call (or a completion
            # that outlived its client) complete it, is it gone, or is the key someone else's?
            res = self._resolve(entry, self.storage.head(key))
            if res is not None:
                return res
            if (no_answer or server_error) and not last:
                log.warning(
                    "CompleteMultipartUpload of s3://%s/%s failed (%s) and the upload is still "
                    "open; trying again (%d/%d) in %.1fs", self.bucket, key, why, attempt + 1,
                    COMPLETE_TRIES, delay,
                )
                time.sleep(delay)
                continue
            break
        return CommitResult.retry_later(
            f"CompleteMultipartUpload of s3://{self.bucket}/{key} failed: {why}; the upload is "
            "still open"
        )

    def recover_file(self, entry):
        """After a restart: a file whose object is already there is not completed again."""
        return self._already(entry, self.storage.head(entry["key"])) or self.commit_file(entry)

    def abort_entry(self, entry):
        self.storage.abort(entry["key"], entry["upload_id"])

    def _lists_uploads_by_prefix(self) -> bool:
        return self.storage.lists_uploads_by_prefix()

    def _list_uploads(self, prefix: str | None) -> list[dict[str, Any]]:
        return self.storage._list_uploads(prefix)

    def abort_lingering(self, query_name, batch_id, intent, keep, names, *, earlier=None, settled=None):
        """One ListMultipartUploads (paged) under the prefix (MinIO: the bucket's, filtered),
        whatever the number of other batches: this batch's uploads under this INTENT, and this
        query's uploads of other batches the log says are finished (``settled``: late task
        attempts'), except ``keep``.  Never by batch-id order (a backfill of an older id may hold
        its open uploads now); ``settled=None``: no other batch's upload is touched."""
        self.check_intent(intent, batch_id)
        prefix = self.storage.prefix
        keep_ids = {e["upload_id"] for e in keep}
        n, late = 0, []
        for u in self.storage.open_uploads(prefix):
            rel = u["Key"][len(prefix) :]
            segs = rel.split("/")
            # Only this query's (pipeline's, generation's) part files: <k=v/>*<a name ``names``
            # matches> (this batch, this INTENT; rule: the ballot being cleaned up is closed, or
            # committed with ``keep``), or one ``earlier`` matches for another batch the log says
            # is finished, any ballot (rule: a COMMITTED record or a pruned range: no ballot of it
            # is decided again, so an upload still open is a late attempt's).  Never a batch the log
            # says nothing of (a backfill's, by any id), other pipelines' uploads or foreign keys.
            if not all("=" in seg for seg in segs[:-1]) or u["UploadId"] in keep_ids:
                continue
            if not names.fullmatch(segs[-1]):
                m = earlier.fullmatch(segs[-1]) if earlier is not None else None
                if m is None or settled is None or int(m.group(1)) == int(batch_id) \
                        or not settled(query_name, int(m.group(1))):
                    continue
                late.append(u["Key"])
            self.storage.abort(u["Key"], u["UploadId"])
            n += 1
        if late:
            log.warning(
                "batch %d: aborted %d uploads of other, finished batches of %s, opened late "
                "(after their batch's cleanup): %s", batch_id, len(late), query_name,
                ", ".join(late[:5]) + (", ..." if len(late) > 5 else ""),
            )
        return n

    def verify_files(self, entries):
        """Every entry's upload still open: one ListMultipartUploads (paged) under the keys'
        common prefix (on an endpoint that lists only by whole key, as MinIO does, the bucket's
        uploads, filtered).  An open upload keeps the parts the handle lists (only a holder of
        its id can replace one, and completion checks their ETags), so its size is not asked."""
        keys = [e["key"] for e in entries]
        common = posixpath.commonprefix(keys)
        alive = {(u["Key"], u["UploadId"]) for u in self.storage.open_uploads(common)}
        return [
            f"upload {str(e['upload_id'])[:16]}… of s3://{self.bucket}/{e['key']} is gone "
            "(aborted, or expired by a bucket lifecycle rule)"
            for e in entries
            if (e["key"], e["upload_id"]) not in alive
        ]

    def describe(self, entry):
        return (
            f"s3 object s3://{entry.get('bucket')}/{entry.get('key')} "
            f"(upload {str(entry.get('upload_id'))[:16]}…, "
            f"{len(entry.get('parts', []))} parts, {entry.get('size')} bytes)"
        )
