"""Latency per micro-batch: small, frequent streaming batches, with the transaction log local,
on S3 (MinIO) or on HDFS (issue 29).

Every case is a streaming query over Spark's ``rate-micro-batch`` source (``rowsPerBatch``
rows a batch, 2 partitions, the default trigger: the next batch starts as soon as the last
one ends), run for ``--latency-batches`` micro-batches, the first
``--latency-warmup`` of which are discarded.  Per batch, Spark's own ``durationMs``
(``triggerExecution``: the whole micro-batch; ``addBatch``: the sink's part) from
``query.recentProgress``.  The variants of one (target, rows per batch) group run one query
each, interleaved (the order rotates every round) and repeated ``--latency-reps`` times; medians
are over the batches of all rounds.

Variants, per target: Spark's own streaming sink for that target (``format("parquet")``,
``format("kafka")``, ``foreachBatch`` + ``df.write.jdbc``), and ``foreachBatch(Coordinator(...))``
with the log local (``<checkpoint>/twophase``), on S3 (MinIO behind a pass-through TCP proxy
that can add a delay before each HTTP request), or on HDFS (WebHDFS behind the same proxy).
Spark's own checkpoint is local in every case, so the log's round trips are all the remote
I/O a case does.  The file target also runs a ladder of floors: an empty ``foreachBatch``, a
``foreachBatch`` that moves the rows into Python workers with ``mapInArrow`` and collects one
row per task (what the coordinator's handle collection costs at least), the same through the
RDD API (pickled rows, no Arrow), and ``Coordinator(NullSink)``; and
``FileSink(writer="spark")`` with the log local: one ``df.write`` per batch in Spark's JVM into
the batch's staging folder, no rows through Python workers.

The proxy (this module run as a program, in its own process) forwards bytes unchanged, so
SigV4 signatures stay valid, and records each HTTP request (method, target, when it started,
when its last response byte came), which the benchmark assigns to batches by the
coordinator's own per-batch timestamps.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import Params, goal, percentile, progress, tmpdir, uid

#: Defaults of the options (``--latency-*``); --quick uses QUICK.
DEFAULTS: dict[str, Any] = {"rows": (100, 10_000), "batches": 20, "warmup": 3, "reps": 2, "sinks": ("files", "kafka", "postgres"),
            "logs": ("local", "s3", "hdfs"), "delays": (0, 25), "ladder": True, "file_writers": ("arrow", "spark"),
            "task_inputs": ("auto",)}
QUICK: dict[str, Any] = {"rows": (100,), "batches": 3, "warmup": 1, "reps": 1, "sinks": ("files",), "logs": ("s3",),
         "delays": (0,), "ladder": False, "file_writers": ("arrow",),
         "task_inputs": ("auto",)}
TITLES = {"files": "Spark format('parquet')", "kafka": "Spark format('kafka')",
          "postgres": "Spark foreachBatch + df.write.jdbc"}
SINK_NAMES = {"files": "FileSink", "kafka": "KafkaSink", "postgres": "PostgresSink"}


# ------------------------------------------------------------------------ options
def add_arguments(ap) -> None:
    ap.add_argument("--latency-rows", help="latency section: comma list of rows per micro-batch (default 100,10000)")
    ap.add_argument("--latency-batches", type=int, help="latency section: micro-batches per query, warm-up "
                    "included (default 20)")
    ap.add_argument("--latency-warmup", type=int, help="latency section: first batches of each query discarded "
                    "(default 3)")
    ap.add_argument("--latency-reps", type=int, help="latency section: queries per variant, interleaved (default 2)")
    ap.add_argument("--latency-sinks", help="latency section: comma list of files, kafka, postgres (default all)")
    ap.add_argument("--latency-logs", help="latency section: comma list of transaction log locations "
                    "local, s3 (MinIO), hdfs (default all)")
    ap.add_argument("--latency-delays", help="latency section: comma list of ms added before each S3 request "
                    "by the proxy in front of MinIO (default 0,25)")
    ap.add_argument("--latency-file-writers", help="latency section: FileSink writers measured (arrow, "
                    "spark; default both). arrow runs with every log location, spark (one df.write "
                    "per batch into the batch's staging folder) with the log local")
    ap.add_argument("--latency-task-inputs", help="latency section: Coordinator(task_input=...) values "
                    "measured (auto, arrow, rows, driver; default auto). The first runs with every log location, "
                    "the others with the log local. With driver, every target also gets the driver path's "
                    "floor: an empty foreachBatch plus its collect (df.limit(n + 1).toArrow())")
    ap.add_argument("--latency-no-ladder", action="store_true", help="latency section: skip the floors "
                    "(empty foreachBatch, rows-into-Python collect by mapInArrow and by the RDD API, "
                    "Coordinator(NullSink))")


def configure(params: Params, a, error) -> None:
    """Put the latency options on ``params`` (as ``params.latency``, a dict)."""
    cfg = dict(QUICK if params.quick else DEFAULTS)
    if a.latency_rows:
        cfg["rows"] = tuple(int(x) for x in a.latency_rows.split(",") if x.strip())
    for k in ("batches", "warmup", "reps"):
        v = getattr(a, f"latency_{k}")
        if v is not None:
            cfg[k] = v
    if a.latency_sinks:
        cfg["sinks"] = tuple(x.strip() for x in a.latency_sinks.split(",") if x.strip())
        if set(cfg["sinks"]) - set(TITLES):
            error(f"--latency-sinks takes {', '.join(TITLES)}")
    if a.latency_logs:
        cfg["logs"] = tuple(x.strip() for x in a.latency_logs.split(",") if x.strip())
        if set(cfg["logs"]) - {"local", "s3", "hdfs"}:
            error("--latency-logs takes local, s3, hdfs")
    if a.latency_delays:
        cfg["delays"] = tuple(int(x) for x in a.latency_delays.split(",") if x.strip())
    if a.latency_no_ladder:
        cfg["ladder"] = False
    if a.latency_file_writers:
        cfg["file_writers"] = tuple(x.strip() for x in a.latency_file_writers.split(",") if x.strip())
        if not cfg["file_writers"] or set(cfg["file_writers"]) - {"arrow", "spark"}:
            error("--latency-file-writers takes arrow, spark or both")
    if a.latency_task_inputs:
        cfg["task_inputs"] = tuple(x.strip() for x in a.latency_task_inputs.split(",") if x.strip())
        if not cfg["task_inputs"] or set(cfg["task_inputs"]) - {"auto", "arrow", "rows", "driver"}:
            error("--latency-task-inputs takes auto, arrow, rows, driver")
    if cfg["batches"] <= cfg["warmup"] or cfg["reps"] < 1 or not cfg["rows"] or min(cfg["rows"]) < 1:
        error("--latency-batches must exceed --latency-warmup; reps and rows >= 1")
    params.latency = cfg  # type: ignore[attr-defined]


def needs(params: Params) -> set[str]:
    cfg = getattr(params, "latency", DEFAULTS)
    out = {s for s in cfg["sinks"] if s in ("kafka", "postgres")}
    out |= {"minio" if lg == "s3" else lg for lg in cfg["logs"] if lg != "local"}
    return out


def jars(params: Params, only: list[str], sinks: set[str] | None = None) -> list[str]:
    """Jars the chosen sinks' Spark baselines need that :func:`benchmarks.common.session` does not
    already add for the other sections of this run (``sinks``: these targets, for every streaming
    section at once, instead of the latency section's)."""
    cfg = getattr(params, "latency", DEFAULTS)
    if sinks is None:
        sinks = set(cfg["sinks"])
    out: list[str] = []
    if "kafka" in sinks and not {"kafka", "partitions", "connect"} & set(only):
        from tests.services.kafka import spark_kafka_jars

        progress("streaming sections: resolving Spark's Kafka writer jars")
        out += [str(j) for j in spark_kafka_jars()]
    if "postgres" in sinks and not {"postgres", "partitions", "connect"} & set(only):
        from tests.services.maven import resolve

        progress("streaming sections: resolving the PostgreSQL JDBC driver")
        out += [str(j) for j in resolve(["org.postgresql:postgresql:42.7.8"], "postgresql-jdbc")]
    return out


# -------------------------------------------------------------------------- proxy
class Proxy:
    """The request-recording (and delaying) TCP proxy, in a process of its own."""

    def __init__(self, target: str, delay_ms: float):
        from urllib.parse import urlsplit

        u = urlsplit(target)
        self.events = Path(tempfile.mkstemp(prefix="twophase-bench-proxy-", suffix=".jsonl")[1])
        self.delay_ms = delay_ms
        port_file = self.events.with_suffix(".port")
        self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.latency", "proxy", str(u.hostname),
                                      str(u.port), str(delay_ms), str(self.events), str(port_file)],
                                     cwd=str(Path(__file__).resolve().parents[1]))
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the latency proxy did not start")
            time.sleep(0.05)
        self.port = int(port_file.read_text())
        port_file.unlink()
        self.url = f"{u.scheme}://127.0.0.1:{self.port}"

    def requests(self) -> list[dict[str, Any]]:
        """Every request so far: {id, method, target, start, end} (epoch seconds)."""
        reqs: dict[int, dict[str, Any]] = {}
        for line in self.events.read_text().splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue  # a line being written
            if e["ev"] == "req":
                reqs[e["id"]] = {"id": e["id"], "method": e["method"], "target": e["target"],
                                 "start": e["t"], "end": e["t"]}
            elif e["id"] in reqs:
                reqs[e["id"]]["end"] = max(reqs[e["id"]]["end"], e["t"])
        return sorted(reqs.values(), key=lambda r: r["start"])

    def stop(self) -> None:
        self.proc.terminate()  # our own child, by its handle
        self.proc.wait(10)
        self.events.unlink(missing_ok=True)


