"""Kafka -> PostgreSQL with the source offsets committed together with the results
(the transactional and the idempotent examples of Cody Koeninger's "Exactly-once Spark
Streaming from Apache Kafka", TransactionalExample.scala and IdempotentExample.scala).

``--variant transactional`` (default): every Spark task writes its rows into
``events`` AND moves the consumed Kafka partitions' position in ``kafka_offsets``
(topic, part, until_offset) inside the SAME PostgreSQL transaction, the one the
PostgresSink prepares and the coordinator commits.  As in the article, storing
an offset fails when the stored position is not where this batch starts (a gap
or a repeat), which rolls the transaction back.  The end offsets are the ones
Spark recorded for the batch (``<checkpoint>/offsets/N``, passed to the tasks in
the batch's INTENT), and the coordinator also records them in the batch's
PREPARED record: one commit decision for results and input position.

Because the input position lives with the results, the query can be restarted
from a NEW Spark checkpoint (e.g. after a code change the old checkpoint cannot
take) exactly where the committed results end::

    twophase recover OLD_CHECKPOINT/twophase --sink-config ...   # only if a batch was left pending
    python -m examples.kafka_offsets_postgres run ... --checkpoint NEW_CHECKPOINT \\
        --starting-offsets "$(twophase offsets OLD_CHECKPOINT/twophase)"
    # or, as the article does, from the table itself: --starting-offsets from-table

``--variant idempotent``: Spark's own checkpoint + ``INSERT ... ON CONFLICT (id)
DO NOTHING`` without twophase; at-least-once delivery made harmless by a unique
key per message (fine for per-message rows, useless for aggregates).

Commands (PGPASSWORD in the environment)::

    python -m examples.kafka_offsets_postgres generate --bootstrap 127.0.0.1:9092 --topic events --records 1000
    python -m examples.kafka_offsets_postgres run --bootstrap 127.0.0.1:9092 --topic events \\
        --dsn "host=127.0.0.1 port=5432 dbname=twophase user=twophase" --checkpoint /tmp/ev-ck
    python -m examples.kafka_offsets_postgres verify --bootstrap ... --topic events --dsn ...
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from examples import _common
from examples.wordcount_jdbc import read_topic

EVENT_COLUMNS = ["id", "payload", "topic", "part", "kafka_offset"]


def make_records(start: int, n: int) -> list[dict[str, Any]]:
    return [{"id": i, "payload": f"event-{i}"} for i in range(start, start + n)]


def produce(bootstrap: str, topic: str, records: list[dict[str, Any]]) -> None:
    from examples.wordcount_jdbc import produce as _produce

    _produce(bootstrap, topic, records)


def create_tables(dsn: str, table: str, offsets_table: str, variant: str) -> None:
    from psycopg2 import sql

    key = sql.SQL(", PRIMARY KEY (id)") if variant == "idempotent" else sql.SQL("")
    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (id bigint NOT NULL, payload text, topic text, "
                            "part integer, kafka_offset bigint{})").format(sql.Identifier(table), key))
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (topic text NOT NULL, part integer NOT NULL, "
                            "until_offset bigint NOT NULL, PRIMARY KEY (topic, part))").format(
            sql.Identifier(offsets_table)))


def offsets_from_table(dsn: str, offsets_table: str, topic: str) -> dict[str, dict[str, int]] | None:
    """The committed position in Spark's startingOffsets form ``{"topic": {"part": offset}}``."""
    from psycopg2 import sql

    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT part, until_offset FROM {} WHERE topic = %s ORDER BY part").format(
            sql.Identifier(offsets_table)), (topic,))
        rows = cur.fetchall()
    return {topic: {str(p): int(o) for p, o in rows}} if rows else None


class OffsetGapError(RuntimeError):
    """The stored position of a Kafka partition is not where this batch starts."""


def offsets_sink_class():
    """PostgresSink (insert mode) that also moves ``kafka_offsets`` inside each prepared transaction."""
    from psycopg2 import sql

    from twophase.sinks.postgres import PostgresSink

    class OffsetsInTransactionSink(PostgresSink):
        def __init__(self, *args: Any, checkpoint: str, offsets_table: str,
                     starting_offsets: str = "earliest", **kw: Any):
            super().__init__(*args, mode="insert", **kw)
            self.checkpoint = checkpoint
            self.offsets_table = offsets_table
            self.starting_offsets = starting_offsets

        def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
            """Driver: add where the batch starts and ends (Spark's offsets files) to the INTENT."""
            intent = super().plan_batch(query_name, batch_id, num_partitions)
            end = _common.read_spark_offsets(self.checkpoint, batch_id)
            prev = _common.read_spark_offsets(self.checkpoint, batch_id - 1) if batch_id > 0 else None
            if prev is not None:
                start = prev[0]
            elif self.starting_offsets.strip().startswith("{"):
                start = json.loads(self.starting_offsets)
            else:
                start = None  # "earliest"/"latest": the first position is not known here
            return dict(intent, kafka_start=start, kafka_end=end[0] if end else None)

        def write(self, txn, batch) -> None:
            """Executor: remember which Kafka partitions this task's rows came from, then COPY them."""
            seen = txn.extra.setdefault("kafka_partitions", set())
            for t, p in set(zip(batch.column("topic").to_pylist(), batch.column("part").to_pylist())):
                seen.add((t, int(p)))
            super().write(txn, batch)

        def pre_commit(self, txn) -> dict:
            """Executor: check and move the offsets of this task's Kafka partitions, then PREPARE."""
            intent = txn.ctx.intent
            end, start = intent.get("kafka_end"), intent.get("kafka_start")
            seen = txn.extra.get("kafka_partitions", set())
            if seen and end is None:
                raise OffsetGapError(f"{txn.ctx.label}: no Spark offsets for the batch in the INTENT")
            tbl = sql.Identifier(self.offsets_table)
            with txn.conn.cursor() as cur:
                for topic, part in sorted(seen):
                    until = end[topic][str(part)]
                    begin = (start or {}).get(topic, {}).get(str(part))
                    cur.execute(sql.SQL("SELECT until_offset FROM {} WHERE topic = %s AND part = %s "
                                        "FOR UPDATE").format(tbl), (topic, part))
                    row = cur.fetchone()
                    if row is not None and row[0] != begin:
                        raise OffsetGapError(
                            f"{txn.ctx.label}: {topic}[{part}] is committed up to offset {row[0]} but this "
                            f"batch starts at {begin if begin is not None else 'the start of the topic'}; "
                            "restart the query from the committed offsets (`twophase offsets` or "
                            "--starting-offsets from-table)")
                    cur.execute(sql.SQL("INSERT INTO {} (topic, part, until_offset) VALUES (%s, %s, %s) "
                                        "ON CONFLICT (topic, part) DO UPDATE SET until_offset = "
                                        "EXCLUDED.until_offset").format(tbl), (topic, part, until))
            return super().pre_commit(txn)

    return OffsetsInTransactionSink


