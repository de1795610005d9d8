"""Executor tasks: one task's transaction of FileSink, its part files open in staging."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twophase.context import TransactionContext
from twophase.sinks._formats import FormatWriter as _FormatWriter


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
