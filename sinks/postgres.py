"""Exactly-once PostgreSQL sink: COPY each partition's rows into a prepared transaction, commit it on the driver.

Executors stream Arrow batches into the target table with ``COPY ... FROM STDIN``
(CSV encoded by Arrow's C++ writer), insert a marker row naming the transaction,
and ``PREPARE TRANSACTION`` under a deterministic gid.  The driver runs ``COMMIT
PREPARED`` after the coordinator logged its decision.

Delivery guarantee: with the coordinator, every row of a batch becomes visible
exactly once (insert mode), or the table ends as if each batch were upserted
once (upsert mode), after any number of driver, executor or server crashes.

How it recovers: a prepared transaction survives the death of the executor, of
the driver and a restart of PostgreSQL; its handle (gid and database) is in the
log and ``COMMIT PREPARED`` can be run from any process.  A second ``COMMIT
PREPARED`` fails with 42704 ("does not exist"); the marker row, written inside
the transaction, then tells "already committed" (present) from "lost" (absent).
Prepared transactions of attempts that never reached the decision are found in
``pg_prepared_xacts`` by the batch's gid prefix and rolled back, promptly,
because they hold their locks until then: by the driver (``abort_lingering``), and
by a retried task for its own earlier attempts of the same run, before it writes.
Who may roll back a gid is settled by one row per gid in a claims table beside the
marker table: a retried task rolls back only a gid it claimed as doomed, and before
the decision the driver claims every returned gid as decided (and checks it is still
prepared); whichever claim comes first wins, so a decided gid is never rolled back.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import re
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from twophase._deps import require
from twophase.config import is_secret_ref, resolve_secret
from twophase.context import TransactionContext
from twophase.errors import ConfigurationError, HandleError, TwoPhaseError
from twophase.sink import CommitResult, TwoPhaseCommitSink
from twophase.sinks import _postgres_dsn as _dsn
from twophase.sinks import _sql2pc as _names

if TYPE_CHECKING:
    from twophase.evidence import Settled

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


# ------------------------------------------------------------------------ catalog
@dataclass(frozen=True)
class _Column:
    name: str
    typname: str  # pg_type.typname, e.g. int8, text, _int4 (arrays start with "_")
    category: str  # pg_type.typcategory: N numeric, S string, B bool, D date/time, A array, U user, ...
    sqltype: str  # format_type(): "bigint", "numeric(10,2)", "timestamp with time zone"
    not_null: bool
    has_default: bool
    generated: bool


_COLUMNS_SQL = """
SELECT a.attname, t.typname, t.typcategory, format_type(a.atttypid, a.atttypmod), a.attnotnull,
       a.atthasdef OR a.attidentity <> '', a.attgenerated <> ''
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


def _fetch_columns(cur: Any, oid: int) -> dict[str, _Column]:
    cur.execute(_COLUMNS_SQL, (oid,))
    return {r[0]: _Column(*r) for r in cur.fetchall()}


def _arrow_fits(at: pa.DataType, col: _Column) -> bool:
    """Whether Arrow type ``at`` can be written to ``col`` through COPY text (coarse, before any I/O).

    Strings go anywhere (the server parses them and names the column if it cannot);
    other types must land in a column of a matching family.
    """
    t = pa.types
    if t.is_dictionary(at):
        at = at.value_type
    if t.is_null(at) or t.is_string(at) or t.is_large_string(at):
        return True
    if col.category == "S" and not (t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at)):
        return True  # text, varchar, char: every scalar and nested value renders as text
    if col.typname in ("int2", "int4", "int8") and (t.is_floating(at) or (t.is_decimal(at) and at.scale > 0)):
        return False  # "1.5" is no integer: cast (and round) in Spark, explicitly
    if t.is_integer(at) or t.is_floating(at) or t.is_decimal(at):
        return col.category == "N"
    if t.is_boolean(at):
        return col.category == "B"
    if t.is_date(at):
        return col.typname in ("date", "timestamp", "timestamptz")
    if t.is_timestamp(at):
        return col.typname in ("timestamp", "timestamptz", "date")
    if t.is_time(at):
        return col.typname in ("time", "timetz")
    if t.is_duration(at):
        return col.typname == "interval"
    if t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at):
        return col.typname == "bytea"
    if t.is_list(at) or t.is_large_list(at) or t.is_fixed_size_list(at):
        return col.category == "A" or col.typname in ("json", "jsonb")
    if t.is_struct(at) or t.is_map(at):
        return col.typname in ("json", "jsonb")
    return False


def _pg_array_literal(value: Any) -> str:
    """A Python list as a PostgreSQL array literal: {1,2,NULL,"a \\"b\\""}."""
    if value is None:
        return "NULL"
    if isinstance(value, list):
        return "{" + ",".join(_pg_array_literal(v) for v in value) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (bytes, bytearray)):
        value = "\\x" + bytes(value).hex()
    s = str(value)
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _jsonable(value: Any) -> Any:
    if isinstance(value, list):
        # Arrow maps come back as lists of (key, value) tuples.
        if value and all(isinstance(v, tuple) and len(v) == 2 for v in value):
            return {str(k): _jsonable(v) for k, v in value}
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).hex()
    return value


