"""Exactly-once MySQL / MariaDB sink: each partition's rows in an XA branch, XA COMMIT on the driver.

Executors ``XA START`` a branch named for one attempt of one task of one ballot, write the
partition's rows (insert mode: each Arrow batch by ``LOAD DATA LOCAL INFILE`` of CSV made in memory,
see ``MySqlSink._load``; upsert mode: multi-row ``INSERT ... ON DUPLICATE KEY UPDATE``), insert a
marker row naming the branch, then ``XA END`` and ``XA PREPARE`` and close the connection.  The
driver runs ``XA COMMIT`` on a connection of its own after the coordinator logged its decision.

How it recovers: a prepared XA branch survives the death of the executor, of the driver and a
restart of the server (MariaDB >= 10.5.2, MySQL >= 5.7.7); its handle (gtrid, bqual, database) is in
the log and ``XA COMMIT`` can be run from any session.  A second ``XA COMMIT`` fails with 1397
XAER_NOTA, the same answer as for a branch rolled back: the marker row, written inside the branch,
tells "already committed" (present) from "lost" (absent).  Branches of attempts that never reached
the decision are found by ``XA RECOVER`` and rolled back by the driver (``abort_lingering``), and
so are late attempts' branches of earlier batches (``sweep_late``): they hold their row locks.

Who may roll back a branch is settled by one row per branch in a claims table beside the marker
table (as the PostgreSQL sink's): the driver claims every branch of a batch ``decided`` before the
decision, a retried task claims its earlier attempt's branch ``doomed`` before it rolls it back, and
so do the cleanup and a retried task for a late leftover of an earlier batch; whichever claim comes
first wins, so a decided branch is never rolled back.  On MariaDB a prepared branch stays attached to its preparing session until that
session disconnects (``XA COMMIT`` elsewhere answers 1397 meanwhile): the handle names that session,
and a commit that meets a lingering one kills it (only a connection of the sink's own user).

Names: the XID's gtrid (at most 64 bytes) is the ballot's prefix and the partition,
``{gid_prefix}:{query}:{batch}:{token}:{partition}``; its bqual (at most 64 bytes) is the attempt,
``{attempt}.{task attempt id}[:{run}]`` (see ``sinks/_sql2pc.py``, shared with the PostgreSQL sink).
A query name longer than 24 bytes (or not name-safe) goes into the gtrid as a digest.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import hashlib
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, unquote

import pyarrow as pa

from twophase._deps import require
from twophase.config import is_secret_ref, resolve_secret
from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, HandleError, TwoPhaseError
from twophase.evidence import Settled
from twophase.sink import CommitResult, TwoPhaseCommitSink
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


class MySqlSink(TwoPhaseCommitSink[MySqlTransaction, dict]):
    """Write each batch into a MySQL or MariaDB table exactly once, by XA transactions.

    ``host``, ``port``, ``database``, ``user``: where to connect; ``password`` a string (kept in
    memory only, never in the config, handles or messages) or a secret reference
    ``{"env": "VAR"}`` / ``{"file": "/path"}``.  ``table`` names the target table literally (quoted
    with backticks, never parsed).  ``mode="upsert"`` writes ``INSERT ... ON DUPLICATE KEY UPDATE``
    and needs a PRIMARY KEY or UNIQUE index on exactly ``key_columns``; within one transaction the
    last row of a key wins.  ``marker_table`` (same database) holds one row per committed branch.
    ``lock_wait_timeout`` (seconds) bounds how long a task waits for a row lock, e.g. one held by a
    leftover prepared branch.  ``insert_rows``: rows per multi-row INSERT statement.
    """

    kind = "mysql"

    def __init__(self, host: str = "127.0.0.1", port: int = 3306, database: str | None = None,
                 table: str | None = None, *, user: str | None = None,
                 password: str | dict[str, str] | None = None, mode: str = "insert",
                 key_columns: list[str] | tuple[str, ...] | None = None,
                 marker_table: str = "twophase_commits", gid_prefix: str = "tp",
                 lock_wait_timeout: int = 60, connect_timeout: int = 10,
                 marker_retention_batches: int = 100, insert_rows: int = 1000):
        _my()  # fail now, naming the extra to install, if PyMySQL is missing
        if not table or not isinstance(table, str):
            raise ConfigurationError("MySqlSink needs table=... (the target table's name)")
        if not database or not isinstance(database, str):
            raise ConfigurationError("MySqlSink needs database=... (the database of the table)")
        if mode not in MODES:
            raise ConfigurationError(f"MySqlSink mode must be one of {', '.join(MODES)}, got {mode!r}")
        keys = list(key_columns or [])
        if mode == "upsert" and not keys:
            raise ConfigurationError("MySqlSink(mode='upsert') needs key_columns=[...] (the columns of "
                                     "a PRIMARY KEY or UNIQUE index of the table)")
        if mode == "insert" and keys:
            raise ConfigurationError("key_columns only apply to mode='upsert'; remove them or set mode='upsert'")
        if len(set(keys)) != len(keys):
            raise ConfigurationError(f"key_columns has duplicates: {keys}")
        if not gid_prefix or names.safe(gid_prefix) != gid_prefix:
            raise ConfigurationError(f"gid_prefix {gid_prefix!r} must be letters, digits, '_', '-' or '.'")
        if marker_retention_batches < 1:
            raise ConfigurationError("marker_retention_batches must be >= 1")
        if password is not None and not is_secret_ref(password) and not isinstance(password, str):
            raise ConfigurationError('password must be a string or a secret reference {"env": "VAR"}')
        if not isinstance(marker_table, str) or not re.fullmatch(r"[A-Za-z0-9_$]{1,57}", marker_table):
            # Its name (and its claims table's, + "_claims") is part of statements sent with values.
            raise ConfigurationError(f"marker_table must be 1-57 letters, digits, '_' or '$', got {marker_table!r}")
        self.host = host
        self.port = int(port)
        self.database = database
        self.table = table
        self.user = user
        self.mode = mode
        self.key_columns = keys
        self.marker_table = marker_table
        self.gid_prefix = gid_prefix
        self.lock_wait_timeout = int(lock_wait_timeout)
        self.connect_timeout = int(connect_timeout)
        self.marker_retention_batches = int(marker_retention_batches)
        self.insert_rows = max(1, int(insert_rows))
        self._password_ref = password if is_secret_ref(password) else None
        self._password_inline = password if isinstance(password, str) else None
        self._pool = names.ConnectionPool()

    def _driver_conn(self) -> Any:
        """A pooled driver connection, or a new one (driver; thread-safe).  Each connection costs PyMySQL
        ~50 ms of TLS context set-up, so the driver keeps up to 8 (the executors' branches are never on
        them: an XA COMMIT always runs in a session other than the one that prepared the branch)."""
        return self._pool.take(self._connect, _alive)

    def _release(self, conn: Any) -> None:
        """Back to the pool if it is still usable (PyMySQL closes a connection that broke), else closed."""
        self._pool.give(conn, bool(conn.open))

    def close(self) -> None:
        """Close the driver's pooled connections."""
        self._pool.close()

    def __repr__(self) -> str:
        return f"MySqlSink({self.where}, table={self.table}, mode={self.mode!r})"

    @property
    def where(self) -> str:
        """``user@host:port/database`` for messages (no password)."""
        return f"{self.user or ''}{'@' if self.user else ''}{self.host}:{self.port}/{self.database}"

    def target(self) -> str:
        return f"mysql database {self.database} table {self.table}"

    def _redact(self, text: str) -> str:
        text = _URL_SECRET_RE.sub(r"\1***", text)
        pw = self._password_inline
        if pw is None and self._password_ref is not None:
            try:
                pw = resolve_secret(self._password_ref, "MySqlSink password")
            except Exception:  # noqa: BLE001 - nothing to redact then
                pw = None
        if pw and len(pw) >= 3:
            text = text.replace(pw, "***")
        return text

    def _describe(self, e: BaseException) -> str:
        n = _errno(e)
        msg = e.args[1] if len(getattr(e, "args", ())) > 1 else str(e)
        return self._redact(f"{msg} [error {n}]" if n is not None else str(msg))

    def _connect(self, load: bool = False) -> Any:
        """A new connection (driver or executor); errors name the server, never the password.

        ``load``: an executor's connection of insert mode, which offers the server LOAD DATA LOCAL
        (``_load_connection_class``: it sends only the buffer armed for the statement it runs)."""
        my = _my()
        pw = resolve_secret(self._password_ref, "MySqlSink password") if self._password_ref \
            else self._password_inline
        try:
            conn = _load_connection_class()(
                              host=self.host, port=self.port, user=self.user, password=pw or "",
                              database=self.database, connect_timeout=self.connect_timeout,
                              autocommit=True, charset="utf8mb4", local_infile=load,
                              # No gap locks: concurrent branches' inserts (and the markers') never wait
                              # on each other, only on the rows they write.
                              init_command="SET SESSION TRANSACTION ISOLATION LEVEL READ COMMITTED")
        except my.Error as e:
            raise _ConnectError(f"cannot connect to MySQL at {self.where}: {self._describe(e)}") from None
        try:
            with conn.cursor() as cur:
                # Timestamps are sent as UTC wall time (_py_value, the CSV): a TIMESTAMP column reads
                # them in the session's zone, which is the server's unless set (a server in +05:00
                # stored every instant 5 hours early).  An offset needs no time zone tables.
                cur.execute("SET SESSION time_zone = '+00:00'")
        except my.Error as e:
            conn.close()
            raise _ConnectError(f"cannot set the session time zone on MySQL at {self.where}: "
                                f"{self._describe(e)}") from None
        return conn

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """Everything needed to rebuild this sink; a password only as a secret reference."""
        cfg: dict[str, Any] = {"sink": self.kind, "host": self.host, "port": self.port,
                               "database": self.database, "table": self.table, "user": self.user,
                               "mode": self.mode, "key_columns": list(self.key_columns),
                               "marker_table": self.marker_table, "gid_prefix": self.gid_prefix,
                               "lock_wait_timeout": self.lock_wait_timeout,
                               "connect_timeout": self.connect_timeout,
                               "marker_retention_batches": self.marker_retention_batches,
                               "insert_rows": self.insert_rows}
        if isinstance(self._password_ref, dict):
            cfg["password"] = dict(self._password_ref)
        return cfg

    def executor_modules(self) -> list[str]:
        return ["pyarrow", "pymysql"]

    # ---------------------------------------------------------------- driver
    def open(self) -> None:
        """Check the server version, the table and (upsert) its key; create the marker table."""
        my = _my()
        try:
            conn = self._driver_conn()
        except _ConnectError as e:
            raise ConfigurationError(str(e)) from None
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT VERSION()")
                self._check_version(cur.fetchone()[0])
                self._check_xa_recover(cur)
                cur.execute("SELECT table_type FROM information_schema.tables WHERE table_schema = %s "
                            "AND table_name = %s", (self.database, self.table))
                row = cur.fetchone()
                if row is None:
                    raise ConfigurationError(f"table {quote_ident(self.table)} does not exist in database "
                                             f"{self.database!r} at {self.where}; create it first")
                if row[0] != "BASE TABLE":
                    raise ConfigurationError(f"{quote_ident(self.table)} is a {row[0]}, not a table")
                cur.execute("SELECT engine FROM information_schema.tables WHERE table_schema = %s "
                            "AND table_name = %s", (self.database, self.table))
                engine = (cur.fetchone() or ("",))[0] or ""
                if engine.lower() != "innodb":
                    raise ConfigurationError(f"table {quote_ident(self.table)} uses engine {engine}; only "
                                             "InnoDB takes part in XA transactions (ALTER TABLE ... ENGINE=InnoDB)")
                if self.mode == "upsert":
                    self._check_keys(cur)
                cur.execute(self._marker_ddl())
                cur.execute(self._claims_ddl())
                for what, name in (("marker table", self.marker_table), ("claims table", self.claims_table)):
                    cur.execute("SELECT engine FROM information_schema.tables WHERE table_schema = %s "
                                "AND table_name = %s", (self.database, name))
                    engine = (cur.fetchone() or ("",))[0] or ""
                    if engine.lower() != "innodb":
                        raise ConfigurationError(
                            f"the {what} {quote_ident(name)} uses engine {engine or '(unknown)'}; its rows must be "
                            "written inside the XA branches (InnoDB only), or a rolled-back branch would leave "
                            f"them behind: ALTER TABLE {quote_ident(name)} ENGINE=InnoDB")
                self._check_claims_writable(conn)
        except my.Error as e:
            raise ConfigurationError(f"MySqlSink could not check {self.table} at {self.where}: "
                                     f"{self._describe(e)}") from None
        finally:
            self._release(conn)

    def _check_claims_writable(self, conn: Any) -> None:
        """A trial claim, rolled back: the claims are ``INSERT ... ON DUPLICATE KEY UPDATE`` (and
        ``DELETE``), so a user who may not UPDATE the claims table (an append-only writer) would pass
        every other check and then fail every batch's decision.  Refused here, naming the grant."""
        my = _my()
        claims = quote_ident(self.claims_table)
        conn.begin()
        try:
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {claims} (gtrid, bqual, state) VALUES (%s, %s, %s) "
                            "ON DUPLICATE KEY UPDATE state = VALUES(state)", ("twophase-open-check", "", DOOMED))
                cur.execute(f"DELETE FROM {claims} WHERE gtrid = %s AND bqual = %s", ("twophase-open-check", ""))
        except my.Error as e:
            if _errno(e) in (1142, 1143):  # command denied for the table / a column
                raise ConfigurationError(
                    f"user {self.user!r} may not write the claims table {claims} at {self.where} "
                    f"({self._describe(e)}); each batch's decision claims its branches there with INSERT ... ON "
                    f"DUPLICATE KEY UPDATE and finished claims are deleted: GRANT SELECT, INSERT, UPDATE, DELETE "
                    f"ON {quote_ident(self.database or '')}.{claims} TO ...") from None
            raise
        finally:
            try:
                conn.rollback()
            except my.Error:  # the connection broke: the server rolled back
                pass

    def _check_version(self, version: str) -> None:
        m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
        if not m:
            return
        v = tuple(int(x) for x in m.groups())
        maria = "mariadb" in version.lower()
        need = (10, 5, 2) if maria else (5, 7, 7)
        if v < need:
            raise ConfigurationError(
                f"{'MariaDB' if maria else 'MySQL'} {version} at {self.where} rolls prepared XA transactions "
                f"back when their session ends or the server restarts; MySqlSink needs "
                f"{'MariaDB >= 10.5.2' if maria else 'MySQL >= 5.7.7'}")

    def _check_xa_recover(self, cur: Any) -> None:
        """``XA RECOVER`` must list every session's branches: the driver checks, commits and cleans up
        branches prepared by executor sessions.  MySQL 8 answers 1401 (XAER_RMERR) to a user without
        ``XA_RECOVER_ADMIN``; refused here, naming the grant, not at the first batch."""
        try:
            cur.execute("XA RECOVER")
            cur.fetchall()
        except _my().Error as e:
            if _errno(e) != ER_XAER_RMERR:
                raise
            user = quote_ident(self.user) if self.user else "<the sink's user>"
            raise ConfigurationError(
                f"XA RECOVER at {self.where} fails for user {self.user!r} ({self._describe(e)}): on MySQL 8 "
                "listing other sessions' prepared XA branches needs XA_RECOVER_ADMIN, and MySqlSink's "
                "driver must list the branches its executors prepared; have an administrator run: "
                f"GRANT XA_RECOVER_ADMIN ON *.* TO {user}") from None

    def _check_keys(self, cur: Any) -> None:
        """Upsert: a PRIMARY KEY or UNIQUE index on exactly ``key_columns``, and no other unique index that
        could match a row of another key (:func:`_unique_index_problem`); refused at ``open()``.  Each task
        checks again before ``XA START`` (:meth:`begin_transaction`): an index a DBA adds while the query
        runs is refused by the batch, not found later as lost rows."""
        problem = _unique_index_problem(self._unique_indexes(cur), self.table, self.key_columns)
        if problem:
            raise ConfigurationError(problem)

    def _unique_indexes(self, cur: Any) -> list[tuple[Any, ...]]:
        """The table's unique indexes, a row per indexed column: (index, column, sub_part, extra)."""
        cur.execute("SELECT s.index_name, s.column_name, s.sub_part, c.extra FROM information_schema.statistics s "
                    "JOIN information_schema.columns c ON c.table_schema = s.table_schema "
                    "AND c.table_name = s.table_name AND c.column_name = s.column_name "
                    "WHERE s.table_schema = %s AND s.table_name = %s AND s.non_unique = 0 "
                    "ORDER BY s.index_name, s.seq_in_index", (self.database, self.table))
        return list(cur.fetchall())

    def _marker_ddl(self) -> str:
        return (f"CREATE TABLE IF NOT EXISTS {quote_ident(self.marker_table)} ("
                "gtrid VARBINARY(64) NOT NULL, bqual VARBINARY(64) NOT NULL, query_name VARCHAR(255) NOT NULL, "
                "batch_id BIGINT NOT NULL, partition_id INT NOT NULL, attempt INT NOT NULL, "
                "target_table VARCHAR(255) NOT NULL, row_count BIGINT NOT NULL, "
                "prepared_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), PRIMARY KEY (gtrid, bqual), "
                "KEY query_batch (query_name, batch_id)) ENGINE=InnoDB")

    @property
    def claims_table(self) -> str:
        """``{marker_table}_claims`` (or a shortened name and a digest past 64 characters)."""
        return names.claims_name(self.marker_table, 64)

    def _claims_ddl(self) -> str:
        return (f"CREATE TABLE IF NOT EXISTS {quote_ident(self.claims_table)} ("
                "gtrid VARBINARY(64) NOT NULL, bqual VARBINARY(64) NOT NULL, "
                "state VARCHAR(16) NOT NULL, at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
                "PRIMARY KEY (gtrid, bqual)) ENGINE=InnoDB")

    def _claim(self, conn: Any, xids: list[tuple[str, str]], state: str) -> set[tuple[str, str]]:
        """Claim ``xids`` as ``state`` (``doomed`` or ``decided``); return those now claimed so.

        One statement on the branches' claim rows, ``INSERT ... ON DUPLICATE KEY UPDATE``, which keeps
        an existing claim of the other state: InnoDB's row lock orders two claims of one branch, and
        whichever comes first wins.  A branch claimed ``decided`` (by :meth:`verify_prepared`, before
        the decision) is never claimed ``doomed``, so never rolled back by a retried task or a sweep of
        late leftovers; one claimed ``doomed`` is never decided.  The rows are read back in the same
        transaction, under their locks.  Errors (a missing claims table: 1146) are raised."""
        if not xids:
            return set()
        other = DECIDED if state == DOOMED else DOOMED
        xids = sorted(set(xids))  # one lock order for every claimer
        claims = quote_ident(self.claims_table)
        conn.begin()
        try:
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {claims} (gtrid, bqual, state) VALUES "
                            + ", ".join(["(%s, %s, %s)"] * len(xids))
                            + " ON DUPLICATE KEY UPDATE state = IF(state = %s, state, VALUES(state))",
                            [v for g, b in xids for v in (g, b, state)] + [other])
                cur.execute(f"SELECT gtrid, bqual FROM {claims} WHERE state = %s AND (gtrid, bqual) IN ("
                            + ", ".join(["(%s, %s)"] * len(xids)) + ")", [state] + [v for x in xids for v in x])
                won = {(_text(g), _text(b)) for g, b in cur.fetchall()}
            conn.commit()
        except BaseException:
            try:
                conn.rollback()
            except Exception:  # noqa: BLE001 - the connection broke: the server rolls back
                pass
            raise
        return won

    def _doom(self, conn: Any, label: str, xids: list[tuple[str, str]],
              strict: bool = True) -> list[tuple[str, str]] | None:
        """Claim ``xids`` as doomed; return those the caller may roll back (see :meth:`_claim`).  A
        branch claimed ``decided`` is in a decision and left alone.  When the claims cannot be written:
        ``strict`` (an executor), none; else None, and the caller decides."""
        if not xids:
            return []
        try:
            won = self._claim(conn, xids, DOOMED)
        except _my().Error as e:
            if not strict:
                log.debug("%s: cannot claim %s as doomed (%s)", label, _xids(xids), self._describe(e))
                return None
            log.warning("%s: cannot claim %s as doomed (%s); none is rolled back and this attempt may wait on "
                        "their locks", label, _xids(xids), self._describe(e))
            return []
        for x in xids:
            if x not in won:
                log.warning("%s: %s looks like a leftover but is claimed by its batch's decision: left alone "
                            "(what needs its locks may wait on them)", label, _xids([x]))
        return [x for x in sorted(xids) if x in won]

    def _drop_claims(self, conn: Any, head: str, listed: set[tuple[str, str]], before: Any) -> int:
        """Delete claims of branches under ``head`` that were claimed before ``before`` (the server's
        time when ``listed``, an ``XA RECOVER``, was read) and are not listed: a branch is claimed only
        once prepared, so such a branch was committed or rolled back and never comes back.  A claim
        made after the listing is kept, whatever its branch looked like then."""
        claims = quote_ident(self.claims_table)
        with conn.cursor() as cur:
            cur.execute(f"SELECT gtrid, bqual FROM {claims} WHERE LEFT(gtrid, %s) = %s AND at < %s",
                        (len(head.encode()), head, before))
            done = [x for x in ((_text(g), _text(b)) for g, b in cur.fetchall()) if x not in listed]
            n = 0
            for i in range(0, len(done), 500):
                part = done[i:i + 500]
                n += cur.execute(f"DELETE FROM {claims} WHERE at < %s AND (gtrid, bqual) IN ("
                                 + ", ".join(["(%s, %s)"] * len(part)) + ")", [before] + [v for x in part for v in x])
            return n

    def batch_prefix(self, query_name: str, batch_id: int) -> str:
        return f"{self.query_prefix(query_name)}{int(batch_id)}:"

    def query_prefix(self, query_name: str) -> str:
        """``{gid_prefix}:{query token}:`` — every gtrid of every batch of this query starts so."""
        return f"{self.gid_prefix}:{query_token(query_name)}:"

    def make_xid(self, ballot_prefix: str, partition_id: int, attempt: int, run: str = "", *,
                 task_attempt_id: int | None = None) -> tuple[str, str]:
        """``(gtrid, bqual)`` of one task attempt of one ballot; each at most 64 bytes or refused."""
        gtrid = f"{ballot_prefix}{int(partition_id)}"
        bqual = names.attempt_name(attempt, task_attempt_id, run)
        for what, part in (("gtrid", gtrid), ("bqual", bqual)):
            n = len(part.encode())
            if n > MAX_XID_PART_BYTES:
                raise ConfigurationError(
                    f"XA {what} {part!r} is {n} bytes; MySQL and MariaDB allow at most {MAX_XID_PART_BYTES}. "
                    "Shorten the sink's gid_prefix=... (the query name goes in as a digest past "
                    f"{MAX_QUERY_CHARS} characters)")
        return gtrid, bqual

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT: the gtrid prefix of this ballot, with a random token drawn once per INTENT."""
        prefix = f"{self.batch_prefix(query_name, batch_id)}{uuid.uuid4().hex[:8]}:"
        self.make_xid(prefix, max(num_partitions - 1, 0), MAX_PLANNED_ATTEMPTS, "r" * names.MAX_RUN_CHARS,
                      task_attempt_id=names.MAX_TASK_ATTEMPT_ID)
        return {"gid_prefix": prefix, "table": self.table, "database": self.database}

    def _intent_prefix(self, query_name: str, batch_id: int, intent: dict[str, Any]) -> str:
        prefix = intent.get("gid_prefix") if intent else None
        if prefix is None:
            return self.batch_prefix(query_name, batch_id)
        if not isinstance(prefix, str) or not prefix.startswith(self.batch_prefix(query_name, batch_id)):
            raise HandleError(f"INTENT of batch {batch_id} has gid_prefix {prefix!r}, which does not belong "
                              f"to query {query_name!r} batch {batch_id}")
        return prefix

    def prepared(self, prefix: str = "") -> list[tuple[str, str]]:
        """``(gtrid, bqual)`` of every prepared XA branch whose gtrid starts with ``prefix`` (driver)."""
        conn = self._driver_conn()
        try:
            return sorted(x for x in self._recover(conn) if x[0].startswith(prefix))
        finally:
            self._release(conn)

    def _recover(self, conn: Any) -> set[tuple[str, str]]:
        """``(gtrid, bqual)`` of every prepared XA branch of the server (``XA RECOVER`` on ``conn``)."""
        with conn.cursor() as cur:
            cur.execute("XA RECOVER")
            return {self._split_xid(row) for row in cur.fetchall()}

    @staticmethod
    def _split_xid(row: tuple[Any, ...]) -> tuple[str, str]:
        """``(gtrid, bqual)`` from a row of ``XA RECOVER`` (formatID, gtrid_length, bqual_length, data)."""
        _fmt, glen, blen, data = row[:4]
        raw = data if isinstance(data, bytes) else str(data).encode()
        return raw[:glen].decode(errors="replace"), raw[glen:glen + blen].decode(errors="replace")

    def verify_prepared(self, batch_id: int, handles: list[dict], *, prepare_started_at: float) -> None:
        """Claim every handle's branch as decided, then check it is still prepared, before the decision
        is logged (driver).

        From the claim on, no retried task and no sweep of late leftovers rolls the branch back (they
        claim ``doomed`` first, which a ``decided`` claim refuses: :meth:`_claim`).  A branch a retried
        task doomed first, or one ``XA RECOVER`` no longer lists (rolled back by an operator or by
        another coordinator cleaning up this batch), fails the batch now, while it is undecided.  If
        the server cannot be asked, the batch fails too.  Without a claims table (1146: a sink never
        opened) only the listing is checked."""
        if not handles:
            return
        my = _my()
        xids = sorted({(h["gtrid"], h["bqual"]) for h in handles})
        decided: set[tuple[str, str]] | None = None
        try:
            conn = self._driver_conn()
            try:
                try:
                    decided = self._claim(conn, xids, DECIDED)
                except my.Error as e:
                    if _errno(e) != ER_NO_SUCH_TABLE:
                        raise
                    log.warning("batch %d: no claims table %s (%s): checking only that its %d XA branches are "
                                "still prepared", batch_id, quote_ident(self.claims_table), self._describe(e),
                                len(xids))
                present = self._recover(conn)
            finally:
                self._release(conn)
        except (_ConnectError, my.Error) as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot claim its {len(xids)} prepared XA branches as decided "
                                f"at {self.where}: {e if isinstance(e, _ConnectError) else self._describe(e)}. "
                                "Nothing was decided; restart the query and the batch is written again.") from None
        doomed = [x for x in xids if decided is not None and x not in decided]
        gone = [x for x in xids if x not in present and x not in doomed]
        names.refuse_undecidable(batch_id, len(xids), [_xids([x]) for x in doomed], [_xids([x]) for x in gone],
                                 where=self.where, what="prepared XA branches")

    def commit(self, handle: dict) -> CommitResult:
        """``XA COMMIT`` the handle's branch on a driver connection, never the session that prepared it (driver; idempotent).

        1397 XAER_NOTA is resolved by the marker row: present = committed before, absent = rolled
        back (lost, never visible).  Connection trouble and a branch still attached elsewhere are
        retried later."""
        my = _my()
        self._check_database(handle)
        try:
            conn = self._driver_conn()
        except _ConnectError as e:
            return CommitResult.retry_later(str(e))
        try:
            with conn.cursor() as cur:
                session = handle.get("session")
                if isinstance(session, int) and session > 0:
                    self._await_gone(cur, session, time.monotonic() + SESSION_GONE_WAIT_SECONDS)
                cur.execute("XA COMMIT %s, %s", (handle["gtrid"], handle["bqual"]))
                return self._committed_or_limbo(cur, handle)
        except my.Error as e:
            n = _errno(e)
            if n == ER_XAER_NOTA:
                return self._resolve_missing(handle)
            if n is None or n >= 2000 or n in _TRANSIENT or n in (ER_XAER_RMFAIL, ER_XAER_DUPID):
                return CommitResult.retry_later(self._describe(e))
            raise TwoPhaseError(f"XA COMMIT of {self.describe_handle(handle)} failed: {self._describe(e)}") from None
        finally:
            self._release(conn)

    def _check_database(self, handle: dict) -> None:
        """Refuse a handle whose branch this sink would judge by other evidence than it was written
        with: another database, or another marker table (a recovery config whose ``marker_table``
        differs would read another table, find no marker of a committed branch and judge it never
        visible: the batch voided and written again, issue 61).  A handle of before the field (no
        ``marker_table``) is judged by the sink's marker table, as it was."""
        if handle.get("database") and handle["database"] != self.database:
            raise ConfigurationError(
                f"{self.describe_handle(handle)} was prepared in database {handle['database']!r} but this "
                f"sink connects to {self.database!r}; point the sink at the database of the log's handles")
        marker = handle.get("marker_table")
        if marker is not None and marker != self.marker_table:
            raise ConfigurationError(
                f"{self.describe_handle(handle)} wrote its marker row into marker table {marker!r} but this sink "
                f"reads marker table {self.marker_table!r}; its commit could not be proven there. Give the sink "
                f"marker_table={marker!r}, the one the batch was written with")

    def _resolve_missing(self, handle: dict) -> CommitResult:
        my = _my()
        try:
            conn = self._driver_conn()
        except _ConnectError as e:
            return CommitResult.retry_later(str(e))
        name = f"{handle['gtrid']}/{handle['bqual']}"
        try:
            with conn.cursor() as cur:
                # MariaDB answers 1397 too for a branch still attached to the session that prepared it,
                # while the server has not yet processed that session's disconnect: XA RECOVER lists it
                # then, and only a commit or rollback takes it off the list.
                cur.execute("XA RECOVER")
                if any(self._split_xid(r) == (handle["gtrid"], handle["bqual"]) for r in cur.fetchall()):
                    return self._commit_detached(conn, handle)
                cur.execute(f"SELECT 1 FROM {quote_ident(self.marker_table)} WHERE gtrid = %s AND bqual = %s",
                            (handle["gtrid"], handle["bqual"]))
                found = cur.fetchone() is not None
                if not found and self._marker_held(cur, handle):
                    return CommitResult.retry_later(_limbo_text(name))
        except my.Error as e:
            if _errno(e) == ER_NO_SUCH_TABLE:
                return CommitResult.lost(f"XA branch {name} does not exist and the marker table "
                                         f"{self.marker_table!r} is missing, so it cannot be proven committed")
            return CommitResult.retry_later(self._describe(e))
        finally:
            self._release(conn)
        if found:
            return CommitResult.already_committed(f"marker row of {name} present")
        # rule: a never-visible verdict rests on the marker's absence, committed and uncommitted (no
        # transaction holds its key: _marker_held); this sink deletes markers only of batches the log
        # shows COMMITTED (_prune_markers).  A marker deleted by hand is not told apart (open: issue 59's
        # "evidence someone else can delete").
        return CommitResult.lost(
            f"XA branch {name} does not exist and its marker row is absent: it was rolled back (XA ROLLBACK "
            "by someone else, or the database was restored from an older backup)", never_visible=True)

    def _commit_detached(self, conn: Any, handle: dict) -> CommitResult:
        """The branch is listed by ``XA RECOVER`` but ``XA COMMIT`` answers 1397: on MariaDB it is still
        attached to the session that prepared it, an executor's that has not disconnected (paused, or
        its disconnect not yet processed); it stays so for as long as that session lives.  A fence, not
        a timer: the handle names that session (``session``, its CONNECTION_ID(); ``session_user``, its
        user; ``session_at``, the server's clock after it connected), and it is KILLed only if
        ``information_schema.PROCESSLIST`` shows that id under that user, which is this sink's own user
        too, and the server has been up since before ``session_at``: connection ids restart with the
        server and are not reused within one run of it, so a connection with that id made after the
        branch began (after a restart) is someone else's and is never killed.  The server then detaches
        the branch, still prepared, and the commit is retried until it is (at most
        :data:`DETACH_WAIT_SECONDS`).  A handle without those fields (written before them), or a
        connection that does not match: retried later (the session idles out
        ``PREPARED_SESSION_IDLE_SECONDS`` after it pre-committed).  (MySQL 8.0.30+ detaches a branch at
        XA PREPARE by default, ``xa_detach_on_prepare``, so this is never reached there.)"""
        import time

        my = _my()
        name = f"{handle['gtrid']}/{handle['bqual']}"
        session, suser, sat = handle.get("session"), handle.get("session_user"), handle.get("session_at")
        still = CommitResult.retry_later(f"XA branch {name} is still attached to the session that prepared it")
        if not isinstance(session, int) or session <= 0:
            return still
        with conn.cursor() as cur:
            ours = False
            if isinstance(suser, str) and isinstance(sat, (int, float)):
                cur.execute("SELECT p.id FROM information_schema.PROCESSLIST p WHERE p.id = %s AND p.user = %s "
                            "AND p.user = SUBSTRING_INDEX(USER(), '@', 1)", (session, suser))
                if cur.fetchone() is not None:
                    ours = self._up_since(cur, float(sat))
            if not ours:
                # Not that connection (another user's, one made after a restart, or gone already: then
                # its disconnect is on its way).
                log.info("XA branch %s is attached to session %d, which is not the connection that prepared it "
                         "as its handle names it (user, and made before the branch began), or is gone: retried "
                         "later", name, session)
            else:
                log.warning("XA branch %s is still attached to session %d, which prepared it and did not "
                            "disconnect (a paused or hung executor): killing that connection so the branch "
                            "can be committed", name, session)
                try:
                    # rule: only the connection the handle names (id, user, made before the branch began).
                    cur.execute("KILL CONNECTION %s", (session,))
                except my.Error as e:
                    if _errno(e) != ER_NO_SUCH_THREAD:
                        raise
            deadline = time.monotonic() + DETACH_WAIT_SECONDS
            # Not while the session is still going (see _await_gone): an XA COMMIT then can be answered
            # OK and commit nothing.
            if not self._await_gone(cur, session, deadline):
                return still
            while True:
                try:
                    cur.execute("XA COMMIT %s, %s", (handle["gtrid"], handle["bqual"]))
                    return self._committed_or_limbo(cur, handle)
                except my.Error as e:
                    if _errno(e) != ER_XAER_NOTA:
                        raise
                if not self._listed(conn, handle["gtrid"], handle["bqual"]):
                    break  # gone: the marker row says committed or rolled back
                if time.monotonic() > deadline:
                    return still
                time.sleep(0.05)
            cur.execute(f"SELECT 1 FROM {quote_ident(self.marker_table)} WHERE gtrid = %s AND bqual = %s",
                        (handle["gtrid"], handle["bqual"]))
            if cur.fetchone() is not None:
                return CommitResult.already_committed(f"marker row of {name} present")
            if self._marker_held(cur, handle):
                return CommitResult.retry_later(_limbo_text(name))
        return CommitResult.lost(
            f"XA branch {name} does not exist and its marker row is absent: it was rolled back (XA ROLLBACK "
            "by someone else, or the database was restored from an older backup)", never_visible=True)

    @staticmethod
    def _await_gone(cur: Any, session: int, deadline: float) -> bool:
        """Wait (until ``deadline``, ``time.monotonic()``) for connection ``session`` to leave the server's
        process list; True once it has.  MariaDB (10.5 to 10.11 at least) hands a prepared branch over to
        ``XA RECOVER``'s list early in a session's disconnect and detaches InnoDB's transaction from the
        session only at its end; an ``XA COMMIT`` from another session in between is answered OK and
        commits nothing (:meth:`_committed_or_limbo`).  The session leaves the process list after the
        first step and a few instructions before the second: waiting for that closes nearly all of the
        window, and :meth:`_committed_or_limbo` catches the rest.  Without the PROCESS privilege the
        list shows the sink's own user's connections, which is whose branches a commit waits for."""
        while True:
            cur.execute("SELECT 1 FROM information_schema.PROCESSLIST WHERE id = %s", (session,))
            if cur.fetchone() is None:
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)

    def _committed_or_limbo(self, cur: Any, handle: dict) -> CommitResult:
        """After an ``XA COMMIT`` the server answered OK: committed only if the branch's marker row is now
        visible.  MariaDB answers OK without committing when the commit meets the preparing session's
        disconnect half done (:meth:`_await_gone`): InnoDB keeps the branch prepared and its locks held
        where no ``XA RECOVER`` lists it and no ``XA COMMIT`` reaches it, until the server restarts (its
        recovery lists the branch again).  Reported committed, the log would say COMMITTED over rows
        nobody sees, and a cleanup after that restart could roll the branch back as a settled batch's
        leftover: retried later instead, saying what to do."""
        name = f"{handle['gtrid']}/{handle['bqual']}"
        cur.execute(f"SELECT 1 FROM {quote_ident(self.marker_table)} WHERE gtrid = %s AND bqual = %s",
                    (handle["gtrid"], handle["bqual"]))
        if cur.fetchone() is not None:
            return CommitResult.committed()
        log.error("%s", _limbo_text(name))
        return CommitResult.retry_later(_limbo_text(name))

    def _marker_held(self, cur: Any, handle: dict) -> bool:
        """Does a transaction hold the key of the branch's marker row (one it inserted and has not
        ended)?  A branch not listed by ``XA RECOVER`` whose marker row is not committed is never visible
        only if no transaction holds that row: one in MariaDB's limbo (:meth:`_committed_or_limbo`) does.
        A locking read of that one key, waiting at most a second; the session's lock wait is set back to
        the server's default after it."""
        my = _my()
        cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            cur.execute(f"SELECT 1 FROM {quote_ident(self.marker_table)} WHERE gtrid = %s AND bqual = %s "
                        "FOR UPDATE", (handle["gtrid"], handle["bqual"]))
            cur.fetchall()
            return False
        except my.Error as e:
            if _errno(e) in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK):
                return True
            raise
        finally:
            cur.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")

    @staticmethod
    def _up_since(cur: Any, at: float) -> bool:
        """Has the server been up since before ``at`` (its own clock, UNIX seconds)?  Its boot time is
        now minus ``Uptime`` (whole seconds: up to 1 s late)."""
        cur.execute("SHOW GLOBAL STATUS LIKE 'Uptime'")
        row = cur.fetchone()
        cur.execute("SELECT UNIX_TIMESTAMP(NOW(6))")
        now = float(cur.fetchone()[0])
        return row is not None and now - float(_text(row[1])) < at + 1.0

    def recover_and_abort(self, handle: dict) -> None:
        """``XA ROLLBACK`` the handle's branch if it still exists (driver)."""
        # rule: the caller holds the ballot's abort (a closed ballot, no decision to commit it).
        self._rollback([(handle["gtrid"], handle["bqual"])])

    def _rollback(self, xids: list[tuple[str, str]], strict: bool = True) -> int:
        """``XA ROLLBACK`` each branch; one already gone is fine.  Other failures raise, or with
        ``strict=False`` only log (the next cleanup tries again)."""
        if not xids:
            return 0
        my = _my()
        n = 0
        conn = self._driver_conn()
        try:
            for gtrid, bqual in xids:
                try:
                    n += self._rollback_one(conn, gtrid, bqual)
                except my.Error as e:
                    # 1397 for a branch XA RECOVER still lists after the wait: still attached to the
                    # session that prepared it (one pre-committed before PREPARED_SESSION_IDLE_SECONDS
                    # was set), and nothing was rolled back.
                    msg = (f"XA ROLLBACK {gtrid}/{bqual} at {self.where} failed: {self._describe(e)}"
                           + (" (the branch is still attached to the session that prepared it)"
                              if _errno(e) == ER_XAER_NOTA else ""))
                    if strict:
                        raise TwoPhaseError(msg) from None
                    log.warning("%s; the next batch's cleanup tries again", msg)
        finally:
            self._release(conn)
        return n

    def _rollback_one(self, conn: Any, gtrid: str, bqual: str) -> bool:
        """``XA ROLLBACK`` one branch (the caller may: claimed doomed, or its ballot decided to abort);
        True if rolled back here, False if gone already.  A branch still attached to the session that
        prepared it (1397 while ``XA RECOVER`` lists it: MariaDB) is waited for: that session idles out
        ``PREPARED_SESSION_IDLE_SECONDS`` after it pre-committed, or is being closed, and the branch then
        stays prepared, detached; the rollback is tried again until then (plus ``DETACH_WAIT_SECONDS``).
        Other errors, and a branch still attached after that, raise ``pymysql.Error``."""
        my = _my()
        deadline = time.monotonic() + PREPARED_SESSION_IDLE_SECONDS + DETACH_WAIT_SECONDS
        while True:
            try:
                with conn.cursor() as cur:
                    cur.execute("XA ROLLBACK %s, %s", (gtrid, bqual))
                return True
            except my.Error as e:
                if _errno(e) != ER_XAER_NOTA:
                    raise
                if not self._listed(conn, gtrid, bqual):
                    return False  # gone already (committed or rolled back)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)

    def _listed(self, conn: Any, gtrid: str, bqual: str) -> bool:
        """Does ``XA RECOVER`` (on ``conn``) list the branch?  True when it cannot be asked: an
        abort is confirmed only by the branch's absence."""
        try:
            with conn.cursor() as cur:
                cur.execute("XA RECOVER")
                return any(self._split_xid(r) == (gtrid, bqual) for r in cur.fetchall())
        except _my().Error:
            return True

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict], *,
                        settled: Settled | None = None) -> int:
        """Roll back this ballot's prepared branches except ``keep``, and every prepared branch of an
        *earlier* batch of this query (a late task attempt's: it holds row locks) that can be claimed
        doomed, found by XA RECOVER; prune the marker rows of batches the log shows finished
        (``settled``, below the retention; None: none) and the claims of this query's branches that are
        no longer prepared (driver)."""
        my = _my()
        prefix = self._intent_prefix(query_name, batch_id, intent)
        head = self.query_prefix(query_name)
        keep_xids = {(h["gtrid"], h["bqual"]) for h in keep}
        try:
            conn = self._driver_conn()
            try:
                with conn.cursor() as cur:
                    cur.execute("SELECT NOW(6)")
                    listed_at = cur.fetchone()[0]
                listed = self._recover(conn)
            finally:
                self._release(conn)
            found = sorted(x for x in listed if x[0].startswith(head) and x not in keep_xids)
            by_name = {f"{g}\n{b}": (g, b) for g, b in found}
            own, late = names.split_leftovers(by_name, ballot_prefix=prefix, query_head=head, batch_id=batch_id)
            # rule: this ballot's own branches not in keep: its decision (or its abort) is in the log.
            n = self._rollback([by_name[k] for k in own])
            if n:
                log.info("batch %d: rolled back %d prepared XA branches under %s", batch_id, n, prefix)
            # rule: a late leftover is rolled back only once this sink holds its "doomed" claim.
            n += self._rollback_late(query_name, batch_id, [by_name[k] for k in late], settled)
            self._prune_markers(query_name, batch_id, settled)
            conn = self._driver_conn()
            try:
                # rule: only claims of branches XA RECOVER no longer lists (committed or rolled back, never
                # prepared again), made before that listing.
                self._drop_claims(conn, head, listed, listed_at)
            except my.Error as e:
                if _errno(e) != ER_NO_SUCH_TABLE:
                    log.warning("cannot delete claims of finished XA branches (%s); the next batch's cleanup "
                                "tries again", self._describe(e))
            finally:
                self._release(conn)
        except _ConnectError as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot look for leftover XA branches: {e}") from None
        except my.Error as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot look for leftover XA branches at {self.where}: "
                                f"{self._describe(e)}") from None
        return n

    def _rollback_late(self, query_name: str, batch_id: int, late: list[tuple[str, str]],
                       settled: Settled | None = None) -> int:
        """Roll back late leftovers of earlier batches, each only once claimed ``doomed``: a branch
        claimed ``decided`` is in a decision (another run of the job, a batch decided and not yet
        committed) and is left alone, however it looked.  Without the claims table, only leftovers of
        batches the log shows finished (``settled``) are rolled back: never by batch-id order."""
        if not late:
            return 0
        conn = self._driver_conn()
        try:
            doomed = self._doom(conn, f"batch {batch_id}", late, strict=False)
        finally:
            self._release(conn)
        if doomed is None:
            # No claims table: decided branches are not marked either, so only the leftovers of batches
            # the log shows finished may go (their decisions are all committed).
            head = self.query_prefix(query_name)
            doomed = [x for x in late if settled is not None
                      and (b := names.batch_of(head, f"{x[0]}\n{x[1]}")) is not None and settled(query_name, b)]
            if len(doomed) < len(late):
                log.warning("batch %d: left %d late prepared XA branches of earlier batches alone: without the claims "
                            "table %s they can be rolled back only once the log shows their batch committed; open() "
                            "the sink to create it", batch_id, len(late) - len(doomed), quote_ident(self.claims_table))
        # rule: only branches this sink holds a doomed claim on, or, without the claims table, of batches
        # the log shows finished (settled).
        n = self._rollback(doomed, strict=False)
        if n:
            log.warning("batch %d: rolled back %d prepared XA branches of earlier, finished batches of %s, "
                        "prepared late (after their batch's cleanup): %s", batch_id, n, query_name, _xids(doomed))
        return n

    def sweep_late(self, query_name: str, batch_id: int, *, settled: Settled | None = None) -> int:
        """Roll back this query's prepared branches of batches before ``batch_id`` that can be claimed
        doomed (driver)."""
        head = self.query_prefix(query_name)
        try:
            late = [(g, b) for g, b in self.prepared(head)
                    if (k := names.batch_of(head, g)) is not None and k < int(batch_id)]
            return self._rollback_late(query_name, batch_id, late, settled)
        except _ConnectError as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot look for late XA branches: {e}") from None

    def _prune_markers(self, query_name: str, batch_id: int, settled: Settled | None = None) -> int:
        """Delete the marker rows of this query's batches the log shows finished and below the retention.

        rule: a marker proves its branch committed; it may go only once the log holds the batch
        COMMITTED (or pruned after it): ``settled``, by ``_sql2pc.prunable_ranges``.  Never by batch-id
        distance: a backfill's batch 5, decided and committed but not yet COMMITTED in the log while a
        run of batch 200 cleans up, would lose the markers that prove its commits, be judged never
        visible, voided and written again (issue 59, scenario 3).  No evidence (None): nothing.

        Each row is deleted by its primary key (``gtrid = %s AND bqual = %s``): a consistent read sees
        only committed markers, and a DELETE by key equality locks only that row.  MariaDB 10.11 runs
        ``WHERE (gtrid, bqual) IN ((g, b))`` of one key as a full scan, which waited on any prepared
        branch's uncommitted marker row (another pipeline's, sharing the marker table) and failed with
        1205 after the lock wait, every batch (issue 61)."""
        ranges = names.prunable_ranges(settled, query_name, batch_id, self.marker_retention_batches)
        if not ranges:
            return 0
        my = _my()
        markers = quote_ident(self.marker_table)
        conn = self._driver_conn()
        try:
            with conn.cursor() as cur:
                cur.execute("SET SESSION innodb_lock_wait_timeout = 5")
                keys: list[tuple[Any, Any]] = []
                for first, last in ranges:
                    cur.execute(f"SELECT gtrid, bqual FROM {markers} WHERE query_name = %s "
                                "AND batch_id BETWEEN %s AND %s", (query_name, int(first), int(last)))
                    keys.extend(cur.fetchall())
                n = 0
                for i in range(0, len(keys), 100):
                    part = keys[i:i + 100]
                    n += cur.execute(f"DELETE FROM {markers} WHERE "
                                     + " OR ".join(["(gtrid = %s AND bqual = %s)"] * len(part)),
                                     [v for k in part for v in k])
                return n
        except my.Error as e:
            if _errno(e) != ER_NO_SUCH_TABLE:
                log.warning("cannot prune marker rows (%s); the next batch tries again", self._describe(e))
            return 0
        finally:
            self._release(conn)

    def describe_handle(self, handle: dict) -> str:
        return (f"XA branch {handle.get('gtrid')!r}/{handle.get('bqual')!r} in database {handle.get('database')!r} "
                f"({handle.get('rows')} rows for {handle.get('table')})")

    # -------------------------------------------------------------- executor
    def begin_transaction(self, ctx: TransactionContext) -> MySqlTransaction:
        """Connect, ``XA START`` the attempt's branch and read the table's columns (executor)."""
        my = _my()
        prefix = self._intent_prefix(ctx.query_name, ctx.batch_id, ctx.intent)
        gtrid, bqual = self.make_xid(prefix, ctx.partition_id, ctx.attempt, ctx.run,
                                     task_attempt_id=ctx.task_attempt_id)
        try:
            conn = self._connect(load=self.mode == "insert")
        except _ConnectError as e:
            raise TwoPhaseError(f"{ctx.label}: {e}") from None
        txn = MySqlTransaction(ctx, gtrid, bqual, conn, {})
        try:
            if ctx.attempt > 0 and ctx.run:
                self._roll_back_earlier_attempts(conn, ctx, f"{prefix}{int(ctx.partition_id)}")
                self._roll_back_late_leftovers(conn, ctx)
            with conn.cursor() as cur:
                cur.execute("SET SESSION innodb_lock_wait_timeout = %s", (self.lock_wait_timeout,))
                # The session the branch stays attached to on MariaDB until it disconnects: in the
                # handle, so a commit can end a lingering one (see _commit_detached).
                # Its user and the server's clock now (after it connected) name that connection: ids
                # restart with the server, and a commit KILLs only a connection of that user made before
                # the branch began (see _commit_detached).
                cur.execute("SELECT CONNECTION_ID(), SUBSTRING_INDEX(USER(), '@', 1), UNIX_TIMESTAMP(NOW(6))")
                sid, suser, sat = cur.fetchone()
                txn.extra.update(session=int(sid), session_user=_text(suser), session_at=float(sat))
                cur.execute("SELECT column_name, data_type, is_nullable, column_default, extra, character_set_name "
                            "FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
                            "ORDER BY ordinal_position", (self.database, self.table))
                for name, dtype, nullable, default, extra, charset in cur.fetchall():
                    extra = (extra or "").lower()
                    txn.columns[name] = _Column(name, str(dtype).lower(), nullable == "YES",
                                                default is not None or "auto_increment" in extra,
                                                "generated" in extra or "virtual" in extra or "persistent" in extra,
                                                str(charset).lower() if charset else None,
                                                "auto_increment" in extra)
                if not txn.columns:
                    raise MySqlWriteError(f"{ctx.label}: table {quote_ident(self.table)} does not exist in "
                                          f"database {self.database!r}")
                if self.mode == "upsert":
                    # open() checked once (once a run in the streaming form); an index a DBA added since
                    # would make ON DUPLICATE KEY UPDATE overwrite another key's row: refused before
                    # XA START, so the batch fails before prepare and nothing is written.
                    problem = _unique_index_problem(self._unique_indexes(cur), self.table, self.key_columns)
                    if problem:
                        raise MySqlWriteError(f"{ctx.label}: {problem}")
                cur.execute("XA START %s, %s", (gtrid, bqual))
                txn.started = True
        except BaseException as e:
            _close_quietly(conn)
            txn.closed = True
            if isinstance(e, my.Error):
                raise MySqlWriteError(f"{ctx.label} (xid {gtrid}/{bqual}): cannot begin: {self._describe(e)}",
                                      errno=_errno(e)) from None
            raise
        return txn

    def _roll_back_earlier_attempts(self, conn: Any, ctx: TransactionContext, gtrid: str) -> int:
        """``XA ROLLBACK`` what earlier attempts of this task left prepared, each only once claimed
        ``doomed`` (executor, before ``XA START``).  Which branches count as this task's own earlier
        attempts is the PostgreSQL sink's rule (``_sql2pc.earlier_attempts``): same gtrid (ballot and
        partition), same run, for each lower attempt number the highest task attempt id below this
        one's.  The rule is a guess and the claim is the fence: a branch the driver claimed
        ``decided`` is left alone (this attempt then waits on its locks and fails after
        ``lock_wait_timeout``; the decided branch commits).  Failures only log."""
        my = _my()
        n = 0
        try:
            candidates = names.earlier_attempts(((x, x[1]) for x in self._recover(conn) if x[0] == gtrid),
                                                attempt=ctx.attempt, task_attempt_id=ctx.task_attempt_id,
                                                run=ctx.run)
            # rule: only branches this task holds a doomed claim on.
            for g, b in self._doom(conn, ctx.label, candidates) or []:
                try:
                    if self._rollback_one(conn, g, b):
                        n += 1
                        log.info("%s: rolled back %s/%s, left prepared by an earlier attempt of this task",
                                 ctx.label, g, b)
                except my.Error as e:
                    log.warning("%s: cannot roll back %s/%s of an earlier attempt (%s); this attempt may "
                                "wait on its locks", ctx.label, g, b, self._describe(e))
        except my.Error as e:
            log.warning("%s: cannot look for earlier attempts' branches (%s); this attempt may wait on their "
                        "locks", ctx.label, self._describe(e))
        return n

    def _roll_back_late_leftovers(self, conn: Any, ctx: TransactionContext) -> int:
        """A retried attempt (its first failed, perhaps on the row locks of a late attempt's branch of
        an earlier batch, after ``lock_wait_timeout``) rolls back this query's prepared branches of
        earlier batches that it can claim ``doomed`` (executor), as the driver's :meth:`sweep_late`
        does before a batch: in the data source form no driver runs the batch again, so the retry is
        where it can pass.  A branch claimed ``decided`` is left alone.  Failures only log."""
        my = _my()
        head = self.query_prefix(ctx.query_name)
        n = 0
        try:
            late = sorted(x for x in self._recover(conn)
                          if (k := names.batch_of(head, x[0])) is not None and k < int(ctx.batch_id))
            # rule: only branches this task holds a doomed claim on.
            for g, b in self._doom(conn, ctx.label, late) or []:
                try:
                    if self._rollback_one(conn, g, b):
                        n += 1
                        log.info("%s: rolled back %s/%s, a late leftover of an earlier batch", ctx.label, g, b)
                except my.Error as e:
                    log.warning("%s: cannot roll back %s/%s, a late leftover of an earlier batch (%s)",
                                ctx.label, g, b, self._describe(e))
        except my.Error as e:
            log.warning("%s: cannot look for late leftovers of earlier batches (%s)", ctx.label, self._describe(e))
        return n

    def _map_columns(self, txn: MySqlTransaction, schema: pa.Schema) -> list[str]:
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}, table {self.table})"
        lower = {c.lower(): c for c in txn.columns}
        out: list[str] = []
        for f in schema:
            # MySQL column names are case-insensitive, as Spark's JDBC writer matches them.
            name = f.name if f.name in txn.columns else lower.get(f.name.lower())
            if name is None:
                raise MySqlWriteError(f"{label}: the DataFrame column {f.name!r} is not a column of the table; "
                                      f"table columns: {', '.join(txn.columns)}", column=f.name)
            if txn.columns[name].generated:
                raise MySqlWriteError(f"{label}: column {name!r} is a generated column and cannot be written; "
                                      "drop it from the DataFrame", column=name)
            if name in out:
                # Both would be written to one column: INSERT refuses it (1110), LOAD DATA kept the last.
                raise MySqlWriteError(f"{label}: DataFrame columns {schema.names[out.index(name)]!r} and {f.name!r} "
                                      f"both map to the table's column {name!r} (names match case-insensitively); "
                                      "drop or rename one", column=name)
            out.append(name)
        present = set(out)
        for c in txn.columns.values():
            if c.name not in present and not c.nullable and not c.has_default and not c.generated:
                raise MySqlWriteError(f"{label}: the table's column {c.name!r} is NOT NULL without a default "
                                      "but the DataFrame has no such column", column=c.name)
        if self.mode == "upsert":
            auto = [n for n in out if txn.columns[n].auto_increment and n not in self.key_columns]
            if auto:
                # open() let a unique index on this AUTO_INCREMENT column pass because new rows take fresh
                # values; a written value could match another key's row (see _check_keys).
                raise MySqlWriteError(f"{label}: column {auto[0]!r} is AUTO_INCREMENT and not an upsert key "
                                      "column: a value written to it could make ON DUPLICATE KEY UPDATE overwrite "
                                      "the row of another key; drop it from the DataFrame (the server numbers "
                                      "new rows)", column=auto[0])
            missing = [k for k in self.key_columns if k not in present]
            if missing:
                raise MySqlWriteError(f"{label}: upsert key columns {missing} are missing from the DataFrame",
                                      column=missing[0])
        return out

    def _insert_sql(self, columns: list[str]) -> tuple[str, str, str]:
        """The multi-row INSERT as (head, one row's placeholders, tail).  Only the row is formatted
        with values (``cursor.mogrify``): the quoted names in head and tail reach the server as they
        are, a ``%`` in one included (PyMySQL's ``executemany`` %-formats the statement's head)."""
        cols = ", ".join(quote_ident(c) for c in columns)
        head = f"INSERT INTO {quote_ident(self.table)} ({cols}) VALUES "
        tail = ""
        if self.mode == "upsert":
            upd = names.update_columns(columns, self.key_columns)
            # No other column: a key already there keeps its row (a no-op update of the first key).
            upd = upd or [self.key_columns[0]]
            tail = " ON DUPLICATE KEY UPDATE " + ", ".join(f"{quote_ident(c)} = VALUES({quote_ident(c)})"
                                                           for c in upd)
        return head, f"({', '.join(['%s'] * len(columns))})", tail

    def write(self, txn: MySqlTransaction, batch: pa.RecordBatch) -> None:
        """Write one Arrow batch into the branch (executor): in insert mode by ``LOAD DATA LOCAL INFILE``
        of the batch as CSV made in memory by ``pyarrow.csv`` (see :meth:`_load`), else, and for column
        types the CSV cannot carry (nested, durations), by multi-row INSERTs."""
        my = _my()
        if batch.num_rows == 0:
            return
        if txn.insert_columns is None:
            txn.insert_columns = self._map_columns(txn, batch.schema)
            txn.extra["names"] = list(batch.schema.names)
            txn.extra["sql"] = self._insert_sql(txn.insert_columns)
        elif list(batch.schema.names) != txn.extra["names"]:
            raise MySqlWriteError(f"{txn.ctx.label}: Arrow batches of one partition changed columns "
                                  f"({txn.extra['names']} then {batch.schema.names})")
        if self.mode == "upsert":
            for k in self.key_columns:
                col = batch.column(txn.insert_columns.index(k))
                if col.null_count:
                    raise MySqlWriteError(
                        f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): upsert key column {k!r} is NULL in this "
                        "partition; a NULL key matches no row, so it cannot be upserted. Nothing of this batch "
                        "became visible; filter or fill NULL keys in Spark and restart the query.", column=k)
        self._refuse_non_finite(txn, batch)
        if self.mode == "insert" and (self.host, self.port) not in _NO_LOCAL_INFILE and self._loadable(txn, batch.schema):
            csv = _csv_table(batch)
            if csv is not None:
                step = _rows_per_statement(batch.num_columns)
                for off in range(0, batch.num_rows, step):
                    if not self._load(txn, csv.slice(off, step), min(step, batch.num_rows - off)):
                        if off:  # LOCAL refused after a part was loaded: INSERT would write it twice
                            raise MySqlWriteError(f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): the server "
                                                  "stopped allowing LOAD DATA LOCAL in the middle of a batch. The "
                                                  "branch is rolled back; nothing of this batch became visible.")
                        break
                else:
                    txn.rows += batch.num_rows
                    return
        cols = [[_py_value(v) for v in batch.column(i).to_pylist()] if not (
                    pa.types.is_duration(f.type) and txn.columns[name].data_type == "time")
                else [None if v is None else _time_text(v) for v in batch.column(i).to_pylist()]
                for i, (f, name) in enumerate(zip(batch.schema, txn.insert_columns))]
        rows = list(zip(*cols))
        head, row_sql, tail = txn.extra["sql"]
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual})"
        try:
            with txn.conn.cursor() as cur:
                self._list_every_note(txn, cur)

                def insert(values: list[str]) -> None:
                    # A server without strict mode stores a bad value with a warning (a string cut to
                    # the column's length): refused as the LOAD path refuses it.
                    cur.execute(head + ", ".join(values) + tail)
                    self._refuse_warnings(cur, label, "INSERT")

                step = min(self.insert_rows, _rows_per_statement(batch.num_columns))
                for i in range(0, len(rows), step):
                    values: list[str] = []
                    size = 0
                    for row in rows[i:i + step]:
                        v = cur.mogrify(row_sql, row)
                        if values and size + len(v) > _MAX_STATEMENT:  # as executemany splits
                            insert(values)
                            values, size = [], 0
                        values.append(v)
                        size += len(v) + 2
                    insert(values)
        except my.Error as e:
            raise MySqlWriteError(
                f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): INSERT into table {self.table} failed: "
                f"{self._describe(e)}.{self._lock_wait_hint(txn, e)} The branch is rolled back; nothing of this "
                "batch became visible.",
                errno=_errno(e)) from None
        txn.rows += batch.num_rows

    def _lock_wait_hint(self, txn: MySqlTransaction, e: BaseException) -> str:
        """For a write that gave up waiting on a row lock (1205), what holds it and what to do, else "".

        A prepared branch keeps its row locks until the driver commits the batch, after every partition
        prepared: a key written by two partitions of one batch makes the second wait on the first on
        every attempt and every run (a stall, not a loss).  ``XA RECOVER`` (on a connection of its own:
        this one is inside the branch) says whether a branch of this same ballot holds it: then it is
        that, by name; otherwise it names the other candidates."""
        if _errno(e) != ER_LOCK_WAIT_TIMEOUT:
            return ""
        table = quote_ident(self.table)
        keys = ", ".join(self.key_columns) if self.key_columns else "a unique index's columns"
        ballot = txn.gtrid[:txn.gtrid.rfind(":") + 1]
        mates: list[str] = []
        try:
            conn = self._connect()
            try:
                mates = sorted(f"partition {g[len(ballot):]} ({g}/{b})" for g, b in self._recover(conn)
                               if g.startswith(ballot) and g != txn.gtrid)
            finally:
                _close_quietly(conn)
        except Exception:  # noqa: BLE001 - only a hint: the advice below stands without it
            pass
        if mates:
            found = (f" A prepared XA branch of this same batch holds rows of table {table}: "
                     f"{', '.join(mates[:5])}{', ...' if len(mates) > 5 else ''}; so a key is written by two "
                     "partitions of this batch.")
        else:
            found = (f" A row lock on table {table} was held for lock_wait_timeout={self.lock_wait_timeout}s: by a "
                     "prepared XA branch of this batch (a key written by two partitions of one batch), of a late "
                     "attempt of an earlier batch, or another writer.")
        return (f"{found} Each partition's branch keeps its row locks until the driver commits the batch, after "
                "every partition prepared, so a key in two partitions of one batch fails the second one on every "
                f"attempt and every run: repartition the DataFrame by the key columns ({keys}), "
                "df.repartition(*keys), so that each key is written by one partition.")

    def _loadable(self, txn: MySqlTransaction, schema: pa.Schema) -> bool:
        """Whether LOAD DATA stores what the INSERT path stores in the mapped columns (asked once per
        transaction).  The CSV is UTF-8 and loaded ``CHARACTER SET binary`` (binary columns get their
        bytes as they are): a text column of another character set (latin1, utf16, ...) would get the
        UTF-8 bytes unconverted, without a warning; a BIT column reads "1" as a byte string (1264).
        LOAD reads every field as text, where INSERT sends numbers: a YEAR column reads "0" as 2000
        (INSERT's 0 is 0000), an integer column rounds a float's text "2.5" half up (INSERT's double
        half to even), and a text or JSON column keeps a number's, time's or timestamp's CSV spelling
        ("1e+20", "12:00:00.000000") where INSERT stores the server's ("1e20", "12:00:00").  Those
        tables are written by INSERT."""
        ok = txn.extra.get("loadable")
        if ok is None:
            def odd_one(c: _Column, t: pa.DataType) -> bool:
                if c.data_type in ("bit", "year"):
                    return True
                if c.charset is not None and c.charset not in _LOAD_CHARSETS:
                    return True
                if c.data_type in _INTEGER_TYPES and pa.types.is_floating(t):
                    return True
                return c.data_type in _TEXT_TYPES and not (
                    pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
                    or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t) or pa.types.is_null(t)
                    or pa.types.is_dictionary(t))
            odd = [txn.columns[n] for n, f in zip(txn.insert_columns or [], schema) if odd_one(txn.columns[n], f.type)]
            ok = not odd
            txn.extra["loadable"] = ok
            if odd and self.table not in _INSERT_TABLES:
                _INSERT_TABLES.add(self.table)
                log.info("%s: table %s has columns LOAD DATA cannot write as INSERT does (%s): multi-row INSERT",
                         txn.ctx.label, quote_ident(self.table),
                         ", ".join(f"{c.name} {c.data_type}{' ' + c.charset if c.charset else ''}" for c in odd[:5]))
        return bool(ok)

    def _refuse_non_finite(self, txn: MySqlTransaction, batch: pa.RecordBatch) -> None:
        """NaN and infinities have no MySQL value: refused by name, whichever way the batch goes in
        (PyMySQL's INSERT escaping refuses them too; LOAD DATA would store 0 with a warning)."""
        import pyarrow.compute as pc

        assert txn.insert_columns is not None
        for i, f in enumerate(batch.schema):
            if (pa.types.is_float32(f.type) or pa.types.is_float64(f.type)) \
                    and batch.column(i).null_count < batch.num_rows:
                col = batch.column(i)
                if pc.any(pc.invert(pc.is_finite(col))).as_py():
                    raise MySqlWriteError(
                        f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual}): column {txn.insert_columns[i]!r} holds "
                        "NaN or an infinity, which MySQL cannot store. Nothing of this batch became visible; "
                        "replace them in Spark (e.g. with NULL) and restart the query.", column=txn.insert_columns[i])

    def _load(self, txn: MySqlTransaction, csv: pa.Table, num_rows: int) -> bool:
        """``LOAD DATA LOCAL INFILE`` of ``csv`` into the branch; False if the server does not allow it
        (``local_infile=OFF``: logged once per server and process, then INSERT is used).

        The file name is a fresh random one; the connection sends this buffer only to a request for
        exactly that name and refuses any other (:func:`_load_connection_class`).  With LOCAL the server
        turns a bad value, a NULL in a NOT NULL column or a duplicate key into a warning, even in strict
        mode: any warning, or a row count other than the batch's, fails the write."""
        import pyarrow.csv as pcsv

        my = _my()
        out = pa.BufferOutputStream()
        pcsv.write_csv(csv, out, _csv_options())
        name = f"twophase-{uuid.uuid4().hex}.csv"  # letters, digits, '-' and '.': a literal as it is
        cols = ", ".join(quote_ident(c) for c in txn.insert_columns or [])
        sql = (f"LOAD DATA LOCAL INFILE '{name}' INTO TABLE {quote_ident(self.table)} CHARACTER SET binary "
               "FIELDS TERMINATED BY ',' OPTIONALLY ENCLOSED BY '\"' ESCAPED BY '' LINES TERMINATED BY '\\n' "
               f"({cols})")
        label = f"{txn.ctx.label} (xid {txn.gtrid}/{txn.bqual})"
        conn = txn.conn
        conn._twophase_infile = (name.encode(), out.getvalue())
        try:
            with conn.cursor() as cur:
                self._list_every_note(txn, cur)
                loaded = cur.execute(sql)  # no arguments: no %-formatting of the names
                self._refuse_warnings(cur, label, "LOAD DATA")
        except my.Error as e:
            if _errno(e) in _LOCAL_INFILE_OFF:
                if (self.host, self.port) not in _NO_LOCAL_INFILE:
                    _NO_LOCAL_INFILE.add((self.host, self.port))
                    log.warning("%s: the server at %s refuses LOAD DATA LOCAL INFILE (%s); writing by multi-row "
                                "INSERT instead (slower; SET GLOBAL local_infile = ON to load)", txn.ctx.label,
                                self.where, self._describe(e))
                return False
            raise MySqlWriteError(f"{label}: LOAD DATA into table {self.table} failed: {self._describe(e)}."
                                  f"{self._lock_wait_hint(txn, e)} The "
                                  "branch is rolled back; nothing of this batch became visible.",
                                  errno=_errno(e)) from None
        finally:
            conn._twophase_infile = None
        return self._loaded(label, loaded, num_rows)

    @staticmethod
    def _list_every_note(txn: MySqlTransaction, cur: Any) -> None:
        """Once per branch: every note listed by SHOW WARNINGS (a decimal rounded to the column's scale
        gives one per row), up to the server's maximum, so that notes can be told from warnings."""
        if not txn.extra.get("max_error_count"):
            cur.execute(f"SET SESSION max_error_count = {_MAX_LISTED}")
            txn.extra["max_error_count"] = True

    def _refuse_warnings(self, cur: Any, label: str, statement: str) -> None:
        """Fail the write if the statement just run left a warning (notes pass).

        Notes (1265: a value rounded to the column's scale, a timestamp stored as a DATE) are what
        INSERT does silently in strict mode; warnings are what strict mode refuses, and what a server
        without STRICT_TRANS_TABLES (or LOAD DATA in any mode) stores anyway: a string cut to the
        column's length, a NULL made 0, an out-of-range number clamped."""
        warnings = cur.warning_count
        if not warnings:
            return
        if warnings >= _MAX_LISTED:
            # The protocol's count stops at 65,535 (and so does the list): the true count, before
            # SHOW WARNINGS (which does not clear it).
            cur.execute("SHOW COUNT(*) WARNINGS")
            warnings = int(cur.fetchone()[0])
        cur.execute("SHOW WARNINGS")
        listed = cur.fetchall()
        # Notes, and 1287 (MySQL 8.0.20+ on every upsert: "'VALUES function' is deprecated"), which is
        # about the statement's syntax, not a value.
        bad = [w for w in listed if str(w[0]).lower() != "note" and w[1] != _DEPRECATED_SYNTAX]
        if not bad and len(listed) >= warnings:
            return
        if not bad:
            raise MySqlWriteError(
                f"{label}: {statement} into table {self.table} gave {warnings} notes or warnings, more than the "
                f"server lists ({len(listed)}): whether one is a warning cannot be told. The branch is rolled back; "
                "nothing of this batch became visible.")
        shown = "; ".join(f"{w[2]} [{str(w[0]).lower()} {w[1]}]" for w in (bad or listed)[:3])
        raise MySqlWriteError(
            f"{label}: {statement} into table {self.table} gave {warnings} warning(s): {self._redact(shown)}. "
            "The branch is rolled back; nothing of this batch became visible.")

    def _loaded(self, label: str, loaded: int, num_rows: int) -> bool:
        if loaded != num_rows:
            raise MySqlWriteError(f"{label}: LOAD DATA into table {self.table} stored {loaded} of {num_rows} rows. "
                                  "The branch is rolled back; nothing of this batch became visible.")
        return True

    def pre_commit(self, txn: MySqlTransaction) -> dict:
        """Insert the marker row, ``XA END`` and ``XA PREPARE`` the branch, close the connection."""
        my = _my()
        ctx = txn.ctx
        action = "session timeout"
        try:
            with txn.conn.cursor() as cur:
                # Before XA END (a branch in IDLE or PREPARED state takes no SET): see the constant.
                cur.execute("SET SESSION wait_timeout = %s", (PREPARED_SESSION_IDLE_SECONDS,))
                action = "marker row"
                cols = ", ".join(("gtrid", "bqual") + names.MARKER_COLUMNS)
                cur.execute(f"INSERT INTO {quote_ident(self.marker_table)} ({cols}) VALUES "
                            f"({', '.join(['%s'] * (2 + len(names.MARKER_COLUMNS)))})",
                            (txn.gtrid, txn.bqual) + names.marker_values(ctx, self.table, txn.rows))
                action = "XA END"
                cur.execute("XA END %s, %s", (txn.gtrid, txn.bqual))
                action = "XA PREPARE"
                cur.execute("XA PREPARE %s, %s", (txn.gtrid, txn.bqual))
            txn.prepared = True
        except my.Error as e:
            raise MySqlWriteError(f"{ctx.label} (xid {txn.gtrid}/{txn.bqual}): {action} failed: "
                                  f"{self._describe(e)}. The branch is rolled back; nothing of this batch "
                                  "became visible.", errno=_errno(e)) from None
        _close_quietly(txn.conn)
        txn.closed = True
        return {"gtrid": txn.gtrid, "bqual": txn.bqual, "database": self.database, "table": self.table,
                "rows": txn.rows, "batch": ctx.batch_id, "partition": ctx.partition_id,
                "session": txn.extra.get("session"), "session_user": txn.extra.get("session_user"),
                "session_at": txn.extra.get("session_at"), "marker_table": self.marker_table}

    def abort(self, txn: MySqlTransaction) -> None:
        """Roll back the branch, open or prepared (executor; best effort, idempotent)."""
        my = _my()
        if txn.prepared:
            try:
                self._rollback([(txn.gtrid, txn.bqual)], strict=False)
            except _ConnectError as e:
                log.warning("%s: rolling back prepared %s/%s failed (%s); the coordinator's cleanup rolls it "
                            "back", txn.ctx.label, txn.gtrid, txn.bqual, e)
            txn.closed = True
            return
        if not txn.closed:
            try:
                with txn.conn.cursor() as cur:
                    if txn.started:
                        try:
                            cur.execute("XA END %s, %s", (txn.gtrid, txn.bqual))
                        except my.Error:
                            pass  # ended already (a failed XA PREPARE)
                        cur.execute("XA ROLLBACK %s, %s", (txn.gtrid, txn.bqual))
            except my.Error:
                pass  # closing the connection rolls back an unprepared branch too
            _close_quietly(txn.conn)
            txn.closed = True


