"""MySqlSink against Spark's ``df.write.jdbc`` on MariaDB at 2, 50 and 200 input partitions (issue 49),
and the sink's two loaders: multi-row INSERT (upsert mode) and ``LOAD DATA LOCAL INFILE`` (insert mode).

**Writers.** The same rows, repartitioned to P partitions and cached (untimed), written by
``Coordinator.write`` with a ``MySqlSink`` (at most Spark's ``defaultParallelism`` writer tasks, 2
on ``local[2]``: an XA branch each, each Arrow batch by ``LOAD DATA LOCAL INFILE`` of CSV made in
memory by ``pyarrow.csv`` (insert mode, since issue 49), ``XA PREPARE`` on the executor, ``XA COMMIT``
on the driver) and by Spark's JDBC writer (``df.write.jdbc``, mode append, one task and one JDBC
connection per input partition) with MariaDB Connector/J (:data:`CONNECTOR_J`, from Maven Central
into the jar cache) and Spark's usual tuning: ``batchsize`` 1000 (Spark's default, as in the
PostgreSQL section) and the driver's bulk protocol for batched INSERTs (``useBulkStmtsForInserts``,
on by default since Connector/J 3.2; ``rewriteBatchedStatements`` was removed in 3.0).  The url is
``jdbc:mysql:`` (with ``permitMysqlScheme``) so that Spark picks its MySQL dialect.  Each writer has
its own table ``(id BIGINT, payload TEXT)`` (InnoDB), truncated (untimed) before every run.

**Loaders.** One connection in this process, the same rows (collected to Arrow, untimed) in Arrow
batches of 10,000 into one table, inside ``XA START`` / ``XA END`` / ``XA PREPARE`` and an ``XA
COMMIT`` from a second connection, as the sink does: the INSERT path (the sink's upsert mode and
its fallback; its insert mode's loader before issue 49: each value through ``sinks.mysql._py_value``,
PyMySQL ``executemany`` of 1,000 rows, which PyMySQL sends as one multi-row INSERT) against ``LOAD
DATA LOCAL INFILE`` of each batch written as CSV by ``pyarrow.csv`` to a temporary file (the sink's
insert mode sends it from memory instead).  LOAD DATA LOCAL needs the client to allow it (PyMySQL
``local_infile=True``) and the server's ``local_infile`` ON (MariaDB's default; checked here).  Both the whole transaction and its load step alone are timed, with this
process's CPU seconds.
"""

from __future__ import annotations

import os
import statistics
import time
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

GOAL = 1.5  # issue 49: at least 1.5x Spark's JDBC writer, as PostgreSQL does
OURS, SPARK = "MySqlSink (exactly-once)", "Spark df.write.jdbc (MariaDB Connector/J)"
INSERT, LOAD = "multi-row INSERT (upsert mode)", "LOAD DATA LOCAL INFILE (insert mode)"
ARROW_BATCH = 10_000  # rows per Arrow batch the loaders get (Spark's maxRecordsPerBatch default)


def jars() -> list[str]:
    """MariaDB Connector/J for Spark's JDBC writer (resolved once into the jar cache)."""
    from tests.services.maven import MARIADB_CONNECTOR_J, resolve

    return [str(j) for j in resolve([MARIADB_CONNECTOR_J], "mariadb-jdbc")]


