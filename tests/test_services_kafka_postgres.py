"""Smoke tests proving the Kafka and PostgreSQL test services are the real servers.

Kafka: transactions are committed/aborted and filtered by isolation level, a second
producer with the same transactional.id fences the first, and Spark's Kafka source
(jars from ``spark_kafka_jars``) reads from the broker.
PostgreSQL: a prepared transaction outlives its SIGKILLed client and a server restart.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid

import pytest

pytestmark = pytest.mark.services

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --------------------------------------------------------------------------- Kafka

def _uid() -> str:
    return uuid.uuid4().hex[:10]


def _txn_producer(bootstrap: str, tid: str):
    from confluent_kafka import Producer

    p = Producer({
        "bootstrap.servers": bootstrap,
        "transactional.id": tid,
        "transaction.timeout.ms": 60000,
        "enable.idempotence": True,
        "linger.ms": 5,
    })
    p.init_transactions(30)
    return p


def _create_topic(bootstrap: str, topic: str, partitions: int = 1) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fut = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic]
    fut.result(30)


def _read_all(bootstrap: str, topic: str, isolation: str, partitions: int = 1, timeout: float = 30.0) -> list[str]:
    """Every value of ``topic`` from the beginning up to the end visible at ``isolation``."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, TopicPartition

    c = Consumer({
        "bootstrap.servers": bootstrap,
        "group.id": f"smoke-{_uid()}",
        "enable.auto.commit": False,
        "enable.partition.eof": True,
        "isolation.level": isolation,
    })
    try:
        c.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        values: list[str] = []
        at_eof: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(at_eof) < partitions:
            assert time.monotonic() < deadline, f"did not reach the end of {topic} ({isolation})"
            msg = c.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    at_eof.add(msg.partition())
                    continue
                raise AssertionError(f"consumer error: {msg.error()}")
            values.append(msg.value().decode())
        return values
    finally:
        c.close()


@pytest.mark.kafka
def test_kafka_transactions_are_filtered_by_isolation_level(kafka_service):
    bootstrap = kafka_service["bootstrap_servers"]
    topic = f"smoke-txn-{_uid()}"
    _create_topic(bootstrap, topic)
    p = _txn_producer(bootstrap, f"smoke-tid-{_uid()}")

    committed = [f"committed-{i}" for i in range(5)]
    aborted = [f"aborted-{i}" for i in range(4)]
    p.begin_transaction()
    for v in committed:
        p.produce(topic, v.encode())
    p.commit_transaction(30)
    p.begin_transaction()
    for v in aborted:
        p.produce(topic, v.encode())
    assert p.flush(30) == 0  # the aborted records really reached the log before the abort
    p.abort_transaction(30)

    rc = _read_all(bootstrap, topic, "read_committed")
    ru = _read_all(bootstrap, topic, "read_uncommitted")
    assert sorted(set(rc)) == sorted(committed) and len(rc) == len(committed)
    assert sorted(set(ru)) == sorted(committed + aborted) and len(ru) == len(committed + aborted)


@pytest.mark.kafka
def test_kafka_same_transactional_id_fences_the_first_producer(kafka_service):
    from confluent_kafka import KafkaError, KafkaException

    bootstrap = kafka_service["bootstrap_servers"]
    topic = f"smoke-fence-{_uid()}"
    _create_topic(bootstrap, topic)
    tid = f"smoke-fence-tid-{_uid()}"

    first = _txn_producer(bootstrap, tid)
    first.begin_transaction()
    first.produce(topic, b"zombie-0")
    assert first.flush(30) == 0

    second = _txn_producer(bootstrap, tid)  # bumps the epoch and aborts first's open transaction

    with pytest.raises(KafkaException) as exc:
        first.produce(topic, b"zombie-1")
        first.flush(10)
        first.commit_transaction(30)
    err = exc.value.args[0]
    fenced_codes = {KafkaError._FENCED, KafkaError.PRODUCER_FENCED, KafkaError.INVALID_PRODUCER_EPOCH}
    assert err.fatal() and err.code() in fenced_codes, f"not a fatal fencing error: {err!r}"
    # The fatal error is sticky: the zombie can do no more transactional work.
    with pytest.raises(KafkaException):
        first.begin_transaction()

    second.begin_transaction()
    second.produce(topic, b"fresh-0")
    second.commit_transaction(30)

    assert _read_all(bootstrap, topic, "read_committed") == ["fresh-0"]
    assert sorted(_read_all(bootstrap, topic, "read_uncommitted")) == ["fresh-0", "zombie-0"]