def _to_text_friendly(arr: pa.Array, col: _Column) -> pa.Array:
    """Convert one Arrow column to something Arrow's CSV writer renders the way COPY reads it."""
    t = pa.types
    if t.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    at = arr.type
    if t.is_null(at):
        return pa.array([None] * len(arr), pa.string())
    if t.is_binary(at) or t.is_large_binary(at) or t.is_fixed_size_binary(at):
        return pa.array([None if v is None else "\\x" + v.hex() for v in arr.to_pylist()], pa.string())
    if t.is_duration(at):
        unit = {"s": "seconds", "ms": "milliseconds", "us": "microseconds", "ns": "microseconds"}[at.unit]
        vals = arr.cast(pa.int64()).to_pylist()
        if at.unit == "ns":
            vals = [None if v is None else v // 1000 for v in vals]
        return pa.array([None if v is None else f"{v} {unit}" for v in vals], pa.string())
    if t.is_list(at) or t.is_large_list(at) or t.is_fixed_size_list(at) or t.is_struct(at) or t.is_map(at):
        if col.category == "A":
            return pa.array([None if v is None else _pg_array_literal(v) for v in arr.to_pylist()], pa.string())
        return pa.array([None if v is None else json.dumps(_jsonable(v), default=str, ensure_ascii=False)
                         for v in arr.to_pylist()], pa.string())
    if t.is_boolean(at) or t.is_integer(at) or t.is_floating(at) or t.is_decimal(at) or t.is_string(at) \
            or t.is_large_string(at) or t.is_date(at) or t.is_timestamp(at) or t.is_time(at):
        return arr
    return pa.array([None if v is None else str(v) for v in arr.to_pylist()], pa.string())


def encode_csv(batch: pa.RecordBatch, columns: list[_Column] | None = None) -> bytes:
    """Encode a RecordBatch as COPY-compatible CSV (no header; NULL = empty unquoted field).

    Arrow quotes every string (so an empty string is ``""`` and a lone ``\\.`` is
    not COPY's end-of-data marker) and writes timestamps as ISO text, tz-aware
    ones in UTC with ``Z``.  ``columns`` (the target columns, same order) drive
    conversions for bytea, intervals, arrays and JSON; without them nested values
    become JSON text.
    """
    import pyarrow.csv as pacsv

    arrays, names = [], []
    for i, name in enumerate(batch.schema.names):
        col = columns[i] if columns else _Column(name, "text", "S", "text", False, False, False)
        arrays.append(_to_text_friendly(batch.column(i), col))
        names.append(f"c{i}")  # header is not written; unique names keep Arrow happy
    buf = io.BytesIO()
    pacsv.write_csv(pa.RecordBatch.from_arrays(arrays, names=names), buf,
                    pacsv.WriteOptions(include_header=False))
    return buf.getvalue()


# -------------------------------------------------------------------- transaction
@dataclass
class PostgresTransaction:
    """One partition's open PostgreSQL transaction of one batch (executor side)."""

    ctx: TransactionContext
    gid: str
    conn: Any
    database: str
    table_oid: int
    columns: dict[str, _Column]
    stage: str | None = None  # upsert: the per-transaction staging table
    copy_columns: list[str] | None = None  # the batch's columns, fixed by the first write
    rows: int = 0
    bytes: int = 0
    prepared: bool = False
    closed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


class PostgresSink(TwoPhaseCommitSink[PostgresTransaction, dict]):
    """Write each batch into a PostgreSQL table exactly once, by prepared transactions.

    ``dsn``: a libpq connection string or URI (``host=... port=... dbname=... user=...``),
    or a ``jdbc:postgresql://host:port/db?user=...&password=...`` URL (translated to libpq
    parameters); ``None`` uses libpq's environment (``PGHOST``, ``PGPASSWORD``,
    ``~/.pgpass`` ...).  A password in the DSN is taken out at once and kept only in
    memory; a malformed DSN is refused without quoting it.  ``password`` may instead be
    a secret reference ``{"env": "VAR"}`` / ``{"file": "/path"}``, resolved where a
    connection is made (driver and executors).

    ``table`` (and optional ``schema``) name the target table literally: they are
    identifiers, quoted, never parsed (``"my.table"`` is one name with a dot).

    ``mode="insert"`` appends rows with COPY.  ``mode="upsert"`` COPYs into a
    staging table created inside the transaction, then ``INSERT ... ON CONFLICT
    (key_columns) DO UPDATE``; the table needs a UNIQUE constraint or index on
    exactly ``key_columns``.  Within one transaction the last row of a key wins.

    ``marker_table`` (in ``marker_schema``, default: the role's current schema when
    :meth:`open` runs, never another schema of its search path) holds one row per
    committed transaction, the proof that a gid was committed;
    rows of batches older than ``marker_retention_batches`` are deleted.
    ``lock_timeout`` bounds how long an executor waits for a row lock (e.g. held by
    a leftover prepared transaction) before failing the batch.
    """

    kind = "postgres"

    def __init__(self, dsn: str | None = None, table: str | None = None, *, schema: str | None = None,
                 mode: str = "insert", key_columns: list[str] | tuple[str, ...] | None = None,
                 password: str | dict[str, str] | None = None, marker_table: str = "twophase_commits",
                 marker_schema: str | None = None, gid_prefix: str = "tp",
                 lock_timeout: str | None = "60s", connect_timeout: int = 10,
                 marker_retention_batches: int = 100, application_name: str = "twophase"):
        _pg()  # fail now, naming the extra to install, if psycopg2 is missing
        if not table or not isinstance(table, str):
            raise ConfigurationError("PostgresSink needs table=... (the target table's name)")
        if mode not in MODES:
            raise ConfigurationError(f"PostgresSink mode must be one of {', '.join(MODES)}, got {mode!r}")
        keys = list(key_columns or [])
        if mode == "upsert" and not keys:
            raise ConfigurationError("PostgresSink(mode='upsert') needs key_columns=[...] (the columns of "
                                     "a UNIQUE constraint or index of the table)")
        if mode == "insert" and keys:
            raise ConfigurationError("key_columns only apply to mode='upsert'; remove them or set "
                                     "mode='upsert'")
        if len(set(keys)) != len(keys):
            raise ConfigurationError(f"key_columns has duplicates: {keys}")
        if not gid_prefix or _safe(gid_prefix) != gid_prefix or ":" in gid_prefix:
            raise ConfigurationError(f"gid_prefix {gid_prefix!r} must be letters, digits, '_', '-' or '.'")
        if marker_retention_batches < 1:
            raise ConfigurationError("marker_retention_batches must be >= 1")
        params: dict[str, str] = _dsn.parse(dsn) if dsn else {}
        inline = {k: params.pop(k) for k in _SECRET_DSN_KEYS if k in params}
        if password is not None and "password" in inline:
            raise ConfigurationError("give the password either in the dsn or as password=..., not both")
        if password is not None and not is_secret_ref(password) and not isinstance(password, str):
            raise ConfigurationError('password must be a string or a secret reference {"env": "VAR"}')
        self.params = params  # connection parameters, never a secret
        self.table = table
        self.schema = schema
        self.mode = mode
        self.key_columns = keys
        self.marker_table = marker_table
        self.marker_schema = marker_schema
        self.gid_prefix = gid_prefix
        self.lock_timeout = lock_timeout
        self.connect_timeout = int(connect_timeout)
        self.marker_retention_batches = int(marker_retention_batches)
        self.application_name = application_name
        # A secret reference is configuration; an inline password is only kept in memory.
        self._password_ref = password if is_secret_ref(password) else None
        self._password_inline = password if isinstance(password, str) else inline.get("password")
        self._sslpassword = inline.get("sslpassword")
        self._max_prepared: int | None = None
        # The marker table's schema: marker_schema, else the role's current schema, fixed by open()
        # (not left to the search_path, where another role's table in a later schema would win).
        self._marker_home: str | None = marker_schema
        # The target table's schema: schema, else the one the session's search_path resolved the table
        # to (open(), or target() first): what target() names, so that two jobs writing same-named
        # tables of two schemas are two jobs.
        self._table_home: str | None = schema
        self._pool = _names.ConnectionPool()

    # -------------------------------------------------------------- plumbing

    def __repr__(self) -> str:
        return f"PostgresSink({self.where}, table={self.target_name}, mode={self.mode!r})"

    @property
    def dsn(self) -> str:
        """The connection string without any secret."""
        return _pg().extensions.make_dsn(**self.params) if self.params else ""

    @property
    def where(self) -> str:
        """``user@host:port/dbname`` for messages (no password)."""
        p = self.params
        return f"{p.get('user', '')}{'@' if p.get('user') else ''}{p.get('host', '(libpq default)')}" \
               f":{p.get('port', '5432')}/{p.get('dbname', '(default)')}"

    @property
    def target_name(self) -> str:
        return f"{self.schema}.{self.table}" if self.schema else self.table

    def _ident(self, schema: str | None, name: str) -> Any:
        sql = _pg().sql
        return sql.Identifier(schema, name) if schema else sql.Identifier(name)

    @property
    def _target(self) -> Any:
        return self._ident(self.schema, self.table)

    @property
    def _marker(self) -> Any:
        return self._ident(self._marker_home, self.marker_table)

    def _claims_in(self, schema: str | None) -> Any:
        """The claims table beside the marker table in ``schema`` (see :meth:`verify_prepared`)."""
        return self._ident(schema, _claims_name(self.marker_table))

    def _connect(self, autocommit: bool) -> Any:
        """A new connection (driver or executor); errors name the server, never the password."""
        pg = _pg()
        kw: dict[str, Any] = {}
        if "connect_timeout" not in self.params:  # the dsn's own value wins, like application_name
            kw["connect_timeout"] = self.connect_timeout
        if "application_name" not in self.params:
            kw["application_name"] = self.application_name
        pw = resolve_secret(self._password_ref, "PostgresSink password") if self._password_ref \
            else self._password_inline
        if pw is not None:
            kw["password"] = pw
        if self._sslpassword is not None:
            kw["sslpassword"] = self._sslpassword
        try:
            conn = pg.connect(self.dsn, **kw)
        except pg.Error as e:
            raise _ConnectError(f"cannot connect to PostgreSQL at {self.where}: "
                                f"{self._redact(str(e)).strip()}") from None
        conn.autocommit = autocommit
        return conn

    def _redact(self, text: str) -> str:
        """``scrub`` plus the inline passwords themselves, wherever a message might echo them."""
        text = scrub(text)
        for secret in (self._password_inline, self._sslpassword):
            if secret and len(secret) >= 4:
                text = text.replace(secret, "***")
        return text

    @contextmanager
    def _driver_cursor(self) -> Iterator[Any]:
        """An autocommit cursor on a pooled driver connection (driver; thread-safe).

        A connection that failed is closed, never returned to the pool.
        """
        pg = _pg()
        conn = self._pool.take(lambda: self._connect(autocommit=True), lambda c: not c.closed)
        ok = False
        try:
            with conn.cursor() as cur:
                yield cur
            ok = True
        except pg.Error as e:
            # A server error leaves an autocommit connection usable; a broken one is dropped.
            ok = conn.closed == 0 and not isinstance(e, (pg.OperationalError, pg.InterfaceError))
            raise
        finally:
            self._pool.give(conn, ok)

    def close(self) -> None:
        """Close the driver's pooled connections."""
        self._pool.close()

    def target(self) -> str:
        """What is written, not the way there: a job reached through another host name, port (a pooler,
        a proxy) or user is the same job.  The schema is always named: the one given, else the one the
        ``search_path`` resolves the table to (asked of the server once, here or in :meth:`open`), so
        that two batch jobs of one name and log writing same-named tables of two schemas get two batch
        query ids (the second is refused) rather than one (the second silently skipped as committed).
        A log generation bound by an older version (schema left out) is taken over by the first job
        that claims it (:func:`twophase.log.remember_former_target`)."""
        schema = self.schema or self._table_home or self._resolve_table_home()
        db = self.params.get('dbname', '(default)')
        target = f"postgres database {db} table {schema}.{self.table}"
        if not self.schema:
            from twophase.log import remember_former_target

            homes: list[str] = []

            def wrote(h: dict[str, Any]) -> bool:
                # An older version's handle names the schema of its marker table; this job's is where
                # its search_path finds the marker table now (or its current schema, as open() would).
                if not homes:
                    homes.append(self._marker_home or self._resolve_marker_home())
                return h.get("marker_schema") == homes[0]

            remember_former_target(target, f"postgres database {db} table {self.table}", wrote)
        return target

    def _resolve_marker_home(self) -> str:
        """The schema this sink's marker table is in for the session's ``search_path`` (the schema
        open() would create it in when there is none: the current schema) (driver)."""
        try:
            with self._driver_cursor() as cur:
                cur.execute("SELECT COALESCE((SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON "
                            "n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)), current_schema())",
                            (self._quoted(cur, self._marker),))
                return str(cur.fetchone()[0])
        except (_ConnectError, _pg().Error) as e:
            raise ConfigurationError(f"PostgresSink could not resolve the schema of its marker table at "
                                     f"{self.where}: {e}") from None

    def _resolve_table_home(self) -> str:
        """The schema the session's ``search_path`` resolves the table to (driver, once)."""
        pg = _pg()
        try:
            with self._driver_cursor() as cur:
                home = self._table_schema_of(cur)
        except _ConnectError as e:
            raise ConfigurationError(str(e)) from None
        except pg.Error as e:
            raise ConfigurationError(f"PostgresSink could not resolve the schema of {self.table!r} at "
                                     f"{self.where}: {_describe_pg_error(e)}") from None
        if home is None:
            raise ConfigurationError(f"table {self.table!r} is not found in the search_path of the sink's role at "
                                     f"{self.where}; create it first, or name its schema=...")
        return home

    def _table_schema_of(self, cur: Any) -> str | None:
        cur.execute("SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.oid = to_regclass(%s)", (self._quoted(cur, self._target),))
        row = cur.fetchone()
        if row is not None and not self.schema:
            self._table_home = row[0]
        return None if row is None else str(row[0])

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """Everything needed to rebuild this sink, without secrets.

        A password given as a reference is kept as the reference; one given inline
        (in the dsn or as a string) is left out: the rebuilt sink then authenticates
        through libpq's environment (``PGPASSWORD``, ``PGPASSFILE`` / ``~/.pgpass``),
        or pass ``password={"env": "VAR"}``.
        """
        cfg: dict[str, Any] = {"sink": self.kind, "dsn": self.dsn, "table": self.table,
                               "schema": self.schema, "mode": self.mode, "key_columns": list(self.key_columns),
                               "marker_table": self.marker_table, "marker_schema": self.marker_schema,
                               "gid_prefix": self.gid_prefix, "lock_timeout": self.lock_timeout,
                               "connect_timeout": self.connect_timeout,
                               "marker_retention_batches": self.marker_retention_batches,
                               "application_name": self.application_name}
        if isinstance(self._password_ref, dict):  # a secret reference, never the password itself
            cfg["password"] = dict(self._password_ref)
        return cfg

    # ---------------------------------------------------------------- driver
    def executor_modules(self) -> list[str]:
        return ["pyarrow", "psycopg2"]

    def max_parallelism(self) -> int | None:
        """Half of ``max_prepared_transactions`` (known after :meth:`open`): a batch's prepared
        transactions must fit beside leftovers of a failed attempt and other writers' ones."""
        return None if self._max_prepared is None else max(1, self._max_prepared // 2)

    def open(self) -> None:
        """Check the server and the table before the first batch (driver).

        Refuses ``max_prepared_transactions = 0``, a missing table, a role that
        cannot write it, and (upsert) key columns without a UNIQUE index.  Creates
        the marker table if it is missing.
        """
        pg = _pg()
        sql = pg.sql
        try:
            with self._driver_cursor() as cur:
                cur.execute("SELECT current_setting('max_prepared_transactions')::int, current_database(), "
                            "current_user, current_schema()")
                max_prepared, database, user, current_schema = cur.fetchone()
                if max_prepared == 0:
                    raise ConfigurationError(
                        f"PostgreSQL at {self.where} has max_prepared_transactions = 0, so it cannot "
                        "PREPARE TRANSACTION. Set max_prepared_transactions in postgresql.conf (or "
                        "ALTER SYSTEM SET max_prepared_transactions = 64) to at least the number of "
                        "Spark partitions per batch times the batches that may be pending (e.g. 2 x "
                        "partitions), and restart PostgreSQL.")
                self._max_prepared = max_prepared
                self._marker_home = self.marker_schema or current_schema
                oid = self._table_oid(cur)
                if oid is None:
                    raise ConfigurationError(
                        f"table {self._quoted(cur, self._target)} does not exist in database {database!r} "
                        f"(as user {user!r}, current schema {current_schema!r}); create it first")
                self._table_schema_of(cur)  # what target() names (resolved by the search_path now)
                cur.execute("SELECT relkind FROM pg_class WHERE oid = %s", (oid,))
                if cur.fetchone()[0] not in ("r", "p"):
                    raise ConfigurationError(f"{self._quoted(cur, self._target)} is not a table "
                                             "(a view or foreign table cannot take COPY)")
                needed = ["INSERT"] + (["SELECT", "UPDATE"] if self.mode == "upsert" else [])
                for priv in needed:
                    cur.execute("SELECT has_table_privilege(%s, %s)", (oid, priv))
                    if not cur.fetchone()[0]:
                        raise ConfigurationError(
                            f"role {user!r} lacks {priv} on {self._quoted(cur, self._target)}; "
                            f"GRANT {', '.join(needed)} ON {self._quoted(cur, self._target)} TO "
                            f"{sql.Identifier(user).as_string(cur)}")
                columns = _fetch_columns(cur, oid)
                if self.mode == "upsert":
                    self._check_keys(cur, oid, columns)
                    stage_schema = self.marker_schema or current_schema
                    cur.execute("SELECT has_schema_privilege(%s, 'CREATE')", (stage_schema,))
                    if not cur.fetchone()[0]:
                        raise ConfigurationError(
                            f"upsert stages rows in a table created per transaction in schema "
                            f"{stage_schema!r}, where role {user!r} may not create tables; GRANT CREATE ON "
                            f"SCHEMA {sql.Identifier(stage_schema).as_string(cur)} TO "
                            f"{sql.Identifier(user).as_string(cur)}, or set marker_schema=... to a schema "
                            "where it may")
                self._ensure_marker(cur, user)
                self._ensure_claims(cur, user)
        except _ConnectError as e:
            raise ConfigurationError(str(e)) from None
        except pg.Error as e:
            raise ConfigurationError(f"PostgresSink could not check {self.target_name} at {self.where}: "
                                     f"{_describe_pg_error(e)}") from None

    def _quoted(self, cur: Any, ident: Any) -> str:
        return ident.as_string(cur)

    def _table_oid(self, cur: Any) -> int | None:
        cur.execute("SELECT to_regclass(%s)::oid", (self._quoted(cur, self._target),))
        return cur.fetchone()[0]

    def _check_keys(self, cur: Any, oid: int, columns: dict[str, _Column]) -> None:
        target = self._quoted(cur, self._target)
        missing = [k for k in self.key_columns if k not in columns]
        if missing:
            raise ConfigurationError(f"key_columns {missing} are not columns of {target} "
                                     f"(columns: {', '.join(columns)})")
        cur.execute("""
            SELECT array_agg(a.attname::text ORDER BY a.attname)
            FROM pg_index i JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
            WHERE i.indrelid = %s AND i.indisunique AND i.indpred IS NULL AND i.indexprs IS NULL
            GROUP BY i.indexrelid""", (oid,))
        wanted = sorted(self.key_columns)
        if not any(sorted(r[0]) == wanted for r in cur.fetchall()):
            cols = ", ".join(_pg().sql.Identifier(k).as_string(cur) for k in self.key_columns)
            raise ConfigurationError(
                f"upsert on {target} needs a UNIQUE constraint or index on exactly ({cols}) for "
                f"ON CONFLICT; create one: ALTER TABLE {target} ADD UNIQUE ({cols})")

    def _ensure_marker(self, cur: Any, user: str) -> None:
        pg = _pg()
        sql = pg.sql
        marker = self._quoted(cur, self._marker)
        cur.execute("SELECT to_regclass(%s)::oid", (marker,))
        if cur.fetchone()[0] is None:
            ddl = sql.SQL(
                "CREATE TABLE IF NOT EXISTS {m} (gid text PRIMARY KEY, query_name text NOT NULL, "
                "batch_id bigint NOT NULL, partition_id integer NOT NULL, attempt integer NOT NULL, "
                "target_table text NOT NULL, row_count bigint NOT NULL, "
                "prepared_at timestamptz NOT NULL DEFAULT now())").format(m=self._marker)
            idx = sql.SQL("CREATE INDEX IF NOT EXISTS {i} ON {m} (query_name, batch_id)").format(
                i=sql.Identifier((self.marker_table + "_query_batch")[:63]), m=self._marker)
            try:
                cur.execute(ddl)
                cur.execute(idx)
            except pg.errors.InsufficientPrivilege:
                raise ConfigurationError(
                    f"the marker table {marker} does not exist and role {user!r} may not create it; "
                    f"have an administrator run: {ddl.as_string(cur)}; {idx.as_string(cur)}; "
                    f"GRANT SELECT, INSERT, DELETE ON {marker} TO {sql.Identifier(user).as_string(cur)}"
                ) from None
            except pg.errors.UniqueViolation:
                pass  # created concurrently by another driver
        for priv in ("SELECT", "INSERT", "DELETE"):
            cur.execute("SELECT has_table_privilege(to_regclass(%s), %s)", (marker, priv))
            if not cur.fetchone()[0]:
                raise ConfigurationError(f"role {user!r} lacks {priv} on the marker table {marker}; "
                                         f"GRANT SELECT, INSERT, DELETE ON {marker} TO "
                                         f"{sql.Identifier(user).as_string(cur)}")

    def _ensure_claims(self, cur: Any, user: str) -> None:
        """Create the claims table beside the marker table if it is missing (driver, :meth:`open`).

        One row per gid, ``(gid, state, at)``; state ``prepared`` (the executor's, after
        PREPARE TRANSACTION), ``doomed`` (a retried task's, before it rolls the gid back) or
        ``decided`` (the driver's, before the decision is logged).  Every change is one
        statement on the gid's row, so PostgreSQL's row lock decides which of ``doomed`` and
        ``decided`` comes first, and the other never happens.  A role that may not create it
        is refused, naming the DDL and the grant.  A role that may not write an existing one
        is only warned: its retried tasks then never roll an earlier attempt back (they wait
        on its locks and fail after ``lock_timeout``), and the driver checks the gids as before.
        """
        pg = _pg()
        sql = pg.sql
        claims_ident = self._claims_in(self._marker_home)
        claims = self._quoted(cur, claims_ident)
        grant = (f"GRANT SELECT, INSERT, UPDATE, DELETE ON {claims} TO "
                 f"{sql.Identifier(user).as_string(cur)}")
        cur.execute("SELECT to_regclass(%s)::oid", (claims,))
        if cur.fetchone()[0] is None:
            ddl = sql.SQL(
                "CREATE TABLE IF NOT EXISTS {c} (gid text PRIMARY KEY, state text NOT NULL "
                "CHECK (state IN ('prepared', 'doomed', 'decided')), at timestamptz NOT NULL DEFAULT now())"
            ).format(c=claims_ident)
            try:
                cur.execute(ddl)
            except pg.errors.InsufficientPrivilege:
                raise ConfigurationError(
                    f"the claims table {claims} (who may roll back which prepared transaction: a retried "
                    f"task, or nobody once its batch is decided) does not exist and role {user!r} may not "
                    f"create it; have an administrator run: {ddl.as_string(cur)}; {grant}") from None
            except pg.errors.UniqueViolation:
                pass  # created concurrently by another driver
        cur.execute("SELECT has_table_privilege(to_regclass(%s), 'SELECT') AND has_table_privilege("
                    "to_regclass(%s), 'INSERT') AND has_table_privilege(to_regclass(%s), 'UPDATE') AND "
                    "has_table_privilege(to_regclass(%s), 'DELETE')", (claims,) * 4)
        if not cur.fetchone()[0]:
            log.warning("role %r may not write the claims table %s: its retried tasks will never roll back "
                        "what an earlier attempt left prepared (they wait on its locks and fail after "
                        "lock_timeout), and the driver rolls back late leftovers of earlier batches without "
                        "claiming them (two overlapping runs of one batch job could roll back each other's "
                        "decided transactions); to let them: %s", user, claims, grant)

    def batch_prefix(self, query_name: str, batch_id: int) -> str:
        """``{gid_prefix}:{query}:{batch}:`` — every gid of any attempt of this batch starts so."""
        return f"{self.gid_prefix}:{_safe(query_name)}:{int(batch_id)}:"

    def make_gid(self, intent_prefix: str, partition_id: int, attempt: int, run: str = "", *,
                 task_attempt_id: int | None = None) -> str:
        """The gid of one task attempt of one execution of a batch.  < 200 bytes or refused.

        ``{prefix}{partition}:{attempt}.{task_attempt_id}:{run}``, without ``:{run}`` when
        ``run`` (:attr:`TransactionContext.run`) is empty.  Spark numbers attempts from 0
        in every job, so only ``run`` keeps a replay's gids apart from those of the
        execution before it; and from 0 again in every stage attempt (SPARK-24589), so
        only Spark's ``taskAttemptId()`` (unique in its SparkContext) keeps an attempt of
        a resubmitted stage apart from the attempt of the same number in the stage
        attempt before it, which may be the result Spark accepts.  Without a task attempt
        id (``None`` or negative: not known) the old form ``{prefix}{partition}:{attempt}[:{run}]``.
        """
        gid = f"{intent_prefix}{int(partition_id)}:{_names.attempt_name(attempt, task_attempt_id, run)}"
        n = len(gid.encode())
        if n > MAX_GID_BYTES:
            raise ConfigurationError(
                f"prepared-transaction gid {gid!r} is {n} bytes; PostgreSQL allows at most "
                f"{MAX_GID_BYTES}. Shorten the coordinator's name=... or the sink's gid_prefix=...")
        return gid

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT: the gid prefix of this batch (driver).

        The prefix carries a random token, drawn once per INTENT (one ballot, one execution
        of the batch): a re-run of the batch is a new ballot with gids of its own, so aborting
        a closed ballot's gids, however late, never touches a later one; and a new log
        generation, whose batch ids restart at 0, can never reuse an old batch's gid (and
        marker row).
        """
        prefix = f"{self.batch_prefix(query_name, batch_id)}{uuid.uuid4().hex[:8]}:"
        # Longest gid this batch may use (attempt numbers up to 9999, any task attempt id, the longest run).
        self.make_gid(prefix, max(num_partitions - 1, 0), 9999, "r" * MAX_RUN_CHARS,
                      task_attempt_id=MAX_TASK_ATTEMPT_ID)
        if self._max_prepared is not None and num_partitions > self._max_prepared:
            raise ConfigurationError(
                f"batch {batch_id} runs {num_partitions} partitions, each a prepared transaction, but "
                f"max_prepared_transactions = {self._max_prepared} at {self.where}. Raise it to at "
                f"least {2 * num_partitions} (restart PostgreSQL), or write with fewer tasks (the Coordinator "
                f"writes a batch with at most max_prepared_transactions // 2 = {self._max_prepared // 2}).")
        return {"gid_prefix": prefix, "table": self.target_name, "database": self.params.get("dbname")}

    def _intent_prefix(self, query_name: str, batch_id: int, intent: dict[str, Any]) -> str:
        prefix = intent.get("gid_prefix") if intent else None
        if prefix is None:
            return self.batch_prefix(query_name, batch_id)  # every attempt of the batch
        if not isinstance(prefix, str) or not prefix.startswith(self.batch_prefix(query_name, batch_id)):
            raise HandleError(f"INTENT of batch {batch_id} has gid_prefix {prefix!r}, which does not belong "
                              f"to query {query_name!r} batch {batch_id}")
        return prefix

    def prepared(self, prefix: str = "") -> list[dict[str, Any]]:
        """Prepared transactions of this database whose gid starts with ``prefix`` (driver)."""
        with self._driver_cursor() as cur:
            cur.execute("SELECT gid, prepared, owner FROM pg_prepared_xacts "
                        "WHERE database = current_database() AND left(gid, length(%s)) = %s ORDER BY gid",
                        (prefix, prefix))
            return [{"gid": g, "prepared_at": p.isoformat(), "owner": o} for g, p, o in cur.fetchall()]

    def verify_prepared(self, batch_id: int, handles: list[dict], *,
                        prepare_started_at: float) -> None:
        """Claim every handle's gid as decided and check it is still prepared, before the
        decision is logged (driver).

        One statement: ``decided`` is set on each gid's claim unless a retried task doomed it
        first (see :meth:`_roll_back_earlier_attempts`); a gid without a claim (a handle of an
        executor that found no claims table) gets a ``decided`` one.  From then on no task
        attempt rolls it back.  A doomed gid, or one no longer in ``pg_prepared_xacts``
        (rolled back by an operator, or by another coordinator cleaning up this batch),
        fails the batch now, while it is undecided, instead of being decided and reported
        lost at the commit; its replay writes it again.  If the server cannot be asked the
        batch fails too: a gid not claimed as decided could still be doomed.  Without a
        claims table this role may write, only the ``pg_prepared_xacts`` check is made.
        """
        pg = _pg()
        sql = pg.sql
        gids = sorted({h["gid"] for h in handles})
        if not gids:
            return
        schema = next((h["marker_schema"] for h in handles if h.get("marker_schema")), None) or self._marker_home
        claims = self._claims_in(schema)
        check = ("SELECT ARRAY(SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                 "AND gid = ANY(%s))")
        decided: set[str] | None = None
        try:
            with self._driver_cursor() as cur:
                try:
                    cur.execute(sql.SQL(
                        "WITH d AS (INSERT INTO {c} AS c (gid, state) SELECT g, 'decided' FROM unnest(%s::text[]) "
                        "AS g ORDER BY g ON CONFLICT (gid) DO UPDATE SET state = 'decided', at = now() "
                        "WHERE c.state IN ('prepared', 'decided') RETURNING c.gid) "
                        "SELECT ARRAY(SELECT gid FROM d), " + check[len("SELECT "):]).format(c=claims),
                        (gids, gids))
                    won, present = cur.fetchone()
                    decided = set(won)
                except pg.Error as e:
                    if e.pgcode not in (_UNDEFINED_TABLE, _INSUFFICIENT_PRIVILEGE):
                        raise
                    log.warning("batch %d: no claims table this role may write (%s): checking only that its "
                                "%d transactions are still prepared", batch_id, _describe_pg_error(e), len(gids))
                    cur.execute(check, (gids,))
                    (present,) = cur.fetchone()
        except (_ConnectError, pg.Error) as e:
            cause = e if isinstance(e, _ConnectError) else _describe_pg_error(e)
            raise TwoPhaseError(
                f"batch {batch_id}: cannot claim its {len(gids)} prepared transactions as decided at "
                f"{self.where}: {cause}. Nothing was decided; restart the query and the batch is written "
                "again.") from None
        doomed = [g for g in gids if decided is not None and g not in decided]
        gone = [g for g in gids if g not in set(present) and g not in doomed]
        _names.refuse_undecidable(batch_id, len(gids), doomed, gone, where=self.where,
                                  what="prepared transactions")

    def commit(self, handle: dict) -> CommitResult:
        """``COMMIT PREPARED`` the handle's gid (driver; idempotent).

        42704 ("does not exist") is resolved by the marker row: present = committed
        before (already committed), absent = rolled back (lost).  Connection errors,
        a server restarting and a gid busy in another session are retried later.
        """
        pg = _pg()
        gid = handle["gid"]
        try:
            try:
                with self._driver_cursor() as cur:
                    self._check_database(cur, handle)
                    cur.execute("COMMIT PREPARED %s", (gid,))
            except (pg.OperationalError, pg.InterfaceError) as e:
                if e.pgcode:
                    raise
                # A pooled connection that died (e.g. the server restarted): once more on a fresh one.
                self.close()
                with self._driver_cursor() as cur:
                    self._check_database(cur, handle)
                    cur.execute("COMMIT PREPARED %s", (gid,))
            return CommitResult.committed()
        except _ConnectError as e:
            return CommitResult.retry_later(str(e))
        except pg.Error as e:
            code = e.pgcode or ""
            if code == _UNDEFINED_OBJECT:
                return self._resolve_missing(handle)
            if code == _OBJECT_IN_USE or not code or code[:2] in _TRANSIENT_CLASSES \
                    or isinstance(e, (pg.OperationalError, pg.InterfaceError)):
                return CommitResult.retry_later(_describe_pg_error(e))
            raise TwoPhaseError(f"COMMIT PREPARED of {self.describe_handle(handle)} failed: "
                                f"{_describe_pg_error(e)}") from None

    def _check_database(self, cur: Any, handle: dict) -> None:
        cur.execute("SELECT current_database()")
        db = cur.fetchone()[0]
        if handle.get("database") and handle["database"] != db:
            raise ConfigurationError(
                f"{self.describe_handle(handle)} was prepared in database {handle['database']!r} but this "
                f"sink connects to {db!r}; point the sink's dsn at the database of the log's handles")

    def _marker_schemas(self, cur: Any, handle: dict) -> list[str]:
        """Where to look for a handle's marker row: the schema recorded in the handle, else the
        configured (or opened) one; for a handle without one and a sink never opened (an old
        log, read by ``twophase recover``), every schema with a table of that name this role
        may read — never the session's search_path, which may not be the pipeline's.  A
        marker row is keyed by the gid, which names its query and batch: found anywhere, it
        was committed."""
        schema = handle.get("marker_schema") or self._marker_home
        if schema:
            return [schema]
        cur.execute("SELECT n.nspname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                    "WHERE c.relname = %s AND c.relkind IN ('r', 'p') AND has_table_privilege(c.oid, 'SELECT') "
                    "ORDER BY n.nspname", (self.marker_table,))
        return [r[0] for r in cur.fetchall()]

    def _resolve_missing(self, handle: dict) -> CommitResult:
        pg = _pg()
        gid = handle["gid"]
        found, schemas = False, []
        try:
            with self._driver_cursor() as cur:
                schemas = self._marker_schemas(cur, handle)
                for schema in schemas:
                    cur.execute(pg.sql.SQL("SELECT 1 FROM {} WHERE gid = %s").format(
                        self._ident(schema, self.marker_table)), (gid,))
                    if cur.fetchone() is not None:
                        found = True
                        break
        except _ConnectError as e:
            return CommitResult.retry_later(str(e))
        except pg.errors.UndefinedTable:
            schemas = []
        except pg.Error as e:
            return CommitResult.retry_later(_describe_pg_error(e))
        if not found and not schemas:
            where = handle.get("marker_schema") or self._marker_home
            name = f"{where}.{self.marker_table}" if where else self.marker_table
            return CommitResult.lost(f"prepared transaction {gid} does not exist and the marker table "
                                     f"{name!r} is missing, so it cannot be proven committed")
        if found:
            return CommitResult.already_committed(f"marker row of {gid} present")
        # The marker row is written in the same transaction as the rows: absent, none of its rows is
        # visible, and a gid that no longer exists can never commit.
        return CommitResult.lost(
            f"prepared transaction {gid} does not exist and its marker row is absent: it was rolled back "
            "(ROLLBACK PREPARED by someone else, or the database was restored from an older backup)",
            never_visible=True)

    def recover_and_abort(self, handle: dict) -> None:
        """``ROLLBACK PREPARED`` the handle's gid if it still exists, and drop its claim (driver)."""
        self._rollback_prepared([handle["gid"]])
        self._drop_claims(handle.get("marker_schema") or self._marker_home, gids=[handle["gid"]])

    def _drop_claims(self, schema: str | None, *, gids: list[str] | None = None, prefix: str | None = None) -> int:
        """Delete claim rows (driver; best effort, one statement): of ``gids``, or of every gid
        starting with ``prefix``; in both cases only of gids no longer prepared (committed or
        rolled back: such a gid can never come back, so its claim is needed no more).  A claims
        table that is missing or not this role's to write is no error."""
        pg = _pg()
        sql = pg.sql
        args: list[Any]
        if gids is not None:
            where, args = sql.SQL("c.gid = ANY(%s)"), [gids]
        else:
            where, args = sql.SQL("left(c.gid, length(%s)) = %s"), [prefix, prefix]
        try:
            with self._driver_cursor() as cur:
                cur.execute(sql.SQL("DELETE FROM {c} AS c WHERE {w} AND NOT EXISTS (SELECT 1 FROM pg_prepared_xacts p "
                                    "WHERE p.gid = c.gid)").format(c=self._claims_in(schema), w=where), args)
                return cur.rowcount
        except pg.Error as e:
            if e.pgcode not in (_UNDEFINED_TABLE, _INSUFFICIENT_PRIVILEGE):
                log.warning("cannot delete claims of finished prepared transactions (%s); the next batch's "
                            "cleanup tries again", _describe_pg_error(e))
            return 0
        except _ConnectError as e:
            log.warning("cannot delete claims of finished prepared transactions (%s)", e)
            return 0

    def _rollback_prepared(self, gids: list[str], strict: bool = True) -> int:
        """``ROLLBACK PREPARED`` each gid; one already gone is fine.  Other failures raise, or
        with ``strict=False`` only log (a late leftover of a finished batch must not stop
        the batch that found it: the next cleanup tries again)."""
        pg = _pg()
        n = 0
        for gid in gids:
            try:
                with self._driver_cursor() as cur:
                    cur.execute("ROLLBACK PREPARED %s", (gid,))
                n += 1
            except pg.Error as e:
                if e.pgcode == _UNDEFINED_OBJECT:  # gone already: someone else finished it
                    continue
                msg = f"ROLLBACK PREPARED {gid} at {self.where} failed: {_describe_pg_error(e)}"
                if strict:
                    raise TwoPhaseError(msg) from None
                log.warning("%s; the next batch's cleanup tries again", msg)
        return n

    def query_prefix(self, query_name: str) -> str:
        """``{gid_prefix}:{query}:`` — every gid of every batch of this query starts so."""
        return f"{self.gid_prefix}:{_safe(query_name)}:"

    def _gid_batch(self, query_name: str, gid: str) -> int | None:
        """The batch number of a gid of this query, or None for a gid of anything else.

        The query part is matched whole, up to its ``:`` (``_safe`` names hold no ``:``),
        so ``q.1`` never reads as query ``q``; the batch is the digits before the next ``:``.
        """
        return _names.batch_of(self.query_prefix(query_name), gid)

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[dict], *, settled: Settled | None = None) -> int:
        """Roll back this batch's prepared transactions (gid prefix from the INTENT) except ``keep``,
        and every prepared transaction of an *earlier* batch of this query (driver).

        Earlier batches: by the time batch N is written, replayed or cleaned up, the
        coordinator has committed every decided batch before it (its recovery commits
        decided batches before anything else runs), so a gid of this query with a batch
        number below N that is still prepared belongs to a late actor (a task attempt of
        a finished job that prepared after its batch's cleanup) and is in no decision
        still to commit.  It holds its row locks and a ``max_prepared_transactions`` slot
        until someone rolls it back: the next batch's cleanup does, so a batch that meets
        its locks fails after ``lock_timeout`` and its replay finds them gone.  Gids of
        later batches, of other queries and in ``keep`` are never touched.

        Only this database's ``pg_prepared_xacts`` are looked at.  Also deletes marker
        rows of this query's batches that ``settled`` (the log's evidence, handed by the
        protocol) shows finished and that are older than ``marker_retention_batches``
        batches: never by batch-id distance alone, since a backfill of an older id may be
        decided and committing, and its marker rows are what prove its commits (without
        ``settled`` none are deleted; see :meth:`_prune_markers`), and, in one statement,
        the claims of this query's gids that are no longer prepared (``keep``, once
        committed, and everything rolled back): the claims table holds only gids that
        may still be committed or rolled back.
        """
        prefix = self._intent_prefix(query_name, batch_id, intent)
        keep_gids = {h["gid"] for h in keep}
        try:
            gids, late = _names.split_leftovers(
                (p["gid"] for p in self.prepared(self.query_prefix(query_name))), ballot_prefix=prefix,
                query_head=self.query_prefix(query_name), batch_id=batch_id, keep=keep_gids)
            # rule: this ballot's own gids not in keep: its slot holds its abort, or its decision names keep.
            n = self._rollback_prepared(gids)
            if n:
                log.info("batch %d: rolled back %d prepared transactions under %s", batch_id, n, prefix)
            n += self._rollback_late(query_name, batch_id, late, settled)
            self._prune_markers(query_name, batch_id, keep, settled)
            schema = next((h["marker_schema"] for h in keep if h.get("marker_schema")), None) or self._marker_home
            # rule: only claims of gids pg_prepared_xacts no longer lists (never prepared again).
            self._drop_claims(schema, prefix=self.query_prefix(query_name))
        except _ConnectError as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot look for leftover prepared transactions: {e}") \
                from None
        return n

    def _rollback_late(self, query_name: str, batch_id: int, late: list[str], settled: Settled | None = None) -> int:
        """Roll back late leftovers of earlier batches, each only once claimed ``doomed`` (one statement):
        a gid claimed ``decided`` is in a decision (another run of the job, a batch decided and not yet
        committed) and is left alone, however it looked.  Without a claims table this role may write,
        only leftovers of batches the log shows finished (``settled``) are rolled back: never by
        batch-id order (issue 59)."""
        if not late:
            return 0
        with self._driver_cursor() as cur:
            doomed = self._doom(cur, f"batch {batch_id}", late, strict=False)
        if doomed is None:
            # No claims table this role may write: decided gids are not marked either, so only the
            # leftovers of batches the log shows finished may go (their decisions are all committed).
            doomed = [g for g in late if settled is not None
                      and (b := self._gid_batch(query_name, g)) is not None and settled(query_name, b)]
            if len(doomed) < len(late):
                log.warning("batch %d: left %d late prepared transactions of earlier batches alone: without a claims "
                            "table this role may write they can be rolled back only once the log shows their batch "
                            "committed (grant the claims table to roll them back sooner)", batch_id,
                            len(late) - len(doomed))
        late = doomed
        # rule: only gids this sink claimed doomed (a decided gid refuses it), or, without a claims table,
        # of batches the log shows finished (settled).
        n = self._rollback_prepared(late, strict=False)
        if n:
            log.warning("batch %d: rolled back %d prepared transactions of earlier, finished batches of %s, "
                        "prepared late (after their batch's cleanup): %s", batch_id, n, query_name,
                        ", ".join(late[:5]) + (", ..." if len(late) > 5 else ""))
        return n

    def sweep_late(self, query_name: str, batch_id: int, *, settled: Settled | None = None) -> int:
        """Roll back this query's prepared transactions of batches before ``batch_id`` (driver): late
        task attempts' leftovers, holding row locks batch ``batch_id``'s tasks may need (see
        :meth:`abort_lingering`).  One look at ``pg_prepared_xacts``."""
        try:
            late = [p["gid"] for p in self.prepared(self.query_prefix(query_name))
                    if (b := self._gid_batch(query_name, p["gid"])) is not None and b < int(batch_id)]
            return self._rollback_late(query_name, batch_id, late, settled)
        except _ConnectError as e:
            raise TwoPhaseError(f"batch {batch_id}: cannot look for late prepared transactions: {e}") from None

    def _prune_markers(self, query_name: str, batch_id: int, keep: list[dict],
                       settled: Settled | None = None) -> int:
        """Delete this query's marker rows of batches the log shows finished (``settled``: COMMITTED,
        or pruned after it) below ``batch_id - marker_retention_batches``, one DELETE per range, in
        the marker table's own schema (from the handles, or fixed by :meth:`open`); not knowing it
        (a sink never opened, no handle), nothing is pruned rather than a table of the session's
        search_path.

        Rule (docs/design.md, "What may justify a destructive action"): a marker row is the only
        proof that a gone prepared transaction was committed, so it goes only once the log holds
        its batch's COMMITTED record (or a pruned range, written only over COMMITTED batches).  Not
        by batch-id distance: a backfill of batch 5, decided and committed but not yet COMMITTED in
        the log, would lose its markers to a run of batch 200 and be read as "rolled back, never
        visible", voided and written twice.  No evidence (``settled`` None): nothing is pruned."""
        pg = _pg()
        ranges = _names.prunable_ranges(settled, query_name, batch_id, self.marker_retention_batches)
        if not ranges:
            return 0
        schema = next((h["marker_schema"] for h in keep if h.get("marker_schema")), None) or self._marker_home
        if not schema:
            return 0
        deleted = 0
        try:
            with self._driver_cursor() as cur:
                for first, last in ranges:
                    # rule: the log shows every batch of [first, last] COMMITTED (or pruned after it).
                    cur.execute(pg.sql.SQL("DELETE FROM {} WHERE query_name = %s AND batch_id BETWEEN %s AND %s")
                                .format(self._ident(schema, self.marker_table)), (query_name, first, last))
                    deleted += cur.rowcount
        except pg.errors.UndefinedTable:
            return deleted
        return deleted

    def describe_handle(self, handle: dict) -> str:
        return (f"prepared transaction {handle.get('gid')!r} in database {handle.get('database')!r} "
                f"({handle.get('rows')} rows for {handle.get('table')})")

    # -------------------------------------------------------------- executor
    def begin_transaction(self, ctx: TransactionContext) -> PostgresTransaction:
        """Connect and begin the partition's transaction under its gid (executor).

        A retried task first rolls back what its earlier attempts in the same run left
        prepared and it could claim as doomed (see :meth:`_roll_back_earlier_attempts`):
        their locks would otherwise make this attempt wait for ``lock_timeout`` and fail.
        """
        pg = _pg()
        prefix = self._intent_prefix(ctx.query_name, ctx.batch_id, ctx.intent)
        gid = self.make_gid(prefix, ctx.partition_id, ctx.attempt, ctx.run, task_attempt_id=ctx.task_attempt_id)
        try:
            conn = self._connect(autocommit=ctx.attempt > 0 and bool(ctx.run))
        except _ConnectError as e:
            raise TwoPhaseError(f"{ctx.label}: {e}") from None
        try:
            if conn.autocommit:  # ROLLBACK PREPARED cannot run inside a transaction block
                self._roll_back_earlier_attempts(conn, ctx, prefix)
                self._roll_back_late_leftovers(conn, ctx)
                conn.autocommit = False
            conn.tpc_begin(gid)
            with conn.cursor() as cur:
                if self.lock_timeout:
                    cur.execute("SELECT set_config('lock_timeout', %s, true)", (self.lock_timeout,))
                # The marker table's schema goes into the handle: recovery, in any session, on any
                # search_path, looks for the marker row exactly there.  open() fixed it on the
                # driver; without open(), it is the schema this session's search path finds it in.
                cur.execute("SELECT to_regclass(%s)::oid, current_database(), (SELECT n.nspname FROM "
                            "pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = "
                            "to_regclass(%s))", (self._quoted(cur, self._target),
                                                 self._quoted(cur, self._marker)))
                oid, database, marker_schema = cur.fetchone()
                if oid is None:
                    raise PostgresWriteError(f"{ctx.label}: table {self._quoted(cur, self._target)} does not "
                                             f"exist in database {database!r}")
                columns = _fetch_columns(cur, oid)
        except BaseException as e:
            _close_quietly(conn)
            if isinstance(e, pg.Error):
                raise PostgresWriteError(f"{ctx.label} (gid {gid}): cannot begin: {_describe_pg_error(e)}",
                                         sqlstate=e.pgcode) from None
            raise
        txn = PostgresTransaction(ctx, gid, conn, database, oid, columns)
        txn.extra["marker_schema"] = self._marker_home or marker_schema
        return txn

    def _roll_back_late_leftovers(self, conn: Any, ctx: TransactionContext) -> int:
        """A retried attempt (its first failed, perhaps on the locks of a late attempt of an earlier
        batch, after ``lock_timeout``) rolls back this query's prepared gids of earlier batches that it
        can claim ``doomed`` (executor), as the driver's :meth:`sweep_late` does before a batch: in
        the data source form no driver runs the batch again, so the retry is where it can pass.  A
        gid claimed ``decided`` is left alone; without a claims table nothing is rolled back."""
        pg = _pg()
        head = self.query_prefix(ctx.query_name)
        n = 0
        with conn.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                        "AND left(gid, length(%s)) = %s", (head, head))
            late = sorted(g for (g,) in cur.fetchall()
                          if (b := self._gid_batch(ctx.query_name, g)) is not None and b < int(ctx.batch_id))
            for gid in self._doom(cur, ctx.label, late) or []:
                try:
                    cur.execute("ROLLBACK PREPARED %s", (gid,))
                    n += 1
                    log.info("%s: rolled back %s, a late leftover of an earlier batch", ctx.label, gid)
                except pg.Error as e:
                    if e.pgcode != _UNDEFINED_OBJECT:
                        log.warning("%s: cannot roll back %s (%s)", ctx.label, gid, _describe_pg_error(e))
        return n

    def _roll_back_earlier_attempts(self, conn: Any, ctx: TransactionContext, prefix: str) -> int:
        """``ROLLBACK PREPARED`` what earlier attempts of this task left prepared (executor).

        Such an attempt prepared and then was lost with its executor; Spark discards the
        result of a failed attempt, so its transaction is in no decision.  But attempt
        numbers restart at 0 in a resubmitted stage (SPARK-24589) while the old stage
        attempt's tasks keep running, and Spark accepts the first result of a partition from
        either; PySpark does not tell which stage attempt a task belongs to.  What it does
        tell is ``taskAttemptId()``, drawn from one increasing counter: a stage attempt is
        submitted after the one before it stopped launching tasks, so every attempt of an
        older stage attempt has a lower id than every attempt of this task's own.  Attempt
        ``k`` of this task exists only once its attempts ``0 .. k-1`` failed, one each,
        with increasing ids below this attempt's: so for each number ``j < k`` only the
        gid of attempt ``j`` with the highest task attempt id below this one's can be
        this task's own, and only that one is rolled back.  Lower ids with the same
        number (attempts of older stage attempts, maybe the accepted result), higher ids,
        gids of other runs (another coordinator racing on the batch may have one in its
        decision), of other partitions, without run or without task attempt id (old logs),
        are never touched: those leftovers are the coordinator's ``abort_lingering``.
        (Not knowing its own task attempt id, an attempt rolls back the lower attempts of
        the old form, as before task attempt ids were in gids.)

        The rule is a guess, and a guess is no fence: if this task's own attempt ``j`` failed
        *before* it prepared, an attempt ``j`` of an older stage attempt (maybe the accepted
        result) is taken for its own; and a late attempt (a stage retry's task beginning after
        the batch was decided) takes the decided gid for its earlier attempt.  So a candidate
        is rolled back only once this attempt has claimed it as ``doomed`` in the claims table
        (:meth:`_doom`, one statement on the gid's row).  The driver claims every gid of the
        batch as ``decided`` before the decision (:meth:`verify_prepared`), on the same row;
        PostgreSQL's row lock orders the two, and the later one does nothing: a decided gid
        is never rolled back by a task (this attempt then waits on its locks and fails after
        ``lock_timeout``, and the decided transaction commits), and a doomed gid is never
        decided (the batch fails while undecided and is written again).  An attempt that
        prepares a gid already doomed rolls it back and fails (:meth:`_claim_prepared`).
        Without a claims table this role may write, nothing is rolled back.  Failures only
        log: the write then waits on the leftover's locks and fails after ``lock_timeout``.
        """
        pg = _pg()
        head = f"{prefix}{int(ctx.partition_id)}:"
        n = 0
        with conn.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                        "AND left(gid, length(%s)) = %s", (head, head))
            candidates = _names.earlier_attempts(((gid, gid[len(head):]) for (gid,) in cur.fetchall()),
                                                 attempt=ctx.attempt, task_attempt_id=ctx.task_attempt_id,
                                                 run=ctx.run)
            for gid in self._doom(cur, ctx.label, candidates) or []:
                try:
                    cur.execute("ROLLBACK PREPARED %s", (gid,))
                    n += 1
                    log.info("%s: rolled back %s, left prepared by an earlier attempt of this task",
                             ctx.label, gid)
                except pg.Error as e:
                    if e.pgcode != _UNDEFINED_OBJECT:  # gone already: fine
                        log.warning("%s: cannot roll back %s of an earlier attempt (%s); this "
                                    "attempt may wait on its locks", ctx.label, gid,
                                    _describe_pg_error(e))
        return n

    def _doom(self, cur: Any, label: str, gids: list[str], strict: bool = True) -> list[str] | None:
        """Claim ``gids`` as doomed; return those this attempt (or the driver's sweep of late
        leftovers) may roll back.

        One statement: a gid without a claim, or claimed ``prepared`` or ``doomed``, is doomed
        (from then on the driver's check refuses to decide it, and its own attempt, if it has
        not claimed it yet, rolls it back and fails); one claimed ``decided`` is in a decision
        and is left alone: this attempt then waits on its locks and fails after
        ``lock_timeout`` like any conflict, and the decided transaction commits.  Without a
        claims table this role may write, nothing may be rolled back (``strict=False``: None,
        and the caller decides).
        """
        if not gids:
            return []
        pg = _pg()
        try:
            cur.execute(pg.sql.SQL(
                "INSERT INTO {c} AS c (gid, state) SELECT g, 'doomed' FROM unnest(%s::text[]) AS g ORDER BY g "
                "ON CONFLICT (gid) DO UPDATE SET state = 'doomed', at = now() "
                "WHERE c.state IN ('prepared', 'doomed') RETURNING c.gid").format(
                    c=self._claims_in(self._marker_home)), (gids,))
            won = {r[0] for r in cur.fetchall()}
        except pg.Error as e:
            if not strict:  # the caller decides (the driver's sweep of late leftovers)
                log.debug("%s: cannot claim %s as doomed (%s)", label, ", ".join(gids), _describe_pg_error(e))
                return None
            log.warning("%s: cannot claim %s as doomed (%s); none is rolled back and this attempt may wait on "
                        "their locks", label, ", ".join(gids), _describe_pg_error(e))
            return []
        for gid in gids:
            if gid not in won:
                log.warning("%s: %s looks like a leftover but is claimed by its batch's decision: left alone "
                            "(what needs its locks may wait on them)", label, gid)
        return [g for g in gids if g in won]

    def _map_columns(self, txn: PostgresTransaction, schema: pa.Schema) -> list[_Column]:
        """Match the batch's columns to the table's, as Spark's JDBC writer does (its default
        ``spark.sql.caseSensitive=false``): by exact name, else case-insensitively (a DataFrame
        column ``ID`` goes into the table column ``id``).  A name that matches several table columns
        only case-insensitively, or two DataFrame columns that land in one table column, are
        refused: which one was meant cannot be told.  Errors name the column."""
        label = f"{txn.ctx.label} (gid {txn.gid}, table {self.target_name})"
        cols = txn.columns
        mapped: list[_Column] = []
        for f in schema:
            col = cols.get(f.name)
            if col is None:
                close = [c for c in cols if c.lower() == f.name.lower()]
                if len(close) > 1:
                    raise PostgresWriteError(
                        f"{label}: the DataFrame column {f.name!r} matches the table columns "
                        f"{', '.join(repr(c) for c in close)} when case is ignored (as Spark's JDBC writer "
                        "matches names) and none of them exactly: rename it to the one meant", column=f.name)
                if not close:
                    raise PostgresWriteError(f"{label}: the DataFrame column {f.name!r} is not a column of "
                                             f"the table; table columns: {', '.join(cols)}", column=f.name)
                col = cols[close[0]]
            if col.generated:
                raise PostgresWriteError(f"{label}: column {col.name!r} is a generated column and cannot be "
                                         "written; drop it from the DataFrame", column=col.name)
            if not _arrow_fits(f.type, col):
                raise PostgresWriteError(
                    f"{label}: column {col.name!r} is {col.sqltype} in the table but {f.type} in the "
                    f"DataFrame; cast it in Spark first (e.g. F.col({f.name!r}).cast(...))", column=col.name)
            mapped.append(col)
        twice = sorted({c.name for c in mapped if sum(m.name == c.name for m in mapped) > 1})
        if twice:
            same = [f.name for f, c in zip(schema, mapped) if c.name == twice[0]]
            raise PostgresWriteError(f"{label}: the DataFrame columns {', '.join(repr(n) for n in same)} all go "
                                     f"into the table column {twice[0]!r} (names match ignoring case, as in "
                                     "Spark's JDBC writer): drop or rename all but one",
                                     column=next((n for n in same if n != twice[0]), same[-1]))
        present = {c.name for c in mapped}
        for c in cols.values():
            if c.name not in present and c.not_null and not c.has_default and not c.generated:
                raise PostgresWriteError(f"{label}: the table's column {c.name!r} is NOT NULL without a "
                                         "default but the DataFrame has no such column", column=c.name)
        if self.mode == "upsert":
            missing = [k for k in self.key_columns if k not in present]
            if missing:
                raise PostgresWriteError(f"{label}: upsert key columns {missing} are missing from the "
                                         "DataFrame", column=missing[0])
        return mapped

    def _stage_name(self, gid: str) -> str:
        return "twophase_stage_" + hashlib.sha1(gid.encode()).hexdigest()[:20]

    def write(self, txn: PostgresTransaction, batch: pa.RecordBatch) -> None:
        """COPY one Arrow batch into the transaction (executor).  Errors name the column or constraint."""
        pg = _pg()
        sql = pg.sql
        if batch.num_rows == 0:
            return
        if txn.copy_columns is None:
            mapped = self._map_columns(txn, batch.schema)
            txn.copy_columns = [c.name for c in mapped]  # the table's names (matched ignoring case)
            txn.extra["mapped"] = mapped
            txn.extra["names"] = list(batch.schema.names)
        elif list(batch.schema.names) != txn.extra["names"]:
            raise PostgresWriteError(f"{txn.ctx.label}: Arrow batches of one partition changed columns "
                                     f"({txn.extra['names']} then {batch.schema.names})")
        if self.mode == "upsert":
            self._refuse_null_keys(txn, batch)
        col_list = sql.SQL(", ").join(sql.Identifier(c) for c in txn.copy_columns)
        try:
            with txn.conn.cursor() as cur:
                if self.mode == "upsert" and txn.stage is None:
                    txn.stage = self._stage_name(txn.gid)
                    cur.execute(sql.SQL("CREATE UNLOGGED TABLE {s} AS SELECT {c} FROM {t} WITH NO DATA").format(
                        s=self._ident(self.marker_schema, txn.stage), c=col_list, t=self._target))
                into = self._ident(self.marker_schema, txn.stage) if txn.stage else self._target
                data = encode_csv(batch, txn.extra["mapped"])
                cur.copy_expert(sql.SQL("COPY {t} ({c}) FROM STDIN WITH (FORMAT csv)").format(
                    t=into, c=col_list), io.BytesIO(data))
        except pg.Error as e:
            raise self._write_error(txn, "COPY", e) from None
        txn.rows += batch.num_rows
        txn.bytes += len(data)

    def _refuse_null_keys(self, txn: PostgresTransaction, batch: pa.RecordBatch) -> None:
        """Upsert: a NULL in a key column fails the batch, before its rows are sent.

        ``DISTINCT ON`` takes NULL keys as equal (rows would silently collapse into one)
        and ``ON CONFLICT`` never matches them (replays would add rows again): neither is
        an upsert.  Arrow keeps a null count per column, so the check is free when there
        are none.
        """
        import pyarrow.compute as pc

        index = {c: i for i, c in enumerate(txn.copy_columns or [])}  # table name -> batch column
        for k in self.key_columns:
            col = batch.column(index[k])
            if not col.null_count:
                continue
            i = pc.index(col.is_null(), True).as_py()
            others = ", ".join(
                f"{o}={batch.column(index[o])[i].as_py()!r}"[:80]
                for o in self.key_columns if o != k)
            raise PostgresWriteError(
                f"{txn.ctx.label} (gid {txn.gid}): upsert key column {k!r} is NULL in row "
                f"{txn.rows + i + 1} of this partition{f' ({others})' if others else ''}. A NULL key "
                "matches no row and equals no other key, so it cannot be upserted. The transaction "
                "is rolled back; nothing of this batch became visible. Filter or fill NULL keys in "
                f"Spark (e.g. df.dropna(subset={list(self.key_columns)!r})) and restart the query.",
                column=k)

    def _write_error(self, txn: PostgresTransaction, action: str, e: Any) -> PostgresWriteError:
        d = e.diag
        column, constraint = d.column_name, d.constraint_name
        if column is None and d.context:
            m = re.search(r"column (\w+|\"[^\"]+\")", d.context)
            column = m.group(1).strip('"') if m else None
        msg = (f"{txn.ctx.label} (gid {txn.gid}): {action} into table {self.target_name} failed: "
               f"{_describe_pg_error(e)}. The transaction is rolled back; nothing of this batch became "
               "visible. Fix the rows (or the table) and restart the query: the batch is replayed.")
        return PostgresWriteError(msg, column=column, constraint=constraint, sqlstate=e.pgcode)

    def pre_commit(self, txn: PostgresTransaction) -> dict:
        """Upsert from staging (upsert mode), insert the marker row, PREPARE TRANSACTION (executor).

        After this returns, the transaction survives this process and a server
        restart; the connection is closed.  The handle is the gid and database.
        """
        pg = _pg()
        sql = pg.sql
        ctx = txn.ctx
        try:
            with txn.conn.cursor() as cur:
                if txn.stage is not None:
                    action = "INSERT ... ON CONFLICT"
                    cols = txn.copy_columns or []
                    keys = sql.SQL(", ").join(sql.Identifier(k) for k in self.key_columns)
                    others = _names.update_columns(cols, self.key_columns)
                    on_conflict = sql.SQL("DO NOTHING") if not others else sql.SQL("DO UPDATE SET {}").format(
                        sql.SQL(", ").join(sql.SQL("{c} = EXCLUDED.{c}").format(c=sql.Identifier(c))
                                           for c in others))
                    col_list = sql.SQL(", ").join(sql.Identifier(c) for c in cols)
                    stage = self._ident(self.marker_schema, txn.stage)
                    # Last row of a key wins: the staging table is filled in order, so ctid order is row order.
                    cur.execute(sql.SQL(
                        "INSERT INTO {t} ({c}) SELECT DISTINCT ON ({k}) {c} FROM {s} ORDER BY {k}, ctid DESC "
                        "ON CONFLICT ({k}) {oc}").format(t=self._target, c=col_list, k=keys, s=stage,
                                                          oc=on_conflict))
                    cur.execute(sql.SQL("DROP TABLE {}").format(stage))
                action = "marker row"
                marker = self._ident(txn.extra.get("marker_schema"), self.marker_table)
                cur.execute(sql.SQL("INSERT INTO {m} ({c}) VALUES ({v})").format(
                    m=marker, c=sql.SQL(", ").join(sql.Identifier(c) for c in ("gid",) + _names.MARKER_COLUMNS),
                    v=sql.SQL(", ").join(sql.Placeholder() for _ in range(1 + len(_names.MARKER_COLUMNS)))),
                    (txn.gid,) + _names.marker_values(ctx, self.target_name, txn.rows))
            action = "PREPARE TRANSACTION"  # deferred constraints are checked here
            txn.conn.tpc_prepare()
            txn.prepared = True
        except pg.Error as e:
            raise self._write_error(txn, action, e) from None
        self._claim_prepared(txn)
        _close_quietly(txn.conn)
        txn.closed = True
        return {"gid": txn.gid, "database": txn.database, "table": self.target_name, "rows": txn.rows,
                "batch": ctx.batch_id, "partition": ctx.partition_id,
                "marker_schema": txn.extra.get("marker_schema")}

    def _claim_prepared(self, txn: PostgresTransaction) -> None:
        """After PREPARE TRANSACTION: claim the gid as ``prepared``, unless a retried task of this
        partition doomed it first (executor).

        One statement on the gid's claim row; it returns the row's state, whoever wrote it.
        ``doomed``: a retried attempt took this one for its own earlier attempt and rolls it
        back; this attempt rolls it back too (whichever comes first) and fails, so its result
        never reaches the driver.  No claims table this role may write: the handle is returned
        unclaimed, as before claims (the driver's check claims it).  Any other failure also
        fails the attempt, after rolling its transaction back.
        """
        pg = _pg()
        claims = self._claims_in(txn.extra.get("marker_schema"))
        try:
            txn.conn.reset()  # the prepared transaction stays; the session is usable again
            txn.conn.autocommit = True
            with txn.conn.cursor() as cur:
                cur.execute(pg.sql.SQL(
                    "INSERT INTO {c} AS c (gid, state) VALUES (%s, 'prepared') ON CONFLICT (gid) DO UPDATE "
                    "SET state = c.state RETURNING c.state").format(c=claims), (txn.gid,))
                state = cur.fetchone()[0]
        except pg.Error as e:
            if e.pgcode in (_UNDEFINED_TABLE, _INSUFFICIENT_PRIVILEGE):
                log.info("%s: no claims table this role may write (%s); %s is returned unclaimed",
                         txn.ctx.label, _describe_pg_error(e), txn.gid)
                return
            self._rollback_own(txn)
            raise PostgresWriteError(f"{txn.ctx.label} (gid {txn.gid}): cannot claim the prepared transaction: "
                                     f"{_describe_pg_error(e)}. It was rolled back; Spark runs the task "
                                     "again.", sqlstate=e.pgcode) from None
        if state == "doomed":
            self._rollback_own(txn)
            raise PostgresWriteError(
                f"{txn.ctx.label} (gid {txn.gid}): a retried attempt of this partition doomed this prepared "
                "transaction (it took it for its own earlier attempt) before this attempt could claim it; it "
                "is rolled back and this attempt fails, so its result never reaches the driver.")

    def _rollback_own(self, txn: PostgresTransaction) -> None:
        """``ROLLBACK PREPARED`` this attempt's own gid after it was prepared (executor; best effort)."""
        pg = _pg()
        conns = [txn.conn]
        try:
            if txn.conn.closed:
                conns.append(self._connect(autocommit=True))
            with conns[-1].cursor() as cur:
                cur.execute("ROLLBACK PREPARED %s", (txn.gid,))
        except pg.Error as e:
            if e.pgcode != _UNDEFINED_OBJECT:  # gone already: the retry that doomed it rolled it back
                log.warning("%s: rolling back %s failed (%s); the coordinator's cleanup rolls it back",
                            txn.ctx.label, txn.gid, _describe_pg_error(e))
        except _ConnectError as e:
            log.warning("%s: rolling back %s failed (%s); the coordinator's cleanup rolls it back",
                        txn.ctx.label, txn.gid, e)
        finally:
            for c in conns:
                _close_quietly(c)
            txn.closed = True

    def abort(self, txn: PostgresTransaction) -> None:
        """Roll back the open (or already prepared) transaction (executor; best effort, idempotent)."""
        pg = _pg()
        if txn.prepared:
            try:
                if txn.closed:
                    txn.conn = self._connect(autocommit=True)
                    with txn.conn.cursor() as cur:
                        cur.execute("ROLLBACK PREPARED %s", (txn.gid,))
                else:
                    txn.conn.tpc_rollback()
            except (pg.Error, _ConnectError) as e:
                if getattr(e, "pgcode", None) != _UNDEFINED_OBJECT:  # gone already: fine
                    log.warning("%s: rolling back prepared %s failed (%s); the next attempt of the batch "
                                "rolls it back", txn.ctx.label, txn.gid, scrub(str(e)).strip())
            finally:
                _close_quietly(txn.conn)
                txn.closed = True
            return
        if not txn.closed:
            try:
                txn.conn.tpc_rollback()
            except pg.Error:
                pass  # closing the connection rolls back too
            _close_quietly(txn.conn)
            txn.closed = True


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
