"""MySqlSink: who may XA ROLLBACK a prepared branch (issue 49, faults F1 and F6 of its review).

- F1 (loss): two runs of one batch job on one log.  The next run's sweep of late attempts'
  leftovers (``sweep_late``) rolled back a prepared branch of a backfill's decided, partly committed
  batch; the backfill's commit then found it gone (1397) and the batch was half visible.  Now a
  leftover is rolled back only once claimed ``doomed`` in the claims table, which a branch claimed
  ``decided`` (by ``verify_prepared``, before the decision) refuses; first claim wins.
- A retried task whose earlier attempt prepared on the same upsert keys waited
  ``lock_wait_timeout`` and failed; now it claims that branch doomed and rolls it back itself.
- F6 (stall): on MariaDB a prepared branch stays attached to the session that prepared it until that
  session disconnects, and ``XA COMMIT`` from another session answers 1397 meanwhile; a paused
  executor stalled the batch's commit for as long as it kept its connection.  Now the handle
  carries the preparing session's CONNECTION_ID() and the commit KILLs that connection (only one
  of the sink's own user) and commits.

Without Spark (tests/inprocess.py drivers): real local files for the log, the real MariaDB server.
"""

from __future__ import annotations

import uuid
from typing import Any

import pyarrow as pa
import pytest

from tests.inprocess import Driver, ids, run_attempt
from twophase import TransactionContext
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress
from twophase.recovery import Committer
from twophase.sink import CommitOutcome
from twophase.sinks.mysql import MySqlSink, MySqlWriteError

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


class MyTable:
    """A table of a test's own on the MariaDB server, ``(id BIGINT PRIMARY KEY, v VARCHAR)``, and what a
    MySqlSink leaves beside it; on exit its branches are rolled back and its tables dropped."""

    def __init__(self, service: dict[str, Any], stem: str):
        import pymysql

        self.s = service
        uid = uuid.uuid4().hex[:8]
        self.name, self.markers, self.prefix = f"{stem}_{uid}", f"{stem}_{uid}_m", f"t{uid}"
        self.db = pymysql.connect(host=service["host"], port=service["port"], user=service["user"],
                                  password=service["password"], database=service["database"], autocommit=True)
        self.q(f"CREATE TABLE `{self.name}` (id BIGINT PRIMARY KEY, v VARCHAR(100)) ENGINE=InnoDB")

    def __enter__(self) -> MyTable:
        return self

    def __exit__(self, *exc: object) -> None:
        for g, b in self.prepared():
            try:
                self.q("XA ROLLBACK %s, %s", (g, b))
            except Exception:  # noqa: BLE001 - still attached to a test's held session: closed below
                pass
        self.q(f"DROP TABLE IF EXISTS `{self.name}`, `{self.markers}`, `{self.markers}_claims`")
        self.db.close()

    def sink(self, **kw: Any) -> MySqlSink:
        s = self.s
        kw.setdefault("password", s["password"])
        return MySqlSink(s["host"], s["port"], s["database"], self.name, user=s["user"],
                         marker_table=self.markers, gid_prefix=self.prefix, **kw)

    def q(self, statement: str, args: Any = None) -> list[tuple]:
        with self.db.cursor() as cur:
            cur.execute(statement, args)
            return list(cur.fetchall()) if cur.description else []

    def ids(self) -> list[int]:
        return [r[0] for r in self.q(f"SELECT id FROM `{self.name}` ORDER BY id")]

    def prepared(self) -> list[tuple[str, str]]:
        out = []
        for _f, glen, blen, data in self.q("XA RECOVER"):
            g, b = data[:glen].decode(), data[glen:glen + blen].decode()
            if g.startswith(self.prefix + ":"):
                out.append((g, b))
        return sorted(out)


def kv(keys: list[int], v: str) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.string())})


