"""Issue 59 on PostgreSQL, and the log's and protocol's parts of it: backfills and overlapping runs of
one batch job (batch ids the user picks), where no destructive action may rest on batch-id order or on
evidence someone else can delete.

- Scenario 3 (DUPLICATE): marker rows pruned by batch-id distance took a backfill's markers while
  its decided batch was committed but not yet COMMITTED in the log; the re-run read "gone, marker
  absent" as "rolled back, never visible", voided the batch and wrote it again.  Now a marker row is
  pruned only when the log shows its batch finished (``settled``), and a "never visible" verdict is
  checked against the log read after it (COMMITTED or pruned: not vanished, never voided).
- Scenario 4: ``PostgresSink.target()`` left out a schema resolved by ``search_path``, so two jobs of
  one name and log writing same-named tables in two schemas shared a batch query id.
- Mutants: the log's prune recording ``[min, max]`` of what it pruned (a backfill in the gap refused),
  and "a late decision found while closing a ballot wins" (protocol and recovery) never taken.

Without Spark (tests/inprocess.py): a real PostgreSQL server and a real log in local files.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.errors import PrunedBatchError
from twophase.log import COMMITTED, INTENT, TransactionLog, batch_query_id
from twophase.protocol import BatchProgress
from twophase.recovery import Committer


def _sink(t: PgTable, **kw: Any):
    from twophase.sinks.postgres import PostgresSink

    return PostgresSink(t.dsn, table=t.name, marker_table=f"{t.name}_m", gid_prefix=t.gid_prefix, **kw)


def _counts(t: PgTable) -> Counter:
    return Counter(r[0] for r in t.execute(f'SELECT id FROM "{t.name}"'))


def _marker_batches(t: PgTable) -> list[int]:
    return sorted({r[0] for r in t.execute(f'SELECT batch_id FROM "{t.name}_m"')})


def _backfill_decided_and_committed(t: PgTable, log_url: str, qid: str, batch_id: int, rows) -> Driver:
    """A backfill X takes the log over, decides ``batch_id``, commits every prepared transaction of it,
    and dies before its COMMITTED record."""
    x = Driver(_sink(t), log_url, qid, takeover=True)
    opened = x.protocol.open_ballot(batch_id, lambda planned: 1, BatchProgress("pipe", batch_id, None, "committed"))
    assert opened is not None
    results = OneTask(x.sink, rows).prepare(opened.query_name, batch_id, opened.intent, opened.run)
    x.protocol.check_prepared(opened, results, started_at=0)
    assert x.tlog.mine(x.tlog.decide(batch_id, opened.number, {"handles": [r["handle"] for r in results],
                                                               "rows": rows.num_rows, "partitions": [0]}))
    Committer(x.sink, backoff=0.01).commit(batch_id, [x.sink.decode_handle(r["handle"]) for r in results],
                                           recovering=False)
    return x   # dies here: no COMMITTED record


# ---------------------------------------------------------------- scenario 3 (PostgreSQL)
@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_scenario_3_a_backfills_committed_markers_pruned_by_a_newer_run_is_not_voided_and_written_twice(
        postgres_service, tmp_path):
    """X decides a backfill of batch 5 and commits it, then dies before COMMITTED; Y (batch 200) runs
    its cleanup, which pruned every marker below 100 (X's too); the re-run of batch 5 then found the
    transaction gone and its marker absent, voided the batch and wrote it again: every row twice."""
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "bf3") as t:
        t.execute(f'ALTER TABLE "{t.name}" DROP CONSTRAINT "{t.name}_pkey"')  # a duplicate shows as one
        qid = batch_query_id("daily", _sink(t).target())
        y = Driver(_sink(t), log_url, qid, takeover=True)
        drivers = [y]
        commit = y.sink.commit

        def y_commit(handle):
            # Y has decided batch 200; before its commit, the backfill X takes the log over (Y is
            # fenced: its decision stands and it goes on), decides batch 5, commits it and dies.
            if len(drivers) == 1:
                drivers.append(_backfill_decided_and_committed(t, log_url, qid, 5, ids(50, 51)))
            return commit(handle)

        y.sink.commit = y_commit  # type: ignore[method-assign]
        try:
            # Y commits batch 200, and its cleanup (abort_lingering) prunes markers below 200 - 100.
            assert y.batch(200, ids(2000)).action == "committed"
            assert len(drivers) == 2
            markers = _marker_batches(t)
            z = Driver(_sink(t), log_url, qid, takeover=True)
            drivers.append(z)
            action = z.batch(5, ids(50, 51)).action
        finally:
            for d in drivers:
                d.close()
        counts = _counts(t)
        assert counts[50] == 1 and counts[51] == 1, f"batch 5's rows: {counts}"   # was: 2 and 2 (voided)
        assert action == "recommitted"
        assert 5 in markers, "the backfill's marker (its only proof of commit) was pruned"
        assert t.prepared() == []


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_markers_of_committed_batches_below_the_retention_are_still_pruned(postgres_service, tmp_path):
    """Streaming as before: each batch's cleanup deletes the markers of COMMITTED batches older than
    ``marker_retention_batches`` (fails if the prune were simply disabled)."""
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "bfprune") as t:
        d = Driver(_sink(t, marker_retention_batches=2), log_url, batch_query_id("stream", _sink(t).target()))
        try:
            for b in range(6):
                assert d.batch(b, ids(b)).action == "committed"
        finally:
            d.close()
        assert _marker_batches(t) == [3, 4, 5]   # batch 5's cleanup pruned those below 5 - 2
        assert t.ids() == [0, 1, 2, 3, 4, 5]


class _SettledAt:
    """The log's evidence as a sink sees it (``ranges_below``), fixed: the real one is
    :class:`twophase.evidence.Settled`, given by the protocol in the Driver tests above."""

    def __init__(self, ranges):
        self.ranges = ranges

    def ranges_below(self, query_name, below):
        return [(a, min(b, below - 1)) for a, b in self.ranges if a < below]


@pytest.mark.postgres
def test_abort_lingering_prunes_only_the_markers_of_settled_batches_below_the_retention(postgres_service):
    """Batches 5, 7, 8, 9 committed at the target; the log shows 5 and 7 to 9 finished (6 absent),
    batch 3 of a backfill committed and not COMMITTED: batch 10's cleanup with retention 2 deletes the
    markers of 5 and 7 only (3 is kept: no evidence), another query's are never touched, and without
    evidence nothing goes (what test_postgres_sink's distance-only prune test expected before)."""
    import uuid

    from twophase.sinks.postgres import PostgresSink

    with PgTable(postgres_service["dsn"], "bfunit") as t:
        t.execute(f'ALTER TABLE "{t.name}" DROP CONSTRAINT "{t.name}_pkey"')
        sink = PostgresSink(t.dsn, table=t.name, marker_table=f"{t.name}_m", gid_prefix=t.gid_prefix,
                            marker_retention_batches=2)
        sink.open()
        name = f"prune-{uuid.uuid4().hex[:6]}"
        other = f"{name}-other"
        for n, b in ((name, 3), (name, 5), (name, 7), (name, 8), (name, 9), (other, 1)):
            h = run_attempt(sink, TransactionContext(n, b, 0, 0, sink.plan_batch(n, b, 1)), ids(b))
            assert sink.commit(h).done

        def markers(n):
            return sorted(r[0] for r in t.execute(f'SELECT batch_id FROM "{t.name}_m" WHERE query_name = %s',
                                                   (n,)))

        sink.abort_lingering(name, 10, sink.plan_batch(name, 10, 1), [])
        assert markers(name) == [3, 5, 7, 8, 9]   # no evidence: nothing pruned
        sink.abort_lingering(name, 10, sink.plan_batch(name, 10, 1), [], settled=_SettledAt([(0, 1), (5, 5),
                                                                                              (7, 9)]))
        assert markers(name) == [3, 8, 9]
        assert markers(other) == [1]
        sink.close()


def test_a_sink_given_no_evidence_prunes_no_marker():
    """``prunable_ranges`` without the log's evidence names nothing (the sink's prune then deletes nothing)."""
    from twophase.sinks._sql2pc import prunable_ranges

    assert prunable_ranges(None, "q.abcdefghg1", 500, 100) == []


# ------------------------------------------------ scenario 3, fix B: the log read after the verdict
@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_scenario_3_a_vanished_verdict_on_a_batch_the_log_shows_committed_is_not_a_void(postgres_service, tmp_path):
    """Defence in depth: whatever deleted a committed batch's markers, a "gone, never visible" verdict
    on a batch the log shows COMMITTED (read after the verdict) is never a void: the batch is skipped,
    its rows stay once.  Here the markers are deleted by hand between the recovery's read of what is
    pending and its commit, and COMMITTED lands meanwhile (another run finished the batch)."""
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "bf3b") as t:
        t.execute(f'ALTER TABLE "{t.name}" DROP CONSTRAINT "{t.name}_pkey"')
        qid = batch_query_id("daily", _sink(t).target())
        x = _backfill_decided_and_committed(t, log_url, qid, 5, ids(50, 51))
        z = Driver(_sink(t), log_url, qid, takeover=True)
        commit = z.sink.commit
        done: dict = {}

        def z_commit(handle):
            # Between Z's read of the pending batch and its commit: another run (X, resumed) writes
            # COMMITTED, and the markers go (pruned, or deleted by someone else).
            if not done:
                done["x"] = x.tlog.write(5, COMMITTED, {"rows": 2})
                t.execute(f'DELETE FROM "{t.name}_m"')
            return commit(handle)

        z.sink.commit = z_commit  # type: ignore[method-assign]
        try:
            assert z.batch(5, ids(50, 51)).action in ("skipped", "recommitted")
        finally:
            x.close()
            z.close()
        assert done
        counts = _counts(t)
        assert counts[50] == 1 and counts[51] == 1, f"batch 5's rows: {counts}"
        tlog = TransactionLog(log_url, readonly=True)
        tlog.generation = 1
        assert all(b.void is None for b in tlog.view(5).ballots)


# ------------------------------------------------------------------ mutant: the log's prune
def test_the_logs_prune_records_each_range_so_a_backfill_in_a_gap_is_not_refused(tmp_path):
    """Batches 1, 2, 3, 10 and 12 committed, a backfill of 5 pending (its INTENT written): a prune
    keeping one batch records [1, 3] and [10, 10], never [1, 10], and batch 5 is then decided and
    committed, not refused as pruned."""
    tlog = TransactionLog(str(tmp_path / "log"))
    tlog.acquire("q", "pipe")
    tlog.retain_batches = 1
    for b in (1, 2, 3, 10, 12):
        tlog.write(b, INTENT, {"intent": {}})
        assert tlog.mine(tlog.decide(b, 0, {"handles": []}))
        tlog.write(b, COMMITTED, {})
    tlog.write(5, INTENT, {"intent": {}})
    assert tlog.prune(12) > 0
    tlog.refuse_pruned(5, fresh=True)   # the mutant: PrunedBatchError
    assert tlog.pruned(fresh=True) == [[1, 3], [10, 10]]
    with pytest.raises(PrunedBatchError):
        tlog.refuse_pruned(10, fresh=True)
    assert tlog.mine(tlog.decide(5, 0, {"handles": []}))
    tlog.write(5, COMMITTED, {})
    assert tlog.view(5).committed is not None
    tlog.close()


# ------------------------------------- mutant: a late decision found while closing a ballot wins
def _late_ballot(a: Driver, batch_id: int, rows) -> list[dict]:
    """A (deposed, paused) writes its INTENT of ``batch_id`` (ballot 0) and pre-commits its task under it;
    its decision is still to come.  Returns its task results."""
    intent = a.sink.plan_batch(a.query_name, batch_id, 1)
    opened = a.tlog.write(batch_id, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                             "num_partitions": 1}, ballot=0)
    assert a.tlog.mine(opened)
    results = OneTask(a.sink, rows).prepare(a.query_name, batch_id, intent, f"e{a.tlog.epoch}late")
    a.sink.verify_prepared(batch_id, [a.sink.decode_handle(r["handle"]) for r in results], prepare_started_at=0)
    return results


