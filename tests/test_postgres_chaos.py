"""Kill tests of the PostgreSQL sink: a real streaming driver killed at every crash point and at random.

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

from twophase import chaos, crash

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


def _run(tmp_path, info, table, mode, name, crash_points, random_kills, seed):
    env = {"PGPASSWORD": info["password"], "TWOPHASE_SPARK_DRIVER_MEMORY": "512m"}
    dsn = f"host={info['host']} port={info['port']} dbname={info['dbname']} user={info['user']}"
    cmd = [sys.executable, DRIVER, "--input", str(tmp_path / "in"), "--checkpoint", str(tmp_path / "ck"),
           "--dsn", dsn, "--table", table, "--mode", mode, "--name", name]
    log_path = str(tmp_path / "driver.log")
    try:
        return chaos.run_with_faults(cmd, crash_points=crash_points, random_kills=random_kills,
                                     kill_window=(12.0, 40.0), seed=seed, env=env, log_path=log_path,
                                     timeout=300)
    except BaseException:
        with open(log_path, errors="replace") as f:
            sys.stderr.write("".join(f.readlines()[-60:]))
        raise


def _leftovers(info, name) -> list[str]:
    with _conn(info) as c, c.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                    "AND left(gid, length(%s)) = %s", (f"tp:{name}", f"tp:{name}"))
        return [r[0] for r in cur.fetchall()]


def test_insert_exactly_once_under_crash_points_and_sigkills(tmp_path, postgres_service):
    info = postgres_service
    table = f"chaos_{uuid.uuid4().hex[:8]}"
    name = f"pgchaos-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=4, rows=300, keys=50)
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id bigint NOT NULL, k bigint, v bigint)')
    runs = _run(tmp_path, info, table, "insert", name, crash.POINTS, random_kills=2, seed=20251122)
    faults = [r for r in runs if r.fault != "none"]
    assert len(faults) == len(crash.POINTS) + 2
    # Every crash-point run really died at its point (exit 137), none finished early.
    assert all(r.exit_code != 0 for r in faults if r.fault.startswith("crash:")), runs
    assert runs[-1].completed
    with _conn(info) as c, c.cursor() as cur:  # a fresh connection: the runs took minutes
        cur.execute(f'SELECT id FROM "{table}"')
        actual = [r[0] for r in cur.fetchall()]
    verdict = chaos.verify(expected, actual)
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
    assert [r.exit_code for r in runs[:2]] == [crash.EXIT_CODE, crash.EXIT_CODE], runs
    assert runs[-1].completed
    expected = dict(last)
    expected.update({k: -2 for k in range(1000, 1005)})
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'SELECT k, v FROM "{table}"')
        actual = dict(cur.fetchall())
    assert actual == expected
    assert _leftovers(info, name) == []
