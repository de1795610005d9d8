"""PostgresSink task retries against the real PostgreSQL server (issue 14, item 5).

A retried task attempt rolls back the transactions its own earlier attempts of the same
execution (``TransactionContext.run``) left prepared, and nothing else: not another run's,
not another partition's, not a gid without run (old logs), and only once it claimed it as
doomed in the claims table.  ``verify_prepared`` refuses a batch whose returned transaction
is gone (or doomed) before the decision.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid

import pyarrow as pa
import pytest

from tests.test_postgres_sink import _uid, ids_batch, prepared_gids, q, table
from twophase import ConfigurationError, TransactionContext, TwoPhaseError
from twophase.sink import CommitOutcome
from twophase.sinks.postgres import MAX_GID_BYTES, PostgresSink, PostgresWriteError

pytestmark = [pytest.mark.postgres, pytest.mark.timeout(300)]


@pytest.fixture
def prefixes(db):
    """Gid prefixes of the batches a test planned; a failing test's leftovers are rolled back."""
    planned: list[str] = []
    yield planned
    for prefix in planned:
        for gid in prepared_gids(db, prefix):
            q(db, "ROLLBACK PREPARED %s", (gid,))


def attempt(
    sink: PostgresSink,
    name: str,
    batch_id: int,
    intent: dict,
    partition: int,
    number: int,
    run: str,
    batch: pa.RecordBatch,
) -> dict:
    """One task attempt on the executor side, by hand: begin, write, pre_commit."""
    txn = sink.begin_transaction(TransactionContext(name, batch_id, partition, number, intent, run))
    sink.write(txn, batch)
    return sink.pre_commit(txn)


def test_retried_task_does_not_wait_on_its_own_earlier_attempt(db, postgres_service, prefixes):
    """Attempt 0 PREPAREs and its executor is lost; attempt 1 upserts the same keys.

    Before the fix attempt 1 waited on attempt 0's row locks for ``lock_timeout``, then
    failed with "fix the rows", and the job failed.
    """
    t = table(db, "k bigint PRIMARY KEY, v text")
    name = f"retry-{_uid()}"
    sink = PostgresSink(
        postgres_service["dsn"], table=t, mode="upsert", key_columns=["k"], lock_timeout="3s"
    )
    sink.open()
    intent = sink.plan_batch(name, 0, 2)
    prefixes.append(intent["gid_prefix"])
    run = "e1" + uuid.uuid4().hex[:6]

    def rows(v):
        return pa.record_batch({"k": pa.array([1, 2], pa.int64()), "v": [v, v]})

    other_partition = attempt(
        sink,
        name,
        0,
        intent,
        1,
        0,
        run,
        pa.record_batch({"k": pa.array([7], pa.int64()), "v": ["p1"]}),
    )
    lost = attempt(sink, name, 0, intent, 0, 0, run, rows("lost"))  # never reaches the driver
    retried = attempt(sink, name, 0, intent, 0, 1, run, rows("retried"))
    assert prepared_gids(db, intent["gid_prefix"]) == sorted(
        [other_partition["gid"], retried["gid"]]
    )
    assert [sink.commit(h).outcome for h in (other_partition, retried)] == [
        CommitOutcome.COMMITTED
    ] * 2
    assert q(db, f'SELECT k, v FROM "{t}" ORDER BY k') == [
        (1, "retried"),
        (2, "retried"),
        (7, "p1"),
    ]
    assert sink.commit(lost).outcome is CommitOutcome.LOST  # it was rolled back, never committed


