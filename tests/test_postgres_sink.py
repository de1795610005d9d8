"""PostgresSink against the real PostgreSQL server (tests/services/postgres.py, 127.0.0.1:15432).

Covers: COPY of every supported Arrow type, invisibility until COMMIT PREPARED, idempotent commit
resolved by the marker row, commit from another process after the writer was SIGKILLed, lost
transactions, lingering-transaction cleanup limited to the batch's gid prefix and this database,
start-up checks (max_prepared_transactions = 0 on a second throwaway cluster, missing table, role
without privileges, upsert without a unique index), secrets kept out of configs/handles/errors,
quoted identifiers and SQL-injection-shaped names, upsert semantics, bad input through the real
Coordinator + Spark, a server restart with transactions prepared, and marker pruning.
"""

from __future__ import annotations

import datetime as dt
import decimal
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pyarrow as pa
import pytest

from twophase import ConfigurationError, TransactionContext
from twophase.config import sink_from_config
from twophase.evidence import Committed
from twophase.sink import CommitOutcome
from twophase.sinks.postgres import PostgresSink, PostgresWriteError

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------- helpers
def _uid() -> str:
    return uuid.uuid4().hex[:8]


def q(db, query, params=None):
    with db.cursor() as cur:
        cur.execute(query, params)
        return cur.fetchall() if cur.description else None


def table(db, ddl_cols: str, name: str | None = None) -> str:
    name = name or f"t_{_uid()}"
    q(db, f'CREATE TABLE "{name}" ({ddl_cols})')
    return name


def prepared_gids(db, prefix: str) -> list[str]:
    return [r[0] for r in q(db, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                                "AND left(gid, length(%s)) = %s ORDER BY gid", (prefix, prefix))]


def prepare(sink: PostgresSink, name: str, batch_id: int, parts: list[list[pa.RecordBatch]],
            attempt: int = 0, intent: dict | None = None) -> tuple[dict, list[dict]]:
    """Executor side by hand: one transaction per entry of ``parts`` (a list of Arrow batches)."""
    intent = intent if intent is not None else sink.plan_batch(name, batch_id, len(parts))
    handles = []
    for pid, batches in enumerate(parts):
        txn = sink.begin_transaction(TransactionContext(name, batch_id, pid, attempt, intent))
        for b in batches:
            sink.write(txn, b)
        handles.append(sink.pre_commit(txn))
    return intent, handles


def ids_batch(ids, **extra) -> pa.RecordBatch:
    cols = {"id": pa.array(ids, pa.int64())}
    cols.update(extra)
    return pa.record_batch(cols)


# ------------------------------------------------------------------------ happy path
def test_types_round_trip_through_copy(db, postgres_service):
    t = table(db, "i int, b bigint, f float8, r real, n numeric(12,3), flag boolean, s text, "
                  "vc varchar(20), d date, ts timestamp, tstz timestamptz, tm time, by bytea, "
                  "arr int[], sarr text[], j jsonb, st jsonb, iv interval, id bigint")
    ts = dt.datetime(2024, 2, 29, 23, 59, 58, 123456)
    tricky = ['plain', '', None, 'tab\there', 'new\nline', 'quo"te, comma', '\\.', 'back\\slash', 'ünïcødé ✓']
    n = len(tricky)
    batch = pa.record_batch({
        "i": pa.array([1, -2, None, 2**31 - 1, 0, 5, 6, 7, 8], pa.int32()),
        "b": pa.array([2**62, None, 3, 4, 5, 6, 7, 8, 9], pa.int64()),
        "f": pa.array([1.5, float("nan"), float("inf"), float("-inf"), None, -0.0, 1e300, 2.5, 3.5]),
        "r": pa.array([1.25, None, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0], pa.float32()),
        "n": pa.array([decimal.Decimal("123456789.123"), None, decimal.Decimal("-0.001")] + [decimal.Decimal(1)] * 6,
                      pa.decimal128(12, 3)),
        "flag": pa.array([True, False, None, True, False, True, False, True, False]),
        "s": pa.array(tricky, pa.large_string()),
        "vc": pa.array(["x"] * n),
        "d": pa.array([dt.date(1, 1, 1), dt.date(9999, 12, 31), None] + [dt.date(2024, 1, 1)] * 6),
        "ts": pa.array([ts, None] + [ts] * 7, pa.timestamp("us")),
        "tstz": pa.array([ts, None] + [ts] * 7, pa.timestamp("us", tz="Europe/Paris")),
        "tm": pa.array([dt.time(12, 34, 56, 789000), None] + [dt.time(0)] * 7, pa.time64("us")),
        "by": pa.array([b"\x00\x01\xff", b"", None] + [b"ab"] * 6, pa.binary()),
        "arr": pa.array([[1, None, 3], [], None] + [[1]] * 6, pa.list_(pa.int32())),
        "sarr": pa.array([["a b", 'q"', "c,d", None], None] + [["x"]] * 7, pa.list_(pa.string())),
        "j": pa.array([[1, 2], None] + [[3]] * 7, pa.list_(pa.int64())),
        "st": pa.array([{"a": 1, "b": "x\ny"}, None] + [{"a": 2, "b": "z"}] * 7,
                       pa.struct([("a", pa.int64()), ("b", pa.string())])),
        "iv": pa.array([dt.timedelta(days=1, microseconds=5), None] + [dt.timedelta(0)] * 7,
                       pa.duration("us")),
        "id": pa.array(range(n), pa.int64()),
    })
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    _, handles = prepare(sink, f"types-{_uid()}", 0, [[batch]])
    assert sink.commit(handles[0]).outcome is CommitOutcome.COMMITTED
    rows = q(db, f'SELECT i, b, f, r, n, flag, s, vc, d, ts, tstz, tm, by, arr, sarr, j, st, iv '
                 f'FROM "{t}" ORDER BY id')
    assert len(rows) == n
    r0, r1, r2 = rows[0], rows[1], rows[2]
    assert r0[0:2] == (1, 2**62) and r1[1] is None and r2[0] is None
    assert r0[2] == 1.5 and r1[2] != r1[2] and r2[2] == float("inf") and rows[3][2] == float("-inf")
    assert rows[4][2] is None and rows[6][2] == 1e300
    assert r0[3] == 1.25 and r1[3] is None
    assert r0[4] == decimal.Decimal("123456789.123") and r1[4] is None and r2[4] == decimal.Decimal("-0.001")
    assert [r[5] for r in rows[:3]] == [True, False, None]
    assert [r[6] for r in rows] == tricky  # '' stays '', None stays NULL, '\.' is data
    assert r0[8] == dt.date(1, 1, 1) and r1[8] == dt.date(9999, 12, 31) and r2[8] is None
    # A tz-aware Arrow timestamp is an instant: timestamptz keeps it, naive columns get its UTC wall time.
    assert r0[10] == ts.replace(tzinfo=dt.UTC) and r1[10] is None
    assert r0[9] == ts
    assert r0[11] == dt.time(12, 34, 56, 789000)
    assert bytes(r0[12]) == b"\x00\x01\xff" and bytes(r1[12]) == b"" and r2[12] is None
    assert r0[13] == [1, None, 3] and r1[13] == [] and r2[13] is None
    assert r0[14] == ["a b", 'q"', "c,d", None] and r1[14] is None
    assert r0[15] == [1, 2] and r1[15] is None
    assert r0[16] == {"a": 1, "b": "x\ny"} and r1[16] is None
    assert r0[17] == dt.timedelta(days=1, microseconds=5) and r1[17] is None


