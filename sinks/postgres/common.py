"""Both sides (driver and executor tasks): what every part of the PostgreSQL sink shares.

Its constants (modes, gid limits, SQLSTATEs), :class:`PostgresWriteError`, the scrubbing of
secrets out of messages, the claims table's name, psycopg2 (imported when first needed) and the
one-line description of its errors.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from twophase._deps import require
from twophase.errors import TwoPhaseError
from twophase.sinks import _sql2pc as _names

log = logging.getLogger("twophase.sinks.postgres")

MODES = ("insert", "upsert")
MAX_GID_BYTES = 199  # PostgreSQL: "transaction identifier ... is too long" at 200 bytes
MAX_RUN_CHARS = _names.MAX_RUN_CHARS  # a longer (or not gid-safe) TransactionContext.run goes in as a digest
MAX_TASK_ATTEMPT_ID = _names.MAX_TASK_ATTEMPT_ID  # Spark's taskAttemptId() is a Long
# Keys of a libpq connection string that hold secrets: never stored in the config, handles or messages.
_SECRET_DSN_KEYS = ("password", "sslpassword")
# What a leaked connection string would look like inside a server or driver message.
_DSN_SECRET_RE = re.compile(r"((?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URI_SECRET_RE = re.compile(r"(postgres(?:ql)?://[^:/@\s]*:)[^@\s]*@", re.IGNORECASE)

# SQLSTATEs: connection trouble and server going away are transient for the driver's commit.
_UNDEFINED_OBJECT = "42704"
_UNDEFINED_TABLE = "42P01"
_INSUFFICIENT_PRIVILEGE = "42501"
_OBJECT_IN_USE = "55000"
_TRANSIENT_CLASSES = ("08", "53", "57", "58")


class PostgresWriteError(TwoPhaseError):
    """A batch could not be written (bad row, type mismatch, missing column); raised on the executor.

    The transaction was rolled back: nothing of the batch became visible and no
    prepared transaction is left.  ``column``, ``constraint`` and ``sqlstate`` say
    what PostgreSQL (or the sink's own check) refused.
    """

    def __init__(self, message: str, *, column: str | None = None, constraint: str | None = None,
                 sqlstate: str | None = None):
        super().__init__(message)
        self.column = column
        self.constraint = constraint
        self.sqlstate = sqlstate


def scrub(text: str) -> str:
    """Remove passwords from anything that could echo a connection string."""
    text = _DSN_SECRET_RE.sub(r"\1***", text)
    return _URI_SECRET_RE.sub(r"\1***@", text)


# Gid naming, shared with the MySQL sink (sinks/_sql2pc.py).
_safe = _names.safe
_run_token = _names.run_token


def _claims_name(marker_table: str) -> str:
    """The claims table's name: ``{marker_table}_claims``, or, where that would pass PostgreSQL's
    63 bytes (and be cut, maybe to the marker table's own name), a shortened marker name and a
    digest of the whole one (shared with the MySQL sink: ``_sql2pc.claims_name``)."""
    return _names.claims_name(marker_table, 63)


def _pg() -> Any:
    """psycopg2 with its ``sql``, ``extensions`` and ``errors`` submodules loaded."""
    pg = require("psycopg2", "PostgresSink")
    import psycopg2.errors
    import psycopg2.extensions
    import psycopg2.sql  # noqa: F401

    return pg


_ConnectError = _names.ConnectError
_close_quietly = _names.close_quietly


def _describe_pg_error(e: Any) -> str:
    """One line from a psycopg2 error: message, SQLSTATE, column, constraint, COPY context; no secrets."""
    d = getattr(e, "diag", None)
    primary = (d.message_primary if d is not None and d.message_primary else str(e)).strip()
    parts = [primary]
    if getattr(e, "pgcode", None):
        parts[0] += f" [SQLSTATE {e.pgcode}]"
    if d is not None:
        if d.column_name:
            parts.append(f"column {d.column_name!r}")
        if d.constraint_name:
            parts.append(f"constraint {d.constraint_name!r}")
        if d.message_detail:
            parts.append(d.message_detail.strip())
        if d.context:
            parts.append(d.context.strip().splitlines()[0][:300])
    return scrub("; ".join(parts))