def _serve(host: str, port: int, delay_ms: float, events: str, port_file: str) -> None:
    """Forward 127.0.0.1:<free> to host:port byte for byte; before forwarding the first byte of
    each HTTP request, wait ``delay_ms``; log each request and each response chunk's time."""
    import asyncio
    import itertools

    out = open(events, "a", buffering=1)
    ids = itertools.count()

    def emit(**e: Any) -> None:
        out.write(json.dumps(e) + "\n")

    async def handle(cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        try:
            sr, sw = await asyncio.open_connection(host, port)
        except OSError:
            cw.close()
            return
        current: list[int | None] = [None]

        async def upstream() -> None:
            # Parse the client's byte stream into requests: headers, then Content-Length bytes
            # (chunked bodies: until the 0-length chunk).
            buf = b""
            need_body = 0
            chunked = False
            while True:
                data = await cr.read(65536)
                if not data:
                    break
                buf += data
                send = b""
                while buf:
                    if need_body > 0:
                        n = min(need_body, len(buf))
                        send += buf[:n]
                        buf = buf[n:]
                        need_body -= n
                        continue
                    if chunked:
                        end = buf.find(b"0\r\n\r\n")
                        if end < 0:
                            send += buf
                            buf = b""
                            break
                        send += buf[:end + 5]
                        buf = buf[end + 5:]
                        chunked = False
                        continue
                    head_end = buf.find(b"\r\n\r\n")
                    if head_end < 0:
                        break  # wait for the whole head
                    head = buf[:head_end].decode("latin-1")
                    line, *hdrs = head.split("\r\n")
                    parts = line.split(" ")
                    rid = next(ids)
                    current[0] = rid
                    emit(ev="req", id=rid, t=time.time(), method=parts[0],
                         target=parts[1] if len(parts) > 1 else "")
                    h = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in hdrs)}
                    need_body = int(h.get("content-length") or 0)
                    chunked = "chunked" in h.get("transfer-encoding", "").lower()
                    if send:
                        sw.write(send)
                        send = b""
                    if delay_ms:
                        await asyncio.sleep(delay_ms / 1000.0)
                    send += buf[:head_end + 4]
                    buf = buf[head_end + 4:]
                if send:
                    sw.write(send)
                    await sw.drain()
            sw.close()

        async def downstream() -> None:
            while True:
                data = await sr.read(65536)
                if not data:
                    break
                if current[0] is not None:
                    emit(ev="resp", id=current[0], t=time.time())
                cw.write(data)
                await cw.drain()
            cw.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        Path(port_file).write_text(str(server.sockets[0].getsockname()[1]))
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def classify(req: dict[str, Any]) -> str:
    """A short name for a log request: S3 (``PUT <record>``, ``LIST <prefix>``, ``GET <key>``) or
    WebHDFS (``<OP> <path>``)."""
    from urllib.parse import parse_qs, unquote, urlsplit

    u = urlsplit(req["target"])
    q = parse_qs(u.query)
    path = unquote(u.path)
    if "op" in q:  # WebHDFS
        return f"{q['op'][0]} {_tail(path)}"
    if "list-type" in q or ("prefix" in q and req["method"] == "GET"):
        return f"LIST {_tail(q.get('prefix', [''])[0])}"
    return f"{req['method']} {_tail(path)}"


