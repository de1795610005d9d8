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

    # On the test cluster every executor runs on this host: the local path is shared.
    coord = Coordinator(FileSink(tmpdir(f"parts{p}"), format="parquet"), log_location=tmpdir("parts-log"),
                        name=f"bench-parts-files-{p}", shared_storage=params.cluster > 0)
    batch = iter(range(10**9))
    spark_dir = tmpdir(f"parts{p}-spark")

    def ours():
        prog = coord.write(dp, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return {"handles": prog["handles"], "commit_ms": prog["commit_ms"]}

    return [Variant(TITLES["files"][0], ours),
            Variant(TITLES["files"][1], lambda: dp.write.mode("append").parquet(spark_dir + "/o"))]


def _kafka(spark, dp, params: Params, p: int, services: dict[str, Any]) -> list[Variant]:
    from benchmarks.kafka import _create_topic
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

    return [Variant(TITLES["kafka"][0], ours), Variant(TITLES["kafka"][1], theirs)]


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
            ours, theirs = (s[v.name] for v in variants)
            r = ratio(ours, theirs)
            handles = sorted({e["handles"] for e in variants[0].extras})
            points.append({"target": target, "partitions": p, "variants": s, "ratio": r,
                           "transactions_per_batch": handles,
                           "commit_ms": [e["commit_ms"] for e in variants[0].extras]})
            goals.append(goal(f"{TITLES[target][0]} >= {GOALS[target]}x {TITLES[target][1]} at {p} partitions",
                              r, GOALS[target], ">="))
            progress(f"partitions: {target} P={p}: {r:.2f}x ({handles} transactions per batch)")
        dp.unpersist()
    return {"title": "By input partitions", "points": points, "goals": goals,
            "note": (f"Input partitions P are what the DataFrame has; the coordinator writes each batch with "
                     f"at most Spark's defaultParallelism writer tasks (one transaction each), coalescing "
                     f"without a shuffle. Spark's writers run one task per input partition. Kafka topic: "
                     f"{params.kafka_topic_partitions} partitions.")}
