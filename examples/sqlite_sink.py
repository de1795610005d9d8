"""A small, real custom sink: exactly-once appends into a SQLite table, with a staging table.

The worked example of docs/conformance.md: subclass ``TwoPhaseCommitSink``, then
prove it with one call to ``twophase.testing.run_sink_conformance``.

Delivery guarantee: with the twophase coordinator, every row of a batch lands in
the target table exactly once, after any number of driver or task crashes.
(SQLite is one file on one machine: use it with ``local[*]`` Spark, or as a model
for a sink of your own.)

How it recovers: ``write`` appends rows to ``<table>__staging``, tagged with a
transaction id unique to the task attempt and with the execution's (ballot's)
token from ``plan_batch``, and commits them there (durable, invisible to readers
of ``<table>``).  ``pre_commit`` returns the handle
``{"txn", "rows", ...}``.  ``commit`` moves the transaction's staged rows into
``<table>``, deletes them from staging and records the transaction id in
``_twophase_commits``, all in one SQLite transaction; a second ``commit`` finds
the record and does nothing.  ``abort`` and ``abort_lingering`` delete staged
rows of transactions that will never be committed: ``abort_lingering`` only those
of the one execution its INTENT names (a newer execution of the same batch, maybe
decided by another coordinator, is never touched) and leftovers of late task
attempts of earlier batches.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import ConfigurationError
from twophase.sink import CommitResult, TwoPhaseCommitSink

COMMITS = "_twophase_commits"
_META = ("_txn", "_query", "_batch", "_ballot")


def quote(name: str) -> str:
    """A SQLite identifier, quoted (names come from Arrow schemas, never trust them)."""
    return '"' + name.replace('"', '""') + '"'


def _sql_type(t: pa.DataType) -> str:
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return "INTEGER"
    if pa.types.is_floating(t):
        return "REAL"
    if pa.types.is_binary(t) or pa.types.is_large_binary(t):
        return "BLOB"
    return "TEXT"


def _py(value: Any) -> Any:
    """Arrow scalars as SQLite values: ints, floats, str, bytes stay; the rest become text."""
    if value is None or isinstance(value, (int, float, str, bytes)):
        return value
    return str(value)


@dataclass
class SQLiteTransaction:
    """One task attempt's staged rows (executor side)."""

    ctx: TransactionContext
    txn: str
    ballot: str
    rows: int = 0


