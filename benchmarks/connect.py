"""Spark Connect against the classic session, same run, same JVM (issue 20).

The benchmark's classic session is started with the Spark Connect server plugin
(``spark.plugins=org.apache.spark.sql.connect.SparkConnectPlugin``, on a free loopback
port: see :func:`benchmarks.common.session`), so one Spark JVM serves both the classic
session and a Spark Connect client created in this same process
(``pyspark.sql.connect.session.SparkSession.builder.remote("sc://127.0.0.1:PORT")``).
Both run on the same executors (``local[2]``), with the same Python workers' Python.

The rows of the benchmark DataFrame are written once to a Parquet directory (untimed);
each session reads that directory (not cached, so neither gets a cached-DataFrame
advantage) and writes it, per target:

- through ``Coordinator.write(df, batch_id=N)`` from the classic session and from the
  Connect client (the coordinator then runs in this process, its executors' tasks via
  ``mapInArrow`` over Connect);
- through Spark's own writer for the target, from each session (``df.write.parquet``,
  ``format("kafka")``, ``df.write.jdbc``), the baselines of the partitions section,
  whose helpers build every variant here.

Four variants per target, interleaved, medians.  Reported as throughput ratios:
Connect/classic for our sink and for Spark's writer (what Connect itself costs), and
each session's sink against Spark's writer from that session.

**Streaming** (:func:`streaming`): the same rows as ``stream_batches`` Parquet files, read
by a file stream (``maxFilesPerTrigger=1``, ``trigger(availableNow=True)``: one file per
micro-batch) and written by ``foreachBatch(Coordinator(..., checkpoint_location=...))``
from each session; over Connect the coordinator then runs in the server's ``foreachBatch``
Python worker.  Each repetition is a new query (new checkpoint, output, topic or truncated
table); interleaved; reported: the whole query's seconds and Spark's own ``addBatch`` ms
per micro-batch (medians).
"""

from __future__ import annotations

import statistics
from typing import Any

from benchmarks.common import (
    PG_COLUMNS,
    PLUGIN,  # noqa: F401 - still importable from here
    Params,
    Variant,
    data_bytes,
    interleave,
    progress,
    ratio,
    summarize,
    tmpdir,
    uid,
)
from benchmarks.partitions import TARGETS, TITLES, _add_batch_ms, input_rows

SESSIONS = ("classic", "Connect")


def client(spark):
    """A Spark Connect client of the Connect server that runs inside ``spark``'s JVM (the plugin)."""
    from pyspark.sql.connect.session import SparkSession as ConnectSession

    port = spark.conf.get("spark.connect.grpc.binding.port")
    # create(), not getOrCreate(): the classic builder refuses a remote session while a classic
    # one is active; the connect class's builder makes a new client for the URL regardless.
    return ConnectSession.builder.remote(f"sc://127.0.0.1:{port}").create()


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from coordinator.coordinator import is_connect

    nbytes = data_bytes(params.rows, params.row_size, params.data_shape)
    src = tmpdir("connect-src") + "/rows"
    df.write.parquet(src)  # once, untimed: the input both sessions read
    cspark = client(spark)
    assert is_connect(cspark) and not is_connect(spark)
    progress(f"connect: client of the in-JVM Connect server: {type(cspark).__module__}, Spark {cspark.version}")
    try:
        inputs = {"classic": spark.read.parquet(src), "Connect": cspark.read.parquet(src)}
        nparts = inputs["classic"].rdd.getNumPartitions()
        targets = [t for t in ("files", "kafka", "postgres") if t == "files" or t in services]
        points: list[dict[str, Any]] = []
        for target in targets:
            ours_t, spark_t = TITLES[target]
            variants: list[Variant] = []
            for sess in SESSIONS:
                ours, theirs = TARGETS[target](spark if sess == "classic" else cspark, inputs[sess], params,
                                               nparts, services)
                ours.name, theirs.name = f"{ours_t} ({sess})", f"{spark_t} ({sess})"
                variants += [ours, theirs]
            # Order: ours classic, ours Connect, Spark classic, Spark Connect (rotated each round).
            variants = [variants[0], variants[2], variants[1], variants[3]]
            interleave(variants, params.reps, params.warmup, f"connect/{target}")
            s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
            oc, ok, sc, sk = (s[v.name] for v in variants)
            r = {"ours Connect / classic": ratio(ok, oc), "Spark Connect / classic": ratio(sk, sc),
                 "ours / Spark, classic": ratio(oc, sc), "ours / Spark, Connect": ratio(ok, sk)}
            points.append({"target": target, "input_partitions": nparts, "variants": s, "ratios": r,
                           "transactions_per_batch": {sess: sorted({e["handles"] for e in v.extras})
                                                      for sess, v in zip(SESSIONS, variants[:2])},
                           "commit_ms": {sess: [e["commit_ms"] for e in v.extras]
                                         for sess, v in zip(SESSIONS, variants[:2])}})
            progress(f"connect: {target}: ours Connect/classic {r['ours Connect / classic']:.2f}x, "
                     f"Spark Connect/classic {r['Spark Connect / classic']:.2f}x")
        stream = streaming(spark, cspark, df, params, services, targets) if params.stream_batches else None
    finally:
        cspark.stop()  # the client only; the server stops with the classic session
    return {"title": "Spark Connect vs classic", "points": points, "goals": [], "streaming": stream,
            "note": (f"One Spark JVM (local[2]) serves the classic session and, through the Spark Connect "
                     f"plugin, a Connect client in the same Python process. Each variant reads the same "
                     f"Parquet directory ({params.rows} rows, {nparts} partitions, not cached) and writes "
                     f"it once per repetition: ours = Coordinator.write(df, batch_id=N), Spark = its own "
                     f"writer. Ratios are throughput ratios (> 1: the first named is faster). Kafka topic: "
                     f"{params.kafka_topic_partitions} partitions.")}