@pytest.mark.parametrize("claims", [True, False], ids=["claims", "no-claims-table"])
def test_the_next_runs_sweep_of_late_leftovers_leaves_a_backfills_decided_branches_alone(mariadb_service, tmp_path,
                                                                                         claims):
    """With the claims table a decided branch refuses to be doomed; without it (dropped: a sink never
    open()ed) the sweep rolled back every branch of a lower batch id, now only those of batches the
    log shows finished (issue 59's rule), and batch 5 is not finished."""
    log_url = str(tmp_path / "log")
    with MyTable(mariadb_service, "sweepdec") as t:
        qid = batch_query_id("daily", t.sink().target())
        y = Driver(t.sink(), log_url, qid, takeover=True)
        x_state: dict = {}

        def y_partitions(planned):
            # Y (batch 7) has recovered and pauses before its INTENT; X (a backfill of batch 5) runs:
            # INTENT, two tasks, the check (claim as decided), the decision, the first of its two commits.
            x = Driver(t.sink(), log_url, qid, takeover=True)
            opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
            assert opened is not None
            results = []
            for part, rows in ((0, ids(50, 51)), (1, ids(52, 53))):
                ctx = TransactionContext(opened.query_name, 5, part, 0, opened.intent, opened.run)
                results.append({"partition": part, "attempt": 0, "rows": 2,
                                "handle": x.sink.encode_handle(run_attempt(x.sink, ctx, rows))})
            x.protocol.check_prepared(opened, results, started_at=0)
            assert x.tlog.mine(x.tlog.decide(5, opened.number, {"handles": [r["handle"] for r in results],
                                                                "rows": 4, "partitions": [0, 1]}))
            assert x.sink.commit(x.sink.decode_handle(results[0]["handle"])).outcome is CommitOutcome.COMMITTED
            x_state.update(x=x, results=results)
            if not claims:
                t.q(f"DROP TABLE `{t.markers}_claims`")
            return 1

        prog = BatchProgress("pipe", 7, None, "committed")
        y.protocol.open_ballot(7, y_partitions, prog)   # its INTENT, then its sweep of late leftovers
        assert prog.aborted_lingering == 0
        x, results = x_state["x"], x_state["results"]
        # X resumes its commit: was DataLossError (partition 1 rolled back by Y's sweep, 52 and 53 lost).
        Committer(x.sink, backoff=0.01).commit(5, [x.sink.decode_handle(r["handle"]) for r in results],
                                               recovering=False)
        assert t.ids() == [50, 51, 52, 53] and t.prepared() == []
        if claims:
            # abort_lingering of the next batch drops the claims of branches no longer prepared.
            x.sink.abort_lingering(x.query_name, 8, {}, [])
            assert t.q(f"SELECT COUNT(*) FROM `{t.markers}_claims`") == [(0,)]
        x.close()
        y.close()


def test_a_retried_task_rolls_back_its_earlier_attempts_branch_on_the_same_upsert_keys(mariadb_service):
    with MyTable(mariadb_service, "retry") as t:
        sink = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=3)
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        # Attempt 0 prepared on keys 1 and 2 and its executor was lost (its result never reached the driver).
        run_attempt(sink, TransactionContext("q", 0, 0, 0, intent, "r1", task_attempt_id=10), kv([1, 2], "a0"))
        # Attempt 1 of the same task writes the same keys: was 1205 after lock_wait_timeout.
        h = run_attempt(sink, TransactionContext("q", 0, 0, 1, intent, "r1", task_attempt_id=11), kv([1, 2], "a1"))
        assert t.prepared() == [(h["gtrid"], h["bqual"])]
        sink.verify_prepared(0, [h], prepare_started_at=0)
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT id, v FROM `{t.name}` ORDER BY id") == [(1, "a1"), (2, "a1")]


def test_a_decided_branch_is_never_doomed_and_a_doomed_one_is_never_decided(mariadb_service):
    with MyTable(mariadb_service, "firstclaim") as t:
        sink = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1)
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        # Decided first: a late attempt 1 (which takes attempt 0's branch for its own earlier one)
        # leaves it alone, waits on its locks and fails; the decided branch commits.
        h0 = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent, "r1", task_attempt_id=10), kv([1], "a0"))
        sink.verify_prepared(0, [h0], prepare_started_at=0)
        with pytest.raises(MySqlWriteError, match="1205"):
            run_attempt(sink, TransactionContext("q", 0, 0, 1, intent, "r1", task_attempt_id=11), kv([1], "a1"))
        assert sink.commit(h0).outcome is CommitOutcome.COMMITTED
        # Doomed first: the driver refuses to decide a branch a retried attempt claimed (and rolled back).
        intent = sink.plan_batch("q", 1, 1)
        h0 = run_attempt(sink, TransactionContext("q", 1, 0, 0, intent, "r2", task_attempt_id=20), kv([2], "b0"))
        h1 = run_attempt(sink, TransactionContext("q", 1, 0, 1, intent, "r2", task_attempt_id=21), kv([2], "b1"))
        with pytest.raises(Exception, match="doomed by a retried task"):
            sink.verify_prepared(1, [h0], prepare_started_at=0)
        assert sink.commit(h1).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT id, v FROM `{t.name}` ORDER BY id") == [(1, "a0"), (2, "b1")]


