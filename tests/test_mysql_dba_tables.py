"""MySqlSink on the tables DBAs really have, and its cleanup under batch jobs that overlap (issue 61, and
issue 59's MySQL parts).  Each test is one scenario on the real MariaDB server, in process (no Spark):

- a second UNIQUE index in upsert mode: ``ON DUPLICATE KEY UPDATE`` fires on any unique key, so a new
  key whose email was taken overwrote the other key's row and was never written (silent loss); now
  ``open()`` refuses such a table, naming the index and the remedy, in both forms.  PostgreSQL's
  ``ON CONFLICT (id)`` answered by test: it fails the batch and loses nothing.
- the markers' prune ran ``DELETE ... WHERE (gtrid, bqual) IN ((g, b))``, a full scan on 10.11 that
  waited on another pipeline's prepared marker row (1205 after 5 s a batch, markers never pruned);
  and it pruned by batch-id distance, deleting the markers of a backfill's batch decided and
  committed but not yet COMMITTED in the log (then judged never visible, written again).
- a key in two partitions of one batch: the second partition fails with 1205 on every attempt; now
  the error says so, naming the table, the batch's branch that holds the lock and the remedy.
- a handle that did not name its marker table: a recovery config with another ``marker_table``
  judged a committed branch never visible; now refused, naming both.
- the KILL of a lingering session by a connection id that restarts with the server: now only a
  connection of the handle's user, the sink's own, made before the branch began.
- ``_drop_claims`` must keep the claims of branches ``XA RECOVER`` still lists (issue 59's mutant).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import pyarrow as pa
import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids, run_attempt
from tests.test_mysql_overlaps import MyTable, kv
from twophase import TransactionContext
from twophase.errors import ConfigurationError
from twophase.evidence import Settled
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress
from twophase.recovery import Committer
from twophase.sink import CommitOutcome
from twophase.sink import abort_lingering as protocol_abort_lingering
from twophase.sinks.mysql import MySqlSink, MySqlWriteError

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


def _sink(s: dict, table: str, **kw: Any) -> MySqlSink:
    kw.setdefault("user", s["user"])
    kw.setdefault("password", s["password"])
    return MySqlSink(s["host"], s["port"], s["database"], table, **kw)


def emails(rows: list[tuple[int, str, str]]) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array([r[0] for r in rows], pa.int64()),
                            "email": [r[1] for r in rows], "v": [r[2] for r in rows]})


def _email_table(t: MyTable) -> None:
    """``t`` as a DBA's table: ``(id PK, email UNIQUE, v)`` holding ``(1, 'a@x', 'old')``."""
    t.q(f"DROP TABLE `{t.name}`")
    t.q(f"CREATE TABLE `{t.name}` (id BIGINT PRIMARY KEY, email VARCHAR(100) NOT NULL, v VARCHAR(100), "
        "UNIQUE KEY email_u (email)) ENGINE=InnoDB")
    t.q(f"INSERT INTO `{t.name}` VALUES (1, 'a@x', 'old')")


# ---------------------------------------------------------------- 1. a second unique index, upsert
def test_upsert_on_a_table_with_a_second_unique_index_is_refused_at_open_not_silently_lost(mariadb_service):
    with MyTable(mariadb_service, "dbauniq") as t:
        _email_table(t)
        sink = t.sink(mode="upsert", key_columns=["id"])
        # Was: open() passed, the commit said 1 row, and the table held [(1, 'a@x', 'new')]: id 2 lost.
        with pytest.raises(ConfigurationError, match=r"another unique index, `email_u` on \(`email`\).*"
                                                     r"upsert by that index's columns, or drop it"):
            sink.open()
        assert t.q(f"SELECT id, email, v FROM `{t.name}` ORDER BY id") == [(1, "a@x", "old")]
        # Upserting by exactly the key an index has, and a unique index on a superset of the key, pass.
        t.q(f"ALTER TABLE `{t.name}` DROP INDEX email_u, ADD UNIQUE KEY id_email (id, email)")
        sink.open()
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)),
                        emails([(1, "a@x", "new"), (2, "b@x", "two")]))
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT id, email, v FROM `{t.name}` ORDER BY id") == [(1, "a@x", "new"), (2, "b@x", "two")]


