"""The class users construct, :class:`MySqlSink`, assembled from its parts (one mixin per file,
each saying where it runs); its own code runs on the driver: the configuration, ``open()`` (checks of
the server, the table and the grants; the marker and claims tables created) and each batch's plan."""

from __future__ import annotations

import re
import uuid
from typing import Any

from twophase.errors import ConfigurationError
from twophase.sink import TwoPhaseCommitSink
from twophase.sinks import _sql2pc as names
from twophase.sinks.mysql.committer import _Committer
from twophase.sinks.mysql.common import (
    DOOMED,
    ER_XAER_RMERR,
    MAX_PLANNED_ATTEMPTS,
    MySqlTransaction,
    _ConnectError,
    _errno,
    _my,
    _unique_index_problem,
    quote_ident,
)
from twophase.sinks.mysql.rows import _Rows
from twophase.sinks.mysql.writer import _Writer


class MySqlSink(_Committer, _Writer, _Rows, TwoPhaseCommitSink[MySqlTransaction, dict]):
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

    def _marker_ddl(self) -> str:
        return (f"CREATE TABLE IF NOT EXISTS {quote_ident(self.marker_table)} ("
                "gtrid VARBINARY(64) NOT NULL, bqual VARBINARY(64) NOT NULL, query_name VARCHAR(255) NOT NULL, "
                "batch_id BIGINT NOT NULL, partition_id INT NOT NULL, attempt INT NOT NULL, "
                "target_table VARCHAR(255) NOT NULL, row_count BIGINT NOT NULL, "
                "prepared_at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), PRIMARY KEY (gtrid, bqual), "
                "KEY query_batch (query_name, batch_id)) ENGINE=InnoDB")

    def _claims_ddl(self) -> str:
        return (f"CREATE TABLE IF NOT EXISTS {quote_ident(self.claims_table)} ("
                "gtrid VARBINARY(64) NOT NULL, bqual VARBINARY(64) NOT NULL, "
                "state VARCHAR(16) NOT NULL, at TIMESTAMP(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6), "
                "PRIMARY KEY (gtrid, bqual)) ENGINE=InnoDB")

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """INTENT: the gtrid prefix of this ballot, with a random token drawn once per INTENT."""
        prefix = f"{self.batch_prefix(query_name, batch_id)}{uuid.uuid4().hex[:8]}:"
        self.make_xid(prefix, max(num_partitions - 1, 0), MAX_PLANNED_ATTEMPTS, "r" * names.MAX_RUN_CHARS,
                      task_attempt_id=names.MAX_TASK_ATTEMPT_ID)
        return {"gid_prefix": prefix, "table": self.table, "database": self.database}