def _stream_sink(target: str, params: Params, services: dict[str, Any]):
    """(a fresh sink, the query's select expressions) for one streaming repetition."""
    from twophase.sinks.files import FileSink

    if target == "files":
        return FileSink(tmpdir("connect-stream-out"), format="parquet"), ["*"]
    if target == "kafka":
        from benchmarks.common import _create_topic
        from twophase.sinks.kafka import KafkaSink

        bootstrap = services["kafka"]["bootstrap_servers"]
        topic = f"bench-connect-stream-{uid()}"
        _create_topic(bootstrap, topic, params.kafka_topic_partitions)
        return (KafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-cs-{uid()}"),
                ["CAST(id AS STRING) AS key", "payload AS value"])
    import psycopg2

    from twophase.sinks.postgres import PostgresSink

    info, tag = services["postgres"], uid()
    table = f"bench_connect_stream_{tag}"
    conn = psycopg2.connect(info["dsn"])
    try:
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute(f'CREATE TABLE "{table}" ({PG_COLUMNS[params.data_shape]})')
    finally:
        conn.close()
    return PostgresSink(info["dsn"], table, gid_prefix=f"cs{tag}"), ["*"]


def streaming(spark, cspark, df, params: Params, services: dict[str, Any], targets: list[str]) -> dict[str, Any]:
    """Per target, the same file stream written through ``foreachBatch(Coordinator)`` from the
    classic session and from the Connect client (see the module docstring)."""
    from twophase.coordinator import Coordinator

    files = params.stream_batches
    src = tmpdir("connect-stream-src") + "/rows"
    df.repartition(files).write.parquet(src)  # one file per micro-batch
    schema = df.schema
    points = []
    for target in targets:
        variants = []
        for sess, sp in (("classic", spark), ("Connect", cspark)):
            state: dict[str, Any] = {}

            def setup(target=target, state=state):
                sink, cols = _stream_sink(target, params, services)
                ck = tmpdir("connect-stream-ckpt")
                state.update(ck=ck, cols=cols, coord=Coordinator(
                    sink, checkpoint_location=ck, name=f"bench-connect-stream-{target}-{uid()}"))

            def run(sp=sp, state=state, sess=sess, target=target):
                sdf = (sp.readStream.schema(schema).option("maxFilesPerTrigger", 1).parquet(src)
                       .selectExpr(*state["cols"]))
                q = (sdf.writeStream.foreachBatch(state["coord"]).option("checkpointLocation", state["ck"])
                     .trigger(availableNow=True).start())
                q.awaitTermination()
                if q.exception() is not None:
                    raise RuntimeError(f"connect/streaming {target} ({sess}): the query failed: {q.exception()}")
                ms = _add_batch_ms(q.recentProgress, files)
                rows = sum(input_rows(p) for p in q.recentProgress)
                assert len(ms) == files and rows == params.rows, (len(ms), rows)
                return ms

            variants.append(Variant(f"{TITLES[target][0]} ({sess})", run, setup=setup))
        interleave(variants, params.reps, params.warmup, f"connect/streaming/{target}")
        s = {}
        for v in variants:
            ms = [x for e in v.extras for x in e]
            s[v.name] = {"query_s": [round(x, 4) for x in v.seconds],
                         "query_median_s": round(statistics.median(v.seconds), 4),
                         "add_batch_ms": ms, "add_batch_median_ms": statistics.median(ms)}
        classic, conn = (s[v.name] for v in variants)
        r = {"query Connect / classic": round(classic["query_median_s"] / conn["query_median_s"], 3),
             "addBatch Connect / classic": round(classic["add_batch_median_ms"] / conn["add_batch_median_ms"], 3)}
        points.append({"target": target, "variants": s, "ratios": r})
        progress(f"connect/streaming: {target}: query {r['query Connect / classic']:.2f}x, "
                 f"addBatch {r['addBatch Connect / classic']:.2f}x (Connect/classic)")
    return {"points": points, "batches": files, "rows_per_batch": params.rows // files,
            "note": (f"Streaming: the same {params.rows} rows as {files} Parquet files, read with "
                     f"maxFilesPerTrigger=1 and trigger(availableNow=True), written by "
                     f"foreachBatch(Coordinator) from each session; a new query per repetition. "
                     f"query = start to awaitTermination; addBatch = Spark's durationMs.addBatch per "
                     f"micro-batch, over every batch of the timed repetitions.")}