def _decision_lands_before_the_close(a: Driver, b: Driver, batch_id: int, results: list[dict]) -> dict:
    """Hook B's log store: just before B's close of A's ballot 0 (an abort in its decision slot)
    lands, A's commit decision lands there first."""
    from twophase.log import PREPARED, _batch_name

    slot = _batch_name(int(b.tlog.generation or 0), batch_id, PREPARED, 0)
    create = b.tlog.store.create
    seen: dict = {}

    def b_create(name, data):
        if name == slot and not seen:
            seen["decided"] = a.tlog.decide(batch_id, 0, {"handles": [r["handle"] for r in results], "rows": 2,
                                                          "partitions": [0]})
        return create(name, data)

    b.tlog.store.create = b_create  # type: ignore[method-assign]
    return seen


def _assert_the_late_decision_was_committed(t: PgTable, a: Driver, b: Driver, batch_id: int,
                                            results: list[dict], action: str, seen: dict) -> None:
    assert seen and a.tlog.mine(seen["decided"]), "A's decision did not land first"
    assert action == "recommitted"
    # A resumes its commit step: its transaction was committed by B, never rolled back.
    Committer(a.sink, backoff=0.01).commit(batch_id, [a.sink.decode_handle(r["handle"]) for r in results],
                                           recovering=False)
    view = b.tlog.view(batch_id)
    assert [(x.ballot, x.committed, x.void is None) for x in view.ballots] == [(0, True, True)]
    assert view.committed is not None
    assert Counter(t.ids()) == Counter([1, 2, 3, 4, 5]) and t.prepared() == []


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_a_late_decision_landing_while_the_owner_closes_the_ballot_is_committed_protocol(postgres_service, tmp_path):
    """The owner B meets deposed A's late INTENT in its slot (the late-INTENT loop) and closes A's ballot;
    A's decision lands between B's view and B's close: B's close finds it, and it wins: committed once,
    never skipped, never rolled back and run again (twophase/protocol_recovery.py, ``_close_earlier_ballots``)."""
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "latedec") as t:
        a = Driver(t.sink(), log_url, "q")
        try:
            assert a.batch(0, ids(1, 2)).action == "committed"
            b = Driver(t.sink(), log_url, "q", takeover=True)
            try:
                assert b.batch(1, ids(3)).action == "committed"   # batch 2 is then B's fast path
                results = _late_ballot(a, 2, ids(4, 5))
                seen = _decision_lands_before_the_close(a, b, 2, results)
                action = b.batch(2, ids(4, 5)).action
                _assert_the_late_decision_was_committed(t, a, b, 2, results, action, seen)
            finally:
                b.close()
        finally:
            a.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_a_late_decision_landing_while_recovery_closes_the_ballot_is_committed_recovery(postgres_service, tmp_path):
    """B takes the log over while A's ballot of batch 2 is open; B's recovery closes it, and A's decision
    lands between recovery's read of what is pending and its close: committed once, never aborted
    (twophase/recovery.py, ``_close_open_ballots``)."""
    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "latedecr") as t:
        a = Driver(t.sink(), log_url, "q")
        try:
            assert a.batch(0, ids(1, 2)).action == "committed"
            assert a.batch(1, ids(3)).action == "committed"
            results = _late_ballot(a, 2, ids(4, 5))
            b = Driver(t.sink(), log_url, "q", takeover=True)
            try:
                seen = _decision_lands_before_the_close(a, b, 2, results)
                action = b.batch(2, ids(4, 5)).action
                _assert_the_late_decision_was_committed(t, a, b, 2, results, action, seen)
            finally:
                b.close()
        finally:
            a.close()


