"""``python -m benchmarks``: bring up the services, run the comparisons, write benchmarks/results/.

Runs in one process with one Spark session (local[2]).  Progress goes to stderr;
the paths of the written files go to stdout.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import datasource, latency
from benchmarks.common import SECTIONS as _COMMON_SECTIONS
from benchmarks.common import SHAPES, Params, make_data, progress, session

SECTIONS = (*_COMMON_SECTIONS, "latency", "datasource", "mysql")

#: Sections --quick leaves out unless named in --only: connect costs about a minute even at
#: --quick sizes (first use of a Connect client, then its streaming queries).
NOT_QUICK = ("connect",)
NEEDS = {"kafka": ("kafka",), "postgres": ("postgres",), "files": ("hdfs", "s3", "minio"), "recovery": ("postgres",),
         "coordinator": (), "partitions": ("kafka", "postgres"),
         "connect": ("kafka", "postgres"), "latency": (),  # latency: latency.needs(params)
         "datasource": (),  # datasource.needs(params)
         "mysql": ("mariadb",)}


def parse(argv: list[str] | None) -> tuple[Params, list[str]]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="small and fast (what CI runs)")
    ap.add_argument("--only", help=f"comma list of {', '.join(SECTIONS)} (default: all; with --quick all "
                    f"but {', '.join(NOT_QUICK)})")
    ap.add_argument("--rows", type=int)
    ap.add_argument("--row-size", type=int, help="payload bytes per row")
    ap.add_argument("--partitions", type=int)
    ap.add_argument("--trigger-interval", type=float, help="seconds, for the streaming run")
    ap.add_argument("--reps", type=int, help="timed repetitions per variant (interleaved)")
    ap.add_argument("--warmup", type=int, help="untimed runs per variant first")
    ap.add_argument("--out", type=Path, help="results directory (default benchmarks/results)")
    ap.add_argument("--partition-counts", help="comma list of input partition counts for the "
                    "partitions section (default 2,50,200)")
    ap.add_argument("--targets", help="comma list of files, kafka, postgres for the partitions section")
    ap.add_argument("--stream-partitions", type=int, help="source partitions of the partitions section's "
                    "streaming comparison (default 50; 0 leaves it out)")
    ap.add_argument("--file-targets", help="comma list of local, hdfs, s3, s3-moto, s3a for the files "
                    "section (default all but s3a; s3a: FileSink S3 against Spark's own S3A writer on MinIO, "
                    "which needs hadoop-aws and the ~690 MB AWS SDK bundle from Maven Central)")
    ap.add_argument("--file-writers", help="comma list of FileSink writers (arrow, spark) measured on "
                    "local and HDFS in the files section (default both), and on the partitions section's "
                    "file target (default arrow)")
    ap.add_argument("--cluster", type=int, metavar="N", choices=(1, 2),
                    help="run on the test Spark standalone cluster (python -m tests.services start "
                         "spark_cluster) with N one-core executors, one per worker, instead of local[2]")
    ap.add_argument("--data-shape", choices=SHAPES, help="rows of the partitions section: hex "
                    "(default), random (incompressible), events (timestamps, numbers, categories) or repeated "
                    "(one character repeated: compresses to almost nothing)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each sink's executor+commit path in-process with pyinstrument")
    latency.add_arguments(ap)
    datasource.add_arguments(ap)
    a = ap.parse_args(argv)
    p = Params()
    if a.quick:
        p = Params(rows=4000, row_size=100, partitions=2, trigger_interval=1.0, reps=1, warmup=0,
                   stream_batches=3, recovery_handles=(10, 100), pg_recovery_handles=(10,),
                   partition_counts=(50,), stream_partitions=0, quick=True)
    for k in ("rows", "row_size", "partitions", "trigger_interval", "reps", "warmup", "out"):
        v = getattr(a, k)
        if v is not None:
            setattr(p, k, v)
    p.profile = a.profile
    if a.partition_counts:
        p.partition_counts = tuple(int(x) for x in a.partition_counts.split(","))
    if a.stream_partitions is not None:
        if a.stream_partitions < 0:
            ap.error("--stream-partitions must be >= 0")
        p.stream_partitions = a.stream_partitions
    if a.targets:
        p.partition_targets = tuple(t.strip() for t in a.targets.split(",") if t.strip())
        bad_t = [t for t in p.partition_targets if t not in ("files", "kafka", "postgres")]
        if bad_t:
            ap.error(f"unknown target(s) {bad_t}; choose from files, kafka, postgres")
    if a.file_targets:
        p.file_targets = tuple(t.strip() for t in a.file_targets.split(",") if t.strip())
        bad_f = [t for t in p.file_targets if t not in ("local", "hdfs", "s3", "s3-moto", "s3a")]
        if bad_f:
            ap.error(f"unknown file target(s) {bad_f}; choose from local, hdfs, s3, s3-moto")
    if a.file_writers:
        p.file_writers = tuple(w.strip() for w in a.file_writers.split(",") if w.strip())
        if not p.file_writers or set(p.file_writers) - {"arrow", "spark"}:
            ap.error("--file-writers takes arrow, spark or both")
        p.partition_file_writers = p.file_writers
    p.cluster = a.cluster or 0
    if a.data_shape:
        if {x.strip() for x in (a.only or "").split(",") if x.strip()} != {"partitions"} and a.data_shape != "hex":
            ap.error("--data-shape other than hex applies to --only partitions")
        p.data_shape = a.data_shape
    only = [s.strip() for s in a.only.split(",") if s.strip()] if a.only else [
        s for s in SECTIONS if not (a.quick and s in NOT_QUICK)]
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {', '.join(SECTIONS)}")
    latency.configure(p, a, ap.error)
    datasource.configure(p, a, ap.error)
    if p.rows < 1 or p.row_size < 1 or p.partitions < 1 or p.reps < 1 or p.warmup < 0:
        ap.error("rows, row-size, partitions and reps must be >= 1, warmup >= 0")
    return p, only


def main(argv: list[str] | None = None) -> int:
    params, only = parse(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
    t0 = time.monotonic()
    load0 = round(os.getloadavg()[0], 2)  # other work on the machine skews every number: record it
    from tests import services as svc

    need = {n for s in only for n in NEEDS[s] if s != "files"}
    if "files" in only:  # only the servers of the file targets asked for
        need |= {n for t, n in (("hdfs", "hdfs"), ("s3", "minio"), ("s3-moto", "s3"), ("s3a", "minio"))
                 if t in params.file_targets}
    if "latency" in only:
        need |= latency.needs(params)
    if "datasource" in only:
        need |= datasource.needs(params)
    names = sorted(need | ({"spark_cluster"} if params.cluster else set()))
    progress(f"services: {', '.join(names) or 'none'}")
    services: dict[str, Any] = svc.ensure(*names) if names else {}
    if "TWOPHASE_SPARK_DRIVER_MEMORY" not in os.environ:
        # local[2]: the cached DataFrame lives in the driver JVM; give it room at large --rows
        # (2M rows x 100 B needs more than the 1g default).
        need_gb = params.rows * (params.row_size + 40) * 8 / 1e9
        os.environ["TWOPHASE_SPARK_DRIVER_MEMORY"] = f"{min(8, max(1, int(need_gb) + 1))}g"
    extra_jars = None
    if "files" in only and "s3a" in params.file_targets:
        from benchmarks.s3a import s3a_jars

        progress("resolving Spark's S3A connector (hadoop-aws and the AWS SDK bundle, ~690 MB once)")
        extra_jars = s3a_jars()
    streaming_sinks = (set(params.latency["sinks"]) if "latency" in only else set()) | (  # type: ignore[attr-defined]
        datasource.targets(params) if "datasource" in only else set())
    if streaming_sinks:  # Spark's own streaming sinks of the latency and datasource sections
        extra_jars = (extra_jars or []) + latency.jars(params, only, streaming_sinks)
    if "mysql" in only:  # Spark's JDBC writer to MariaDB: MariaDB Connector/J
        from benchmarks.mysql import jars as mysql_jars

        progress("resolving MariaDB Connector/J")
        extra_jars = (extra_jars or []) + mysql_jars()
    spark = session(only, params.cluster, extra_jars)
    progress(f"data: {params.rows} rows x {params.row_size} B in {params.partitions} partitions")
    df = make_data(spark, params.rows, params.row_size, params.partitions, params.data_shape)
    res: dict[str, Any] = {"started_at": started, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                           f"Python {platform.python_version()}, Spark {spark.version}, master {spark.sparkContext.master}"
                           + (f" ({params.cluster} one-core executor(s), one per worker)" if params.cluster else ""),
                           "params": params.to_dict(), "sections": {}, "goals": []}
    for name in only:
        progress(f"=== {name} ===")
        mod = importlib.import_module(f"benchmarks.{name}")
        sec = mod.run(spark, df, params, services)
        res["sections"][name] = sec
        res["goals"] += sec.get("goals", [])
    if params.profile:
        from benchmarks import profile

        try:
            res["profiles"] = profile.run(spark, df, params, services, only)
        except Exception as e:  # a profile is a diagnostic: never lose the measurements for it
            progress(f"profile failed: {type(e).__name__}: {e}")
            res["profiles"] = {"error": f"{type(e).__name__}: {e}"}
    res["duration_s"] = round(time.monotonic() - t0, 1)
    res["load_average"] = {"start_1min": load0, "end_1min": round(os.getloadavg()[0], 2)}
    from benchmarks import report

    paths = report.write(res, params.out)
    if "mysql" in res["sections"]:  # report.py knows the older sections only: add this one's tables
        from benchmarks.mysql import markdown as mysql_markdown

        md = paths["md"].read_text()
        head, sep, goals = md.partition("## Goals")
        paths["md"].write_text(head + "\n".join(mysql_markdown(res["sections"]["mysql"])) + "\n" + sep + goals)
    spark.stop()
    progress(f"done in {res['duration_s']:.0f}s")
    for g in res["goals"]:
        progress(f"goal {'met   ' if g['met'] else 'MISSED'}: {g['goal']}: {g['value']:.3g}")
    print(json.dumps({k: str(v) for k, v in paths.items()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
