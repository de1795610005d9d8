"""Driver: a batch's commit and everything around it.  Before the decision, every prepared
transaction is claimed ``decided`` and checked still prepared (``verify_prepared``); after it,
``COMMIT PREPARED`` (a gone gid judged by its marker row); and the cleanup of what no decision
names: this ballot's leftovers, late ones of earlier batches, old marker rows and finished claims.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.sink import CommitResult
from twophase.sinks import _sql2pc as _names
from twophase.sinks.postgres.base import _PostgresBase
from twophase.sinks.postgres.common import (
    _INSUFFICIENT_PRIVILEGE,
    _OBJECT_IN_USE,
    _TRANSIENT_CLASSES,
    _UNDEFINED_OBJECT,
    _UNDEFINED_TABLE,
    _ConnectError,
    _describe_pg_error,
    _pg,
    log,
)

if TYPE_CHECKING:
    from twophase.evidence import Settled


class _Committer(_PostgresBase):
    """Runs on the driver: claims a batch's prepared transactions ``decided``, commits them, and
    rolls back and cleans up what no decision names."""

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
