"""MySqlSink: findings of a fresh-context adversarial review of its claims and lingering-session fence
(issue 49, commits 8687109, 4c01531, 088b61a).

Each test is one scenario, run for real on the MariaDB server; each failed on the sink the review read
(commit 5a69585 has them as strict xfails) and passes since the fix:

- The rollback paths had no lingering-session fence.  The commit KILLs the session a branch is still
  attached to (F6), but a retried task (``_roll_back_earlier_attempts``) and the cleanup
  (``abort_lingering``, which ``_give_up`` and ``python -m twophase abort-lingering``/``recover``
  call) only got 1397 for such a branch: the retry waited ``lock_wait_timeout`` and failed, the
  cleanup raised, for as long as the paused executor kept its connection (stall).  Now an executor's
  session idles out ``PREPARED_SESSION_IDLE_SECONDS`` after it pre-committed, and a rollback of a
  branch still attached waits for that (``_rollback_one``).
- A claims table the sink's user may not UPDATE (an append-only writer: SELECT, INSERT, DELETE, CREATE):
  ``open()`` passed, and every batch then failed in ``verify_prepared`` (``INSERT ... ON DUPLICATE KEY
  UPDATE`` needs UPDATE), telling to restart, which failed the same way (stall).  Now ``open()`` makes
  a trial claim, rolled back, and refuses naming the grant.
"""

from __future__ import annotations

import time
import uuid

import pytest

from tests.inprocess import ids, run_attempt
from tests.test_mysql_overlaps import MyTable, kv
from twophase import TransactionContext
from twophase.errors import ConfigurationError
from twophase.sink import CommitOutcome

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


def _prepare_and_linger(sink, ctx, batch):
    """An executor that prepared its branch and paused (SIGSTOP, a GC pause) before it disconnected:
    the branch stays attached to its session.  Returns (handle, the held connection)."""
    import twophase.sinks.mysql.writer as my  # pre_commit's module

    txn = sink.begin_transaction(ctx)
    sink.write(txn, batch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(my, "_close_quietly", lambda c: None)
        h = sink.pre_commit(txn)
    assert txn.conn.open
    return h, txn.conn


def _release(t: MyTable, conn) -> None:
    """Close the held session; wait until its branches can be rolled back (so that MyTable's DROP does
    not wait on their metadata locks)."""
    try:
        conn.close()
    except Exception:  # noqa: BLE001 - killed already
        pass
    deadline = time.monotonic() + 20
    while t.prepared() and time.monotonic() < deadline:
        for g, b in t.prepared():
            try:
                t.q("XA ROLLBACK %s, %s", (g, b))
            except Exception:  # noqa: BLE001 - still attached: its disconnect not yet processed
                time.sleep(0.1)


def test_a_retried_task_is_not_stalled_by_its_earlier_attempts_branch_attached_to_a_paused_session(mariadb_service):
    with MyTable(mariadb_service, "rvretry") as t:
        sink = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=2)
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        # Attempt 0 prepared on key 1 and paused before disconnecting: Spark gives up on it and retries.
        _h0, held = _prepare_and_linger(sink,
                                        TransactionContext("q", 0, 0, 0, intent, "r1", task_attempt_id=10),
                                        kv([1], "a0"))
        try:
            t0 = time.monotonic()
            # Attempt 1 of the same task on the same key: claims attempt 0's branch doomed, then must get
            # past it (was: XA ROLLBACK 1397, logged, then 1205 after lock_wait_timeout).
            h1 = run_attempt(sink, TransactionContext("q", 0, 0, 1, intent, "r1", task_attempt_id=11),
                             kv([1], "a1"))
            print(f"attempt 1 prepared after {time.monotonic() - t0:.1f} s")
            sink.verify_prepared(0, [h1], prepare_started_at=0)
            assert sink.commit(h1).outcome is CommitOutcome.COMMITTED
            assert t.q(f"SELECT id, v FROM `{t.name}` ORDER BY id") == [(1, "a1")]
            assert t.prepared() == []
        finally:
            _release(t, held)


def test_the_cleanup_rolls_back_an_undecided_branch_attached_to_a_paused_session(mariadb_service):
    with MyTable(mariadb_service, "rvclean") as t:
        sink = t.sink()
        sink.open()
        intent = sink.plan_batch("q", 0, 2)
        h, held = _prepare_and_linger(sink, TransactionContext("q", 0, 0, 0, intent), ids(1, 2))
        try:
            assert t.prepared() == [(h["gtrid"], h["bqual"])]
            # The batch is given up undecided (another partition failed); its ballot's leftovers are
            # rolled back by the cleanup, as 'twophase abort-lingering' does for an undecided batch.
            t.sink().abort_lingering("q", 0, intent, [])
            assert t.prepared() == [] and t.ids() == []
        finally:
            _release(t, held)


def test_open_refuses_a_claims_table_an_append_only_writer_cannot_claim_in(mariadb_service):
    import pymysql

    s = mariadb_service
    user = f"rv{uuid.uuid4().hex[:8]}"
    root = pymysql.connect(unix_socket=s["socket"], user="root", autocommit=True)
    with MyTable(s, "rvgrant") as t:
        t.sink().open()  # an administrator created the sink's tables (target, markers, claims)
        with root.cursor() as cur:
            cur.execute("CREATE USER %s@'127.0.0.1' IDENTIFIED BY 'pw'", (user,))
            cur.execute(f"GRANT SELECT, INSERT, DELETE, CREATE ON `{s['database']}`.* TO %s@'127.0.0.1'", (user,))
        try:
            sink = t.sink(password="pw")
            sink.user = user
            # Refused now, naming the claims table and the grant (before: open() passed and every
            # batch then failed at verify_prepared with 1142).
            with pytest.raises(ConfigurationError, match=r"claims table .* GRANT SELECT, INSERT, UPDATE, DELETE") as e:
                sink.open()
            assert "pw" not in str(e.value)
        finally:
            with root.cursor() as cur:
                cur.execute("DROP USER %s@'127.0.0.1'", (user,))
            root.close()