def test_retry_rolls_back_only_earlier_attempts_of_its_own_run(db, postgres_service, prefixes):
    """Another run's gids (a racing coordinator may have them in its decision), other partitions,
    later attempts and gids without run (old logs) are left alone; the coordinator's
    abort_lingering (by the INTENT's prefix) still finds them all."""
    t = table(db, "id bigint")
    name = f"runs-{_uid()}"
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    intent = sink.plan_batch(name, 3, 2)
    prefixes.append(intent["gid_prefix"])
    mine, theirs, third = (
        "e2" + uuid.uuid4().hex[:6],
        "e3" + uuid.uuid4().hex[:6],
        "e4" + uuid.uuid4().hex[:6],
    )
    prefix = intent["gid_prefix"]

    def go(partition, number, run, i):
        return attempt(sink, name, 3, intent, partition, number, run, ids_batch([i]))

    earlier = [go(0, 0, mine, 1), go(0, 1, mine, 2)]
    keep = {
        "other run": go(0, 0, theirs, 3),
        "third run, lower attempt": go(0, 1, third, 4),
        "old log (no run)": go(0, 0, "", 5),
        "other partition": go(1, 0, mine, 6),
        "later attempt": go(0, 3, mine, 7),
    }
    assert keep["old log (no run)"]["gid"] == f"{prefix}0:0"  # without run: the gid of old logs
    assert earlier[0]["gid"] == f"{prefix}0:0:{mine}"
    current = go(0, 2, mine, 8)
    left = set(prepared_gids(db, prefix))
    assert left == {h["gid"] for h in keep.values()} | {current["gid"]}, left
    # A retry that does not know its run cannot tell executions apart: it rolls back nothing.
    go(0, 1, "", 9)
    assert keep["old log (no run)"]["gid"] in prepared_gids(db, prefix)
    # The old-format handle stays committable; the coordinator cleans up the rest by prefix.
    assert sink.commit(keep["old log (no run)"]).outcome is CommitOutcome.COMMITTED
    assert sink.commit(current).outcome is CommitOutcome.COMMITTED
    assert sink.abort_lingering(name, 3, intent, [keep["old log (no run)"], current]) == 5
    assert prepared_gids(db, prefix) == []
    assert sorted(r[0] for r in q(db, f'SELECT id FROM "{t}"')) == [5, 8]


def test_gid_with_run_stays_under_200_bytes(db, postgres_service, prefixes):
    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    name = f"len-{_uid()}"
    intent = sink.plan_batch(name, 0, 1)
    prefixes.append(intent["gid_prefix"])
    # A run that is long or not gid-safe is reduced to a short digest, the same for every attempt.
    for run in ("r" * 60, "a:b c/d"):
        h = attempt(sink, name, 0, intent, 0, 0, run, ids_batch([1]))
        assert (
            len(h["gid"].encode()) <= MAX_GID_BYTES
            and ":" not in h["gid"][len(intent["gid_prefix"]) :][4:]
        )
        h2 = attempt(sink, name, 0, intent, 0, 1, run, ids_batch([1]))
        assert prepared_gids(db, intent["gid_prefix"]) == [
            h2["gid"]
        ]  # same run: attempt 0 rolled back
        sink.recover_and_abort(h2)
    # plan_batch's worst case counts the run: a prefix that only fits without it is refused.
    base = len(sink.batch_prefix("q", 1)) - len("tp") + len("12345678:") + len("0:9999")
    fits_without_run = MAX_GID_BYTES - base
    with pytest.raises(ConfigurationError, match="gid_prefix"):
        PostgresSink(
            postgres_service["dsn"], table=t, gid_prefix="g" * fits_without_run
        ).plan_batch("q", 1, 1)


def test_verify_prepared_refuses_a_batch_whose_transaction_is_gone(db, postgres_service, prefixes):
    t = table(db, "id bigint")
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    name = f"verify-{_uid()}"
    intent = sink.plan_batch(name, 4, 2)
    prefixes.append(intent["gid_prefix"])
    handles = [attempt(sink, name, 4, intent, p, 0, "e1abc", ids_batch([p])) for p in (0, 1)]
    sink.verify_prepared(4, handles, prepare_started_at=0.0)  # all there: nothing to say
    q(db, "ROLLBACK PREPARED %s", (handles[1]["gid"],))
    with pytest.raises(TwoPhaseError) as ei:
        sink.verify_prepared(4, handles, prepare_started_at=0.0)
    assert "batch 4" in str(ei.value) and handles[1]["gid"] in str(ei.value)
    assert handles[0]["gid"] not in str(ei.value)
    sink.recover_and_abort(handles[0])


