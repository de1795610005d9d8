"""MySqlSink against the real MariaDB server (tests/services/mariadb.py, 127.0.0.1:13306).

Covers: rows invisible until XA COMMIT and listed by XA RECOVER meanwhile, a repeated commit
recognised by the marker row, a branch rolled back by someone else reported lost (never visible),
abort of open and prepared branches, cleanup of a ballot's leftovers and of a late attempt's branch
of an earlier batch (whose row locks block the next batch until swept), upsert, the 64-byte gtrid
limit, secrets kept out of configs, handles, logs and errors, and Spark's JDBC options.
"""

from __future__ import annotations

import json
import logging
import uuid

import pyarrow as pa
import pytest

from twophase import ConfigurationError, TransactionContext
from twophase.config import sink_from_config
from twophase.sink import CommitOutcome
from twophase.sinks.mysql import MySqlSink, MySqlWriteError, sink_from_jdbc_options

pytestmark = [pytest.mark.mysql, pytest.mark.timeout(300)]


def _uid() -> str:
    return uuid.uuid4().hex[:8]


def q(db, query, params=None):
    with db.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall()


def xa_recover(db, prefix: str) -> list[tuple[str, str]]:
    out = []
    for _f, glen, blen, data in q(db, "XA RECOVER"):
        g, b = data[:glen].decode(), data[glen:glen + blen].decode()
        if g.startswith(prefix):
            out.append((g, b))
    return sorted(out)


@pytest.fixture
def env(mariadb_service, mdb):
    """A fresh table ``t_<uid>`` (id BIGINT PRIMARY KEY, v TEXT), a sink factory on it, and cleanup of
    its branches and tables."""
    uid = _uid()
    s = mariadb_service
    tbl, markers, prefix = f"t_{uid}", f"m_{uid}", f"tm{uid}"
    q(mdb, f"CREATE TABLE `{tbl}` (id BIGINT PRIMARY KEY, v VARCHAR(100)) ENGINE=InnoDB")

    def make(**kw) -> MySqlSink:
        kw.setdefault("gid_prefix", prefix)
        kw.setdefault("marker_table", markers)
        kw.setdefault("password", s["password"])
        kw.setdefault("user", s["user"])
        return MySqlSink(s["host"], s["port"], s["database"], kw.pop("table", tbl), **kw)

    sink = make()
    sink.open()
    yield {"db": mdb, "table": tbl, "markers": markers, "prefix": prefix, "make": make, "sink": sink}
    for g, b in xa_recover(mdb, prefix + ":"):
        q(mdb, "XA ROLLBACK %s, %s", (g, b))
    q(mdb, f"DROP TABLE IF EXISTS `{tbl}`, `{markers}`, `{markers}_claims`")


def batch(ids, vs=None) -> pa.RecordBatch:
    vs = vs if vs is not None else [f"v{i}" for i in ids]
    return pa.record_batch({"id": pa.array(ids, pa.int64()), "v": pa.array(vs, pa.string())})


def prepare(sink, name, batch_id, parts, attempt=0, intent=None, task_attempt_id=-1):
    intent = intent if intent is not None else sink.plan_batch(name, batch_id, len(parts))
    handles = []
    for pid, batches in enumerate(parts):
        txn = sink.begin_transaction(TransactionContext(name, batch_id, pid, attempt, intent,
                                                        task_attempt_id=task_attempt_id))
        for b in batches:
            sink.write(txn, b)
        handles.append(sink.pre_commit(txn))
    return intent, handles


def rows(env) -> list[tuple]:
    return sorted(q(env["db"], f"SELECT id, v FROM `{env['table']}`"))


# ------------------------------------------------------------------------------ tests
def test_invisible_until_xa_commit_then_visible_once(env):
    sink = env["sink"]
    _, handles = prepare(sink, "q", 0, [[batch([1, 2])], [batch([3]), batch([4, 5])]])
    assert rows(env) == []
    assert [(h["gtrid"], h["bqual"]) for h in handles] == xa_recover(env["db"], env["prefix"] + ":")
    assert [h["rows"] for h in handles] == [2, 3]
    for h in handles:
        assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    assert [r[0] for r in rows(env)] == [1, 2, 3, 4, 5]
    assert xa_recover(env["db"], env["prefix"] + ":") == []
    markers = q(env["db"], f"SELECT gtrid, bqual, batch_id, partition_id, row_count FROM `{env['markers']}` "
                           "ORDER BY partition_id")
    assert [(m[0].decode(), m[1].decode(), m[2], m[3], m[4]) for m in markers] == \
        [(h["gtrid"], h["bqual"], 0, h["partition"], h["rows"]) for h in handles]


