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

from benchmarks.common import (
    Params,
    Variant,
    _create_topic,
    data_bytes,
    goal,
    interleave,
    percentile,
    progress,
    ratio,
    summarize,
    tmpdir,
    uid,
)


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


# ------------------------------------------------------------------ per-transaction cost
def txn_cost(bootstrap: str, transactions: int = 50, handles: int = 200, threads: int = 8,
             rows: int = 100) -> dict[str, Any]:
    """What one KafkaSink transaction costs, without Spark.

    Run ``python -m benchmarks.kafka --txn-cost`` (prints JSON).

    Executor side, in this process as in one Python worker: ``transactions`` transactions
    of ``rows`` rows one after another, each under its own transactional id (as the
    partitions of a batch), timed per step: ``begin_transaction`` (producer creation,
    FindCoordinator + InitProducerId), ``write`` (topic check, produce), ``pre_commit``
    (flush, producer id, release).  Then the parts alone on a bare producer with the
    sink's settings: creation, ``init_transactions``, ``list_topics``, destruction.
    Driver side, on ``handles`` pre-committed transactions: ``verify_prepared``, the
    commit fan-out with ``threads`` threads (as the coordinator's commit pool), counting
    the answers that asked for a retry, and recovery's ``recover_and_commit`` of the
    same (now committed) handles.
    """
    import time
    from concurrent.futures import ThreadPoolExecutor

    import confluent_kafka as ck
    import pyarrow as pa

    from twophase.context import TransactionContext
    from twophase.sink import CommitOutcome
    from twophase.sinks.kafka import KafkaSink

    def ms(t0: float) -> float:
        return (time.perf_counter() - t0) * 1000

    def stats(values: list[float]) -> dict[str, float]:
        return {"p50": round(percentile(values, 50), 2), "p90": round(percentile(values, 90), 2),
                "max": round(max(values), 2)}

    topic = f"bench-txn-{uid()}"
    _create_topic(bootstrap, topic, 4)
    prefix = f"bench-txn-{uid()}"
    sink = KafkaSink(bootstrap, topic=topic, transactional_id_prefix=prefix,
                     transaction_timeout_ms=600_000)
    batch = pa.RecordBatch.from_pydict({"value": [b"x" * 100] * rows})
    steps: dict[str, list[float]] = {"begin_transaction": [], "write": [], "pre_commit": [],
                                     "transaction": []}

    def one(batch_id: int, partition: int, n: int) -> dict:
        intent = sink.plan_batch("bench", batch_id, n)
        ctx = TransactionContext("bench", batch_id, partition, 0, intent)
        t0 = t = time.perf_counter()
        txn = sink.begin_transaction(ctx)
        steps["begin_transaction"].append(ms(t))
        t = time.perf_counter()
        sink.write(txn, batch)
        steps["write"].append(ms(t))
        t = time.perf_counter()
        handle = sink.pre_commit(txn)
        steps["pre_commit"].append(ms(t))
        steps["transaction"].append(ms(t0))
        return handle

    progress(f"kafka txn cost: {transactions} transactions of {rows} rows")
    first = [one(0, p, transactions) for p in range(transactions)]
    for h in first:
        assert sink.commit(h).done
    out: dict[str, Any] = {"executor_ms": {k: stats(v) for k, v in steps.items()}}

    parts: dict[str, list[float]] = {"create": [], "init_transactions": [], "list_topics": [],
                                     "destroy": []}
    for _ in range(min(transactions, 30)):
        conf = sink._producer_config(f"{prefix}-bare", [None])
        for k in ("debug", "logger", "stats_cb", "statistics.interval.ms"):
            conf.pop(k, None)
        t = time.perf_counter()
        p = ck.Producer(conf)
        parts["create"].append(ms(t))
        t = time.perf_counter()
        p.init_transactions(60)
        parts["init_transactions"].append(ms(t))
        t = time.perf_counter()
        p.list_topics(topic, timeout=30)
        parts["list_topics"].append(ms(t))
        t = time.perf_counter()
        del p
        parts["destroy"].append(ms(t))
    out["bare_producer_ms"] = {k: stats(v) for k, v in parts.items()}

    progress(f"kafka txn cost: {handles} pre-committed handles for the driver")
    for values in steps.values():
        values.clear()
    pending = [one(1, p, handles) for p in range(handles)]
    driver = KafkaSink(bootstrap, topic=topic, transactional_id_prefix=prefix,
                       transaction_timeout_ms=600_000)
    driver.open()
    t = time.perf_counter()
    driver.verify_prepared(1, pending, prepare_started_at=time.time() - 1)
    out["driver_ms"] = {"verify_prepared": round(ms(t), 1)}
    retries: dict[str, int] = {}

    def commit(h: dict) -> None:
        while True:
            res = driver.commit(h)
            if res.done:
                return
            assert res.outcome is CommitOutcome.RETRY_LATER, res
            key = res.reason.split(" ")[0]
            retries[key] = retries.get(key, 0) + 1
            time.sleep(0.05)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(commit, pending))
    out["driver_ms"][f"commit {handles} handles, {threads} threads"] = round(ms(t), 1)
    out["commit_retries"] = retries
    answers: dict[str, int] = {}

    def recover(h: dict) -> None:
        while True:
            res = driver.recover_and_commit(h)
            key = res.outcome.value
            if res.reason.startswith("committed"):  # "committed (or already committed: ...)"
                key += f" ({res.reason})"
            answers[key] = answers.get(key, 0) + 1
            if res.done:
                return
            time.sleep(0.05)

    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(recover, pending))
    out["driver_ms"][f"recover_and_commit {handles} committed handles"] = round(ms(t), 1)
    out["recovery_answers"] = answers
    out["executor_ms_with_handles"] = {k: stats(v) for k, v in steps.items()}
    driver.close()
    sink.close()
    return out


