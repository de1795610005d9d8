"""A PySpark job for YARN (tests/test_yarn.py): JSON-lines files -> Spark -> Coordinator(<sink>).

Submitted with ``spark-submit --master yarn`` (tests/services/yarn.py, ``spark_submit_command``):
the master comes from spark-submit, so the session is ``SparkSession.builder.getOrCreate()``.
In cluster mode this runs inside the ApplicationMaster's container; a second attempt (after the
first was killed) runs it again from the start, and the query resumes from its checkpoint while the
coordinator recovers its transaction log.  In client mode it runs where spark-submit runs; a
driver killed there is submitted again with the same checkpoint.  One input file per micro-batch
(``trigger(availableNow=True)``); exits 0 once all are committed.  Paths are absolute (the
driver's working directory is its container's).

``--sink`` names the target and how the rows are shaped for it; ``--sink-config`` is the sink
itself as JSON (``to_config()``; secrets as ``{"env": ...}`` references, which the AM gets through
``spark.yarn.appMasterEnv.*`` and the executors through ``spark.executorEnv.*``), base64url-encoded
like ``--log-options``: YARN's container launch script mangles the quotes of a raw JSON argument
(:func:`encode`):

* ``files``: a local folder every NodeManager sees (``shared_storage``);
* ``hdfs``: an ``hdfs://`` folder (output and its staging on HDFS; the checkpoint and ``--log`` too);
* ``kafka``: the id as the record's key and value;
* ``postgres``: the rows as they are (id, file, amount).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
from typing import Any


def encode(obj: object) -> str:
    """A JSON value as a command-line argument that survives YARN's launch script."""
    return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode()


def decode(arg: str) -> Any:
    return json.loads(base64.urlsafe_b64decode(arg.encode()))


def _python_here() -> dict[str, Any]:
    """This process's container, its Python (``sys.prefix``: a venv's folder) and twophase's file."""
    import twophase

    return {"container": os.environ.get("CONTAINER_ID"), "prefix": sys.prefix, "twophase": twophase.__file__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files (id, file, amount)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--sink", required=True, choices=("files", "hdfs", "kafka", "postgres"))
    ap.add_argument("--sink-config", required=True, help="the sink as JSON (to_config()), encode()d")
    ap.add_argument("--log", default=None, help="transaction log URL (default <checkpoint>/twophase)")
    ap.add_argument("--log-options", default=None, help="storage options of the log URL as JSON, encode()d")
    ap.add_argument("--name", default="yarn-job")
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--lease-timeout", type=float, default=120.0,
                    help="the coordinator's lease_timeout: how long a killed attempt's lease keeps an "
                         "attempt on another host from the log (tests/test_yarn_hosts.py)")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "py4j.clientserver", "py4j.java_gateway", "hdfs", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from pyspark.sql import SparkSession

    from twophase.config import sink_from_config
    from twophase.coordinator import Coordinator

    # The application's name is spark-submit's --name (in client mode a name set here would
    # replace it); --name below is the coordinator's, the same for every submission of the job.
    spark = SparkSession.builder.getOrCreate()
    # CONTAINER_ID (set by the NodeManager) names the attempt: container_<app>_<attempt>_<n>; a
    # client-mode driver has none.  Where the driver's and the executors' Python and twophase come
    # from (a packed venv shipped with --archives, or the submitting machine's venv): one line each.
    print("yarn-job driver: " + json.dumps(dict(
        application=spark.sparkContext.applicationId, **_python_here())), file=sys.stderr, flush=True)
    executors = spark.sparkContext.parallelize(range(4), 4).map(lambda _: _python_here()).collect()
    print("yarn-job executors: " + json.dumps(sorted({json.dumps(e, sort_keys=True) for e in executors})),
          file=sys.stderr, flush=True)
    coordinator = Coordinator(sink_from_config(decode(args.sink_config)),
                              checkpoint_location=args.checkpoint, log_location=args.log,
                              storage_options=decode(args.log_options) if args.log_options else None,
                              name=args.name, retry_backoff=0.1, shared_storage=args.sink == "files",
                              lease_timeout=args.lease_timeout,
                              # Every batch written by Arrow tasks on the executors, as a batch of
                              # production size is ("auto" picks other paths for these small ones).
                              task_input="arrow")

    df = (spark.readStream.schema("id STRING, file INT, amount INT").option("maxFilesPerTrigger", 1)
          .json(args.input)).repartition(args.partitions)
    if args.sink == "kafka":
        df = df.selectExpr("id AS key", "id AS value")
    query = (df.writeStream.foreachBatch(coordinator).option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
