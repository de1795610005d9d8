"""``writeStream.format("twophase-files")`` (issue 28): the data source form of the protocol."""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path

import pytest

from twophase import chaos

pytestmark = [pytest.mark.spark]
#: A driver with ``--connect`` is a client of SparkSession.builder.remote("local[2]"), whose Connect
#: server takes pyspark's fixed port 15002 (two at once, in two test processes, clash); one with
#: ``--cluster`` takes both cores of the shared standalone cluster (1 core per worker, cores.max 2),
#: where another test's application would get no executor until it ends.
LOCAL_CONNECT = pytest.mark.one_at_a_time("connect_port_15002")
ON_CLUSTER = pytest.mark.one_at_a_time("spark_cluster")  # as the spark_cluster_service fixture's tests

REPO = Path(__file__).resolve().parent.parent


def _inputs(folder: Path, files: int, rows: int) -> list[str]:
    folder.mkdir()
    expected = []
    for f in range(files):
        ids = [f"f{f}-{i:04d}" for i in range(rows)]
        expected += ids
        (folder / f"f{f:03d}.json").write_text("".join(json.dumps({"id": i, "n": n}) + "\n" for n, i in enumerate(ids)))
    return expected


def _path(*dirs: Path) -> str:
    """PYTHONPATH for a driver: ``dirs``, then this process's."""
    return os.pathsep.join(filter(None, (*map(str, dirs), os.environ.get("PYTHONPATH"))))


def _log_records(log_dir: Path) -> int:
    """Files in the transaction log: grows with every batch (the kills land while batches flow)."""
    return sum(len(f) for _, _, f in os.walk(log_dir))


def _read(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [i for p in sorted(out.glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_files_data_source_every_id_once_across_driver_kills_and_worker_crash_points(tmp_path):
    """The data source form under the kill tests' faults, on a stateful query as real jobs write
    one (issue 47): the rows deduplicated within a watermark at 16 shuffle partitions (Spark's
    default 200 costs this test 30 s more in CI; tests/test_datasource_stateful.py and
    tests/test_datasource_coalesce_faults.py run stateful queries at 200), coalesced by the data
    source to the application's cores. 6 micro-batches of 100
    ids, each crash point on its own batch, then a SIGKILL of the driver's process group, then a
    run to the end: every id once, nothing left staged. A batch decided before a crash is replayed
    by Spark without being written again: its state must still be committed (else the next batch
    fails on the state store's missing version)."""
    expected = _inputs(tmp_path / "in", files=6, rows=100)
    out, ck = tmp_path / "out", tmp_path / "ck"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-files",
           "--path", str(out), "--dedup", "--shuffle-partitions", "16"]
    # Both crash points in the commit worker (the decision logged, nothing committed; a commit half
    # done): each kills a Python worker, which fails the query and ends the driver; the SIGKILL ends
    # the whole driver at a random moment. The planner's and a task's crash points are the JDBC
    # (Connect) and Kafka (cluster) tests'.
    points = ["after_prepared_logged:1", "mid_commit:3"]
    runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=1, kill_window=(0.5, 3.0), seed=28,
                                 progress_probe=lambda: _log_records(ck / "twophase"),
                                 env={"PYTHONPATH": _path(REPO)},
                                 log_path=str(tmp_path / "driver.log"), timeout=400)
    assert [r.fault for r in runs] == [f"crash:{p}" for p in points] + [runs[len(points)].fault, "none"], \
        [r.to_dict() for r in runs]
    # Each crash point fired (in the commit worker: the driver's exit is not 137), the SIGKILL
    # ended a run with batches left, no run failed otherwise, one fault-free run completed.
    chaos.check_runs(runs, executor_points=[p.split(":")[0] for p in points])
    verdict = chaos.verify(expected, _read(out))
    assert verdict.exactly_once, (verdict.to_dict(), [r.to_dict() for r in runs])
    staged = [p for p in (out / "_twophase").rglob("*") if p.is_file()] if (out / "_twophase").exists() else []
    assert staged == []
    # The query was the stateful one: its deduplication state in 16 partitions, written by fewer tasks.
    assert len([p for p in (ck / "state" / "0").iterdir() if p.name.isdigit()]) == 16
    assert len(list(out.glob("*.parquet"))) <= 2 * 6, "each batch coalesced to the 2 cores"


@pytest.mark.parametrize("case", ["misspelt option", "complete mode", "update mode", "continuous trigger",
                                  "no checkpoint"])
def test_a_new_users_mistake_gets_one_clear_line_and_writes_nothing(spark, tmp_path, case):
    """Issue 28, "trying it as a new user would": each mistake fails the query (or its start) with
    a line that names it; nothing reaches the output folder."""
    import twophase.datasource

    twophase.datasource.register(spark)
    src = spark.readStream.format("rate").option("rowsPerSecond", 5).load().selectExpr("value AS id")
    out, ck = tmp_path / "out", str(tmp_path / "ck")
    w = src.writeStream.format("twophase-files")
    expected = {
        "misspelt option": "unknown option(s) fromat (did you mean format?)",
        "complete mode": "writes in Append output mode only",
        "update mode": "twophase-files does not support Update mode",
        "continuous trigger": "a continuous trigger is not supported",
        "no checkpoint": "checkpointLocation must be specified",
    }[case]
    if case == "misspelt option":
        w = w.option("fromat", "json").option("checkpointLocation", ck)
    elif case in ("complete mode", "update mode"):
        counts = src.groupBy("id").count().writeStream.format("twophase-files")
        w = counts.outputMode("complete" if case == "complete mode" else "update").option("checkpointLocation", ck)
    elif case == "continuous trigger":
        w = w.trigger(continuous="1 second").option("checkpointLocation", ck)
    with pytest.raises(Exception) as info:
        q = w.start(str(out))
        try:
            q.awaitTermination(60)
        finally:
            q.stop()
    assert expected in str(info.value), str(info.value)[:3000]
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file() and "_twophase" not in p.parts]


