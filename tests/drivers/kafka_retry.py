"""Task-retry driver for KafkaSink, run in its own process (master local[2,3]).

``python -m tests.drivers.kafka_retry BOOTSTRAP TOPIC PREFIX LOG MODE``: writes ids 0..3999 in
4 partitions with ``Coordinator.write``.  MODE ``exit``: attempt 0 of partition 0 produces and
flushes 1000 rows, then its Python worker dies (os._exit, no abort); ``raise``: the same attempt
raises after writing (the coordinator aborts it).  The retried attempt must fence the first.
Prints one JSON line with the outcome.
"""

from __future__ import annotations

import json
import os
import sys

from twophase.coordinator import Coordinator
from twophase.sinks.kafka import KafkaSink
from twophase.spark import local_session


class FailingFirstAttempt(KafkaSink):
    def write(self, txn, batch):
        super().write(txn, batch)
        ctx = txn.ctx
        if ctx.partition_id == 0 and ctx.attempt == 0 and txn.rows >= 1000:
            txn.producer.flush(30)  # the rows are on the broker, inside the open transaction
            if os.environ.get("KAFKA_RETRY_MODE") == "exit":
                os._exit(3)
            raise RuntimeError("injected executor failure after 1000 rows were produced")


def main(bootstrap: str, topic: str, prefix: str, log: str, mode: str) -> None:
    os.environ["KAFKA_RETRY_MODE"] = mode
    spark = local_session("local[2,3]", app_name="kafka-retry",
                          conf={"spark.sql.execution.arrow.maxRecordsPerBatch": "250",
                                "spark.executorEnv.KAFKA_RETRY_MODE": mode})
    df = spark.range(0, 4000, numPartitions=4).selectExpr("cast(id as string) as value")
    coord = Coordinator(FailingFirstAttempt(bootstrap, topic, prefix, transaction_timeout_ms=60_000),
                        log_location=log, name="kafka-retry", driver_batch_rows=0)  # a task retried: tasks
    try:
        progress = coord.write(df, batch_id=0)
        print(json.dumps({"ok": True, "progress": progress}))
    except Exception as e:
        print(json.dumps({"ok": False, "error": type(e).__name__, "message": str(e)[:2000]}))
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:6])