def _connect(info: dict[str, Any], **kw: Any):
    import pymysql

    return pymysql.connect(host=info["host"], port=info["port"], user=info["user"], password=info["password"],
                           database=info["database"], autocommit=True, charset="utf8mb4", **kw)


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from tests.services import get

    info = services["mariadb"]
    tag = uid()
    conn = _connect(info)
    made: list[str] = []

    def sql(stmt: str, args: Any = None) -> Any:
        with conn.cursor() as cur:
            cur.execute(stmt, args)
            return cur.fetchall()

    def create(name: str) -> str:
        sql(f"CREATE TABLE `{name}` (id BIGINT, payload TEXT) ENGINE=InnoDB")
        made.append(name)
        return name

    pgid = get("mariadb").pid()
    nbytes = data_bytes(params.rows, params.row_size)
    try:
        markers = f"bench_markers_{tag}"
        made.append(markers)  # the sink creates it; dropped with the rest
        points = [_point(spark, df, params, info, p, tag, create, sql, markers, pgid, nbytes)
                  for p in params.partition_counts]
        loaders = _loaders(df, params, info, create(f"bench_load_{tag}"), sql, pgid, nbytes)
    finally:
        # and what the sink made beside its marker table (e.g. ``{marker_table}_claims``)
        made += [r[0] for r in sql("SELECT table_name FROM information_schema.tables WHERE table_schema = "
                                   "DATABASE() AND table_name LIKE %s", (f"bench\\_markers\\_{tag}\\_%",))]
        for t in made:
            sql(f"DROP TABLE IF EXISTS `{t}`")
        conn.close()
    goals = [goal(f"MySqlSink >= {GOAL}x Spark df.write.jdbc at {pt['partitions']} partitions", pt["ratio"],
                  GOAL, ">=") for pt in points]
    return {"title": "MySQL / MariaDB", "baseline": SPARK, "connector_j": _coordinate(), "points": points,
            "loaders": loaders, "goals": goals,
            "note": ("MySqlSink through Coordinator.write (at most defaultParallelism XA branches per batch) "
                     "against Spark's df.write.jdbc (one task and connection per input partition, batchsize "
                     "1000, Connector/J's bulk INSERTs), same cached DataFrame of P partitions, interleaved.")}


def _coordinate() -> str:
    from tests.services.maven import MARIADB_CONNECTOR_J

    return MARIADB_CONNECTOR_J


