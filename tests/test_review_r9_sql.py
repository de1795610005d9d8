"""Review r9 (issue 59/61's fault model) of the SQL sinks' changed code, on the real servers, in process.

- A decided batch's committer that committed part of it and paused, while another run finished the
  batch (COMMITTED) and pruned its markers (the log's evidence allows it), reads the rest "gone,
  never visible" and raises DATA LOSS for a batch the log shows COMMITTED, all of it once
  (finished_after_all is consulted for BatchVanishedError only, not for a partly vanished batch).
"""

from __future__ import annotations

from collections import Counter

import pytest

from tests.inprocess import Driver, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.errors import DataLossError
from twophase.log import batch_query_id
from twophase.protocol import BatchProgress


def _pg_sink(t: PgTable, **kw):
    from twophase.sinks.postgres import PostgresSink

    return PostgresSink(t.dsn, table=t.name, marker_table=f"{t.name}_m", gid_prefix=t.gid_prefix, **kw)


def _prepared_batch_5(x: Driver):
    """X's ballot of batch 5: two partitions (ids 50 and 51) pre-committed and checked, not decided."""
    opened = x.protocol.open_ballot(5, lambda p: 2, BatchProgress("pipe", 5, None, "committed"))
    assert opened is not None
    results = []
    for part in (0, 1):
        ctx = TransactionContext(opened.query_name, 5, part, 0, opened.intent, opened.run)
        h = run_attempt(x.sink, ctx, ids(50 + part))
        results.append({"partition": part, "attempt": 0, "rows": 1, "handle": x.sink.encode_handle(h)})
    x.protocol.check_prepared(opened, results, started_at=0)
    return opened, results


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_r9_a_partly_committing_run_overtaken_by_recovery_and_a_prune_does_not_report_data_loss(
        postgres_service, tmp_path):
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "r9dl") as t:
        qid = batch_query_id("daily", _pg_sink(t).target())
        x = Driver(_pg_sink(t), log_url, qid, takeover=True)
        drivers = [x]
        opened, results = _prepared_batch_5(x)
        commit = x.sink.commit

        def x_commit(handle):
            res = commit(handle)
            if len(drivers) == 1:
                # X committed its first handle alone and pauses. Y takes the log over: its recovery
                # commits the rest of batch 5 and writes COMMITTED; its batch 200's cleanup prunes the
                # markers of settled batches below 200 - retention: batch 5's.
                y = Driver(_pg_sink(t), log_url, qid, takeover=True)
                drivers.append(y)
                assert y.batch(200, ids(2000)).action == "committed"
                assert y.tlog.view(5).committed is not None
                assert 5 not in {r[0] for r in t.execute(f'SELECT batch_id FROM "{t.name}_m"')}
            return res

        x.sink.commit = x_commit  # type: ignore[method-assign]
        error = None
        try:
            x.protocol.decide_and_commit(opened, results, BatchProgress("pipe", 5, None, "committed"))
        except DataLossError as e:
            error = e
        finally:
            for d in drivers:
                d.close()
        counts = Counter(r[0] for r in t.execute(f'SELECT id FROM "{t.name}"'))
        assert counts == Counter({50: 1, 51: 1, 2000: 1}), counts      # nothing lost, nothing twice
        assert error is None, f"reported on a batch the log shows COMMITTED: {error}"


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_r9_an_old_generation_is_not_taken_over_by_a_job_of_another_schema_that_comes_first(postgres_service, tmp_path):
    """An older version bound the log for job A (search_path s4a; its target named no schema) and
    committed A's batch 0.  After the upgrade, job B (same name and log, search_path s4b: another
    table) happens to start first.  B took it over (exclusive create of the retarget record) and its
    batch 0 was 'skipped'.  Now a job takes an old generation over only where the generation's decided
    handles name its marker table's schema: B is refused (A, later, takes it: test_backfill_sql.py)."""
    from tests.test_backfill_sql import _TwoSchemas
    from twophase.errors import QueryMismatchError

    log_url = str(tmp_path / "log")
    two = _TwoSchemas(postgres_service["dsn"])
    try:
        a_sink, b_sink = two.sink(0), two.sink(1)
        old = f"postgres database {a_sink.params.get('dbname')} table {two.table}"
        a = Driver(a_sink, log_url, batch_query_id("daily", old), takeover=True)   # as an older version bound it
        try:
            assert a.batch(0, ids(1, 2)).action == "committed"
        finally:
            a.close()
        from twophase.log import TransactionLog

        tlog = TransactionLog(log_url)
        try:
            tlog.acquire(batch_query_id("daily", b_sink.target()), "daily", takeover=True, target=b_sink.target())
        except QueryMismatchError:
            return  # refused: nothing silently skipped (a fix)
        skipped = tlog.view(0).committed is not None
        tlog.close()
        # HEAD: B owns A's generation; its batch 0 reads COMMITTED and is skipped: rows 3, 4 never written.
        assert not skipped, f"B (schema {two.schemas[1]}) took over A's generation: its batch 0 is skipped"
    finally:
        two.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_r9_twophase_recover_overtaken_by_another_run_and_a_prune_does_not_report_data_loss(postgres_service, tmp_path):
    """The twin of the test above in ``twophase recover``: X decided batch 5 and died; the operator's
    recover commits its first handle, and then another run takes over, commits the rest, writes
    COMMITTED and prunes batch 5's markers.  The recover's commit of the second handle finds it gone
    and its marker absent: the log, read after that verdict, shows the batch COMMITTED, so it is not
    data loss (was: DataLossError)."""
    from twophase.recovery import recover

    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "r9rc") as t:
        qid = batch_query_id("daily", _pg_sink(t).target())
        x = Driver(_pg_sink(t), log_url, qid, takeover=True)
        drivers = [x]
        opened, results = _prepared_batch_5(x)
        assert x.tlog.mine(x.tlog.decide(5, opened.number, {"handles": [r["handle"] for r in results],
                                                            "rows": 2, "partitions": [0, 1]}))
        x.close()   # X dies after its decision
        operator = _pg_sink(t)
        commit = operator.recover_and_commit

        def operator_commit(handle):
            res = commit(handle)
            if len(drivers) == 1:   # the first handle committed: another run overtakes the operator
                y = Driver(_pg_sink(t), log_url, qid, takeover=True)
                drivers.append(y)
                assert y.batch(200, ids(2000)).action == "committed"
                assert y.tlog.view(5).committed is not None
            return res

        operator.recover_and_commit = operator_commit  # type: ignore[method-assign]
        try:
            recover(log_url, operator, takeover=True, parallelism=1)
        finally:
            for d in drivers[1:]:
                d.close()
        counts = Counter(r[0] for r in t.execute(f'SELECT id FROM "{t.name}"'))
        assert counts == Counter({50: 1, 51: 1, 2000: 1}), counts
