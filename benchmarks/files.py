"""FileSink (Parquet) vs Spark's own Parquet writer on local disk and HDFS; FileSink on S3 vs plain s3fs.

Local and HDFS: ``Coordinator.write`` with a FileSink, with each executor path
(``writer="arrow"``: the sink's Arrow writers in per-task transactions, over WebHDFS on
HDFS; ``writer="spark"``: one ``df.write`` per batch into the batch's staging folder,
then renames on commit), vs ``df.write.mode("append").parquet(...)`` (Spark's file
sink with its commit protocol), each into its own fresh directory, same cached
DataFrame, in one interleaved run.  S3, on two servers (MinIO, which like S3
assembles a completed multipart object from its stored parts; and moto, whose
CompleteMultipartUpload copies every byte again): FileSink (multipart uploads
completed on commit) vs a plain upload of the same rows with s3fs from this
process: each partition's rows (pre-collected, untimed) encoded to Parquet and
written with ``s3fs`` — no Spark, no commit protocol, the client's limit.  The
goal is judged on MinIO; the moto pair shows what the mock's copy costs.  Opt-in
(``--file-targets s3a``): FileSink on MinIO against Spark's own ``s3a://`` writer, with
its default commit and with the S3A magic committer (benchmarks/s3a.py).
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


def _sink_variant(name: str, sink, label: str, rows: int, df, commit_ms: list[float]) -> Variant:
    from twophase.coordinator import Coordinator

    coord = Coordinator(sink, log_location=tmpdir(f"{label}-log"), name=f"bench-{label}")
    batch = iter(range(10**9))

    def run():
        prog = coord.write(df, batch_id=next(batch))
        assert prog["rows"] == rows, prog
        commit_ms.append(prog["commit_ms"])
        return {k: prog[k] for k in ("prepare_ms", "commit_ms", "log_ms", "total_ms")}

    return Variant(name, run)


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from twophase.sinks.files import FileSink

    nbytes = data_bytes(params.rows, params.row_size)
    out: dict[str, Any] = {"title": "Files (Parquet)", "targets": {}, "ratios": {}, "goals": [],
                           "commit_latency_ms": {}}

    # -- local -------------------------------------------------------------------------
    from tests.services import get as service

    targets: list[tuple[str, list[Variant]]] = []
    pgids: dict[str, int | None] = {"local": None}
    commit: dict[str, list[float]] = {"local": [], "hdfs": [], "s3": [], "s3-moto": [], "s3a": []}
    local_ours, local_spark = tmpdir("files-ours"), tmpdir("files-spark")
    local_sw = tmpdir("files-ours-spark-writer")
    wanted = params.file_targets
    writers = params.file_writers
    if "local" in wanted:
        targets.append(("local", [
            *([_sink_variant("FileSink local", FileSink(local_ours, format="parquet", writer="arrow"), "local",
                             params.rows, df, commit["local"])] if "arrow" in writers else []),
            *([_sink_variant("FileSink(writer=spark) local", FileSink(local_sw, format="parquet", writer="spark"),
                             "local-sw", params.rows, df, [])] if "spark" in writers else []),
            Variant("Spark parquet local", lambda: df.write.mode("append").parquet(local_spark + "/out"))]))

    # -- HDFS --------------------------------------------------------------------------
    if "hdfs" in services and "hdfs" in wanted:
        h = services["hdfs"]
        base = f"/bench-{uid()}"
        so = {"webhdfs_url": h["webhdfs_url"], "user": h["user"]}
        from hdfs import InsecureClient

        InsecureClient(h["webhdfs_url"], user=h["user"]).makedirs(base + "/ours")
        InsecureClient(h["webhdfs_url"], user=h["user"]).makedirs(base + "/ours-sw")
        spark_url = f"{h['namenode']}{base}/spark"
        pgids["hdfs"] = service("hdfs").pid()
        targets.append(("hdfs", [
            *([_sink_variant("FileSink HDFS", FileSink(f"{h['namenode']}{base}/ours", format="parquet",
                                                       storage_options=so, writer="arrow"),
                             "hdfs", params.rows, df, commit["hdfs"])] if "arrow" in writers else []),
            *([_sink_variant("FileSink(writer=spark) HDFS", FileSink(f"{h['namenode']}{base}/ours-sw",
                                                                     format="parquet", storage_options=so,
                                                                     writer="spark"),
                             "hdfs-sw", params.rows, df, [])]
              if "spark" in writers else []),
            Variant("Spark parquet HDFS", lambda: df.write.mode("append").parquet(spark_url))]))

    # -- S3: MinIO (assembles a multipart object from its parts, as S3 does) and moto ---------
    for label, svc_name, server in (("s3", "minio", "MinIO"), ("s3-moto", "s3", "moto")):
        if svc_name in services and label in wanted:
            targets.append((label, _s3_variants(df, params, services[svc_name], label, server, commit[label])))
            pgids[label] = service(svc_name).pid()

    # -- S3 against Spark's own S3A writer (opt-in: --file-targets s3a), on MinIO -----------
    if "minio" in services and "s3a" in wanted:
        targets.append(("s3a", _s3a_variants(spark, df, params, services["minio"], commit["s3a"])))
        pgids["s3a"] = service("minio").pid()

    for label, variants in targets:
        progress(f"files: {label}")
        interleave(variants, params.reps, params.warmup, f"files/{label}", server_pgid=pgids.get(label))
        s = {v.name: summarize(v, params.rows, nbytes) for v in variants}
        baseline = variants[-1]
        rs = {v.name: ratio(s[v.name], s[baseline.name]) for v in variants[:-1]}
        r = rs[variants[0].name]
        out["targets"][label] = {"baseline": baseline.name, "variants": s, "ratio": r, "ratios": rs,
                                 "phases_ms": {v.name: v.extras for v in variants[:-1]}}
        for name, x in rs.items():
            out["ratios"][f"{name} / {baseline.name}"] = x
        timed = [e["commit_ms"] for e in variants[0].extras]  # timed runs only, not the warm-up
        out["commit_latency_ms"][label] = {"p50": percentile(timed, 50), "p99": percentile(timed, 99),
                                           "samples": len(timed)}
        if label in ("local", "hdfs"):
            for v in variants[:-1]:
                spark_w = "writer=spark" in v.name
                out["goals"].append(goal(
                    f"FileSink{'(writer=spark)' if spark_w else ''} {label} >= {0.95 if spark_w else 0.9}x "
                    "Spark's file sink", rs[v.name], 0.95 if spark_w else 0.9, ">="))
        elif label == "s3":
            out["goals"].append(goal("FileSink S3 (MinIO) >= 0.9x a plain s3fs upload", r, 0.9, ">="))
        elif label == "s3a":
            out["goals"].append(goal("FileSink S3 (MinIO) >= 0.9x Spark's S3A write (magic committer)", r,
                                     0.9, ">="))
    if "local" in wanted:
        for ours, w in ((local_ours, "arrow"), (local_sw, "spark")):
            if w in writers:
                _check_local(spark, ours, local_spark, params)
    return out


def _s3_variants(df, params: Params, info: dict[str, Any], label: str, server: str,
                 commit_ms: list[float]) -> list[Variant]:
    """FileSink vs a plain s3fs upload of the same rows, both to one S3 server."""
    import pyarrow.parquet as pq
    import s3fs

    from tests.services.s3 import storage_options
    from twophase.sinks.files import FileSink

    so = storage_options(info)
    prefix = f"{info['bucket']}/bench-{uid()}"
    fs = s3fs.S3FileSystem(**so)
    parts = _partitions_arrow(df)
    counter = iter(range(10**9))

    def s3fs_run():
        n = next(counter)
        for i, t in enumerate(parts):
            buf = io.BytesIO()
            pq.write_table(t, buf, compression="snappy")
            fs.pipe(f"{prefix}/plain/part-{n:08d}-{i:05d}.parquet", buf.getvalue())

    return [_sink_variant(f"FileSink S3 ({server})", FileSink(f"s3://{prefix}/ours", format="parquet",
                                                              storage_options=so),
                          label, params.rows, df, commit_ms),
            Variant(f"plain s3fs upload ({server})", s3fs_run)]


def _s3a_variants(spark, df, params: Params, info: dict[str, Any], commit_ms: list[float]) -> list[Variant]:
    """FileSink on s3:// vs Spark's own writer on s3a:// (benchmarks/s3a.py), same MinIO bucket:
    with Spark's default commit (FileOutputCommitter, renames = copies on S3A) and with the S3A
    magic committer, the baseline (the last variant)."""
    from benchmarks import s3a
    from tests.services.s3 import storage_options
    from twophase.sinks.files import FileSink

    s3a.configure(spark, info)
    prefix = f"{info['bucket']}/bench-s3a-{uid()}"
    return [_sink_variant("FileSink S3 (MinIO)", FileSink(f"s3://{prefix}/ours", format="parquet",
                                                          storage_options=storage_options(info)),
                          "s3a", params.rows, df, commit_ms),
            Variant("Spark parquet s3a, FileOutputCommitter (MinIO)",
                    lambda: s3a.write(df, f"s3a://{prefix}/spark-file", magic=False)),
            Variant("Spark parquet s3a, magic committer (MinIO)",
                    lambda: s3a.write(df, f"s3a://{prefix}/spark-magic", magic=True))]


def _partitions_arrow(df) -> list:
    """The DataFrame's rows as one Arrow table per partition's worth of rows (collected, untimed)."""
    table = df.toArrow()
    n = max(1, df.rdd.getNumPartitions())
    step = -(-table.num_rows // n)
    return [table.slice(i, step) for i in range(0, table.num_rows, step)]


def _check_local(spark, ours: str, theirs: str, params: Params) -> None:
    """Both local outputs hold reps+warmup copies of the data: nothing was lost or doubled."""
    n = params.reps + params.warmup
    a = spark.read.parquet(ours).count()
    b = spark.read.parquet(theirs + "/out").count()
    assert a == b == n * params.rows, (a, b, n * params.rows)