_ConnectError = names.ConnectError
_close_quietly = names.close_quietly


#: Server errors that mean "LOAD DATA LOCAL is not allowed here": MariaDB 4166, MySQL 3948, older 1148.
_LOCAL_INFILE_OFF = frozenset({1148, 3948, 4166})
#: (host, port) of servers that refused LOAD DATA LOCAL in this process: INSERT from then on.
_NO_LOCAL_INFILE: set[tuple[str, int]] = set()
#: LOAD DATA's data packets (below any server's max_allowed_packet).
_LOAD_CHUNK = 256 * 1024


_CSV_OPTS: Any = None


def _csv_options() -> Any:
    """``pyarrow.csv.WriteOptions`` of the loads: every valid text value quoted (pyarrow's ``needed`` quotes
    each value of a string column, binary columns viewed as strings included, whatever it holds; a quote
    doubled inside, no escape character), numbers, dates and times bare (their text holds no comma, quote
    or newline), NULL as the bare word NULL, which LOAD DATA reads as NULL (the string "NULL" is quoted).
    Quoting every valid value (``all_valid``) stores the same; bare numbers are fewer bytes for the server
    to read (benchmarks/results/mysql/profile_server.txt)."""
    global _CSV_OPTS
    if _CSV_OPTS is None:
        import pyarrow.csv as pcsv

        _CSV_OPTS = pcsv.WriteOptions(include_header=False, quoting_style="needed", null_string="NULL",
                                      delimiter=",", eol="\n")
    return _CSV_OPTS