def test_repeated_commit_is_recognised_by_the_marker(env):
    sink = env["sink"]
    _, (h,) = prepare(sink, "q", 0, [[batch([1, 2, 3])]])
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    again = env["make"]().commit(h)  # a rebuilt sink, as after a driver restart
    assert again.outcome is CommitOutcome.ALREADY_COMMITTED, again
    assert len(rows(env)) == 3


def test_branch_rolled_back_by_someone_else_is_lost_and_never_visible(env):
    sink = env["sink"]
    _, (h,) = prepare(sink, "q", 0, [[batch([1, 2])]])
    q(env["db"], "XA ROLLBACK %s, %s", (h["gtrid"], h["bqual"]))
    r = sink.commit(h)
    assert r.outcome is CommitOutcome.LOST and r.never_visible, r
    assert rows(env) == []


def test_verify_prepared_refuses_a_gone_branch(env):
    sink = env["sink"]
    _, handles = prepare(sink, "q", 0, [[batch([1])], [batch([2])]])
    sink.verify_prepared(0, handles, prepare_started_at=0)
    q(env["db"], "XA ROLLBACK %s, %s", (handles[1]["gtrid"], handles[1]["bqual"]))
    with pytest.raises(Exception, match="no longer exist"):
        sink.verify_prepared(0, handles, prepare_started_at=0)


def test_abort_open_and_prepared_branches(env):
    sink = env["sink"]
    intent = sink.plan_batch("q", 0, 2)
    open_txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
    sink.write(open_txn, batch([1]))
    sink.abort(open_txn)
    sink.abort(open_txn)  # idempotent
    done = sink.begin_transaction(TransactionContext("q", 0, 1, 0, intent))
    sink.write(done, batch([2]))
    sink.pre_commit(done)
    assert len(xa_recover(env["db"], env["prefix"] + ":")) == 1
    sink.abort(done)
    assert xa_recover(env["db"], env["prefix"] + ":") == []
    assert rows(env) == []


def test_abort_lingering_rolls_back_the_ballot_except_keep_and_leaves_others(env):
    sink = env["sink"]
    intent, handles = prepare(sink, "q", 3, [[batch([1])], [batch([2])]])
    _, (retry,) = prepare(sink, "q", 3, [[batch([10])]], attempt=1, intent=intent)  # a failed attempt's
    _, (later,) = prepare(sink, "q", 4, [[batch([20])]])  # a later batch: never touched
    _, (other,) = prepare(sink, "other", 1, [[batch([30])]])  # another query: never touched
    n = sink.abort_lingering("q", 3, intent, keep=[handles[0]])
    left = xa_recover(env["db"], env["prefix"] + ":")
    assert n == 2
    assert left == sorted((h["gtrid"], h["bqual"]) for h in (handles[0], later, other))
    assert retry["gtrid"] == handles[0]["gtrid"] and retry["bqual"] != handles[0]["bqual"]


def test_late_attempts_branch_of_an_earlier_batch_is_swept_and_its_locks_released(env):
    sink = env["make"](mode="upsert", key_columns=["id"], lock_wait_timeout=1)
    sink.open()
    # Batch 0 committed; then a late attempt of batch 0 prepares a branch on key 1 after its cleanup.
    _, (h0,) = prepare(sink, "q", 0, [[batch([1], ["a"])]])
    assert sink.commit(h0).done
    _, (late,) = prepare(sink, "q", 0, [[batch([1], ["late"])]], attempt=1)
    # Batch 1 needs key 1's row lock: it waits lock_wait_timeout and fails.
    intent = sink.plan_batch("q", 1, 1)
    txn = sink.begin_transaction(TransactionContext("q", 1, 0, 0, intent))
    with pytest.raises(MySqlWriteError, match="1205"):
        sink.write(txn, batch([1], ["b"]))
    sink.abort(txn)
    # The sweep rolls the late branch back (and nothing of batch 1's or a later batch's).
    _, (later,) = prepare(sink, "q", 2, [[batch([7])]])
    assert sink.sweep_late("q", 1) == 1
    assert xa_recover(env["db"], env["prefix"] + ":") == [(later["gtrid"], later["bqual"])]
    _, (h1,) = prepare(sink, "q", 1, [[batch([1], ["b"])]])
    assert sink.commit(h1).done
    assert rows(env) == [(1, "b")]
    assert sink.commit(late).outcome is CommitOutcome.LOST  # never visible