def test_invisible_until_commit_then_idempotent(db, postgres_service):
    t = table(db, "id bigint, s text")
    name = f"vis-{_uid()}"
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    intent, handles = prepare(sink, name, 3, [[ids_batch([1, 2], s=["a", "b"])], [ids_batch([3], s=["c"])]])
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 0
    assert prepared_gids(db, intent["gid_prefix"]) == sorted(h["gid"] for h in handles)
    for h in handles:  # a handle is small, JSON, secret-free, names the gid and database
        assert set(h) >= {"gid", "database"} and "password" not in json.dumps(h)
        assert h["gid"].startswith(intent["gid_prefix"]) and len(h["gid"].encode()) < 200
    envelopes = [json.loads(json.dumps(sink.encode_handle(h))) for h in handles]
    assert [sink.commit(sink.decode_handle(e)).outcome for e in envelopes] == [CommitOutcome.COMMITTED] * 2
    assert sorted(r[0] for r in q(db, f'SELECT id FROM "{t}"')) == [1, 2, 3]
    again = [sink.commit(h) for h in handles]
    assert [r.outcome for r in again] == [CommitOutcome.ALREADY_COMMITTED] * 2
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 3
    assert prepared_gids(db, intent["gid_prefix"]) == []
    assert handles[0]["gid"] in sink.describe_handle(handles[0])


