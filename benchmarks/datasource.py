"""The data source form (``writeStream.format("twophase-<kind>")``, issue 28) against the
``foreachBatch`` coordinator and Spark's own streaming sinks, per micro-batch and per row.

Every case is a streaming query over Spark's ``rate-micro-batch`` source
(``--datasource-rows`` rows a batch, default 10,000, in P partitions for each P of
``--datasource-partitions``, default 2 and 50; the default trigger), run for
``--datasource-batches`` micro-batches, the first ``--datasource-warmup`` discarded, and timed by
Spark's own ``durationMs`` (``triggerExecution``: the whole micro-batch; ``addBatch``: the sink's
part; ``queryPlanning``: where a data source's plan runs) from ``query.recentProgress``, as the
latency section does (its helpers run the queries: :func:`benchmarks.latency._measure`).

Variants, per (target, P), one query each, interleaved, ``--datasource-reps`` rounds:

- Spark's own streaming sink for the target (``format("parquet")``, ``format("kafka")``,
  ``foreachBatch`` + ``df.write.jdbc``): the baseline;
- ``foreachBatch(Coordinator(<Sink>))`` with its log local (``<checkpoint>/twophase``);
- the data source form, ``format("twophase-files" | "twophase-kafka" | "twophase-jdbc")`` with
  its log under the checkpoint (the default), options as Spark's own sinks take them;
- files only (unless ``--datasource-no-floor``): a data source whose plan, ``write()`` and
  ``commit()`` do nothing but read the rows: what Spark's Python Data Source API costs by itself.

``--datasource-stateful S`` (issue 47): every variant runs the same stateful query instead, as real
jobs write one: the rows deduplicated by ``id`` within a watermark (``dropDuplicatesWithinWatermark``)
at ``spark.sql.shuffle.partitions`` = S (Spark's default is 200), so each batch reaches the sink in S
partitions.  The data source form then coalesces them to the application's cores
(``twophase.coalesce=auto``); on the files target it also runs with ``twophase.coalesce=off``, and
the floor is the no-op Python data source on the same, uncoalesced query.

Each query's output is checked when it stops: every kept batch reported its rows
(``numInputRows``); the files, tables and topics are read back (Parquet through Spark, a
``count(DISTINCT id)`` in PostgreSQL, a ``read_committed`` consumer in Kafka): at least every
measured batch's rows, no id twice, and for the exactly-once variants whole batches only.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage

from benchmarks import latency
from benchmarks.common import Params, percentile, progress, tmpdir, uid

#: Defaults of the options (``--datasource-*``); --quick uses QUICK.
DEFAULTS: dict[str, Any] = {"rows": 10_000, "partitions": (2, 50), "batches": 10, "warmup": 2, "reps": 2,
                            "targets": ("files", "kafka", "postgres"), "floor": True, "coalesce": 0,
                            "stateful": 0}
QUICK: dict[str, Any] = {"rows": 10_000, "partitions": (2,), "batches": 4, "warmup": 1, "reps": 1,
                         "targets": ("files",), "floor": False, "coalesce": 0,
                         "stateful": 0}
KINDS = {"files": "twophase-files", "kafka": "twophase-kafka", "postgres": "twophase-jdbc"}
COORD = "foreachBatch(Coordinator({})), log local"
FLOOR = "floor: no-op Python data source"


# ------------------------------------------------------------------------ options
def add_arguments(ap) -> None:
    ap.add_argument("--datasource-rows", type=int, help="datasource section: rows per micro-batch (default 10000)")
    ap.add_argument("--datasource-partitions", help="datasource section: comma list of the source's partitions "
                    "per micro-batch (default 2,50)")
    ap.add_argument("--datasource-batches", type=int, help="datasource section: micro-batches per query, warm-up "
                    "included (default 10)")
    ap.add_argument("--datasource-warmup", type=int, help="datasource section: first batches of each query "
                    "discarded (default 2)")
    ap.add_argument("--datasource-reps", type=int, help="datasource section: queries per variant, interleaved "
                    "(default 2)")
    ap.add_argument("--datasource-targets", help="datasource section: comma list of files, kafka, postgres "
                    "(default all)")
    ap.add_argument("--datasource-coalesce", type=int, help="datasource section: also run the data source form "
                    "after .coalesce(N) where the source has more than N partitions (default: not run)")
    ap.add_argument("--datasource-stateful", type=int, metavar="S", help="datasource section: every variant on "
                    "a deduplication within a watermark at S shuffle partitions (Spark's default: 200)")
    ap.add_argument("--datasource-no-floor", action="store_true", help="datasource section: skip the no-op "
                    "Python data source (run on the files target)")


def configure(params: Params, a, error) -> None:
    """Put the datasource options on ``params`` (as ``params.datasource``, a dict)."""
    cfg = dict(QUICK if params.quick else DEFAULTS)
    for k in ("rows", "batches", "warmup", "reps"):
        v = getattr(a, f"datasource_{k}")
        if v is not None:
            cfg[k] = v
    if a.datasource_partitions:
        cfg["partitions"] = tuple(int(x) for x in a.datasource_partitions.split(",") if x.strip())
    if a.datasource_targets:
        cfg["targets"] = tuple(x.strip() for x in a.datasource_targets.split(",") if x.strip())
        if not cfg["targets"] or set(cfg["targets"]) - set(KINDS):
            error(f"--datasource-targets takes {', '.join(KINDS)}")
    if a.datasource_no_floor:
        cfg["floor"] = False
    if a.datasource_stateful is not None:
        if a.datasource_stateful < 1:
            error("--datasource-stateful must be >= 1")
        cfg["stateful"] = a.datasource_stateful
    if a.datasource_coalesce is not None:
        if a.datasource_coalesce < 1:
            error("--datasource-coalesce must be >= 1")
        cfg["coalesce"] = a.datasource_coalesce
    if (cfg["batches"] <= cfg["warmup"] or cfg["warmup"] < 0 or cfg["reps"] < 1 or cfg["rows"] < 1
            or not cfg["partitions"] or min(cfg["partitions"]) < 1):
        error("--datasource-batches must exceed --datasource-warmup; reps, rows and partitions >= 1")
    params.datasource = cfg  # type: ignore[attr-defined]


def needs(params: Params) -> set[str]:
    cfg = getattr(params, "datasource", DEFAULTS)
    return {t for t in cfg["targets"] if t in ("kafka", "postgres")}


def targets(params: Params) -> set[str]:
    return set(getattr(params, "datasource", DEFAULTS)["targets"])


# ------------------------------------------------------------- the no-op floor
@dataclass
class NullMessage(WriterCommitMessage):
    rows: int


class _NullWriter(DataSourceStreamArrowWriter):
    def write(self, iterator):
        return NullMessage(sum(b.num_rows for b in iterator))

    def commit(self, messages, batchId):  # noqa: N803 - Spark's name
        pass

    def abort(self, messages, batchId):  # noqa: N803 - Spark's name
        pass


class NullDataSource(DataSource):
    """``format("bench-null")``: the rows reach ``write()`` in the tasks as Arrow batches, are
    counted and dropped; plan and commit do nothing.  Spark's Python Data Source API alone."""

    @classmethod
    def name(cls) -> str:
        return "bench-null"

    def streamWriter(self, schema, overwrite):  # noqa: N802 - Spark's name
        return _NullWriter()