@pytest.mark.spark
def test_spark_retries_a_task_whose_worker_died_after_prepare(db, postgres_service, tmp_path):
    """The whole path: Coordinator + Spark (task retries on) + upsert.

    Partition 0's first attempt PREPAREs and its Python worker dies before reporting; Spark
    runs attempt 1 on the same keys.  Before the fix every later attempt waited on attempt
    0's row locks until ``lock_timeout`` and the job failed.  Own process: the shared
    session allows no task retries.
    """
    t = table(db, "k bigint PRIMARY KEY, v text")
    name = f"sparkretry-{_uid()}"
    script = textwrap.dedent(f"""
        import os
        from twophase.coordinator import Coordinator
        from twophase.sinks.postgres import PostgresSink
        from twophase.spark import local_session

        class DiesAfterFirstPrepare(PostgresSink):
            def pre_commit(self, txn):
                handle = super().pre_commit(txn)
                if txn.ctx.partition_id == 0 and txn.ctx.attempt == 0:
                    os._exit(137)  # the worker is gone; its prepared transaction stays
                return handle

        spark = local_session("local[1,3]", app_name="twophase-retry-test")
        sink = DiesAfterFirstPrepare({postgres_service["dsn"]!r}, table={t!r}, mode="upsert",
                                     key_columns=["k"], lock_timeout="5s")
        coord = Coordinator(sink, log_location={str(tmp_path / "log")!r}, name={name!r}, parallelism=2)
        df = spark.range(0, 100, numPartitions=2).selectExpr("id AS k", "'v' AS v")
        coord.write(df, batch_id=0)
        spark.stop()
    """)
    try:
        env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
        p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           timeout=240, check=False, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        assert q(db, f'SELECT count(*), count(DISTINCT k) FROM "{t}"')[0] == (100, 100)
        markers = q(db, "SELECT partition_id, attempt FROM twophase_commits WHERE query_name LIKE %s "
                        "ORDER BY 1", (name + ".%",))
        assert markers == [(0, 1), (1, 0)], markers  # partition 0 committed by its retry
        assert prepared_gids(db, f"tp:{name}") == []
    finally:
        for gid in prepared_gids(db, f"tp:{name}"):
            q(db, "ROLLBACK PREPARED %s", (gid,))


def test_an_attempt_whose_gid_was_doomed_before_its_claim_rolls_it_back_and_fails(db, postgres_service, prefixes):
    """A retry dooms a gid between its PREPARE TRANSACTION and its claim (played here by
    dooming it first: the gid is deterministic).  The attempt finds the claim doomed, rolls its
    own transaction back and fails, so its handle never reaches the driver; the cleanup then
    drops the claim of the gid that is gone."""
    t = table(db, "id bigint")
    name = f"doomed-{_uid()}"
    sink = PostgresSink(postgres_service["dsn"], table=t)
    sink.open()
    intent = sink.plan_batch(name, 0, 1)
    prefix = intent["gid_prefix"]
    prefixes.append(prefix)
    run = "e8" + uuid.uuid4().hex[:6]
    gid = sink.make_gid(prefix, 0, 0, run, task_attempt_id=5)
    q(db, "INSERT INTO twophase_commits_claims (gid, state) VALUES (%s, 'doomed')", (gid,))
    txn = sink.begin_transaction(TransactionContext(name, 0, 0, 0, intent, run, task_attempt_id=5))
    sink.write(txn, ids_batch([1, 2]))
    with pytest.raises(PostgresWriteError, match="doomed") as ei:
        sink.pre_commit(txn)
    assert gid in str(ei.value)
    sink.abort(txn)  # as the task runner does after a failure: nothing left to do, no error
    assert prepared_gids(db, prefix) == []
    assert q(db, f'SELECT count(*) FROM "{t}"') == [(0,)]
    assert sink.abort_lingering(name, 0, intent, []) == 0
    assert q(db, "SELECT count(*) FROM twophase_commits_claims WHERE gid = %s", (gid,)) == [(0,)]


