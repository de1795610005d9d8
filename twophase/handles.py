"""Transaction handles as versioned JSON, so they survive the log and a restart unchanged.

A handle is a small dict of JSON values that names a pre-committed transaction
(e.g. a staged file and its size, a Kafka transactional id with producer id and
epoch, a PostgreSQL gid).  It never carries a secret.  The envelope adds the
sink kind and the handle format version; decoding a version the sink does not
know is refused rather than guessed at.
"""

from __future__ import annotations

import json
import re
from typing import Any

from twophase.errors import HandleError

ENVELOPE_KEYS = {"sink", "v", "data"}

# Keys that must never appear in a handle: a handle is logged, printed and stored.
_SECRET_KEY = re.compile(r"(pass(word|wd)?|secret|token|credential|sasl|private[_.-]?key|api[_.-]?key)",
                         re.IGNORECASE)


def check_no_secrets(data: Any, path: str = "handle") -> None:
    """Raise HandleError if a key in ``data`` looks like it holds a secret."""
    if isinstance(data, dict):
        for k, v in data.items():
            if _SECRET_KEY.search(str(k)):
                raise HandleError(f"{path} has a key {k!r} that looks like a secret; handles are logged "
                                  "and must never carry credentials")
            check_no_secrets(v, f"{path}.{k}")
    elif isinstance(data, list):
        for i, v in enumerate(data):
            check_no_secrets(v, f"{path}[{i}]")


def encode(sink_kind: str, version: int, data: dict[str, Any]) -> dict[str, Any]:
    """Wrap handle ``data`` in the versioned envelope (a plain, JSON-serialisable dict)."""
    check_no_secrets(data)
    env = {"sink": sink_kind, "v": int(version), "data": data}
    try:
        json.dumps(env, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise HandleError(f"{sink_kind} handle is not plain JSON: {e}") from None
    return env


def decode(envelope: Any, sink_kind: str, versions: set[int] | frozenset[int]) -> tuple[int, dict[str, Any]]:
    """Unwrap an envelope made by :func:`encode`; refuse other sinks and unknown versions."""
    if isinstance(envelope, str):
        try:
            envelope = json.loads(envelope)
        except ValueError as e:
            raise HandleError(f"handle is not JSON: {e}") from None
    if not isinstance(envelope, dict) or not ENVELOPE_KEYS <= envelope.keys():
        raise HandleError(f"not a twophase handle (expected keys {sorted(ENVELOPE_KEYS)}): {envelope!r:.200}")
    if envelope["sink"] != sink_kind:
        raise HandleError(f"handle belongs to sink {envelope['sink']!r}, not {sink_kind!r}")
    v = envelope["v"]
    if v not in versions:
        raise HandleError(
            f"{sink_kind} handle version {v!r} is not one this version of twophase understands "
            f"(known: {sorted(versions)}); upgrade twophase to recover this batch, do not delete the log")
    if not isinstance(envelope["data"], dict):
        raise HandleError(f"{sink_kind} handle data must be an object, got {type(envelope['data']).__name__}")
    return v, envelope["data"]


def dumps(envelope: dict[str, Any]) -> str:
    return json.dumps(envelope, sort_keys=True, separators=(",", ":"))


def loads(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise HandleError(f"handle is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise HandleError("handle JSON must be an object")
    return obj