# -------------------------------------------------------------------------- cases
class _DsCase(latency._Case):
    """A variant whose every query writes to an output of its own (``self.out``), checked after it."""

    def __init__(self, name: str, start, *, exactly_once: bool, log: str = "-", coord: bool = False):
        super().__init__(name, start, log, coord=coord)
        self.exactly_once = exactly_once
        self.out: Any = None
        self.ck: str | None = None
        #: The sink of the query's log, for recovery after it stopped (exactly-once variants).
        self.recovery_sink: Any = None
        self.checked: list[dict[str, Any]] = []
        #: Options of this variant's writer beyond the target's own (data source variants).
        self.options: dict[str, str] = {}
        self.recovered: list[dict[str, Any]] = []
        #: What the query does to the source's rows before its sink (e.g. a coalesce).
        self.pre: Any = lambda sdf: sdf


def dedup(sdf):
    """The stateful query of ``--datasource-stateful``: each ``id`` kept once within a watermark."""
    return (sdf.selectExpr("id", "payload", "current_timestamp() AS ts").withWatermark("ts", "10 minutes")
            .dropDuplicatesWithinWatermark(["id"]).select("id", "payload"))


def _after_stop(c: _DsCase) -> None:
    """Recover a stopped exactly-once query's log (``twophase recover``: what its restart would do),
    and record what was left: ``query.stop()`` interrupts a micro-batch, whose prepared
    transactions stay (holding their locks, in PostgreSQL) until the query runs again."""
    if not c.exactly_once or c.ck is None or c.recovery_sink is None:
        return
    from twophase.recovery import recover

    rep = recover(f"{c.ck}/twophase", c.recovery_sink(), takeover=True)
    c.recovered.append({"committed_batches": list(rep.committed_batches), "aborted": sum(rep.aborted.values()),
                        "lost": len(rep.lost)})
    if rep.lost:
        raise RuntimeError(f"datasource {c.name}: recovery after stop lost {rep.lost}")