class SQLiteSink(TwoPhaseCommitSink[SQLiteTransaction, dict]):
    """Append each batch to ``table`` in the SQLite database at ``path``, exactly once.

    The table (and ``<table>__staging``) is created from the first Arrow batch's
    schema if it does not exist.
    """

    kind = "sqlite"

    def __init__(self, path: str, table: str = "events", *, busy_timeout: float = 30.0):
        if not table or table.startswith("_") or table.endswith("__staging"):
            raise ConfigurationError(f"table name {table!r} must not start with '_' or end with '__staging'")
        self.path = os.path.abspath(path)
        self.table = table
        self.staging = f"{table}__staging"
        self.busy_timeout = busy_timeout

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        return {"sink": self.kind, "path": self.path, "table": self.table, "busy_timeout": self.busy_timeout}

    def _connect(self) -> sqlite3.Connection:
        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so nothing commits behind our back.
        con = sqlite3.connect(self.path, timeout=self.busy_timeout, isolation_level=None)
        con.execute("PRAGMA synchronous=FULL")  # a COMMIT survives a machine crash
        return con

    def _columns(self, con: sqlite3.Connection) -> list[str]:
        info = con.execute(f"PRAGMA table_info({quote(self.staging)})").fetchall()
        return [row[1] for row in info if row[1] not in _META]

    # ---------------------------------------------------------------- driver
    def open(self) -> None:
        try:
            con = self._connect()
        except sqlite3.Error as e:
            raise ConfigurationError(f"SQLiteSink cannot open {self.path}: {e}") from None
        with _closing(con):
            con.execute(f"CREATE TABLE IF NOT EXISTS {quote(COMMITS)} (txn TEXT PRIMARY KEY, "
                        "query TEXT, batch INTEGER, rows INTEGER, committed_at REAL)")

    def commit(self, handle: dict) -> CommitResult:
        txn, rows = handle["txn"], int(handle["rows"])
        with _closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")  # one writer at a time: check and move atomically
            try:
                if con.execute(f"SELECT 1 FROM {quote(COMMITS)} WHERE txn = ?", (txn,)).fetchone():
                    con.execute("ROLLBACK")
                    return CommitResult.already_committed()
                staged = con.execute(f"SELECT count(*) FROM {quote(self.staging)} WHERE _txn = ?",
                                     (txn,)).fetchone()[0] if rows else 0
                if staged != rows:
                    con.execute("ROLLBACK")
                    return CommitResult.lost(f"transaction {txn} has {staged} staged rows, expected {rows} "
                                             "(staging was cleaned up by something else?)")
                if rows:
                    cols = ", ".join(quote(c) for c in self._columns(con))
                    con.execute(f"INSERT INTO {quote(self.table)} ({cols}) SELECT {cols} FROM "
                                f"{quote(self.staging)} WHERE _txn = ? ORDER BY rowid", (txn,))
                    con.execute(f"DELETE FROM {quote(self.staging)} WHERE _txn = ?", (txn,))
                con.execute(f"INSERT INTO {quote(COMMITS)} VALUES (?, ?, ?, ?, ?)",
                            (txn, handle.get("query"), handle.get("batch"), rows, time.time()))
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise
        return CommitResult.committed()

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        # Every execution (ballot) of a batch tags its staged rows with a token of its own, so
        # that cleaning up one execution never deletes another's (maybe decided) rows.
        return {"ballot": uuid.uuid4().hex[:12]}

    def recover_and_abort(self, handle: dict) -> None:
        with _closing(self._connect()) as con:
            if self._has_staging(con):
                con.execute(f"DELETE FROM {quote(self.staging)} WHERE _txn = ?", (handle["txn"],))

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[dict]) -> int:
        keep_ids = [h["txn"] for h in keep]
        with _closing(self._connect()) as con:
            if not self._has_staging(con):
                return 0
            # Not "NOT IN (NULL)" for an empty keep: that is never true in SQL and would delete nothing.
            spare = f" AND _txn NOT IN ({', '.join('?' for _ in keep_ids)})" if keep_ids else ""
            # This execution's rows, and late attempts' rows of earlier batches (committed: their
            # decided rows left staging when they were moved), never another execution's.
            cur = con.execute(f"DELETE FROM {quote(self.staging)} WHERE _query = ? AND "
                              f"((_batch = ? AND _ballot = ?) OR _batch < ?){spare}",
                              (query_name, batch_id, str(intent.get("ballot", "")), batch_id, *keep_ids))
            return cur.rowcount

    def describe_handle(self, handle: dict) -> str:
        return f"sqlite txn {handle.get('txn')} ({handle.get('rows')} rows)"

    # -------------------------------------------------------------- executor
    def begin_transaction(self, ctx: TransactionContext) -> SQLiteTransaction:
        # Unique per task attempt: a retried or replayed task never shares staged rows with another.
        ballot = str(ctx.intent.get("ballot", ""))
        txn = f"{ctx.query_name}/{ctx.batch_id}/{ballot}/{ctx.partition_id}/{ctx.attempt}/{uuid.uuid4().hex[:12]}"
        return SQLiteTransaction(ctx, txn, ballot)

    def write(self, txn: SQLiteTransaction, batch: pa.RecordBatch) -> None:
        names = batch.schema.names
        with _closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                self._ensure_tables(con, batch.schema)
                cols = ", ".join(quote(c) for c in (*_META, *names))
                marks = ", ".join("?" for _ in range(len(_META) + len(names)))
                meta = (txn.txn, txn.ctx.query_name, txn.ctx.batch_id, txn.ballot)
                columns = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
                con.executemany(f"INSERT INTO {quote(self.staging)} ({cols}) VALUES ({marks})",
                                (meta + tuple(_py(c[r]) for c in columns) for r in range(batch.num_rows)))
                con.execute("COMMIT")  # staged rows are durable now, and still invisible
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise
        txn.rows += batch.num_rows

    def pre_commit(self, txn: SQLiteTransaction) -> dict:
        # Every write already committed its rows to staging: nothing left to flush.
        return {"txn": txn.txn, "rows": txn.rows, "query": txn.ctx.query_name, "batch": txn.ctx.batch_id,
                "partition": txn.ctx.partition_id}

    def abort(self, txn: SQLiteTransaction) -> None:
        with _closing(self._connect()) as con:
            if self._has_staging(con):
                con.execute(f"DELETE FROM {quote(self.staging)} WHERE _txn = ?", (txn.txn,))

    # ---------------------------------------------------------------- tables
    def _has_staging(self, con: sqlite3.Connection) -> bool:
        return con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?",
                           (self.staging,)).fetchone() is not None

    def _ensure_tables(self, con: sqlite3.Connection, schema: pa.Schema) -> None:
        cols = ", ".join(f"{quote(f.name)} {_sql_type(f.type)}" for f in schema)
        con.execute(f"CREATE TABLE IF NOT EXISTS {quote(self.table)} ({cols})")
        con.execute(f"CREATE TABLE IF NOT EXISTS {quote(self.staging)} "
                    f"(_txn TEXT NOT NULL, _query TEXT NOT NULL, _batch INTEGER NOT NULL, _ballot TEXT NOT NULL, "
                    f"{cols})")
        con.execute(f"CREATE INDEX IF NOT EXISTS {quote(self.staging + '_txn')} ON {quote(self.staging)} (_txn)")


class _closing:
    """``with _closing(con)``: close the connection (sqlite3's own context manager only commits)."""

    def __init__(self, con: sqlite3.Connection):
        self.con = con

    def __enter__(self) -> sqlite3.Connection:
        return self.con

    def __exit__(self, *exc: object) -> None:
        self.con.close()


def read_table(path: str, table: str = "events") -> list[dict[str, Any]]:
    """All committed rows of ``table`` (what a reader of the database sees)."""
    with _closing(sqlite3.connect(path)) as con:
        if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (table,)).fetchone() is None:
            return []
        cur = con.execute(f"SELECT * FROM {quote(table)}")
        names = [d[0] for d in cur.description]
        return [dict(zip(names, row)) for row in cur.fetchall()]


def staged_transactions(path: str, table: str = "events") -> list[str]:
    """Transaction ids that still have staged rows (pre-committed or left over)."""
    with _closing(sqlite3.connect(path)) as con:
        staging = f"{table}__staging"
        if con.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (staging,)).fetchone() is None:
            return []
        return [r[0] for r in con.execute(f"SELECT DISTINCT _txn FROM {quote(staging)}")]
