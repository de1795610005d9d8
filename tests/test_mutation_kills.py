"""Small tests that kill mutants of the mutation gate (tests/mutation/mutants.toml) which no other fast
in-process test killed (issue 60).  Each passes on the real code and fails with its mutant applied:
``python -m tests.mutation --only <id>``; the mutant each one is for is named in its docstring."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter

import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids, run_attempt
from twophase import TransactionContext
from twophase.errors import CommitError, DataLossError, LogOwnershipError, TwoPhaseError
from twophase.log import COMMITTED, INTENT, TransactionLog
from twophase.protocol import BatchProgress
from twophase.recovery import Committer
from twophase.sink import CommitResult, TwoPhaseCommitSink


def test_a_live_holder_in_another_process_is_not_taken_over_by_this_one(tmp_path):
    """Mutant ``log-live-holder-taken-over``: a coordinator in this process asks for a log whose lease
    another process holds and heartbeats; it is refused (without takeover), never given the log."""
    url = str(tmp_path / "log")
    code = ("import sys, time; from twophase.log import TransactionLog\n"
            f"t = TransactionLog({url!r}); t.acquire('q-1', 'other')\n"
            "print('HELD', flush=True); sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "HELD"
        tlog = TransactionLog(url)
        with pytest.raises(LogOwnershipError, match="live coordinator"):
            tlog.acquire("q-1", "this")
        assert tlog.epoch is None
    finally:
        holder.communicate("", timeout=30)


def test_pruned_ranges_never_cover_a_batch_id_between_them(tmp_path):
    """Mutant ``log-merge-bridges-a-gap``: batches 1 and 3 committed and pruned, batch 2 never written
    (a backfill's id to come): the pruned ranges are [1, 1] and [3, 3], and batch 2 is not pruned."""
    tlog = TransactionLog(str(tmp_path / "log"), retain_batches=1)
    tlog.acquire("q", "pipe")
    for b in (1, 3, 5):
        tlog.write(b, INTENT, {"intent": {}})
        assert tlog.mine(tlog.decide(b, 0, {"handles": []}))
        tlog.write(b, COMMITTED, {})
    tlog.prune(5)
    assert tlog.pruned(fresh=True) == [[1, 1], [3, 3]]
    assert not tlog.is_pruned(2, fresh=True) and tlog.is_pruned(3, fresh=True)
    tlog.close()


class _LostSink(TwoPhaseCommitSink):
    """Each handle's commit answers what ``verdict`` says (no server: the committer's judgement)."""

    kind = "lost"

    def __init__(self, verdicts: dict[str, CommitResult]):
        self.verdicts = verdicts
        self.commits = 0

    def commit(self, handle):
        self.commits += 1
        return self.verdicts[handle["txn"]]

    def recover_and_abort(self, handle):  # pragma: no cover - not reached
        raise AssertionError("nothing is aborted here")

    def begin_transaction(self, ctx):  # pragma: no cover - driver side only here
        raise NotImplementedError

    def write(self, txn, batch):  # pragma: no cover
        raise NotImplementedError

    def pre_commit(self, txn):  # pragma: no cover
        raise NotImplementedError

    def abort(self, txn):  # pragma: no cover
        raise NotImplementedError


def test_a_transaction_the_target_reports_lost_is_data_loss_at_once_not_retried():
    """Mutant ``recovery-lost-handle-retried-as-transient``: a commit the target answers LOST (not
    proven never visible) is DataLossError at its first answer, never retried as if transient and
    then reported as a CommitError a restart would retry forever."""
    sink = _LostSink({"a": CommitResult.committed(), "b": CommitResult.lost("b expired")})
    committer = Committer(sink, retries=2, backoff=0.01, max_backoff=0.01)
    with pytest.raises(DataLossError, match="b expired") as caught:
        committer.commit(4, [{"txn": "a"}, {"txn": "b"}], recovering=False)
    assert not isinstance(caught.value, CommitError)
    assert sink.commits == 2  # each handle once: the lost one was not retried


def _file_rows(out) -> Counter:
    import json
    import os

    return Counter(json.loads(line)["id"] for p in os.listdir(out) if not p.startswith("_")
                   for line in open(out / p) if line.strip())


def test_a_coordinator_whose_ballot_the_owner_closed_commits_nothing_of_it(tmp_path):
    """Mutant ``protocol-lost-decision-taken-as-ours``: A opens batch 1's ballot and its task
    pre-commits; B takes the log over and runs batch 1 (closing A's ballot); A's decision then finds
    its slot closed: A stops, commits nothing, and batch 1's rows are there once."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    b = None
    try:
        assert a.batch(0, ids(1, 2)).action == "committed"
        prog = BatchProgress("pipe", 1, None, "committed")
        opened = a.protocol.open_ballot(1, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(a.sink, ids(3)).prepare(a.query_name, 1, opened.intent, opened.run)
        b = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
        assert b.batch(1, ids(3)).action == "committed"
        with pytest.raises(TwoPhaseError, match="was closed by another coordinator"):
            a.protocol.decide_and_commit(opened, results, prog)
        assert _file_rows(out) == Counter([1, 2, 3])
    finally:
        a.close()
        if b is not None:
            b.close()


def test_an_older_coordinator_leaves_a_newer_owners_open_ballot_open(tmp_path):
    """Mutant ``protocol-newer-owners-ballot-closed``: A (recovering, so it reads the batch's view)
    finds batch 1's ballot 0 opened by B, a newer owner that took the log over after A's recovery: A
    stops without closing it (B runs the batch), rather than closing B's ballot and aborting B's work."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    held: dict = {}
    view = a.tlog.view

    def a_view(batch_id, generation=None):
        if batch_id == 1 and not held:  # after A's recovery, before A reads batch 1: B takes over, opens ballot 0
            b = held["b"] = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
            intent = b.sink.plan_batch(b.query_name, 1, 1)
            assert b.tlog.mine(b.tlog.write(1, INTENT, {"intent": intent, "sink": b.sink.kind, "name": b.query_name,
                                                        "num_partitions": 1}, ballot=0))
        return view(batch_id, generation)

    try:
        assert a.batch(0, ids(1)).action == "committed"
        a.protocol.dirty = True  # A reads the view of batch 1 (no fast path)
        a.tlog.view = a_view  # type: ignore[method-assign]
        with pytest.raises(LogOwnershipError, match="newer than this one"):
            a.batch(1, ids(2))
        ballots = held["b"].tlog.view(1).ballots
        assert [(x.ballot, x.decision) for x in ballots] == [(0, None)]  # B's ballot: still open, B's to decide
    finally:
        a.close()
        if "b" in held:
            held["b"].close()


def _decided(driver: Driver, batch_id: int, ballot: int, rows) -> list[dict]:
    """``driver`` opens ``ballot`` of ``batch_id`` (its INTENT), runs its task and decides it; the handles."""
    intent = driver.sink.plan_batch(driver.query_name, batch_id, 1)
    assert driver.tlog.mine(driver.tlog.write(batch_id, INTENT, {"intent": intent, "sink": driver.sink.kind,
                                                                 "name": driver.query_name, "num_partitions": 1},
                                              ballot=ballot))
    results = OneTask(driver.sink, rows).prepare(driver.query_name, batch_id, intent, f"e{driver.tlog.epoch}b{ballot}")
    handles = [r["handle"] for r in results]
    assert driver.tlog.mine(driver.tlog.decide(batch_id, ballot, {"handles": handles, "rows": rows.num_rows}))
    return handles


def test_a_failed_ballot_whose_slot_holds_a_decision_keeps_its_transactions(tmp_path):
    """Mutant ``protocol-abort-only-after-close``: a ballot's failure handling closes its slot and aborts
    its names only if the slot then says abort.  Here the slot holds a commit decision (the data source
    form's commit step landed first): nothing of the ballot is aborted, and the decision commits whole."""
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, ids(1)).action == "committed"
        prog = BatchProgress("pipe", 1, None, "committed")
        opened = a.protocol.open_ballot(1, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(a.sink, ids(2, 3)).prepare(a.query_name, 1, opened.intent, opened.run)
        handles = [r["handle"] for r in results]
        assert a.tlog.mine(a.tlog.decide(1, opened.number, {"handles": handles, "rows": 2}))
        a.protocol.give_up(opened, RuntimeError("the driver's own step failed after the decision landed"))
        assert not a.tlog.view(1).ballots[0].decision.aborted
        Committer(a.sink, backoff=0.01).commit(1, [a.sink.decode_handle(h) for h in handles], recovering=True)
        assert _file_rows(out) == Counter([1, 2, 3])
    finally:
        a.close()


def test_a_void_decision_is_no_decision_and_the_batch_runs_again(tmp_path):
    """Mutant ``log-void-decision-still-committed``: batch 1's decision is proved void (its transaction
    gone, never visible) and recorded so; the batch is then undecided and runs again in a new ballot,
    its rows once."""
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, ids(1)).action == "committed"
        handles = _decided(a, 1, 0, ids(2))
        a.sink.recover_and_abort(a.sink.decode_handle(handles[0]))  # gone, never visible
        a.tlog.void_ballot(1, 0, "its transaction is gone and was never visible")
        assert a.tlog.view(1).decision is None
        a.protocol.dirty = True
        assert a.batch(1, ids(2)).action == "committed"
        assert [(x.ballot, x.committed) for x in a.tlog.view(1).ballots] == [(0, False), (1, True)]
        assert _file_rows(out) == Counter([1, 2])
    finally:
        a.close()


def test_a_batch_never_pruned_is_never_forgotten(tmp_path):
    """Mutant ``log-forget-unpruned-batch``: ``forget_pruned`` (recovery's cleanup of a deposed writer's
    late records in a pruned batch) refuses a batch that was not pruned, and its decision stays."""
    from twophase.errors import LogError

    tlog = TransactionLog(str(tmp_path / "log"))
    tlog.acquire("q", "pipe")
    tlog.write(3, INTENT, {"intent": {}})
    assert tlog.mine(tlog.decide(3, 0, {"handles": [{"h": 1}]}))
    with pytest.raises(LogError, match="was not pruned"):
        tlog.forget_pruned(3)
    assert tlog.view(3).decision is not None
    tlog.close()


def _vanished(batch_id: int, generation: int | None, ballot: int):
    from twophase.errors import BatchVanishedError

    e = BatchVanishedError(f"batch {batch_id}: every transaction gone", batch_id=batch_id)
    e.generation, e.ballot = generation, ballot
    return e


def test_a_vanished_verdict_on_another_batch_voids_nothing_of_this_one(tmp_path):
    """Mutant ``protocol-void-of-a-batch-not-being-replayed``: while batch 2 (decided) is run, recovery
    finds batch 1's decision vanished.  Batch 1 is not the batch Spark replays, so that stays data loss
    (not voided), and batch 2's decision is never voided for it."""
    from twophase.sinks.files import FileSink

    a = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        _decided(a, 1, 0, ids(1))
        _decided(a, 2, 0, ids(2))
        assert a.protocol._void(2, _vanished(1, a.tlog.generation, 0)) is False
        assert [x.void for x in a.tlog.view(2).ballots] == [None] and a.tlog.view(2).decision is not None
    finally:
        a.close()


def test_a_vanished_verdict_on_a_void_ballot_never_voids_the_batchs_new_decision(tmp_path):
    """Mutant ``protocol-void-of-another-ballot``: batch 1's ballot 0 was voided and ballot 1 decided
    since (another run); a vanished verdict on ballot 0 arriving now (a late committer's) voids nothing:
    ballot 1's decision stands."""
    from twophase.sinks.files import FileSink

    a = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        _decided(a, 1, 0, ids(1))
        a.tlog.void_ballot(1, 0, "gone")
        _decided(a, 1, 1, ids(1))
        assert a.protocol._void(1, _vanished(1, a.tlog.generation, 0)) is False
        assert [x.void is None for x in a.tlog.view(1).ballots] == [False, True]
        assert a.tlog.view(1).decision is not None and a.tlog.view(1).decision.ballot == 1
    finally:
        a.close()


def test_the_logs_evidence_settles_only_its_own_names_and_only_the_batches_it_holds(tmp_path):
    """Mutants ``evidence-another-logs-name-settled`` and ``evidence-settled-open-above``: a log with batches
    1 and 2 COMMITTED and 4 decided settles exactly 1 and 2 of its own scoped name; a name scoped by
    another log (another pipeline sharing the target) and batches above or between are never settled
    (a sink's cleanup would destroy their evidence or staged work)."""
    from twophase.evidence import Settled

    mine = TransactionLog(str(tmp_path / "log"))
    mine.acquire("q", "pipe")
    other = TransactionLog(str(tmp_path / "other"))
    other.acquire("q", "pipe")
    for b in (1, 2, 4):
        mine.write(b, INTENT, {"intent": {}})
        assert mine.mine(mine.decide(b, 0, {"handles": []}))
    mine.write(1, COMMITTED, {})
    mine.write(2, COMMITTED, {})
    settled = Settled(mine)
    name, foreign = f"pipe.{mine.scope()}", f"pipe.{other.scope()}"
    assert settled(name, 1) and settled(name, 2)
    assert not settled(name, 3) and not settled(name, 4) and not settled(name, 50)
    assert settled.ranges(name) == [(1, 2)]
    assert not settled(foreign, 1) and settled.ranges(foreign) == [] and settled.generation_of(foreign) is None
    mine.close()
    other.close()


@pytest.mark.mysql
@pytest.mark.timeout(300)
def test_mysql_a_branch_rolled_back_before_the_decision_is_refused_not_decided(mariadb_service):
    """Mutant ``mysql-verify-ignores-gone``: a prepared branch someone rolled back (an operator, another
    run cleaning up) before the decision fails the batch undecided (it runs again), never decided and
    then found lost."""
    from tests.test_mysql_overlaps import MyTable

    with MyTable(mariadb_service, "gonebranch") as t:
        sink = t.sink()
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent, "r1", task_attempt_id=1), ids(1))
        t.q("XA ROLLBACK %s, %s", (h["gtrid"], h["bqual"]))
        with pytest.raises(TwoPhaseError, match="no longer exist"):
            sink.verify_prepared(0, [h], prepare_started_at=0)
        sink.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_postgres_a_transaction_a_retried_task_doomed_is_refused_by_the_decision(postgres_service):
    """Mutant ``postgres-decided-claim-overrides-doomed``: a retried attempt of the partition claims its
    earlier attempt's transaction doomed (and rolls it back); the driver's decided claim then loses,
    and the decision is refused for that reason (not decided over the doomed claim)."""
    with PgTable(postgres_service["dsn"], "doomedgid") as t:
        sink = t.sink()
        sink.open()
        intent = sink.plan_batch("q", 1, 1)
        h0 = run_attempt(sink, TransactionContext("q", 1, 0, 0, intent, "r2", task_attempt_id=20), ids(2))
        h1 = run_attempt(sink, TransactionContext("q", 1, 0, 1, intent, "r2", task_attempt_id=21), ids(2))
        with pytest.raises(TwoPhaseError, match="doomed by a retried task"):
            sink.verify_prepared(1, [h0], prepare_started_at=0)
        assert sink.commit(h1).done and t.ids() == [2]
        sink.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_postgres_a_gone_transaction_whose_marker_table_is_missing_is_lost_not_never_visible(postgres_service):
    """Mutant ``postgres-missing-marker-table-read-as-never-visible``: a decided transaction gone at the
    target, its marker table dropped: its commit cannot be proven either way, so it is lost (data loss
    reported), never "never visible" (which would void the batch and write it again)."""
    from twophase.sink import CommitOutcome

    with PgTable(postgres_service["dsn"], "nomarkers") as t:
        sink = t.sink()
        sink.open()
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1), "r1"), ids(1))
        t.execute("ROLLBACK PREPARED %s", (h["gid"],))
        t.execute(f'DROP TABLE "{t.name}_m"')
        res = sink.commit(h)
        assert res.outcome is CommitOutcome.LOST and not res.never_visible, res
        sink.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_postgres_a_cleanup_keeps_the_claims_of_decided_transactions_still_prepared(postgres_service):
    """Mutant ``postgres-drop-claims-of-prepared-gids``: batch 0's transaction is decided (claimed so)
    and not yet committed; two cleanups of batch 1 (another run's) leave it alone: its decided claim
    stays, so the second cleanup cannot doom and roll it back."""
    with PgTable(postgres_service["dsn"], "keepclaims") as t:
        sink = t.sink()
        sink.open()
        h = run_attempt(sink, TransactionContext("q", 0, 0, 0, sink.plan_batch("q", 0, 1), "r1"), ids(1))
        sink.verify_prepared(0, [h], prepare_started_at=0)
        for _ in range(2):
            sink.abort_lingering("q", 1, sink.plan_batch("q", 1, 1), [])
        assert t.execute(f'SELECT state FROM "{t.name}_m_claims" WHERE gid = %s', (h["gid"],)) == [("decided",)]
        assert h["gid"] in t.prepared()
        assert sink.commit(h).done and t.ids() == [1]
        sink.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_postgres_a_retried_task_never_rolls_back_its_earlier_attempt_once_decided(postgres_service):
    """Mutant ``postgres-earlier-attempts-rolled-back-unclaimed``: attempt 0's transaction is claimed
    decided by the driver; the partition's retried attempt 1 takes it for its own earlier attempt but
    cannot claim it doomed, so it leaves it prepared, and the decision commits it."""
    with PgTable(postgres_service["dsn"], "decidedfirst") as t:
        sink = t.sink()
        sink.open()
        intent = sink.plan_batch("q", 0, 1)
        h0 = run_attempt(sink, TransactionContext("q", 0, 0, 0, intent, "r1", task_attempt_id=10), ids(1))
        sink.verify_prepared(0, [h0], prepare_started_at=0)
        h1 = run_attempt(sink, TransactionContext("q", 0, 0, 1, intent, "r1", task_attempt_id=11), ids(2))
        assert h0["gid"] in t.prepared()
        assert sink.commit(h0).done
        sink.recover_and_abort(h1)
        assert t.ids() == [1]
        sink.close()


