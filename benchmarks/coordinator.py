"""Coordinator overhead per micro-batch (a sink that does nothing) and commit latency of a streaming run.

**Overhead** (``Coordinator.write`` with :class:`NullSink`): the sink's methods do
nothing, so what is left is the protocol: start-up checks, the INTENT, PREPARED
and COMMITTED log records (local fsync'd files), handle envelopes, the commit
thread pool and the collect of one handle per partition.  Reported two ways:

- ``overhead_ms`` = median ``total_ms`` of the coordinator minus the median time
  of a plain ``df.mapInArrow(f).collect()`` of the same data, where ``f`` reads
  every batch and returns one row per partition (what any foreachBatch writer
  pays anyway);
- ``protocol_ms`` = median of ``intent_ms + log_ms + commit_ms`` as measured by
  the coordinator itself (the driver-side work, no Spark job).

**Streaming**: a ``rate`` source with ``trigger(processingTime=interval)`` into a
Coordinator + local FileSink; per batch ``commit_ms`` and ``total_ms`` p50/p99.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from benchmarks.common import Params, Variant, goal, interleave, percentile, progress, tmpdir
from twophase.context import TransactionContext
from twophase.sink import CommitResult, TwoPhaseCommitSink


class NullSink(TwoPhaseCommitSink[dict, dict]):
    """Reads every row and keeps nothing; commit is an instant success.  For measuring the coordinator."""

    kind = "null"

    def begin_transaction(self, ctx: TransactionContext) -> dict:
        return {"partition": ctx.partition_id, "rows": 0}

    def write(self, txn: dict, batch) -> None:
        txn["rows"] += batch.num_rows

    def pre_commit(self, txn: dict) -> dict:
        return {"partition": txn["partition"], "rows": txn["rows"]}

    def commit(self, handle: dict) -> CommitResult:
        return CommitResult.committed()

    def abort(self, txn: dict) -> None:
        pass

    def to_config(self) -> dict[str, Any]:
        return {"kind": self.kind}


def _plain_collect(df) -> int:
    import pyarrow as pa

    schema = "partition INT, attempt INT, rows LONG, handle STRING"
    arrow_schema = pa.schema([("partition", pa.int32()), ("attempt", pa.int32()), ("rows", pa.int64()),
                              ("handle", pa.string())])

    def f(batches):
        from pyspark import TaskContext

        tc = TaskContext.get()
        n = 0
        for b in batches:
            n += b.num_rows
        yield pa.RecordBatch.from_pydict({"partition": [tc.partitionId()], "attempt": [tc.attemptNumber()],
                                          "rows": [n], "handle": ["{}"]}, schema=arrow_schema)

    return sum(r["rows"] for r in df.mapInArrow(f, schema).collect())


def _rdd_collect(df) -> int:
    """:func:`_plain_collect` through the RDD API instead of ``mapInArrow``: rows pickled into
    the Python workers, one (partition, rows) pair per task collected."""
    return sum(n for _, n in df.rdd.mapPartitionsWithIndex(lambda i, rows: [(i, sum(1 for _ in rows))]).collect())


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from twophase.coordinator import Coordinator

    coord = Coordinator(NullSink(), log_location=tmpdir("null-log"), name="bench-null")
    batch = iter(range(10**9))

    def coord_run():
        prog = coord.write(df, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return prog

    def plain_run():
        assert _plain_collect(df) == params.rows

    reps = max(params.reps * 2, 3)
    variants = [Variant("Coordinator + NullSink", coord_run), Variant("plain mapInArrow().collect()", plain_run)]
    interleave(variants, reps, params.warmup, "coordinator")
    coord_ms = [p["total_ms"] for p in variants[0].extras]
    plain_ms = [s * 1000 for s in variants[1].seconds]
    protocol = [p["intent_ms"] + p["log_ms"] + p["commit_ms"] for p in variants[0].extras]
    overhead = round(statistics.median(coord_ms) - statistics.median(plain_ms), 2)
    out: dict[str, Any] = {
        "title": "Coordinator overhead",
        "batch": {"coordinator_total_ms": [round(x, 2) for x in coord_ms],
                  "plain_collect_ms": [round(x, 2) for x in plain_ms],
                  "overhead_ms": overhead,
                  "protocol_ms": {"p50": percentile(protocol, 50), "p99": percentile(protocol, 99),
                                  "samples": len(protocol)},
                  "log_ms_p50": percentile([p["log_ms"] for p in variants[0].extras], 50),
                  "commit_ms_p50": percentile([p["commit_ms"] for p in variants[0].extras], 50)},
        "goals": [goal("coordinator overhead < 50 ms per batch (median, overhead_ms)", overhead, 50.0, "<"),
                  goal("coordinator protocol time < 50 ms per batch (median, protocol_ms)",
                       percentile(protocol, 50), 50.0, "<")],
    }
    out["streaming"] = _streaming(spark, params)
    return out


def _streaming(spark, params: Params) -> dict[str, Any]:
    """A real streaming query (rate source) through a Coordinator + local FileSink; per-batch latencies."""
    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink

    per_batch = max(1, params.rows // max(params.stream_batches, 1))
    rate = max(1, int(per_batch / params.trigger_interval))
    ckpt = tmpdir("stream-ckpt")
    coord = Coordinator(FileSink(tmpdir("stream-out"), format="parquet"), checkpoint_location=ckpt,
                        name="bench-stream")
    payload = f"substring(repeat(sha2(cast(value as string), 256), {params.row_size // 64 + 1}), 1, {params.row_size})"
    sdf = (spark.readStream.format("rate").option("rowsPerSecond", rate)
           .option("numPartitions", params.partitions).load()
           .selectExpr("value AS id", f"{payload} AS payload"))
    progress(f"coordinator/streaming: rate {rate} rows/s, trigger {params.trigger_interval}s, "
             f"{params.stream_batches} batches")
    q = (sdf.writeStream.foreachBatch(coord).option("checkpointLocation", ckpt)
         .trigger(processingTime=f"{params.trigger_interval} seconds").start())
    deadline = time.monotonic() + 60 + params.stream_batches * (params.trigger_interval + 10)
    try:
        while len([p for p in coord.recent_progress if p["rows"] > 0]) < params.stream_batches:
            if q.exception() is not None:
                raise RuntimeError(f"streaming benchmark query failed: {q.exception()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"streaming benchmark: only {len(coord.recent_progress)} batches in time")
            time.sleep(0.5)
    finally:
        q.stop()
    progs = [p for p in coord.recent_progress if p["rows"] > 0][: params.stream_batches]
    progress(f"coordinator/streaming: {len(progs)} batches, {sum(p['rows'] for p in progs)} rows")
    commit = [p["commit_ms"] for p in progs]
    total = [p["total_ms"] for p in progs]
    proto = [p["intent_ms"] + p["log_ms"] + p["commit_ms"] for p in progs]
    return {"sink": "FileSink local parquet", "batches": len(progs), "rows": sum(p["rows"] for p in progs),
            "trigger_interval_s": params.trigger_interval,
            "commit_ms": {"p50": percentile(commit, 50), "p99": percentile(commit, 99)},
            "protocol_ms": {"p50": percentile(proto, 50), "p99": percentile(proto, 99)},
            "total_ms": {"p50": percentile(total, 50), "p99": percentile(total, 99)}}