def test_commit_from_another_process_after_writer_sigkilled(db, postgres_service, tmp_path):
    t = table(db, "id bigint")
    name = f"kill-{_uid()}"
    script = textwrap.dedent(f"""
        import json, os, signal, sys
        import pyarrow as pa
        from twophase import TransactionContext
        from twophase.sinks.postgres import PostgresSink
        sink = PostgresSink({postgres_service['dsn']!r}, table={t!r})
        intent = sink.plan_batch({name!r}, 0, 1)
        txn = sink.begin_transaction(TransactionContext({name!r}, 0, 0, 0, intent))
        sink.write(txn, pa.record_batch({{"id": pa.array(range(100), pa.int64())}}))
        h = sink.pre_commit(txn)
        print(json.dumps(sink.encode_handle(h)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    envelope = json.loads(p.stdout.strip().splitlines()[-1])
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 0
    sink = PostgresSink(postgres_service["dsn"], table=t)
    assert sink.recover_and_commit(sink.decode_handle(envelope)).outcome is CommitOutcome.COMMITTED
    assert q(db, f'SELECT count(DISTINCT id), count(*) FROM "{t}"')[0] == (100, 100)


def test_rolled_back_elsewhere_is_lost_not_already_committed(db, postgres_service):
    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    _, (h,) = prepare(sink, f"lost-{_uid()}", 0, [[ids_batch([1])]])
    q(db, "ROLLBACK PREPARED %s", (h["gid"],))
    res = sink.commit(h)
    assert res.outcome is CommitOutcome.LOST
    assert h["gid"] in res.reason and "marker row is absent" in res.reason


def test_abort_lingering_only_this_batch_prefix_and_database(db, postgres_service):
    import psycopg2

    from tests.services.postgres import SERVICE

    t = table(db, "id bigint")
    name = f"ling-{_uid()}"
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    intent = sink.plan_batch(name, 5, 2)
    # A crashed attempt 0 (both partitions prepared), then attempt 1 of partition 0 (the one to keep).
    _, crashed = prepare(sink, name, 5, [[ids_batch([1])], [ids_batch([2])]], intent=intent)
    _, (kept,) = prepare(sink, name, 5, [[ids_batch([1])]], attempt=1, intent=intent)
    _, (other_batch,) = prepare(sink, name, 6, [[ids_batch([9])]])
    # The same gid prefix in another database must not be touched (pg_prepared_xacts lists all databases).
    other_db = "twophase_other"
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    with su.cursor() as cur:
        cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (other_db,))
        if not cur.fetchone():
            cur.execute(f'CREATE DATABASE "{other_db}" OWNER twophase')
    su.close()
    other = psycopg2.connect(postgres_service["dsn"].replace("dbname=twophase", f"dbname={other_db}"))
    foreign_gid = intent["gid_prefix"] + "0:7"
    other.tpc_begin(foreign_gid)
    other.cursor().execute("SELECT 1")
    other.tpc_prepare()
    other.close()
    try:
        n = sink.abort_lingering(name, 5, intent, [kept])
        assert n == 2
        assert prepared_gids(db, intent["gid_prefix"]) == [kept["gid"]]
        assert prepared_gids(db, other_batch["gid"]) == [other_batch["gid"]]
        assert foreign_gid in [r[0] for r in q(db, "SELECT gid FROM pg_prepared_xacts WHERE database = %s",
                                                (other_db,))]
        assert sink.abort_lingering(name, 5, intent, [kept]) == 0  # idempotent
        assert [sink.commit(h).outcome for h in crashed] == [CommitOutcome.LOST] * 2
        assert sink.commit(kept).outcome is CommitOutcome.COMMITTED
        assert q(db, f'SELECT id FROM "{t}"') == [(1,)]
    finally:
        sink.recover_and_abort(other_batch)
        other = psycopg2.connect(postgres_service["dsn"].replace("dbname=twophase", f"dbname={other_db}"))
        other.autocommit = True
        other.cursor().execute("ROLLBACK PREPARED %s", (foreign_gid,))
        other.close()


def test_commit_refuses_handle_of_another_database(db, postgres_service):
    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    _, (h,) = prepare(sink, f"db-{_uid()}", 0, [[ids_batch([1])]])
    try:
        with pytest.raises(ConfigurationError, match="prepared in database 'elsewhere'"):
            sink.commit(dict(h, database="elsewhere"))
    finally:
        sink.recover_and_abort(h)
    assert prepared_gids(db, h["gid"]) == []


# ------------------------------------------------------------------------- start-up
@pytest.fixture
def zero_prepared_cluster():
    """A throwaway PostgreSQL cluster with max_prepared_transactions = 0 (trust auth, port 35439)."""
    from tests.services.postgres import SERVICE

    bindir = SERVICE.bindir()
    user = SERVICE.os_user()
    root = f"/tmp/twophase-pg0-{_uid()}"
    os.makedirs(root)
    os.chown(root, user.pw_uid, user.pw_gid)
    kw = SERVICE._as_user()
    env = SERVICE._env()
    r = subprocess.run([str(bindir / "initdb"), "-D", f"{root}/data", "-U", "postgres", "--auth=trust",
                        "-E", "UTF8", "--locale=C"], capture_output=True, text=True, env=env, cwd="/", **kw)
    assert r.returncode == 0, r.stderr
    port = 35439
    proc = subprocess.Popen([str(bindir / "postgres"), "-D", f"{root}/data", "-p", str(port), "-k", root,
                             "-c", "listen_addresses=127.0.0.1", "-c", "max_prepared_transactions=0",
                             "-c", "shared_buffers=16MB", "-c", "fsync=off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd="/", **kw)
    import psycopg2

    dsn = f"host=127.0.0.1 port={port} dbname=postgres user=postgres"
    deadline = time.monotonic() + 60
    while True:
        try:
            psycopg2.connect(dsn, connect_timeout=2).close()
            break
        except psycopg2.OperationalError:
            assert time.monotonic() < deadline and proc.poll() is None, "throwaway cluster did not start"
            time.sleep(0.3)
    try:
        yield dsn
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)


def test_open_refuses_max_prepared_transactions_zero(zero_prepared_cluster):
    import psycopg2

    c = psycopg2.connect(zero_prepared_cluster)
    c.autocommit = True
    c.cursor().execute("CREATE TABLE t (id bigint)")
    c.close()
    with pytest.raises(ConfigurationError) as ei:
        PostgresSink(zero_prepared_cluster, table="t").open()
    msg = str(ei.value)
    assert "max_prepared_transactions = 0" in msg and "restart PostgreSQL" in msg
    assert "max_prepared_transactions in postgresql.conf" in msg


def test_open_checks_table_privileges_and_keys(db, postgres_service):
    from tests.services.postgres import SERVICE

    dsn = postgres_service["dsn"]
    PostgresSink(dsn, table=table(db, "id bigint")).open()  # the marker table exists from here on
    with pytest.raises(ConfigurationError, match='table "no_such_table_x" does not exist'):
        PostgresSink(dsn, table="no_such_table_x").open()
    t = table(db, "id bigint, v text")
    with pytest.raises(ConfigurationError, match="UNIQUE constraint or index on exactly"):
        PostgresSink(dsn, table=t, mode="upsert", key_columns=["id"]).open()
    with pytest.raises(ConfigurationError, match="not columns of"):
        PostgresSink(dsn, table=t, mode="upsert", key_columns=["nope"]).open()
    with pytest.raises(ConfigurationError, match="needs key_columns"):
        PostgresSink(dsn, table=t, mode="upsert")
    with pytest.raises(ConfigurationError, match="only apply to mode='upsert'"):
        PostgresSink(dsn, table=t, key_columns=["id"])
    # A role that may read but not write the table.
    role, pw = f"tp_ro_{_uid()}", f"pw-{uuid.uuid4().hex}"
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    try:
        with su.cursor() as cur:
            cur.execute(f"CREATE ROLE {role} LOGIN PASSWORD %s", (pw,))
        q(db, f'GRANT SELECT ON "{t}" TO {role}')
        q(db, f"GRANT SELECT, INSERT, DELETE ON twophase_commits TO {role}")
        ro_dsn = dsn.replace("user=twophase", f"user={role}").replace("password=twophase", f"password={pw}")
        with pytest.raises(ConfigurationError) as ei:
            PostgresSink(ro_dsn, table=t).open()
        assert f"lacks INSERT on \"{t}\"" in str(ei.value) and "GRANT INSERT" in str(ei.value)
        assert pw not in str(ei.value)
    finally:
        q(db, f'REVOKE ALL ON "{t}" FROM {role}')
        q(db, f"REVOKE ALL ON twophase_commits FROM {role}")
        with su.cursor() as cur:
            cur.execute(f"DROP ROLE {role}")
        su.close()


def test_two_roles_sharing_a_database_each_keep_their_marker_table_in_their_own_schema(db, postgres_service):
    """Several pipelines, one database: a role with a schema of its own (first on its search
    path) gets its marker table there, not the one another role made in public (which its
    search path also reaches and which it may not read)."""
    from tests.services.postgres import SERVICE

    dsn = postgres_service["dsn"]
    PostgresSink(dsn, table=table(db, "id bigint")).open()  # public.twophase_commits exists
    role, pw = f"tp_own_{_uid()}", f"pw-{uuid.uuid4().hex}"
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    own_dsn = dsn.replace("user=twophase", f"user={role}").replace("password=twophase", f"password={pw}")
    import psycopg2

    with su.cursor() as cur:
        cur.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD %s', (pw,))
    q(db, f'GRANT CREATE ON DATABASE twophase TO "{role}"')
    own = psycopg2.connect(own_dsn)
    own.autocommit = True
    try:
        q(own, f'CREATE SCHEMA "{role}"')
        q(own, f'CREATE TABLE "{role}".events (id bigint)')
        sink = PostgresSink(own_dsn, table="events")
        sink.open()
        qname = f"own{_uid()}"  # its own: the server's data outlives test runs and other tests
        _, handles = prepare(sink, qname, 0, [[ids_batch([1, 2])], [ids_batch([3])]])
        assert all(sink.commit(h).outcome is CommitOutcome.COMMITTED for h in handles)
        assert all(sink.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED for h in handles)
        assert q(own, f'SELECT count(*) FROM "{role}".twophase_commits') == [(2,)]
        assert q(own, f'SELECT sum(id) FROM "{role}".events') == [(6,)]
        assert q(own, f'SELECT count(*) FROM "{role}".twophase_commits WHERE query_name = %s', (qname,)) == [(2,)]
        assert q(db, "SELECT count(*) FROM twophase_commits WHERE query_name = %s", (qname,)) == [(0,)]
    finally:
        q(own, f'DROP SCHEMA "{role}" CASCADE')
        own.close()
        q(db, f'REVOKE CREATE ON DATABASE twophase FROM "{role}"')
        with su.cursor() as cur:
            cur.execute(f'DROP ROLE "{role}"')
        su.close()


def test_plan_batch_checks_gid_length_and_prepared_capacity(postgres_service, db):
    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t, gid_prefix="g" * 180)
    with pytest.raises(ConfigurationError) as ei:
        sink.plan_batch("query", 1, 2)
    assert "gid" in str(ei.value) and "bytes" in str(ei.value) and "gid_prefix" in str(ei.value)
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    with pytest.raises(ConfigurationError, match="max_prepared_transactions = 128"):
        sink.plan_batch("query", 1, 129)
    with pytest.raises(ConfigurationError, match="gid_prefix"):
        PostgresSink(postgres_service["dsn"], table=t, gid_prefix="a:b")


# -------------------------------------------------------------------------- secrets
def test_password_never_in_config_handles_repr_or_errors(db, postgres_service, monkeypatch):
    from tests.services.postgres import SERVICE

    role, pw = f"tp_leak_{_uid()}", f"S3cr3t-{uuid.uuid4().hex}"
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    t = table(db, "id bigint")
    try:
        with su.cursor() as cur:
            cur.execute(f"CREATE ROLE {role} LOGIN PASSWORD %s", (pw,))
        q(db, f'GRANT INSERT, SELECT ON "{t}" TO {role}')
        q(db, f"GRANT SELECT, INSERT, DELETE ON twophase_commits TO {role}")
        info = postgres_service
        dsns = [f"host={info['host']} port={info['port']} dbname={info['dbname']} user={role} password={pw}",
                f"postgresql://{role}:{pw}@{info['host']}:{info['port']}/{info['dbname']}"]
        seen: list[str] = []
        for dsn in dsns:
            sink = PostgresSink(dsn, table=t)
            sink.open()
            _, (h,) = prepare(sink, f"leak-{_uid()}", 0, [[ids_batch([1])]])
            seen += [repr(sink), json.dumps(sink.to_config()), json.dumps(sink.encode_handle(h)),
                     sink.describe_handle(h), json.dumps(sink.plan_batch("x", 0, 1))]
            assert sink.commit(h).done
            # Errors: a missing table, a wrong port (connection refused), a wrong password.
            for bad in (PostgresSink(dsn, table="missing_" + _uid()),
                        PostgresSink(dsn.replace(str(info["port"]), "35438"), table=t, connect_timeout=2)):
                with pytest.raises(ConfigurationError) as ei:
                    bad.open()
                seen.append(str(ei.value))
            import pickle

            seen.append(repr(pickle.loads(pickle.dumps(sink))))
        wrong = PostgresSink(dsns[0].replace(pw, pw + "x"), table=t)
        with pytest.raises(ConfigurationError, match="password authentication failed") as ei:
            wrong.open()
        seen.append(str(ei.value))
        for text in seen:
            assert pw not in text, text
        # Rebuilt from its config, with the password as an env reference (the operator-tool path).
        cfg = PostgresSink(dsns[0], table=t).to_config()
        assert "password" not in cfg and f"user={role}" in cfg["dsn"]
        monkeypatch.setenv("TP_TEST_PG_PW", pw)
        rebuilt = sink_from_config(json.dumps(dict(cfg, password={"env": "TP_TEST_PG_PW"})))
        assert rebuilt.to_config()["password"] == {"env": "TP_TEST_PG_PW"}
        writer = PostgresSink(dsns[1], table=t)
        _, (h,) = prepare(writer, f"cfg-{_uid()}", 0, [[ids_batch([2])]])
        assert rebuilt.recover_and_commit(rebuilt.decode_handle(writer.encode_handle(h))).outcome \
            is CommitOutcome.COMMITTED
        # Without any password the rebuilt sink uses libpq's environment (PGPASSWORD).
        monkeypatch.setenv("PGPASSWORD", pw)
        _, (h,) = prepare(writer, f"env-{_uid()}", 0, [[ids_batch([3])]])
        assert sink_from_config(cfg).commit(h).outcome is CommitOutcome.COMMITTED
        assert sorted(r[0] for r in q(db, f'SELECT id FROM "{t}"')) == [1, 1, 2, 3]
    finally:
        q(db, f'DROP TABLE "{t}"')
        q(db, f"REVOKE ALL ON twophase_commits FROM {role}")
        with su.cursor() as cur:
            cur.execute(f"DROP ROLE {role}")
        su.close()


# ---------------------------------------------------------------------- identifiers
def test_quoted_identifiers_and_injection_shaped_names(db, postgres_service):
    schema = f'my "schema" {_uid()}'
    tname = 'we"ird ta.ble'
    q(db, 'CREATE SCHEMA "{}"'.format(schema.replace('"', '""')))
    qs = '"{}"'.format(schema.replace('"', '""'))
    q(db, f'CREATE TABLE {qs}."we""ird ta.ble" ("the ""id""" bigint, "a b" text)')
    q(db, "CREATE TABLE IF NOT EXISTS victim (x int)")
    evil = f'x"; DROP TABLE victim; -- {_uid()}'
    q(db, 'CREATE TABLE "{}" ("id); DROP TABLE victim; --" bigint)'.format(evil.replace('"', '""')))
    try:
        sink = PostgresSink(postgres_service["dsn"], table=tname, schema=schema,
                            marker_table='mark "er"; DROP TABLE victim', marker_schema=schema)
        sink.open()
        _, hs = prepare(sink, f"quote-{_uid()}", 0, [[pa.record_batch({'the "id"': pa.array([1, 2], pa.int64()),
                                                                          "a b": ["x", "y"]})]])
        assert sink.commit(hs[0]).outcome is CommitOutcome.COMMITTED
        assert sink.commit(hs[0]).outcome is CommitOutcome.ALREADY_COMMITTED  # marker in the odd table
        assert q(db, f'SELECT "the ""id""", "a b" FROM {qs}."we""ird ta.ble" ORDER BY 1') == [(1, "x"), (2, "y")]
        evil_sink = PostgresSink(postgres_service["dsn"], table=evil)
        evil_sink.open()
        _, hs = prepare(evil_sink, f"evil-{_uid()}", 0,
                        [[pa.record_batch({"id); DROP TABLE victim; --": pa.array([7], pa.int64())})]])
        assert evil_sink.commit(hs[0]).done
        assert q(db, 'SELECT * FROM "{}"'.format(evil.replace('"', '""'))) == [(7,)]
        assert q(db, "SELECT to_regclass('victim') IS NOT NULL")[0][0] is True
    finally:
        q(db, f"DROP SCHEMA {qs} CASCADE")
        q(db, 'DROP TABLE IF EXISTS "{}"'.format(evil.replace('"', '""')))