@pytest.mark.postgres
@pytest.mark.timeout(300)
def test_postgres_a_cleanup_of_an_older_batch_never_touches_a_later_batchs_transactions(postgres_service):
    """Mutant ``sql2pc-later-batches-taken-as-late``: a backfill of batch 5 cleans up while another run's
    batch 7 has a transaction prepared (its tasks done, its decision to come): the cleanup takes only
    this ballot's and earlier batches' leftovers, never batch 7's."""
    with PgTable(postgres_service["dsn"], "laterbatch") as t:
        sink = t.sink()
        sink.open()
        h7 = run_attempt(sink, TransactionContext("q", 7, 0, 0, sink.plan_batch("q", 7, 1), "r7"), ids(7))
        sink.abort_lingering("q", 5, sink.plan_batch("q", 5, 1), [])
        assert t.prepared() == [h7["gid"]]
        assert sink.commit(h7).done and t.ids() == [7]
        sink.close()


def test_the_harness_reports_a_row_committed_twice_within_a_few_examples(tmp_path):
    """Mutant ``conformance-blind-to-duplicates`` (test_conformance's own test kills it too, after 200
    examples, minutes): a sink whose commit is not idempotent is reported within 10 examples, by the
    duplicate-row check ("row N appears K times")."""
    import re

    from tests.test_conformance import NonIdempotentCommitSink, _fail

    msg = _fail(NonIdempotentCommitSink, str(tmp_path / "db"), max_examples=10)
    assert re.search(r"row \d+ appears \d+ times", msg), msg


