"""KafkaSink vs Spark's ``format("kafka")`` writer (at-least-once) vs raw librdkafka transactional produce.

Same cached DataFrame for all three; each run appends to one fresh topic with
as many partitions as the DataFrame.  The KafkaSink runs through
``Coordinator.write`` (INTENT, executors, PREPARED, EndTxn commits, COMMITTED);
Spark's writer runs ``df.write.format("kafka").save()``; the raw client is one
confluent-kafka transactional producer in this process producing the same rows
(pre-collected to Arrow, untimed): init_transactions, begin, produce, commit.
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (Params, Variant, data_bytes, goal, interleave, percentile, progress, ratio,
                               summarize, tmpdir, uid)


def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fut = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic]
    fut.result(timeout=60)


def _raw_produce(bootstrap: str, topic: str, table) -> int:
    from confluent_kafka import Producer

    p = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"bench-raw-{uid()}",
                  "linger.ms": 5})
    p.init_transactions(30)
    p.begin_transaction()
    keys = table.column("key").to_pylist()
    values = table.column("value").to_pylist()
    n = 0
    for k, v in zip(keys, values):
        while True:
            try:
                p.produce(topic, value=v, key=k)
                break
            except BufferError:
                p.poll(0.05)
        n += 1
    p.commit_transaction(120)
    return n


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from twophase.coordinator import Coordinator
    from twophase.sinks.kafka import KafkaSink

    bootstrap = services["kafka"]["bootstrap_servers"]
    kv = df.selectExpr("CAST(id AS STRING) AS key", "payload AS value").cache()
    kv.count()
    table = kv.toArrow()
    topic = f"bench-{uid()}"
    _create_topic(bootstrap, topic, params.partitions)
    progress(f"kafka: topic {topic}, {params.rows} rows x {params.row_size} B")

    sink = KafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-{uid()}")
    coord = Coordinator(sink, log_location=tmpdir("kafka-log"), name="bench-kafka")
    batch = iter(range(10**9))
    commit_ms: list[float] = []

    def twophase_run():
        prog = coord.write(kv, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        commit_ms.append(prog["commit_ms"])
        return {k: prog[k] for k in ("prepare_ms", "commit_ms", "log_ms", "total_ms")}

    def spark_run():
        (kv.write.format("kafka").option("kafka.bootstrap.servers", bootstrap)
         .option("topic", topic).save())

    def raw_run():
        assert _raw_produce(bootstrap, topic, table) == params.rows

    variants = [Variant("KafkaSink (exactly-once)", twophase_run),
                Variant("Spark format('kafka') (at-least-once)", spark_run),
                Variant("raw librdkafka transactional produce", raw_run)]
    interleave(variants, params.reps, params.warmup, "kafka")
    nbytes = data_bytes(params.rows, params.row_size)
    s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
    ours, spark_w, raw = (s[v.name] for v in variants)
    kv.unpersist()
    commit_ms = [e["commit_ms"] for e in variants[0].extras]  # timed runs only, not the warm-up
    r_spark, r_raw = ratio(ours, spark_w), ratio(ours, raw)
    return {
        "title": "Kafka",
        "baseline": variants[1].name,
        "variants": s,
        "ratios": {"KafkaSink / Spark kafka writer": r_spark, "KafkaSink / raw librdkafka txn": r_raw},
        "commit_latency_ms": {"p50": percentile(commit_ms, 50), "p99": percentile(commit_ms, 99),
                              "samples": len(commit_ms)},
        "phases_ms": variants[0].extras,
        "goals": [goal("KafkaSink >= 0.9x Spark's Kafka writer", r_spark, 0.9, ">=")],
    }
