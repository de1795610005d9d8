"""Shared helpers: parameters, the Spark session, the benchmark data, interleaved timing, progress.

Everything here runs on the driver (the benchmark process).  Only the Arrow
functions handed to ``mapInArrow`` run in Spark's Python workers.
"""

from __future__ import annotations

import os
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
SECTIONS = ("kafka", "postgres", "files", "coordinator", "recovery", "partitions")


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
    kafka_topic_partitions: int = 4
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
    return tempfile.mkdtemp(prefix=f"twophase-bench-{prefix}-")


@dataclass
class Variant:
    """One way of writing the data: ``run()`` does the work being timed; ``setup()`` runs untimed before it."""

    name: str
    run: Callable[[], Any]
    setup: Callable[[], None] | None = None
    seconds: list[float] = field(default_factory=list)
    extras: list[Any] = field(default_factory=list)
    server_cpu: list[float] = field(default_factory=list)


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
    slow phase of the shared machine does not always hit the same variant.  With
    ``server_pgid``, each timed run also records the CPU seconds that server's process
    group spent during it (:attr:`Variant.server_cpu`): on one machine the server's
    work competes with the writer's for the same cores.
    """
    n = len(variants)
    for r in range(warmup + reps):
        order = [variants[(i + r) % n] for i in range(n)]
        for v in order:
            if v.setup:
                v.setup()
            c0 = group_cpu_seconds(server_pgid) if server_pgid else 0.0
            t0 = time.perf_counter()
            extra = v.run()
            dt = time.perf_counter() - t0
            timed = r >= warmup
            if timed:
                v.seconds.append(dt)
                v.extras.append(extra)
                if server_pgid:
                    v.server_cpu.append(group_cpu_seconds(server_pgid) - c0)
            progress(f"{label}: {v.name} {'rep ' + str(r - warmup + 1) if timed else 'warm-up'}: {dt:.2f}s")


def summarize(v: Variant, rows: int, nbytes: int) -> dict[str, Any]:
    med = statistics.median(v.seconds)
    out = {"seconds": [round(s, 4) for s in v.seconds], "median_s": round(med, 4),
           "rows_per_s": round(rows / med, 1), "mb_per_s": round(nbytes / med / 1e6, 3)}
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


# ----------------------------------------------------------------------- Spark
def session(sections: list[str]):
    """The one Spark session of this process, with the jars the chosen sections need."""
    # Spark's Python workers must import benchmarks.* (the null sink) and twophase.
    pp = os.environ.get("PYTHONPATH", "")
    if str(REPO) not in pp.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), pp) if p)
    jars: list[str] = []
    if "kafka" in sections or "partitions" in sections:
        from tests.services.kafka import spark_kafka_jars

        progress("resolving Spark's Kafka writer jars")
        jars += [str(j) for j in spark_kafka_jars()]
    if "postgres" in sections or "partitions" in sections:
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
    progress("starting Spark local[2]")
    return local_session("local[2]", "twophase-benchmarks", conf=conf)


def make_data(spark, rows: int, row_size: int, partitions: int):
    """A cached DataFrame ``id BIGINT, payload STRING`` of ``rows`` rows in ``partitions`` partitions.

    ``payload`` is ``row_size`` characters of hex digits from sha2(id): not
    trivially compressible, so Parquet and Kafka move realistic bytes.
    """
    reps = row_size // 64 + 1
    df = (spark.range(0, rows, 1, partitions)
          .selectExpr("id", f"substring(repeat(sha2(cast(id as string), 256), {reps}), 1, {row_size}) AS payload")
          .cache())
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


def data_bytes(rows: int, row_size: int) -> int:
    """Bytes of payload plus an 8-byte id per row: the figure MB/s are computed from."""
    return rows * (row_size + 8)
