"""``python -m benchmarks --quick`` runs end to end against the real services and reports real measurements.

Runs the command in a subprocess (it starts its own Spark session, which must not
share the pytest process's SparkContext) and checks the JSON it wrote: every
section present, every timing positive, and every ratio recomputed from the
medians of the timings recorded in that same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.kafka, pytest.mark.postgres, pytest.mark.hdfs, pytest.mark.s3,
              pytest.mark.mysql]

REPO = Path(__file__).resolve().parents[1]
SECTIONS = {"kafka", "postgres", "files", "coordinator", "recovery", "partitions", "latency", "datasource", "mysql"}


def _check_variants(variants: dict, rows: int) -> None:
    assert len(variants) >= 2
    for name, v in variants.items():
        assert v["seconds"] and all(s > 0 for s in v["seconds"]), name
        assert v["median_s"] == pytest.approx(statistics.median(v["seconds"]), abs=1e-3), name
        assert v["rows_per_s"] == pytest.approx(rows / v["median_s"], rel=1e-2), name
        assert v["mb_per_s"] > 0, name


def _ratio(variants: dict, cand: str, base: str) -> float:
    return statistics.median(variants[base]["seconds"]) / statistics.median(variants[cand]["seconds"])


def _check_mysql(my: dict, partition_counts: list, rows: int) -> None:
    """The mysql section: MySqlSink against Spark's JDBC writer (MariaDB Connector/J) at each partition
    count, and the loaders (the sink's multi-row INSERT, LOAD DATA LOCAL INFILE) in one XA branch each."""
    assert [p["partitions"] for p in my["points"]] == list(partition_counts)
    for p in my["points"]:
        _check_variants(p["variants"], rows)
        assert list(p["variants"]) == ["MySqlSink (exactly-once)", my["baseline"]]
        assert p["ratio"] == pytest.approx(_ratio(p["variants"], "MySqlSink (exactly-once)", my["baseline"]),
                                           rel=1e-2, abs=1e-3)
        assert p["transactions_per_batch"] and max(p["transactions_per_batch"]) <= 2 < p["partitions"], p
        assert all(v["server_cpu_s"] for v in p["variants"].values())  # MariaDB's CPU during each run
    ld = my["loaders"]
    _check_variants(ld["variants"], rows)
    from benchmarks.mysql import INSERT, LOAD

    ins, load = ld["variants"][INSERT], ld["variants"][LOAD]
    assert ld["ratio_load_data_over_insert"] == pytest.approx(
        statistics.median(ins["seconds"]) / statistics.median(load["seconds"]), rel=1e-2, abs=1e-3)
    assert ld["ratio_load_step_only"] == pytest.approx(
        statistics.median(ins["load_s"]) / statistics.median(load["load_s"]), rel=1e-2, abs=1e-3)
    assert all(0 < a < b for v in (ins, load) for a, b in zip(v["load_s"], v["seconds"]))
    assert ld["server_local_infile"] is True


@pytest.mark.timeout(600)
@pytest.mark.alone("runs the benchmark suite: timings of its own, both cores busy, within a 580 s bound")
def test_quick_benchmark_writes_every_section(tmp_path):
    out = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[bench" in proc.stderr  # progress is shown while it runs
    res = json.loads((out / "results.json").read_text())
    assert (out / "results.md").read_text().startswith("# twophase benchmark results")
    assert (out / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = res["params"]["rows"]
    assert res["params"]["quick"] is True
    sec = res["sections"]
    assert set(sec) == SECTIONS

    for key, (cand, bases) in {
        "kafka": ("KafkaSink (exactly-once)", {
            "KafkaSink / Spark kafka writer": "Spark format('kafka') (at-least-once)",
            "KafkaSink / raw librdkafka txn": "raw librdkafka transactional produce"}),
        "postgres": ("PostgresSink (exactly-once)", {
            "PostgresSink / Spark JDBC": "Spark df.write.jdbc",
            "PostgresSink / raw COPY": "raw COPY (psycopg2)"}),
    }.items():
        s = sec[key]
        _check_variants(s["variants"], rows)
        for label, base in bases.items():
            assert s["ratios"][label] == pytest.approx(_ratio(s["variants"], cand, base), rel=1e-2, abs=1e-3)
        assert s["commit_latency_ms"]["p50"] > 0 and s["commit_latency_ms"]["p99"] >= s["commit_latency_ms"]["p50"]
        assert all(p["total_ms"] > 0 for p in s["phases_ms"])

    files = sec["files"]
    assert set(files["targets"]) == {"local", "hdfs", "s3", "s3-moto"}
    for t, d in files["targets"].items():
        _check_variants(d["variants"], rows)
        cand, *others, base = list(d["variants"])
        assert d["baseline"] == base
        assert d["ratio"] == pytest.approx(_ratio(d["variants"], cand, base), rel=1e-2, abs=1e-3), t
        # local and HDFS also measure FileSink(writer="spark") against the same baseline
        assert len(others) == (1 if t in ("local", "hdfs") else 0), t
        for o in [cand, *others]:
            assert d["ratios"][o] == pytest.approx(_ratio(d["variants"], o, base), rel=1e-2, abs=1e-3), (t, o)
        assert files["commit_latency_ms"][t]["p50"] > 0

    coord = sec["coordinator"]
    b = coord["batch"]
    assert b["coordinator_total_ms"] and all(x > 0 for x in b["coordinator_total_ms"] + b["plain_collect_ms"])
    assert b["overhead_ms"] == pytest.approx(
        statistics.median(b["coordinator_total_ms"]) - statistics.median(b["plain_collect_ms"]), abs=0.1)
    assert b["protocol_ms"]["p50"] > 0
    st = coord["streaming"]
    assert st["batches"] >= 3 and st["rows"] > 0
    assert 0 < st["commit_ms"]["p50"] <= st["commit_ms"]["p99"]

    rec = sec["recovery"]
    assert [r["handles"] for r in rec["files"]] == list(res["params"]["recovery_handles"])
    assert all(r["recover_s"] > 0 for r in rec["files"] + rec["postgres"])
    assert rec["postgres"], "PostgreSQL recovery was not measured"

    # One many-partition case per sink, so a per-partition cost shows as a falling ratio.
    pts = sec["partitions"]["points"]
    assert {(p["target"], p["partitions"]) for p in pts} == {
        (t, n) for t in res["params"]["partition_targets"] for n in res["params"]["partition_counts"]}
    assert max(res["params"]["partition_counts"]) >= 50
    for p in pts:
        _check_variants(p["variants"], rows)
        cand, base, *floor = list(p["variants"])
        assert p["ratio"] == pytest.approx(_ratio(p["variants"], cand, base), rel=1e-2, abs=1e-3)
        # Kafka also measures the rows moved into Python with nothing sent: the Python floor.
        assert floor == (["rows into Python (no sink)"] if p["target"] == "kafka" else []), floor
        if floor:
            assert p["floor_ratio"] == pytest.approx(_ratio(p["variants"], floor[0], base), rel=1e-2, abs=1e-3)
        # Transactions per batch follow the writer slots (local[2]), not the input partitions.
        assert p["transactions_per_batch"] and max(p["transactions_per_batch"]) <= 2 < p["partitions"], p

    # Latency per micro-batch (streaming, tiny at --quick): Spark's file sink against the
    # coordinator with its log on S3 (MinIO through the request-counting proxy).
    lat = sec["latency"]
    assert [(g["target"], g["rows"]) for g in lat["groups"]] == [("files", 100)]
    g = lat["groups"][0]
    base = g["variants"][g["baseline"]]
    assert g["baseline"] == next(iter(g["variants"]))
    for name, v in g["variants"].items():
        kept = lat["config"]["batches"] - lat["config"]["warmup"]
        assert len(v["trigger_ms"]) == kept * lat["config"]["reps"] and all(x > 0 for x in v["trigger_ms"]), name
        assert v["trigger_ms_median"] == pytest.approx(statistics.median(v["trigger_ms"]), abs=0.1), name
        assert v["ratio"] == pytest.approx(statistics.median(base["trigger_ms"]) / statistics.median(v["trigger_ms"]),
                                           rel=1e-2), name
        if v["coordinator"]:
            assert v["coordinator_ms_median"]["total_ms"] > 0, name
    s3 = [v for v in g["variants"].values() if v["log"] == "s3"]
    assert s3 and s3[0]["log_requests"]["critical_median"] >= 1 and s3[0]["log_requests"]["batches"] >= 1

    # The data source form (files at 2 partitions at --quick): Spark's file sink, the coordinator and
    # format("twophase-files"), per batch and per row; every query's output read back.
    ds = sec["datasource"]
    assert [(g["target"], g["partitions"]) for g in ds["groups"]] == [("files", 2)]
    g = ds["groups"][0]
    assert list(g["variants"]) == [g["baseline"], g["coordinator"], g["datasource"]]
    base = g["variants"][g["baseline"]]
    kept = (ds["config"]["batches"] - ds["config"]["warmup"]) * ds["config"]["reps"]
    for name, v in g["variants"].items():
        assert len(v["trigger_ms"]) == kept and all(x > 0 for x in v["trigger_ms"]), name
        assert v["ratio"] == pytest.approx(statistics.median(base["trigger_ms"]) / statistics.median(v["trigger_ms"]),
                                           rel=1e-2), name
        assert v["us_per_row"] == pytest.approx(v["trigger_ms_median"] * 1000 / ds["config"]["rows"], rel=1e-2), name
        assert len(v["output_checked"]) == ds["config"]["reps"], name
        assert all(c["rows"] >= ds["config"]["batches"] * ds["config"]["rows"] for c in v["output_checked"]), name
    over = g["datasource_over_coordinator"]
    assert over["trigger_ms"] == pytest.approx(g["variants"][g["datasource"]]["trigger_ms_median"]
                                               - g["variants"][g["coordinator"]]["trigger_ms_median"], abs=0.2)
    assert ds["in_process"]["files"]["plan_ms_median"] > 0 and ds["in_process"]["files"]["commit_ms_median"] > 0

    _check_mysql(sec["mysql"], res["params"]["partition_counts"], rows)

    # Goals are reported, each against a value measured above.
    names = " ".join(g["goal"] for g in res["goals"])
    for word in ("Kafka", "JDBC", "COPY", "file sink", "overhead", "MySqlSink"):
        assert word in names
    assert all(isinstance(g["met"], bool) for g in res["goals"])


def test_data_shapes_are_what_their_names_say(spark):
    """``--data-shape``: ``random`` payloads compress far worse than ``hex`` ones, ``repeated`` ones
    to almost nothing; ``events`` rows carry timestamps, numbers and a few repeated categories."""
    import zlib

    from benchmarks.common import make_data

    def payload_ratio(shape: str) -> float:
        df = make_data(spark, 2000, 100, 2, shape)
        text = "".join(r["payload"] for r in df.orderBy("id").collect()).encode()
        df.unpersist()
        assert len(text) == 2000 * 100
        return len(zlib.compress(text, 6)) / len(text)

    hexr, randr, repr_ = payload_ratio("hex"), payload_ratio("random"), payload_ratio("repeated")
    assert randr > 0.7 and hexr < 0.6 and randr > hexr + 0.15, (hexr, randr)
    assert repr_ < 0.01, repr_
    ev = make_data(spark, 3000, 100, 2, "events")
    assert [f.name for f in ev.schema] == ["id", "ts", "user_id", "amount", "country", "event_type"]
    assert dict(ev.dtypes)["ts"] == "timestamp"
    assert ev.select("country").distinct().count() == 20
    assert ev.select("event_type").distinct().count() == 8
    assert ev.select("user_id").distinct().count() == 3000  # 3000 of 10,000 users, all different
    ev.unpersist()
    with pytest.raises(ValueError, match="unknown data shape"):
        make_data(spark, 10, 10, 1, "nope")
