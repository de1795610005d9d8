"""Exactly-once over Spark Connect: the same pipelines as the kill tests, driven by a Spark Connect
client (``SparkSession.builder.remote("local[2]")``).  pyspark starts the Connect server in a JVM of
the client's own; the coordinator, pickled by the client, runs in the server's ``foreachBatch``
worker, a Python process of that JVM.  A crash point there kills that worker (the query then fails
and the client exits 1); a SIGKILL of the client's process group kills client, server and worker.

Each test arms few, well-placed faults (CI time): an executor's worker after its pre-commit, the
decision logged but nothing committed, a commit half done; the files test also one SIGKILL of client,
server and worker while batches flow (what it kills does not depend on the sink).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.services import wait_until
from twophase import chaos

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.connect, pytest.mark.spark, pytest.mark.chaos]
#: SparkSession.builder.remote("local[...]") starts its Connect server on pyspark's fixed port 15002
#: and connects to localhost:15002 (an ephemeral port only under SPARK_TESTING): two such sessions
#: at once, in two test processes, clash.
LOCAL_CONNECT = pytest.mark.one_at_a_time("connect_port_15002")


def _log_records(log_dir: Path) -> int:
    """Files in a transaction log: grows with every INTENT/PREPARED/COMMITTED (batches flowing)."""
    return sum(len(f) for _, _, f in os.walk(log_dir))


def _fired(runs) -> list[str]:
    return [r.fault for r in runs if r.outcome == "crash point fired"]


@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time: Connect servers killed with the client, and its workers' crash points, "
                           "are the Kafka twin's below and the data source form's "
                           "(tests/test_datasource.py); the demo's --connect is the Connect example test's "
                           "neighbour; TWOPHASE_FULL_CHAOS=1 runs it")
@LOCAL_CONNECT
def test_files_exactly_once_over_spark_connect_with_client_server_and_worker_killed(tmp_path):
    workdir = tmp_path / "demo"
    points = ["after_pre_commit", "after_prepared_logged", "mid_commit"]
    r = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "demo", "--connect", "--workdir", str(workdir),
         "--files", "5", "--records", "200", "--points", ",".join(points), "--kills", "1",
         "--seed", "20261124", "--json"],
        capture_output=True, text=True, timeout=1200)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    verdict = json.loads(r.stdout)
    runs = verdict["runs"]
    # Each armed point fired in its own run (the crash log names it), on its own batch.
    for i, point in enumerate(points):
        assert runs[i]["fault"] == f"crash:{point}:{i}"
        assert runs[i]["outcome"] == "crash point fired", runs[i]
        assert runs[i]["fired"][0].split()[:2] == [point, str(i)]
    assert runs[len(points)]["fault"].startswith("sigkill")
    # The SIGKILL ended its run while batches flowed (below the completing run's progress), no run
    # failed otherwise, the last completed.  Over Connect no crash point kills the client itself
    # (they fire in the server's workers; the client then exits 1): none is a driver point here.
    chaos.check_runs([chaos.Run(**run) for run in runs], executor_points=points)
    assert verdict["records_in"] == 5 * 200
    assert verdict["lost"] == 0, verdict["lost_sample"]
    assert verdict["duplicated"] == 0, verdict["duplicated_sample"]
    assert verdict["unexpected"] == 0
    assert verdict["staging_files_left"] == 0
    assert r.returncode == 0
    # The coordinator really ran in the Connect server's foreachBatch worker, and said what
    # Connect cannot offer.
    driver_log = (workdir / "driver.log").read_text(errors="replace")
    assert "Streaming ForeachBatch worker Started batch" in driver_log
    assert "over Spark Connect the coordinator cannot inspect the streaming query" in driver_log


def _kill_server_and_time_the_client(server, client) -> float:
    """SIGKILL the Connect server; seconds until its client's call ended (fails after 60 s)."""
    server.kill()
    killed_at = time.monotonic()
    try:
        client.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(client.pid, signal.SIGKILL)
        client.wait()
        pytest.fail("the client still waited 60 s after its Connect server died")
    return time.monotonic() - killed_at