def test_claims_table_needs_create_or_grants(db, postgres_service, prefixes, caplog):
    """open() creates the claims table beside the marker table; a role that may not is refused,
    naming the table and the grant.  A role that may not write an existing one is only warned,
    and its retried tasks then roll back nothing (they wait, they never guess)."""
    from tests.services.postgres import SERVICE

    dsn = postgres_service["dsn"]
    schema = f"tp_claims_{_uid()}"
    role, pw = f"tp_cl_{_uid()}", f"pw-{uuid.uuid4().hex}"
    q(db, f'CREATE SCHEMA "{schema}"')
    q(db, f'CREATE TABLE "{schema}".t (id bigint)')
    PostgresSink(dsn, table="t", schema=schema, marker_schema=schema).open()  # marker + claims
    assert q(db, "SELECT to_regclass(%s) IS NOT NULL", (f'"{schema}".twophase_commits_claims',)) == [(True,)]
    q(db, f'DROP TABLE "{schema}".twophase_commits_claims')
    su = SERVICE._superuser_conn(timeout=10)
    su.autocommit = True
    try:
        with su.cursor() as cur:
            cur.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD %s', (pw,))
        q(db, f'GRANT USAGE ON SCHEMA "{schema}" TO "{role}"')
        q(db, f'GRANT SELECT, INSERT ON "{schema}".t TO "{role}"')
        q(db, f'GRANT SELECT, INSERT, DELETE ON "{schema}".twophase_commits TO "{role}"')
        role_dsn = dsn.replace("user=twophase", f"user={role}").replace("password=twophase", f"password={pw}")
        sink = PostgresSink(role_dsn, table="t", schema=schema, marker_schema=schema)
        with pytest.raises(ConfigurationError) as ei:
            sink.open()
        msg = str(ei.value)
        assert "twophase_commits_claims" in msg and "CREATE TABLE" in msg and \
            "GRANT SELECT, INSERT, UPDATE, DELETE" in msg, msg
        assert pw not in msg
        # An administrator creates it, without granting it to the role: a warning, and no guessing.
        PostgresSink(dsn, table="t", schema=schema, marker_schema=schema).open()
        with caplog.at_level("WARNING", logger="twophase.sinks.postgres"):
            sink.open()
        assert any("may not write the claims table" in r.getMessage() for r in caplog.records)
        name = f"noclaims-{_uid()}"
        intent = sink.plan_batch(name, 0, 1)
        prefixes.append(intent["gid_prefix"])
        run = "e9" + uuid.uuid4().hex[:6]
        first = attempt(sink, name, 0, intent, 0, 0, run, ids_batch([1]))
        retry = attempt(sink, name, 0, intent, 0, 1, run, ids_batch([1]))
        assert prepared_gids(db, intent["gid_prefix"]) == sorted([first["gid"], retry["gid"]])
        sink.verify_prepared(0, [retry], prepare_started_at=0.0)  # the pg_prepared_xacts check only
        assert sink.commit(retry).outcome is CommitOutcome.COMMITTED
        assert sink.abort_lingering(name, 0, intent, [retry]) == 1
        assert q(db, f'SELECT id FROM "{schema}".t') == [(1,)]
    finally:
        with su.cursor() as cur:  # what a failing test left prepared
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE owner = %s", (role,))
            for (gid,) in cur.fetchall():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
        q(db, f'DROP SCHEMA "{schema}" CASCADE')
        with su.cursor() as cur:
            cur.execute(f'DROP OWNED BY "{role}"')
            cur.execute(f'DROP ROLE "{role}"')
        su.close()