def events(df):
    from pyspark.sql import functions as F

    r = F.from_json(F.col("value").cast("string"), "id LONG, payload STRING")
    return df.select(r.alias("r"), "topic", F.col("partition").alias("part"),
                     F.col("offset").alias("kafka_offset")).select("r.id", "r.payload", "topic", "part",
                                                                   "kafka_offset")


def run(args: argparse.Namespace) -> int:
    create_tables(args.dsn, args.table, args.offsets_table, args.variant)
    starting = args.starting_offsets
    if starting == "from-table":
        stored = offsets_from_table(args.dsn, args.offsets_table, args.topic)
        starting = json.dumps(stored) if stored else "earliest"
    spark = _common.session("kafka-offsets-postgres", kafka=True, jars=args.jars)
    src = _common.kafka_source(spark, args.bootstrap, args.topic, starting_offsets=starting,
                               max_offsets=args.max_offsets)
    if args.variant == "transactional":
        from twophase.coordinator import Coordinator

        sink = offsets_sink_class()(args.dsn, table=args.table, checkpoint=args.checkpoint,
                                    offsets_table=args.offsets_table, starting_offsets=starting,
                                    password={"env": "PGPASSWORD"}, lock_timeout="20s")
        coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name)

        def each_batch(df, batch_id: int) -> None:
            coordinator(events(df), batch_id)
    else:
        from twophase.spark import clear_interrupted_start

        clear_interrupted_start(args.checkpoint)  # the Coordinator does this in the other variant
        upsert = _common.at_least_once_upsert(args.dsn, args.table, EVENT_COLUMNS, ["id"])

        def each_batch(df, batch_id: int) -> None:
            upsert(events(df), batch_id)
    q = (src.writeStream.foreachBatch(each_batch).option("checkpointLocation", args.checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def table_ids(dsn: str, table: str) -> list[int]:
    from psycopg2 import sql

    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT id FROM {}").format(sql.Identifier(table)))
        return [int(r[0]) for r in cur.fetchall()]


def verify(args: argparse.Namespace) -> int:
    from twophase.chaos import verify as by_id

    expected = [json.loads(v)["id"] for v in read_topic(args.bootstrap, args.topic)]
    v = by_id(expected, table_ids(args.dsn, args.table))
    print(json.dumps(v.to_dict()))
    return 0 if v.exactly_once else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.kafka_offsets_postgres", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="append events with ids START..START+N-1 to the topic")
    g.add_argument("--bootstrap", required=True)
    g.add_argument("--topic", required=True)
    g.add_argument("--start", type=int, default=0)
    g.add_argument("--records", type=int, default=1000)
    r = sub.add_parser("run", help="run the streaming query over everything in the topic, then exit")
    _common.add_kafka_args(r)
    _common.add_pg_args(r)
    r.add_argument("--topic", required=True)
    r.add_argument("--table", default="events")
    r.add_argument("--offsets-table", default="kafka_offsets")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--name", default="kafka-offsets-postgres")
    r.add_argument("--variant", choices=("transactional", "idempotent"), default="transactional")
    r.add_argument("--starting-offsets", default="earliest",
                   help="'earliest', Spark's JSON form (e.g. the output of `twophase offsets LOG`), or "
                        "'from-table' (read kafka_offsets). Only used when the checkpoint is new.")
    o = sub.add_parser("offsets", help="print the committed position from the offsets table "
                                       "(Spark's startingOffsets JSON)")
    _common.add_pg_args(o)
    o.add_argument("--topic", required=True)
    o.add_argument("--offsets-table", default="kafka_offsets")
    v = sub.add_parser("verify", help="every event id of the topic in the table exactly once")
    v.add_argument("--bootstrap", required=True)
    v.add_argument("--topic", required=True)
    _common.add_pg_args(v)
    v.add_argument("--table", default="events")
    args = ap.parse_args(argv)
    _common.setup_logging()
    if args.cmd == "generate":
        produce(args.bootstrap, args.topic, make_records(args.start, args.records))
        return 0
    if args.cmd == "offsets":
        stored = offsets_from_table(args.dsn, args.offsets_table, args.topic)
        if stored is None:
            print(f"no offsets stored for topic {args.topic}", file=sys.stderr)
            return 1
        print(json.dumps(stored, separators=(",", ":")))
        return 0
    return run(args) if args.cmd == "run" else verify(args)


if __name__ == "__main__":
    sys.exit(main())
