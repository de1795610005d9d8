"""Storage backends under the transaction log and the file sink: one module per backend (S3's
face ``s3`` over its client, storage and part-file modules).

:mod:`~twophase.storage.local` (POSIX directories), :mod:`~twophase.storage.hdfs`
(WebHDFS) and :mod:`~twophase.storage.s3` (botocore) each offer what two-phase commit
needs from a filesystem: exclusive create, a rename (or completion) that never
overwrites, listing, deleting under a prefix, holding files invisibly (staged files,
open multipart uploads) and probes of what an endpoint honours.  Each also holds the
transaction log's store for its scheme.  :mod:`~twophase.storage.registry` is the one
table that picks a backend by URL scheme; it imports a backend only when asked.
This package never imports a sink or the coordinator.
"""

from __future__ import annotations

from twophase.storage._base import LogStore
from twophase.storage.registry import (
    BACKENDS,
    Backend,
    backend_for,
    open_store,
    register_store,
    scheme_of,
)

__all__ = [
    "BACKENDS",
    "Backend",
    "LogStore",
    "backend_for",
    "open_store",
    "register_store",
    "scheme_of",
]