# ------------------------------------------------------------------ scenario 4 (PostgreSQL)
class _TwoSchemas:
    """Two schemas of the test database, each with a table of one name ``(id bigint PRIMARY KEY, v text)``,
    and a DSN per schema whose ``search_path`` is that schema alone (two roles' defaults, say)."""

    def __init__(self, dsn: str):
        import uuid

        import psycopg2

        tag = uuid.uuid4().hex[:8]
        self.schemas = [f"s4a_{tag}", f"s4b_{tag}"]
        self.table, self.gid_prefix, self.dsn = f"events_{tag}", f"t{tag[:7]}", dsn
        self.admin = psycopg2.connect(dsn)
        self.admin.autocommit = True
        for s in self.schemas:
            self.execute(f'CREATE SCHEMA "{s}"')
            self.execute(f'CREATE TABLE "{s}"."{self.table}" (id bigint PRIMARY KEY, v text)')

    def execute(self, statement: str, args: Any = None) -> list[tuple]:
        with self.admin.cursor() as cur:
            cur.execute(statement, args)
            return cur.fetchall() if cur.description else []

    def sink(self, i: int, *, explicit: bool = False):
        from twophase.sinks.postgres import PostgresSink

        s = self.schemas[i]
        if explicit:
            return PostgresSink(self.dsn, table=self.table, schema=s, marker_schema=s, gid_prefix=self.gid_prefix)
        return PostgresSink(f"{self.dsn} options='-c search_path={s}'", table=self.table, gid_prefix=self.gid_prefix)

    def ids(self, i: int) -> list[int]:
        return [r[0] for r in self.execute(f'SELECT id FROM "{self.schemas[i]}"."{self.table}" ORDER BY id')]

    def close(self) -> None:
        for gid, in self.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s",
                                 (self.gid_prefix, self.gid_prefix)):
            self.execute("ROLLBACK PREPARED %s", (gid,))
        for s in self.schemas:
            self.execute(f'DROP SCHEMA "{s}" CASCADE')
        self.admin.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_scenario_4_two_jobs_writing_same_named_tables_of_two_schemas_by_search_path_are_two_jobs(
        postgres_service, tmp_path):
    """Two batch jobs of one name and one log, each writing ``events`` resolved by its search_path to
    another schema: before, one batch query id, and the second job's batch 0 was skipped as committed
    (its rows never written).  Now two targets: the second job is refused on the first one's log."""
    from twophase.errors import QueryMismatchError

    log_url = str(tmp_path / "log")
    two = _TwoSchemas(postgres_service["dsn"])
    try:
        a_sink, b_sink = two.sink(0), two.sink(1)
        assert a_sink.target() != b_sink.target()
        # The same table named with its schema is the same job.
        assert a_sink.target() == two.sink(0, explicit=True).target()
        a = Driver(a_sink, log_url, batch_query_id("daily", a_sink.target()), takeover=True)
        try:
            assert a.batch(0, ids(1, 2)).action == "committed"
        finally:
            a.close()
        with pytest.raises(QueryMismatchError, match="Two jobs must not share one log"):
            Driver(b_sink, log_url, batch_query_id("daily", b_sink.target()), takeover=True)
        assert two.ids(0) == [1, 2] and two.ids(1) == []
    finally:
        two.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_scenario_4_a_log_bound_with_the_old_target_is_taken_over_by_the_first_job_and_refuses_the_second(
        postgres_service, tmp_path):
    """Upgrade: a log generation bound by an older version (the schema left out of the target) is taken
    over by the first job of that name that comes (its batches are its own: a committed batch is skipped),
    rebound to its precise target; the job of the other schema is refused, never silently skipped."""
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
        tlog = TransactionLog(log_url)
        tlog.acquire(batch_query_id("daily", a_sink.target()), "daily", takeover=True, target=a_sink.target())
        assert tlog.generation == 1 and tlog.view(0).committed is not None   # its own batch 0: skipped
        tlog.close()
        with pytest.raises(QueryMismatchError):
            TransactionLog(log_url).acquire(batch_query_id("daily", b_sink.target()), "daily", takeover=True,
                                            target=b_sink.target())
        assert two.ids(0) == [1, 2] and two.ids(1) == []
    finally:
        two.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_scenario_3_twophase_recover_does_not_void_a_batch_the_log_shows_committed_after_its_verdict(
        postgres_service, tmp_path):
    """``twophase recover``'s void path, the same defence: the markers gone and COMMITTED written by
    another run between recover's read of what is pending and its commit: not voided."""
    from twophase.recovery import recover

    log_url = str(tmp_path / "log")
    with PgTable(postgres_service["dsn"], "bf3r") as t:
        qid = batch_query_id("daily", _sink(t).target())
        x = _backfill_decided_and_committed(t, log_url, qid, 5, ids(50, 51))
        sink = _sink(t)
        sink.open()
        commit = sink.commit
        done: dict = {}

        def late_commit(handle):
            if not done:
                done["x"] = x.tlog.write(5, COMMITTED, {"rows": 2})
                t.execute(f'DELETE FROM "{t.name}_m"')
            return commit(handle)

        sink.commit = late_commit  # type: ignore[method-assign]
        try:
            report = recover(log_url, sink, takeover=True)
        finally:
            x.close()
        assert done and report.voided == []
        tlog = TransactionLog(log_url, readonly=True)
        tlog.generation = 1
        assert all(b.void is None for b in tlog.view(5).ballots)
        assert tlog.view(5).committed is not None
        assert Counter(t.ids()) == Counter([50, 51])