def _csv_column(col: pa.Array | pa.ChunkedArray) -> pa.Array | pa.ChunkedArray | None:
    """A column as ``pyarrow.csv`` writes it the way the INSERT path stores it, or None (no such way)."""
    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = col.type
    if (pa.types.is_integer(t) or pa.types.is_float64(t) or pa.types.is_decimal(t) or pa.types.is_string(t)
            or pa.types.is_large_string(t) or pa.types.is_date32(t) or pa.types.is_time(t) or pa.types.is_null(t)):
        return col
    if pa.types.is_float32(t) or pa.types.is_float16(t):
        return col.cast(pa.float64())  # as PyMySQL sends a Python float: its double's digits
    if pa.types.is_boolean(t):
        return col.cast(pa.int8())  # 1 / 0, as PyMySQL sends True / False
    if pa.types.is_date64(t):
        return col.cast(pa.date32())
    if pa.types.is_timestamp(t):
        # Arrow keeps instants in UTC: dropping the zone leaves UTC wall time, as _py_value sends it.
        return col.cast(pa.timestamp(t.unit)) if t.tz is not None else col
    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        if pa.types.is_fixed_size_binary(t):
            col = col.cast(pa.binary())
        # The bytes as they are (LOAD DATA ... CHARACTER SET binary converts nothing): a view, so that
        # the CSV writer does not check them for UTF-8.
        return col.view(pa.large_string() if pa.types.is_large_binary(col.type) else pa.string())
    return None


