"""PostgresSink vs Spark's ``df.write.jdbc`` vs raw COPY, into identical fresh tables.

Each variant has its own table ``(id BIGINT, payload TEXT)``, truncated before
every run (untimed).  PostgresSink runs through ``Coordinator.write`` (COPY into
prepared transactions, COMMIT PREPARED on the driver); Spark's JDBC writer uses
its defaults (batched INSERTs, ``batchsize=1000``); the raw baseline is one
psycopg2 connection in this process: the same rows (pre-collected to Arrow,
untimed) encoded as CSV by pyarrow and sent with ``COPY ... FROM STDIN``, then
COMMIT.
"""

from __future__ import annotations

import io
from typing import Any

from benchmarks.common import (
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


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    import psycopg2
    import pyarrow.csv as pacsv

    from twophase.coordinator import Coordinator
    from twophase.sinks.postgres import PostgresSink

    info = services["postgres"]
    tag = uid()
    tables = {k: f"bench_{k}_{tag}" for k in ("sink", "jdbc", "copy")}
    conn = psycopg2.connect(info["dsn"])
    conn.autocommit = True
    with conn.cursor() as cur:
        for t in tables.values():
            cur.execute(f'CREATE TABLE "{t}" (id BIGINT, payload TEXT)')
    table = df.toArrow()
    progress(f"postgres: tables {', '.join(tables.values())}")

    def truncate(t: str):
        def f():
            with conn.cursor() as cur:
                cur.execute(f'TRUNCATE "{t}"')
        return f

    def count(t: str) -> int:
        with conn.cursor() as cur:
            cur.execute(f'SELECT count(*) FROM "{t}"')
            return cur.fetchone()[0]

    sink = PostgresSink(info["dsn"], tables["sink"], gid_prefix=f"b{tag}")
    coord = Coordinator(sink, log_location=tmpdir("pg-log"), name="bench-pg")
    batch = iter(range(10**9))
    commit_ms: list[float] = []

    def twophase_run():
        prog = coord.write(df, batch_id=next(batch))
        commit_ms.append(prog["commit_ms"])
        assert count(tables["sink"]) == params.rows
        return {k: prog[k] for k in ("prepare_ms", "commit_ms", "log_ms", "total_ms")}

    jdbc_url = f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}"
    props = {"user": info["user"], "password": info["password"], "driver": "org.postgresql.Driver"}

    def jdbc_run():
        df.write.jdbc(jdbc_url, tables["jdbc"], mode="append", properties=props)

    def copy_run():
        raw = psycopg2.connect(info["dsn"])
        try:
            buf = io.BytesIO()
            pacsv.write_csv(table, buf, pacsv.WriteOptions(include_header=False))
            buf.seek(0)
            with raw.cursor() as cur:
                cur.copy_expert(f'COPY "{tables["copy"]}" (id, payload) FROM STDIN WITH (FORMAT csv)', buf)
            raw.commit()
        finally:
            raw.close()

    variants = [Variant("PostgresSink (exactly-once)", twophase_run, truncate(tables["sink"])),
                Variant("Spark df.write.jdbc", jdbc_run, truncate(tables["jdbc"])),
                Variant("raw COPY (psycopg2)", copy_run, truncate(tables["copy"]))]
    try:
        interleave(variants, params.reps, params.warmup, "postgres")
        for k in ("jdbc", "copy"):
            n = count(tables[k])
            assert n == params.rows, f"{tables[k]} holds {n} rows, expected {params.rows}"
    finally:
        with conn.cursor() as cur:
            for t in tables.values():
                cur.execute(f'DROP TABLE IF EXISTS "{t}"')
        conn.close()
    nbytes = data_bytes(params.rows, params.row_size)
    s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
    ours, jdbc, copy = (s[v.name] for v in variants)
    commit_ms = [e["commit_ms"] for e in variants[0].extras]  # timed runs only, not the warm-up
    r_jdbc, r_copy = ratio(ours, jdbc), ratio(ours, copy)
    return {
        "title": "PostgreSQL",
        "baseline": variants[1].name,
        "variants": s,
        "ratios": {"PostgresSink / Spark JDBC": r_jdbc, "PostgresSink / raw COPY": r_copy},
        "commit_latency_ms": {"p50": percentile(commit_ms, 50), "p99": percentile(commit_ms, 99),
                              "samples": len(commit_ms)},
        "phases_ms": variants[0].extras,
        "goals": [goal("PostgresSink >= 2x Spark JDBC", r_jdbc, 2.0, ">="),
                  goal("PostgresSink >= 0.8x raw COPY", r_copy, 0.8, ">=")],
    }