@pytest.mark.kafka
@pytest.mark.timeout(1200)
@LOCAL_CONNECT
def test_kafka_exactly_once_over_spark_connect_with_client_server_and_worker_killed(kafka_service, tmp_path):
    from confluent_kafka import Producer

    from tests.test_kafka_sink import _topic, read_committed

    bs = kafka_service["bootstrap_servers"]
    src, dst = _topic(bs, 2), _topic(bs, 2)
    ids = [f"id-{i:06d}" for i in range(900)]
    p = Producer({"bootstrap.servers": bs, "linger.ms": 5})
    for i, v in enumerate(ids):
        p.produce(src, v.encode(), key=str(i).encode())
    assert p.flush(30) == 0
    cmd = [sys.executable, "-m", "tests.drivers.kafka_pipeline", bs, src, dst,
           str(tmp_path / "checkpoint"), f"connect-{uuid.uuid4().hex[:8]}", "150", "--connect"]  # 6 batches
    # The driver-side points (a task's crash point over Connect is the PostgreSQL twin's, Kafka's
    # after_pre_commit the local crash-point test's).
    points = ["after_prepared_logged:1", "mid_commit:2"]
    log_dir = tmp_path / "checkpoint" / "twophase"
    runs = chaos.run_with_faults(
        cmd, crash_points=points, random_kills=0, seed=11,
        env={"PYTHONPATH": str(REPO)}, log_path=str(tmp_path / "driver.log"), timeout=600,
        progress_probe=lambda: _log_records(log_dir))
    assert _fired(runs) == [f"crash:{p}" for p in points], [r.to_dict() for r in runs]
    assert runs[-1].completed
    verdict = chaos.verify(ids, [v.decode() for v in read_committed(bs, dst, timeout=60, idle=3)])
    assert verdict.exactly_once, (verdict.to_dict(), (tmp_path / "driver.log").read_text()[-5000:])


@pytest.mark.postgres
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time: PostgreSQL over Connect meets the server's SIGKILL in the killed-apart test "
                           "below (orphan prepared transactions and decisions), and the crash points by name in "
                           "tests/test_datasource.py's JDBC data source over Connect; the coordinator's worker "
                           "crash points are the Kafka twin's above; TWOPHASE_FULL_CHAOS=1 runs it")
@LOCAL_CONNECT
def test_postgres_exactly_once_over_spark_connect_with_client_server_and_worker_killed(tmp_path,
                                                                                        postgres_service):
    from tests.test_postgres_chaos import _leftovers, _new_table, _run, _table_ids, _write_input

    info = postgres_service
    table = _new_table(info, "connect")
    name = f"pgconnect-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=5, rows=200, keys=50)
    # A task's crash point on the Connect server and a driver's before its decision (after_commit,
    # a decided batch's commits cut short, is the local kill tests' and the Kafka twin's mid_commit).
    points = ["after_pre_commit:1", "before_prepared_logged:2"]
    log_dir = tmp_path / "ck" / "twophase"
    runs = _run(tmp_path, info, table, "insert", name, points, random_kills=0, seed=5, connect=True,
                timeout=600,
                progress_probe=lambda: _log_records(log_dir))
    assert _fired(runs) == [f"crash:{p}" for p in points], [r.to_dict() for r in runs]
    assert runs[-1].completed
    verdict = chaos.verify(expected, _table_ids(info, table))
    assert verdict.exactly_once, verdict.to_dict()
    assert verdict.records_out == len(expected) == 1000
    assert _leftovers(info, name) == []