def _tail(path: str) -> str:
    """The log-relative part of a key: ``g0001/batch-…7.intent.json`` -> ``intent`` (its HDFS temp
    file ``.batch-…7.intent.json.<uuid>.tmp`` -> ``intent (temp file)``); others as is."""
    name = path.rstrip("/").rsplit("/", 1)[-1] or path
    for st in ("intent", "prepared", "committed"):
        if name.lstrip(".").startswith("batch-") and f".{st}" in name:
            # HDFS writes a record as a hidden temp file, then renames it into place
            return f"{st} (temp file)" if name.endswith(".tmp") else st
    if "epochs" in path:
        return "epochs/"
    return name


# -------------------------------------------------------------------------- cases
def _payload(row_size: int) -> str:
    return f"substring(repeat(sha2(cast(value as string), 256), {row_size // 64 + 1}), 1, {row_size}) AS payload"


class _Case:
    """One variant of one (target, rows) group: ``start(sdf, ckpt)`` starts its query."""

    def __init__(self, name: str, start, log: str = "-", delay_ms: float | None = None, coord: bool = False):
        self.name, self.start, self.log, self.delay_ms, self.coord = name, start, log, delay_ms, coord
        self.trigger_ms: list[float] = []
        self.add_batch_ms: list[float] = []
        self.other_ms: dict[str, list[float]] = {}
        self.rep_medians: list[float] = []
        self.progress: list[dict[str, Any]] = []
        self.requests: list[dict[str, Any]] = []  # per steady-state batch
        self.coordinators: list[Any] = []
        self.proxy: Proxy | None = None
        #: Called after each query with (query, kept progress entries): raises when the output is not
        #: what the batches wrote (so a broken variant cannot report a fast time).
        self.verify: Any = None


