"""Both sides (driver and executor tasks): the sink's options, connections (pooled on the driver,
new on an executor), the names of its XA branches (gtrid, bqual) and the table's unique indexes."""

from __future__ import annotations

import re
from typing import Any

from twophase.config import is_secret_ref, resolve_secret
from twophase.errors import ConfigurationError, HandleError
from twophase.sink import TwoPhaseCommitSink
from twophase.sinks import _sql2pc as names
from twophase.sinks.mysql.common import (
    _URL_SECRET_RE,
    MAX_QUERY_CHARS,
    MAX_XID_PART_BYTES,
    MODES,
    MySqlTransaction,
    _alive,
    _ConnectError,
    _errno,
    _my,
    query_token,
)
from twophase.sinks.mysql.infile import _load_connection_class


class _MySqlBase(TwoPhaseCommitSink[MySqlTransaction, dict]):
    """The sink's options, its connections and the names of its XA branches (driver and executor
    tasks: every part of :class:`~twophase.sinks.mysql.MySqlSink` builds on it)."""

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

    def _unique_indexes(self, cur: Any) -> list[tuple[Any, ...]]:
        """The table's unique indexes, a row per indexed column: (index, column, sub_part, extra)."""
        cur.execute("SELECT s.index_name, s.column_name, s.sub_part, c.extra FROM information_schema.statistics s "
                    "JOIN information_schema.columns c ON c.table_schema = s.table_schema "
                    "AND c.table_name = s.table_name AND c.column_name = s.column_name "
                    "WHERE s.table_schema = %s AND s.table_name = %s AND s.non_unique = 0 "
                    "ORDER BY s.index_name, s.seq_in_index", (self.database, self.table))
        return list(cur.fetchall())

    @property
    def claims_table(self) -> str:
        """``{marker_table}_claims`` (or a shortened name and a digest past 64 characters)."""
        return names.claims_name(self.marker_table, 64)

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

    def _intent_prefix(self, query_name: str, batch_id: int, intent: dict[str, Any]) -> str:
        prefix = intent.get("gid_prefix") if intent else None
        if prefix is None:
            return self.batch_prefix(query_name, batch_id)
        if not isinstance(prefix, str) or not prefix.startswith(self.batch_prefix(query_name, batch_id)):
            raise HandleError(f"INTENT of batch {batch_id} has gid_prefix {prefix!r}, which does not belong "
                              f"to query {query_name!r} batch {batch_id}")
        return prefix

    def describe_handle(self, handle: dict) -> str:
        return (f"XA branch {handle.get('gtrid')!r}/{handle.get('bqual')!r} in database {handle.get('database')!r} "
                f"({handle.get('rows')} rows for {handle.get('table')})")