def test_the_harness_reports_rows_of_a_decided_batch_that_never_appear(tmp_path):
    """Mutant ``conformance-blind-to-missing-rows``: a sink whose commit reports success but whose
    rows then vanish (nothing twice, nothing early, nothing left open) is caught by the check that every
    decided batch's rows are visible."""
    from examples.sqlite_sink import SQLiteSink, _closing, quote
    from tests.test_conformance import _fail

    class LosesRowsAfterCommit(SQLiteSink):
        def commit(self, handle):
            res = super().commit(handle)
            with _closing(self._connect()) as con:
                con.execute(f"DELETE FROM {quote(self.table)}")
            return res

    msg = _fail(LosesRowsAfterCommit, str(tmp_path / "db"), max_examples=10)
    assert "missing although its batch was decided" in msg, msg


def test_the_harness_reports_an_abort_that_leaves_its_transaction_open_within_a_few_examples(tmp_path):
    """Mutant ``conformance-blind-to-abort-leftovers`` (test_conformance's own test kills it too, after 200
    examples): a sink whose abort() does nothing is reported within 10 examples, by the check that an
    aborted attempt leaves nothing open."""
    from tests.test_conformance import NoopAbortSink, _fail

    msg = _fail(NoopAbortSink, str(tmp_path / "db"), max_examples=10)
    assert "was aborted, but it left 1 transaction(s) open" in msg, msg


