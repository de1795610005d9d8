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
``jdbc:mysql:`` (with ``permitMysqlScheme``) so that Spark picks its MySQL dialect.  Unless ``--quick``,
MySQL's own Connector/J (:data:`MYSQL_CONNECTOR_J`) is a second baseline, in the same interleaved runs:
with its defaults (what a ``jdbc:mysql:`` url gets: a batch goes one INSERT per row) and with
``rewriteBatchedStatements=true`` (one multi-row INSERT per batch).  Each writer has its own table
``(id BIGINT, payload TEXT)`` (InnoDB), truncated (untimed) before every run.

**Server accounting.** Per run: the whole MariaDB process's CPU (every thread: InnoDB's background work
and any other client of the shared server count too), the CPU of the server threads that served the
writer's own connections (:class:`_WriterThreads`), and ``SHOW GLOBAL STATUS`` deltas (:data:`STATUS`).

**Loaders.** One connection in this process, the same rows (collected to Arrow, untimed) in Arrow
batches of 10,000 into one table, inside ``XA START`` / ``XA END`` / ``XA PREPARE`` and an ``XA
COMMIT`` from a second connection, as the sink does: the INSERT path (the sink's upsert mode and
its fallback; its insert mode's loader before issue 49: each value through ``sinks.mysql._py_value``,
PyMySQL ``executemany`` of 1,000 rows, which PyMySQL sends as one multi-row INSERT) against ``LOAD
DATA LOCAL INFILE`` of each batch written as CSV by ``pyarrow.csv`` to a temporary file, in the sink's
CSV form and statement (``CHARACTER SET binary``; the sink's insert mode sends it from memory instead).
LOAD DATA LOCAL needs the client to allow it (PyMySQL ``local_infile=True``) and the server's
``local_infile`` ON (MariaDB's default; checked here).  Both the whole transaction and its load step
alone are timed, with this process's CPU seconds.
"""

from __future__ import annotations

import contextlib
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
#: MySQL's own Connector/J (what ``jdbc:mysql:`` users of Spark get), a second baseline: with its defaults
#: (a batch is sent one INSERT per row) and with ``rewriteBatchedStatements=true`` (one multi-row INSERT
#: per batch).  Measured beside the others, interleaved, but not with ``--quick`` (row by row is slow).
MYSQL_CONNECTOR_J = "com.mysql:mysql-connector-j:26.10.0"
SPARK_MYSQL = "Spark df.write.jdbc (MySQL Connector/J, defaults)"
SPARK_MYSQL_RW = "Spark df.write.jdbc (MySQL Connector/J, rewriteBatchedStatements=true)"
#: Server counters recorded per run (``SHOW GLOBAL STATUS`` deltas; the server is shared: other clients count too).
STATUS = ("Questions", "Com_load", "Com_insert", "Handler_write", "Innodb_rows_inserted", "Innodb_row_lock_waits",
          "Innodb_buffer_pool_pages_flushed", "Innodb_os_log_written", "Bytes_received")
INSERT, LOAD = "multi-row INSERT (upsert mode)", "LOAD DATA LOCAL INFILE (insert mode)"
ARROW_BATCH = 10_000  # rows per Arrow batch the loaders get (Spark's maxRecordsPerBatch default)


def jars() -> list[str]:
    """MariaDB's and MySQL's Connector/J for Spark's JDBC writer (resolved once into the jar cache)."""
    from tests.services.maven import MARIADB_CONNECTOR_J, resolve

    return [str(j) for j in resolve([MARIADB_CONNECTOR_J], "mariadb-jdbc")
            + resolve([MYSQL_CONNECTOR_J], "mysql-jdbc")]


def _connect(info: dict[str, Any], **kw: Any):
    import pymysql

    return pymysql.connect(host=info["host"], port=info["port"], user=info["user"], password=info["password"],
                           database=info["database"], autocommit=True, charset="utf8mb4", **kw)


def _threads_oncpu(pid: int) -> dict[int, int]:
    """Nanoseconds on CPU so far of each thread of process ``pid`` (``/proc/<pid>/task/*/schedstat``)."""
    out: dict[int, int] = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{t}/schedstat") as f:
                out[int(t)] = int(f.read().split()[0])
        except OSError:
            pass  # ended meanwhile
    return out


class _WriterThreads:
    """The server's CPU seconds in the threads that served one writer's connections during a run.

    The whole server's CPU (``server_cpu_s``) counts its background threads and every other client of the
    shared server too.  Here a thread polls ``information_schema.PROCESSLIST`` every 10 ms for connections
    whose running statement names the writer's table (the executors' LOAD DATA / INSERTs; MariaDB >= 10.5
    shows each one's server thread, ``TID``) and the CPU of those threads between the start and the end of
    the run is summed.  A connection none of whose statements is caught by a poll is missed: the driver's
    ``XA COMMIT`` (a millisecond) is, a writer's connection that loads for tenths of a second is not."""

    def __init__(self, info: dict[str, Any], pid: int, table: str) -> None:
        self.info, self.pid, self.table = info, pid, table
        self.seen: set[int] = set()

    def __enter__(self) -> _WriterThreads:
        import threading

        self.before = _threads_oncpu(self.pid)
        self.stop = threading.Event()
        self.conn = _connect(self.info)
        self.poller = threading.Thread(target=self._poll, daemon=True)
        self.poller.start()
        return self

    def _poll(self) -> None:
        like = "%" + self.table.replace("\\", "\\\\").replace("_", "\\_").replace("%", "\\%") + "%"
        with self.conn.cursor() as cur:
            while True:
                cur.execute("SELECT TID FROM information_schema.PROCESSLIST WHERE INFO LIKE %s "
                            "AND ID <> CONNECTION_ID()", (like,))
                self.seen.update(int(r[0]) for r in cur.fetchall() if r[0])
                if self.stop.wait(0.01):
                    return

    def __exit__(self, *exc: Any) -> None:
        self.stop.set()
        self.poller.join()
        self.conn.close()
        after = _threads_oncpu(self.pid)
        self.cpu_s = sum(after.get(t, 0) - self.before.get(t, 0) for t in self.seen) / 1e9
        self.connections = len(self.seen)


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
    goals = [goal(f"MySqlSink >= {GOAL}x Spark df.write.jdbc (MariaDB Connector/J, bulk) at {pt['partitions']} "
                  "partitions", pt["ratio"], GOAL, ">=") for pt in points]
    goals += [goal(f"MySqlSink >= {GOAL}x Spark df.write.jdbc ({name.split('(', 1)[1][:-1]}) at "
                   f"{pt['partitions']} partitions", r, GOAL, ">=")
              for name in (SPARK_MYSQL_RW, SPARK_MYSQL) for pt in points
              if (r := pt["ratios_mysql_connector_j"].get(name)) is not None]
    return {"title": "MySQL / MariaDB", "baseline": SPARK, "connector_j": _coordinate(),
            "mysql_connector_j": None if params.quick else MYSQL_CONNECTOR_J, "points": points,
            "loaders": loaders, "goals": goals,
            "note": ("MySqlSink through Coordinator.write (at most defaultParallelism XA branches per batch) "
                     "against Spark's df.write.jdbc (one task and connection per input partition, batchsize "
                     "1000): MariaDB Connector/J with its bulk INSERTs and, unless --quick, MySQL Connector/J "
                     "with its defaults (one INSERT a row) and with rewriteBatchedStatements=true (one "
                     "multi-row INSERT a batch); same cached DataFrame of P partitions, interleaved.")}


def _coordinate() -> str:
    from tests.services.maven import MARIADB_CONNECTOR_J

    return MARIADB_CONNECTOR_J


def _point(spark, df, params: Params, info: dict[str, Any], p: int, tag: str, create, sql, markers: str,
           pgid: int | None, nbytes: int) -> dict[str, Any]:
    from twophase.coordinator import Coordinator
    from twophase.sinks.mysql import MySqlSink

    ours_t, jdbc_t = create(f"bench_my_sink_{tag}_{p}"), create(f"bench_my_jdbc_{tag}_{p}")
    mysql_ts = [] if params.quick else [create(f"bench_my_cj_{tag}_{p}"), create(f"bench_my_cjrw_{tag}_{p}")]
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
    # MySQL Connector/J: the plain url (its defaults), then the one setting Spark users add for batches.
    my_url = f"jdbc:mysql://{info['host']}:{info['port']}/{info['database']}"
    my_props = dict(props, driver="com.mysql.cj.jdbc.Driver")

    def truncate(t: str):
        return lambda: sql(f"TRUNCATE TABLE `{t}`")

    def status() -> dict[str, int]:
        return {k: int(v) for k, v in sql("SHOW GLOBAL STATUS WHERE variable_name IN "
                                           f"({', '.join(['%s'] * len(STATUS))})", STATUS)}

    def counted(fn, table: str):
        def run():
            s0 = status()
            with _WriterThreads(info, pgid, table) if pgid else contextlib.nullcontext() as w:
                out = fn() or {}
            s1 = status()
            out = dict(out, status={k: s1.get(k, 0) - s0.get(k, 0) for k in STATUS})
            if w is not None:
                out.update(writer_server_cpu_s=round(w.cpu_s, 4), writer_server_threads=w.connections)
            return out
        return run

    def ours():
        prog = coord.write(dp, batch_id=next(batch))
        assert prog["rows"] == params.rows, prog
        return {k: prog[k] for k in ("handles", "prepare_ms", "commit_ms", "log_ms", "total_ms")}

    def jdbc(u: str, table: str, pr: dict[str, str]):
        return lambda: dp.write.jdbc(u, table, mode="append", properties=pr)

    variants = [Variant(OURS, counted(ours, ours_t), truncate(ours_t)),
                Variant(SPARK, counted(jdbc(url, jdbc_t, props), jdbc_t), truncate(jdbc_t))]
    if mysql_ts:
        variants += [Variant(SPARK_MYSQL, counted(jdbc(my_url, mysql_ts[0], my_props), mysql_ts[0]),
                             truncate(mysql_ts[0])),
                     Variant(SPARK_MYSQL_RW, counted(jdbc(my_url + "?rewriteBatchedStatements=true", mysql_ts[1],
                                                          my_props), mysql_ts[1]), truncate(mysql_ts[1]))]
    try:
        interleave(variants, params.reps, params.warmup, f"mysql/P={p}", server_pgid=pgid)
        for t in (ours_t, jdbc_t, *mysql_ts):  # the last run of each left every row, once
            n, distinct = sql(f"SELECT count(*), count(DISTINCT id) FROM `{t}`")[0]
            assert n == distinct == params.rows, f"{t} holds {n} rows ({distinct} ids), expected {params.rows}"
    finally:
        sink.close()
        dp.unpersist()
    s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
    for v in variants:
        s[v.name]["status_median"] = {k: statistics.median(e["status"][k] for e in v.extras) for k in STATUS}
        if pgid:
            s[v.name]["writer_server_cpu_s"] = [e["writer_server_cpu_s"] for e in v.extras]
            s[v.name]["writer_server_cpu_median_s"] = round(statistics.median(s[v.name]["writer_server_cpu_s"]), 3)
            s[v.name]["writer_server_threads"] = [e["writer_server_threads"] for e in v.extras]
    r = ratio(s[OURS], s[SPARK])
    ex = variants[0].extras
    progress(f"mysql: P={p}: {r:.2f}x Spark's JDBC writer (MariaDB Connector/J)")
    others = {name: s.pop(name) for name in (SPARK_MYSQL, SPARK_MYSQL_RW) if name in s}
    return {"partitions": p, "variants": s, "ratio": r,
            # MySQL Connector/J: beside "variants" (which holds the goal's two writers), same runs, interleaved.
            "mysql_connector_j": others,
            "ratios_mysql_connector_j": {name: ratio(s[OURS], v) for name, v in others.items()},
            "transactions_per_batch": sorted({e["handles"] for e in ex}),
            "phases_ms": ex,
            "commit_latency_ms": {"p50": percentile([e["commit_ms"] for e in ex], 50),
                                  "p99": percentile([e["commit_ms"] for e in ex], 99), "samples": len(ex)}}


def _loaders(df, params: Params, info: dict[str, Any], table: str, sql, pgid: int | None,
             nbytes: int) -> dict[str, Any]:
    """The sink's two loaders, multi-row INSERT and LOAD DATA LOCAL INFILE: same rows, same table, in one XA branch."""
    import pyarrow.csv as pacsv

    from twophase.sinks.mysql import _csv_options, _csv_table, _py_value

    local_infile = sql("SELECT @@local_infile")[0][0]
    if not local_infile:
        raise RuntimeError("the server's local_infile is OFF: LOAD DATA LOCAL INFILE cannot be measured "
                           "(SET GLOBAL local_infile = ON)")
    batches = df.toArrow().to_batches(max_chunksize=ARROW_BATCH)
    insert_sql = f"INSERT INTO `{table}` (`id`, `payload`) VALUES (%s, %s)"
    scratch = tmpdir("mysql-load")
    load_sql = (f"LOAD DATA LOCAL INFILE %s INTO TABLE `{table}` CHARACTER SET binary "
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
        for b in batches:  # sinks/mysql/rows.py MySqlSink.write, per Arrow batch
            cols = [[_py_value(v) for v in b.column(i).to_pylist()] for i in range(b.num_columns)]
            rows = list(zip(*cols))
            for i in range(0, len(rows), 1000):
                cur.executemany(insert_sql, rows[i:i + 1000])

    def infile_load(cur) -> None:
        path = os.path.join(scratch, "batch.csv")
        for b in batches:
            pacsv.write_csv(_csv_table(b), path, _csv_options())  # the sink's CSV and statement
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
    cj = [f"`{s['connector_j']}` (bulk)"] + ([f"`{s['mysql_connector_j']}` (defaults; rewriteBatchedStatements="
                                             "true)"] if s.get("mysql_connector_j") else [])
    lines = [f"## {s['title']}", "", f"Spark's JDBC writer with {' and '.join(cj)}.", "",
             "| input partitions | baseline | MySqlSink rows/s | Spark JDBC rows/s | ratio | MySqlSink median s | "
             "Spark median s | transactions per batch | MariaDB CPU s, whole server: ours / Spark's | "
             "MariaDB CPU s, the writer's connections: ours / Spark's | statements: ours / Spark's |",
             "|---:|---|---:|---:|---:|---:|---:|---|---|---|---|"]
    for pt in s["points"]:
        o = pt["variants"][OURS]
        base = [(SPARK, pt["variants"][SPARK], pt["ratio"])] + [
            (n, v, pt["ratios_mysql_connector_j"][n]) for n, v in pt.get("mysql_connector_j", {}).items()]
        for name, t, r in base:
            cpu = " / ".join(f"{x['server_cpu_median_s']:.2f}" for x in (o, t) if "server_cpu_median_s" in x) or "-"
            wcpu = " / ".join(f"{x['writer_server_cpu_median_s']:.2f}" for x in (o, t)
                              if "writer_server_cpu_median_s" in x) or "-"
            qs = " / ".join(f"{x['status_median']['Questions']:,.0f}" for x in (o, t) if "status_median" in x) or "-"
            lines.append(f"| {pt['partitions']} | {name.split('(', 1)[1][:-1]} | {o['rows_per_s']:,.0f} | "
                         f"{t['rows_per_s']:,.0f} | **{r:.2f}x** | {o['median_s']:.3f} | {t['median_s']:.3f} | "
                         f"{', '.join(str(h) for h in pt['transactions_per_batch'])} | {cpu} | {wcpu} | {qs} |")
    ld = s["loaders"]
    lines += ["", s["note"], "", "| loader (one XA branch) | median s | load step median s | rows/s | "
              "client CPU s | MariaDB CPU s |", "|---|---:|---:|---:|---:|---:|"]
    for name, v in ld["variants"].items():
        lines.append(f"| {name} | {v['median_s']:.3f} | {v['load_median_s']:.3f} | {v['rows_per_s']:,.0f} | "
                     f"{v['client_cpu_median_s']:.3f} | {v.get('server_cpu_median_s', float('nan')):.3f} |")
    lines += ["", f"- **LOAD DATA LOCAL INFILE / multi-row INSERT: {ld['ratio_load_data_over_insert']:.2f}x** "
              f"(load step alone {ld['ratio_load_step_only']:.2f}x)", "", ld["note"], ""]
    return lines