def _duration(p, key: str) -> float | None:
    d = p.get("durationMs") or {}
    return float(d[key]) if key in d else None


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    cfg = getattr(params, "latency", QUICK if params.quick else DEFAULTS)
    progress(f"latency: {cfg}")
    proxies: dict[tuple[str, float], Proxy] = {}
    groups: list[dict[str, Any]] = []
    cleanup: list[Any] = []
    try:
        for target in cfg["sinks"]:
            for rows in cfg["rows"]:
                cases = _cases(spark, target, rows, params, cfg, services, proxies, cleanup)
                groups.append(_measure(spark, target, rows, params, cfg, cases))
    finally:
        for p in proxies.values():
            p.stop()
        for f in cleanup:
            f()
    goals = make_goals(groups)
    return {"title": "Latency per micro-batch", "config": {k: list(v) if isinstance(v, tuple) else v
                                                            for k, v in cfg.items()},
            "groups": groups, "goals": goals}


def make_goals(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 29's goals, from the groups' numbers: each sink (not the floors) against Spark's own
    sink; log requests on the critical path (S3: every request; HDFS: the NameNode's, the
    DataNode writes a create is redirected to do not pass the proxy); round trips a delay adds."""
    goals = []
    for g in groups:
        for name, v in g["variants"].items():
            if not v.get("coordinator") or not name.startswith(SINK_NAMES[g["target"]]):
                continue
            if v["log"] == "local":
                goals.append(goal(f"latency: {g['rows']}-row batches: {name} >= 1.0x {g['baseline']} "
                                  "(median triggerExecution)", v["ratio"], 1.0, ">="))
            lr = v.get("log_requests")
            if lr:
                what = "NameNode requests" if v["log"] == "hdfs" else "log requests"
                goals.append(goal(f"latency: {g['rows']}-row batches, {name}: {what} on the critical path per "
                                  "steady-state batch <= 3 (median)", lr["critical_median"], 3.5, "<"))
        # Spark's checkpoint is local in every case: the round trips a delay adds to our batch
        # (against the same query at +0 ms) are the round trips we pay more than Spark's sink.
        for d, n in (g.get("round_trips_added") or {}).items():
            goals.append(goal(f"latency: {g['rows']}-row batches, {g['target']}: round trips added to the median "
                              f"triggerExecution by {d} ms per S3 request (Spark's sink: 0) <= 3", n, 3.5, "<"))
    return goals


def _cases(spark, target: str, rows: int, params: Params, cfg: dict[str, Any], services: dict[str, Any],
           proxies: dict[tuple[str, float], Proxy], cleanup: list[Any]) -> list[_Case]:
    from twophase.coordinator import Coordinator

    cases: list[_Case] = []

    def coordinated(label: str, make_sink, log: str, delay: float | None = None,
                    task_input: str = "auto") -> _Case:
        case = _Case(label, None, log, delay, coord=True)

        def start(sdf, ck):
            so = loc = px = None
            if log == "s3":
                from tests.services.s3 import storage_options

                info = services["minio"]
                px = proxies.get(("s3", delay))
                if px is None:
                    px = proxies[("s3", delay)] = Proxy(info["endpoint_url"], delay or 0)
                so = storage_options(dict(info, endpoint_url=px.url))
                loc = f"s3://{info['bucket']}/bench-latency-{uid()}/log"
            elif log == "hdfs":
                h = services["hdfs"]
                px = proxies.get(("hdfs", 0))
                if px is None:
                    px = proxies[("hdfs", 0)] = Proxy(h["webhdfs_url"], 0)
                so = {"webhdfs_url": px.url, "user": h["user"]}
                loc = f"{h['namenode']}/bench-latency-{uid()}/log"
            case.proxy = px
            # On the test cluster every executor runs on this host: local paths are shared.
            coord = Coordinator(make_sink(), checkpoint_location=ck, log_location=loc, storage_options=so,
                                name=f"bench-lat-{target}-{uid()}", shared_storage=params.cluster > 0,
                                task_input=task_input)
            case.coordinators.append(coord)
            return sdf.writeStream.foreachBatch(coord).option("checkpointLocation", ck).start()

        case.start = start
        return case

    if target == "files":
        from twophase.sinks.files import FileSink

        def sink():
            return FileSink(tmpdir("lat-ours"), format="parquet")

        cases.append(_Case(TITLES["files"], lambda sdf, ck: sdf.writeStream.format("parquet").option(
            "path", tmpdir("lat-spark")).option("checkpointLocation", ck).start()))
        if cfg["ladder"]:
            cases += _ladder()
    elif target == "kafka":
        from benchmarks.kafka import _create_topic
        from twophase.sinks.kafka import KafkaSink

        bootstrap = services["kafka"]["bootstrap_servers"]
        topic = f"bench-latency-{uid()}"
        _create_topic(bootstrap, topic, params.kafka_topic_partitions)

        def sink():
            return KafkaSink(bootstrap, topic=topic, transactional_id_prefix=f"bench-lat-{uid()}")

        cases.append(_Case(TITLES["kafka"], lambda sdf, ck: sdf.selectExpr(
            "CAST(id AS STRING) AS key", "payload AS value").writeStream.format("kafka").option(
            "kafka.bootstrap.servers", bootstrap).option("topic", topic).option("checkpointLocation", ck).start()))
    else:
        import psycopg2

        from twophase.sinks.postgres import PostgresSink

        info = services["postgres"]
        tag = uid()
        ours_t, jdbc_t = f"bench_lat_sink_{tag}", f"bench_lat_jdbc_{tag}"
        conn = psycopg2.connect(info["dsn"])
        conn.autocommit = True
        with conn.cursor() as cur:
            for t in (ours_t, jdbc_t):
                cur.execute(f'CREATE TABLE "{t}" (id BIGINT, payload TEXT)')
        conn.close()

        prefixes: list[str] = []

        def drop():
            c = psycopg2.connect(info["dsn"])
            c.autocommit = True
            with c.cursor() as cur:
                # A query stopped mid-batch can leave its batch's prepared transactions (a restart
                # would abort them by its INTENT; these queries are not restarted), and they hold
                # locks on the table: roll back ours first, so that DROP does not wait for ever.
                cur.execute("SELECT gid FROM pg_prepared_xacts WHERE split_part(gid, ':', 1) = ANY(%s)",
                            (prefixes,))
                for (gid,) in cur.fetchall():
                    cur.execute("ROLLBACK PREPARED %s", (gid,))
                cur.execute("SET lock_timeout = '30s'")
                for t in (ours_t, jdbc_t):
                    cur.execute(f'DROP TABLE IF EXISTS "{t}"')
            c.close()

        cleanup.append(drop)
        url = f"jdbc:postgresql://{info['host']}:{info['port']}/{info['dbname']}"
        props = {"user": info["user"], "password": info["password"], "driver": "org.postgresql.Driver"}

        def sink():
            prefixes.append(f"l{uid()}")
            return PostgresSink(info["dsn"], ours_t, gid_prefix=prefixes[-1])

        def jdbc(batch_df, batch_id):
            batch_df.write.jdbc(url, jdbc_t, mode="append", properties=props)

        cases.append(_Case(TITLES["postgres"], lambda sdf, ck: sdf.writeStream.foreachBatch(jdbc).option(
            "checkpointLocation", ck).start()))
    ours = SINK_NAMES[target]
    if target == "files" and "spark" in cfg["file_writers"]:
        def spark_writer_sink():
            return FileSink(tmpdir("lat-ours-sw"), format="parquet", writer="spark")

        cases.append(coordinated("FileSink(writer='spark'), log local", spark_writer_sink, "local"))
        if "arrow" not in cfg["file_writers"]:
            return cases
    first, *others = cfg["task_inputs"]
    said = "" if first == "auto" else f", task_input={first}"
    for log in cfg["logs"]:
        if log == "s3":
            for d in cfg["delays"]:
                cases.append(coordinated(f"{ours}, log on S3 (MinIO, +{d} ms/request){said}", sink, "s3", d, first))
        elif log == "hdfs":
            cases.append(coordinated(f"{ours}, log on HDFS{said}", sink, "hdfs", task_input=first))
        else:
            cases.append(coordinated(f"{ours}, log local{said}", sink, "local", task_input=first))
    for ti in others:
        cases.append(coordinated(f"{ours}, log local, task_input={ti}", sink, "local", task_input=ti))
    if "driver" in cfg["task_inputs"]:
        cases.append(_collect_floor(rows))
    if target == "kafka":  # the coordinated queries write key/value rows
        for c in cases[1:]:
            c.start = _keyed(c.start)
    return cases


def _collect_floor(rows: int) -> _Case:
    """The driver path's floor: an empty ``foreachBatch`` plus the collect the driver path makes
    (``df.limit(bound + 1).toArrow()``, the default bound), rows counted."""
    from twophase.coordinator.coordinator import DRIVER_BATCH_ROWS as bound
    case = _Case("floor: empty foreachBatch + the driver path's collect (toArrow)", None)

    def start(sdf, ck):
        def collect(d, i):
            n = d.limit(bound + 1).toArrow().num_rows
            if n != rows:
                raise RuntimeError(f"the collect floor read {n} rows of a {rows}-row batch")
        return sdf.writeStream.foreachBatch(collect).option("checkpointLocation", ck).start()

    case.start = start
    return case


def _keyed(start):
    """``start`` on the Kafka rows (key, value) of the source's (id, payload)."""
    return lambda sdf, ck: start(sdf.selectExpr("CAST(id AS STRING) AS key", "payload AS value"), ck)


def _ladder() -> list[_Case]:
    """Floors of a Python foreachBatch writer, on the file target's source."""
    from benchmarks.coordinator import NullSink, _plain_collect, _rdd_collect
    from twophase.coordinator import Coordinator

    def empty(sdf, ck):
        return sdf.writeStream.foreachBatch(lambda d, i: None).option("checkpointLocation", ck).start()

    def collect(sdf, ck):
        return sdf.writeStream.foreachBatch(lambda d, i: _plain_collect(d)).option("checkpointLocation", ck).start()

    def rdd_collect(sdf, ck):
        return sdf.writeStream.foreachBatch(lambda d, i: _rdd_collect(d)).option("checkpointLocation", ck).start()

    null = _Case("Coordinator(NullSink), log local", None, "local", coord=True)

    def null_start(sdf, ck):
        coord = Coordinator(NullSink(), checkpoint_location=ck, name=f"bench-lat-null-{uid()}",
                            shared_storage=True)
        null.coordinators.append(coord)
        return sdf.writeStream.foreachBatch(coord).option("checkpointLocation", ck).start()

    null.start = null_start
    return [_Case("floor: empty foreachBatch", empty),
            _Case("floor: foreachBatch, rows into Python, one row per task collected", collect),
            _Case("floor: the same through the RDD API (pickled rows, no Arrow)", rdd_collect), null]


def _measure(spark, target: str, rows: int, params: Params, cfg: dict[str, Any], cases: Sequence[_Case],
             partitions: int = 2, label: str = "latency") -> dict[str, Any]:
    """Run every case ``cfg["reps"]`` times, interleaved (the order rotated each round, every other
    cycle reversed, as :func:`benchmarks.common.interleave`), over a ``rate-micro-batch`` source of
    ``rows`` rows in ``partitions`` partitions per batch; medians against ``cases[0]``."""
    want, warm = cfg["batches"], cfg["warmup"]
    n = len(cases)
    for r in range(cfg["reps"]):
        order = [cases[(i + r) % n] for i in range(n)]
        if (r // n) % 2 == 1:
            order.reverse()
        for c in order:
            _one_query(spark, c, target, rows, params, want, warm, r, partitions=partitions, label=label)
    base = cases[0]
    out: dict[str, Any] = {"target": target, "rows": rows, "baseline": base.name, "variants": {}}
    b_tr, b_ab = statistics.median(base.trigger_ms), statistics.median(base.add_batch_ms)
    for c in cases:
        tr, ab = statistics.median(c.trigger_ms), statistics.median(c.add_batch_ms)
        v: dict[str, Any] = {
            "log": c.log, "delay_ms": c.delay_ms, "coordinator": c.coord,
            "trigger_ms": [round(x, 1) for x in c.trigger_ms], "add_batch_ms": [round(x, 1) for x in c.add_batch_ms],
            "trigger_ms_median": round(tr, 1), "add_batch_ms_median": round(ab, 1),
            "trigger_ms_p10_p90": [percentile(c.trigger_ms, 10), percentile(c.trigger_ms, 90)],
            "add_batch_ms_p10_p90": [percentile(c.add_batch_ms, 10), percentile(c.add_batch_ms, 90)],
            "trigger_ms_rep_medians": [round(x, 1) for x in c.rep_medians],
            "other_ms_median": {k: round(statistics.median(x), 1) for k, x in c.other_ms.items() if x},
            "ratio": round(b_tr / tr, 3), "add_batch_ratio": round(b_ab / ab, 3)}
        if c.progress:
            keys = ("intent_ms", "prepare_ms", "log_ms", "commit_ms", "total_ms", "collect_ms")
            v["coordinator_ms_median"] = {k: round(statistics.median(p.get(k, 0.0) for p in c.progress), 1)
                                          for k in keys}
            # The path each steady-state batch took (task_input "driver", "rows", "arrow").
            paths: dict[str, int] = {}
            for p in c.progress:
                paths[p.get("task_input", "")] = paths.get(p.get("task_input", ""), 0) + 1
            v["paths"] = paths
            # The driver's protocol work per batch: INTENT, decision and COMMITTED (and the commit).
            v["coordinator_ms_median"]["protocol_ms"] = round(statistics.median(_protocol_ms(p) for p in c.progress), 1)
            v["coordinator_batches"] = [{k: round(p.get(k, 0.0), 1) for k in keys} for p in c.progress]
        if c.requests:
            crit = [b["critical"] for b in c.requests]
            bg = [b["background"] for b in c.requests]
            kinds: dict[str, list[int]] = {}
            for b in c.requests:
                for k in {x for x in b["kinds"]}:
                    kinds.setdefault(k, [])
                for k in kinds:
                    kinds[k].append(b["kinds"].get(k, 0))
            v["log_requests"] = {
                "batches": len(c.requests), "critical_median": statistics.median(crit),
                "background_median": statistics.median(bg),
                "total_median": statistics.median([a + b for a, b in zip(crit, bg)]),
                "per_kind_median": {k: statistics.median(x) for k, x in sorted(kinds.items())},
                "request_ms_median": {k: round(statistics.median(x), 1) for k, x in
                                      _per_kind_ms(c.requests).items()},
                "example_batch": c.requests[len(c.requests) // 2]["sequence"]}
        out["variants"][c.name] = v
        progress(f"{label}: {target} {rows} rows: {c.name}: triggerExecution {tr:.0f} ms, addBatch {ab:.0f} ms "
                 f"({b_tr / tr:.2f}x)" + (f", log requests {v['log_requests']['critical_median']:g} critical + "
                                          f"{v['log_requests']['background_median']:g} background"
                                          if "log_requests" in v else ""))
    s3 = {c.delay_ms: c for c in cases if c.log == "s3"}
    if s3 and 0 in s3:
        z = statistics.median(s3[0].trigger_ms)
        out["round_trips_added"] = {str(d): round((statistics.median(c.trigger_ms) - z) / d, 2)
                                    for d, c in s3.items() if d}
        # Steadier: the coordinator's own protocol time (the Spark job's noise left out).
        zp = statistics.median(_protocol_ms(p) for p in s3[0].progress)
        out["round_trips_added_protocol"] = {str(d): round((statistics.median(_protocol_ms(p) for p in c.progress)
                                                            - zp) / d, 2) for d, c in s3.items() if d}
        out["round_trips_over_spark"] = {str(d): round((statistics.median(c.trigger_ms) - b_tr) / d, 2)
                                         for d, c in s3.items() if d}
    return out


def _protocol_ms(p: dict[str, Any]) -> float:
    return float(p["intent_ms"] + p["log_ms"] + p["commit_ms"])


def _per_kind_ms(batches: list[dict[str, Any]]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for b in batches:
        for name, ms in b["sequence"]:
            out.setdefault(name.rsplit(" (", 1)[0], []).append(ms)
    return out


def _one_query(spark, c: _Case, target: str, rows: int, params: Params, want: int, warm: int, rep: int,
               partitions: int = 2, label: str = "latency") -> None:
    sdf = (spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rows)
           .option("numPartitions", partitions).load().selectExpr("value AS id", _payload(params.row_size)))
    ck = tmpdir("lat-ckpt")
    t_start = time.time()
    q = c.start(sdf, ck)
    deadline = time.monotonic() + 120 + want * 30
    try:
        # Every batch: numInputRows is 0 when a foreachBatch function never reads its batch.
        while len([p for p in q.recentProgress if _duration(p, "addBatch") is not None]) < want:
            if q.exception() is not None:
                raise RuntimeError(f"{label} {c.name}: the query failed: {q.exception()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label} {c.name}: fewer than {want} batches in time")
            time.sleep(0.2)
    finally:
        q.stop()
        for coord in c.coordinators:
            coord.close()
    progs = [p for p in q.recentProgress if _duration(p, "addBatch") is not None][warm:want]
    if c.verify is not None:
        c.verify(q, progs)
    tr = [_duration(p, "triggerExecution") or 0.0 for p in progs]
    c.trigger_ms += tr
    c.add_batch_ms += [_duration(p, "addBatch") or 0.0 for p in progs]
    for k in ("latestOffset", "queryPlanning", "walCommit", "commitOffsets", "getBatch"):
        c.other_ms.setdefault(k, []).extend(x for x in (_duration(p, k) for p in progs) if x is not None)
    c.rep_medians.append(statistics.median(tr))
    if c.coordinators:
        coord = c.coordinators[-1]
        mine = [p for p in coord.recent_progress if p["rows"] > 0 and p["action"] == "committed"]
        batch_ids = {int(p["batchId"]) for p in progs}
        mine = [p for p in mine if p["batch_id"] in batch_ids]
        c.progress += mine
        c.coordinators.clear()
        if c.proxy is not None:
            c.requests += _assign(c.proxy.requests(), mine, t_start)
    progress(f"{label}: {target} {rows} rows: {c.name} round {rep + 1}: triggerExecution median "
             f"{statistics.median(tr):.0f} ms over {len(tr)} batches")


def _assign(reqs: list[dict[str, Any]], progs: list[dict[str, Any]], t_start: float) -> list[dict[str, Any]]:
    """Requests made during each batch of ``progs`` (by the coordinator's own timestamps): those
    that started and ended while the batch's tasks ran (the prepare phase), and those still running
    when the batch returned or started after it, before the next batch (its COMMITTED record,
    written in the background), are *background*; the others are on the batch's critical path."""
    reqs = [r for r in reqs if r["start"] >= t_start]
    out = []
    progs = sorted(progs, key=lambda p: p["timestamp"])
    for i, p in enumerate(progs):
        t0 = p["timestamp"]
        t1 = t0 + p["total_ms"] / 1000.0
        prep0 = t0 + p["intent_ms"] / 1000.0
        prep1 = prep0 + p["prepare_ms"] / 1000.0
        # Until the next batch starts (at most 2 s): what the batch left running when it returned.
        after = min(progs[i + 1]["timestamp"], t1 + 2.0) if i + 1 < len(progs) else t1 + 2.0
        mine = [r for r in reqs if t0 <= r["start"] < after]
        seq: list[list[Any]] = []
        kinds: dict[str, int] = {}
        crit = bg = 0
        for r in mine:
            name = classify(r)
            background = (r["start"] >= prep0 and r["end"] <= prep1) or r["end"] > t1
            if background:
                bg += 1
            else:
                crit += 1
            kinds[name] = kinds.get(name, 0) + 1
            seq.append([f"{name} ({'background' if background else 'critical'})",
                        round((r["end"] - r["start"]) * 1000, 1)])
        out.append({"batch_id": p["batch_id"], "critical": crit, "background": bg, "kinds": kinds, "sequence": seq})
    return out


if __name__ == "__main__" and len(sys.argv) == 7 and sys.argv[1] == "proxy":
    _serve(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), sys.argv[5], sys.argv[6])