def test_upsert_on_a_table_with_a_second_unique_index_is_refused_at_open_in_the_data_source_form(mariadb_service):
    from twophase.sinks.spark_jdbc import build

    s = mariadb_service
    with MyTable(mariadb_service, "dbauniqds") as t:
        _email_table(t)
        sink = build({"url": f"jdbc:mysql://{s['host']}:{s['port']}/{s['database']}", "dbtable": t.name,
                      "user": s["user"], "password": s["password"], "twophase.mode": "upsert",
                      "twophase.keycolumns": "id"})
        assert isinstance(sink, MySqlSink)
        with pytest.raises(ConfigurationError, match="another unique index, `email_u`"):
            sink.open()   # what format("twophase-jdbc")'s planner calls before a batch


def test_insert_mode_on_a_table_with_a_second_unique_index_fails_the_batch_on_a_duplicate(mariadb_service):
    with MyTable(mariadb_service, "dbauniqins") as t:
        _email_table(t)
        sink = t.sink()
        sink.open()   # insert mode: unchanged, the table is accepted
        with pytest.raises(MySqlWriteError, match="Duplicate entry 'a@x'"):
            run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)),
                        emails([(2, "a@x", "new")]))
        assert t.q(f"SELECT id, email, v FROM `{t.name}` ORDER BY id") == [(1, "a@x", "old")]
        assert t.prepared() == []


def test_upsert_writing_an_auto_increment_column_that_is_not_the_key_is_refused(mariadb_service):
    with MyTable(mariadb_service, "dbaauto") as t:
        t.q(f"DROP TABLE `{t.name}`")
        t.q(f"CREATE TABLE `{t.name}` (id BIGINT AUTO_INCREMENT PRIMARY KEY, ext VARCHAR(20) NOT NULL, "
            "v VARCHAR(100), UNIQUE KEY ext_u (ext)) ENGINE=InnoDB")
        t.q(f"INSERT INTO `{t.name}` (ext, v) VALUES ('e1', 'old')")
        sink = t.sink(mode="upsert", key_columns=["ext"])
        sink.open()   # the AUTO_INCREMENT primary key numbers new rows: no other key's row can match it
        intent = sink.plan_batch("q", 0, 1)
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent),
                        pa.record_batch({"ext": ["e1", "e2"], "v": ["new", "two"]}))
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        assert t.q(f"SELECT ext, v FROM `{t.name}` ORDER BY ext") == [("e1", "new"), ("e2", "two")]
        with pytest.raises(MySqlWriteError, match="'id' is AUTO_INCREMENT and not an upsert key"):
            run_attempt(sink, TransactionContext("q", 1, 0, 0, sink.plan_batch("q", 1, 1)),
                        pa.record_batch({"id": pa.array([1], pa.int64()), "ext": ["e3"], "v": ["x"]}))


@pytest.mark.postgres
def test_postgres_upsert_on_a_table_with_a_second_unique_index_fails_the_batch_and_loses_nothing(postgres_service):
    from twophase.errors import TwoPhaseError
    from twophase.sinks.postgres import PostgresSink

    with PgTable(postgres_service["dsn"], "dbauniqpg") as t:
        t.execute(f'DROP TABLE "{t.name}"')
        t.execute(f'CREATE TABLE "{t.name}" (id bigint PRIMARY KEY, email text NOT NULL UNIQUE, v text)')
        t.execute(f"INSERT INTO \"{t.name}\" VALUES (1, 'a@x', 'old')")
        sink = PostgresSink(t.dsn, table=t.name, marker_table=f"{t.name}_m", gid_prefix=t.gid_prefix,
                            mode="upsert", key_columns=["id"], lock_timeout="5s")
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        # ON CONFLICT (id) does not cover the email: the unique violation fails the write, naming it.
        with pytest.raises(TwoPhaseError, match="email"):
            run_attempt(sink, TransactionContext("q", 0, 0, 0, intent), emails([(2, "a@x", "new")]))
        assert t.execute(f'SELECT id, email, v FROM "{t.name}" ORDER BY id') == [(1, "a@x", "old")]
        assert t.prepared() == []