def test_a_branch_claimed_doomed_while_still_prepared_is_refused_by_the_decision(mariadb_service):
    """The doomed claim is the fence, not the rollback after it: a retried task claimed its earlier
    attempt's branch doomed and stopped before its XA ROLLBACK (paused, or its executor lost), and
    meanwhile the driver, whose result names that earlier attempt, is offered the branch, still
    prepared.  It must refuse to decide it (the retry's rollback would then take a decided branch:
    loss), claiming nothing; the branch stays the retry's to roll back.  (Above, the retry had
    rolled the branch back before the check, so the branch was gone either way.)"""
    with MyTable(mariadb_service, "doomprep") as t:
        driver = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1)
        driver.open()
        intent = driver.plan_batch("q", 0, 1)
        h0 = run_attempt(t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1),
                         TransactionContext("q", 0, 0, 0, intent, "r", task_attempt_id=10), kv([7], "a0"))
        retry = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1)
        seen: dict = {}
        rollback_one = retry._rollback_one

        def stopped_before_its_rollback(conn: Any, gtrid: str, bqual: str) -> bool:
            # The retry holds its doomed claim; the branch is still prepared: the driver decides now.
            seen["prepared"] = t.prepared()
            with pytest.raises(Exception, match="doomed by a retried task") as refused:
                driver.verify_prepared(0, [h0], prepare_started_at=0)
            seen["refused"] = str(refused.value)
            seen["claims"] = [(bytes(g).decode(), bytes(b).decode(), st) for g, b, st in
                              t.q(f"SELECT gtrid, bqual, state FROM `{t.markers}_claims`")]
            return rollback_one(conn, gtrid, bqual)

        retry._rollback_one = stopped_before_its_rollback  # type: ignore[method-assign]
        h1 = run_attempt(retry, TransactionContext("q", 0, 0, 1, intent, "r", task_attempt_id=11), kv([7], "a1"))
        assert seen.get("prepared") == [(h0["gtrid"], h0["bqual"])], seen  # offered while still prepared
        assert "Nothing was decided" in seen["refused"], seen
        assert seen["claims"] == [(h0["gtrid"], h0["bqual"], "doomed")], seen  # the decision claimed nothing
        # The retry rolled its earlier attempt's branch back; its own branch is the one decided.
        assert t.prepared() == [(h1["gtrid"], h1["bqual"])]
        driver.verify_prepared(0, [h1], prepare_started_at=0)
        assert driver.commit(h1).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT id, v FROM `{t.name}` ORDER BY id") == [(7, "a1")]


def test_a_commit_is_not_stalled_by_an_executor_session_that_prepared_and_lingers(mariadb_service, monkeypatch):
    import twophase.sinks.mysql.writer as my  # pre_commit's module

    with MyTable(mariadb_service, "linger") as t:
        sink = t.sink()
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
        sink.write(txn, ids(1, 2))
        # The executor prepared and then paused (SIGSTOP) before it disconnected: its session is held.
        monkeypatch.setattr(my, "_close_quietly", lambda c: None)
        h = sink.pre_commit(txn)
        monkeypatch.undo()
        try:
            assert txn.conn.open
            # Was: retry_later ("still attached") for as long as the session lives.
            r = t.sink().commit(h)
            assert r.outcome is CommitOutcome.COMMITTED, r
            assert t.ids() == [1, 2] and t.prepared() == []
        finally:
            txn.conn.close()


def _side_branch(t: MyTable, handle: dict, marker: bool, prepare: bool) -> Any:
    """A session of the test's own that starts the handle's XA branch, inserts rows 8 and 9 and (with
    ``marker``) the branch's marker row, and (with ``prepare``) prepares it; returned open."""
    import pymysql

    s = t.s
    conn = pymysql.connect(host=s["host"], port=s["port"], user=s["user"], password=s["password"],
                           database=s["database"], autocommit=True)
    with conn.cursor() as cur:
        cur.execute("XA START %s, %s", (handle["gtrid"], handle["bqual"]))
        cur.execute(f"INSERT INTO `{t.name}` (id, v) VALUES (8, 'x'), (9, 'x')")
        if marker:
            cur.execute(f"INSERT INTO `{t.markers}` (gtrid, bqual, query_name, batch_id, partition_id, attempt, "
                        "target_table, row_count) VALUES (%s, %s, 'q', 0, 0, 0, %s, 2)",
                        (handle["gtrid"], handle["bqual"], t.name))
        if prepare:
            cur.execute("XA END %s, %s", (handle["gtrid"], handle["bqual"]))
            cur.execute("XA PREPARE %s, %s", (handle["gtrid"], handle["bqual"]))
    return conn