def _ownership_check(monkeypatch, url: str, seen: list[int], handles: dict[str, list[int]],
                     left_open: tuple[str, ...] = ()) -> str:
    """Run the ownership harness's exact check (``OwnershipMachine._check``) over the log at ``url``,
    with a reader that sees ``seen``; ``handles``: the rows each handle ``{"h": key}`` carries.  Returns
    the ConformanceError's message ("" if it passed).  ``left_open``: transactions the target shows open."""
    import json

    from twophase.testing import _ownership_checks, ownership
    from twophase.testing.conformance import ConformanceError

    # hypothesis' note, outside a run here (patched where OwnershipMachine._check reads it)
    monkeypatch.setattr(_ownership_checks, "note", lambda *a, **k: None)
    m = object.__new__(ownership.OwnershipMachine)
    m.urls, m.late, m.rows, m.owner, m.protocol_factory = [url], {}, {}, None, "TwoPhaseProtocol"
    m.handle_rows = {json.dumps({"h": k}, sort_keys=True): ids for k, ids in handles.items()}
    m.id_base, m.id_of, m.read_committed, m.settle_timeout = 1000, int, lambda: list(seen), 0
    m.pending, m.pending_baseline = (lambda: set(left_open)), set()
    try:
        m._check("after the example", exact=True, final=True)
    except ConformanceError as e:
        return str(e)
    return ""


