"""Two runs of one batch job that overlap (found by the fresh-context review of issue 45's change).

Batch jobs pick their own batch ids (a daily job and a backfill of an older date), and in the data
source form every run takes the log over; any run may pause between two lines longer than its lease:

- prune decided from a listing which batches were pending, then raised the low-water mark over a
  backfill's batch whose decision landed in between; recovery took that decision for a deposed
  coordinator's late write, aborted it and refused the batch for ever.  Now the log keeps which
  batch ids it pruned (only batches it saw committed), not a mark that claims every id below it.
- ``sweep_late`` (the next batch's look for late attempts' leftovers of earlier batches) rolled back a
  prepared transaction of the backfill's decided, partly committed batch.  Now a leftover is rolled
  back only once claimed ``doomed`` in the claims table, which a gid claimed ``decided`` refuses.

Without Spark (tests/inprocess.py): real local files and a real PostgreSQL server.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress
from twophase.recovery import Committer


def test_a_backfill_decided_while_another_run_prunes_is_committed_not_taken_for_a_late_write(tmp_path):
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")

    def sink():
        return FileSink(str(out), format="jsonl")

    qid = batch_query_id("daily", sink().target())
    y = Driver(sink(), log_url, qid, takeover=True)
    y.tlog.retain_batches = 1
    y.batch(10, ids(100))
    y2 = Driver(sink(), log_url, qid, takeover=True)
    y2.tlog.retain_batches = 1
    create = y2.tlog.store.create
    backfill: dict = {}

    def y2_create(name, data):
        # Y2 has listed the log to prune batch 10; before its mark lands, the backfill X decides batch 5.
        if "low-water/" in name and not backfill:
            x = Driver(sink(), log_url, qid, takeover=True)
            opened = x.protocol.open_ballot(5, lambda planned: 1, BatchProgress("pipe", 5, None, "committed"))
            assert opened is not None
            results = OneTask(x.sink, ids(50, 51)).prepare(opened.query_name, 5, opened.intent, opened.run)
            assert x.tlog.mine(x.tlog.decide(5, opened.number, {"handles": [r["handle"] for r in results],
                                                                "rows": 2, "partitions": [0]}))
            backfill["x"] = x   # X's commit step dies here
        return create(name, data)

    y2.tlog.store.create = y2_create  # type: ignore[method-assign]
    y2.protocol.run_batch(11, OneTask(y2.sink, ids(110)), BatchProgress("pipe", 11, None, "committed"))
    z = Driver(sink(), log_url, qid, takeover=True)
    try:
        assert z.batch(5, ids(50, 51)).action == "recommitted"   # was: PrunedBatchError, 50 and 51 lost
    finally:
        for d in (y, y2, z, backfill["x"]):
            d.close()
    visible = sorted(json.loads(line)["id"] for p in os.listdir(out) if p.endswith(".jsonl")
                     for line in open(out / p) if line.strip())
    assert visible == [50, 51, 100, 110]


@pytest.mark.postgres
@pytest.mark.timeout(300)
@pytest.mark.parametrize("claims", [True, False], ids=["claims", "no-claims-table"])
def test_the_next_runs_sweep_of_late_leftovers_leaves_a_backfills_decided_transactions_alone(
        postgres_service, tmp_path, claims):
    """With the claims table, a decided gid refuses to be doomed.  Without one this role may write
    (no claim at all), the sweep rolled back every leftover of a lower batch id; now only those of
    batches the log shows finished (issue 59's rule), and batch 5 is not finished."""
    from twophase.sinks.postgres import _claims_name

    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "sweepdec") as t:
        qid = batch_query_id("daily", t.sink().target())
        y = Driver(t.sink(), log_url, qid, takeover=True)
        x_state: dict = {}
        table_of_claims = _claims_name(f"{t.name}_m")
        if not claims:
            t.execute(f'REVOKE INSERT, UPDATE ON "{table_of_claims}" FROM CURRENT_USER')

        def y_partitions(planned):
            # Y (batch 7) has recovered and pauses before its INTENT; X (a backfill of batch 5) runs:
            # INTENT, two tasks, the claim as decided, the decision, and the first of its two commits.
            x = Driver(t.sink(), log_url, qid, takeover=True)
            opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
            assert opened is not None
            results = []
            for part, rows in ((0, ids(50, 51)), (1, ids(52, 53))):
                ctx = TransactionContext(opened.query_name, 5, part, 0, opened.intent, opened.run)
                results.append({"partition": part, "attempt": 0, "rows": 2,
                                "handle": x.sink.encode_handle(run_attempt(x.sink, ctx, rows))})
            x.protocol.check_prepared(opened, results, started_at=0)
            assert x.tlog.mine(x.tlog.decide(5, opened.number, {"handles": [r["handle"] for r in results],
                                                                "rows": 4, "partitions": [0, 1]}))
            x.sink.commit(x.sink.decode_handle(results[0]["handle"]))
            x_state.update(x=x, results=results)
            return 1

        prog = BatchProgress("pipe", 7, None, "committed")
        y.protocol.open_ballot(7, y_partitions, prog)   # its INTENT, then its sweep of late leftovers
        assert prog.aborted_lingering == 0
        x, results = x_state["x"], x_state["results"]
        # X resumes its commit: was DataLossError (partition 1 rolled back by Y's sweep).
        Committer(x.sink, backoff=0.01).commit(5, [x.sink.decode_handle(r["handle"]) for r in results],
                                               recovering=False)
        assert t.ids() == [50, 51, 52, 53] and t.prepared() == []
        x.close()
        y.close()
        if not claims:
            t.execute(f'GRANT INSERT, UPDATE ON "{table_of_claims}" TO CURRENT_USER')
