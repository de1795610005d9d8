"""Issue 47's coalescing stream writer under the faults a fresh-context review found (each test
failed before its fix).

``twophase.register(spark)`` coalesces a ``twophase-*`` query's micro-batches to
``twophase.coalesce`` partitions (``auto``: the application's cores) and sets
``twophase.maxPartitions`` to that count, so the plan sizes each batch's ballot to it.

- A batch run again gets a ballot sized by its earlier ballot *and* by what the new run allows:
  before, by the earlier ballot alone, so a batch whose first run was coalesced to 2 and whose
  replay had more partitions (a restart on more cores, another ``twophase.coalesce``, or without
  ``register()``, where the query keeps its 200 shuffle partitions) failed on every restart
  ("partition 2 ... beyond the 2 transactions its plan allows").
- ``start()`` checks the options in the client; a Spark Connect client without the target's
  driver (psycopg2) still starts a query its server runs.
- ``auto`` stays within what the target allows (PostgreSQL's ``max_prepared_transactions / 2``)
  on an application with more cores than that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_datasource import _inputs, _path, _read

pytestmark = [pytest.mark.spark, pytest.mark.chaos]

REPO = Path(__file__).resolve().parent.parent


def _driver(tmp_path: Path, name: str, *extra: str, crash_at: str | None = None, discovery: bool = False,
            timeout: float = 420) -> subprocess.CompletedProcess:
    """One run of the stateful pipeline on ``tmp_path``'s input and checkpoint; its log in ``name``.log."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TWOPHASE_CRASH") and k != "TWOPHASE_PAUSE_AT"}
    env["PYTHONPATH"] = _path(REPO, REPO / "discovery") if discovery else _path(REPO)
    if crash_at:
        env["TWOPHASE_CRASH_AT"] = crash_at
        env["TWOPHASE_CRASH_LOG"] = str(tmp_path / "crashes.log")
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(tmp_path / "ck"),
           "twophase-files", "--path", str(tmp_path / "out"), "--dedup", *extra]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    (tmp_path / f"{name}.log").write_text(r.stdout + "\n---- stderr\n" + r.stderr)
    return r


def _why(r: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in r.stderr.splitlines() if "beyond the" in ln or "Error" in ln or "twophase" in ln]
    return "\n".join(lines[-8:])[-3000:]


def test_a_replayed_batch_gets_a_ballot_as_wide_as_the_new_run_allows(tmp_path):
    """The plan alone, in this process (a checkpoint as Spark leaves it: ``metadata``,
    ``offsets/0``): batch 0 planned with ``twophase.maxPartitions=2`` and never decided, then
    planned again by a run that allows 4: its new ballot has 4 transactions (before: 2), and a
    third run allowing 1 keeps 4 (a ballot never narrows below the batch's earlier one)."""
    import json
    import uuid

    from pyspark.sql.types import StringType, StructField, StructType

    from twophase.datasource import FilesDataSource

    ck = tmp_path / "ck"
    (ck / "offsets").mkdir(parents=True)
    (ck / "metadata").write_text(json.dumps({"id": str(uuid.uuid4())}))
    (ck / "offsets" / "0").write_text("v1\n{}\n")
    schema = StructType([StructField("id", StringType())])

    def planned(max_partitions: int) -> int:
        ds = FilesDataSource({"path": str(tmp_path / "out"), "checkpointlocation": str(ck),
                              "twophase.maxpartitions": str(max_partitions)})
        plan = ds.streamWriter(schema, False).plan
        assert plan is not None and plan.action == "write" and plan.batch_id == 0
        return plan.partitions

    assert planned(2) == 2
    assert planned(4) == 4
    assert planned(1) == 4


@pytest.mark.timeout(900)
def test_a_batch_first_run_coalesced_to_2_is_replayed_with_more_partitions_after_a_crash(tmp_path):
    """Run 1 (register(), coalesced to the 2 cores) dies in the planner just after batch 0's INTENT
    (its ballot: 2 transactions).  Run 2 restarts the same checkpoint as a driver that does not
    call ``register()`` (the formats from Spark's discovery; the query's 200 shuffle partitions):
    every id once.  Before, batch 0's new ballot was sized by the crashed one (2), and partition 2
    failed ("beyond the 2 transactions its plan allows") on every restart."""
    expected = _inputs(tmp_path / "in", files=1, rows=40)
    r1 = _driver(tmp_path, "run1", crash_at="after_intent:0")
    assert r1.returncode != 0, "run 1 should have died at the crash point"
    assert (tmp_path / "crashes.log").read_text().split()[:2] == ["after_intent", "0"]
    r2 = _driver(tmp_path, "run2", "--no-register", discovery=True)
    assert r2.returncode == 0, f"the restarted query failed:\n{_why(r2)}"
    assert sorted(_read(tmp_path / "out")) == sorted(expected)


