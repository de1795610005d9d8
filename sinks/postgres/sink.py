"""Driver: :class:`PostgresSink`, the class users construct: its options, ``open()``'s checks of
the server and the table (creating the marker and claims tables), and each batch's plan.  The
class is assembled from the mixins of this package: ``_Committer`` (committer.py, driver) and
``_Writer`` (writer.py, executor tasks), on ``_PostgresBase`` (base.py, both).
"""

from __future__ import annotations

import uuid
from typing import Any

from twophase.config import is_secret_ref
from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink
from twophase.sinks import _sql2pc as _names
from twophase.sinks.postgres import dsn as _dsn
from twophase.sinks.postgres.columns import _Column, _fetch_columns
from twophase.sinks.postgres.committer import _Committer
from twophase.sinks.postgres.common import (
    _SECRET_DSN_KEYS,
    MAX_RUN_CHARS,
    MAX_TASK_ATTEMPT_ID,
    MODES,
    _ConnectError,
    _describe_pg_error,
    _pg,
    _safe,
    log,
)
from twophase.sinks.postgres.writer import PostgresTransaction, _Writer


class PostgresSink(_Committer, _Writer, TwoPhaseCommitSink[PostgresTransaction, dict]):
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