# --------------------------------------------------------------------------- upsert
def test_upsert_last_row_wins_and_replays_are_idempotent(db, postgres_service):
    t = table(db, "k bigint PRIMARY KEY, v text, untouched text DEFAULT 'keep'")
    q(db, f'INSERT INTO "{t}" (k, v, untouched) VALUES (1, \'old\', \'mine\'), (50, \'other\', \'x\')')
    sink = PostgresSink(postgres_service["dsn"], table=t, mode="upsert", key_columns=["k"])
    sink.open()
    b1 = pa.record_batch({"k": pa.array([1, 2, 2, 3], pa.int64()), "v": ["a", "b1", "b2", "c"]})
    b2 = pa.record_batch({"k": pa.array([3, 4], pa.int64()), "v": ["c2", "d"]})
    name = f"up-{_uid()}"
    intent, (h,) = prepare(sink, name, 0, [[b1, b2]])
    assert q(db, f'SELECT v FROM "{t}" WHERE k = 1')[0][0] == "old"  # invisible until commit
    assert sink.commit(h).outcome is CommitOutcome.COMMITTED
    expected = {1: ("a", "mine"), 2: ("b2", "keep"), 3: ("c2", "keep"), 4: ("d", "keep"), 50: ("other", "x")}
    def table_now():
        return {k: (v, u) for k, v, u in q(db, f'SELECT k, v, untouched FROM "{t}"')}
    assert table_now() == expected
    assert sink.commit(h).outcome is CommitOutcome.ALREADY_COMMITTED
    # A replay of the same rows under a new attempt changes nothing.
    _, (h2,) = prepare(sink, name, 0, [[b1, b2]], attempt=1, intent=intent)
    assert sink.commit(h2).outcome is CommitOutcome.COMMITTED
    assert table_now() == expected
    # No staging table is left behind.
    assert q(db, "SELECT count(*) FROM pg_class WHERE relname LIKE 'twophase_stage_%%'")[0][0] == 0
    # Key-only upsert: DO NOTHING.
    t2 = table(db, "k bigint PRIMARY KEY")
    s2 = PostgresSink(postgres_service["dsn"], table=t2, mode="upsert", key_columns=["k"])
    s2.open()
    _, (h3,) = prepare(s2, name, 1, [[pa.record_batch({"k": pa.array([1, 1, 2], pa.int64())})]])
    assert s2.commit(h3).done
    assert sorted(r[0] for r in q(db, f'SELECT k FROM "{t2}"')) == [1, 2]


