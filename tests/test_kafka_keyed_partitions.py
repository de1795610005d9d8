"""Issue 47: keyed records through ``format("twophase-kafka")`` land on the partitions Spark's own
Kafka sink puts them on.  Before, librdkafka's default partitioner (CRC32) put 38 of 50 keys on
another partition than the Java client's murmur2 that Spark's sink uses: per-key order across the
switch, compaction and co-partitioning with Java producers broke, silently.

One streaming query per format over the same rows (50 keys, 6 topic partitions), each as a named
query (``.queryName``, which Spark hands to the sink as an option: before, twophase refused it).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from tests.test_kafka_sink import _topic

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parent.parent


def _partitions_by_key(bootstrap: str, topic: str, expected: int) -> dict[str, set[int]]:
    from confluent_kafka import Consumer

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"keyed-{uuid.uuid4().hex[:8]}",
                  "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                  "enable.auto.commit": False})
    c.subscribe([topic])
    out: dict[str, set[int]] = defaultdict(set)
    seen, idle = 0, 0
    try:
        while seen < expected and idle < 300:
            m = c.poll(0.2)
            if m is None or m.error() is not None:
                idle += 1
                continue
            idle = 0
            out[m.key().decode()].add(m.partition())
            seen += 1
    finally:
        c.close()
    assert seen == expected, f"read {seen} of {expected} records from {topic}"
    return dict(out)


def test_keyed_records_land_where_sparks_kafka_sink_puts_them_and_a_named_query_runs(kafka_service, tmp_path):
    bs = kafka_service["bootstrap_servers"]
    spark_topic, ours = _topic(bs, 6), _topic(bs, 6)
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "rows.json").write_text(
        "".join(json.dumps({"id": f"r{i:04d}", "n": i}) + "\n" for i in range(500)))
    script = textwrap.dedent(f"""
        import twophase.datasource
        from tests.services.kafka import spark_kafka_jars
        from twophase.spark import local_session

        spark = local_session("local[2]", "keyed", {{"spark.jars": ",".join(spark_kafka_jars())}})
        twophase.datasource.register(spark)
        src = spark.readStream.schema("id STRING, n LONG").json({str(tmp_path / "in")!r}).repartition(2)
        df = src.selectExpr("CONCAT('key-', CAST(n % 50 AS STRING)) AS key", "id AS value")
        for fmt, topic in (("kafka", {spark_topic!r}), ("twophase-kafka", {ours!r})):
            q = (df.writeStream.format(fmt).queryName("orders_" + fmt.replace("-", "_"))
                 .option("kafka.bootstrap.servers", {bs!r}).option("topic", topic)
                 .option("checkpointLocation", {str(tmp_path)!r} + "/ck-" + fmt)
                 .trigger(availableNow=True).start())
            q.awaitTermination()
        spark.stop()
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=500, cwd=REPO,
                       env=dict(__import__("os").environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr[-4000:]
    theirs, mine = _partitions_by_key(bs, spark_topic, 500), _partitions_by_key(bs, ours, 500)
    assert len(theirs) == 50 and all(len(v) == 1 for v in theirs.values()), theirs
    moved = sorted(k for k in theirs if mine.get(k) != theirs[k])
    assert moved == [], f"{len(moved)} of 50 keys land on another partition than Spark's sink puts them: {moved[:10]}"