def _csv_table(batch: pa.RecordBatch) -> pa.Table | None:
    """The batch with each column as :func:`_csv_column` makes it, or None if one has no CSV form."""
    cols = []
    for i in range(batch.num_columns):
        c = _csv_column(batch.column(i))
        if c is None:
            return None
        cols.append(c)
    return pa.Table.from_arrays(cols, names=[f"c{i}" for i in range(len(cols))])


_LOAD_CLASS: Any = None


def _load_connection_class() -> Any:
    """PyMySQL's Connection whose LOAD DATA LOCAL handler sends only the in-memory buffer armed for the
    running statement (``conn._twophase_infile = (name, buffer)``), and only to a request for exactly
    that name.  PyMySQL's own handler opens whatever file name the server asks for: a server (or
    anyone in between) could read any file the executor can.  A request for any other name, or while
    nothing is armed, is answered with no data (the server loads nothing) and fails the statement."""
    global _LOAD_CLASS
    if _LOAD_CLASS is not None:
        return _LOAD_CLASS
    my = _my()
    from pymysql import connections as pmc

    class _Result(pmc.MySQLResult):  # type: ignore[misc]
        def _read_load_local_packet(self, first_packet: Any) -> None:
            conn = self.connection
            asked = pmc.LoadLocalPacketWrapper(first_packet).filename
            armed = conn._twophase_infile
            ok = conn._local_infile and armed is not None and asked == armed[0]
            try:
                if ok:
                    data = memoryview(armed[1])
                    for i in range(0, len(data), _LOAD_CHUNK):
                        conn.write_packet(data[i:i + _LOAD_CHUNK])
            finally:
                conn.write_packet(b"")  # end of data (nothing at all for a refused request)
                reply = conn._read_packet()  # raises the server's error
            if not ok:
                raise my.err.OperationalError(
                    f"refused the server's LOAD DATA LOCAL request for {asked[:100]!r}: only the sink's own "
                    "in-memory batch is sent, to a request for its name")
            if not reply.is_ok_packet():
                raise my.err.OperationalError(2014, "Commands out of sync after LOAD DATA LOCAL")
            self._read_ok_packet(reply)

    class _Connection(pmc.Connection):  # type: ignore[misc]
        _twophase_infile: tuple[bytes, Any] | None = None
        _result_class = _Result

        def _read_query_result(self, unbuffered: bool = False) -> Any:
            self._result = None
            result = self._result_class(self)
            if unbuffered:
                result.init_unbuffered_query()
            else:
                result.read()
            self._result = result
            if result.server_status is not None:
                self.server_status = result.server_status
            return result.affected_rows

    _LOAD_CLASS = _Connection
    return _LOAD_CLASS


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


