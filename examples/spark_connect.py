"""Exactly-once from a Spark Connect client: JSON files -> Spark -> FileSink, started over Spark Connect.

The pipeline is the same code as with a classic session; only the session is built with
``SparkSession.builder.remote(...)``.  The query's ``foreachBatch`` function, the
:class:`~twophase.coordinator.Coordinator`, is pickled by this client and runs in the Connect
server's ``foreachBatch`` worker (a Python process next to the server's driver), so twophase must
be importable by the server's Python and by the executors.  Over Connect the coordinator learns
the query's id from its checkpoint: give it the query's ``checkpointLocation``.

    python -m examples.spark_connect --input IN --output OUT --checkpoint CK [--remote sc://host:15002]

``--remote local[2]`` (the default) has pyspark start a Connect server of its own in a JVM of
this process, as ``SparkSession.builder.remote("local[2]")`` does.  Then every committed id is
counted: ``... --verify`` reads the output and prints records, lost and duplicated.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)  # the local server's Python workers
    from pyspark.sql import SparkSession

    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink
    from twophase.spark import bound_connect_retries

    # A dead server ends this client's call within seconds (pyspark alone retries for minutes).
    spark = bound_connect_retries(SparkSession.builder.remote(args.remote).appName("twophase-connect").getOrCreate())

    sink = FileSink(args.output, format="parquet")
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name="connect-copy")
    query = (spark.readStream.schema("id STRING, n INT").option("maxFilesPerTrigger", 1).json(args.input)
             .writeStream.foreachBatch(coordinator)
             .option("checkpointLocation", args.checkpoint)
             .trigger(availableNow=True)
             .start())
    query.awaitTermination()
    spark.stop()
    return 0


def verify(args: argparse.Namespace) -> int:
    import pyarrow.parquet as pq

    from twophase.chaos import verify as count

    expected = [json.loads(line)["id"] for p in sorted(Path(args.input).glob("*.json"))
                for line in p.read_text().splitlines() if line]
    parts = [p for p in sorted(Path(args.output).glob("*")) if p.is_file() and not p.name.startswith(("_", "."))]
    out = [i for p in parts for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    v = count(expected, out)
    print(json.dumps(v.to_dict()))
    return 0 if v.exactly_once else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.spark_connect", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", required=True, help="folder of JSON-lines files with fields id, n")
    ap.add_argument("--output", required=True, help="FileSink output folder")
    ap.add_argument("--checkpoint", required=True, help="the query's checkpoint (and the coordinator's log)")
    ap.add_argument("--remote", default="local[2]",
                    help="Spark Connect URL, e.g. sc://host:15002 (default local[2]: a server of our own)")
    ap.add_argument("--verify", action="store_true", help="count the committed ids instead of running")
    args = ap.parse_args(argv)
    return verify(args) if args.verify else run(args)


if __name__ == "__main__":
    sys.exit(main())
