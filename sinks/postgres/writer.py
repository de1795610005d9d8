"""Executor tasks: one partition's transaction of one batch.  ``begin_transaction`` connects
(a retried task first rolls back what its earlier attempts left prepared and late leftovers of
earlier batches, each once claimed ``doomed``), ``write`` COPYs Arrow batches in, ``pre_commit``
upserts from staging, inserts the marker row, runs PREPARE TRANSACTION and claims the gid
``prepared``; ``abort`` rolls back.
"""

from __future__ import annotations

import hashlib
import io
import re
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import TwoPhaseError
from twophase.sinks import _sql2pc as _names
from twophase.sinks.postgres.base import _PostgresBase
from twophase.sinks.postgres.columns import _arrow_fits, _Column, _fetch_columns, encode_csv
from twophase.sinks.postgres.common import (
    _INSUFFICIENT_PRIVILEGE,
    _UNDEFINED_OBJECT,
    _UNDEFINED_TABLE,
    PostgresWriteError,
    _close_quietly,
    _ConnectError,
    _describe_pg_error,
    _pg,
    log,
    scrub,
)


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


class _Writer(_PostgresBase):
    """Runs on executor tasks: begins, writes, prepares and aborts one partition's transaction."""

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