def _opened_and_decided(tlog: TransactionLog, batch_id: int, ballot: int, key: str, decider=None) -> None:
    tlog.write(batch_id, INTENT, {"intent": {}}, ballot=ballot)
    decider = decider or tlog
    assert decider.mine(decider.decide(batch_id, ballot, {"handles": [{"h": key}]}))


def test_the_ownership_checker_reports_rows_missing_or_twice(tmp_path, monkeypatch):
    """Mutants ``ownership-blind-to-missing-rows`` and ``ownership-blind-to-duplicates``: over a log whose
    batch 1 is decided with rows 1001 and 1002, a reader seeing each once passes; seeing 1001 only, or
    1001 twice, fails naming the row."""
    url = str(tmp_path / "log")
    tlog = TransactionLog(url)
    tlog.acquire("q", "pipe")
    _opened_and_decided(tlog, 1, 0, "a")
    rows = {"a": [1001, 1002]}
    assert _ownership_check(monkeypatch, url, [1001, 1002], rows) == ""
    assert "row 1002 is missing although the log decided its batch" in _ownership_check(monkeypatch, url, [1001], rows)
    assert "row 1001 appears 2 times" in _ownership_check(monkeypatch, url, [1001, 1001, 1002], rows)
    # Mutant ``ownership-blind-to-leftovers``: a transaction still open at the end is named.
    assert "1 transaction(s) still open at a quiescent point: ['q:1:x']" in _ownership_check(
        monkeypatch, url, [1001, 1002], rows, left_open=("q:1:x",))
    tlog.close()