def _check_rows(c: _DsCase, progs: list[Any], rows: int) -> None:
    got = [int(p.get("numInputRows") or 0) for p in progs]
    if any(n != rows for n in got):
        raise RuntimeError(f"datasource {c.name}: batches reported {got} input rows, not {rows} each")


def _check_output(c: _DsCase, n: int, distinct: int, rows: int, want: int) -> None:
    """``n`` rows (``distinct`` ids) in the query's output, which ran at least ``want`` batches."""
    c.checked.append({"rows": n, "distinct_ids": distinct})
    if n < want * rows or distinct != n or (c.exactly_once and n % rows):
        raise RuntimeError(f"datasource {c.name}: the output holds {n} rows ({distinct} distinct ids) after at "
                           f"least {want} batches of {rows}: not what the batches wrote")


def _cases(spark, target: str, rows: int, partitions: int, params: Params, cfg: dict[str, Any],
           services: dict[str, Any], cleanup: list[Any]) -> list[_DsCase]:
    from twophase.coordinator import Coordinator
    from twophase.datasource import FilesDataSource, JdbcDataSource, KafkaDataSource

    want = cfg["batches"]
    cases: list[_DsCase] = []
    base = _DsCase(latency.TITLES[target], None, exactly_once=False)
    coord = _DsCase(COORD.format(latency.SINK_NAMES[target]), None, exactly_once=True, log="local", coord=True)
    ds = _DsCase(f"format('{KINDS[target]}'), log under the checkpoint", None, exactly_once=True, log="local")
    cases = [base, coord, ds]
    data_sources = [ds]
    n = cfg.get("coalesce") or 0
    if n and n < partitions:  # the data source form with the coordinator's number of transactions
        dsc = _DsCase(f"format('{KINDS[target]}') after coalesce({n})", None, exactly_once=True, log="local")
        dsc.pre = lambda sdf: sdf.coalesce(n)
        cases.append(dsc)
        data_sources.append(dsc)
    if cfg.get("stateful") and target == "files":  # Spark's partitions, as the query makes them
        off = _DsCase(f"format('{KINDS[target]}'), twophase.coalesce=off", None, exactly_once=True, log="local")
        off.options = {"twophase.coalesce": "off"}
        cases.append(off)
        data_sources.append(off)

    def coordinated(make_sink):
        def start(sdf, ck):
            sink = make_sink()
            coord.recovery_sink = lambda: sink
            c = Coordinator(sink, checkpoint_location=ck, name=f"bench-ds-{target}-{uid()}")
            coord.coordinators.append(c)
            return sdf.writeStream.foreachBatch(c).option("checkpointLocation", ck).start()

        return start

    if target == "files":
        from twophase.sinks.files import FileSink

        def new_out(c: _DsCase) -> str:
            c.out = tmpdir("ds-out")
            return str(c.out)

        base.start = lambda sdf, ck: sdf.writeStream.format("parquet").option("checkpointLocation", ck).start(
            new_out(base))
        coord.start = coordinated(lambda: FileSink(new_out(coord), format="parquet"))
        for d in data_sources:
            d.start = lambda sdf, ck, d=d: (sdf.writeStream.format(KINDS["files"]).option("format", "parquet")
                                            .options(**d.options).option("checkpointLocation", ck)
                                            .start(new_out(d)))
            d.recovery_sink = lambda d=d: FilesDataSource({"path": d.out, "format": "parquet"}).build_sink()

        def read_back(c: _DsCase):
            def verify(q, progs):
                _check_rows(c, progs, rows)
                _after_stop(c)
                from pyspark.sql import functions as F

                r = spark.read.parquet(c.out).agg(F.count("*").alias("n"), F.countDistinct("id").alias("d")).first()
                _check_output(c, int(r["n"]), int(r["d"]), rows, want)

            return verify

        for c in cases:
            c.verify = read_back(c)
        if cfg["floor"]:
            floor = _DsCase(FLOOR, lambda sdf, ck: sdf.writeStream.format("bench-null").option(
                "checkpointLocation", ck).start(), exactly_once=False)
            floor.verify = lambda q, progs: _check_rows(floor, progs, rows)
            cases.append(floor)
    elif target == "kafka":
        from benchmarks.kafka import _create_topic
        from tests.services.kafka import read_committed
        from twophase.sinks.kafka import KafkaSink

        bootstrap = services["kafka"]["bootstrap_servers"]

        def new_topic(c: _DsCase) -> str:
            c.out = f"bench-ds-{uid()}"
            _create_topic(bootstrap, c.out, params.kafka_topic_partitions)
            cleanup.append(lambda t=c.out: _delete_topic(bootstrap, t))
            return str(c.out)

        def keyed(sdf):
            return sdf.selectExpr("CAST(id AS STRING) AS key", "payload AS value")

        base.start = lambda sdf, ck: keyed(sdf).writeStream.format("kafka").option(
            "kafka.bootstrap.servers", bootstrap).option("topic", new_topic(base)).option(
            "checkpointLocation", ck).start()
        coord.start = latency._keyed(coordinated(
            lambda: KafkaSink(bootstrap, topic=new_topic(coord), transactional_id_prefix=f"bench-ds-{uid()}")))
        for d in data_sources:
            d.start = lambda sdf, ck, d=d: keyed(sdf).writeStream.format(KINDS["kafka"]).option(
                "kafka.bootstrap.servers", bootstrap).option("topic", new_topic(d)).option(
                "checkpointLocation", ck).start()
            d.recovery_sink = lambda d=d: KafkaDataSource({"kafka.bootstrap.servers": bootstrap, "topic": d.out,
                                                           "checkpointlocation": d.ck}).build_sink()

        def consume(c: _DsCase):
            def verify(q, progs):
                _check_rows(c, progs, rows)
                _after_stop(c)
                keys = read_committed(bootstrap, c.out, timeout=120.0, part="key")
                _check_output(c, len(keys), len(set(keys)), rows, want)

            return verify

        for c in cases:
            c.verify = consume(c)
    else:
        import psycopg2

        from twophase.sinks.postgres import PostgresSink

        info = services["postgres"]

        def sql(statement: str) -> Any:
            conn = psycopg2.connect(info["dsn"])
            conn.autocommit = True
            try:
                with conn.cursor() as cur:
                    cur.execute(statement)
                    return cur.fetchone() if cur.description else None
            finally:
                conn.close()

        def new_table(c: _DsCase) -> str:
            c.out = f"bench_ds_{uid()}"
            sql(f'CREATE TABLE "{c.out}" (id BIGINT, payload TEXT)')
            cleanup.append(lambda t=c.out: sql(f'DROP TABLE IF EXISTS "{t}"'))
            return str(c.out)

        url = f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}"
        props = {"user": info["user"], "password": info["password"], "driver": "org.postgresql.Driver"}

        def jdbc_start(sdf, ck):
            table = new_table(base)
            return sdf.writeStream.foreachBatch(lambda d, i: d.write.jdbc(url, table, mode="append",
                                                                           properties=props)).option(
                "checkpointLocation", ck).start()

        base.start = jdbc_start
        coord.start = coordinated(lambda: PostgresSink(info["dsn"], new_table(coord), gid_prefix=f"d{uid()}"))

        def jdbc_options(table: str) -> dict[str, str]:
            return {"url": url, "dbtable": table, "user": info["user"], "password": info["password"]}

        def ds_start(d: _DsCase):
            def start(sdf, ck):
                w = sdf.writeStream.format(KINDS["postgres"])
                for k, v in jdbc_options(new_table(d)).items():
                    w = w.option(k, v)
                return w.option("checkpointLocation", ck).start()

            return start

        for d in data_sources:
            d.start = ds_start(d)
            d.recovery_sink = lambda d=d: JdbcDataSource(jdbc_options(d.out)).build_sink()

        def count(c: _DsCase):
            def verify(q, progs):
                _check_rows(c, progs, rows)
                _after_stop(c)  # else DROP TABLE waits for the locks of what the stop left prepared
                n, d = sql(f'SELECT count(*), count(DISTINCT id) FROM "{c.out}"')
                _check_output(c, int(n), int(d), rows, want)
                sql(f'DROP TABLE IF EXISTS "{c.out}"')

            return verify

        for c in cases:
            c.verify = count(c)
    for c in cases:
        if cfg.get("stateful"):
            pre = c.pre
            c.pre = lambda sdf, pre=pre: pre(dedup(sdf))
        c.start = _remembering(c, c.start)
    return cases


