"""Both sides (driver and executor tasks): prepared XA branches as ``XA RECOVER`` lists them, the
claims (one row per branch) that settle who may roll one back, and ``XA ROLLBACK`` of a branch."""

from __future__ import annotations

import time
from typing import Any

from twophase.errors import TwoPhaseError
from twophase.sinks.mysql.base import _MySqlBase
from twophase.sinks.mysql.common import (
    ABSENT,
    DECIDED,
    DETACH_WAIT_SECONDS,
    DOOMED,
    ER_LOCK_DEADLOCK,
    ER_LOCK_WAIT_TIMEOUT,
    ER_XAER_NOTA,
    HELD,
    PREPARED_SESSION_IDLE_SECONDS,
    PRESENT,
    _errno,
    _my,
    _text,
    _xids,
    log,
    quote_ident,
)


class _Branches(_MySqlBase):
    """Both sides: prepared XA branches as ``XA RECOVER`` lists them, the claims that say who may roll
    one back, and ``XA ROLLBACK`` (the driver's cleanup and commit, an executor task's retry and abort)."""

    def _claim(self, conn: Any, xids: list[tuple[str, str]], state: str) -> set[tuple[str, str]]:
        """Claim ``xids`` as ``state`` (``doomed`` or ``decided``); return those now claimed so.

        One statement on the branches' claim rows, ``INSERT ... ON DUPLICATE KEY UPDATE``, which keeps
        an existing claim of the other state: InnoDB's row lock orders two claims of one branch, and
        whichever comes first wins.  A branch claimed ``decided`` (by :meth:`verify_prepared`, before
        the decision) is never claimed ``doomed``, so never rolled back by a retried task or a sweep of
        late leftovers; one claimed ``doomed`` is never decided.  The rows are read back in the same
        transaction, under their locks.  Errors (a missing claims table: 1146) are raised."""
        if not xids:
            return set()
        other = DECIDED if state == DOOMED else DOOMED
        xids = sorted(set(xids))  # one lock order for every claimer
        claims = quote_ident(self.claims_table)
        conn.begin()
        try:
            with conn.cursor() as cur:
                cur.execute(f"INSERT INTO {claims} (gtrid, bqual, state) VALUES "
                            + ", ".join(["(%s, %s, %s)"] * len(xids))
                            + " ON DUPLICATE KEY UPDATE state = IF(state = %s, state, VALUES(state))",
                            [v for g, b in xids for v in (g, b, state)] + [other])
                cur.execute(f"SELECT gtrid, bqual FROM {claims} WHERE state = %s AND (gtrid, bqual) IN ("
                            + ", ".join(["(%s, %s)"] * len(xids)) + ")", [state] + [v for x in xids for v in x])
                won = {(_text(g), _text(b)) for g, b in cur.fetchall()}
            conn.commit()
        except BaseException:
            try:
                conn.rollback()
            except Exception:  # noqa: BLE001 - the connection broke: the server rolls back
                pass
            raise
        return won

    def _doom(self, conn: Any, label: str, xids: list[tuple[str, str]],
              strict: bool = True) -> list[tuple[str, str]] | None:
        """Claim ``xids`` as doomed; return those the caller may roll back (see :meth:`_claim`).  A
        branch claimed ``decided`` is in a decision and left alone.  When the claims cannot be written:
        ``strict`` (an executor), none; else None, and the caller decides."""
        if not xids:
            return []
        try:
            won = self._claim(conn, xids, DOOMED)
        except _my().Error as e:
            if not strict:
                log.debug("%s: cannot claim %s as doomed (%s)", label, _xids(xids), self._describe(e))
                return None
            log.warning("%s: cannot claim %s as doomed (%s); none is rolled back and this attempt may wait on "
                        "their locks", label, _xids(xids), self._describe(e))
            return []
        for x in xids:
            if x not in won:
                log.warning("%s: %s looks like a leftover but is claimed by its batch's decision: left alone "
                            "(what needs its locks may wait on them)", label, _xids([x]))
        return [x for x in sorted(xids) if x in won]

    def _recover(self, conn: Any) -> set[tuple[str, str]]:
        """``(gtrid, bqual)`` of every prepared XA branch of the server (``XA RECOVER`` on ``conn``)."""
        with conn.cursor() as cur:
            cur.execute("XA RECOVER")
            return {self._split_xid(row) for row in cur.fetchall()}

    @staticmethod
    def _split_xid(row: tuple[Any, ...]) -> tuple[str, str]:
        """``(gtrid, bqual)`` from a row of ``XA RECOVER`` (formatID, gtrid_length, bqual_length, data)."""
        _fmt, glen, blen, data = row[:4]
        raw = data if isinstance(data, bytes) else str(data).encode()
        return raw[:glen].decode(errors="replace"), raw[glen:glen + blen].decode(errors="replace")

    def _rollback(self, xids: list[tuple[str, str]], strict: bool = True) -> int:
        """``XA ROLLBACK`` each branch; one already gone is fine.  Other failures raise, or with
        ``strict=False`` only log (the next cleanup tries again)."""
        if not xids:
            return 0
        my = _my()
        n = 0
        conn = self._driver_conn()
        try:
            for gtrid, bqual in xids:
                try:
                    n += self._rollback_one(conn, gtrid, bqual)
                except my.Error as e:
                    # 1397 for a branch XA RECOVER still lists after the wait: still attached to the
                    # session that prepared it (one pre-committed before PREPARED_SESSION_IDLE_SECONDS
                    # was set), and nothing was rolled back.
                    msg = (f"XA ROLLBACK {gtrid}/{bqual} at {self.where} failed: {self._describe(e)}"
                           + (" (the branch is still attached to the session that prepared it)"
                              if _errno(e) == ER_XAER_NOTA else ""))
                    if strict:
                        raise TwoPhaseError(msg) from None
                    log.warning("%s; the next batch's cleanup tries again", msg)
        finally:
            self._release(conn)
        return n

    def _marker_state(self, cur: Any, handle: dict) -> str:
        """What a locking read of the branch's marker row key finds: :data:`HELD` (a transaction holds
        it: one it inserted and has not ended), :data:`PRESENT` (the row, committed: the freshest
        evidence there is, the read waited for any holder to end) or :data:`ABSENT`.  A branch not
        listed by ``XA RECOVER`` whose marker row is not committed is never visible only if the key is
        ABSENT: a branch in MariaDB's limbo (``_Committer._committed_or_limbo``) holds it.  The read
        waits at most a second; the session's lock wait is set back to the server's default after it."""
        my = _my()
        cur.execute("SET SESSION innodb_lock_wait_timeout = 1")
        try:
            cur.execute(f"SELECT 1 FROM {quote_ident(self.marker_table)} WHERE gtrid = %s AND bqual = %s "
                        "FOR UPDATE", (handle["gtrid"], handle["bqual"]))
            return PRESENT if cur.fetchall() else ABSENT
        except my.Error as e:
            if _errno(e) in (ER_LOCK_WAIT_TIMEOUT, ER_LOCK_DEADLOCK):
                return HELD
            raise
        finally:
            cur.execute("SET SESSION innodb_lock_wait_timeout = DEFAULT")

    def _rollback_one(self, conn: Any, gtrid: str, bqual: str) -> bool:
        """``XA ROLLBACK`` one branch (the caller may: claimed doomed, or its ballot decided to abort);
        True if rolled back here, False if gone already.  A branch still attached to the session that
        prepared it (1397 while ``XA RECOVER`` lists it: MariaDB) is waited for: that session idles out
        ``PREPARED_SESSION_IDLE_SECONDS`` after it pre-committed, or is being closed, and the branch then
        stays prepared, detached; the rollback is tried again until then (plus ``DETACH_WAIT_SECONDS``).
        Other errors, and a branch still attached after that, raise ``pymysql.Error``."""
        my = _my()
        deadline = time.monotonic() + PREPARED_SESSION_IDLE_SECONDS + DETACH_WAIT_SECONDS
        while True:
            try:
                with conn.cursor() as cur:
                    cur.execute("XA ROLLBACK %s, %s", (gtrid, bqual))
                    # MariaDB's race (``_Committer._committed_or_limbo``) answers a rollback OK too and
                    # leaves the branch prepared, unlisted, its row locks held until the server restarts
                    # (its recovery lists it again for the next cleanup): nothing becomes visible, but
                    # writers of the same keys wait and fail; say so, with the remedy.
                    if self._marker_state(cur, {"gtrid": gtrid, "bqual": bqual}) == HELD:
                        log.error("XA ROLLBACK %s/%s was answered OK, but the branch still holds its marker row: "
                                  "MariaDB's race with the disconnect of the session that prepared it left it "
                                  "prepared and unlisted, its row locks held (writes of the same keys fail after "
                                  "the lock wait). Restart the MariaDB server: its recovery lists the branch again "
                                  "and the next cleanup rolls it back. Nothing of it is visible", gtrid, bqual)
                return True
            except my.Error as e:
                if _errno(e) != ER_XAER_NOTA:
                    raise
                if not self._listed(conn, gtrid, bqual):
                    return False  # gone already (committed or rolled back)
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.25)

    def _listed(self, conn: Any, gtrid: str, bqual: str) -> bool:
        """Does ``XA RECOVER`` (on ``conn``) list the branch?  True when it cannot be asked: an
        abort is confirmed only by the branch's absence."""
        try:
            with conn.cursor() as cur:
                cur.execute("XA RECOVER")
                return any(self._split_xid(r) == (gtrid, bqual) for r in cur.fetchall())
        except _my().Error:
            return True
