"""JSON files -> Spark -> ``format("twophase-...")``: the driver the data source kill tests start and kill.

Usage: python -m tests.drivers.datasource_pipeline INPUT_DIR CHECKPOINT_DIR FORMAT [--schema DDL]
[--option KEY=VALUE ...] [--path OUT] [--files-per-trigger N] [--cluster | --connect] [--no-register]
[--coordinator] [--dedup [--shuffle-partitions N]].  ``--dedup``: a stateful query, as real jobs write one:
the rows deduplicated by ``id`` within a watermark (``dropDuplicatesWithinWatermark``) at Spark's default
200 shuffle partitions, or N.
``--coordinator`` (FORMAT twophase-kafka only): the same query through
``foreachBatch(Coordinator(KafkaSink(...)))`` built from the same options (``kafka.bootstrap.servers``,
``topic``, ``twophase.transactionalIdPrefix``, ``twophase.transactionTimeoutMs``), for a test that
runs one scenario through both forms.
``--cluster``: on the test Spark cluster (tests/cluster.py); ``--connect``: as a Spark Connect client
of a local[2] server that pyspark starts in a JVM of this process's own; ``--no-register``: no
``register(spark)``, the formats must come from Spark's discovery of the ``pyspark_twophase_*``
modules on its Python path.  A streaming query with
``trigger(availableNow=True)`` over every file in INPUT_DIR (one JSON object per line); exits 0
once all of it is committed.  The environment's ``PGPASSWORD``, if set, becomes the writer's
``password`` option (never a command-line argument).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any


def add_where_arguments(p: argparse.ArgumentParser) -> None:
    """``--cluster | --connect`` and ``--no-register``, for :func:`session`."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--cluster", action="store_true", help="on the test Spark cluster")
    where.add_argument("--connect", action="store_true", help="as a Spark Connect client")
    p.add_argument("--no-register", action="store_true", help="rely on Spark's discovery of pyspark_twophase_*")


def session(args: argparse.Namespace, app: str) -> Any:
    """The session ``args`` ask for (local[2] by default, ``TWOPHASE_TEST_MASTER`` to change it), the
    data sources registered unless ``--no-register``."""
    import twophase.datasource
    from twophase.spark import local_session

    if args.cluster:
        from tests.cluster import cluster_session

        spark = cluster_session(app)
    else:
        spark = local_session(os.environ.get("TWOPHASE_TEST_MASTER", "local[2]"), app, connect=args.connect)
    if args.connect and not type(spark).__module__.startswith("pyspark.sql.connect"):
        raise SystemExit(f"--connect gave a {type(spark).__module__} session")
    if not args.no_register:
        twophase.datasource.register(spark)
    return spark


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.drivers.datasource_pipeline")
    p.add_argument("input")
    p.add_argument("checkpoint")
    p.add_argument("format", help="twophase-files, twophase-jdbc or twophase-kafka")
    p.add_argument("--schema", default="id STRING, n LONG")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--select", action="append", default=[], metavar="EXPR", help="selectExpr before the write")
    p.add_argument("--path")
    p.add_argument("--files-per-trigger", default="1")
    p.add_argument("--coordinator", action="store_true", help="foreachBatch(Coordinator(KafkaSink)) instead")
    p.add_argument("--dedup", action="store_true", help="deduplicate by id within a watermark, 200 shuffle partitions")
    p.add_argument("--shuffle-partitions", type=int, default=200, metavar="N",
                   help="the stateful query's shuffle partitions with --dedup (default: Spark's 200)")
    add_where_arguments(p)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("twophase").setLevel(logging.INFO)
    spark = session(args, "datasource-pipeline")
    df = spark.readStream.schema(args.schema).option("maxFilesPerTrigger", args.files_per_trigger).json(args.input)
    if args.dedup:
        # Spark's default (the test sessions set 2): fixed in the checkpoint by the first batch.
        spark.conf.set("spark.sql.shuffle.partitions", str(args.shuffle_partitions))
        cols = [f.name for f in df.schema.fields]
        df = (df.selectExpr(*cols, "current_timestamp() AS twophase_ts").withWatermark("twophase_ts", "10 minutes")
              .dropDuplicatesWithinWatermark(["id"]).select(*cols))
    else:
        df = df.repartition(2)
    if args.select:
        df = df.selectExpr(*args.select)
    if args.coordinator:
        if args.format != "twophase-kafka":
            raise SystemExit("--coordinator goes with twophase-kafka")
        from twophase.coordinator import Coordinator
        from twophase.sinks.kafka import KafkaSink

        o = dict(kv.partition("=")[::2] for kv in args.option)
        timeout = {"transaction_timeout_ms": int(o["twophase.transactionTimeoutMs"])} \
            if "twophase.transactionTimeoutMs" in o else {}
        sink = KafkaSink(o["kafka.bootstrap.servers"], o["topic"], o["twophase.transactionalIdPrefix"], **timeout)
        # The scenario the data source runs in Spark's tasks: the Coordinator's batches on tasks too
        # (driver_batch_rows=0: "auto" never takes the driver path), so both forms meet the same faults.
        coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name="pipeline", driver_batch_rows=0)
        q = (df.writeStream.foreachBatch(coordinator)
             .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
        q.awaitTermination()
        spark.stop()
        return 0
    w = df.writeStream.format(args.format).option("checkpointLocation", args.checkpoint)
    for kv in args.option:
        k, _, v = kv.partition("=")
        w = w.option(k, v)
    if os.environ.get("PGPASSWORD"):
        w = w.option("password", os.environ["PGPASSWORD"])
    q = w.trigger(availableNow=True).start(args.path) if args.path else w.trigger(availableNow=True).start()
    q.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
