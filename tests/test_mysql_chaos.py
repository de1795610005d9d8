"""Kill tests of the MySQL/MariaDB sink (issue 49), both forms, on the real MariaDB server.

1. ``foreachBatch(Coordinator(MySqlSink))`` (tests/drivers/mysql_pipeline.py) on local[2]: the driver
   dies after the decision is logged and before any XA COMMIT, then after the first XA COMMIT of a
   batch, then by a SIGKILL of its process group while batches flow; then it runs to the end.
2. ``format("twophase-jdbc")`` with ``url=jdbc:mysql://...`` (tests/drivers/datasource_pipeline.py) on
   local[2], as a user of its own: the planner dies after the INTENT, the commit step mid-commit, and
   a SIGKILL; then it runs to the end.

Then every input id is in the target table exactly once (the table has no unique key, so a batch
committed twice would show as duplicates), ``XA RECOVER`` lists no branch of the query, and (2) the
password is in no log.  The other crash points' states (``after_pre_commit``,
``before_prepared_logged``) are the conformance harness's (tests/test_conformance_mysql.py) and the
PostgreSQL kill test's: CI time.
"""

from __future__ import annotations

import contextlib
import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.cluster import checkpoint_batches
from tests.test_postgres_chaos import _write_input
from twophase import chaos

pytestmark = [pytest.mark.mysql, pytest.mark.chaos, pytest.mark.spark, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "drivers" / "mysql_pipeline.py"


@contextlib.contextmanager
def _conn(info, user=None, password=None):
    import pymysql

    c = pymysql.connect(host=info["host"], port=info["port"], user=user or info["user"],
                        password=password or info["password"], database=info["database"], autocommit=True)
    try:
        with c.cursor() as cur:
            yield cur
    finally:
        c.close()


@contextlib.contextmanager
def _root(info):
    import pymysql

    c = pymysql.connect(unix_socket=info["socket"], user="root", autocommit=True)
    try:
        with c.cursor() as cur:
            yield cur
    finally:
        c.close()


def _new_table(info, prefix: str) -> str:
    """A fresh insert target (id, k, v) without a unique key: a duplicate row would stay."""
    table = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with _conn(info) as cur:
        cur.execute(f"CREATE TABLE `{table}` (id BIGINT NOT NULL, k BIGINT, v BIGINT) ENGINE=InnoDB")
    return table


def _table_ids(info, table: str) -> list[int]:
    with _conn(info) as cur:  # a fresh connection: the runs took minutes
        cur.execute(f"SELECT id FROM `{table}`")
        return [r[0] for r in cur.fetchall()]


def _prepared(info, prefix: str) -> list[tuple[str, str]]:
    """``(gtrid, bqual)`` of every prepared XA branch whose gtrid starts with ``prefix``."""
    with _conn(info) as cur:
        cur.execute("XA RECOVER")
        out = []
        for _fmt, glen, blen, data in cur.fetchall():
            gtrid, bqual = data[:glen].decode(errors="replace"), data[glen:glen + blen].decode(errors="replace")
            if gtrid.startswith(prefix):
                out.append((gtrid, bqual))
        return out


def _drop(info, prefix: str, *tables: str) -> None:
    """Roll back what is left prepared under ``prefix`` (it holds locks), then drop ``tables``."""
    import pymysql

    with _conn(info) as cur:
        for gtrid, bqual in _prepared(info, prefix):
            try:
                cur.execute("XA ROLLBACK %s, %s", (gtrid, bqual))
            except pymysql.err.OperationalError as e:
                if e.args[0] not in (1397, 1402):  # gone already; a branch that wrote nothing is "rolled back"
                    raise
        cur.execute("DROP TABLE IF EXISTS " + ", ".join(f"`{t}`" for t in tables))


def _show_log(path: Path) -> None:
    if path.exists():
        sys.stderr.write("".join(path.read_text(errors="replace").splitlines(keepends=True)[-60:]))


def test_coordinator_insert_exactly_once_under_crash_points_and_a_sigkill(tmp_path, mariadb_service):
    info = mariadb_service
    uid = uuid.uuid4().hex[:6]
    table, markers, name = _new_table(info, "mychaos"), f"mychaos_markers_{uid}", f"mychaos-{uid}"
    # A gtrid prefix of the test's own: the sink sees the query as ``{name}.{log scope}``, longer than
    # 24 characters, so the gtrid holds a digest of it, not the name (tp:<name>: would find nothing).
    gid = f"my{uid}"
    expected, _ = _write_input(tmp_path / "in", files=6, rows=200, keys=50)
    ck = tmp_path / "ck"
    cmd = [sys.executable, str(DRIVER), "--input", str(tmp_path / "in"), "--checkpoint", str(ck),
           "--host", info["host"], "--port", str(info["port"]), "--database", info["database"],
           "--user", info["user"], "--table", table, "--marker-table", markers, "--name", name, "--gid-prefix", gid]
    # Decided, no XA COMMIT run (recovery commits every handle); decided, one branch committed
    # (recovery commits it again: 1397, told from "rolled back" by its marker row, and the rest).
    # Then a SIGKILL of the whole process group while batches flow.
    points = ["after_prepared_logged:1", "mid_commit:2"]
    log_path = tmp_path / "driver.log"
    try:
        try:
            runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=1, kill_window=(0.5, 3.0),
                                         seed=20260049, env={"MYSQL_PWD": info["password"]},
                                         log_path=str(log_path), timeout=400,
                                         progress_probe=lambda: checkpoint_batches(ck))
        except BaseException:
            _show_log(log_path)
            raise
        assert [r.fault for r in runs[:len(points)]] == [f"crash:{p}" for p in points], runs
        assert runs[len(points)].fault.startswith("sigkill"), runs
        # Each crash point fired in the driver at its batch (exit 137, named in its crash log), the
        # SIGKILL ended its run before the work was done, no run failed otherwise, the last completed.
        chaos.check_runs(runs)
        verdict = chaos.verify(expected, _table_ids(info, table))
        assert verdict.exactly_once, (verdict.to_dict(), [r.to_dict() for r in runs])
        assert verdict.records_out == len(expected) == 1200
        assert _prepared(info, f"{gid}:") == []
    finally:
        _drop(info, f"{gid}:", table, markers)


