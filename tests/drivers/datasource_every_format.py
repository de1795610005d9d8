"""One Spark session writes a folder of JSON files through every ``format("twophase-...")``, one
streaming query (``trigger(availableNow=True)``) after the other: the smoke test of where the data
sources run (local Spark, the test cluster, a Spark Connect client).

Usage: python -m tests.drivers.datasource_every_format SPEC.json [--cluster | --connect] [--no-register]

SPEC.json: ``{"input": DIR, "schema": DDL, "targets": [{"format": ..., "checkpoint": DIR,
"path": DIR or null, "select": [EXPR, ...], "options": {KEY: VALUE}}, ...]}``.  The environment's
``PGPASSWORD``, if set, becomes the ``password`` option of ``twophase-jdbc`` (never an argument).
Prints one line per target, ``<format> done <rows in Spark's progress>``, and exits 0 once every
query ended.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from tests.drivers.datasource_pipeline import add_where_arguments, session


def run(spark, spec: dict):
    """Write ``spec["input"]`` through each target in turn; yields each target's format once done,
    with the rows Spark's own progress counted for its sink (``sink.numOutputRows``)."""
    src = spark.readStream.schema(spec["schema"]).json(spec["input"]).repartition(2)
    for t in spec["targets"]:
        df = src.selectExpr(*t["select"]) if t.get("select") else src
        w = df.writeStream.format(t["format"]).option("checkpointLocation", t["checkpoint"])
        for k, v in t.get("options", {}).items():
            w = w.option(k, v)
        if t["format"] == "twophase-jdbc" and os.environ.get("PGPASSWORD"):
            w = w.option("password", os.environ["PGPASSWORD"])
        w = w.trigger(availableNow=True)
        q = w.start(t["path"]) if t.get("path") else w.start()
        q.awaitTermination()
        yield t["format"], sum(max(0, p["sink"]["numOutputRows"]) for p in q.recentProgress)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.drivers.datasource_every_format")
    p.add_argument("spec")
    add_where_arguments(p)
    args = p.parse_args(argv)
    with open(args.spec) as f:
        spec = json.load(f)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("twophase").setLevel(logging.INFO)
    spark = session(args, "datasource-every-format")
    for fmt, rows in run(spark, spec):
        print(f"{fmt} done {rows}", flush=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
