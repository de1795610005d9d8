"""The driver: the decision's check (:meth:`_Committer.verify_prepared`), ``XA COMMIT`` of each
handle on a connection of its own and its verdicts (the marker row: committed, or never visible),
recovery's rollback, and the cleanup of leftover branches (``abort_lingering``, ``sweep_late``),
of marker rows and of claims."""

from __future__ import annotations

import time
from typing import Any

from twophase.errors import ConfigurationError, TwoPhaseError
from twophase.evidence import Settled
from twophase.sink import CommitResult
from twophase.sinks import _sql2pc as names
from twophase.sinks.mysql.branches import _Branches
from twophase.sinks.mysql.common import (
    _TRANSIENT,
    ABSENT,
    DECIDED,
    DETACH_WAIT_SECONDS,
    ER_NO_SUCH_TABLE,
    ER_NO_SUCH_THREAD,
    ER_XAER_DUPID,
    ER_XAER_NOTA,
    ER_XAER_RMFAIL,
    HELD,
    PRESENT,
    SESSION_GONE_WAIT_SECONDS,
    _ConnectError,
    _errno,
    _limbo_text,
    _my,
    _text,
    _xids,
    log,
    quote_ident,
)


class _Committer(_Branches):
    """The driver: claims a batch's branches decided, ``XA COMMIT`` and its verdicts, recovery, and
    the cleanup of leftover branches, markers and claims."""

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

    def prepared(self, prefix: str = "") -> list[tuple[str, str]]:
        """``(gtrid, bqual)`` of every prepared XA branch whose gtrid starts with ``prefix`` (driver)."""
        conn = self._driver_conn()
        try:
            return sorted(x for x in self._recover(conn) if x[0].startswith(prefix))
        finally:
            self._release(conn)

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
                if not found:
                    state = self._marker_state(cur, handle)
                    if state == HELD:
                        return CommitResult.retry_later(_limbo_text(name))
                    found = state == PRESENT
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
        # transaction holds its key: _marker_state); this sink deletes markers only of batches the log
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
            state = PRESENT if cur.fetchone() is not None else self._marker_state(cur, handle)
            if state == PRESENT:
                return CommitResult.already_committed(f"marker row of {name} present")
            if state == HELD:
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
        state = self._marker_state(cur, handle)
        if state == HELD:
            log.error("%s", _limbo_text(name))
            return CommitResult.retry_later(_limbo_text(name))
        if state == ABSENT:
            # Committed (no transaction of the branch is left: nothing holds its marker's key), but its
            # marker row is not in this table: a handle written before it named its marker table, read
            # with another one.  Never a retry: the retry's 1397 would find no marker and judge it
            # never visible.
            log.warning("XA branch %s: XA COMMIT answered OK and no transaction holds its marker row's key, "
                        "but marker table %s has no row of it: is that the table the branch was written with?",
                        name, quote_ident(self.marker_table))
        return CommitResult.committed()

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