def _remembering(c: _DsCase, start):
    def remembered(sdf, ck):
        c.ck = ck
        return start(c.pre(sdf), ck)

    return remembered


def _delete_topic(bootstrap: str, topic: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the deletion is done
    admin.delete_topics([topic])[topic].result(timeout=60)


# ---------------------------------------------------------------------------- run
def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    import twophase.datasource

    cfg = getattr(params, "datasource", QUICK if params.quick else DEFAULTS)
    progress(f"datasource: {cfg}")
    twophase.datasource.register(spark)
    spark.dataSource.register(NullDataSource)
    code = {"driver": _code(), "python_worker": spark.sparkContext.parallelize([0], 1).map(lambda _: _code()).first()}
    progress(f"datasource: code measured: {code}")
    rows = cfg["rows"]
    groups: list[dict[str, Any]] = []
    cleanup: list[Any] = []
    steps: dict[str, Any] = {}
    shuffle = spark.conf.get("spark.sql.shuffle.partitions")
    if cfg.get("stateful"):  # fixed in each query's checkpoint by its first batch
        spark.conf.set("spark.sql.shuffle.partitions", str(cfg["stateful"]))
    try:
        for target in cfg["targets"]:
            for p in cfg["partitions"]:
                progress(f"datasource: === {target}, {p} partitions, {rows} rows per batch ===")
                cases = _cases(spark, target, rows, p, params, cfg, services, cleanup)
                g = latency._measure(spark, target, rows, params, cfg, cases, partitions=p, label="datasource")
                groups.append(_derive(g, cases, p, rows))
        steps = {} if cfg.get("stateful") else in_process(cfg["targets"], services, cleanup, n=cfg["batches"] + 2,
                                                          warm=2)
    finally:
        spark.conf.set("spark.sql.shuffle.partitions", shuffle)
        for f in cleanup:
            try:
                f()
            except Exception as e:  # noqa: BLE001 - cleanup of a benchmark's own tables/topics
                progress(f"datasource: cleanup: {type(e).__name__}: {e}")
    title = f"The data source form, stateful query at {cfg['stateful']} shuffle partitions" if cfg.get("stateful") \
        else "The data source form"
    return {"title": title, "config": {k: list(v) if isinstance(v, tuple) else v
                                                        for k, v in cfg.items()},
            "groups": groups, "in_process": steps, "code": code, "goals": []}


def _code() -> dict[str, str]:
    """Where twophase, its coordinator and its sinks are imported from (an editable install can map
    them to different trees)."""
    import twophase
    import twophase.coordinator
    import twophase.sinks

    return {m.__name__: str(m.__file__) for m in (twophase, twophase.coordinator, twophase.sinks)}


def in_process(targets, services: dict[str, Any], cleanup: list[Any], n: int, warm: int) -> dict[str, Any]:
    """The data source's own two steps, in this process, without Spark: ``streamWriter()`` of a
    ``DataSource`` made afresh (the plan: read the checkpoint's ``offsets/``, build and open the
    sink, take a new log epoch, recovery's read, the INTENT), then ``commit()`` on a writer of an
    unpickled ``DataSource`` (Spark's commit step) with one message of no rows: the decision and
    COMMITTED with no transaction to commit.  ``n`` pairs over a fake checkpoint (``metadata``,
    ``offsets/N``), the first ``warm`` discarded: what twophase itself spends per micro-batch
    in the two planner calls, apart from the round trips to the planner worker and the tasks."""
    import json
    import os
    import pickle
    import time
    from dataclasses import asdict

    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from twophase.datasource import FilesDataSource, JdbcDataSource, KafkaDataSource, TaskMessage

    schema = StructType([StructField("id", LongType()), StructField("payload", StringType())])
    out: dict[str, Any] = {}
    for target in targets:
        options: dict[str, Any]
        cls: Any
        if target == "files":
            cls, options = FilesDataSource, {"path": tmpdir("ds-inproc-out"), "format": "parquet"}
        elif target == "kafka":
            from benchmarks.kafka import _create_topic

            bootstrap = services["kafka"]["bootstrap_servers"]
            topic = f"bench-ds-inproc-{uid()}"
            _create_topic(bootstrap, topic, 4)
            cleanup.append(lambda t=topic, b=bootstrap: _delete_topic(b, t))
            cls, options = KafkaDataSource, {"kafka.bootstrap.servers": bootstrap, "topic": topic}
        else:
            import psycopg2

            info = services["postgres"]
            table = f"bench_ds_inproc_{uid()}"
            conn = psycopg2.connect(info["dsn"])
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'CREATE TABLE "{table}" (id BIGINT, payload TEXT)')
            conn.close()

            def drop(t: str = table, dsn: str = info["dsn"]) -> None:
                c = psycopg2.connect(dsn)
                c.autocommit = True
                with c.cursor() as cur:
                    cur.execute(f'DROP TABLE IF EXISTS "{t}"')
                c.close()

            cleanup.append(drop)
            cls, options = JdbcDataSource, {"url": f"jdbc:postgresql://{info['host']}:{info['port']}/"
                                            f"{info['dbname']}", "dbtable": table, "user": info["user"],
                                            "password": info["password"]}
        ck = tmpdir("ds-inproc-ckpt")
        os.makedirs(f"{ck}/offsets")
        with open(f"{ck}/metadata", "w") as f:
            f.write(json.dumps({"id": f"bench-{uid()}"}))
        options["checkpointlocation"] = ck
        committer = pickle.loads(pickle.dumps(cls(options)))  # as Spark's commit step: never plans
        plan_ms: list[float] = []
        commit_ms: list[float] = []
        for b in range(n):
            with open(f"{ck}/offsets/{b}", "w") as f:
                f.write('v1\n{"batchWatermarkMs":0}\n{"0":1}\n')
            t0 = time.perf_counter()
            w = cls(options).streamWriter(schema, False)
            t1 = time.perf_counter()
            assert w.plan is not None and w.plan.action == "write", w.plan
            committer.streamWriter(schema, False).commit([TaskMessage(asdict(w.plan), 0, 0, 0, None)], b)
            t2 = time.perf_counter()
            if b >= warm:
                plan_ms.append((t1 - t0) * 1000)
                commit_ms.append((t2 - t1) * 1000)
        committed = sorted(os.listdir(f"{ck}/twophase")) if os.path.isdir(f"{ck}/twophase") else []
        out[target] = {"plan_ms": [round(x, 1) for x in plan_ms], "commit_ms": [round(x, 1) for x in commit_ms],
                       "plan_ms_median": round(statistics.median(plan_ms), 1),
                       "commit_ms_median": round(statistics.median(commit_ms), 1),
                       "plan_ms_p10_p90": [percentile(plan_ms, 10), percentile(plan_ms, 90)],
                       "commit_ms_p10_p90": [percentile(commit_ms, 10), percentile(commit_ms, 90)],
                       "log_entries": committed}
        progress(f"datasource: in process, {target}: plan {out[target]['plan_ms_median']:.0f} ms, commit step "
                 f"{out[target]['commit_ms_median']:.0f} ms (medians of {len(plan_ms)})")
    return out