@pytest.mark.chaos
@pytest.mark.postgres
@pytest.mark.connect
@pytest.mark.timeout(900)
@LOCAL_CONNECT
def test_jdbc_data_source_by_name_over_spark_connect_every_id_once_across_server_kills_and_crash_points(
        tmp_path, postgres_service):
    """``format("twophase-jdbc")`` with Spark's JDBC options (url, dbtable, user, password), from a
    Spark Connect client that registers nothing: the server finds the ``pyspark_twophase_*``
    modules on its Python path (as where twophase is installed).  Under the same faults, in the
    server's planner and commit workers, then a SIGKILL of client and server: every id in the
    table once, nothing of the query left prepared, and the password in no log."""
    from tests.test_postgres_chaos import _conn, _superuser, _write_input

    info = postgres_service
    # A role of its own with a password found nowhere else, so that the log check below can fail.
    role, secret, table = f"tp_ds_{uuid.uuid4().hex[:8]}", uuid.uuid4().hex, "events"
    as_role = dict(info, user=role, password=secret,
                   dsn=f"host={info['host']} port={info['port']} dbname={info['dbname']} user={role} "
                       f"password={secret}")
    with _superuser() as cur:
        cur.execute(f'CREATE ROLE "{role}" LOGIN PASSWORD %s', (secret,))
    with _conn(info) as c, c.cursor() as cur:
        cur.execute(f'GRANT CREATE ON DATABASE "{info["dbname"]}" TO "{role}"')
    with _conn(as_role) as c, c.cursor() as cur:
        cur.execute(f'CREATE SCHEMA "{role}"')  # its marker table goes there too ("$user" on the search path)
        cur.execute(f'CREATE TABLE "{role}"."{table}" (id bigint NOT NULL, k bigint, v bigint)')
    expected, _ = _write_input(tmp_path / "in", files=10, rows=100, keys=50)
    ck = tmp_path / "ck"
    prefix = f"ds{uuid.uuid4().hex[:6]}"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-jdbc",
           "--schema", "id BIGINT, k BIGINT, v BIGINT",
           "--option", f"url=jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}",
           "--option", f"dbtable={role}.{table}", "--option", f"user={role}",
           "--option", f"twophase.gidPrefix={prefix}", "--connect", "--no-register"]
    # The planner's and the commit worker's faults, then a SIGKILL of client and server; a task's
    # crash point is the cluster Kafka test's, the rest of the commit worker's the files test's.
    points = ["after_intent:1", "after_prepared_logged:2"]
    log_path = tmp_path / "driver.log"
    runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=1, kill_window=(0.5, 3.0), seed=29,
                                 progress_probe=lambda: _log_records(ck / "twophase"),
                                 env={"PYTHONPATH": _path(REPO, REPO / "discovery"), "PGPASSWORD": secret},
                                 log_path=str(log_path), timeout=400)
    assert [r.fault for r in runs] == [f"crash:{p}" for p in points] + [runs[len(points)].fault, "none"], \
        [r.to_dict() for r in runs]
    # Each crash point fired in the server's planner or commit worker (the client's exit is not
    # 137), the SIGKILL ended a run with batches left, no run failed otherwise, one fault-free run.
    chaos.check_runs(runs, executor_points=[p.split(":")[0] for p in points])
    with _conn(as_role) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{role}"."{table}"')
        verdict = chaos.verify(expected, [r[0] for r in cur.fetchall()])
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s", (prefix, prefix))
        left = cur.fetchall()
    assert verdict.exactly_once, (verdict.to_dict(), [r.to_dict() for r in runs])
    assert left == []
    assert secret not in log_path.read_text(errors="replace")


