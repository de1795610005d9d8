"""Where a small Kafka batch's time goes, step by step, in issue 63's query (the default coordinator).

A ``rate-micro-batch`` source (``--rows`` rows a batch in 2 partitions), ``CAST(value AS STRING)
AS key, CAST(timestamp AS STRING) AS value``, into a new 2-partition topic through
``foreachBatch(Coordinator(KafkaSink(...)))`` with every other option at its default (the driver
path after the first batch).  Each step is timed by a wrapper around the sink's methods, the Kafka
protocol client's requests and the coordinator's collect; after ``--warmup`` batches, the median of
``--batches`` batches is printed per step (``sum/batch``: the step's total per batch, for steps
that run several times in one).  Run from the repository root with Kafka up
(``python -m tests.services start kafka``)::

    .venv/bin/python benchmarks/tools/kafka_small_batch_steps.py --rows 100

Its figures: docs/benchmarks.md, "Kafka's small batches, step by step".  The wrappers cost a few
microseconds a call; Spark's own ``durationMs`` comes from ``python -m benchmarks --only latency``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import sys
import tempfile
import time
import uuid

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "../..")))
os.environ.setdefault("TWOPHASE_KEEP_SERVICES", "1")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=100, help="rows per batch (default 100)")
    ap.add_argument("--batches", type=int, default=25, help="timed batches (default 25)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed batches first (default 5)")
    args = ap.parse_args(argv)

    from benchmarks.common import _create_topic
    from tests import services
    from twophase.coordinator import Coordinator, driver_path
    from twophase.sinks.kafka import KafkaSink
    from twophase.sinks.kafka import protocol as kp
    from twophase.spark import local_session

    times: dict[str, list[float]] = collections.defaultdict(list)
    current = {"batch": -1}

    def timed(owner, name: str, label: str | None = None) -> None:
        f = getattr(owner, name)

        @functools.wraps(f)
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return f(*a, **kw)
            finally:
                if current["batch"] >= args.warmup:
                    times[label or name].append((time.perf_counter() - t0) * 1000)

        setattr(owner, name, wrapper)

    for name in ("plan_batch", "_bump_plan_fence", "begin_transaction", "_describe", "_check_plan_fence", "_claim",
                 "write", "pre_commit", "_first_offsets", "_topic_ids", "commit", "abort_lingering"):
        timed(KafkaSink, name, f"sink.{name}")
    for name in ("init_producer_id", "describe_transactions", "describe_producers", "end_txn", "topic_ids"):
        timed(kp.TxnClient, name, f"request.{name}")
    timed(driver_path._DriverPath, "_driver_rows", "coordinator.collect (driver path)")
    timed(driver_path._DriverPath, "_prepare_in_driver", "coordinator.transaction (driver path)")
    timed(driver_path, "_few_partitions", "coordinator.collect: partitions counted")

    bootstrap = services.get("kafka").start()["bootstrap_servers"]
    topic = f"steps-{uuid.uuid4().hex[:8]}"
    _create_topic(bootstrap, topic, 2)
    spark = local_session("local[2]", app_name="twophase-kafka-steps")
    checkpoint = tempfile.mkdtemp(prefix="twophase-kafka-steps-")
    coordinator = Coordinator(KafkaSink(bootstrap_servers=bootstrap, topic=topic,
                                        transactional_id_prefix=f"steps-{uuid.uuid4().hex[:8]}"),
                              checkpoint_location=checkpoint, name="steps")

    def each_batch(df, batch_id: int) -> None:
        current["batch"] = batch_id
        t0 = time.perf_counter()
        coordinator(df, batch_id)
        if batch_id >= args.warmup:
            times["foreachBatch (the whole call)"].append((time.perf_counter() - t0) * 1000)
        print(f"[steps] batch {batch_id} {coordinator.last_progress['task_input']}", file=sys.stderr)

    query = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", args.rows)
             .option("numPartitions", 2).load()
             .selectExpr("CAST(value AS STRING) AS key", "CAST(timestamp AS STRING) AS value")
             .writeStream.foreachBatch(each_batch).option("checkpointLocation", checkpoint).start())
    try:
        while len(times["foreachBatch (the whole call)"]) < args.batches and query.isActive:
            time.sleep(0.5)
    finally:
        query.stop()
        coordinator.close()
    if query.exception() is not None:
        print(f"the query failed: {query.exception()}", file=sys.stderr)
        return 1
    n = len(times["foreachBatch (the whole call)"])
    print(f"{args.rows} rows a batch, {n} batches after {args.warmup} of warm-up; ms")
    print(f"{'step':40s} {'calls':>6s} {'median':>8s} {'sum/batch':>10s}")
    for name, values in sorted(times.items()):
        print(f"{name:40s} {len(values):6d} {statistics.median(values):8.1f} {sum(values) / n:10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