def test_upsert_with_a_null_key_is_refused_not_collapsed(db, postgres_service):
    """Key columns need not be NOT NULL; DISTINCT ON takes NULL keys as equal, keeping one row.

    The executor refuses the batch naming the column and the row; its abort leaves nothing
    visible and nothing prepared.
    """
    t = table(db, "k1 bigint, k2 text, v text, UNIQUE (k1, k2)")
    sink = PostgresSink(postgres_service["dsn"], table=t, mode="upsert", key_columns=["k1", "k2"])
    sink.open()
    name = f"nullkey-{_uid()}"
    intent = sink.plan_batch(name, 0, 1)
    ok = pa.record_batch({"k1": pa.array([1, 2], pa.int64()), "k2": ["a", "b"], "v": ["x", "y"]})
    bad = pa.record_batch({"k1": pa.array([3, 4, 5], pa.int64()),
                           "k2": pa.array(["c", None, None]).dictionary_encode(),
                           "v": ["p", "q", "r"]})
    txn = sink.begin_transaction(TransactionContext(name, 0, 0, 0, intent))
    try:
        with pytest.raises(PostgresWriteError) as ei:
            sink.write(txn, ok)
            sink.write(txn, bad)
            sink.pre_commit(txn)
    finally:
        sink.abort(txn)  # what the executor does when a write fails
    e = ei.value
    msg = str(e)
    assert e.column == "k2", msg
    assert "'k2'" in msg and "NULL" in msg and "k1=4" in msg, msg
    assert "row 4 of this partition" in msg, msg  # rows count across the partition's Arrow batches
    assert "batch 0 partition 0 attempt 0" in msg and txn.gid in msg
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 0
    assert prepared_gids(db, intent["gid_prefix"]) == []
    stage = sink._stage_name(txn.gid)
    assert q(db, "SELECT count(*) FROM pg_class WHERE relname = %s", (stage,))[0][0] == 0