def test_the_ownership_checker_reports_two_decisions_and_a_decision_by_another_coordinator(tmp_path, monkeypatch):
    """Mutants ``ownership-blind-to-two-decisions`` and ``ownership-blind-to-a-decision-by-another-epoch``:
    batch 1 decided in ballots 0 and 1 (a decision written twice), and batch 2's ballot decided by a
    coordinator that did not open it (a deposed one whose INTENT was not the ballot's): each is named,
    even with every row visible once."""
    url = str(tmp_path / "log")
    a = TransactionLog(url)
    a.acquire("q", "pipe")
    _opened_and_decided(a, 1, 0, "a")
    _opened_and_decided(a, 1, 1, "b")
    b = TransactionLog(url)
    b.acquire("q", "pipe", takeover=True)
    a.write(2, INTENT, {"intent": {}}, ballot=0)
    assert b.mine(b.decide(2, 0, {"handles": [{"h": "c"}]}))
    msg = _ownership_check(monkeypatch, url, [1001, 1002, 1003], {"a": [1001], "b": [1002], "c": [1003]})
    assert "batch 1 (log" in msg and "has 2 commit decisions (ballots [0, 1])" in msg, msg
    assert "batch 2 ballot 0" in msg and "holds a commit decision by epoch" in msg, msg
    a.close()
    b.close()