def _derive(g: dict[str, Any], cases: list[_DsCase], partitions: int, rows: int) -> dict[str, Any]:
    """Per-row figures, and the data source form's cost over the coordinator, from ``g``'s medians."""
    g["partitions"] = partitions
    names = [c.name for c in cases]
    coord, ds = g["variants"][names[1]], g["variants"][names[2]]
    for c in cases:
        v = g["variants"][c.name]
        v["us_per_row"] = round(v["trigger_ms_median"] * 1000 / rows, 2)
        v["add_batch_us_per_row"] = round(v["add_batch_ms_median"] * 1000 / rows, 2)
        v["rows_per_s"] = round(rows / (v["trigger_ms_median"] / 1000), 1)
        v["query_planning_ms_median"] = v["other_ms_median"].get("queryPlanning")
        v["over_coordinator_ms"] = round(v["trigger_ms_median"] - coord["trigger_ms_median"], 1)
        v["output_checked"] = c.checked
        if c.recovered:  # what each stopped query left, found by recovery
            v["recovered_after_stop"] = c.recovered
    g["coordinator"], g["datasource"] = names[1], names[2]
    over = {"trigger_ms": round(ds["trigger_ms_median"] - coord["trigger_ms_median"], 1),
            "add_batch_ms": round(ds["add_batch_ms_median"] - coord["add_batch_ms_median"], 1),
            "query_planning_ms": round((ds["query_planning_ms_median"] or 0) - (coord["query_planning_ms_median"] or 0),
                                       1),
            "ratio": round(coord["trigger_ms_median"] / ds["trigger_ms_median"], 3)}
    over["us_per_row"] = round(over["trigger_ms"] * 1000 / rows, 2)
    # Beside Spark's sink: what is left of the addBatch difference, and the other steps of a batch.
    over["rest_ms"] = round(over["trigger_ms"] - over["add_batch_ms"] - over["query_planning_ms"], 1)
    g["datasource_over_coordinator"] = over
    if FLOOR in g["variants"]:
        f = g["variants"][FLOOR]
        g["floor_over_spark"] = {"trigger_ms": round(f["trigger_ms_median"] - g["variants"][names[0]]["trigger_ms_median"], 1),
                                 "query_planning_ms": round((f["query_planning_ms_median"] or 0) - (
                                     g["variants"][names[0]]["query_planning_ms_median"] or 0), 1)}
        g["datasource_over_floor"] = {
            "trigger_ms": round(ds["trigger_ms_median"] - f["trigger_ms_median"], 1),
            "add_batch_ms": round(ds["add_batch_ms_median"] - f["add_batch_ms_median"], 1),
            "query_planning_ms": round((ds["query_planning_ms_median"] or 0) - (f["query_planning_ms_median"] or 0), 1)}
    progress(f"datasource: {g['target']} P={partitions}: data source over coordinator {over['trigger_ms']:+.0f} ms "
             f"per batch (addBatch {over['add_batch_ms']:+.0f}, queryPlanning {over['query_planning_ms']:+.0f}); "
             f"{over['us_per_row']:+.1f} us per row")
    return g

