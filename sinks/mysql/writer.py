"""Executor tasks: a partition's XA branch begun (``begin_transaction``: connect, roll back earlier
attempts' and late leftovers' branches it can claim, read the table's columns, ``XA START``),
pre-committed (the marker row, ``XA END``, ``XA PREPARE``, disconnect) or aborted."""

from __future__ import annotations

from typing import Any

from twophase.context import TransactionContext
from twophase.errors import TwoPhaseError
from twophase.sinks import _sql2pc as names
from twophase.sinks.mysql.branches import _Branches
from twophase.sinks.mysql.common import (
    PREPARED_SESSION_IDLE_SECONDS,
    MySqlTransaction,
    MySqlWriteError,
    _close_quietly,
    _Column,
    _ConnectError,
    _errno,
    _my,
    _text,
    _unique_index_problem,
    log,
    quote_ident,
)


class _Writer(_Branches):
    """Executor tasks: ``XA START`` of the attempt's branch (after rolling back what its earlier
    attempts left), the marker row, ``XA END`` and ``XA PREPARE``, and the abort."""

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