def _staged(sink, envelopes) -> list[str]:
    """The staged files of a FileSink's handle envelopes that are still there."""
    import os

    return [e["staging"] for env in envelopes for e in sink._entries(sink.decode_handle(env))
            if os.path.exists(e["staging"])]


def test_a_commit_of_our_own_decision_that_finds_part_of_it_gone_is_data_loss(tmp_path):
    """Mutant ``a01-protocol-loss-after-decision-swallowed``: our ballot of batch 1 is decided, then its
    staged file is deleted (an operator, a cleanup) before the commit: the file is neither staged nor
    published, and the log does not show the batch finished, so the commit raises DataLossError, never
    returns as if another run had committed it."""
    import os

    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, ids(1)).action == "committed"
        prog = BatchProgress("pipe", 1, None, "committed")
        opened = a.protocol.open_ballot(1, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(a.sink, ids(2)).prepare(a.query_name, 1, opened.intent, opened.run)
        staged = _staged(a.sink, [r["handle"] for r in results])
        assert len(staged) == 1
        os.remove(staged[0])
        with pytest.raises(DataLossError, match="neither the staged file"):
            a.protocol.decide_and_commit(opened, results, prog)
        assert a.tlog.view(1).committed is None and _file_rows(out) == Counter([1])
    finally:
        a.close()


def test_recovery_that_finds_part_of_a_decided_batch_gone_reports_data_loss_at_once(tmp_path, caplog):
    """Mutant ``a02-protocol-recovery-loss-swallowed``: batch 1 is decided and its staged file deleted
    before any commit; the log does not show it finished.  Recovery raises DataLossError at the sink's
    first verdict and never logs it as 'not data loss' (the mutant logged that, then retried the batch)."""
    import logging
    import os

    from twophase.sinks.files import FileSink

    a = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, ids(1)).action == "committed"
        handles = _decided(a, 1, 0, ids(2))
        for path in _staged(a.sink, handles):
            os.remove(path)
        caplog.set_level(logging.WARNING)
        with pytest.raises(DataLossError) as caught:
            a.protocol.recover()
        assert caught.value.batch_id == 1
        assert not [r for r in caplog.records if "not data loss" in r.getMessage()]
        assert a.tlog.view(1).committed is None
    finally:
        a.close()