def test_upsert_last_row_of_a_key_wins_and_updates_existing_rows(env):
    sink = env["make"](mode="upsert", key_columns=["id"])
    sink.open()
    _, (h,) = prepare(sink, "q", 0, [[batch([1, 2, 1], ["a", "b", "c"])]])
    assert sink.commit(h).done
    assert rows(env) == [(1, "c"), (2, "b")]
    _, (h,) = prepare(sink, "q", 1, [[batch([2, 3], ["B", "C"])]])
    assert sink.commit(h).done
    assert sink.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED
    assert rows(env) == [(1, "c"), (2, "B"), (3, "C")]


def test_upsert_needs_a_unique_index_on_the_keys(env):
    with pytest.raises(ConfigurationError, match="UNIQUE index on exactly"):
        env["make"](mode="upsert", key_columns=["v"]).open()


def test_gtrid_longer_than_64_bytes_is_refused_by_name(env):
    sink = env["make"](gid_prefix="p" * 50)
    with pytest.raises(ConfigurationError, match="gtrid .* is [0-9]+ bytes; MySQL and MariaDB allow at most 64"):
        sink.plan_batch("q", 12345, 100)
    # A long query name goes in as a digest: the gtrid stays within 64 bytes.
    intent = env["sink"].plan_batch("a_very_long_query_name_" * 4, 2 ** 40, 10_000)
    assert len(env["sink"].make_xid(intent["gid_prefix"], 9999, 9999, "r" * 16,
                                    task_attempt_id=2 ** 63 - 1)[0].encode()) <= 64


@pytest.fixture
def own_user(mariadb_service):
    """A user of its own whose password is like no other string in play (as root, by the socket)."""
    import pymysql

    user, pw = f"u{_uid()}", "Zq7-pw-" + _uid()
    root = pymysql.connect(unix_socket=mariadb_service["socket"], user="root", autocommit=True)
    q(root, "CREATE USER %s@'127.0.0.1' IDENTIFIED BY %s", (user, pw))
    q(root, f"GRANT ALL PRIVILEGES ON `{mariadb_service['database']}`.* TO %s@'127.0.0.1'", (user,))
    yield user, pw
    q(root, "DROP USER %s@'127.0.0.1'", (user,))
    root.close()


def test_password_never_in_handle_config_log_or_error(env, mariadb_service, own_user, caplog, monkeypatch):
    s = mariadb_service
    user, pw = own_user
    caplog.set_level(logging.DEBUG)
    # Wrong password: the error names the server, never the password.
    wrong = pw + "-wrong"
    bad = MySqlSink(s["host"], s["port"], s["database"], env["table"], user=user, password=wrong)
    with pytest.raises(ConfigurationError) as ei:
        bad.open()
    assert "Access denied" in str(ei.value) and pw not in str(ei.value)
    # The right password inline: not in repr, config, handle, log, nor a write error.
    sink = env["make"](password=pw, user=user)
    _, (h,) = prepare(sink, "q", 0, [[batch([1])]])
    assert sink.commit(h).done
    sink.abort_lingering("q", 0, {}, keep=[h])
    intent = sink.plan_batch("q", 1, 1)
    txn = sink.begin_transaction(TransactionContext("q", 1, 0, 0, intent))
    with pytest.raises(MySqlWriteError) as we:
        sink.write(txn, batch([2], [pw * 10]))  # too long for VARCHAR(100): the server refuses the row
    sink.abort(txn)
    text = " ".join([repr(sink), json.dumps(sink.to_config()), json.dumps(h), sink.describe_handle(h),
                     str(we.value), caplog.text])
    assert user in text and pw not in text and "password" not in sink.to_config()
    # A password in a JDBC url is never quoted by a refusal of the url.
    with pytest.raises(ConfigurationError) as ei:
        sink_from_jdbc_options({"url": f"jdbc:mysql:/broken?password={pw}", "dbtable": "t"})
    assert pw not in str(ei.value)
    # By reference: the config keeps the reference and a rebuilt sink commits.
    monkeypatch.setenv("TWOPHASE_TEST_MYSQL_PW", pw)
    by_ref = env["make"](password={"env": "TWOPHASE_TEST_MYSQL_PW"}, user=user)
    rebuilt = sink_from_config(by_ref.to_config())
    assert rebuilt.to_config()["password"] == {"env": "TWOPHASE_TEST_MYSQL_PW"}
    _, (h2,) = prepare(by_ref, "q", 2, [[batch([3])]])
    assert rebuilt.commit(h2).done and len(rows(env)) == 2