# ---------------------------------------------------------------- 2. the prune, by key and by evidence
@pytest.mark.alone("wall-clock: asserts each of 6 MariaDB batches takes under 2 s")
def test_the_marker_prune_is_not_stalled_by_another_pipelines_prepared_branch_and_prunes(mariadb_service, tmp_path):
    with MyTable(mariadb_service, "prunefast") as t, MyTable(mariadb_service, "pruneother") as other:
        # Another pipeline shares the marker table; its branch is prepared (its marker row uncommitted).
        o = _sink(mariadb_service, other.name, marker_table=t.markers, gid_prefix=other.prefix)
        o.open()
        held = run_attempt(o, TransactionContext("other", 0, 0, 0, o.plan_batch("other", 0, 1)), ids(900))
        sink = t.sink(marker_retention_batches=1)
        d = Driver(sink, str(tmp_path / "log"), "prunefast")
        try:
            took = []
            for b in range(1, 7):
                t0 = time.monotonic()
                d.batch(b, ids(b))
                took.append(time.monotonic() - t0)
            batches = [r[0] for r in t.q(f"SELECT batch_id FROM `{t.markers}` WHERE query_name = %s "
                                         "ORDER BY batch_id", (d.query_name,))]
        finally:
            d.close()
        # Was: batches 3 and 5 took 5.2 s (1205 on the other pipeline's marker row) and markers stayed.
        assert max(took) < 2.0, took
        assert batches == [5, 6], batches   # below 6 - retention: pruned
        assert t.ids() == [1, 2, 3, 4, 5, 6]
        assert other.prepared() == [(held["gtrid"], held["bqual"])]


def test_a_backfills_markers_decided_and_committed_but_not_committed_in_the_log_survive_another_runs_prune(
        mariadb_service, tmp_path):
    log_url = str(tmp_path / "log")
    with MyTable(mariadb_service, "prunebackfill") as t:
        qid = batch_query_id("daily", t.sink().target())
        y = Driver(t.sink(), log_url, qid, takeover=True)
        # X, a backfill of batch 5, takes the log over, decides and commits its branch, and dies before COMMITTED.
        x = Driver(t.sink(), log_url, qid, takeover=True)
        assert x.query_name == y.query_name
        opened = x.protocol.open_ballot(5, lambda planned: 1, BatchProgress("pipe", 5, None, "committed"))
        assert opened is not None
        results = OneTask(x.sink, ids(50, 51)).prepare(opened.query_name, 5, opened.intent, opened.run)
        x.protocol.check_prepared(opened, results, started_at=0)
        assert x.tlog.mine(x.tlog.decide(5, opened.number, {"handles": [r["handle"] for r in results],
                                                            "rows": 2, "partitions": [0]}))
        assert x.sink.commit(x.sink.decode_handle(results[0]["handle"])).outcome is CommitOutcome.COMMITTED
        # Y, a run of batch 200, cleans up as the protocol has it clean up (with the log's evidence).
        protocol_abort_lingering(y.sink, y.query_name, 200, {}, [], Settled(y.tlog))
        assert t.q(f"SELECT batch_id FROM `{t.markers}`") == [(5,)]   # was: [] (pruned by distance)
        z = Driver(t.sink(), log_url, qid, takeover=True)
        try:
            # Was: judged never visible, voided, written again: Duplicate entry '50' on every run.
            assert z.batch(5, ids(50, 51)).action == "recommitted"
        finally:
            for d in (x, y, z):
                d.close()
        assert t.ids() == [50, 51]


# ---------------------------------------------------------------- 3. a key in two partitions of one batch
def test_a_key_in_two_partitions_of_one_batch_fails_with_an_error_naming_the_batchs_branch_and_the_remedy(
        mariadb_service):
    with MyTable(mariadb_service, "twoparts") as t:
        sink = t.sink(mode="upsert", key_columns=["id"], lock_wait_timeout=1)
        sink.open()
        intent = sink.plan_batch("q", 0, 2)
        h0 = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent, "r", task_attempt_id=1), kv([1, 2], "p0"))
        with pytest.raises(MySqlWriteError) as e:
            run_attempt(sink, TransactionContext("q", 0, 1, 0, intent, "r", task_attempt_id=2), kv([2, 3], "p1"))
        msg = str(e.value)
        # Was: "Lock wait timeout exceeded; try restarting transaction [error 1205]" and nothing more.
        assert "1205" in msg and f"`{t.name}`" in msg
        assert f"prepared XA branch of this same batch holds rows of table `{t.name}`: partition 0 ({h0['gtrid']}/" in msg
        assert "repartition the DataFrame by the key columns (id)" in msg
        assert t.prepared() == [(h0["gtrid"], h0["bqual"])]