@pytest.mark.chaos
@pytest.mark.kafka
@pytest.mark.cluster
@pytest.mark.timeout(900)
@ON_CLUSTER
def test_kafka_data_source_on_a_cluster_every_id_once_across_driver_kills_and_executor_crash_points(
        tmp_path, kafka_service, spark_cluster_service):
    """``format("twophase-kafka")`` with Spark's Kafka options on the standalone cluster: a task's
    crash point on an executor (which inherits nothing from the driver: the plan carries the crash
    plan to it; Spark retries the task until the stage fails). A read_committed consumer finds every
    id once, and no transaction of the pool is left open. (The planner's and the commit worker's
    faults and the driver's SIGKILL are the files and JDBC tests'.)"""
    from tests.test_kafka_sink import _topic, read_committed
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    dst = _topic(bs, 2)
    expected = _inputs(tmp_path / "in", files=5, rows=100)
    ck = tmp_path / "ck"
    prefix = f"ds-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-kafka",
           "--select", "id AS key", "--select", "id AS value",
           "--option", f"kafka.bootstrap.servers={bs}", "--option", f"topic={dst}",
           "--option", "kafka.linger.ms=5", "--option", f"twophase.transactionalIdPrefix={prefix}", "--cluster"]
    points = ["after_pre_commit:1"]
    runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=0, seed=30,
                                 progress_probe=lambda: _log_records(ck / "twophase"),
                                 env={"PYTHONPATH": _path(REPO)},
                                 log_path=str(tmp_path / "driver.log"), timeout=400)
    assert [r.fault for r in runs] == [f"crash:{p}" for p in points] + ["none"], [r.to_dict() for r in runs]
    # The task's crash point fired on an executor (the driver's exit is not 137), no run failed
    # otherwise, one fault-free run completed.
    chaos.check_runs(runs, executor_points=[p.split(":")[0] for p in points])
    verdict = chaos.verify(expected, [v.decode() for v in read_committed(bs, dst, timeout=60, idle=3)])
    assert verdict.exactly_once, (verdict.to_dict(), [r.to_dict() for r in runs])
    sink = KafkaSink(bs, dst, prefix)
    try:
        states = sink._txn_client().describe_transactions(sink.pool_ids(2))
    finally:
        sink.close()
    assert any(d.state == "CompleteCommit" for d in states.values()), states
    assert [t for t, d in states.items() if d.state in ("Ongoing", "PrepareAbort", "PrepareCommit")] == []


def test_a_batch_write_with_a_batch_id_lands_once_and_a_repeat_is_skipped(spark, tmp_path):
    """``df.write.format("twophase-files")`` with ``twophase.batchId``: the first write commits,
    the same write again writes nothing; overwrite mode and a missing batch id get one line."""
    import twophase.datasource

    twophase.datasource.register(spark)
    out, log = tmp_path / "out", str(tmp_path / "log")
    df = spark.range(0, 300, 1, 3).selectExpr("CAST(id AS STRING) AS id")

    def write(d, batch_id, mode="append"):
        (d.write.format("twophase-files").mode(mode).option("twophase.logLocation", log)
         .option("twophase.batchId", str(batch_id)).save(str(out)))

    write(df, 0)
    write(df, 0)  # a re-run job: skipped
    write(spark.range(300, 400, 1, 2).selectExpr("CAST(id AS STRING) AS id"), 1)
    assert sorted(_read(out), key=int) == [str(i) for i in range(400)]
    with pytest.raises(Exception, match="appends"):
        write(df, 2, mode="overwrite")
    with pytest.raises(Exception, match="twophase.batchId"):
        df.write.format("twophase-files").mode("append").option("twophase.logLocation", log).save(str(out))
    assert sorted(_read(out), key=int) == [str(i) for i in range(400)]


