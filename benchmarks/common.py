"""Shared helpers: parameters, the Spark session, the benchmark data, interleaved timing, progress.

Everything here runs on the driver (the benchmark process).  Only the Arrow
functions handed to ``mapInArrow`` run in Spark's Python workers.
"""

from __future__ import annotations

import atexit
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
SECTIONS = ("kafka", "postgres", "files", "coordinator", "recovery", "partitions", "connect")


@dataclass
class Params:
    """What one run measures.  ``quick`` shrinks every knob so CI can afford it."""

    rows: int = 200_000
    row_size: int = 100
    partitions: int = 2
    trigger_interval: float = 2.0
    reps: int = 3
    warmup: int = 1
    stream_batches: int = 10
    recovery_handles: tuple[int, ...] = (10, 100, 1000)
    pg_recovery_handles: tuple[int, ...] = (10, 50)
    partition_counts: tuple[int, ...] = (2, 50, 200)
    partition_targets: tuple[str, ...] = ("files", "kafka", "postgres")
    file_targets: tuple[str, ...] = ("local", "hdfs", "s3", "s3-moto")  # the files section's targets
    file_writers: tuple[str, ...] = ("arrow", "spark")  # FileSink's executor paths on local and HDFS
    partition_file_writers: tuple[str, ...] = ("arrow",)  # FileSink's in the partitions section
    kafka_topic_partitions: int = 4
    cluster: int = 0  # > 0: on the test standalone cluster with this many one-core executors
    data_shape: str = "hex"  # see make_data
    stream_partitions: int = 50  # the partitions section's streaming run (0: none)
    quick: bool = False
    out: Path = RESULTS
    profile: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


_T0 = time.monotonic()


