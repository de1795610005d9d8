"""Kafka -> windowed aggregation -> Kafka in Kafka transactions, each window result exactly once
(Flink's "An Overview of End-to-End Exactly-Once Processing in Apache Flink": the
TwoPhaseCommitSinkFunction example, Kafka in, windowed aggregate, Kafka out; plus its
file variant, temp directory -> final directory).

Spark aggregates the events into 10-second tumbling event-time windows with a
watermark (``outputMode("append")``: a window is emitted once, when the
watermark passes its end; its partial state lives in Spark's checkpoint).  Each
micro-batch's finished windows go to ``--output-topic`` through
``Coordinator(KafkaSink)``: one Kafka transaction per partition, pre-committed
by the tasks, committed by the driver only after the batch's decision is logged.
A consumer with ``isolation.level=read_committed`` therefore sees every window
result once, even when the driver is killed between pre-commit and commit (the
pending transactions are committed again by producer id and epoch) or before
(they are aborted and the batch, with the same windows, is replayed).

``--sink files --output DIR``: the same results as JSON-lines files, staged in
``DIR/_twophase/`` (the temp directory) and renamed into ``DIR`` at commit.

A window result is ``{"window_start", "window_end", "count", "sum", "ids"}``;
``ids`` lists the events it aggregates, so a test can count every event by id.
The generator ends the stream with one far-future "flush" event (id -1, in a
window of its own that never closes) so the watermark closes the last real window; the input topic
has ONE partition so event time is in order (a late event would be dropped by the
watermark, as Spark documents).

Commands::

    python -m examples.windowed_kafka_to_kafka generate --bootstrap 127.0.0.1:9092 --topic sensor --records 1500
    python -m examples.windowed_kafka_to_kafka run --bootstrap 127.0.0.1:9092 --topic sensor \\
        --output-topic sensor-windows --checkpoint /tmp/win-ck
    python -m examples.windowed_kafka_to_kafka verify --bootstrap 127.0.0.1:9092 --topic sensor \\
        --output-topic sensor-windows
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import sys
from typing import Any

from examples import _common
from examples.wordcount_jdbc import produce, read_topic

WINDOW_SECONDS = 10
BASE_TS = 1_700_000_000.0
FLUSH_ID = -1


def make_events(n: int, seed: int = 3) -> list[dict[str, Any]]:
    """``n`` events 50 ms apart with unique ids, then the far-future flush event."""
    rng = random.Random(seed)
    ev = [{"id": i, "ts": BASE_TS + i * 0.05, "value": rng.randint(1, 1000)} for i in range(n)]
    return ev + [{"id": FLUSH_ID, "ts": BASE_TS + 10 * 365 * 86400.0, "value": 0}]


def windows(df):
    """Streaming plan: 10 s tumbling windows, 30 s watermark, append mode (each window emitted once)."""
    from pyspark.sql import functions as F

    r = F.from_json(F.col("value").cast("string"), "id LONG, ts DOUBLE, value LONG")
    ev = (df.select(r.alias("r")).select("r.id", F.col("r.ts").cast("timestamp").alias("ts"), "r.value")
          .withWatermark("ts", "30 seconds"))
    # No filter for the flush event: Spark pushes such a filter below the watermark node, and the
    # watermark would never see the flush.  Its own window ends far in the future and never closes.
    return (ev.groupBy(F.window("ts", f"{WINDOW_SECONDS} seconds").alias("w"))
            .agg(F.count(F.lit(1)).alias("count"), F.sum("value").alias("sum"),
                 F.sort_array(F.collect_list("id")).alias("ids"))
            .select(F.col("w.start").cast("long").alias("window_start"),
                    F.col("w.end").cast("long").alias("window_end"), "count", "sum", "ids"))


def run(args: argparse.Namespace) -> int:
    from pyspark.sql import functions as F

    from twophase.coordinator import Coordinator

    spark = _common.session("windowed-kafka-to-kafka", kafka=True, jars=args.jars)
    src = _common.kafka_source(spark, args.bootstrap, args.topic, max_offsets=args.max_offsets)
    agg = windows(src)
    if args.sink == "kafka":
        from twophase.sinks.kafka import KafkaSink

        if not args.output_topic:
            raise SystemExit("--sink kafka needs --output-topic")
        sink = KafkaSink(args.bootstrap, args.output_topic, args.transactional_id_prefix or args.name,
                         transaction_timeout_ms=120_000)
        out = agg.select(F.col("window_start").cast("string").alias("key"),
                         F.to_json(F.struct("window_start", "window_end", "count", "sum", "ids")).alias("value"))
    else:
        from twophase.sinks.files import FileSink

        if not args.output:
            raise SystemExit("--sink files needs --output DIR")
        sink = FileSink(args.output, format="jsonl", prefix="windows")
        out = agg
    coordinator = Coordinator(sink, checkpoint_location=args.checkpoint, name=args.name)

    q = (out.writeStream.outputMode("append").foreachBatch(coordinator)
         .option("checkpointLocation", args.checkpoint).trigger(availableNow=True).start())
    q.awaitTermination()
    spark.stop()
    return 0


def results_from_topic(bootstrap: str, topic: str) -> list[dict[str, Any]]:
    """Window results a read_committed consumer sees."""
    return [json.loads(v) for v in read_topic(bootstrap, topic)]


def results_from_dir(folder: str) -> list[dict[str, Any]]:
    out = []
    for path in sorted(glob.glob(os.path.join(folder, "*.jsonl"))):
        with open(path) as fh:
            out += [json.loads(line) for line in fh if line.strip()]
    return out


def check(events: list[dict[str, Any]], results: list[dict[str, Any]]) -> dict[str, Any]:
    """Every event id in exactly one window result, each window emitted once, counts/sums right."""
    from collections import Counter

    from twophase.chaos import verify as by_id

    real = [e for e in events if e["id"] != FLUSH_ID]
    v = by_id([e["id"] for e in real], [i for r in results for i in r["ids"]])
    starts = Counter(r["window_start"] for r in results)
    value = {e["id"]: e["value"] for e in real}
    bad = [r["window_start"] for r in results
           if r["count"] != len(r["ids"]) or r["sum"] != sum(value.get(i, 0) for i in r["ids"])
           or any(int((BASE_TS + i * 0.05) // WINDOW_SECONDS * WINDOW_SECONDS) != r["window_start"]
                  for i in r["ids"] if i in value)]
    want_windows = {int(e["ts"] // WINDOW_SECONDS * WINDOW_SECONDS) for e in real}
    return dict(v.to_dict(), windows=len(starts), windows_expected=len(want_windows),
                windows_emitted_twice=sum(1 for c in starts.values() if c > 1), bad_windows=bad[:5],
                ok=v.exactly_once and not bad and set(starts) == want_windows
                and all(c == 1 for c in starts.values()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.windowed_kafka_to_kafka", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="append N events and the flush event to the (one-partition) topic")
    g.add_argument("--bootstrap", required=True)
    g.add_argument("--topic", required=True)
    g.add_argument("--records", type=int, default=1500)
    g.add_argument("--seed", type=int, default=3)
    r = sub.add_parser("run", help="aggregate everything in the topic, write finished windows, exit")
    _common.add_kafka_args(r)
    r.add_argument("--topic", required=True)
    r.add_argument("--sink", choices=("kafka", "files"), default="kafka")
    r.add_argument("--output-topic", help="--sink kafka: the output topic")
    r.add_argument("--output", help="--sink files: the final directory")
    r.add_argument("--transactional-id-prefix", default=None, help="default: --name")
    r.add_argument("--checkpoint", required=True)
    r.add_argument("--name", default="windowed-kafka")
    v = sub.add_parser("verify", help="check the window results against the input events, by id")
    v.add_argument("--bootstrap", required=True)
    v.add_argument("--topic", required=True)
    v.add_argument("--output-topic")
    v.add_argument("--output")
    args = ap.parse_args(argv)
    _common.setup_logging()
    if args.cmd == "generate":
        produce(args.bootstrap, args.topic, make_events(args.records, args.seed))
        return 0
    if args.cmd == "run":
        return run(args)
    events = [json.loads(x) for x in read_topic(args.bootstrap, args.topic)]
    results = (results_from_topic(args.bootstrap, args.output_topic) if args.output_topic
               else results_from_dir(args.output))
    res = check(events, results)
    print(json.dumps(res))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