# ----------------------------------------------------------------------- bad input
def test_bad_input_at_the_sink_names_column_and_constraint_and_rolls_back(db, postgres_service):
    t = table(db, "id bigint PRIMARY KEY, amount int NOT NULL CONSTRAINT amount_nonneg CHECK (amount >= 0)")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    name = f"badsink-{_uid()}"
    intent = sink.plan_batch(name, 4, 1)
    cases = [
        ({"id": [1, 2], "amount": [1, -1]}, None, "amount_nonneg", "23514"),
        ({"id": [1, 2], "amount": [1, None]}, "amount", None, "23502"),
        ({"id": [1, 1], "amount": [1, 1]}, None, f"{t}_pkey", "23505"),
        ({"id": [1, 2], "amount": ["1", "x"]}, "amount", None, "22P02"),
        ({"id": [1, 2], "amount": [1.5, 2.5]}, "amount", None, None),  # float into int: refused up front
        ({"id": [1, 2], "amount": [1, 2], "Amount": [1, 2]}, "Amount", None, None),
    ]
    for attempt, (data, column, constraint, sqlstate) in enumerate(cases):
        txn = sink.begin_transaction(TransactionContext(name, 4, 0, attempt, intent))
        with pytest.raises(PostgresWriteError) as ei:
            sink.write(txn, pa.record_batch({k: pa.array(v) for k, v in data.items()}))
            sink.pre_commit(txn)  # a deferred problem would show here, before the decision
        sink.abort(txn)
        e = ei.value
        assert (e.column, e.constraint, e.sqlstate) == (column, constraint, sqlstate), str(e)
        assert f"batch 4 partition 0 attempt {attempt}" in str(e) and txn.gid in str(e)
        assert "password" not in str(e)
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 0
    assert prepared_gids(db, intent["gid_prefix"]) == []
    assert q(db, "SELECT count(*) FROM twophase_commits WHERE query_name = %s", (name,))[0][0] == 0