_NO_CHECKPOINT = """
import json, sys
from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink
from twophase.spark import local_session

out, log, ck, batch_out, batch_log = sys.argv[1:6]
spark = local_session("local[2]", "connect-no-checkpoint", connect=True)
# A batch DataFrame over Connect: the coordinator runs in this client; batch 0 twice = once.
# Tasks for every batch (driver_batch_rows=0): batch 1's coalesce(1) is about the task plan.
c = Coordinator(FileSink(batch_out, format="jsonl"), log_location=batch_log, name="connect-batch",
                driver_batch_rows=0)
df = spark.range(0, 100, 1, 3).selectExpr("CAST(id AS STRING) AS id")
first, again = c.write(df, batch_id=0), c.write(df, batch_id=0)
# A batch that ends in the user's own coalesce(1) keeps it (one task, one file).
one = c.write(spark.range(100, 110, 1, 3).selectExpr("CAST(id AS STRING) AS id").coalesce(1), batch_id=1)
print("BATCH", json.dumps({"first": first["action"], "rows": first["rows"], "again": again["action"],
                           "one": [one["rows"], one["handles"]]}))
c.close()
# A sink that prepares the whole batch with a Spark job of its own (FileSink(writer="spark")).
c = Coordinator(FileSink(batch_out + "-spark", format="parquet", writer="spark"), log_location=batch_log + "-spark",
                name="connect-spark-writer")
print("SPARK_WRITER", json.dumps({"rows": c.write(df, batch_id=0)["rows"], "again": c.write(df, batch_id=0)["action"]}))
c.close()
c = Coordinator(FileSink(out, format="jsonl"), log_location=log, name="nock")
q = (spark.readStream.format("rate").option("rowsPerSecond", 50).load().writeStream.foreachBatch(c)
     .option("checkpointLocation", ck).start())
try:
    q.awaitTermination(120)
except Exception as e:
    print("QUERY FAILED:", str(e).splitlines()[0][:2000])
    sys.exit(3)
sys.exit(0)
"""


@LOCAL_CONNECT
def test_over_spark_connect_batch_writes_work_and_a_query_without_the_checkpoint_location_is_refused(tmp_path):
    """A batch DataFrame: ``Coordinator.write`` from a Connect client writes once per batch id.
    A streaming query: Connect offers foreachBatch no query id, so the coordinator needs the
    checkpoint to read it from, and says so at the first batch before anything is written."""
    out, log, batch_out = tmp_path / "out", tmp_path / "log", tmp_path / "batch-out"
    r = subprocess.run([sys.executable, "-c", _NO_CHECKPOINT, str(out), str(log), str(tmp_path / "ck"),
                        str(batch_out), str(tmp_path / "batch-log")],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 3, (r.stdout[-2000:], r.stderr[-3000:])
    batch = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("BATCH "))[6:])
    assert batch == {"first": "committed", "rows": 100, "again": "skipped", "one": [10, 1]}
    ids = [json.loads(line)["id"] for p in batch_out.iterdir() if p.is_file() and not p.name.startswith("_")
           for line in p.read_text().splitlines() if line]
    assert sorted(ids, key=int) == [str(i) for i in range(110)]
    import pyarrow.parquet as pq

    spark_writer = json.loads(next(line for line in r.stdout.splitlines() if line.startswith("SPARK_WRITER "))[13:])
    assert spark_writer == {"rows": 100, "again": "skipped"}
    parts = [p for p in (tmp_path / "batch-out-spark").iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    assert sorted(pq.read_table(parts).column("id").to_pylist(), key=int) == [str(i) for i in range(100)]
    assert "QUERY FAILED" in r.stdout
    assert "pass Coordinator(checkpoint_location=...)" in r.stdout + r.stderr
    # Nothing written: no output file, no log (it was never taken).
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]
    assert not log.exists()


@LOCAL_CONNECT
def test_the_spark_connect_example_writes_every_id_once(tmp_path):
    """examples/spark_connect.py, as docs/clusters.md's "Spark Connect" section runs it."""
    inp = tmp_path / "in"
    inp.mkdir()
    for f in range(3):
        (inp / f"f{f}.json").write_text("".join(json.dumps({"id": f"c{f}-{i:04d}", "n": i}) + "\n"
                                                for i in range(100)))
    common = ["--input", str(inp), "--output", str(tmp_path / "out"), "--checkpoint", str(tmp_path / "ck")]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "examples.spark_connect", *common], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "examples.spark_connect", *common, "--verify"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    verdict = json.loads(r.stdout)
    assert verdict["records_in"] == verdict["records_out"] == 300, verdict
    assert verdict["exactly_once"] and r.returncode == 0


def _start_client(cmd: list[str], log) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


@pytest.fixture
def own_connect_server():
    """A Connect server of this test's own (port 7191): the test kills it, never the shared one."""
    from tests.services.spark_connect import KILL_TEST_PORT, SparkConnectService

    server = SparkConnectService("spark_connect_kill", KILL_TEST_PORT)
    info = server.start()
    yield server, info
    server.stop()