def test_jdbc_data_source_mysql_url_every_id_once_across_crash_points_and_a_sigkill(tmp_path, mariadb_service):
    """``format("twophase-jdbc")`` with Spark's JDBC options for MySQL (url, dbtable, user,
    password), as a user of its own whose password is found nowhere else, so that the log check
    can fail.  The password reaches the driver in its environment (``PGPASSWORD``, which
    tests/drivers/datasource_pipeline.py turns into the writer's ``password`` option for any url)."""
    info = mariadb_service
    uid = uuid.uuid4().hex[:8]
    user, secret = f"tpds{uid}", "Xk9-" + uuid.uuid4().hex
    table, prefix = _new_table(info, "mydschaos"), f"myds{uid}"
    with _root(info) as cur:
        cur.execute("CREATE USER %s@'127.0.0.1' IDENTIFIED BY %s", (user, secret))
        cur.execute(f"GRANT ALL PRIVILEGES ON `{info['database']}`.* TO %s@'127.0.0.1'", (user,))
    expected, _ = _write_input(tmp_path / "in", files=6, rows=100, keys=50)
    ck = tmp_path / "ck"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-jdbc",
           "--schema", "id BIGINT, k BIGINT, v BIGINT",
           "--option", f"url=jdbc:mysql://{info['host']}:{info['port']}/{info['database']}",
           "--option", f"dbtable={table}", "--option", f"user={user}",
           "--option", f"twophase.gidPrefix={prefix}"]
    # The planner dies with the INTENT logged (nothing prepared yet); the commit step dies after
    # its first XA COMMIT; then a SIGKILL of the driver's process group.  They fire in Spark's
    # Python planner workers, which fails the query: the driver's exit is not the crash point's.
    points = ["after_intent:1", "mid_commit:2"]
    log_path = tmp_path / "driver.log"
    env = {"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
           "PGPASSWORD": secret}
    try:
        try:
            runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=1, kill_window=(0.5, 3.0),
                                         seed=20260149, env=env, log_path=str(log_path), timeout=400,
                                         progress_probe=lambda: checkpoint_batches(ck))
        except BaseException:
            _show_log(log_path)
            raise
        show = [r.to_dict() for r in runs]
        assert [r.fault for r in runs] == [f"crash:{p}" for p in points] + [runs[len(points)].fault, "none"], show
        for r, point in zip(runs, points):
            assert [line.split(" ")[:2] for line in r.fired] == [point.split(":")], show
        # Each point fired in a Python worker (the driver's exit is not 137), the SIGKILL ended a
        # run with batches left, no run failed otherwise, one fault-free run completed.
        chaos.check_runs(runs, executor_points=[p.split(":")[0] for p in points])
        verdict = chaos.verify(expected, _table_ids(info, table))
        assert verdict.exactly_once, (verdict.to_dict(), show)
        assert verdict.records_out == len(expected) == 600
        assert _prepared(info, f"{prefix}:") == []
        text = log_path.read_text(errors="replace")
        # The log holds the Python workers' stderr too (where the sink runs on the driver's side).
        assert "crash point mid_commit reached (batch 2)" in text
        assert secret not in text, "the password is in the driver's log"
    finally:
        _drop(info, f"{prefix}:", table)
        with _root(info) as cur:
            cur.execute("DROP USER IF EXISTS %s@'127.0.0.1'", (user,))
