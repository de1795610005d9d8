"""Streaming driver for the HDFS/S3 FileSink kill tests: JSON-lines files -> Spark -> Coordinator(FileSink).

Run as a script; ``twophase.chaos.run_with_faults`` kills it at crash points and at random moments.
It processes every available input file (one per micro-batch, ``trigger(availableNow=True)``) and
exits 0 once all are committed.  ``--sink-config`` is the sink as JSON (``FileSink.to_config()``;
S3 credentials as ``{"env": ...}`` references); ``--log`` / ``--log-options`` put the transaction
log elsewhere than ``<checkpoint>/twophase`` (e.g. on HDFS).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files (id, k, v)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--sink-config", required=True, help="FileSink config as JSON")
    ap.add_argument("--log", default=None, help="transaction log URL (default <checkpoint>/twophase)")
    ap.add_argument("--log-options", default=None, help="storage options of the log URL as JSON")
    ap.add_argument("--name", default="fileschaos")
    # More input partitions than local[2]'s two writer slots: every batch (and every replay,
    # whose rows land in other partitions) is coalesced to the transactions its INTENT planned.
    ap.add_argument("--partitions", type=int, default=6)
    ap.add_argument("--cluster", action="store_true",
                    help="run on the test Spark cluster (tests/cluster.py) instead of local[2]")
    ap.add_argument("--shared-storage", action="store_true",
                    help="a local-path sink that every host of the cluster mounts")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "py4j.clientserver", "py4j.java_gateway", "botocore", "urllib3", "hdfs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from twophase.config import sink_from_config
    from twophase.coordinator import Coordinator
    from twophase.spark import local_session

    if args.cluster:
        from tests.cluster import cluster_session

        spark = cluster_session(f"twophase-{args.name}")
    else:
        spark = local_session("local[2]", app_name=f"twophase-{args.name}")
    sink = sink_from_config(json.loads(args.sink_config))
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, log_location=args.log,
                              storage_options=json.loads(args.log_options) if args.log_options else None,
                              name=args.name, retry_backoff=0.1, shared_storage=args.shared_storage,
                              # The kill tests aim before_begin/after_pre_commit (and executor kills) at
                              # writing tasks: "auto" stays on the task paths, never the driver path.
                              driver_batch_rows=0)
    df = (spark.readStream.schema("id LONG, k STRING, v LONG").option("maxFilesPerTrigger", 1)
          .json(args.input)).repartition(args.partitions)
    query = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