def _killed_apart(tmp_path, server, cmd: list[str], log_dir: Path, batches: int) -> None:
    """The scenario of the two tests below, for a query of ``batches`` micro-batches whose
    coordinator logs to ``log_dir``: the client dies with the server running on (an orphan run,
    whose coordinator goes on committing); a new client starts the query again while the orphan
    may still write (Spark stops the orphan run; the new coordinator takes the log); then the
    server dies mid-batch (the client's call ends with an error within seconds: twophase bounds
    its gRPC retries, issue 26) and comes back; clients run until the query is done."""

    def committed_batches() -> int:
        return sum(1 for _, _, fs in os.walk(log_dir) for f in fs if "committed" in f.lower())

    with open(tmp_path / "clients.log", "ab") as log:
        # 1. The client dies; the server runs on (its session, its query, its coordinator).
        c1 = _start_client(cmd, log)
        wait_until(lambda: committed_batches() >= 1 or c1.poll() is not None, 240, "a first committed batch")
        assert c1.poll() is None, "the first client ended before it could be killed"
        os.killpg(c1.pid, signal.SIGKILL)
        c1.wait()
        at_kill = committed_batches()
        # 2. A new client starts the same query while the orphan run may still be writing (its
        # output apart: what it says after the server's death is checked below).
        before = _log_records(log_dir)
        c2_out = tmp_path / "client2.log"
        c2 = _start_client(cmd, c2_out.open("ab"))

        def epoch() -> int:
            return max(int(p.name.split(".")[0]) for p in (log_dir / "epochs").iterdir())

        first = epoch()
        wait_until(lambda: epoch() > first or c2.poll() is not None, 240,
                   "the second client's coordinator to take the log")
        orphan = committed_batches() - at_kill
        print(f"client 1 killed after {at_kill} committed batches; the orphan run committed {orphan} more "
              f"before the second client's coordinator took the log (epoch {epoch()})")
        assert orphan >= 1, "the server did not run the query on after its client died"
        wait_until(lambda: _log_records(log_dir) > before + 1 or c2.poll() is not None, 240, "the log to move again")
        # 3. The server dies mid-work (its driver, its foreachBatch worker, its tasks).  The client's
        # call (awaitTermination) ends with an error within seconds (bound_connect_retries: about
        # 10 s of retries; pyspark's own policy waits about ten minutes); then the server comes back.
        # It must land while the query still has work: the second client still waits on it, and
        # (counted once the server is dead, so nothing commits after the look) batches are left.
        # A kill after the query finished would test nothing of the scenario.
        assert c2.poll() is None, f"the query ended (exit {c2.returncode}) before the server's death"
        waited = _kill_server_and_time_the_client(server, c2)
        at_server_kill = committed_batches()
        print(f"the server died with {at_server_kill} of {batches} batches committed; the client "
              f"ended {waited:.1f} s later, exit {c2.returncode}")
        said = c2_out.read_text(errors="replace")
        assert at_server_kill < batches, f"the server died after the query's last batch: {said[-3000:]}"
        # The query was not done: the server's death ended the client's call with an error.
        assert c2.returncode != 0, said[-3000:]
        assert "UNAVAILABLE" in said or "Connection refused" in said, said[-3000:]
        server.start()
        # 4. Clients until the query has consumed everything.
        for _ in range(3):
            c3 = _start_client(cmd, log)
            if c3.wait(timeout=400) == 0:
                break
        assert c3.returncode == 0, (tmp_path / "clients.log").read_text(errors="replace")[-4000:]


@pytest.mark.timeout(900)
@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time: FileSink's orphaned Connect runs are harmless (staged files under names of "
                           "their own); the scenario where they are not is PostgreSQL's twin below; "
                           "TWOPHASE_FULL_CHAOS=1 runs it")
