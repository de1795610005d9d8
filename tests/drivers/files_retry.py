"""Driver for task-retry and configuration tests, run in its own process (its own SparkContext).

``python -m tests.drivers.files_retry MODE OUT LOG``:
- ``retry``: master local[2,3]; attempt 0 of partition 0 pre-commits, then fails -> retried.
- ``speculation``: spark.speculation=true -> the coordinator must refuse before writing.
Prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import sys

from twophase import TransactionContext
from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink
from twophase.spark import local_session


class FailingFirstAttempt(FileSink):
    """Attempt 0 of partition 0 pre-commits its staged file, then the task dies."""

    def pre_commit(self, txn):
        handle = super().pre_commit(txn)
        ctx: TransactionContext = txn.ctx
        if ctx.partition_id == 0 and ctx.attempt == 0:
            raise RuntimeError("injected executor failure after pre_commit")
        return handle


def main(mode: str, out: str, log: str) -> None:
    if mode == "retry":
        spark = local_session("local[2,3]", app_name="retry")
        sink = FailingFirstAttempt(out)
    elif mode == "speculation":
        spark = local_session("local[2]", app_name="spec", conf={"spark.speculation": "true"})
        sink = FileSink(out)
    else:
        raise SystemExit(f"unknown mode {mode}")
    df = spark.range(0, 1000, numPartitions=2).selectExpr("id", "cast(id as string) as v")
    coord = Coordinator(sink, log_location=log, name="retry", driver_batch_rows=0)  # task retries: tasks
    try:
        progress = coord.write(df, batch_id=0)
        print(json.dumps({"ok": True, "progress": progress}))
    except Exception as e:  # the test inspects the message
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)}))
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:4])