SPARK_READER = textwrap.dedent("""
    import json, sys
    from pyspark.sql import SparkSession

    bootstrap, topic, jars, checkpoint = sys.argv[1:5]
    spark = (SparkSession.builder.master("local[1]").appName("kafka-smoke")
             .config("spark.jars", jars)
             .config("spark.driver.memory", "1g")
             .config("spark.sql.shuffle.partitions", "2")
             .config("spark.ui.enabled", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("WARN")
    df = (spark.readStream.format("kafka")
          .option("kafka.bootstrap.servers", bootstrap)
          .option("subscribe", topic)
          .option("startingOffsets", "earliest")
          .option("kafka.isolation.level", "read_committed")
          .load())
    q = (df.selectExpr("CAST(value AS STRING) AS v").writeStream
         .format("memory").queryName("smoke").outputMode("append")
         .option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    if q.exception() is not None:
        raise SystemExit(f"query failed: {q.exception()}")
    values = [r.v for r in spark.sql("SELECT v FROM smoke").collect()]
    print("RESULT " + json.dumps(values), flush=True)
    spark.stop()
""")


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_spark_kafka_source_reads_from_the_broker(kafka_service, tmp_path):
    from tests.services.kafka import spark_kafka_jars

    bootstrap = kafka_service["bootstrap_servers"]
    topic = f"smoke-spark-{_uid()}"
    _create_topic(bootstrap, topic, partitions=2)
    p = _txn_producer(bootstrap, f"smoke-spark-tid-{_uid()}")
    committed = [f"spark-{i}" for i in range(40)]
    p.begin_transaction()
    for i, v in enumerate(committed):
        p.produce(topic, v.encode(), partition=i % 2)
    p.commit_transaction(30)
    p.begin_transaction()  # an aborted transaction that read_committed must hide
    for i in range(6):
        p.produce(topic, f"spark-aborted-{i}".encode(), partition=i % 2)
    p.flush(30)
    p.abort_transaction(30)

    jars = spark_kafka_jars()
    assert any("spark-sql-kafka-0-10" in j for j in jars) and all(os.path.isabs(j) for j in jars)
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable)
    r = subprocess.run(
        [sys.executable, "-c", SPARK_READER, bootstrap, topic, ",".join(jars), str(tmp_path / "ckpt")],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=540,
    )
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and lines, f"spark reader failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    values = json.loads(lines[-1][len("RESULT "):])
    assert sorted(values) == sorted(committed)


# --------------------------------------------------------------------------- PostgreSQL

def _connect(info, autocommit: bool = True):
    import psycopg2

    conn = psycopg2.connect(info["dsn"], connect_timeout=10)
    conn.autocommit = autocommit
    return conn


def _q(info, query: str, args=()):
    conn = _connect(info)
    try:
        with conn.cursor() as cur:
            cur.execute(query, args)
            return cur.fetchall() if cur.description else None
    finally:
        conn.close()


def _prepared_gids(info) -> set[str]:
    return {r[0] for r in _q(info, "SELECT gid FROM pg_prepared_xacts WHERE database = current_database()")}


@pytest.fixture
def pg_table(postgres_service):
    table = f"smoke_{_uid()}"
    _q(postgres_service, f"CREATE TABLE {table} (id int PRIMARY KEY, v text NOT NULL)")
    gids: list[str] = []
    yield table, gids
    for gid in set(gids) & _prepared_gids(postgres_service):  # never leave locks behind
        _q(postgres_service, "ROLLBACK PREPARED %s", (gid,))
    _q(postgres_service, f"DROP TABLE IF EXISTS {table}")


@pytest.mark.postgres
def test_postgres_settings_for_two_phase_commit(postgres_service):
    assert int(_q(postgres_service, "SHOW max_prepared_transactions")[0][0]) >= 64
    assert _q(postgres_service, "SHOW fsync")[0][0] == "on"
    assert _q(postgres_service, "SELECT current_user, current_database()")[0] == ("twophase", "twophase")
    assert _q(postgres_service, "SELECT inet_server_port()")[0][0] == postgres_service["port"]


PREPARING_CHILD = textwrap.dedent("""
    import sys, time
    import psycopg2
    dsn, table, gid = sys.argv[1:4]
    conn = psycopg2.connect(dsn)
    cur = conn.cursor()  # psycopg2 opens the transaction (BEGIN) implicitly
    cur.executemany(f"INSERT INTO {table} VALUES (%s, %s)", [(i, f"row-{i}") for i in range(3)])
    cur.execute("PREPARE TRANSACTION %s", (gid,))
    print("PREPARED", flush=True)
    time.sleep(600)
""")


@pytest.mark.postgres
def test_postgres_prepared_transaction_survives_killed_client(postgres_service, pg_table):
    table, gids = pg_table
    gid = f"smoke-kill-{_uid()}"
    gids.append(gid)
    child = subprocess.Popen(
        [sys.executable, "-c", PREPARING_CHILD, postgres_service["dsn"], table, gid],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = child.stdout.readline()
        assert line.strip() == "PREPARED", f"child failed: {line!r} {child.stderr.read() if child.poll() is not None else ''}"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(10)
    assert child.returncode == -signal.SIGKILL

    assert gid in _prepared_gids(postgres_service)
    assert _q(postgres_service, f"SELECT count(*) FROM {table}")[0][0] == 0  # prepared, not yet visible
    _q(postgres_service, "COMMIT PREPARED %s", (gid,))
    assert gid not in _prepared_gids(postgres_service)
    rows = _q(postgres_service, f"SELECT id, v FROM {table} ORDER BY id")
    assert rows == [(0, "row-0"), (1, "row-1"), (2, "row-2")]


@pytest.mark.postgres
@pytest.mark.alone("restarts the shared PostgreSQL server")
def test_postgres_prepared_transaction_survives_server_restart(postgres_service, pg_table):
    from tests.services.postgres import SERVICE

    table, gids = pg_table
    gid = f"smoke-restart-{_uid()}"
    gids.append(gid)
    conn = _connect(postgres_service, autocommit=False)
    with conn.cursor() as cur:
        cur.execute(f"INSERT INTO {table} VALUES (1, 'durable')")
        cur.execute("PREPARE TRANSACTION %s", (gid,))
    conn.close()

    pid_before = SERVICE.pid()
    started_before = _q(postgres_service, "SELECT pg_postmaster_start_time()")[0][0]
    info = SERVICE.restart()
    assert info == postgres_service
    assert SERVICE.pid() not in (None, pid_before)
    assert _q(postgres_service, "SELECT pg_postmaster_start_time()")[0][0] > started_before

    assert gid in _prepared_gids(postgres_service)
    assert _q(postgres_service, f"SELECT count(*) FROM {table}")[0][0] == 0
    _q(postgres_service, "COMMIT PREPARED %s", (gid,))
    assert _q(postgres_service, f"SELECT v FROM {table}") == [("durable",)]