def test_sink_from_spark_jdbc_options(env, mariadb_service):
    s = mariadb_service
    for scheme in ("mysql", "mariadb"):
        sink = sink_from_jdbc_options({"url": f"jdbc:{scheme}://{s['host']}:{s['port']}/{s['database']}?useSSL=false",
                                       "user": s["user"], "password": s["password"], "dbtable": env["table"]},
                                      gid_prefix=env["prefix"], marker_table=env["markers"])
        assert (sink.host, sink.port, sink.database, sink.table, sink.user) == \
            (s["host"], s["port"], s["database"], env["table"], s["user"])
        sink.open()
    sink = sink_from_jdbc_options({"url": f"jdbc:mysql://{s['host']}:{s['port']}/?user={s['user']}&password=x",
                                   "dbtable": f"{s['database']}.`a.b`"})
    assert (sink.database, sink.table, sink.user) == (s["database"], "a.b", s["user"])
    with pytest.raises(ConfigurationError, match="jdbc:mysql://"):
        sink_from_jdbc_options({"url": "jdbc:postgresql://h/db", "dbtable": "t"})


def test_identifiers_are_quoted_with_backticks(env, mariadb_service):
    name = f"we`ird; DROP TABLE x -- {_uid()}"
    q(env["db"], f"CREATE TABLE `{name.replace('`', '``')}` (`i``d` BIGINT PRIMARY KEY) ENGINE=InnoDB")
    try:
        sink = env["make"](table=name)
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
        sink.write(txn, pa.record_batch({"i`d": pa.array([5], pa.int64())}))
        assert sink.commit(sink.pre_commit(txn)).done
        assert q(env["db"], f"SELECT * FROM `{name.replace('`', '``')}`") == ((5,),)
    finally:
        q(env["db"], f"DROP TABLE IF EXISTS `{name.replace('`', '``')}`")


def test_a_pooled_connection_the_server_closed_does_not_fail_the_next_call(env):
    """Read-only review, F5: pooled driver connections were reused unchecked (PyMySQL's ``open``
    asks nothing of the server), so after a server restart or an idle connection past
    ``wait_timeout`` the next batch failed with a raw 2013.  Killed here as the server would."""
    sink = env["sink"]
    _, (h0,) = prepare(sink, "q", 0, [[batch([1])]])
    assert sink.commit(h0).outcome is CommitOutcome.COMMITTED
    assert sink._pool, "the commit left its connection in the pool"
    for c in list(sink._pool):
        q(env["db"], f"KILL CONNECTION {c.thread_id()}")
    _, (h1,) = prepare(sink, "q", 1, [[batch([2])]])
    assert sink.sweep_late("q", 1) == 0
    assert sink.commit(h1).outcome is CommitOutcome.COMMITTED
    assert [r[0] for r in rows(env)] == [1, 2]


def test_an_abort_of_a_branch_still_attached_to_its_session_is_not_taken_for_done(env, monkeypatch):
    """Read-only review, F2: MariaDB answers ``XA ROLLBACK`` with 1397 for a branch still attached
    to the session that prepared it (its disconnect not yet processed), which the sink took for
    "already gone": the abort was reported done and the branch stayed prepared (then committed).
    Now the abort is confirmed only by the branch's absence from ``XA RECOVER``."""
    import twophase.sinks.mysql.writer as my  # pre_commit's module

    sink = env["sink"]
    intent = sink.plan_batch("q", 0, 1)
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
    sink.write(txn, batch([7]))
    monkeypatch.setattr(my, "_close_quietly", lambda c: None)  # the executor's session not yet closed
    h = sink.pre_commit(txn)
    monkeypatch.undo()
    try:
        try:
            sink.recover_and_abort(h)
        except Exception as e:  # noqa: BLE001 - refused: the branch is still there
            assert "still attached" in str(e) or "XA ROLLBACK" in str(e), e
        else:
            # MariaDB took the rollback from another session after all: then it must be gone.
            assert xa_recover(env["db"], env["prefix"] + ":") == []
            return
        assert xa_recover(env["db"], env["prefix"] + ":") == [(h["gtrid"], h["bqual"])]
    finally:
        txn.conn.close()
    assert rows(env) == []