# ---------------------------------------------------------------- 4. the handle names its marker table
def test_recovery_with_a_sink_whose_marker_table_differs_is_refused_naming_both(mariadb_service):
    with MyTable(mariadb_service, "markname") as t:
        sink = t.sink()
        sink.open()
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1)), ids(1, 2))
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        # A hand-written recovery config (twophase recover --sink-config) with another marker table.
        other = _sink(mariadb_service, t.name, marker_table=f"{t.name}_other", gid_prefix=t.prefix)
        try:
            other.open()
            # Was: XA COMMIT 1397, no marker in the other table: "never visible", voided and written again.
            with pytest.raises(ConfigurationError, match=f"marker table '{t.markers}' but this sink reads marker "
                                                         f"table '{t.name}_other'"):
                other.commit(h)
            # A handle of before the field is judged by the sink's marker table, as before.
            assert h["marker_table"] == t.markers
            old = {k: v for k, v in h.items() if k != "marker_table"}
            assert sink.commit(old).outcome is CommitOutcome.ALREADY_COMMITTED
        finally:
            t.q(f"DROP TABLE IF EXISTS `{t.name}_other`, `{t.name}_other_claims`")
        assert t.ids() == [1, 2]


# ---------------------------------------------------------------- 5. KILL only the connection that prepared
def _prepare_and_linger(sink: MySqlSink, ctx: TransactionContext, batch: pa.RecordBatch) -> tuple[dict, Any]:
    import twophase.sinks.mysql.writer as my  # pre_commit's module

    txn = sink.begin_transaction(ctx)
    sink.write(txn, batch)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(my, "_close_quietly", lambda c: None)
        h = sink.pre_commit(txn)
    assert txn.conn.open
    return h, txn.conn


def _alive(conn: Any) -> bool:
    try:
        conn.ping(reconnect=False)
        return True
    except Exception:  # noqa: BLE001 - killed
        return False


@pytest.fixture
def killer(mariadb_service):
    """A second account on the server, ``(user, password)``, that may see and KILL any connection (PROCESS,
    CONNECTION ADMIN) and write the test database: a sink of that user could kill another user's connection."""
    import pymysql

    s = mariadb_service
    user, pw = f"tpk{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    root = pymysql.connect(unix_socket=s["socket"], user="root", autocommit=True)
    with root.cursor() as cur:
        for host in ("%", "localhost"):
            cur.execute("CREATE USER %s@%s IDENTIFIED BY %s", (user, host, pw))
            cur.execute(f"GRANT ALL PRIVILEGES ON `{s['database']}`.* TO %s@%s", (user, host))
            cur.execute("GRANT CONNECTION ADMIN, PROCESS ON *.* TO %s@%s", (user, host))
    try:
        yield user, pw
    finally:
        with root.cursor() as cur:
            for host in ("%", "localhost"):
                cur.execute("DROP USER IF EXISTS %s@%s", (user, host))
        root.close()


def _connection(s: dict, user: str, password: str) -> Any:
    import pymysql

    return pymysql.connect(host=s["host"], port=s["port"], user=user, password=password, database=s["database"])


def _session(conn: Any) -> int:
    with conn.cursor() as cur:
        cur.execute("SELECT CONNECTION_ID()")
        return int(cur.fetchone()[0])


def _lingering(t: MyTable, sink: MySqlSink, batch_id: int) -> tuple[dict, Any]:
    sink.open()
    return _prepare_and_linger(sink, TransactionContext("q", batch_id, 0, 0, sink.plan_batch("q", batch_id, 1)),
                               ids(batch_id))


