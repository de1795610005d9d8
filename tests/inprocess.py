"""The protocol without Spark, for tests: a driver is a log owner and its ``TwoPhaseProtocol``, a
batch's one task runs in-process (``BatchWork``), on a real transaction log and a real target."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from twophase import TransactionContext
from twophase.log import INTENT, TransactionLog
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink


def ids(*values: int) -> pa.RecordBatch:
    return pa.record_batch({"id": pa.array(values, pa.int64()), "v": [f"v{i}" for i in values]})


def run_attempt(sink: TwoPhaseCommitSink, ctx: TransactionContext, batch: pa.RecordBatch) -> Any:
    """One task attempt as the coordinator's executor code runs it: begin, write, pre_commit;
    on failure the transaction is aborted and the error raised."""
    txn = sink.begin_transaction(ctx)
    try:
        sink.write(txn, batch)
        return sink.pre_commit(txn)
    except BaseException:
        sink.abort(txn)
        raise


class OneTask:
    """The engine's side of a batch (``BatchWork``): one partition, run here."""

    def __init__(self, sink: TwoPhaseCommitSink, batch: pa.RecordBatch):
        self.sink, self.batch = sink, batch

    def partitions(self, planned: int | None) -> int:
        return 1

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        h = run_attempt(self.sink, TransactionContext(query_name, batch_id, 0, 0, intent, run), self.batch)
        return [{"partition": 0, "attempt": 0, "rows": self.batch.num_rows, "handle": self.sink.encode_handle(h)}]

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        return None


class Driver:
    """One coordinator process: a log owner and its protocol, as ``Coordinator`` builds them."""

    def __init__(self, sink: TwoPhaseCommitSink, log_url: str, query_id: str, *, new_generation: bool = False,
                 takeover: bool = False):
        self.sink = sink
        sink.open()
        self.tlog = TransactionLog(log_url)
        self.tlog.acquire(query_id, "pipe", new_generation=new_generation, takeover=takeover)
        self.query_name = f"pipe.{self.tlog.scope()}"
        self.protocol = TwoPhaseProtocol(sink, self.tlog, name="pipe", query_name=self.query_name,
                                         committer=lambda: Committer(sink, backoff=0.01))

    def batch(self, batch_id: int, rows: pa.RecordBatch) -> BatchProgress:
        prog = BatchProgress("pipe", batch_id, None, "committed")
        self.protocol.run_batch(batch_id, OneTask(self.sink, rows), prog)
        return prog

    def intent(self, batch_id: int) -> dict[str, Any]:
        rec = self.tlog.record(batch_id, INTENT)
        assert rec is not None
        return rec.body["intent"]

    def close(self) -> None:
        self.tlog.close()


class PgTable:
    """A table of a test's own on the PostgreSQL server, ``(id bigint PRIMARY KEY, v text)``, and
    what a PostgresSink leaves beside it; on exit, every prepared transaction of ``gid_prefix``
    is rolled back and the tables dropped.  ``sink()`` makes a PostgresSink into it."""

    def __init__(self, dsn: str, stem: str):
        import uuid

        import psycopg2

        self.dsn = dsn
        self.name = f"{stem}_{uuid.uuid4().hex[:8]}"
        self.gid_prefix = f"t{uuid.uuid4().hex[:7]}"
        self.admin = psycopg2.connect(dsn)
        self.admin.autocommit = True
        self.execute(f'CREATE TABLE "{self.name}" (id bigint PRIMARY KEY, v text)')

    def __enter__(self) -> PgTable:
        return self

    def __exit__(self, *exc: object) -> None:
        for gid in self.prepared():
            self.execute("ROLLBACK PREPARED %s", (gid,))
        self.execute(f'DROP TABLE IF EXISTS "{self.name}", "{self.name}_m", "{self.name}_m_claims"')
        self.admin.close()

    def sink(self) -> TwoPhaseCommitSink:
        from twophase.sinks.postgres import PostgresSink

        return PostgresSink(self.dsn, table=self.name, marker_table=f"{self.name}_m", gid_prefix=self.gid_prefix)

    def execute(self, statement: str, args: Any = None) -> list[tuple]:
        with self.admin.cursor() as cur:
            cur.execute(statement, args)
            return cur.fetchall() if cur.description else []

    def ids(self) -> list[int]:
        return [r[0] for r in self.execute(f'SELECT id FROM "{self.name}" ORDER BY id')]

    def prepared(self) -> list[str]:
        """Prepared transactions of this table's sinks (by their gid prefix)."""
        return [r[0] for r in self.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s",
                                           (self.gid_prefix, self.gid_prefix))]
