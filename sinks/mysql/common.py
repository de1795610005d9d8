"""What both sides share (driver and executor tasks): the server's error numbers and the sink's
constants, :class:`MySqlWriteError`, the executor's transaction record, and small helpers (identifier
quoting, the gtrid's query token, the upsert's unique-index check, text of handles and XIDs)."""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from twophase._deps import require
from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sinks import _sql2pc as names

log = logging.getLogger("twophase.sinks.mysql")

MODES = ("insert", "upsert")
MAX_XID_PART_BYTES = 64  # MySQL and MariaDB: gtrid and bqual are at most 64 bytes each
MAX_QUERY_CHARS = 24  # a longer (or not name-safe) query name goes into the gtrid as a digest
MAX_PLANNED_ATTEMPTS = 9999

# Server error numbers.
ER_XAER_NOTA = 1397  # unknown XID: committed or rolled back already, or never prepared
ER_XAER_RMFAIL = 1399  # the branch is in a state that forbids the command (e.g. still attached)
ER_XAER_OUTSIDE = 1400
ER_XAER_RMERR = 1401  # MySQL 8: XA RECOVER of other sessions' branches without XA_RECOVER_ADMIN
ER_XA_RBROLLBACK = 1402
ER_XAER_DUPID = 1440
ER_NO_SUCH_TABLE = 1146
ER_LOCK_WAIT_TIMEOUT = 1205
ER_LOCK_DEADLOCK = 1213
ER_NO_SUCH_THREAD = 1094  # KILL of a connection that is gone already
#: How long a commit waits, after it KILLed the session a branch is still attached to, for the server
#: to process that disconnect (it detaches the branch; then XA COMMIT works from any session).
DETACH_WAIT_SECONDS = 10.0
#: How long a commit waits for the session that prepared a branch to leave the server's process list
#: before its first ``XA COMMIT`` (see :meth:`MySqlSink._await_gone`).
SESSION_GONE_WAIT_SECONDS = 1.0
#: Text columns' character sets LOAD DATA ... CHARACTER SET binary writes as INSERT does (the CSV is UTF-8).
_LOAD_CHARSETS = frozenset({"utf8mb4", "utf8mb3", "utf8"})
#: The most warnings and notes a server lists for one statement (max_error_count's maximum): each
#: statement of a write carries at most this many values, so that every note can be seen.
_MAX_LISTED = 65535
#: ER_WARN_DEPRECATED_SYNTAX: a warning about the statement's syntax, not about a value.
_DEPRECATED_SYNTAX = 1287
#: Column types (information_schema's data_type) LOAD DATA reads a number's text into otherwise than
#: INSERT stores the number (see ``MySqlSink._loadable``).
_INTEGER_TYPES = frozenset({"tinyint", "smallint", "mediumint", "int", "integer", "bigint"})
_TEXT_TYPES = frozenset({"char", "varchar", "tinytext", "text", "mediumtext", "longtext", "json"})
#: Tables whose columns keep their batches on INSERT (logged once per table and process).
_INSERT_TABLES: set[str] = set()
#: Bytes of row values per multi-row INSERT at most (PyMySQL's executemany splits at 1,024,000).
_MAX_STATEMENT = 1_000_000
#: An executor's session idles out this long after it pre-committed (``SET SESSION wait_timeout`` just
#: before ``XA END``).  MariaDB keeps a prepared branch attached to its session until that session goes;
#: an executor paused (SIGSTOP, a GC pause, a cut network) between ``XA PREPARE`` and its disconnect would
#: otherwise hold it, and its row locks, out of everyone's reach for the server's ``wait_timeout`` (8 h by
#: default).  The server then closes the session and the branch stays prepared, detached: only liveness
#: depends on this timer; who may commit or roll back the branch is settled by the claims.  The session
#: has nothing left to send after ``XA PREPARE`` but its disconnect.  (MySQL >= 8.0.30 detaches at
#: ``XA PREPARE``: ``xa_detach_on_prepare``.)
PREPARED_SESSION_IDLE_SECONDS = 10
#: Claims (one row per branch, beside the marker table): who may XA ROLLBACK it.
DOOMED, DECIDED = "doomed", "decided"
# Client-side and server-going-away errors: transient for the driver's commit.
_TRANSIENT = {1040, 1053, 1205, 1213, 2002, 2003, 2006, 2013, 2014, 2055, 1927}

_URL_SECRET_RE = re.compile(r"(password=)[^&;\s]*", re.IGNORECASE)


class MySqlWriteError(TwoPhaseError):
    """A batch could not be written (bad row, type mismatch, missing column); raised on the executor.

    The branch was rolled back: nothing of the batch became visible and no prepared branch is left.
    """

    def __init__(self, message: str, *, column: str | None = None, errno: int | None = None):
        super().__init__(message)
        self.column = column
        self.errno = errno


def _my() -> Any:
    return require("pymysql", "MySqlSink", extra="mysql")


