"""S3's botocore client: s3fs-style storage options, the client built from them, its errors.

:func:`check_s3_options` checks storage options (s3fs's names, :data:`OPTIONS`) without a
request; :func:`s3_client` builds a botocore client from them as s3fs does (secrets resolved
only then) and caches it per process; :func:`s3_code`, :func:`s3_status` and :func:`s3_error`
read what an S3 error says.  Used by :mod:`~twophase.storage.s3_storage` and the rest of the
S3 backend (:mod:`~twophase.storage.s3`).  Needs ``pip install 'twophase[s3]'``.
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import Any

from twophase._deps import require
from twophase.config import is_secret_ref, resolve_secret
from twophase.errors import ConfigurationError
from twophase.storage._base import check_options

_botocore = require("botocore", "S3 storage (s3://)", extra="s3")
_exc = require("botocore.exceptions", "S3 storage (s3://)", extra="s3")
_config = require("botocore.config", "S3 storage (s3://)", extra="s3")
_session = require("botocore.session", "S3 storage (s3://)", extra="s3")
ClientError = _exc.ClientError
BotoCoreError = _exc.BotoCoreError

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


def _no_answer(e: Exception) -> bool:
    """No HTTP answer came back (a read timeout, a reset or refused connection): the request may
    or may not have reached S3, and S3 may still be acting on it."""
    return isinstance(e, (_exc.HTTPClientError, _exc.ConnectionError))
