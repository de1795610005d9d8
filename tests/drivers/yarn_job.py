"""A PySpark job for YARN (tests/test_yarn.py): JSON-lines files -> Spark -> Coordinator(FileSink).

Submitted with ``spark-submit --master yarn`` (tests/services/yarn.py, ``spark_submit_command``):
the master comes from spark-submit, so the session is ``SparkSession.builder.getOrCreate()``.
In cluster mode this runs inside the ApplicationMaster's container; a second attempt (after the
first was killed) runs it again from the start, and the query resumes from its checkpoint while the
coordinator recovers its transaction log.  One input file per micro-batch
(``trigger(availableNow=True)``); exits 0 once all are committed.  Paths are absolute (the driver's
working directory is its container's).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files (id, file, amount)")
    ap.add_argument("--output", required=True, help="FileSink folder (local path on every node)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--name", default="yarn-files")
    ap.add_argument("--partitions", type=int, default=2)
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "py4j.clientserver", "py4j.java_gateway"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink

    spark = SparkSession.builder.appName(args.name).getOrCreate()
    # CONTAINER_ID (set by the NodeManager) names the attempt: container_<app>_<attempt>_<n>.
    print(f"yarn-files driver: application {spark.sparkContext.applicationId} "
          f"container {os.environ.get('CONTAINER_ID')}", file=sys.stderr, flush=True)
    coordinator = Coordinator(FileSink(args.output, format="parquet"), checkpoint_location=args.checkpoint,
                              name=args.name, retry_backoff=0.1, shared_storage=True)

    df = (spark.readStream.schema("id STRING, file INT, amount INT").option("maxFilesPerTrigger", 1)
          .json(args.input)).repartition(args.partitions)
    query = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