def _handle_of(t: MyTable, sink: MySqlSink) -> dict:
    sink.open()
    intent = sink.plan_batch("q", 0, 1)
    gtrid, bqual = sink.make_xid(intent["gid_prefix"], 0, 0)
    return {"gtrid": gtrid, "bqual": bqual, "database": t.s["database"], "table": t.name, "rows": 2, "batch": 0,
            "partition": 0, "marker_table": t.markers}


def test_a_branch_not_listed_whose_marker_row_a_transaction_holds_is_never_judged_never_visible(mariadb_service):
    """MariaDB can answer an XA COMMIT that meets the preparing session's disconnect half done with OK
    and commit nothing: InnoDB keeps the branch prepared, its marker row uncommitted and locked, and
    XA RECOVER does not list it until the server restarts (CI's lingering-session test, under load:
    'committed' over rows nobody saw).  Judged by the listing and the committed marker alone, the
    branch read as rolled back: lost, never visible, the batch voided and written again, while the
    server still holds it prepared.  The marker row's key held by a transaction is evidence that the
    branch exists: retried, never judged gone.  Played here by a branch not yet prepared (not listed,
    its marker row inserted and uncommitted), which holds the key the same way."""
    with MyTable(mariadb_service, "limbo") as t:
        sink = t.sink()
        h = _handle_of(t, sink)
        side = _side_branch(t, h, marker=True, prepare=False)
        try:
            assert t.prepared() == []  # not listed
            r = sink.commit(h)
            assert r.outcome is CommitOutcome.RETRY_LATER, r
            assert "Restart the MariaDB server" in r.reason and not r.never_visible, r
        finally:
            side.close()  # an unprepared branch: rolled back by the disconnect
        r = sink.commit(h)  # nothing holds the key now: gone, and never visible
        assert r.outcome is CommitOutcome.LOST and r.never_visible, r


def _holding_the_marker_key(t: MyTable, handle: dict) -> Any:
    """A session of the test's own holding the handle's marker row key: its uncommitted insert of it."""
    import pymysql

    s = t.s
    conn = pymysql.connect(host=s["host"], port=s["port"], user=s["user"], password=s["password"],
                           database=s["database"], autocommit=False)
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO `{t.markers}` (gtrid, bqual, query_name, batch_id, partition_id, attempt, "
                    "target_table, row_count) VALUES (%s, %s, 'q', 0, 0, 0, %s, 2)",
                    (handle["gtrid"], handle["bqual"], t.name))
    return conn


def test_an_xa_commit_answered_ok_whose_marker_row_a_transaction_still_holds_is_not_reported_committed(
        mariadb_service):
    """The other half of the lingering-session race: the XA COMMIT answered OK, and the branch, in
    MariaDB's limbo, still holds its uncommitted marker row.  A commit reports COMMITTED only once
    the marker row is visible or nobody holds its key; held, it is retried later with the remedy.
    Played by a branch prepared without its marker row (the server commits it) while another
    transaction holds the marker row's key, as the limbo branch does."""
    with MyTable(mariadb_service, "nomark") as t:
        sink = t.sink()
        h = _handle_of(t, sink)
        _side_branch(t, h, marker=False, prepare=True).close()
        holder = _holding_the_marker_key(t, h)
        try:
            r = sink.commit(h)
        finally:
            holder.rollback()
            holder.close()
        assert r.outcome is CommitOutcome.RETRY_LATER, r
        assert "Restart the MariaDB server" in r.reason, r


def test_an_xa_commit_answered_ok_whose_marker_key_nobody_holds_is_committed_even_without_a_marker_row(
        mariadb_service):
    """From the fresh-context review of the limbo fence: an XA COMMIT answered OK whose marker row is
    not in the table read (a handle written before it named its marker table, read with another)
    was retried; the retry's 1397 found no marker and nothing holding it, and judged the committed
    branch never visible: voided and written again.  Nothing holds the key, so no transaction of
    the branch is left: the commit took; reported COMMITTED (with a warning naming the table)."""
    with MyTable(mariadb_service, "nomark2") as t:
        sink = t.sink()
        h = _handle_of(t, sink)
        _side_branch(t, h, marker=False, prepare=True).close()
        r = sink.commit(h)
        assert r.outcome is CommitOutcome.COMMITTED, r
        assert t.ids() == [8, 9]