class _FakeCursor:
    """Answers as MySQL 8 does to a user without XA_RECOVER_ADMIN: XA RECOVER fails with 1401."""

    def __init__(self) -> None:
        self.last = ""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def execute(self, statement, args=None):
        import pymysql

        self.last = statement
        if statement.strip().upper() == "XA RECOVER":
            raise pymysql.err.OperationalError(1401, "XAER_RMERR: Fatal error occurred in the transaction "
                                                     "branch - check your data for consistency")

    def fetchone(self):
        # Everything else as a MySQL 8.0.36 server with the table in place (InnoDB) would answer.
        if "VERSION" in self.last:
            return ("8.0.36",)
        if "table_type" in self.last:
            return ("BASE TABLE",)
        if "engine" in self.last:
            return ("InnoDB",)
        return None

    def fetchall(self):
        return ()


class _FakeConn:
    open = True

    def cursor(self):
        return _FakeCursor()


def test_open_on_mysql8_without_xa_recover_admin_is_refused_naming_the_grant(monkeypatch):
    """Read-only review, F7 (unit test: MySQL 8 is not installable here; its real-server twin is
    test_open_on_mariadb_passes_xa_recover_of_other_sessions_branches).  Was: open() passed and the
    first batch failed with the raw 1401 of verify_prepared's XA RECOVER."""
    sink = MySqlSink("db.example", 3306, "shop", "orders", user="writer", password="pw")
    monkeypatch.setattr(sink, "_driver_conn", lambda: _FakeConn())
    monkeypatch.setattr(sink, "_release", lambda conn: None)
    with pytest.raises(ConfigurationError) as ei:
        sink.open()
    msg = str(ei.value)
    assert "GRANT XA_RECOVER_ADMIN ON *.* TO `writer`" in msg and "1401" in msg and "pw" not in msg


def test_open_on_mariadb_passes_xa_recover_of_other_sessions_branches(env):
    """The real-server twin of the 1401 test: on MariaDB the sink's user lists, by XA RECOVER, a
    branch another session (an executor's) prepared, and open() passes."""
    sink = env["sink"]
    intent = sink.plan_batch("q", 0, 1)
    txn = sink.begin_transaction(TransactionContext("q", 0, 0, 0, intent))
    sink.write(txn, batch([1]))
    h = sink.pre_commit(txn)
    fresh = env["make"]()
    fresh.open()
    assert (h["gtrid"], h["bqual"]) in fresh.prepared(env["prefix"] + ":")


@pytest.mark.parametrize("which", ["marker", "claims"])
def test_a_marker_or_claims_table_that_is_not_innodb_is_refused_by_open(env, which):
    """Read-only review, F8: a pre-existing MyISAM marker table took the marker row outside the XA
    branch (a rolled-back branch left its marker behind: "already committed" for a lost batch)."""
    markers = f"m_{_uid()}"
    name = markers if which == "marker" else f"{markers}_claims"
    q(env["db"], f"CREATE TABLE `{name}` (gtrid VARBINARY(64) NOT NULL, bqual VARBINARY(64) NOT NULL, "
                 "PRIMARY KEY (gtrid, bqual)) ENGINE=MyISAM")
    try:
        with pytest.raises(ConfigurationError, match=f"`{name}` uses engine MyISAM"):
            env["make"](marker_table=markers).open()
    finally:
        q(env["db"], f"DROP TABLE IF EXISTS `{markers}`, `{markers}_claims`")


@pytest.mark.parametrize("name", ["m%s", "m`x", "", "x" * 58, "a-b"])
def test_a_marker_table_name_that_statements_with_values_cannot_carry_is_refused(name):
    """The marker and claims tables' names are written into statements sent with values (a '%' would
    be read as a placeholder); their names are the sink's own choice, so only plain ones are taken."""
    with pytest.raises(ConfigurationError, match="marker_table must be 1-57 letters"):
        MySqlSink("127.0.0.1", 3306, "db", "t", user="u", marker_table=name)
    MySqlSink("127.0.0.1", 3306, "db", "t", user="u", marker_table="x" * 57)