def _point(spark, df, params: Params, info: dict[str, Any], p: int, tag: str, create, sql, markers: str,
           pgid: int | None, nbytes: int) -> dict[str, Any]:
    from twophase.coordinator import Coordinator
    from twophase.sinks.mysql import MySqlSink

    ours_t, jdbc_t = create(f"bench_my_sink_{tag}_{p}"), create(f"bench_my_jdbc_{tag}_{p}")
    dp = df.repartition(p).cache()
    dp.count()
    sink = MySqlSink(info["host"], info["port"], info["database"], ours_t, user=info["user"],
                     password=info["password"], marker_table=markers, gid_prefix=f"b{tag}")
    coord = Coordinator(sink, log_location=tmpdir("mysql-log"), name=f"bench-my-{p}")
    batch = iter(range(10**9))
    url = (f"jdbc:mysql://{info['host']}:{info['port']}/{info['database']}"
           "?permitMysqlScheme&useBulkStmtsForInserts=true")
    props = {"user": info["user"], "password": info["password"], "driver": "org.mariadb.jdbc.Driver",
             "batchsize": "1000"}

    def truncate(t: str):
        return lambda: sql(f"TRUNCATE TABLE `{t}`")

    def ours():
        prog = coord.write(dp, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return {k: prog[k] for k in ("handles", "prepare_ms", "commit_ms", "log_ms", "total_ms")}

    def theirs():
        dp.write.jdbc(url, jdbc_t, mode="append", properties=props)

    variants = [Variant(OURS, ours, truncate(ours_t)), Variant(SPARK, theirs, truncate(jdbc_t))]
    try:
        interleave(variants, params.reps, params.warmup, f"mysql/P={p}", server_pgid=pgid)
        for t in (ours_t, jdbc_t):  # the last run of each left every row, once
            n, distinct = sql(f"SELECT count(*), count(DISTINCT id) FROM `{t}`")[0]
            assert n == distinct == params.rows, f"{t} holds {n} rows ({distinct} ids), expected {params.rows}"
    finally:
        sink.close()
        dp.unpersist()
    s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
    r = ratio(s[OURS], s[SPARK])
    ex = variants[0].extras
    progress(f"mysql: P={p}: {r:.2f}x Spark's JDBC writer")
    return {"partitions": p, "variants": s, "ratio": r,
            "transactions_per_batch": sorted({e["handles"] for e in ex}),
            "phases_ms": ex,
            "commit_latency_ms": {"p50": percentile([e["commit_ms"] for e in ex], 50),
                                  "p99": percentile([e["commit_ms"] for e in ex], 99), "samples": len(ex)}}


def _loaders(df, params: Params, info: dict[str, Any], table: str, sql, pgid: int | None,
             nbytes: int) -> dict[str, Any]:
    """The sink's two loaders, multi-row INSERT and LOAD DATA LOCAL INFILE: same rows, same table, in one XA branch."""
    import pyarrow.csv as pacsv

    from twophase.sinks.mysql import _py_value

    local_infile = sql("SELECT @@local_infile")[0][0]
    if not local_infile:
        raise RuntimeError("the server's local_infile is OFF: LOAD DATA LOCAL INFILE cannot be measured "
                           "(SET GLOBAL local_infile = ON)")
    batches = df.toArrow().to_batches(max_chunksize=ARROW_BATCH)
    insert_sql = f"INSERT INTO `{table}` (`id`, `payload`) VALUES (%s, %s)"
    scratch = tmpdir("mysql-load")
    csv_opts = pacsv.WriteOptions(include_header=False, quoting_style="needed")
    load_sql = (f"LOAD DATA LOCAL INFILE %s INTO TABLE `{table}` CHARACTER SET utf8mb4 "
                "FIELDS TERMINATED BY ',' OPTIONALLY ENCLOSED BY '\"' ESCAPED BY '' "
                "LINES TERMINATED BY '\\n' (id, payload)")
    xa = iter(range(10**9))

    def branch(load) -> dict[str, float]:
        xid = (f"bl{uid()}", str(next(xa)))
        c = _connect(info, local_infile=True)
        prepared = committed = False
        try:
            cpu0 = time.process_time()
            with c.cursor() as cur:
                cur.execute("XA START %s, %s", xid)
                t0 = time.perf_counter()
                load(cur)
                load_s = time.perf_counter() - t0
                cur.execute("XA END %s, %s", xid)
                cur.execute("XA PREPARE %s, %s", xid)
                prepared = True
            cpu = time.process_time() - cpu0
        finally:
            c.close()  # an unprepared branch dies with its session (and its table locks with it)
        d = _connect(info)  # XA COMMIT from another session, as the coordinator's driver does
        try:
            with d.cursor() as cur:
                cur.execute("XA COMMIT %s, %s", xid)
                committed = True
        finally:
            if prepared and not committed:  # never leave a prepared branch holding the table
                with d.cursor() as cur:
                    cur.execute("XA ROLLBACK %s, %s", xid)
            d.close()
        return {"load_s": round(load_s, 4), "client_cpu_s": round(cpu, 4)}

    def insert_load(cur) -> None:
        for b in batches:  # sinks/mysql.py MySqlSink.write, per Arrow batch
            cols = [[_py_value(v) for v in b.column(i).to_pylist()] for i in range(b.num_columns)]
            rows = list(zip(*cols))
            for i in range(0, len(rows), 1000):
                cur.executemany(insert_sql, rows[i:i + 1000])

    def infile_load(cur) -> None:
        path = os.path.join(scratch, "batch.csv")
        for b in batches:
            pacsv.write_csv(b, path, csv_opts)
            cur.execute(load_sql, (path,))
            if cur.warning_count:  # LOCAL turns bad rows into warnings: would be lost rows
                cur.execute("SHOW WARNINGS LIMIT 5")
                raise AssertionError(f"LOAD DATA warned: {cur.fetchall()}")

    truncate = lambda: sql(f"TRUNCATE TABLE `{table}`")  # noqa: E731
    variants = [Variant(INSERT, lambda: branch(insert_load), truncate),
                Variant(LOAD, lambda: branch(infile_load), truncate)]
    reps = max(params.reps, 1 if params.quick else 5)
    checked: dict[str, tuple[int, int, str]] = {}
    for v in variants:  # after each variant's last run: every row, with its payload, exactly once
        run0 = v.run

        def checked_run(run0=run0, name=v.name) -> Any:
            out = run0()
            checked[name] = sql(f"SELECT count(*), count(DISTINCT id), "
                                f"MD5(GROUP_CONCAT(id, ':', payload ORDER BY id SEPARATOR '|')) FROM `{table}` "
                                f"WHERE id < 1000")[0]
            return out
        v.run = checked_run
    sql("SET SESSION group_concat_max_len = 1048576")
    interleave(variants, reps, params.warmup, "mysql/loaders", server_pgid=pgid)
    total = sql(f"SELECT count(*), count(DISTINCT id) FROM `{table}`")[0]
    assert total == (params.rows, params.rows), f"{table}: {total}, expected {params.rows} distinct rows"
    assert checked[INSERT] == checked[LOAD], f"the loaders stored different rows: {checked}"
    s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
    for v in variants:
        s[v.name]["load_s"] = [e["load_s"] for e in v.extras]
        s[v.name]["load_median_s"] = round(statistics.median(s[v.name]["load_s"]), 4)
        s[v.name]["client_cpu_median_s"] = round(statistics.median(e["client_cpu_s"] for e in v.extras), 4)
    r = ratio(s[LOAD], s[INSERT])
    r_load = round(s[INSERT]["load_median_s"] / s[LOAD]["load_median_s"], 3)
    progress(f"mysql: loaders: LOAD DATA LOCAL INFILE {r:.2f}x the multi-row INSERT (load step alone {r_load:.2f}x)")
    return {"rows": params.rows, "arrow_batch_rows": ARROW_BATCH, "insert_rows": 1000, "variants": s,
            "ratio_load_data_over_insert": r, "ratio_load_step_only": r_load,
            "server_local_infile": bool(local_infile),
            "note": ("One PyMySQL connection in the benchmark process; XA START, the load, XA END, XA PREPARE, "
                     "then XA COMMIT from a second connection. Ratio = INSERT median / LOAD DATA median (> 1: "
                     "LOAD DATA faster). LOAD DATA needs local_infile=True in PyMySQL and local_infile=ON on "
                     "the server.")}


def markdown(s: dict[str, Any]) -> list[str]:
    """The section's tables for results.md (benchmarks/report.py knows the older sections only)."""
    lines = [f"## {s['title']}", "", f"Spark's JDBC writer with `{s['connector_j']}`.", "",
             "| input partitions | MySqlSink rows/s | Spark JDBC rows/s | ratio | MySqlSink median s | "
             "Spark median s | transactions per batch | MariaDB CPU s: ours / Spark's |",
             "|---:|---:|---:|---:|---:|---:|---|---|"]
    for pt in s["points"]:
        o, t = pt["variants"][OURS], pt["variants"][SPARK]
        cpu = " / ".join(f"{x['server_cpu_median_s']:.2f}" for x in (o, t) if "server_cpu_median_s" in x) or "-"
        lines.append(f"| {pt['partitions']} | {o['rows_per_s']:,.0f} | {t['rows_per_s']:,.0f} | "
                     f"**{pt['ratio']:.2f}x** | {o['median_s']:.3f} | {t['median_s']:.3f} | "
                     f"{', '.join(str(h) for h in pt['transactions_per_batch'])} | {cpu} |")
    ld = s["loaders"]
    lines += ["", s["note"], "", "| loader (one XA branch) | median s | load step median s | rows/s | "
              "client CPU s | MariaDB CPU s |", "|---|---:|---:|---:|---:|---:|"]
    for name, v in ld["variants"].items():
        lines.append(f"| {name} | {v['median_s']:.3f} | {v['load_median_s']:.3f} | {v['rows_per_s']:,.0f} | "
                     f"{v['client_cpu_median_s']:.3f} | {v.get('server_cpu_median_s', float('nan')):.3f} |")
    lines += ["", f"- **LOAD DATA LOCAL INFILE / multi-row INSERT: {ld['ratio_load_data_over_insert']:.2f}x** "
              f"(load step alone {ld['ratio_load_step_only']:.2f}x)", "", ld["note"], ""]
    return lines