def test_files_exactly_once_when_the_connect_client_and_the_connect_server_are_killed_apart(tmp_path,
                                                                                             own_connect_server):
    """A Connect server that outlives its clients (see :func:`_killed_apart`), FileSink: every id is
    committed once, nothing is left staged."""
    server, spark_connect_service = own_connect_server
    inp, out, ck = tmp_path / "in", tmp_path / "out", tmp_path / "ck"
    inp.mkdir()
    expected = []
    for f in range(14):
        ids = [f"s{f}-{i:04d}" for i in range(150)]
        expected += ids
        (inp / f"f{f}.json").write_text("".join(json.dumps({"id": i, "n": n}) + "\n" for n, i in enumerate(ids)))
    cmd = [sys.executable, "-m", "examples.spark_connect", "--input", str(inp), "--output", str(out),
           "--checkpoint", str(ck), "--remote", spark_connect_service["url"]]
    _killed_apart(tmp_path, server, cmd, ck / "twophase", 14)
    import pyarrow.parquet as pq

    parts = [p for p in out.iterdir() if p.is_file() and not p.name.startswith(("_", "."))]
    actual = [i for p in parts for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    verdict = chaos.verify(expected, actual)
    assert verdict.exactly_once, verdict.to_dict()
    staged = [p for p in (out / "_twophase").rglob("*") if p.is_file()] if (out / "_twophase").exists() else []
    assert staged == []


@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_postgres_exactly_once_when_the_connect_client_and_the_connect_server_are_killed_apart(
        tmp_path, own_connect_server, postgres_service, monkeypatch):
    """Issue 27: the same scenario where an orphan run is not harmless.  The orphan's coordinator
    holds prepared transactions and decisions of its own while the second client's coordinator
    takes the log over; then the server dies with whatever it had prepared.  Every id is in the
    table once, and nothing of the query is left prepared."""
    from tests.test_postgres_chaos import DRIVER, _leftovers, _new_table, _table_ids, _write_input

    info = postgres_service
    server, spark_connect_service = own_connect_server
    table = _new_table(info, "connect_apart")
    name = f"pgapart-{uuid.uuid4().hex[:6]}"
    expected, _ = _write_input(tmp_path / "in", files=14, rows=150, keys=50)
    dsn = f"host={info['host']} port={info['port']} dbname={info['dbname']} user={info['user']}"
    cmd = [sys.executable, DRIVER, "--input", str(tmp_path / "in"), "--checkpoint", str(tmp_path / "ck"),
           "--dsn", dsn, "--table", table, "--mode", "insert", "--name", name,
           "--remote", spark_connect_service["url"]]
    monkeypatch.setenv("PGPASSWORD", info["password"])  # the clients' (inherited by _start_client)
    _killed_apart(tmp_path, server, cmd, tmp_path / "ck" / "twophase", 14)
    verdict = chaos.verify(expected, _table_ids(info, table))
    assert verdict.exactly_once, verdict.to_dict()
    assert verdict.records_out == len(expected) == 14 * 150
    assert _leftovers(info, name) == []


_WAITS_ON_THE_SERVER = """
import sys, time
from pyspark.sql import SparkSession
from twophase.spark import bound_connect_retries

spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate()
if sys.argv[2] == "bounded":
    bound_connect_retries(spark)
print("READY", flush=True)
t0 = time.monotonic()
try:  # a call that waits on the server (a JVM-side sleep of ten minutes)
    spark.range(0, 1, 1, 1).selectExpr("reflect('java.lang.Thread', 'sleep', CAST(600000 AS BIGINT))").collect()
except Exception as e:
    print("FAILED", round(time.monotonic() - t0, 1), type(e).__name__, str(e).replace(chr(10), " ")[:500], flush=True)
    sys.exit(3)
"""


@pytest.mark.timeout(300)
def test_a_client_whose_connect_server_died_fails_its_call_within_seconds(tmp_path, own_connect_server):
    """Issue 26: pyspark retries an unreachable Connect server for about ten minutes; a session
    through ``twophase.spark.bound_connect_retries`` ends the call with UNAVAILABLE within seconds."""

    server, info = own_connect_server
    with open(tmp_path / "client.log", "w") as log:
        client = _start_client([sys.executable, "-c", _WAITS_ON_THE_SERVER, info["url"], "bounded"], log)
        wait_until(lambda: "READY" in (tmp_path / "client.log").read_text() or client.poll() is not None, 120,
                   "the client's session")
        time.sleep(3)  # the call is running on the server
        assert client.poll() is None, (tmp_path / "client.log").read_text()[-3000:]
        waited = _kill_server_and_time_the_client(server, client)
    said = (tmp_path / "client.log").read_text(errors="replace")
    assert client.returncode == 3, said[-3000:]
    assert "UNAVAILABLE" in said, said[-3000:]
    assert waited < 40, waited
