"""Payments from Kafka into a PostgreSQL ledger, no duplicate payment after a failover
(Hazelcast Jet's "fault-tolerant pipelines" guide: exactly-once 2PC sinks vs at-least-once
with an idempotent sink).

Two variants of the same pipeline, side by side:

``--variant exactly-once`` (default): ``Coordinator(PostgresSink(mode="insert"))``.
The ``ledger`` table has NO unique constraint: nothing in the database stops a
duplicate; each batch's rows go in prepared transactions that the coordinator
commits exactly once, so a replay after a driver failover cannot re-apply a payment.
Costs: one prepared transaction per partition and batch, a transaction-log write per
batch, rows visible only when the batch commits.

``--variant at-least-once``: Spark's checkpoint + ``INSERT ... ON CONFLICT
(payment_id) DO NOTHING`` (Hazelcast's idempotent MERGE).  Replayed batches
re-insert and the unique key discards the duplicates.  Cheaper and rows become
visible as each task finishes, but it needs a unique payment id in every event
and an output whose only effect is that keyed row: an ``UPDATE balance = balance
+ amount`` or an e-mail per payment would still happen twice.

Commands (PGPASSWORD in the environment)::

    python -m examples.payments_ledger generate --bootstrap 127.0.0.1:9092 --topic payments --records 1000
    python -m examples.payments_ledger run --bootstrap 127.0.0.1:9092 --topic payments \\
        --dsn "host=127.0.0.1 port=5432 dbname=twophase user=twophase" --checkpoint /tmp/pay-ck
    python -m examples.payments_ledger verify --bootstrap ... --topic payments --dsn ...
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections import Counter
from typing import Any

from examples import _common
from examples.wordcount_jdbc import produce as _produce
from examples.wordcount_jdbc import read_topic

COLUMNS = ["payment_id", "account", "amount_cents"]


def make_payments(n: int, seed: int = 5, accounts: int = 25) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"payment_id": f"pay-{i:07d}", "account": f"acct-{rng.randrange(accounts):03d}",
             "amount_cents": rng.randint(1, 100_000)} for i in range(n)]


def produce(bootstrap: str, topic: str, payments: list[dict[str, Any]]) -> None:
    """Append the payments to ``topic`` as JSON values keyed by payment_id."""
    _produce(bootstrap, topic, payments, key="payment_id")


def create_table(dsn: str, table: str, variant: str) -> None:
    from psycopg2 import sql

    key = sql.SQL(" PRIMARY KEY") if variant == "at-least-once" else sql.SQL("")
    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("CREATE TABLE IF NOT EXISTS {} (payment_id text NOT NULL{}, account text NOT NULL, "
                            "amount_cents bigint NOT NULL)").format(sql.Identifier(table), key))


def payments(df):
    from pyspark.sql import functions as F

    r = F.from_json(F.col("value").cast("string"), "payment_id STRING, account STRING, amount_cents LONG")
    return df.select(r.alias("r")).select("r.payment_id", "r.account", "r.amount_cents")


def run(args: argparse.Namespace) -> int:
    create_table(args.dsn, args.table, args.variant)
    spark = _common.session("payments-ledger", kafka=True, jars=args.jars)
    src = _common.kafka_source(spark, args.bootstrap, args.topic, max_offsets=args.max_offsets)
    if args.variant == "exactly-once":
        from twophase.coordinator import Coordinator
        from twophase.sinks.postgres import PostgresSink

        sink = PostgresSink(args.dsn, table=args.table, mode="insert", password={"env": "PGPASSWORD"},
                            lock_timeout="20s")
        coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name)

        def each_batch(df, batch_id: int) -> None:
            coordinator(payments(df), batch_id)
    else:
        from twophase.spark import clear_interrupted_start

        clear_interrupted_start(args.checkpoint)  # the Coordinator does this in the other variant
        upsert = _common.at_least_once_upsert(args.dsn, args.table, COLUMNS, ["payment_id"])

        def each_batch(df, batch_id: int) -> None:
            upsert(payments(df), batch_id)
    q = (src.writeStream.foreachBatch(each_batch).option("checkpointLocation", args.checkpoint)
         .trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def ledger(dsn: str, table: str) -> list[tuple[str, str, int]]:
    from psycopg2 import sql

    with _common.pg_connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(sql.SQL("SELECT payment_id, account, amount_cents FROM {}").format(sql.Identifier(table)))
        return [(p, a, int(c)) for p, a, c in cur.fetchall()]


def balances(rows) -> Counter:
    b: Counter = Counter()
    for r in rows:
        b[r[1] if isinstance(r, tuple) else r["account"]] += r[2] if isinstance(r, tuple) else r["amount_cents"]
    return b


def check(expected: list[dict[str, Any]], rows: list[tuple[str, str, int]]) -> dict[str, Any]:
    """Payment ids exactly once (chaos.verify) and every account balance equal to the input's."""
    from twophase.chaos import verify as by_id

    v = by_id([p["payment_id"] for p in expected], [r[0] for r in rows])
    want, got = balances(expected), balances(rows)
    wrong = sorted(a for a in set(want) | set(got) if want[a] != got[a])
    return dict(v.to_dict(), wrong_balances=len(wrong), wrong_balance_sample=wrong[:5],
                ok=v.exactly_once and not wrong)


def verify(args: argparse.Namespace) -> int:
    expected = [json.loads(v) for v in read_topic(args.bootstrap, args.topic)]
    res = check(expected, ledger(args.dsn, args.table))
    print(json.dumps(res))
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.payments_ledger", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="append N payment events (unique payment_id) to the topic")
    g.add_argument("--bootstrap", required=True)
    g.add_argument("--topic", required=True)
    g.add_argument("--records", type=int, default=1000)
    g.add_argument("--seed", type=int, default=5)
    r = sub.add_parser("run", help="apply every payment in the topic to the ledger, then exit")
    _common.add_kafka_args(r)
    _common.add_pg_args(r)
    r.add_argument("--topic", required=True)
    r.add_argument("--table", default="ledger")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--name", default="payments-ledger")
    r.add_argument("--variant", choices=("exactly-once", "at-least-once"), default="exactly-once")
    v = sub.add_parser("verify", help="each payment once in the ledger, balances equal to the input's")
    v.add_argument("--bootstrap", required=True)
    v.add_argument("--topic", required=True)
    _common.add_pg_args(v)
    v.add_argument("--table", default="ledger")
    args = ap.parse_args(argv)
    _common.setup_logging()
    if args.cmd == "generate":
        produce(args.bootstrap, args.topic, make_payments(args.records, args.seed))
        return 0
    return run(args) if args.cmd == "run" else verify(args)


if __name__ == "__main__":
    sys.exit(main())