@pytest.mark.chaos
@pytest.mark.timeout(600)
def test_a_commit_step_paused_while_a_second_run_replays_its_batch_loses_and_every_id_lands_once(tmp_path):
    """No process of the data source form holds a lease: the fence is the ballot. Run A's commit
    step stops (SIGSTOP) just before it logs batch 1's decision; an operator, taking A for dead,
    starts run B on the same checkpoint, which replays batch 1 and runs to the end; then A's commit
    step resumes with its decision in hand. A must lose (its query fails with an ownership error),
    B's output must stand: every id once, nothing staged."""
    import signal
    import subprocess

    from tests.services import wait_until

    expected = _inputs(tmp_path / "in", files=4, rows=100)
    out, ck = tmp_path / "out", tmp_path / "ck"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-files",
           "--path", str(out)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_CRASH") and not k.startswith("TWOPHASE_PAUSE")}
    env["PYTHONPATH"] = _path(REPO)
    pause_log = tmp_path / "pause.log"
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    with open(log_a, "wb") as fa:
        a = subprocess.Popen(cmd, env=dict(env, TWOPHASE_PAUSE_AT="before_prepared_logged:1",
                                           TWOPHASE_PAUSE_LOG=str(pause_log)),
                             stdout=fa, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until(lambda: pause_log.exists() and pause_log.read_text().strip() or a.poll() is not None, 240,
                   "run A's commit step to stop before batch 1's decision")
        assert a.poll() is None, log_a.read_text(errors="replace")[-3000:]
        point, batch, pid = pause_log.read_text().split()[:3]
        assert (point, batch) == ("before_prepared_logged", "1")
        with open(log_b, "wb") as fb:
            b = subprocess.run(cmd, env=env, stdout=fb, stderr=subprocess.STDOUT, timeout=300)
        assert b.returncode == 0, log_b.read_text(errors="replace")[-5000:]
        assert sorted(_read(out)) == sorted(expected)  # B's output, before A wakes up
        os.kill(int(pid), signal.SIGCONT)
        a.wait(timeout=180)
    finally:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()
    text = log_a.read_text(errors="replace")
    assert a.returncode != 0, text[-3000:]
    assert "resumed" in text and "was closed by another coordinator" in text, text[-5000:]
    verdict = chaos.verify(expected, _read(out))
    assert verdict.exactly_once, verdict.to_dict()
    staged = [p for p in (out / "_twophase").rglob("*") if p.is_file()] if (out / "_twophase").exists() else []
    assert staged == []


@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.timeout(600)
@pytest.mark.parametrize("where", ["local", pytest.param("cluster", marks=[pytest.mark.cluster, ON_CLUSTER]),
                                   pytest.param("connect", marks=[pytest.mark.connect, LOCAL_CONNECT])])
def test_every_format_by_name_writes_every_id_once_on_local_spark_a_cluster_and_spark_connect(
        where, tmp_path, kafka_service, postgres_service, request):
    """Issue 28: each of twophase-files, -jdbc and -kafka from one driver, on local Spark (the
    suite's session, registered by ``register(spark)``), on the standalone cluster and from a Spark
    Connect client (drivers of their own, found by Spark's discovery of the ``pyspark_twophase_*``
    modules: nothing registered)."""
    import subprocess

    import psycopg2

    from tests.drivers import datasource_every_format
    from tests.test_kafka_sink import _topic, read_committed

    if where == "cluster":
        request.getfixturevalue("spark_cluster_service")
    expected = _inputs(tmp_path / "in", files=2, rows=50)
    bs, pg = kafka_service["bootstrap_servers"], postgres_service
    topic, table = _topic(bs, 2), f"ds_every_{uuid.uuid4().hex[:8]}"
    with psycopg2.connect(pg["dsn"]) as c, c.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id text NOT NULL, n bigint)')
    out = tmp_path / "out"
    spec = {"input": str(tmp_path / "in"), "schema": "id STRING, n LONG", "targets": [
        {"format": "twophase-files", "checkpoint": str(tmp_path / "ck-files"), "path": str(out)},
        {"format": "twophase-jdbc", "checkpoint": str(tmp_path / "ck-jdbc"),
         "options": {"url": f"jdbc:postgresql://{pg['host']}:{pg['port']}/{pg['dbname']}", "dbtable": table,
                     "user": pg["user"]}},
        {"format": "twophase-kafka", "checkpoint": str(tmp_path / "ck-kafka"), "select": ["id AS key", "id AS value"],
         "options": {"kafka.bootstrap.servers": bs, "topic": topic}},
    ]}
    if where == "local":
        import twophase

        spark = request.getfixturevalue("spark")
        twophase.register(spark)  # the top-level name the README shows
        spec["targets"][1]["options"]["password"] = pg["password"]
        done = list(datasource_every_format.run(spark, spec))
    else:
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TWOPHASE_CRASH", "TWOPHASE_PAUSE"))}
        env.update(PYTHONPATH=_path(REPO, REPO / "discovery"), PGPASSWORD=pg["password"])
        log = tmp_path / "driver.log"
        with open(log, "wb") as f:
            r = subprocess.run([sys.executable, "-m", "tests.drivers.datasource_every_format",
                                str(tmp_path / "spec.json"), f"--{where}", "--no-register"],
                               env=env, stdout=subprocess.PIPE, stderr=f, text=True, timeout=500, cwd=REPO)
        assert r.returncode == 0, log.read_text(errors="replace")[-5000:]
        done = [(line.split()[0], int(line.split()[2])) for line in r.stdout.splitlines() if " done " in line]
    # Every query ended, and Spark's own progress counted the sink's rows (sink.numOutputRows).
    assert done == [(t["format"], len(expected)) for t in spec["targets"]], done
    assert sorted(_read(out)) == sorted(expected)
    with psycopg2.connect(pg["dsn"]) as c, c.cursor() as cur:
        cur.execute(f'SELECT id FROM "{table}"')
        assert sorted(i for (i,) in cur.fetchall()) == sorted(expected)
        cur.execute(f'DROP TABLE "{table}"')
    assert sorted(v.decode() for v in read_committed(bs, topic, timeout=60, idle=3)) == sorted(expected)


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_a_query_stopped_mid_batch_leaves_no_transaction_prepared(spark, postgres_service, tmp_path):
    """``query.stop()`` cancels the micro-batch in flight; Spark's ``abort(messages, N)`` then gets
    no task message naming the ballot.  The transactions that tasks had already prepared must not
    wait for the query's next run (in PostgreSQL they hold their locks: a DROP TABLE waited on them):
    the abort step recovers them at once."""
    import psycopg2

    import twophase

    pg = postgres_service
    table, prefix = f"ds_stop_{uuid.uuid4().hex[:8]}", f"st{uuid.uuid4().hex[:6]}"
    ck = str(tmp_path / "ck")
    conn = psycopg2.connect(pg["dsn"])
    conn.autocommit = True
    cur = conn.cursor()
    cur.execute(f'CREATE TABLE "{table}" (id bigint NOT NULL)')

    def prepared() -> list[str]:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s", (prefix, prefix))
        return [g for (g,) in cur.fetchall()]

    twophase.register(spark)
    q = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", 20000).option("numPartitions", 24).load()
         .selectExpr("value AS id").writeStream.format("twophase-jdbc")
         .option("url", f"jdbc:postgresql://{pg['host']}:{pg['port']}/{pg['dbname']}").option("dbtable", table)
         .option("user", pg["user"]).option("password", pg["password"]).option("twophase.gidPrefix", prefix)
         .option("checkpointLocation", ck).start())
    try:
        deadline = time.time() + 120
        while not prepared() and time.time() < deadline:  # a batch in flight, some of its tasks prepared
            time.sleep(0.05)
        assert prepared(), "no batch had prepared transactions within 120 s"
    finally:
        q.stop()
    try:
        deadline = time.time() + 30
        while prepared() and time.time() < deadline:
            time.sleep(0.2)
        assert prepared() == []
        cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{table}"')
        rows, distinct = cur.fetchone()
        assert rows == distinct and rows % 20000 == 0, (rows, distinct)  # whole micro-batches, each once
    finally:
        for gid in prepared():  # else the DROP below waits on their locks
            cur.execute("ROLLBACK PREPARED %s", (gid,))
        cur.execute(f'DROP TABLE "{table}"')
        conn.close()