def test_a_commit_never_kills_another_users_connection_with_the_handles_session_id(
        mariadb_service, killer, monkeypatch):
    from twophase.sinks.mysql import branches, committer

    # The commit's wait (_commit_detached) and a rollback's (_rollback_one), as before the split.
    monkeypatch.setattr(committer, "DETACH_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(branches, "DETACH_WAIT_SECONDS", 1.0)
    s = mariadb_service
    with MyTable(mariadb_service, "killuser") as t:
        user, pw = killer
        # A sink whose user may KILL any connection.
        sink = _sink(mariadb_service, t.name, user=user, password=pw, marker_table=t.markers, gid_prefix=t.prefix)
        h, held = _lingering(t, sink, 0)
        bystander = _connection(s, s["user"], s["password"])   # another user's connection
        try:
            # The id is the other user's connection (ids restart with the server); the handle says so too.
            for forged in ({"session_user": user}, {"session_user": s["user"]}):
                r = sink.commit({**h, "session": _session(bystander), **forged})
                assert r.outcome is CommitOutcome.RETRY_LATER, r
                assert _alive(bystander)   # was (no user condition): killed
            # A connection of the sink's user, but the handle's branch was prepared by another user's
            # session (executors configured with another account): not the handle's connection either.
            own = _connection(s, user, pw)
            try:
                r = sink.commit({**h, "session": _session(own), "session_user": s["user"]})
                assert r.outcome is CommitOutcome.RETRY_LATER, r
                assert _alive(own)
            finally:
                own.close()
            assert sink.commit(h).outcome is CommitOutcome.COMMITTED   # its own session: killed, committed
            assert not _alive(held)
        finally:
            bystander.close()
            held.close()
        assert t.ids() == [0]


def test_a_commit_never_kills_a_connection_of_the_same_user_made_after_the_branch_began(
        mariadb_service, monkeypatch):
    from twophase.sinks.mysql import branches, committer

    # The commit's wait (_commit_detached) and a rollback's (_rollback_one), as before the split.
    monkeypatch.setattr(committer, "DETACH_WAIT_SECONDS", 1.0)
    monkeypatch.setattr(branches, "DETACH_WAIT_SECONDS", 1.0)
    s = mariadb_service
    with MyTable(mariadb_service, "killtime") as t:
        sink = t.sink()
        h, held = _lingering(t, sink, 0)
        later = _connection(s, s["user"], s["password"])   # the same user's, connected after
        try:
            with later.cursor() as cur:
                cur.execute("SHOW GLOBAL STATUS LIKE 'Uptime'")
                up = float(cur.fetchone()[1])
                cur.execute("SELECT UNIX_TIMESTAMP(NOW(6))")
                boot = float(cur.fetchone()[0]) - up
            # After a restart the ids start again: the handle's session id is now `later`'s, a connection
            # made after the handle's branch began (which began before this server run started).
            r = sink.commit({**h, "session": _session(later), "session_at": boot - 60})
            assert r.outcome is CommitOutcome.RETRY_LATER, r
            assert _alive(later)   # was (id and user only): killed
            # A handle without the connection's user and start (written before them): no KILL either.
            old = {k: v for k, v in h.items() if k not in ("session_user", "session_at")}
            assert sink.commit(old).outcome is CommitOutcome.RETRY_LATER
            assert _alive(held)
            assert sink.commit(h).outcome is CommitOutcome.COMMITTED
        finally:
            later.close()
            held.close()
        assert t.ids() == [0]


# ---------------------------------------------------------------- 6. claims of listed branches are kept
def test_another_sinks_cleanups_never_roll_back_a_decided_batchs_second_branch(mariadb_service):
    with MyTable(mariadb_service, "dropclaims") as t:
        x = t.sink()
        x.open()
        intent = x.plan_batch("q", 5, 2)
        hs = [run_attempt(x, TransactionContext("q", 5, p, 0, intent, "x", task_attempt_id=p + 1), ids(50 + p))
              for p in (0, 1)]
        x.verify_prepared(5, hs, prepare_started_at=0)   # claimed decided; the decision is logged
        assert x.commit(hs[0]).outcome is CommitOutcome.COMMITTED
        # Another run (another sink object) cleans up after batches 11 and 12: its branch of batch 5 is
        # still listed, so its decided claim must stay (the mutant dropped it; the next cleanup then
        # claimed the branch doomed and rolled it back: half the batch).
        y = t.sink()
        y.abort_lingering("q", 11, {}, [])
        y.abort_lingering("q", 12, {}, [])
        y.sweep_late("q", 13)
        r = Committer(x, backoff=0.01).commit(5, [hs[1]], recovering=False)
        assert t.ids() == [50, 51], r
        assert t.prepared() == []