def _coordinator(sink, tmp_path, name):
    from twophase.coordinator import Coordinator

    return Coordinator(sink, log_location=str(tmp_path / "log"), name=name)


def _assert_failed_cleanly(db, t, name, ei, *needles):
    msg = str(ei.value)
    for n in needles:
        assert n in msg, msg
    assert "batch 0" in msg and "password=" not in msg
    assert q(db, f'SELECT count(*) FROM "{t}"')[0][0] == 0
    assert prepared_gids(db, f"tp:{name}") == []


@pytest.mark.spark
def test_bad_input_fails_before_decision_naming_column_or_constraint(db, postgres_service, spark, tmp_path):
    from pyspark.sql import functions as F

    t = table(db, "id bigint PRIMARY KEY, amount int NOT NULL CONSTRAINT amount_nonneg CHECK (amount >= 0), "
                  "note text")
    dsn = postgres_service["dsn"]
    good = spark.range(0, 1000, numPartitions=2).select(F.col("id"), (F.col("id") % 7).cast("int").alias("amount"))
    cases = [
        ("check", good.withColumn("amount", F.when(F.col("id") == 977, -5).otherwise(F.col("amount"))),
         ["amount_nonneg", "23514"]),
        ("notnull", good.withColumn("amount", F.when(F.col("id") == 3, None).otherwise(F.col("amount"))),
         ["amount", "23502"]),
        ("unique", good.union(good.filter("id = 5")).coalesce(1), ["_pkey", "23505"]),
        ("text-to-int", good.withColumn("amount", F.when(F.col("id") == 8, "abc").otherwise(
            F.col("amount").cast("string"))), ["amount", "22P02"]),
        ("bool-to-int", good.withColumn("amount", F.col("amount") > 2), ["'amount'", "integer", "bool"]),
        ("extra-col", good.withColumn("nope", F.lit(1)), ["'nope'", "not a column"]),
        ("missing-col", good.select("id"), ["'amount'", "NOT NULL without a default"]),
    ]
    for label, df, needles in cases:
        df = df.coalesce(1)  # one transaction: see the two-partition test below for the other case
        name = f"bad-{label}-{_uid()}"
        coord = _coordinator(PostgresSink(dsn, table=t), tmp_path / label, name)
        with pytest.raises(Exception) as ei:
            coord.write(df, batch_id=0)
        _assert_failed_cleanly(db, t, name, ei, *needles)
        assert coord.log.state(0).state == "intent"  # never decided
    # After fixing the data the same batch id goes through, exactly once.
    name = f"fixed-{_uid()}"
    coord = _coordinator(PostgresSink(dsn, table=t), tmp_path / "fixed", name)
    with pytest.raises(Exception):  # noqa: B017 - the case's own error is asserted above
        coord.write(cases[0][1], batch_id=0)
    coord.write(good, batch_id=0)
    coord.write(good, batch_id=0)
    assert q(db, f'SELECT count(*), count(DISTINCT id) FROM "{t}"')[0] == (1000, 1000)
    assert prepared_gids(db, f"tp:{name}") == []


