"""Issue 45, scenario 2: two batch jobs given one transaction log.

A batch job has no Spark query id; its log generation was bound to ``batch:{name}``.  An "orders"
job and a "payments" job that share one ``twophase.logLocation`` (and the default name) shared one
generation, and the second found batch 20261127 COMMITTED and silently wrote nothing, its write
returning as if done.  Now a batch job's identity includes its sink's target: the second job is
refused with a message naming the shared log, and nothing of it is lost silently.  Each job on
its own log writes its rows once, and a re-run of either is still skipped.

On local Spark and real local files, in both forms (``Coordinator.write`` and ``df.write``).
"""

from __future__ import annotations

import json
import os

import pytest

from twophase import QueryMismatchError
from twophase.coordinator import Coordinator
from twophase.sinks.files import FileSink


def _ids(folder) -> list[int]:
    if not os.path.isdir(folder):
        return []
    return sorted(int(json.loads(line)["id"]) for p in os.listdir(folder) if p.endswith(".jsonl")
                  for line in open(os.path.join(folder, p)) if line.strip())


def test_two_batch_jobs_on_one_log_with_the_coordinator_the_second_is_refused_naming_the_log(spark, tmp_path):
    log = str(tmp_path / "logs" / "daily")
    orders, payments = tmp_path / "orders", tmp_path / "payments"
    o = spark.range(0, 100, 1, 2).selectExpr("id")
    p = spark.range(1000, 1050, 1, 2).selectExpr("id")
    with Coordinator(FileSink(str(orders), format="jsonl"), log_location=log) as c:
        assert c.write(o, batch_id=20261127)["action"] == "committed"
    with Coordinator(FileSink(str(payments), format="jsonl"), log_location=log) as c:
        with pytest.raises(QueryMismatchError, match="must not share one log") as err:
            c.write(p, batch_id=20261127)
    assert log in str(err.value) and "orders" in str(err.value)
    assert _ids(orders) == list(range(100))
    assert _ids(payments) == []   # refused, not skipped as "committed"
    # Each job on a log of its own: written once, and a re-run is skipped.
    for _ in range(2):
        with Coordinator(FileSink(str(payments), format="jsonl"), log_location=str(tmp_path / "logs" / "pay")) as c:
            c.write(p, batch_id=20261127)
    with Coordinator(FileSink(str(orders), format="jsonl"), log_location=log) as c:
        assert c.write(o, batch_id=20261127)["action"] == "skipped"
    assert _ids(payments) == list(range(1000, 1050))
    assert _ids(orders) == list(range(100))


def test_two_batch_jobs_on_one_log_by_name_the_second_is_refused_naming_the_log(spark, tmp_path):
    import twophase.datasource

    twophase.datasource.register(spark)
    log = str(tmp_path / "logs" / "daily")
    orders, payments = tmp_path / "orders", tmp_path / "payments"

    def write(df, out):
        (df.write.format("twophase-files").mode("append").option("format", "jsonl")
         .option("twophase.logLocation", log).option("twophase.batchId", "20261127").save(str(out)))

    write(spark.range(0, 100, 1, 2).selectExpr("id"), orders)
    with pytest.raises(Exception, match="must not share one log"):
        write(spark.range(1000, 1050, 1, 2).selectExpr("id"), payments)
    write(spark.range(0, 100, 1, 2).selectExpr("id"), orders)   # a re-run of orders: skipped
    assert _ids(orders) == list(range(100))
    assert _ids(payments) == []


def test_a_log_of_an_earlier_version_is_bound_to_the_first_batch_job_that_comes_and_refuses_another(tmp_path):
    """Logs written before batch ids carried the target have a generation bound to ``batch:{name}``:
    the first job of that name adopts it and binds it to its target (an exclusive create); a second
    job of the same name writing elsewhere is refused, not silently skipped (found by the review)."""
    from twophase.log import TransactionLog, batch_query_id

    log = str(tmp_path / "log")
    old = TransactionLog(log)
    old.acquire("batch:daily", "daily")   # as twophase 96f774c bound a batch job's generation
    old.close()
    orders, refunds = FileSink(str(tmp_path / "orders")), FileSink(str(tmp_path / "refunds"))
    first = TransactionLog(log)
    first.acquire(batch_query_id("daily", orders.target()), "daily", target=orders.target())
    assert first.generation == 1
    first.close()
    again = TransactionLog(log)
    again.acquire(batch_query_id("daily", orders.target()), "daily", target=orders.target())
    assert again.generation == 1
    again.close()
    with pytest.raises(QueryMismatchError, match="must not share one log") as err:
        TransactionLog(log).acquire(batch_query_id("daily", refunds.target()), "daily", target=refunds.target())
    assert "orders" in str(err.value) and "refunds" in str(err.value)


def test_a_batch_jobs_target_does_not_change_with_the_way_to_it():
    """A harmless change between two runs (a trailing slash, file://, brokers listed otherwise, another
    host name, port (a pooler, a proxy) or user for the same database) is the same job, not a second
    job refused on its own log; another table, topic or folder is another job."""
    from twophase.sinks.kafka import KafkaSink
    from twophase.sinks.postgres import PostgresSink

    assert FileSink("/data/orders").target() == FileSink("/data/orders/").target() \
        == FileSink("file:///data/orders").target() != FileSink("/data/refunds").target()
    assert KafkaSink("b:9092,a:9092", "t", "p").target() == KafkaSink("a:19092", "t", "p").target() \
        != KafkaSink("a:9092", "u", "p").target()
    # (schema given: without it target() asks the server which schema the search_path resolves the
    # table to, which may differ by user: tests/test_backfill_sql.py)
    assert PostgresSink("host=h port=5432 dbname=d user=u1", "t", schema="s").target() == \
        PostgresSink("host=proxy port=6432 dbname=d user=u2 password=secret", "t", schema="s").target() != \
        PostgresSink("host=h port=5432 dbname=d", "t2", schema="s").target()
    assert "secret" not in PostgresSink("host=h dbname=d password=secret", "t", schema="s").target()
