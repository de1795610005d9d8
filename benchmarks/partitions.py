"""Each sink against Spark's own writer at 2, 50 and 200 input partitions (issue 15).

The same rows, repartitioned to P partitions and cached (untimed), written by
``Coordinator.write`` (default writer parallelism: Spark's ``defaultParallelism``,
2 on ``local[2]``, so a batch opens at most 2 transactions whatever P is) and by
Spark's own writer for the same target, which writes one file / one producer task /
one JDBC connection per partition.  Interleaved, medians, same run.

Targets: local Parquet (``df.write.parquet``), Kafka (``format("kafka")`` into a
``--kafka-topic-partitions`` topic) and PostgreSQL (``df.write.jdbc``).
"""

from __future__ import annotations

from typing import Any

from benchmarks.common import (
    PG_COLUMNS,
    Params,
    Variant,
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

GOALS = {"files": 0.9, "kafka": 0.9, "postgres": 1.5}
TITLES = {"files": ("FileSink local Parquet", "Spark parquet"),
          "kafka": ("KafkaSink", "Spark format('kafka')"),
          "postgres": ("PostgresSink", "Spark df.write.jdbc")}


def _files(spark, dp, params: Params, p: int, services: dict[str, Any]) -> list[Variant]:
    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink

    spark_dir = tmpdir(f"parts{p}-spark")
    out: list[Variant] = []
    for writer in params.partition_file_writers:
        # On the test cluster every executor runs on this host: the local path is shared.
        coord = Coordinator(FileSink(tmpdir(f"parts{p}-{writer}"), format="parquet", writer=writer),
                            log_location=tmpdir("parts-log"), name=f"bench-parts-files-{writer}-{p}",
                            shared_storage=params.cluster > 0)
        batches = iter(range(10**9))

        def ours(coord=coord, batch=batches):
            prog = coord.write(dp, batch_id=next(batch))
            assert prog["rows"] == params.rows, prog
            return {"handles": prog["handles"], "commit_ms": prog["commit_ms"]}

        name = TITLES["files"][0] if writer == "arrow" else f"{TITLES['files'][0]}, writer='spark'"
        out.append(Variant(name, ours))
    # variants[1] is the baseline; the first writer asked for is variants[0]
    out.insert(1, Variant(TITLES["files"][1], lambda: dp.write.mode("append").parquet(spark_dir + "/o")))
    return out


def _kafka(spark, dp, params: Params, p: int, services: dict[str, Any]) -> list[Variant]:
    from benchmarks.common import _create_topic
    from twophase.coordinator import Coordinator
    from twophase.sinks.kafka import KafkaSink

    bootstrap = services["kafka"]["bootstrap_servers"]
    topic = f"bench-parts-{p}-{uid()}"
    _create_topic(bootstrap, topic, params.kafka_topic_partitions)
    value = "payload" if "payload" in dp.columns else "to_json(struct(*))"  # events: one JSON object
    kv = dp.selectExpr("CAST(id AS STRING) AS key", f"{value} AS value")
    sink = KafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-parts-{uid()}")
    coord = Coordinator(sink, log_location=tmpdir("parts-kafka-log"), name=f"bench-parts-kafka-{p}")
    batch = iter(range(10**9))

    def ours():
        prog = coord.write(kv, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return {"handles": prog["handles"], "commit_ms": prog["commit_ms"]}

    def theirs():
        kv.write.format("kafka").option("kafka.bootstrap.servers", bootstrap).option("topic", topic).save()

    return [Variant(TITLES["kafka"][0], ours), Variant(TITLES["kafka"][1], theirs),
            Variant(FLOOR, lambda: _python_floor(kv, params.rows, spark.sparkContext.defaultParallelism))]


#: The third Kafka variant: what any Python executor path pays before it produces a record.
FLOOR = "rows into Python (no sink)"


def _python_floor(kv, rows: int, slots: int) -> None:
    """The same DataFrame through ``mapInArrow`` into Spark's Python workers, in as many tasks
    as the coordinator writes with (coalesced to ``slots``), with the key and value columns
    turned into Python objects as KafkaSink's ``write`` does, and nothing sent: no producer,
    no transaction, no log.  Spark's writer over this time is the best ratio a Python sink can
    reach here (the gap to KafkaSink is the producer and the protocol)."""
    import pyarrow as pa

    schema = "n LONG"

    def f(batches):
        n = 0
        for b in batches:
            b.column(0).to_pylist()
            b.column(1).to_pylist()
            n += b.num_rows
        yield pa.RecordBatch.from_pydict({"n": [n]}, schema=pa.schema([("n", pa.int64())]))

    if kv.rdd.getNumPartitions() > slots:
        kv = kv.coalesce(slots)
    got = sum(r["n"] for r in kv.mapInArrow(f, schema).collect())
    assert got == rows, (got, rows)


def _postgres(spark, dp, params: Params, p: int, services: dict[str, Any]) -> list[Variant]:
    import psycopg2

    from twophase.coordinator import Coordinator
    from twophase.sinks.postgres import PostgresSink

    info = services["postgres"]
    tag = uid()
    ours_t, jdbc_t = f"bench_parts_sink_{tag}", f"bench_parts_jdbc_{tag}"
    conn = psycopg2.connect(info["dsn"])
    conn.autocommit = True
    with conn.cursor() as cur:
        for t in (ours_t, jdbc_t):
            cur.execute(f'CREATE TABLE "{t}" ({PG_COLUMNS[params.data_shape]})')

    def truncate(t: str):
        def f():
            with conn.cursor() as cur:
                cur.execute(f'TRUNCATE "{t}"')
        return f

    coord = Coordinator(PostgresSink(info["dsn"], ours_t, gid_prefix=f"p{tag}"), log_location=tmpdir("parts-pg-log"),
                        name=f"bench-parts-pg-{p}")
    batch = iter(range(10**9))
    url = f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}"
    props = {"user": info["user"], "password": info["password"], "driver": "org.postgresql.Driver"}

    def ours():
        prog = coord.write(dp, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return {"handles": prog["handles"], "commit_ms": prog["commit_ms"]}

    return [Variant(TITLES["postgres"][0], ours, setup=truncate(ours_t)),
            Variant(TITLES["postgres"][1], lambda: dp.write.jdbc(url, jdbc_t, mode="append", properties=props),
                    setup=truncate(jdbc_t))]


TARGETS = {"files": _files, "kafka": _kafka, "postgres": _postgres}


def _add_batch_ms(progress_list: list[dict[str, Any]], batches: int) -> list[float]:
    """Spark's own ``durationMs.addBatch`` of the first ``batches`` micro-batches with rows: the
    time the sink took, measured the same way for ``foreachBatch`` and for Spark's sinks."""
    out = [float(p["durationMs"]["addBatch"]) for p in progress_list
           if input_rows(p) > 0 and "addBatch" in p.get("durationMs", {})]
    return out[:batches]


def input_rows(p) -> int:
    """Input rows of one progress entry.  Over Spark Connect the progress JSON has no top-level
    ``numInputRows`` (pyspark then gives None): sum the sources' instead."""
    n = p.get("numInputRows")
    return int(n) if n is not None else sum(int(s.numInputRows) for s in p.sources)


def streaming(spark, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    """Issue 15, streaming: a query over a ``stream_partitions``-partition source (Spark's rate
    source) written by each sink through ``foreachBatch(Coordinator(...))`` and by Spark's own
    streaming sink for the same target, one query after the other, ``stream_batches``
    micro-batches each after ``warmup`` more; compared by Spark's own ``addBatch`` time per
    micro-batch (medians)."""
    import time

    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink
    from twophase.sinks.kafka import KafkaSink

    parts = params.stream_partitions
    per_batch = max(parts, params.rows // 10)
    rate = max(1, int(per_batch / params.trigger_interval))
    payload = (f"substring(repeat(sha2(cast(value as string), 256), {params.row_size // 64 + 1}), 1, "
               f"{params.row_size})")
    want = params.stream_batches + params.warmup
    points, goals = [], []

    def run(name: str, start) -> list[float]:
        sdf = (spark.readStream.format("rate").option("rowsPerSecond", rate)
               .option("numPartitions", parts).load()
               .selectExpr("value AS id", f"{payload} AS payload"))
        q = start(sdf, tmpdir("stream-parts-ckpt"))
        deadline = time.monotonic() + 120 + want * (params.trigger_interval + 15)
        try:
            while len(_add_batch_ms(q.recentProgress, want)) < want:
                if q.exception() is not None:
                    raise RuntimeError(f"streaming {name}: the query failed: {q.exception()}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"streaming {name}: fewer than {want} batches in time")
                time.sleep(0.5)
        finally:
            q.stop()
        ms = _add_batch_ms(q.recentProgress, want)[params.warmup:]
        progress(f"partitions/streaming: {name}: addBatch ms {[round(x) for x in ms]}")
        return ms

    def trig(w):
        return w.trigger(processingTime=f"{params.trigger_interval} seconds")

    def files_ours(sdf, ck):
        coord = Coordinator(FileSink(tmpdir("stream-parts-out"), format="parquet"), checkpoint_location=ck,
                            name=f"bench-stream-parts-files-{uid()}", shared_storage=params.cluster > 0)
        return trig(sdf.writeStream.foreachBatch(coord).option("checkpointLocation", ck)).start()

    def files_theirs(sdf, ck):
        return trig(sdf.writeStream.format("parquet").option("path", tmpdir("stream-parts-spark"))
                    .option("checkpointLocation", ck)).start()

    cases: list[tuple[str, Any, Any]] = [("files", files_ours, files_theirs)]
    if "kafka" in services:
        from benchmarks.common import _create_topic

        bootstrap = services["kafka"]["bootstrap_servers"]
        topic = f"bench-stream-parts-{uid()}"
        _create_topic(bootstrap, topic, params.kafka_topic_partitions)

        def kafka_ours(sdf, ck):
            sink = KafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-sp-{uid()}")
            coord = Coordinator(sink, checkpoint_location=ck, name=f"bench-stream-parts-kafka-{uid()}")
            kv = sdf.selectExpr("CAST(id AS STRING) AS key", "payload AS value")
            return trig(kv.writeStream.foreachBatch(coord).option("checkpointLocation", ck)).start()

        def kafka_theirs(sdf, ck):
            kv = sdf.selectExpr("CAST(id AS STRING) AS key", "payload AS value")
            return trig(kv.writeStream.format("kafka").option("kafka.bootstrap.servers", bootstrap)
                        .option("topic", topic).option("checkpointLocation", ck)).start()

        cases.append(("kafka", kafka_ours, kafka_theirs))
    for target, ours, theirs in cases:
        mine = run(f"{target} {TITLES[target][0]}", ours)
        spark_ms = run(f"{target} {TITLES[target][1]}", theirs)
        r = percentile(spark_ms, 50) / percentile(mine, 50)
        points.append({"target": target, "partitions": parts, "rows_per_batch": per_batch,
                       "ours_add_batch_ms": mine, "spark_add_batch_ms": spark_ms, "ratio": r})
        goals.append(goal(f"streaming, {parts}-partition source: {TITLES[target][0]} >= {GOALS[target]}x "
                          f"{TITLES[target][1]} per micro-batch (addBatch median)", r, GOALS[target], ">="))
        progress(f"partitions/streaming: {target}: {r:.2f}x")
    return {"points": points, "goals": goals,
            "note": (f"Streaming: Spark's rate source with {parts} partitions, about {per_batch} rows per "
                     f"{params.trigger_interval:g} s micro-batch; each sink's query and Spark's own streaming "
                     f"sink run one after the other, {params.stream_batches} batches each after "
                     f"{params.warmup} warm-up; ratio = median addBatch of Spark's sink / ours.")}


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    nbytes = data_bytes(params.rows, params.row_size, params.data_shape)
    points: list[dict[str, Any]] = []
    goals = []
    for p in params.partition_counts:
        dp = df.repartition(p).cache()
        dp.count()
        for target in params.partition_targets:
            variants = TARGETS[target](spark, dp, params, p, services)
            interleave(variants, params.reps, params.warmup, f"partitions/{target}/P={p}")
            s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
            ours, theirs = s[variants[0].name], s[variants[1].name]
            r = ratio(ours, theirs)
            handles = sorted({e["handles"] for e in variants[0].extras})
            point = {"target": target, "partitions": p, "variants": s, "ratio": r,
                     "transactions_per_batch": handles,
                     "commit_ms": [e["commit_ms"] for e in variants[0].extras]}
            for v in variants[2:]:  # other candidates (FileSink's other writer): their ratios too
                if v.name != FLOOR:
                    point.setdefault("other_ratios", {})[v.name] = ratio(s[v.name], theirs)
                    progress(f"partitions: {target} P={p}: {v.name} {point['other_ratios'][v.name]:.2f}x")
            if FLOOR in s:  # the best ratio a Python executor path can reach in this run
                point["floor_ratio"] = ratio(s[FLOOR], theirs)
                progress(f"partitions: {target} P={p}: {FLOOR} {point['floor_ratio']:.2f}x Spark's writer")
            points.append(point)
            goals.append(goal(f"{TITLES[target][0]} >= {GOALS[target]}x {TITLES[target][1]} at {p} partitions",
                              r, GOALS[target], ">="))
            progress(f"partitions: {target} P={p}: {r:.2f}x ({handles} transactions per batch)")
        dp.unpersist()
    stream = None
    if params.stream_partitions and params.data_shape == "hex":
        stream = streaming(spark, params, services)
        goals += stream["goals"]
    return {"title": "By input partitions", "points": points, "goals": goals, "streaming": stream,
            "note": (f"Input partitions P are what the DataFrame has; the coordinator writes each batch with "
                     f"at most Spark's defaultParallelism writer tasks (one transaction each), coalescing "
                     f"without a shuffle. Spark's writers run one task per input partition. Kafka topic: "
                     f"{params.kafka_topic_partitions} partitions.")}
