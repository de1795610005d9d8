"""Both sides (driver and executor tasks): the base of :class:`~twophase.sinks.postgres.PostgresSink`'s
mixins: connections (the driver's pooled cursors, a task's own connection), identifiers, the gid
names of a batch and of its task attempts, and the ``doomed`` claim (a retried task's, before it
rolls back an earlier attempt; the driver's, before it rolls back late leftovers).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from twophase.config import resolve_secret
from twophase.errors import ConfigurationError, HandleError
from twophase.sinks import _sql2pc as _names
from twophase.sinks.postgres.common import (
    MAX_GID_BYTES,
    _claims_name,
    _ConnectError,
    _describe_pg_error,
    _pg,
    _safe,
    log,
    scrub,
)


class _PostgresBase:
    """Runs on both sides: what the driver's and the executor's parts of
    :class:`~twophase.sinks.postgres.PostgresSink` share.  Its attributes are set by
    ``PostgresSink.__init__`` (sink.py)."""

    params: dict[str, str]
    table: str
    schema: str | None
    mode: str
    key_columns: list[str]
    marker_table: str
    marker_schema: str | None
    gid_prefix: str
    lock_timeout: str | None
    connect_timeout: int
    marker_retention_batches: int
    application_name: str
    _password_ref: str | dict[str, str] | None
    _password_inline: str | None
    _sslpassword: str | None
    _max_prepared: int | None
    _marker_home: str | None
    _table_home: str | None
    _pool: _names.ConnectionPool

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

    def _quoted(self, cur: Any, ident: Any) -> str:
        return ident.as_string(cur)

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

    def _intent_prefix(self, query_name: str, batch_id: int, intent: dict[str, Any]) -> str:
        prefix = intent.get("gid_prefix") if intent else None
        if prefix is None:
            return self.batch_prefix(query_name, batch_id)  # every attempt of the batch
        if not isinstance(prefix, str) or not prefix.startswith(self.batch_prefix(query_name, batch_id)):
            raise HandleError(f"INTENT of batch {batch_id} has gid_prefix {prefix!r}, which does not belong "
                              f"to query {query_name!r} batch {batch_id}")
        return prefix

    def query_prefix(self, query_name: str) -> str:
        """``{gid_prefix}:{query}:`` — every gid of every batch of this query starts so."""
        return f"{self.gid_prefix}:{_safe(query_name)}:"

    def _gid_batch(self, query_name: str, gid: str) -> int | None:
        """The batch number of a gid of this query, or None for a gid of anything else.

        The query part is matched whole, up to its ``:`` (``_safe`` names hold no ``:``),
        so ``q.1`` never reads as query ``q``; the batch is the digits before the next ``:``.
        """
        return _names.batch_of(self.query_prefix(query_name), gid)

    def describe_handle(self, handle: dict) -> str:
        return (f"prepared transaction {handle.get('gid')!r} in database {handle.get('database')!r} "
                f"({handle.get('rows')} rows for {handle.get('table')})")

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