def test_recovery_aborts_the_transactions_of_a_ballot_it_closed(tmp_path):
    """Mutant ``a10-recovery-closed-ballot-leftovers-kept``: A opens batch 1's ballot, its task
    pre-commits, and A dies undecided.  B takes the log over; its recovery closes the ballot (abort)
    and aborts what it left: the staged file is gone (else held forever: a lock, or a stall)."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    b = None
    try:
        assert a.batch(0, ids(1)).action == "committed"
        prog = BatchProgress("pipe", 1, None, "committed")
        opened = a.protocol.open_ballot(1, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(a.sink, ids(2)).prepare(a.query_name, 1, opened.intent, opened.run)
        left = [r["handle"] for r in results]
        assert _staged(a.sink, left)
        b = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
        b.protocol.dirty = True
        b.protocol.recover()
        assert [x.decision is not None and x.decision.aborted for x in b.tlog.view(1).ballots] == [True]
        assert _staged(b.sink, left) == []
        assert _file_rows(out) == Counter([1])
    finally:
        a.close()
        if b is not None:
            b.close()


def test_recovery_of_a_decided_batch_aborts_what_its_closed_ballots_left(tmp_path):
    """Mutant ``a11-recovery-decided-batch-closed-ballots-kept``: batch 1's ballot 0 pre-committed a
    transaction and was closed (abort) by a coordinator that died before aborting it; ballot 1 was then
    decided.  Recovery commits ballot 1 and aborts ballot 0's leftover: its staged file is gone and
    only ballot 1's rows are visible."""
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, ids(1)).action == "committed"
        intent0 = a.sink.plan_batch(a.query_name, 1, 1)
        assert a.tlog.mine(a.tlog.write(1, INTENT, {"intent": intent0, "sink": a.sink.kind, "name": a.query_name,
                                                    "num_partitions": 1}, ballot=0))
        results = OneTask(a.sink, ids(2)).prepare(a.query_name, 1, intent0, f"e{a.tlog.epoch}b0")
        left = [r["handle"] for r in results]
        a.tlog.close_ballot(1, 0, "closed by a coordinator that then died")
        _decided(a, 1, 1, ids(2))
        assert _staged(a.sink, left)
        a.protocol.dirty = True
        a.protocol.recover()
        assert a.tlog.view(1).committed is not None
        assert _staged(a.sink, left) == []
        assert _file_rows(out) == Counter([1, 2])
    finally:
        a.close()


def test_recovery_aborts_a_deposed_coordinators_late_decision_in_a_pruned_batch(tmp_path):
    """Mutant ``a13-recovery-late-decision-handles-kept``: A's INTENT of batch 1 lands, then B takes the
    log over and runs batches 1-4, pruning batch 1.  A's task pre-commits late, A's decision lands in
    the pruned batch's free slot and A dies before it can see the batch pruned.  B's recovery aborts
    that decision's transaction (its staged file gone) and forgets the records, never committing it."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    b = None
    try:
        assert a.batch(0, ids(1)).action == "committed"
        intent = a.sink.plan_batch(a.query_name, 1, 1)
        assert a.tlog.mine(a.tlog.write(1, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                                    "num_partitions": 1}))
        b = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
        b.tlog.retain_batches = 1
        for n in (1, 2, 3, 4):
            assert b.batch(n, ids(10 * n)).action == "committed"
        assert b.tlog.is_pruned(1, fresh=True)
        late = OneTask(a.sink, ids(99)).prepare(a.query_name, 1, intent, f"e{a.tlog.epoch}late")
        handles = [r["handle"] for r in late]
        assert a.tlog.mine(a.tlog.decide(1, 0, {"handles": handles, "rows": 1}))  # then A dies
        assert _staged(b.sink, handles)
        b.protocol.dirty = True
        b.protocol.recover()
        assert _staged(b.sink, handles) == []
        assert b.tlog.view(1).ballots == []
        assert _file_rows(out) == Counter([1, 10, 20, 30, 40])
    finally:
        a.close()
        if b is not None:
            b.close()


def test_two_handles_for_one_partition_are_refused_before_any_decision():
    """Mutant ``a20-coordinator-two-handles-per-partition``: the tasks' results hold two successful
    attempts of partition 0 (speculation, a retried task both of whose attempts pre-committed): the
    coordinator's results check refuses them; both decided would write the partition twice."""
    import json

    from twophase.coordinator.coordinator import Coordinator

    def row(partition: int, attempt: int) -> dict:
        return {"partition": partition, "attempt": attempt, "rows": 1, "handle": json.dumps({"h": attempt})}

    ok = Coordinator._results(3, [row(1, 0), row(0, 2)])
    assert [(r["partition"], r["attempt"]) for r in ok] == [(0, 2), (1, 0)]
    with pytest.raises(TwoPhaseError, match="partition 0 returned two handles"):
        Coordinator._results(3, [row(0, 0), row(1, 0), row(0, 1)])
