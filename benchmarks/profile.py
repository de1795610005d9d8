"""``--profile``: where the time goes, by pyinstrument (read in benchmarks/HISTORY.md, "What limits the ratios").

Two kinds of profile, each saved as text under ``<out>/profile-<what>.txt``:

- ``coordinator``: one ``Coordinator.write`` of a NullSink batch, profiled on the
  driver (the Spark job shows up as time waiting in py4j; the rest is the protocol:
  log records, commit pool, lingering-abort pass).
- ``<sink>-inprocess``: the sink's executor path (``begin_transaction``, ``write``,
  ``pre_commit``) and its driver ``commit`` run in this process on the same rows
  (pre-collected to Arrow), so the Python side of the sink is visible; Spark's
  Python workers cannot be profiled from here.
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Params, progress, tmpdir, uid


def _profiled(fn, path) -> dict[str, Any]:
    from pyinstrument import Profiler

    prof = Profiler(interval=0.001)
    t0 = time.perf_counter()
    prof.start()
    try:
        fn()
    finally:
        prof.stop()
    dt = time.perf_counter() - t0
    text = prof.output_text(unicode=False, color=False, show_all=False)
    path.write_text(text)
    return {"file": str(path.name), "seconds": round(dt, 3)}


def _inprocess(sink, table, name: str) -> None:
    from twophase.context import TransactionContext

    sink.open()
    intent = sink.plan_batch(name, 0, 1)
    txn = sink.begin_transaction(TransactionContext(name, 0, 0, 0, intent))
    for rb in table.to_batches(max_chunksize=10_000):
        sink.write(txn, rb)
    handle = sink.pre_commit(txn)
    res = sink.commit(sink.decode_handle(sink.encode_handle(handle)))
    assert res.done, res


def run(spark, df, params: Params, services: dict[str, Any], only: list[str]) -> dict[str, Any]:
    from benchmarks.coordinator import NullSink
    from twophase.coordinator import Coordinator

    out: dict[str, Any] = {}
    params.out.mkdir(parents=True, exist_ok=True)
    coord = Coordinator(NullSink(), log_location=tmpdir("prof-log"), name="bench-prof")
    coord.write(df, batch_id=0)
    out["coordinator"] = _profiled(lambda: coord.write(df, batch_id=1), params.out / "profile-coordinator.txt")
    progress(f"profile: coordinator {out['coordinator']['seconds']:.2f}s")
    table = df.toArrow()
    if "kafka" in only:
        from benchmarks.kafka import _create_topic
        from twophase.sinks.kafka import KafkaSink

        bs = services["kafka"]["bootstrap_servers"]
        topic = f"bench-prof-{uid()}"
        _create_topic(bs, topic, 1)
        kv = table.select(["id", "payload"]).rename_columns(["key", "value"])
        import pyarrow as pa
        import pyarrow.compute as pc

        kv = pa.table({"key": pc.cast(kv["key"], pa.string()), "value": kv["value"]})
        sink = KafkaSink(bs, topic=topic, transactional_id_prefix=f"prof-{uid()}")
        out["kafka"] = _profiled(lambda: _inprocess(sink, kv, "prof"), params.out / "profile-kafka-inprocess.txt")
    if "postgres" in only:
        import psycopg2

        from twophase.sinks.postgres import PostgresSink

        info = services["postgres"]
        t = f"bench_prof_{uid()}"
        conn = psycopg2.connect(info["dsn"])
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute(f'CREATE TABLE "{t}" (id BIGINT, payload TEXT)')
            sink = PostgresSink(info["dsn"], t, gid_prefix=f"p{uid()}")
            out["postgres"] = _profiled(lambda: _inprocess(sink, table, "prof"),
                                        params.out / "profile-postgres-inprocess.txt")
        finally:
            with conn.cursor() as cur:
                cur.execute(f'DROP TABLE IF EXISTS "{t}"')
            conn.close()
    if "files" in only:
        from twophase.sinks.files import FileSink

        sink = FileSink(tmpdir("prof-files"), format="parquet")
        out["files"] = _profiled(lambda: _inprocess(sink, table, "prof"),
                                 params.out / "profile-files-inprocess.txt")
    for k, v in out.items():
        progress(f"profile: {k}: {v['seconds']:.2f}s -> {v['file']}")
    return out
