"""Kill tests of the PostgreSQL sink: a real streaming driver killed at the crash points where the sink's
state differs (``chaos.SINK_POINTS``) (at random moments: the nemesis, tests/test_nemesis.py; and the
cluster test below).

The driver (tests/drivers/postgres_pipeline.py) reads JSON-lines files with unique ids, one file per
micro-batch, and writes them through ``Coordinator(PostgresSink)``.  After the faults it runs until done;
then every input id must be in the table exactly once (insert mode), or the table must equal the expected
last-value-per-key (upsert mode), and no prepared transaction of the query may be left.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import uuid

import pytest

from twophase import chaos

pytestmark = [pytest.mark.postgres, pytest.mark.chaos, pytest.mark.timeout(900)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "tests", "drivers", "postgres_pipeline.py")


@contextlib.contextmanager
def _conn(info):
    import psycopg2

    c = psycopg2.connect(info["dsn"])
    c.autocommit = True
    try:
        yield c
    finally:
        c.close()


@contextlib.contextmanager
def _superuser():
    """A cursor of the server's superuser (to make and drop a role of the test's own)."""
    from tests.services.postgres import SERVICE

    c = SERVICE._superuser_conn(timeout=10)
    c.autocommit = True
    try:
        with c.cursor() as cur:
            yield cur
    finally:
        c.close()


def _write_input(folder, files: int, rows: int, keys: int) -> tuple[list[int], dict[int, int]]:
    """Files part-000.json ... with unique ids; key k = id % keys, v = file number.

    Spark's file source takes files in modification-time order (ms resolution) and breaks
    ties by listing order, which is not the name order: files written in the same
    millisecond once went into batches 0, 2, 1.  Each file gets its own second, so batch
    order is file order and "last value per key" is well defined.
    """
    os.makedirs(folder)
    ids, last = [], {}
    n = 0
    base = int(time.time()) - files - 1
    for f in range(files):
        path = os.path.join(folder, f"part-{f:03d}.json")
        with open(path, "w") as fh:
            for _ in range(rows):
                fh.write(json.dumps({"id": n, "k": n % keys, "v": f}) + "\n")
                ids.append(n)
                last[n % keys] = f
                n += 1
        os.utime(path, (base + f, base + f))
    return ids, last


def _run(tmp_path, info, table, mode, name, crash_points, random_kills, seed, *, user=None, password=None,
         cluster_conf=None, progress_probe=None, kill_window=(12.0, 40.0), timeout=300, connect=False):
    """Run the driver under faults.  ``cluster_conf``: on the test Spark cluster, with these confs
    (as ``spark-submit --conf``); ``user``/``password``: another role than the service's."""
    password = password or info["password"]
    env = {"PGPASSWORD": password, "TWOPHASE_SPARK_DRIVER_MEMORY": "512m"}
    dsn = f"host={info['host']} port={info['port']} dbname={info['dbname']} user={user or info['user']}"
    cmd = [sys.executable, DRIVER, "--input", str(tmp_path / "in"), "--checkpoint", str(tmp_path / "ck"),
           "--dsn", dsn, "--table", table, "--mode", mode, "--name", name]
    if connect:
        cmd.append("--connect")
    if cluster_conf is not None:
        cmd.append("--cluster")
        env.update({"PYTHONPATH": REPO, "TWOPHASE_CLUSTER_CONF": json.dumps(cluster_conf)})
    log_path = str(tmp_path / "driver.log")
    try:
        return chaos.run_with_faults(cmd, crash_points=crash_points, random_kills=random_kills,
                                     kill_window=kill_window, seed=seed, env=env, log_path=log_path,
                                     timeout=timeout, progress_probe=progress_probe)
    except BaseException:
        with open(log_path, errors="replace") as f:
            sys.stderr.write("".join(f.readlines()[-60:]))
        raise


def _new_table(info, prefix: str) -> str:
    """A fresh insert-mode target table (id, k, v); returns its name."""
    table = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id bigint NOT NULL, k bigint, v bigint)')
    return table


def _table_ids(info, table: str) -> list[int]:
    with _conn(info) as c, c.cursor() as cur:  # a fresh connection: the runs took minutes
        cur.execute(f'SELECT id FROM "{table}"')
        return [r[0] for r in cur.fetchall()]


def _leftovers(info, name) -> list[str]:
    with _conn(info) as c, c.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND left(gid, length(%s)) = %s", (f"tp:{name}", f"tp:{name}"))
        return [r[0] for r in cur.fetchall()]


def test_insert_exactly_once_under_crash_points(tmp_path, postgres_service):
    info = postgres_service
    table = _new_table(info, "chaos")
    name = f"pgchaos-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=4, rows=300, keys=50)
    runs = _run(tmp_path, info, table, "insert", name, list(chaos.SINK_POINTS), random_kills=0, seed=20251122)
    assert [r.fault for r in runs[:len(chaos.SINK_POINTS)]] == [f"crash:{p}" for p in chaos.SINK_POINTS], runs
    # Every crash point fired where it was aimed (its crash log says so; after_pre_commit in the
    # executors' Python workers, the others in the driver, which exited 137), no run failed for
    # another reason (a JVM that did not start, a lost connection), and the last one completed.
    chaos.check_runs(runs)
    verdict = chaos.verify(expected, _table_ids(info, table))
    assert verdict.exactly_once, verdict.to_dict()
    assert verdict.records_out == len(expected) == 1200
    assert _leftovers(info, name) == []