def _rows_per_statement(columns: int) -> int:
    """Rows one LOAD or INSERT carries at most: a note per value at most, all of them listed."""
    return max(1, _MAX_LISTED // max(1, columns))


def _time_text(v: _dt.timedelta) -> str:
    """A duration as a TIME literal ``[-]H:MM:SS.ffffff`` (hours past 24 kept): a number would be
    read as HHMMSS (two minutes' 120 seconds as 00:01:20)."""
    us = (v.days * 86400 + v.seconds) * 1_000_000 + v.microseconds
    sign, us = ("-", -us) if us < 0 else ("", us)
    secs, frac = divmod(us, 1_000_000)
    h, rem = divmod(secs, 3600)
    return f"{sign}{h}:{rem // 60:02d}:{rem % 60:02d}.{frac:06d}"


def _py_value(v: Any) -> Any:
    """An Arrow value as PyMySQL can send it: nested values as JSON text, tz-aware times in UTC."""
    if isinstance(v, (list, dict)):
        return json.dumps(v, default=str, ensure_ascii=False)
    if isinstance(v, _dt.datetime) and v.tzinfo is not None:
        return v.astimezone(_dt.UTC).replace(tzinfo=None)
    if isinstance(v, _dt.timedelta):
        return v.total_seconds()
    if isinstance(v, (str, int, float, bool, bytes, decimal.Decimal, _dt.date, _dt.time)) or v is None:
        return v
    return str(v)


#: JDBC url properties that ask for TLS (Connector/J's and MariaDB Connector/J's): refused, as the
#: sink's PyMySQL connections take no TLS settings yet (a silent drop would not verify the server).
_URL_TLS = frozenset({"sslmode", "usessl", "requiressl", "verifyservercertificate", "trustcertificatekeystoreurl",
                      "trustcertificatekeystorepassword", "clientcertificatekeystoreurl",
                      "clientcertificatekeystorepassword", "ssl", "servercerts", "trustservercertificate",
                      "enabledsslprotocolsuites", "tlsversions"})
#: Of those, the ones that can say "no TLS" (``useSSL=false``, ``sslMode=DISABLED``): the same meaning here.
_URL_TLS_OFF = frozenset({"usessl", "requiressl", "sslmode", "ssl", "verifyservercertificate"})
_OFF = frozenset({"false", "disabled", "disable", "0", "no", "off"})
#: JDBC url properties with the same meaning here: the role and its password (as the options),
#: and Connector/J settings that change nothing of what is written (utf8mb4 text, batched inserts,
#: the MariaDB driver's mysql: scheme).
_URL_ACCEPTED = frozenset({"user", "password", "useunicode", "characterencoding", "rewritebatchedstatements",
                           "permitmysqlscheme"})


def _parse_jdbc_url(url: str) -> dict[str, Any]:
    """``jdbc:mysql://host[:port][/database][?k=v&...]`` (or ``jdbc:mariadb:``) as its parts."""
    m = re.fullmatch(r"jdbc:(mysql|mariadb)://([^/?]*)(?:/([^?]*))?(?:\?(.*))?", url.strip(), re.IGNORECASE)
    if not m:
        raise ConfigurationError("url must be jdbc:mysql://host:port/database or jdbc:mariadb://host:port/database "
                                 "(the url is not quoted here: it may hold a password)")
    hostport = m.group(2)
    if "@" in hostport or "(" in hostport or "=" in hostport:
        # Connector/J's user:password@host and address=(host=...)(password=...) forms: never parsed
        # into a host name, which messages and the sink's config show.
        raise ConfigurationError("the JDBC url's host part holds credentials or Connector/J's address=(...) "
                                 "form, which MySqlSink does not take: give host:port in the url and the user "
                                 "and password as options (the url is not quoted here: it may hold a password)")
    if "," in hostport:
        raise ConfigurationError("MySqlSink takes one host in the JDBC url (failover lists are not supported)")
    host, port_text = hostport, ""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif ":" in hostport:
        host, port_text = hostport.rsplit(":", 1)
    if port_text and not port_text.isdigit():
        raise ConfigurationError("the JDBC url's port is not a number (the url is not quoted here: it may hold "
                                 "a password)")
    port = int(port_text) if port_text else 3306
    params = {k: v for k, v in parse_qsl(m.group(4) or "", keep_blank_values=True)}
    for key in params:
        name = key.lower()
        if name in _URL_TLS and not (name in _URL_TLS_OFF and params[key].strip().lower() in _OFF):
            raise ConfigurationError(
                f"the JDBC url's {key} is not supported: MySqlSink's connections (PyMySQL) take no TLS "
                "settings yet, and would not verify the server as the url asks; drop it only where the "
                "network to the server is trusted")
        if name == "characterencoding" and params[key].strip().lower() not in ("utf8", "utf-8", "utf8mb4"):
            raise ConfigurationError(f"the JDBC url's {key}={params[key]} is not supported: MySqlSink writes text "
                                     "as utf8mb4; drop it")
        if name not in _URL_ACCEPTED and name not in _URL_TLS_OFF:
            raise ConfigurationError(f"the JDBC url's {key} is not supported by MySqlSink (PyMySQL); drop it "
                                     f"(accepted: {', '.join(sorted(_URL_ACCEPTED))})")
    return {"host": host or "127.0.0.1", "port": port, "database": unquote(m.group(3) or "") or None,
            "params": params}


def sink_from_jdbc_options(options: dict[str, str], **kw: Any) -> MySqlSink:
    """A MySqlSink from Spark's JDBC options (``url``, ``user``, ``password``, ``dbtable``).

    ``dbtable`` ``db.table`` names the database too (unquoted, as MySQL reads it); backticks quote
    a name with a dot.  ``user`` and ``password`` may also be in the url's parameters.  Other
    keyword arguments go to :class:`MySqlSink` (``mode``, ``key_columns``, ``gid_prefix`` ...)."""
    opts = {k.lower(): v for k, v in options.items()}
    if "url" not in opts:
        raise ConfigurationError("the JDBC options need url=jdbc:mysql://host:port/database")
    u = _parse_jdbc_url(opts["url"])
    params = {k.lower(): v for k, v in u["params"].items()}
    user = opts.get("user", params.get("user"))
    password = opts.get("password", params.get("password"))
    table = opts.get("dbtable")
    if not table:
        raise ConfigurationError("the JDBC options need dbtable=... (the target table)")
    database = u["database"]
    parts = re.findall(r"`((?:[^`]|``)*)`|([^.`]+)", table.strip())
    idents = [(q.replace("``", "`") if q else n.strip()) for q, n in parts]
    if len(idents) == 2:
        database, table = idents
    elif len(idents) == 1:
        table = idents[0]
    else:
        raise ConfigurationError(f"dbtable {table!r} is not table or database.table")
    if not database:
        raise ConfigurationError("the JDBC url names no database (jdbc:mysql://host:port/database) and "
                                 "dbtable is not database.table")
    return MySqlSink(u["host"], u["port"], database, table, user=user, password=password, **kw)