_CONNECT_JDBC = r"""
import sys
sys.modules["psycopg2"] = None  # this client has pyspark's Connect client and twophase, not the PostgreSQL driver
from pyspark.sql import SparkSession
import twophase
src, ck, url, jdbc, table, user, password = sys.argv[1:8]
spark = SparkSession.builder.remote(url).getOrCreate()
twophase.register(spark)
q = (spark.readStream.schema("id STRING, n LONG").json(src).select("id").writeStream.format("twophase-jdbc")
     .option("url", jdbc).option("dbtable", table).option("user", user).option("password", password)
     .option("checkpointLocation", ck).trigger(availableNow=True).start())
q.awaitTermination()
print("DONE", q.exception() is None)
"""


@pytest.mark.postgres
@pytest.mark.connect
@pytest.mark.timeout(600)
def test_a_connect_client_without_the_postgres_driver_starts_a_jdbc_query_its_server_runs(
        spark_connect_service, postgres_service, db, tmp_path):
    """The Spark Connect server writes (its Python workers have psycopg2); the client only sends
    the plan.  ``start()`` builds the sink in the client (``_check_at_start``); before, a client
    without psycopg2 got ``MissingDependencyError`` there for a query the server runs.  Now the
    query runs and every id lands once."""
    import uuid

    info = postgres_service
    table = f"review_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id text NOT NULL)')
    try:
        expected = _inputs(tmp_path / "in", files=1, rows=20)
        r = subprocess.run([sys.executable, "-c", _CONNECT_JDBC, str(tmp_path / "in"), str(tmp_path / "ck"),
                            spark_connect_service["url"],
                            f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}", table, info["user"],
                            info["password"]],
                           capture_output=True, text=True, timeout=500, env=dict(os.environ, PYTHONPATH=_path(REPO)))
        assert "DONE True" in r.stdout, (r.stdout[-1500:], r.stderr[-2500:])
        with db.cursor() as cur:
            cur.execute(f'SELECT id FROM "{table}"')
            assert sorted(row[0] for row in cur.fetchall()) == sorted(expected)
    finally:
        with db.cursor() as cur:
            cur.execute(f'DROP TABLE IF EXISTS "{table}"')


@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_auto_coalesce_on_an_application_with_more_cores_than_postgres_allows_stays_within_its_limit(
        spark, db, postgres_service, tmp_path, monkeypatch):
    """``twophase.coalesce=auto`` coalesces to the application's cores capped by
    ``twophase.maxPartitions`` (200 for jdbc), and ``start()`` accepts it; but the plan caps a
    PostgreSQL batch at ``max_prepared_transactions / 2`` (64 on the test server).  On an
    application with 100 cores (simulated: ``twophase.spark.default_parallelism`` answers 100, as
    Spark's defaultParallelism does there; the query runs on the shared local[2] session) the
    stateful query at 200 shuffle partitions was coalesced to 100 partitions and partition 64
    failed: the first batch, and every restart.  Now ``auto`` is capped by what the target allows
    (asked of the sink at ``start()``): the query runs, every id once."""
    import uuid

    import twophase.datasource
    import twophase.spark

    twophase.datasource.register(spark)
    monkeypatch.setattr(twophase.spark, "default_parallelism", lambda _spark: 100)
    before = spark.conf.get("spark.sql.shuffle.partitions")
    spark.conf.set("spark.sql.shuffle.partitions", "200")
    info = postgres_service
    table = f"review_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute("SHOW max_prepared_transactions")
        assert int(cur.fetchone()[0]) // 2 < 100
        cur.execute(f'CREATE TABLE "{table}" (id text NOT NULL)')
    try:
        expected = _inputs(tmp_path / "in", files=1, rows=40)
        df = (spark.readStream.schema("id STRING, n LONG").json(str(tmp_path / "in"))
              .selectExpr("id", "current_timestamp() AS ts").withWatermark("ts", "10 minutes")
              .dropDuplicatesWithinWatermark(["id"]).select("id"))
        q = (df.writeStream.format("twophase-jdbc")
             .option("url", f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}")
             .option("dbtable", table).option("user", info["user"]).option("password", info["password"])
             .option("checkpointLocation", str(tmp_path / "ck")).trigger(availableNow=True).start())
        try:
            q.awaitTermination(500)
        except Exception:  # noqa: BLE001 - the query's failure: asserted below
            pass
        finally:
            q.stop()
        assert q.exception() is None, str(q.exception())[:1500]
        with db.cursor() as cur:
            cur.execute(f'SELECT id FROM "{table}"')
            assert sorted(row[0] for row in cur.fetchall()) == sorted(expected)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", before)
        with db.cursor() as cur:
            cur.execute(f'DROP TABLE IF EXISTS "{table}"')
