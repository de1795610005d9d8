"""Streaming driver for the PostgreSQL kill tests: JSON-lines files -> Spark -> Coordinator(PostgresSink).

Run as a script (``python tests/drivers/postgres_pipeline.py --input ... --checkpoint ... --table ...``);
``twophase.chaos.run_with_faults`` kills it at crash points and at random moments.  It processes every
available file (one per micro-batch, ``trigger(availableNow=True)``) and exits 0 once all are committed.
The connection comes from ``--dsn`` without a password plus ``PGPASSWORD`` in the environment.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files (id, k, v)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--dsn", required=True, help="libpq connection string without the password")
    ap.add_argument("--table", required=True)
    ap.add_argument("--schema", default=None)
    ap.add_argument("--mode", choices=("insert", "upsert"), default="insert")
    ap.add_argument("--name", default="pgchaos")
    # More input partitions than local[2]'s two writer slots: every batch (and every replay,
    # whose rows land in other partitions) is coalesced to the transactions its INTENT planned.
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--cluster", action="store_true",
                    help="run on the test Spark cluster (tests/cluster.py) instead of local[2]; the "
                         "executors need PGPASSWORD as spark.executorEnv.PGPASSWORD")
    ap.add_argument("--connect", action="store_true",
                    help="run as a Spark Connect client of a local[2] server that pyspark starts")
    ap.add_argument("--task-input", default="auto", help="Coordinator(task_input=...): auto (default), "
                    "arrow, rows or driver (small batches written by the driver: tests/test_driver_prepared.py)")
    ap.add_argument("--driver-batch-rows", type=int, default=None,
                    help="Coordinator(driver_batch_rows=...) (default: 0 under --task-input auto, so that the "
                         "kill tests' executor points hit writing tasks; else not given: 10,000)")
    ap.add_argument("--remote", metavar="URL",
                    help="run as a Spark Connect client of the running server at URL (sc://host:port), "
                         "which does not share this process's environment: the password goes inline")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from pyspark.sql import functions as F

    from twophase.coordinator import Coordinator
    from twophase.sinks.postgres import PostgresSink
    from twophase.spark import local_session

    password: str | dict[str, str] = {"env": "PGPASSWORD"}
    if args.cluster:
        from tests.cluster import cluster_session

        spark = cluster_session(f"twophase-{args.name}")
    elif args.remote:
        from pyspark.sql import SparkSession

        from twophase.spark import bound_connect_retries

        spark = bound_connect_retries(SparkSession.builder.remote(args.remote)
                                      .appName(f"twophase-{args.name}").getOrCreate())
        password = os.environ["PGPASSWORD"]  # kept in the sink's memory, never logged
    else:
        # Short-lived JVMs under load: C1 only and the serial GC start faster and use less CPU.
        spark = local_session("local[2]", app_name=f"twophase-{args.name}", conf={
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"},
            connect=args.connect)
    sink = PostgresSink(args.dsn, table=args.table, schema=args.schema, mode=args.mode,
                        key_columns=["k"] if args.mode == "upsert" else None,
                        password=password, lock_timeout="20s")
    driver_batch_rows = args.driver_batch_rows
    if driver_batch_rows is None and args.task_input == "auto":
        # The kill tests aim after_pre_commit (and executor kills) at writing tasks, and mid_commit at
        # batches of several handles: "auto" stays on the task paths unless a test asks otherwise.
        driver_batch_rows = 0
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name,
                              retry_backoff=0.1, task_input=args.task_input,
                              driver_batch_rows=driver_batch_rows)
    df = (spark.readStream.schema("id LONG, k LONG, v LONG").option("maxFilesPerTrigger", 1)
          .json(args.input))
    if args.mode == "upsert":
        # One key, one partition: two transactions of a batch never wait on each other's row lock.
        df = df.repartition(args.partitions, F.col("k")).select("k", "v")
    else:
        df = df.repartition(args.partitions)
    query = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
