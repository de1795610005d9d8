"""Issue 45: a late task attempt's prepared leftover holding the lock of a key the next batch writes.

A late attempt of batch 0 (a zombie task, a stage retry's duplicate) prepares its transaction after
batch 0's cleanup: it holds key 3's row lock.  Batch 1 upserts key 3: its task waited for
``lock_timeout`` and failed, and in a streaming query a failed batch is a failed query (an alert,
a manual restart), although the failure path rolled the leftover back and a re-run would have
succeeded.  Now the leftover is rolled back before batch 1's tasks start (one look at
``pg_prepared_xacts``), and one that appears while they run makes the batch run again by itself.

Without Spark (tests/inprocess.py), on a real PostgreSQL server.
"""

from __future__ import annotations

import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.sinks.postgres import PostgresSink

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


def _upsert(t: PgTable) -> PostgresSink:
    return PostgresSink(t.dsn, table=t.name, marker_table=f"{t.name}_m", gid_prefix=t.gid_prefix, mode="upsert",
                        key_columns=["id"], lock_timeout="2s")


def _late_attempt_of_batch_0(d: Driver) -> None:
    """Batch 0's partition 0 again (attempt 1), under batch 0's INTENT: it prepares key 3."""
    ctx = TransactionContext(d.query_name, 0, 0, 1, d.intent(0), "zombie")
    run_attempt(d.sink, ctx, ids(3))


def test_a_late_attempts_prepared_leftover_holding_a_key_is_rolled_back_before_the_next_batch_starts(
        postgres_service, tmp_path):
    with PgTable(postgres_service["dsn"], "latelock") as t:
        d = Driver(_upsert(t), str(tmp_path / "log"), "q")
        try:
            assert d.batch(0, ids(1, 2, 3)).action == "committed"
            _late_attempt_of_batch_0(d)
            assert len(t.prepared()) == 1
            prog = d.batch(1, ids(3, 4))          # was: failed after lock_timeout
            assert prog.action == "committed" and prog.aborted_lingering == 1
            assert t.ids() == [1, 2, 3, 4] and t.prepared() == []
            assert t.execute(f'SELECT v FROM "{t.name}" WHERE id = 3') == [("v3",)]
        finally:
            d.close()


def test_a_batch_that_meets_a_late_attempts_locks_while_its_tasks_run_runs_again_by_itself(
        postgres_service, tmp_path):
    with PgTable(postgres_service["dsn"], "latelock2") as t:
        d = Driver(_upsert(t), str(tmp_path / "log"), "q")
        try:
            assert d.batch(0, ids(1, 2, 3)).action == "committed"

            class ZombieFirst(OneTask):
                late = True

                def prepare(self, query_name, batch_id, intent, run):
                    if ZombieFirst.late:   # the zombie prepares just after the look, as the tasks start
                        ZombieFirst.late = False
                        _late_attempt_of_batch_0(d)
                    return super().prepare(query_name, batch_id, intent, run)

            from twophase.protocol import BatchProgress

            prog = BatchProgress("pipe", 1, None, "committed")
            d.protocol.run_batch(1, ZombieFirst(d.sink, ids(3, 4)), prog)   # was: failed after lock_timeout
            assert prog.action == "committed"
            assert t.ids() == [1, 2, 3, 4] and t.prepared() == []
            ballots = d.tlog.view(1).ballots
            assert [(b.ballot, b.committed) for b in ballots] == [(0, False), (1, True)]
        finally:
            d.close()


def test_a_late_leftover_is_rolled_back_even_where_the_role_may_not_write_the_claims_table(
        postgres_service, tmp_path):
    """Found by the second review: the driver's sweep claims a late leftover ``doomed`` before it rolls
    it back; a role without write access to the claims table then rolled back nothing, and the batch
    failed after ``lock_timeout`` at every run.  Without claims it rolls back as before claims existed
    (and says what that leaves unprotected)."""
    from twophase.sinks.postgres import _claims_name

    with PgTable(postgres_service["dsn"], "noclaims") as t:
        d = Driver(_upsert(t), str(tmp_path / "log"), "q")
        claims = _claims_name(f"{t.name}_m")
        try:
            assert d.batch(0, ids(1, 2, 3)).action == "committed"
            _late_attempt_of_batch_0(d)
            t.execute(f'REVOKE INSERT, UPDATE ON "{claims}" FROM CURRENT_USER')
            assert d.batch(1, ids(3, 4)).action == "committed"   # was: failed after lock_timeout, every run
            assert t.ids() == [1, 2, 3, 4] and t.prepared() == []
        finally:
            t.execute(f'GRANT INSERT, UPDATE ON "{claims}" TO CURRENT_USER')
            d.close()


def test_in_the_data_source_form_a_retried_task_rolls_back_the_late_leftover_its_first_attempt_waited_on(
        postgres_service, tmp_path):
    """The data source form has no driver that runs a batch again: Spark retries the task.  The
    retried attempt (attempt 1) rolls back what a late attempt of an earlier batch left prepared
    (claimed doomed first), so it writes key 3 where its first attempt failed after lock_timeout."""
    from twophase.sinks.postgres import PostgresWriteError

    with PgTable(postgres_service["dsn"], "latelock3") as t:
        d = Driver(_upsert(t), str(tmp_path / "log"), "q")
        try:
            assert d.batch(0, ids(1, 2, 3)).action == "committed"
            intent = d.sink.plan_batch(d.query_name, 1, 1)
            _late_attempt_of_batch_0(d)
            with pytest.raises(PostgresWriteError, match="lock"):   # attempt 0 waits on key 3's lock
                run_attempt(d.sink, TransactionContext(d.query_name, 1, 0, 0, intent, "run1"), ids(3, 4))
            handle = run_attempt(d.sink, TransactionContext(d.query_name, 1, 0, 1, intent, "run1"), ids(3, 4))
            assert [g for g in t.prepared()] == [handle["gid"]]   # the zombie's gid is gone, ours is prepared
            d.sink.commit(handle)
            assert t.ids() == [1, 2, 3, 4]
        finally:
            d.close()