def quote_ident(name: str) -> str:
    """A MySQL identifier in backticks (a backtick inside is doubled)."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise ConfigurationError(f"not an identifier: {name!r}")
    return "`" + name.replace("`", "``") + "`"


def query_token(query_name: str) -> str:
    """The query as it goes into a gtrid: itself if short and name-safe, else a stable digest."""
    s = names.safe(query_name)
    if s == query_name and 0 < len(s) <= MAX_QUERY_CHARS:
        return s
    return "h" + hashlib.sha1(query_name.encode()).hexdigest()[:MAX_QUERY_CHARS - 1]


def _errno(e: BaseException) -> int | None:
    args = getattr(e, "args", ())
    return args[0] if args and isinstance(args[0], int) else None


@dataclass
class _Column:
    name: str
    data_type: str
    nullable: bool
    has_default: bool
    generated: bool
    charset: str | None = None  # text columns' character set; None for others (binary types included)
    auto_increment: bool = False


@dataclass
class MySqlTransaction:
    """One partition's open XA branch of one batch (executor side)."""

    ctx: TransactionContext
    gtrid: str
    bqual: str
    conn: Any
    columns: dict[str, _Column]
    insert_columns: list[str] | None = None
    rows: int = 0
    started: bool = False
    prepared: bool = False
    closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


_ConnectError = names.ConnectError
_close_quietly = names.close_quietly


def _unique_index_problem(rows: list[tuple[Any, ...]], table: str, key_columns: list[str]) -> str | None:
    """Why upsert by ``key_columns`` is unsafe on a table with these unique indexes (rows of
    :meth:`MySqlSink._unique_indexes`), or None.  It needs a PRIMARY KEY or UNIQUE index on exactly the
    key columns, and no other unique index that could match a row of another key.  ``ON DUPLICATE KEY
    UPDATE`` fires on a duplicate of *any* unique index: with ``(id PK, email UNIQUE)`` and key ``id``,
    upserting ``(2, 'a@x')`` over ``(1, 'a@x')`` updates row 1 and writes no id 2, without an error
    (silent loss, issue 61).  An index on a superset of the key columns is harmless (a row it matches has
    the same key, so it is the row the key matches); an ``AUTO_INCREMENT`` column alone is too, as long
    as the DataFrame does not write it (checked per task, :meth:`MySqlSink._map_columns`).  A column
    indexed by a prefix (``sub_part`` set, ``UNIQUE (k(3))``) is not that column: two keys sharing the
    prefix collide on it, so such an index never counts as the key's index and is another unique index
    (review r9)."""
    indexes: dict[str, list[tuple[str, int | None]]] = {}
    auto: set[str] = set()
    for index, col, sub_part, extra in rows:
        index, col = _text(index), _text(col)
        indexes.setdefault(index, []).append((col, None if sub_part is None else int(sub_part)))
        if "auto_increment" in _text(extra or "").lower():
            auto.add(col)

    def whole(entries: list[tuple[str, int | None]]) -> set[str]:
        return {c for c, sub in entries if sub is None}

    cols = ", ".join(quote_ident(k) for k in key_columns)
    keys = set(key_columns)
    if not any(all(sub is None for _, sub in e) and sorted(c for c, _ in e) == sorted(key_columns)
               for e in indexes.values()):
        return (f"upsert on {quote_ident(table)} needs a PRIMARY KEY or UNIQUE index on exactly ({cols}) "
                f"(whole columns, not a prefix) for ON DUPLICATE KEY UPDATE; create one: "
                f"ALTER TABLE {quote_ident(table)} ADD UNIQUE ({cols})")
    others = {name: e for name, e in indexes.items()
              if not keys <= whole(e) and not (len(e) == 1 and e[0][1] is None and e[0][0] in auto)}
    if not others:
        return None
    shown = "; ".join(f"{quote_ident(n)} on ({', '.join(quote_ident(c) + ('' if sub is None else f'({sub})') for c, sub in e)})"
                      for n, e in sorted(others.items()))
    return (f"upsert on {quote_ident(table)} by ({cols}) is refused: the table has another unique index, "
            f"{shown}. MySQL's INSERT ... ON DUPLICATE KEY UPDATE fires on a duplicate of any unique index, so "
            "a row whose key is new but whose value in that index is taken would overwrite the other row "
            "(of another key) and never be written, without an error. Either upsert by that index's columns, "
            "or drop it (ALTER TABLE ... DROP INDEX ...), or write with mode='insert' (a duplicate of any "
            "unique index then fails the batch)")


#: What a locking read of a branch's marker row key finds (``_Branches._marker_state``).
HELD, PRESENT, ABSENT = "held", "present", "absent"


def _limbo_text(name: str) -> str:
    return (f"XA branch {name} is prepared but neither committed nor listed by XA RECOVER: the server answered an "
            "XA COMMIT that met the disconnect of the session that prepared it OK without committing (a MariaDB "
            "race), and InnoDB holds the branch, its rows unseen and locked, until the server restarts. Restart "
            "the MariaDB server: its recovery lists the branch again and this commit, retried, completes it. "
            "Nothing is lost meanwhile; nothing else may roll it back")


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, (bytes, bytearray)) else str(v)


def _xids(xids: list[tuple[str, str]]) -> str:
    return ", ".join(f"{g}/{b}" for g, b in xids[:5]) + (", ..." if len(xids) > 5 else "")


def _alive(conn: Any) -> bool:
    """A pooled connection the server closed since (a restart, wait_timeout, KILL) still looks open
    to PyMySQL until it is used: ask the server, a round trip per use."""
    try:
        conn.ping(reconnect=False)
        return True
    except Exception:  # noqa: BLE001 - any failure: that connection is done
        return False
