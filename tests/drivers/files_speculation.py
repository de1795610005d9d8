"""Driver for tests/test_files_speculation.py, run on the test cluster with ``spark.speculation=true``.

``python -m tests.drivers.files_speculation ROOT LOG MARKERS``: a batch whose partition 0 runs twice:
its first attempt writes all its rows and then fails, and a second attempt writes them again; each
attempt leaves ``MARKERS/p<partition>-a<attempt>``.  (Spark never runs a speculative copy on the host
of the original attempt, and both workers of the test cluster are 127.0.0.1, so the second attempt
is a retry; what makes either safe is the same: Spark's output committer commits one attempt's
files per task and discards the other's.)  ``FileSink(writer="arrow")`` is refused by the
coordinator (per-task transactions cannot isolate two attempts); ``FileSink(writer="spark")``
writes the batch once (Spark's output committer lets one attempt of a task commit), through
``Coordinator.write`` into ``ROOT`` (a local path every executor of the test cluster shares).
"""

from __future__ import annotations

import sys

from tests.cluster import cluster_session, emit

SPECULATION = {
    "spark.speculation": "true",
    "spark.speculation.interval": "100ms",
    "spark.speculation.quantile": "0.5",
    "spark.speculation.multiplier": "1.5",
    "spark.speculation.minTaskRuntime": "500ms",
}
ROWS = 1000


def main(root: str, log: str, markers: str) -> None:
    from twophase.coordinator import Coordinator
    from twophase.errors import ConfigurationError
    from twophase.sinks.files import FileSink

    spark = cluster_session("twophase-speculation", conf=SPECULATION)

    def failing_first_attempt(batches):
        import os as _os

        from pyspark import TaskContext

        ctx = TaskContext.get()
        part, attempt = ctx.partitionId(), ctx.attemptNumber()
        open(_os.path.join(markers, f"p{part}-a{attempt}"), "w").close()
        yield from batches
        if part == 0 and attempt == 0:
            raise RuntimeError("the first attempt of partition 0 fails after writing all its rows")

    df = spark.range(0, ROWS, numPartitions=2).mapInArrow(failing_first_attempt, "id long")
    refused = None
    try:
        Coordinator(FileSink(root + "-arrow", writer="arrow"), log_location=log + "-arrow", name="spec-arrow",
                    shared_storage=True, driver_batch_rows=0).write(df, batch_id=0)  # speculation: tasks
    except ConfigurationError as e:
        refused = str(e)
    sink = FileSink(root, writer="spark")
    c = Coordinator(sink, log_location=log, name="spec-spark", shared_storage=True, driver_batch_rows=0)
    progress = c.write(df, batch_id=0)
    c.close()
    emit("result", refused=refused, supports_speculation=sink.supports_speculation,
         action=progress["action"], rows=progress["rows"])


if __name__ == "__main__":
    main(*sys.argv[1:])
