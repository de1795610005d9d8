"""Streaming driver for the MySQL/MariaDB kill tests: JSON-lines files -> Spark -> Coordinator(MySqlSink).

Run as a script (``python tests/drivers/mysql_pipeline.py --input ... --checkpoint ... --database ...
--table ...``); ``twophase.chaos.run_with_faults`` kills it at crash points and at random moments.  It
processes every available file (one per micro-batch, ``trigger(availableNow=True)``) on local[2] and
exits 0 once all are committed.  The password comes from ``MYSQL_PWD`` in the environment (read by the
sink as a secret reference, never a command-line argument).
"""

from __future__ import annotations

import argparse
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files (id, k, v)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=3306)
    ap.add_argument("--database", required=True)
    ap.add_argument("--user", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--marker-table", default="twophase_commits")
    ap.add_argument("--name", default="mychaos")
    ap.add_argument("--gid-prefix", default="tp", help="the XA gtrids' prefix (the sink's gid_prefix)")
    # More input partitions than local[2]'s two writer slots: every batch (and every replay,
    # whose rows land in other partitions) is coalesced to the transactions its INTENT planned.
    ap.add_argument("--partitions", type=int, default=6)
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from twophase.coordinator import Coordinator
    from twophase.sinks.mysql import MySqlSink
    from twophase.spark import local_session

    # Short-lived JVMs under load: C1 only and the serial GC start faster and use less CPU.
    spark = local_session("local[2]", app_name=f"twophase-{args.name}", conf={
        "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"})
    sink = MySqlSink(args.host, args.port, args.database, args.table, user=args.user,
                     password={"env": "MYSQL_PWD"}, marker_table=args.marker_table, gid_prefix=args.gid_prefix,
                     lock_wait_timeout=20)
    # The kill tests' points (mid_commit: several handles per batch) are the task paths': driver_batch_rows=0
    # keeps "auto" there, never on the driver path.
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name, retry_backoff=0.1,
                              driver_batch_rows=0)
    df = (spark.readStream.schema("id LONG, k LONG, v LONG").option("maxFilesPerTrigger", 1)
          .json(args.input).repartition(args.partitions))
    query = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