def test_upsert_final_table_under_replays(tmp_path, postgres_service):
    info = postgres_service
    table = f"chaos_up_{uuid.uuid4().hex[:8]}"
    name = f"pgup-{uuid.uuid4().hex[:6]}"
    _, last = _write_input(tmp_path / "in", files=3, rows=200, keys=70)
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (k bigint PRIMARY KEY, v bigint NOT NULL)')
        # Pre-existing rows the upserts must overwrite (k < 70) or leave alone (k >= 1000).
        cur.execute(f'INSERT INTO "{table}" SELECT g, -1 FROM generate_series(0, 9) g')
        cur.execute(f'INSERT INTO "{table}" SELECT g, -2 FROM generate_series(1000, 1004) g')
    runs = _run(tmp_path, info, table, "upsert", name, ["after_prepared_logged", "mid_commit"],
                random_kills=0, seed=7)
    assert [r.fault for r in runs[:2]] == ["crash:after_prepared_logged", "crash:mid_commit"], runs
    chaos.check_runs(runs)  # both fired in the driver (exit 137, named in the crash log)
    expected = dict(last)
    expected.update({k: -2 for k in range(1000, 1005)})
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'SELECT k, v FROM "{table}"')
        actual = dict(cur.fetchall())
    assert actual == expected
    assert _leftovers(info, name) == []


@pytest.mark.cluster
@pytest.mark.spark
@pytest.mark.alone("SIGKILLs a Spark standalone cluster worker and its executors (cluster.Saboteur)")
def test_insert_exactly_once_on_a_cluster_whose_executors_and_workers_die(tmp_path, postgres_service,
                                                                          spark_cluster_service):
    """Issue 17, PostgreSQL: the insert pipeline on the standalone cluster (two workers, one
    executor each), as its own role whose password reaches the executors only as
    ``spark.executorEnv.PGPASSWORD`` (executors do not inherit the driver's environment).

    Faults: ``after_pre_commit`` fires in executors' Python workers (prepared transactions whose
    handles never reach the driver, so the restarted driver finds them by its INTENT); meanwhile a
    worker is SIGKILLed with its executors (then started again).  (A driver dying ``mid_commit``:
    the local kill test above, every crash point; SIGKILLs of the driver and of an executor while
    batches flow, an executor paused or cut from its driver, on hosts apart: the nemesis's,
    tests/test_nemesis.py; CI time.)  Every id is then in the table exactly once,
    nothing of the query is left prepared, and the password is in no driver or executor log.
    """
    from tests import cluster
    from tests.services.spark_cluster import SERVICE, WORKERS

    info = postgres_service
    role = f"tp_cluster_{uuid.uuid4().hex[:8]}"
    secret = uuid.uuid4().hex
    table = "events"
    name = f"pgcluster-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=6, rows=200, keys=50)
    as_role = dict(info, user=role, password=secret,
                   dsn=f"host={info['host']} port={info['port']} dbname={info['dbname']} user={role} "
                       f"password={secret}")
    with _superuser() as cur:
        cur.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD %s', (secret,))
    with _conn(info) as c, c.cursor() as cur:  # the database's owner
        cur.execute(f'GRANT CREATE ON DATABASE "{info["dbname"]}" TO "{role}"')
    with _conn(as_role) as c, c.cursor() as cur:
        # Its own schema, which is also where its marker table goes ("$user" on the search path).
        cur.execute(f'CREATE SCHEMA "{role}"')
        cur.execute(f'CREATE TABLE "{role}"."{table}" (id bigint NOT NULL, k bigint, v bigint)')
    def progress() -> int:
        return cluster.checkpoint_batches(tmp_path / "ck")

    started = time.time()
    try:
        # The worker that dies runs an executor of this driver's application (twophase-<name>).
        with cluster.Saboteur(progress, ["worker"], seed=20261124, gap=10, app=f"twophase-{name}") as saboteur:
            runs = _run(tmp_path, info, table, "insert", name, ["after_pre_commit:1"],
                        random_kills=0, seed=11, user=role, password=secret,
                        cluster_conf={"spark.executorEnv.PGPASSWORD": secret},
                        progress_probe=progress, timeout=400)
        cluster.check_fault_runs(runs, saboteur)
        with _conn(as_role) as c, c.cursor() as cur:
            cur.execute(f'SELECT id FROM "{role}"."{table}"')
            actual = [r[0] for r in cur.fetchall()]
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE owner = %s", (role,))
            left = [r[0] for r in cur.fetchall()]
        verdict = chaos.verify(expected, actual)
        assert verdict.exactly_once, verdict.to_dict()
        assert verdict.records_out == len(expected) == 1200
        assert left == []
        logs = [tmp_path / "driver.log"] + [
            f for d in WORKERS for f in SERVICE.work_dir(d).rglob("std*")
            if f.is_file() and f.stat().st_mtime >= started]
        assert len(logs) > 2, logs  # the driver's and at least two executors'
        leaked = [str(f) for f in logs if secret in f.read_text(errors="replace")]
        assert leaked == [], f"the password is in {leaked}"
    finally:
        with _conn(as_role) as c, c.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE owner = %s", (role,))
            for (gid,) in cur.fetchall():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
            cur.execute(f'DROP SCHEMA "{role}" CASCADE')
        with _conn(info) as c, c.cursor() as cur:
            cur.execute(f'REVOKE CREATE ON DATABASE "{info["dbname"]}" FROM "{role}"')
        with _superuser() as cur:
            cur.execute(f'DROP ROLE "{role}"')