def progress(msg: str) -> None:
    """One progress line on stderr, with the elapsed time of the run."""
    print(f"[bench {time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def uid() -> str:
    return uuid.uuid4().hex[:8]


def tmpdir(prefix: str) -> str:
    """A scratch folder removed when the benchmark process exits (a 2,000,000-row files run
    leaves about 0.5 GB in each: 17 GB of them were found left in /tmp)."""
    path = tempfile.mkdtemp(prefix=f"twophase-bench-{prefix}-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@dataclass
class Variant:
    """One way of writing the data: ``run()`` does the work being timed; ``setup()`` runs untimed before it."""

    name: str
    run: Callable[[], Any]
    setup: Callable[[], None] | None = None
    seconds: list[float] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)
    machine_cpu: list[float] = field(default_factory=list)


def machine_cpu_seconds() -> float:
    """CPU seconds every core of this machine has been busy so far (``/proc/stat``: all time
    but idle and iowait).  Over a run, busy seconds / wall seconds near the core count says
    the run was CPU-bound, whoever (writer, Spark, a server) used the cores."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds (user + system) used so far by every live process of process group ``pgid``.

    The services run in their own process groups (tests/services), so this is what a
    server (the HDFS minicluster JVM, the moto S3 server) has spent, whoever asked it.
    """
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # field 5 of stat: the process group
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def interleave(variants: list[Variant], reps: int, warmup: int, label: str,
               server_pgid: int | None = None) -> None:
    """Run every variant ``warmup`` (untimed) + ``reps`` times, interleaved, rotating the order each round.

    Round r runs variants in the order shifted by r (A B C, B C A, C A B ...), so a
    slow phase of the shared machine does not always hit the same variant; every other
    cycle of n rounds runs those orders reversed (C B A, A C B, B A C), so that with three
    or more variants each one follows each other one equally often (a variant that
    leaves the machine busy, e.g. a server still digesting its writes, then slows its
    successors alike).  With
    ``server_pgid``, each timed run also records the CPU seconds that server's process
    group spent during it (:attr:`Variant.server_cpu`): on one machine the server's
    work competes with the writer's for the same cores.  Every timed run records the
    machine's busy CPU seconds too (:attr:`Variant.machine_cpu`).
    """
    n = len(variants)
    for r in range(warmup + reps):
        order = [variants[(i + r) % n] for i in range(n)]
        if (r // n) % 2 == 1:
            order.reverse()
        for v in order:
            if v.setup:
                v.setup()
            c0 = group_cpu_seconds(server_pgid) if server_pgid else 0.0
            m0 = machine_cpu_seconds()
            t0 = time.perf_counter()
            extra = v.run()
            dt = time.perf_counter() - t0
            timed = r >= warmup
            if timed:
                v.seconds.append(dt)
                v.extras.append(extra)
                v.machine_cpu.append(machine_cpu_seconds() - m0)
                if server_pgid:
                    v.server_cpu.append(group_cpu_seconds(server_pgid) - c0)
            progress(f"{label}: {v.name} {'rep ' + str(r - warmup + 1) if timed else 'warm-up'}: {dt:.2f}s")


def summarize(v: Variant, rows: int, nbytes: int) -> dict[str, Any]:
    med = statistics.median(v.seconds)
    out = {"seconds": [round(s, 4) for s in v.seconds], "median_s": round(med, 4),
           "rows_per_s": round(rows / med, 1), "mb_per_s": round(nbytes / med / 1e6, 3)}
    if v.machine_cpu:
        out["machine_cpu_s"] = [round(c, 3) for c in v.machine_cpu]
        out["machine_cpu_median_s"] = round(statistics.median(v.machine_cpu), 3)
    if v.server_cpu:
        out["server_cpu_s"] = [round(c, 3) for c in v.server_cpu]
        out["server_cpu_median_s"] = round(statistics.median(v.server_cpu), 3)
    return out


def ratio(candidate: dict[str, Any], baseline: dict[str, Any]) -> float:
    """Throughput ratio candidate/baseline (> 1: the candidate is faster), from the medians of this run."""
    return round(baseline["median_s"] / candidate["median_s"], 3)


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (no interpolation: with few samples p99 is the maximum, and says so)."""
    if not values:
        raise ValueError("no samples")
    s = sorted(values)
    k = max(0, min(len(s) - 1, int(round(p / 100.0 * len(s) + 0.5)) - 1))
    return round(s[k], 3)


def goal(name: str, value: float, target: float, op: str) -> dict[str, Any]:
    met = value >= target if op == ">=" else value < target
    return {"goal": name, "value": value, "target": target, "op": op, "met": bool(met)}


# ----------------------------------------------------------------------- Kafka
def _create_topic(bootstrap: str, topic: str, partitions: int) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    fut = admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])[topic]
    fut.result(timeout=60)


# ----------------------------------------------------------------------- Spark
def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: The Spark Connect server plugin the connect section's session runs (benchmarks/connect.py).
PLUGIN = "org.apache.spark.sql.connect.SparkConnectPlugin"


def session(sections: list[str], cluster: int = 0, extra_jars: list[str] | None = None):
    """The one Spark session of this process, with the jars the chosen sections need: local[2],
    or with ``cluster`` > 0 an application of the test standalone cluster
    (tests/services/spark_cluster.py) with that many one-core executors (one per worker)."""
    # Spark's Python workers must import benchmarks.* (the null sink) and twophase.
    pp = os.environ.get("PYTHONPATH", "")
    if str(REPO) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pp) if p)
    jars: list[str] = list(extra_jars or [])
    if {"kafka", "partitions", "connect"} & set(sections):
        from tests.services.kafka import spark_kafka_jars

        progress("resolving Spark's Kafka writer jars")
        jars += [str(j) for j in spark_kafka_jars()]
    if {"postgres", "partitions", "connect"} & set(sections):
        from tests.services.maven import resolve

        progress("resolving the PostgreSQL JDBC driver")
        jars += [str(j) for j in resolve(["org.postgresql:postgresql:42.7.8"], "postgresql-jdbc")]
    from twophase.spark import local_session

    conf: dict[str, Any] = {"spark.sql.shuffle.partitions": "8"}
    if "files" in sections:
        # The same HDFS client setting the minicluster's DataNode has (tests/services/hdfs.py):
        # without it Spark's own writer waits 400 ms whenever it closes a file before the
        # DataNode has reported the block, and the HDFS comparison measures that race.
        from tests.services.hdfs import CONF as HDFS_CONF

        key = "dfs.client.block.write.locateFollowingBlock.initial.delay.ms"
        conf[f"spark.hadoop.{key}"] = HDFS_CONF[key]
    if jars:
        conf["spark.jars"] = ",".join(jars)
    if "connect" in sections:
        # The connect section: this JVM also serves Spark Connect clients (benchmarks/connect.py),
        # on a free loopback port.
        conf.update({"spark.plugins": PLUGIN, "spark.connect.grpc.binding.address": "127.0.0.1",
                     "spark.connect.grpc.binding.port": str(free_port())})
    if cluster:
        from tests.cluster import DEFAULT_CONF
        from tests.services.spark_cluster import MASTER_URL

        conf = {**DEFAULT_CONF, **conf, "spark.cores.max": str(cluster),
                "spark.default.parallelism": str(cluster),
                "spark.executor.memory": "1g",
                "spark.executorEnv.PYTHONPATH": os.environ["PYTHONPATH"]}
        progress(f"starting Spark on {MASTER_URL} with {cluster} executor(s)")
        return local_session(MASTER_URL, "twophase-benchmarks", conf=conf)
    progress("starting Spark local[2]")
    return local_session("local[2]", "twophase-benchmarks", conf=conf)


#: Data shapes for ``--data-shape`` (the partitions section; the others use ``hex``).
SHAPES = ("hex", "random", "events", "repeated")
#: Approximate bytes per row of the ``events`` shape (the figure its MB/s are computed from):
#: id, ts, user_id, amount (8 each), a ~7-character country and a ~8-character event type.
EVENT_ROW_BYTES = 47
#: PostgreSQL columns of each shape (what the sink's and JDBC's tables are created with).
PG_COLUMNS = {"hex": "id BIGINT, payload TEXT", "random": "id BIGINT, payload TEXT",
              "repeated": "id BIGINT, payload TEXT",
              "events": "id BIGINT, ts TIMESTAMPTZ, user_id BIGINT, amount DOUBLE PRECISION, "
                        "country TEXT, event_type TEXT"}


def make_data(spark, rows: int, row_size: int, partitions: int, shape: str = "hex"):
    """A cached DataFrame of ``rows`` rows in ``partitions`` partitions.

    ``hex`` (default): ``id BIGINT, payload STRING``, ``payload`` being ``row_size`` hex digits
    from sha2(id) (4 bits of entropy per byte: dictionary-free but compressible 2:1).
    ``random``: the same columns, ``payload`` being base64 of SHA-512 digests (6 bits per
    byte; what neither Parquet nor Kafka's compression can shrink much).
    ``events``: a typical event row: ``id``, ``ts`` (a timestamp a millisecond apart),
    ``user_id`` (10,000 users), ``amount`` (a double), ``country`` (20 values) and
    ``event_type`` (8 values): numbers, timestamps and repeated categorical strings, which
    Parquet dictionary-encodes.
    ``repeated``: ``id`` and a ``payload`` of ``row_size`` copies of one character (one value:
    Parquet stores the column as a one-entry dictionary and run lengths, almost nothing).
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown data shape {shape!r}; choose from {', '.join(SHAPES)}")
    base = spark.range(0, rows, 1, partitions)
    if shape == "hex":
        reps = row_size // 64 + 1
        df = base.selectExpr(
            "id", f"substring(repeat(sha2(cast(id as string), 256), {reps}), 1, {row_size}) AS payload")
    elif shape == "repeated":
        df = base.selectExpr("id", f"repeat('x', {row_size}) AS payload")
    elif shape == "random":
        digests = row_size * 3 // 4 // 64 + 1  # 64 raw bytes per SHA-512 digest, 4/3 in base64
        raw = ", ".join(f"unhex(sha2(concat(cast(id as string), '/{i}'), 512))" for i in range(digests))
        df = base.selectExpr("id", f"substring(base64(concat({raw})), 1, {row_size}) AS payload")
    else:
        countries = ", ".join(f"'{c}'" for c in (
            "DE", "FR", "US", "GB", "NL", "SE", "PL", "ES", "IT", "BR",
            "IN", "JP", "KR", "CA", "AU", "MX", "NG", "ZA", "AR", "TR"))
        kinds = "'view', 'click', 'add_to_cart', 'purchase', 'refund', 'login', 'logout', 'search'"
        df = base.selectExpr(
            "id",
            "timestamp_millis(1767225600000 + id) AS ts",
            "(id * 7919) % 10000 AS user_id",
            "round(((id * 104729) % 100000) / 100.0, 2) AS amount",
            f"element_at(array({countries}), cast(id % 20 AS INT) + 1) AS country",
            f"element_at(array({kinds}), cast((id / 3) % 8 AS INT) + 1) AS event_type")
    df = df.cache()
    n = df.count()
    assert n == rows, (n, rows)
    _warm_workers(df)
    return df


def _warm_workers(df) -> None:
    """Start Spark's Python workers and import the sinks there once, so no variant pays for it."""

    def f(batches):
        import twophase.coordinator  # noqa: F401
        import twophase.sinks.files  # noqa: F401

        for _ in batches:
            pass
        return iter(())

    df.mapInArrow(f, df.schema).collect()


def data_bytes(rows: int, row_size: int, shape: str = "hex") -> int:
    """Bytes of payload plus an 8-byte id per row (``events``: :data:`EVENT_ROW_BYTES`): the
    figure MB/s are computed from."""
    return rows * (EVENT_ROW_BYTES if shape == "events" else row_size + 8)
