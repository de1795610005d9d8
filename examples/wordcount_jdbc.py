"""Kafka -> windowed word count -> PostgreSQL, exactly once (Apache Apex's Kafka-to-JDBC example).

Reproduces the pipeline of "End-to-End Exactly-Once with Apache Apex" (Apex's
Kafka input operator, a windowed word count, and the JDBC output operator that
stores the last committed window id next to the counts).  Here Spark reads the
Kafka topic; every micro-batch counts the words of its lines per 10-second
event-time window; the counts are *added* to ``word_counts(window_start, word,
count)`` with ``count = count + EXCLUDED.count``.

An additive upsert is NOT idempotent: replaying a batch would count its words
twice, which is why Apex keeps a window id in the database.  Under twophase each
batch's upsert runs inside PostgreSQL prepared transactions that the coordinator
commits exactly once (and re-commits, never re-executes, after a crash), so the
additive form is safe and a window that spans several batches is summed
correctly without watermarks or Spark state.

Commands (PGPASSWORD in the environment)::

    python -m examples.wordcount_jdbc generate --bootstrap 127.0.0.1:9092 --topic lines --records 1500
    python -m examples.wordcount_jdbc run --bootstrap 127.0.0.1:9092 --topic lines \\
        --dsn "host=127.0.0.1 port=5432 dbname=twophase user=twophase" --table word_counts \\
        --checkpoint /tmp/wc-checkpoint
    python -m examples.wordcount_jdbc verify --bootstrap 127.0.0.1:9092 --topic lines --dsn ... --table word_counts

``run`` processes everything in the topic (``trigger(availableNow=True)``) and
exits 0; kill it at any moment and run it again.  ``verify`` recomputes the
counts from the topic and compares them with the table, occurrence by occurrence.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from typing import Any

from examples import _common

WINDOW_SECONDS = 10
VOCABULARY = [f"w{i:02d}" for i in range(20)]
BASE_TS = 1_700_000_000.0


def make_records(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """``n`` lines with unique ids, event times 50 ms apart, 1-5 words each (deterministic)."""
    rng = random.Random(seed)
    return [{"id": i, "ts": BASE_TS + i * 0.05,
             "line": " ".join(rng.choice(VOCABULARY) for _ in range(rng.randint(1, 5)))} for i in range(n)]


def produce(bootstrap: str, topic: str, records: list[dict[str, Any]], key: str = "id") -> None:
    """Append the records to ``topic`` as JSON values keyed by ``record[key]``."""
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    for r in records:
        p.produce(topic, json.dumps(r).encode(), key=str(r[key]).encode())
    if p.flush(60):
        raise RuntimeError(f"could not deliver all records to {topic}")


def read_topic(bootstrap: str, topic: str, idle: float = 3.0, timeout: float = 120.0,
               part: str = "value") -> list[bytes]:
    """Every record's ``part`` ("value" or "key") in ``topic`` (read_committed), until ``idle``
    seconds without records (or ``timeout`` in all)."""
    import time
    import uuid

    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"examples-{uuid.uuid4().hex}",
                  "isolation.level": "read_committed", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        c.assign([TopicPartition(topic, p, 0) for p in md.partitions])
        out: list[bytes] = []
        deadline, last = time.time() + timeout, time.time()
        while time.time() < deadline and time.time() - last < idle:
            msgs = c.consume(1000, 0.2)
            out += [getattr(m, part)() for m in msgs if m.error() is None]
            if msgs:
                last = time.time()
        return out
    finally:
        c.close()


def expected_counts(records: list[dict[str, Any]]) -> Counter:
    """(window start epoch seconds, word) -> count, computed from the input lines."""
    c: Counter = Counter()
    for r in records:
        w = int(r["ts"] // WINDOW_SECONDS * WINDOW_SECONDS)
        for word in r["line"].split(" "):
            c[(w, word)] += 1
    return c


def table_counts(dsn: str, table: str) -> Counter:
    from psycopg2 import sql

    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT extract(epoch FROM window_start)::bigint, word, count FROM {}").format(
            sql.Identifier(table)))
        return Counter({(int(w), word): int(n) for w, word, n in cur.fetchall()})


def occurrences(counts: Counter) -> list[str]:
    """One id per counted word occurrence: ``window|word|n`` for n < count (for chaos.verify)."""
    return [f"{w}|{word}|{i}" for (w, word), n in counts.items() for i in range(n)]


def create_table(dsn: str, table: str) -> None:
    from psycopg2 import sql

    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (window_start timestamptz NOT NULL, "
                            "word text NOT NULL, count bigint NOT NULL, PRIMARY KEY (window_start, word))")
                    .format(sql.Identifier(table)))


def additive_sink_class():
    """``PostgresSink`` in upsert mode whose non-key columns are ADDED to the stored row.

    ``pre_commit`` (executor) merges the transaction's staging table into the
    target with ``col = target.col + EXCLUDED.col`` (summing repeated keys first),
    empties the staging table, then lets PostgresSink write its marker row and
    PREPARE.  Everything stays inside the one prepared transaction.
    """
    from psycopg2 import sql

    from twophase.sinks.postgres import PostgresSink

    class AdditiveUpsertSink(PostgresSink):
        def __init__(self, *args: Any, add_columns: list[str], **kw: Any):
            super().__init__(*args, mode="upsert", **kw)
            self.add_columns = list(add_columns)

        def pre_commit(self, txn):
            if txn.stage is not None:
                target = sql.Identifier(*([self.schema] if self.schema else []), self.table)
                stage = sql.Identifier(*([self.marker_schema] if self.marker_schema else []), txn.stage)
                keys = sql.SQL(", ").join(sql.Identifier(k) for k in self.key_columns)
                adds = sql.SQL(", ").join(sql.Identifier(a) for a in self.add_columns)
                sums = sql.SQL(", ").join(sql.SQL("sum({a})::bigint").format(a=sql.Identifier(a))
                                          for a in self.add_columns)
                sets = sql.SQL(", ").join(sql.SQL("{a} = t.{a} + EXCLUDED.{a}").format(a=sql.Identifier(a))
                                          for a in self.add_columns)
                with txn.conn.cursor() as cur:
                    cur.execute(sql.SQL("INSERT INTO {t} AS t ({k}, {a}) SELECT {k}, {s} FROM {st} GROUP BY {k} "
                                        "ON CONFLICT ({k}) DO UPDATE SET {set}").format(
                        t=target, k=keys, a=adds, s=sums, st=stage, set=sets))
                    cur.execute(sql.SQL("TRUNCATE {}").format(stage))
            return super().pre_commit(txn)

    return AdditiveUpsertSink


def count_words(df):
    """Per micro-batch: lines -> (window_start, word, count).  Runs as a Spark plan on executors."""
    from pyspark.sql import functions as F

    parsed = df.select(F.from_json(F.col("value").cast("string"), "id LONG, ts DOUBLE, line STRING").alias("r"))
    words = parsed.select(F.col("r.ts").cast("timestamp").alias("ts"),
                          F.explode(F.split(F.col("r.line"), " ")).alias("word"))
    return (words.groupBy(F.window("ts", f"{WINDOW_SECONDS} seconds").start.alias("window_start"), "word")
            .agg(F.count(F.lit(1)).alias("count"))
            .coalesce(2))  # each (window, word) is in exactly one partition after the groupBy


def run(args: argparse.Namespace) -> int:
    from twophase.coordinator import Coordinator

    create_table(args.dsn, args.table)
    spark = _common.session("wordcount-jdbc", kafka=True, jars=args.jars)
    sink = additive_sink_class()(args.dsn, table=args.table, key_columns=["window_start", "word"],
                                 add_columns=["count"], password={"env": "PGPASSWORD"}, lock_timeout="20s")
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name)

    def each_batch(df, batch_id: int) -> None:
        coordinator(count_words(df), batch_id)

    src = _common.kafka_source(spark, args.bootstrap, args.topic, max_offsets=args.max_offsets)
    q = (src.writeStream.foreachBatch(each_batch).option("checkpointLocation", args.checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def verify(args: argparse.Namespace) -> int:
    from twophase.chaos import verify as by_id

    records = [json.loads(v) for v in read_topic(args.bootstrap, args.topic)]
    v = by_id(occurrences(expected_counts(records)), occurrences(table_counts(args.dsn, args.table)))
    print(json.dumps(v.to_dict()))
    return 0 if v.exactly_once else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.wordcount_jdbc", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="append N lines (JSON, unique ids) to the input topic")
    g.add_argument("--bootstrap", required=True)
    g.add_argument("--topic", required=True)
    g.add_argument("--records", type=int, default=1500)
    g.add_argument("--seed", type=int, default=1)
    r = sub.add_parser("run", help="run the streaming query over everything in the topic, then exit")
    _common.add_kafka_args(r)
    _common.add_pg_args(r)
    r.add_argument("--topic", required=True)
    r.add_argument("--table", default="word_counts")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--name", default="wordcount-jdbc")
    v = sub.add_parser("verify", help="compare the table with counts computed from the topic")
    v.add_argument("--bootstrap", required=True)
    v.add_argument("--topic", required=True)
    _common.add_pg_args(v)
    v.add_argument("--table", default="word_counts")
    args = ap.parse_args(argv)
    _common.setup_logging()
    if args.cmd == "generate":
        produce(args.bootstrap, args.topic, make_records(args.records, args.seed))
        return 0
    return run(args) if args.cmd == "run" else verify(args)


if __name__ == "__main__":
    sys.exit(main())
