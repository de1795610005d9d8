"""JSON files -> Spark -> ``format("twophase-files")``: the driver the data source kill tests start and kill.

Usage: python -m tests.drivers.datasource_pipeline INPUT_DIR OUTPUT_DIR CHECKPOINT_DIR [FILES_PER_TRIGGER].
A streaming query with ``trigger(availableNow=True)`` over every file in INPUT_DIR (one JSON
object per line, an ``id``); exits 0 once all of it is committed to OUTPUT_DIR.
"""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str]) -> int:
    inp, out, checkpoint = argv[:3]
    per_trigger = argv[3] if len(argv) > 3 else "1"
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("twophase").setLevel(logging.INFO)
    import twophase.datasource
    from twophase.spark import local_session

    spark = local_session(os.environ.get("TWOPHASE_TEST_MASTER", "local[2]"), "datasource-pipeline")
    twophase.datasource.register(spark)
    q = (spark.readStream.schema("id STRING, n LONG").option("maxFilesPerTrigger", per_trigger).json(inp)
         .repartition(2)
         .writeStream.format("twophase-files").option("checkpointLocation", checkpoint)
         .trigger(availableNow=True).start(out))
    q.awaitTermination()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