_PAUSED_EXECUTOR = r"""
import json, os, signal, sys
import pyarrow as pa
import twophase.sinks.mysql.writer as my  # pre_commit's module
from twophase import TransactionContext
from twophase.config import sink_from_config

sink = sink_from_config(json.loads(sys.argv[1]))
intent = json.loads(sys.argv[2])
txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
sink.write(txn, pa.record_batch({"id": pa.array([3, 4], pa.int64()), "v": ["v3", "v4"]}))
my._close_quietly = lambda conn: None  # paused right after XA PREPARE, before it disconnects
print(json.dumps(sink.pre_commit(txn)), flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_commit_is_not_stalled_by_a_paused_executor_process_that_prepared(mariadb_service, monkeypatch):
    """F6 with a real second process: it prepares its branch and stops itself (SIGSTOP) before it
    disconnects; the driver's commit kills that process's connection and commits."""
    import json
    import os
    import signal
    import subprocess
    import sys

    with MyTable(mariadb_service, "paused") as t:
        sink = t.sink(password={"env": "TWOPHASE_TEST_MYSQL_PW"})
        monkeypatch.setenv("TWOPHASE_TEST_MYSQL_PW", mariadb_service["password"])
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        child = subprocess.Popen([sys.executable, "-c", _PAUSED_EXECUTOR, json.dumps(sink.to_config()),
                                  json.dumps(intent)], stdout=subprocess.PIPE, text=True,
                                 cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            h = json.loads(child.stdout.readline())
            os.waitpid(child.pid, os.WUNTRACED)  # stopped, its connection open
            assert t.prepared() == [(h["gtrid"], h["bqual"])]
            r = sink.commit(h)
            assert r.outcome is CommitOutcome.COMMITTED, r
            assert t.ids() == [3, 4] and t.prepared() == []
        finally:
            child.send_signal(signal.SIGCONT)
            child.kill()
            child.wait(30)


def test_a_retried_task_rolls_back_a_late_leftover_of_an_earlier_batch_but_never_a_decided_one(mariadb_service):
    """The data source form: no driver runs a failed batch again, so a task that met the row locks
    of a late attempt's branch of an earlier batch must get past it on its retry.  Was: every
    attempt waited lock_wait_timeout and failed until the next batch's driver swept the leftover."""
    with MyTable(mariadb_service, "lateexec") as t:
        sink = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1)
        sink.open()
        intent0 = sink.plan_batch("q", 0, 1)
        h0 = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent0, "r0", task_attempt_id=1), kv([1], "a"))
        assert sink.commit(h0).outcome is CommitOutcome.COMMITTED
        # A late attempt of batch 0 prepares on key 1 after its batch was committed and cleaned up.
        late = run_attempt(sink, TransactionContext("q", 0, 0, 1, intent0, "r0", task_attempt_id=2), kv([1], "late"))
        intent1 = sink.plan_batch("q", 1, 1)
        with pytest.raises(MySqlWriteError, match="1205"):
            run_attempt(sink, TransactionContext("q", 1, 0, 0, intent1, "r1", task_attempt_id=3), kv([1], "b"))
        h1 = run_attempt(sink, TransactionContext("q", 1, 0, 1, intent1, "r1", task_attempt_id=4), kv([1], "b"))
        assert (late["gtrid"], late["bqual"]) not in t.prepared()
        assert sink.commit(h1).outcome is CommitOutcome.COMMITTED
        # A branch of an earlier batch claimed decided (another run's backfill, not yet committed) is
        # left alone: the retry waits on its locks and fails; the decided branch commits.
        intent2 = sink.plan_batch("q", 2, 1)
        backfill = run_attempt(sink, TransactionContext("q", 2, 0, 0, intent2, "x", task_attempt_id=5), kv([2], "x"))
        sink.verify_prepared(2, [backfill], prepare_started_at=0)
        intent3 = sink.plan_batch("q", 3, 1)
        with pytest.raises(MySqlWriteError, match="1205"):
            run_attempt(sink, TransactionContext("q", 3, 0, 1, intent3, "r3", task_attempt_id=7), kv([2], "c"))
        assert sink.commit(backfill).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT id, v FROM `{t.name}` ORDER BY id") == [(1, "b"), (2, "x")]