def row_cost(bootstrap: str, rows: int = 200_000, reps: int = 5, chunk: int = 10_000) -> dict[str, Any]:
    """What KafkaSink's executor side costs per row, without Spark.

    Run ``python -m benchmarks.kafka --row-cost`` (prints JSON).  One transaction of ``rows``
    rows (a 90-byte value and a key, as the partitions section's ``hex`` rows), written in
    Arrow batches of ``chunk`` rows as ``mapInArrow`` hands them over, then pre-committed
    (flush) and committed; ``reps`` times.  Reported: wall and process CPU seconds of
    ``write`` + ``pre_commit`` (the CPU includes librdkafka's threads), medians, and
    microseconds of CPU per row.  CPU is the figure to compare across commits on a shared
    machine: wall time moves with the load, CPU much less.
    """
    import statistics
    import time
    import uuid

    import pyarrow as pa

    from twophase.context import TransactionContext
    from twophase.sinks.kafka import KafkaSink

    topic = f"rowcost-{uuid.uuid4().hex[:8]}"
    _create_topic(bootstrap, topic, 3)
    batch = pa.RecordBatch.from_pydict({"key": [str(i).encode() for i in range(rows)],
                                        "value": [f"{i:090d}".encode() for i in range(rows)]})
    sink = KafkaSink(bootstrap, topic, f"rowcost-{uuid.uuid4().hex[:8]}")
    sink.open()
    wall, cpu = [], []
    try:
        for rep in range(reps):
            ctx = TransactionContext("rowcost", rep, 0, 0, sink.plan_batch("rowcost", rep, 1))
            txn = sink.begin_transaction(ctx)
            c0, w0 = time.process_time(), time.perf_counter()
            for off in range(0, rows, chunk):
                sink.write(txn, batch.slice(off, chunk))
            handle = sink.pre_commit(txn)
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
            sink.commit(handle)
    finally:
        sink.close()
    return {"rows": rows, "reps": reps, "wall_s": round(statistics.median(wall), 3),
            "cpu_s": round(statistics.median(cpu), 3),
            "cpu_us_per_row": round(statistics.median(cpu) / rows * 1e6, 2),
            "wall_s_all": [round(w, 3) for w in wall], "cpu_s_all": [round(c, 3) for c in cpu]}


if __name__ == "__main__":
    import argparse
    import json
    import os

    ap = argparse.ArgumentParser(prog="python -m benchmarks.kafka",
                                 description="KafkaSink's per-transaction cost (the Spark "
                                 "comparison runs with python -m benchmarks --only kafka)")
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--txn-cost", action="store_true", help="per-transaction cost (see txn_cost)")
    what.add_argument("--row-cost", action="store_true", help="per-row cost of write + pre_commit "
                      "(see row_cost)")
    ap.add_argument("--rows", type=int, default=200_000, help="rows for --row-cost")
    ap.add_argument("--reps", type=int, default=5, help="repetitions for --row-cost")
    ap.add_argument("--bootstrap", help="default: the test broker of tests/services")
    ap.add_argument("--transactions", type=int, default=50)
    ap.add_argument("--handles", type=int, default=200)
    ap.add_argument("--threads", type=int, default=8)
    a = ap.parse_args()
    if a.bootstrap is None:
        from tests import services as svc

        a.bootstrap = svc.ensure("kafka")["kafka"]["bootstrap_servers"]
    if a.row_cost:
        result = row_cost(a.bootstrap, a.rows, a.reps)
    else:
        result = txn_cost(a.bootstrap, a.transactions, a.handles, a.threads)
    result["load_avg_1m"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result, indent=1))