@pytest.mark.spark
def test_bad_row_in_one_partition_leaves_no_prepared_transaction(db, postgres_service, spark, tmp_path):
    from pyspark.sql import functions as F

    t = table(db, "id bigint PRIMARY KEY, amount int CONSTRAINT amount_nonneg CHECK (amount >= 0)")
    dsn = postgres_service["dsn"]
    good = spark.range(0, 1000, numPartitions=2).select("id", (F.col("id") % 7).cast("int").alias("amount"))
    bad = good.withColumn("amount", F.when(F.col("id") == 977, -5).otherwise(F.col("amount")))
    name = f"bad2-{_uid()}"
    coord = _coordinator(PostgresSink(dsn, table=t), tmp_path, name)
    with pytest.raises(Exception) as ei:
        coord.write(bad, batch_id=0)
    try:
        _assert_failed_cleanly(db, t, name, ei, "amount_nonneg")
    finally:
        # What works today: the replay of the batch rolls the leftover back before writing again.
        coord.write(good, batch_id=0)
        assert prepared_gids(db, f"tp:{name}") == []
        assert q(db, f'SELECT count(*), count(DISTINCT id) FROM "{t}"')[0] == (1000, 1000)


@pytest.mark.spark
def test_coordinator_end_to_end_exactly_once(db, postgres_service, spark, tmp_path):
    from pyspark.sql import functions as F

    t = table(db, "id bigint, name text, at timestamptz, amount numeric(10,2)")
    name = f"e2e-{_uid()}"
    coord = _coordinator(PostgresSink(postgres_service["dsn"], table=t), tmp_path, name)
    df = spark.range(0, 20000, numPartitions=2).select(
        "id", F.concat(F.lit("n\t"), F.col("id").cast("string")).alias("name"),
        F.timestamp_seconds(F.col("id")).alias("at"), (F.col("id") / 100).cast("decimal(10,2)").alias("amount"))
    p = coord.write(df, batch_id=0)
    assert p["rows"] == 20000 and p["handles"] == 2 and p["action"] == "committed"
    assert coord.write(df, batch_id=0)["action"] == "skipped"
    assert q(db, f'SELECT count(*), count(DISTINCT id), min(at), max(amount) FROM "{t}"')[0] == (
        20000, 20000, dt.datetime(1970, 1, 1, tzinfo=dt.UTC), decimal.Decimal("199.99"))
    qname = coord.sink_query_name
    assert qname.startswith(f"{name}.")  # the name plus the log's identity
    assert q(db, "SELECT count(*) FROM twophase_commits WHERE query_name = %s", (qname,))[0][0] == 2
    assert prepared_gids(db, f"tp:{name}") == []


# ------------------------------------------------------------------- server restart
@pytest.mark.alone("restarts the shared PostgreSQL server")
def test_server_restart_with_prepared_transactions(db, postgres_service):
    from tests.services.postgres import SERVICE

    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    name = f"restart-{_uid()}"
    _, handles = prepare(sink, name, 0, [[ids_batch(range(500))], [ids_batch(range(500, 1000))]])
    envelopes = [json.dumps(sink.encode_handle(h)) for h in handles]
    db.close()
    SERVICE.restart()
    # The sink's pooled connection died with the server; recovery must not care.
    results = [sink.recover_and_commit(sink.decode_handle(json.loads(e))) for e in envelopes]
    assert [r.outcome for r in results] == [CommitOutcome.COMMITTED] * 2
    import psycopg2

    c = psycopg2.connect(postgres_service["dsn"])
    with c.cursor() as cur:
        cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{t}"')
        assert cur.fetchone() == (1000, 1000)
    c.close()
    assert [sink.commit(h).outcome for h in handles] == [CommitOutcome.ALREADY_COMMITTED] * 2


# --------------------------------------------------------------------------- markers
def test_marker_rows_pruned_beyond_retention(db, postgres_service):
    t = table(db, "id bigint")
    name = f"prune-{_uid()}"
    sink = PostgresSink(postgres_service["dsn"], table=t, marker_retention_batches=2)
    sink.open()
    other = f"{name}-other"  # another query's old rows are not this query's to prune
    for n, b in ((name, 5), (name, 7), (name, 8), (name, 9), (other, 1)):
        _, (h,) = prepare(sink, n, b, [[ids_batch([b])]])
        assert sink.commit(h).done
    plan = sink.plan_batch(name, 10, 1)
    sink.abort_lingering(name, 10, plan, [])  # no evidence from the log: no marker goes (issue 59)
    assert [r[0] for r in q(db, "SELECT batch_id FROM twophase_commits WHERE query_name = %s ORDER BY 1",
                            (name,))] == [5, 7, 8, 9]
    # the log shows 5, 7, 8 and 9 committed: those below the retention (10 - 2) go
    sink.abort_lingering(name, 10, plan, [], settled=Committed(name, 5, 7, 8, 9))
    assert [r[0] for r in q(db, "SELECT batch_id FROM twophase_commits WHERE query_name = %s ORDER BY 1",
                            (name,))] == [8, 9]
    assert [r[0] for r in q(db, "SELECT batch_id FROM twophase_commits WHERE query_name = %s",
                            (other,))] == [1]
