"""Shared plumbing of the examples: Spark session, Kafka source, PostgreSQL connection, offsets files.

Runs on the driver.  Nothing here is part of twophase's API; the examples keep
it in one place so that each example module shows only its pipeline.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import Any


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("twophase").setLevel(logging.INFO)


def kafka_jars(explicit: str | None) -> list[str]:
    """Jars of Spark's Kafka source: ``--jars`` if given, else the test services' cached copies."""
    if explicit:
        return [j for j in explicit.split(",") if j]
    try:
        from tests.services.kafka import spark_kafka_jars
    except ImportError as e:  # pragma: no cover - run outside the repository
        raise SystemExit("give --jars with spark-sql-kafka-0-10_2.13 and its dependencies "
                         f"(tests.services.kafka is not importable: {e})") from None
    return spark_kafka_jars()


def session(app: str, *, kafka: bool = False, jars: str | None = None, master: str | None = None):
    """A small local Spark session (local[2] unless ``TWOPHASE_EXAMPLE_MASTER`` or ``master``).

    Under ``spark-submit`` the session is spark-submit's: its ``--master``, ``--py-files`` and
    ``--conf`` settings stand, nothing is overridden (``--jars`` for Kafka are the caller's too).
    """
    if "PYSPARK_GATEWAY_PORT" in os.environ:  # launched by spark-submit (which started the JVM)
        from pyspark.sql import SparkSession

        return SparkSession.builder.appName(app).getOrCreate()
    from twophase.spark import local_session

    conf: dict[str, Any] = {}
    if kafka:
        conf["spark.jars"] = ",".join(kafka_jars(jars))
    return local_session(master or os.environ.get("TWOPHASE_EXAMPLE_MASTER", "local[2]"), app, conf)


def add_kafka_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port")
    ap.add_argument("--jars", default=None, help="comma-separated jars of Spark's Kafka source "
                    "(default: the ones `python -m tests.services start kafka` caches)")
    ap.add_argument("--max-offsets", type=int, default=300,
                    help="maxOffsetsPerTrigger: records per micro-batch (default 300)")


def add_pg_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dsn", required=True,
                    help="libpq connection string WITHOUT the password (the password comes from PGPASSWORD)")


def kafka_source(spark, bootstrap: str, topic: str, *, starting_offsets: str = "earliest",
                 max_offsets: int | None = None):
    """Spark's Kafka source over ``topic`` (key, value, topic, partition, offset, timestamp)."""
    r = (spark.readStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
         .option("subscribe", topic).option("startingOffsets", starting_offsets)
         .option("failOnDataLoss", "true"))
    if max_offsets:
        r = r.option("maxOffsetsPerTrigger", str(max_offsets))
    return r.load()


def pg_connect(dsn: str):
    """A psycopg2 connection (autocommit) from a DSN without password; libpq takes PGPASSWORD."""
    import psycopg2

    c = psycopg2.connect(dsn)
    c.autocommit = True
    return c


def read_spark_offsets(checkpoint: str, batch_id: int) -> list[Any] | None:
    """The source offsets Spark logged in ``<checkpoint>/offsets/<batch_id>`` (one entry per source).

    For the Kafka source an entry is ``{"topic": {"partition": end_offset}}``: where the
    batch ENDS, i.e. where the next batch starts.  None when the file does not exist.
    """
    path = os.path.join(checkpoint, "offsets", str(batch_id))
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    return [json.loads(line) if line != "-" else None for line in lines[2:]]


def at_least_once_upsert(dsn: str, table: str, columns: list[str], key_columns: list[str],
                         password_env: str = "PGPASSWORD"):
    """A ``foreachBatch`` function WITHOUT twophase: plain INSERT ... ON CONFLICT (key) DO NOTHING.

    The classic at-least-once + idempotent writer: a replayed batch re-inserts its
    rows and the unique key turns the duplicates into no-ops.  Each partition
    writes in its own ordinary transaction (executor side).
    """
    env_password = os.environ.get(password_env)

    def write_partition(rows):
        import psycopg2
        from psycopg2 import sql
        from psycopg2.extras import execute_values

        stmt = sql.SQL("INSERT INTO {t} ({c}) VALUES %s ON CONFLICT ({k}) DO NOTHING").format(
            t=sql.Identifier(table), c=sql.SQL(", ").join(sql.Identifier(c) for c in columns),
            k=sql.SQL(", ").join(sql.Identifier(k) for k in key_columns))

        data = [tuple(r[c] for c in columns) for r in rows]
        if not data:
            return
        conn = psycopg2.connect(dsn, password=env_password) if env_password else psycopg2.connect(dsn)
        try:
            with conn, conn.cursor() as cur:
                execute_values(cur, stmt.as_string(cur), data, page_size=500)
        finally:
            conn.close()

    def foreach_batch(df, batch_id: int) -> None:
        df.select(*columns).foreachPartition(write_partition)

    return foreach_batch
