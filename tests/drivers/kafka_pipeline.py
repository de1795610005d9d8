"""Kafka source -> Spark -> Coordinator(KafkaSink) -> Kafka: the driver the Kafka kill tests start and kill.

Usage: python -m tests.drivers.kafka_pipeline BOOTSTRAP IN_TOPIC OUT_TOPIC CHECKPOINT_DIR TID_PREFIX
[MAX_OFFSETS_PER_TRIGGER] [--cluster | --connect].  ``--cluster``: on the test Spark cluster
(tests/cluster.py) instead of local[2]; ``--connect``: as a Spark Connect client of a local[2]
server that pyspark starts (the coordinator then runs in the server's foreachBatch worker).  Runs a streaming query with ``trigger(availableNow=True)`` over
everything in IN_TOPIC and exits 0 once all of it is committed to OUT_TOPIC.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
    cluster, connect = "--cluster" in argv, "--connect" in argv
    argv = [a for a in argv if a not in ("--cluster", "--connect")]
    bootstrap, in_topic, out_topic, checkpoint, prefix = argv[:5]
    max_offsets = int(argv[5]) if len(argv) > 5 else 200
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("twophase").setLevel(logging.INFO)
    from tests.services.kafka import spark_kafka_jars
    from twophase.coordinator import Coordinator
    from twophase.sinks.kafka import KafkaSink
    from twophase.spark import local_session

    jars = {"spark.jars": ",".join(spark_kafka_jars())}  # Spark ships them to the executors
    if cluster:
        from tests.cluster import cluster_session

        spark = cluster_session("twophase-kafka-pipeline", jars)
    else:
        spark = local_session(os.environ.get("TWOPHASE_TEST_MASTER", "local[2]"), "kafka-pipeline", jars,
                              connect=connect)
    src = (spark.readStream.format("kafka")
           .option("kafka.bootstrap.servers", bootstrap)
           .option("subscribe", in_topic)
           .option("startingOffsets", "earliest")
           .option("maxOffsetsPerTrigger", str(max_offsets))
           .load())
    # Same shape as for .format("kafka"): key and value.
    out = src.selectExpr("key", "value")
    # The default timeout (5 min): pending transactions should outlive driver restarts, which take
    # 1-2 minutes each on a loaded 2-core machine (120 s was too short: DataLossError, as designed).
    sink = KafkaSink(bootstrap, out_topic, prefix)
    # The kill tests aim after_pre_commit (and executor kills) at writing tasks: driver_batch_rows=0
    # keeps "auto" on the task paths, never the driver path.
    coordinator = Coordinator(sink, checkpoint_location=checkpoint, name="kafka-pipeline", driver_batch_rows=0)
    q = (out.writeStream.foreachBatch(coordinator)
         .option("checkpointLocation", checkpoint)
         .trigger(availableNow=True)
         .start())
    q.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
