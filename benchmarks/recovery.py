"""Recovery time with N pending handles: ``twophase.recovery.recover`` (the ``twophase recover`` path).

For each N a fresh log holds one decided batch (INTENT + PREPARED) with N
handles, as a driver that crashed right after logging its decision leaves it.
The handles are real pre-committed transactions made with the sink's own
executor methods (``begin_transaction``/``write``/``pre_commit``) in this process:

- FileSink (local Parquet): N staged part files of 10 rows each; N = 10, 100, 1,000.
- PostgresSink: N prepared transactions.  The test server has
  ``max_prepared_transactions = 128`` and is shared with other test runs, so N is
  capped at 50 here; 1,000 PostgreSQL handles would need that setting >= 1,000.

Timed: ``recover(log_url, sink, takeover=True)`` from start to return (takes the
log over, commits every handle, aborts leftovers, logs COMMITTED).  Checked
afterwards: every row is visible exactly once.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Params, goal, progress, tmpdir, uid


def _pending_log(sink, n: int, name: str) -> str:
    import pyarrow as pa

    from twophase.context import TransactionContext
    from twophase.log import INTENT, PREPARED, TransactionLog

    log_url = tmpdir("recovery-log")
    tlog = TransactionLog(log_url)
    tlog.acquire(f"bench-recovery-{uid()}", name)
    intent = sink.plan_batch(name, 0, n)
    tlog.write(0, INTENT, {"intent": intent, "sink": sink.kind, "name": name, "num_partitions": n})
    handles = []
    for p in range(n):
        txn = sink.begin_transaction(TransactionContext(name, 0, p, 0, intent))
        sink.write(txn, pa.RecordBatch.from_pydict({"id": list(range(p * 10, p * 10 + 10)),
                                                    "payload": ["x" * 16] * 10}))
        handles.append(sink.encode_handle(sink.pre_commit(txn)))
    tlog.write(0, PREPARED, {"handles": handles, "rows": n * 10})
    return log_url


def _time_recover(sink, n: int, name: str) -> dict[str, Any]:
    from twophase.recovery import recover

    t0 = time.perf_counter()
    log_url = _pending_log(sink, n, name)
    setup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    report = recover(log_url, sink, takeover=True)
    dt = time.perf_counter() - t0
    done = report.handles_committed + report.handles_already_committed
    assert done == n and report.committed_batches == [0], report.to_dict()
    return {"handles": n, "recover_s": round(dt, 4), "per_handle_ms": round(dt * 1000 / n, 3),
            "setup_s": round(setup_s, 3)}


def run(spark, df, params: Params, services: dict[str, Any]) -> dict[str, Any]:
    from twophase.sinks.files import FileSink

    out: dict[str, Any] = {"title": "Recovery", "files": [], "postgres": [], "goals": []}
    for n in params.recovery_handles:
        target = tmpdir("recovery-out")
        sink = FileSink(target, format="parquet")
        sink.open()
        r = _time_recover(sink, n, "bench-rec")
        rows = spark.read.parquet(target).count()
        assert rows == n * 10, (rows, n)
        progress(f"recovery/files: {n} handles in {r['recover_s']:.2f}s")
        out["files"].append(r)
        if n == 1000:
            out["goals"].append(goal("recovery of 1,000 pending handles < 5 s (FileSink local)",
                                     r["recover_s"], 5.0, "<"))
    if "postgres" in services:
        import psycopg2

        from twophase.sinks.postgres import PostgresSink

        info = services["postgres"]
        for n in params.pg_recovery_handles:
            table = f"bench_rec_{uid()}"
            conn = psycopg2.connect(info["dsn"])
            conn.autocommit = True
            try:
                with conn.cursor() as cur:
                    cur.execute(f'CREATE TABLE "{table}" (id BIGINT, payload TEXT)')
                sink = PostgresSink(info["dsn"], table, gid_prefix=f"r{uid()}")
                sink.open()
                r = _time_recover(sink, n, "bench-rec-pg")
                with conn.cursor() as cur:
                    cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{table}"')
                    total, distinct = cur.fetchone()
                assert total == distinct == n * 10, (total, distinct, n)
            finally:
                with conn.cursor() as cur:
                    cur.execute(f'DROP TABLE IF EXISTS "{table}"')
                conn.close()
            progress(f"recovery/postgres: {n} handles in {r['recover_s']:.2f}s")
            out["postgres"].append(r)
        out["postgres_note"] = ("max_prepared_transactions = 128 on the shared test server: PostgreSQL "
                                f"recovery measured up to {max(params.pg_recovery_handles)} handles; "
                                "1,000 would need max_prepared_transactions >= 1,000")
    return out
