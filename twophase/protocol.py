"""The commit protocol of one batch, without Spark: docs/design.md's protocol section as code.

For batch N, as the owner of the transaction log (twophase/log.py) sees it:

1-2. N COMMITTED: nothing to do.  N decided (a ballot's slot holds a commit decision) but
     not COMMITTED: commit its handles again (idempotent), log COMMITTED.
3.   Otherwise close every open ballot of N (its slot gets an *abort*, by the same exclusive
     create a late commit decision would need: whichever lands first wins, and a late commit
     found here is committed, never overruled), abort what the closed ballots named, and open
     a ballot of our own: INTENT (the sink's plan for this ballot's transaction names).
4.   Run the tasks (:meth:`BatchWork.prepare`: each partition begins, writes and pre-commits),
     check the handles are still pre-committed, read the source offsets, then the decision:
     fill our ballot's slot with the handles.  Refused (someone closed our ballot first): abort
     our own handles only and stop; the owner re-runs N.  A failure before the decision closes
     our ballot first and aborts only its names.
5-6. Commit every handle (in parallel, with retries; a commit that can never succeed raises
     :class:`~twophase.errors.DataLossError`), abort the batch's failed task attempts, log
     COMMITTED.

Nothing here imports Spark: :class:`BatchWork` is what an engine supplies (the coordinator's
Spark glue in ``twophase.coordinator``, or a test harness that runs tasks in-process, late and
twice).  Recovery before a batch (after a start or a failure) is
:func:`twophase.recovery.recover_pending`, which closes open ballots the same way.

Where the code lives: this module holds :class:`TwoPhaseProtocol` and its steps of a batch
(opening a ballot, running the tasks, the decision, the commit, a void decision);
:mod:`twophase.protocol_recovery` its base class: its state, recovery between batches, and the
ballots it closes, gives up or refuses; :mod:`twophase.protocol_model` what an engine supplies
and gets back (:class:`BatchWork`, :class:`BatchProgress`, :class:`OpenedBallot`).  Every name
that was importable from here still is.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from twophase import crash
from twophase.errors import (
    BatchVanishedError,
    CommitError,
    DataLossError,
    LogOwnershipError,
    TransactionTakenError,
    TwoPhaseError,
)
from twophase.errors import PrunedBatchError as PrunedBatchError
from twophase.evidence import Settled
from twophase.log import COMMITTED, INTENT, BatchView
from twophase.log import TransactionLog as TransactionLog
from twophase.log import parse_batch_name as parse_batch_name
from twophase.protocol_model import BatchProgress, BatchWork, OpenedBallot, _InBackground
from twophase.protocol_recovery import _ProtocolRecovery
from twophase.recovery import Committer as Committer
from twophase.recovery import closer_for as closer_for
from twophase.recovery import finished_after_all
from twophase.recovery import forgetter_for as forgetter_for
from twophase.recovery import pending_batches as pending_batches
from twophase.recovery import recover_pending as recover_pending
from twophase.sink import TwoPhaseCommitSink as TwoPhaseCommitSink
from twophase.sink import abort_lingering, sweep_late

log = logging.getLogger("twophase.protocol")


#: Late INTENTs of deposed coordinators one batch closes before it stops (each is another
#: coordinator's write landing in the slot this one was about to take).
_MAX_LATE_INTENTS = 3

#: Decisions of one batch proved void in one call before the batch fails (each void means the
#: target aborted a whole decided batch: something is wrong beyond a one-off timeout).
_MAX_VOIDS = 2

#: Ballots of one batch the owner runs again, in one call, because a later plan (a deposed
#: coordinator's, landing late) kept their tasks from writing (see
#: :meth:`~twophase.sink.TwoPhaseCommitSink.plan_superseded`), because another actor aborted one
#: of its transactions before the decision (:class:`~twophase.errors.TransactionTakenError`), or
#: because the work says its next ballot avoids what failed (:meth:`BatchWork.run_again`).  A
#: deposed coordinator plans at most once more before its INTENT is refused, so one re-run is the
#: rule.
_MAX_REPLANS = 2


class _RunAgain(Exception):
    """Our ballot failed before its decision, and a new ballot would not fail the same way:
    a later plan moved the sink's plan fence, or the work changes how its tasks run."""

    def __init__(self, batch_id: int, ballot: int, cause: BaseException, reason: str):
        super().__init__(f"batch {batch_id}: ballot {ballot} runs again ({reason}): {cause}")
        self.batch_id, self.ballot, self.cause, self.reason = batch_id, ballot, cause, reason


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class TwoPhaseProtocol(_ProtocolRecovery):
    """One log owner's protocol: the steps of a batch, and recovery between batches.

    ``name`` labels logs and errors; ``query_name`` is what the sink sees (the coordinator's
    name scoped by the log's identity and generation).  ``committer`` commits a batch's handles.
    ``dirty`` means: run the recovery routine before the next batch (at the start, and after
    any batch failed).
    """

    # ------------------------------------------------------------------ a batch
    def run_batch(self, batch_id: int, work: BatchWork, prog: BatchProgress) -> None:
        """Make batch ``batch_id`` visible exactly once; fills ``prog`` (its ``action`` says what
        happened: committed now, recommitted from an earlier decision, or skipped)."""
        try:
            voided = replanned = 0
            while True:
                try:
                    self._run_batch(batch_id, work, prog)
                    return
                except BatchVanishedError as e:
                    if voided == _MAX_VOIDS or not self._void(batch_id, e):
                        raise
                    voided += 1
                except _RunAgain as e:
                    if replanned == _MAX_REPLANS:
                        raise e.cause from None  # the tasks' own error, its traceback as it was
                    replanned += 1
                    log.warning("%s: batch %d: ballot %d failed: %s; the ballot is closed. Running the batch "
                                "again in a new ballot.", self.name, batch_id, e.ballot, e.reason)
        except BaseException:
            self.dirty = True  # before the next batch: finish (or report) whatever this one left
            self._last_committed = None
            raise

    def _void(self, batch_id: int, e: BatchVanishedError) -> bool:
        """Beyond Flink (which fails or drops such a batch): the batch being run was decided, but
        every transaction of its decision is gone and the sink proved none of it was ever visible.
        Record that decision as void and run the batch again in a new ballot.  Only the batch
        Spark is replaying (its rows are at hand) of this generation; anything else stays data loss.

        Also True, with nothing voided, when the log read now shows the batch finished after all
        (:func:`~twophase.recovery.finished_after_all`): its evidence at the sink was pruned after
        another run committed it.  The caller runs the batch again, which reads the log and skips it
        (or is refused as pruned): never written twice.  Chosen over a DataLossError: COMMITTED is
        written only after every handle's commit returned, so nothing is lost, and a pipeline must
        not stop over a batch the log proves done (the same record skips it on any other replay)."""
        if e.batch_id is not None:
            # rule: a void needs the log's word that the batch is not finished, read after the sink's
            # verdict (a marker row is pruned only after its batch's COMMITTED record is written).
            finished = finished_after_all(self.tlog, int(e.batch_id), e.generation)
            if finished is not None:
                log.warning("%s: batch %d: its transactions are gone and the sink shows none of it visible, but "
                            "the log shows it %s (another run committed it and its evidence at the sink was "
                            "pruned): not void, not written again", self.name, e.batch_id, finished)
                self.dirty = True
                return True
        if e.batch_id != batch_id or e.generation not in (None, self.tlog.generation):
            return False
        decided = next((b for b in self.tlog.view(batch_id).ballots if b.committed), None)
        if decided is None or (e.ballot is not None and e.ballot != decided.ballot):
            return False
        self.tlog.void_ballot(batch_id, decided.ballot, str(e))
        log.warning("%s: batch %d: its decision (ballot %d) is void: %s. Running the batch again.", self.name,
                    batch_id, decided.ballot, e)
        self.dirty = True  # recovery aborts what the void ballot named, before the new ballot
        return True

    def _run_batch(self, batch_id: int, work: BatchWork, prog: BatchProgress) -> None:
        opened = self.open_ballot(batch_id, work.partitions, prog)
        if opened is None:
            return  # committed before (skipped), or recommitted now from an earlier decision
        t0 = time.perf_counter()                                                    # step 4
        fence = _InBackground(self.tlog.check_fence)  # an early exit only: off the critical path
        sweep = self._start_replaced_sweep(batch_id)
        try:
            started_at = time.time()
            results = work.prepare(opened.query_name, batch_id, opened.intent, opened.run)
            self.check_prepared(opened, results, started_at=started_at)
            source = work.source_offsets(batch_id)
            fence.result()  # an early exit for a deposed coordinator; the slot below is the fence
        except BaseException as e:
            # Nothing is decided: close our ballot, then abort what its partitions left open now,
            # rather than at the replay (prepared transactions hold locks, open Kafka
            # transactions hold back read_committed consumers).
            late = self._sweep_late(opened) if isinstance(e, Exception) else 0
            self.give_up(opened, e)
            if isinstance(e, Exception):
                if late:
                    raise _RunAgain(batch_id, opened.number, e, f"{late} transactions of late task attempts of "
                                    "earlier batches held what its tasks needed; they are aborted") from e
                if self._superseded(opened):
                    raise _RunAgain(batch_id, opened.number, e, "its tasks found a later plan at the target "
                                    "(a deposed coordinator's, landing late) and wrote nothing") from e
                if isinstance(e, TransactionTakenError):
                    raise _RunAgain(batch_id, opened.number, e, "another actor aborted one of its transactions "
                                    "before the decision") from e
                again = getattr(work, "run_again", None)
                reason = again(e) if again is not None else None
                if reason:
                    raise _RunAgain(batch_id, opened.number, e, reason) from e
            raise
        prog.prepare_ms = _ms(t0)
        self.decide_and_commit(opened, results, prog, source=source)
        if sweep is not None:
            sweep.result()  # done by now, as a rule; it logs its own failures
        self.committed(batch_id)

    def _sweep_late(self, opened: OpenedBallot) -> int:
        """After our ballot failed: abort late actors' leftovers of earlier batches (see
        :meth:`~twophase.sink.TwoPhaseCommitSink.sweep_late`); how many there were."""
        try:
            return sweep_late(self.sink, opened.query_name, opened.batch_id, Settled(self.tlog))
        except Exception as e:  # noqa: BLE001 - not known: the failure stands
            log.debug("%s: batch %d: late leftovers not swept (%s)", self.name, opened.batch_id, e)
            return 0

    def _superseded(self, opened: OpenedBallot) -> bool:
        """After our ballot failed: True if we still own the log and the sink says a later plan
        (not ours: we plan one ballot at a time) kept its tasks from writing."""
        try:
            self.tlog.check_fence()  # a newer owner's plan: we are the deposed one, and stop
            return self.sink.plan_superseded(opened.intent)
        except Exception as e:  # noqa: BLE001 - not known to be superseded: the failure stands
            log.debug("%s: batch %d: not re-run (%s)", self.name, opened.batch_id, e)
            return False

    def _start_replaced_sweep(self, batch_id: int) -> _InBackground | None:
        """The periodic sweep of replaced generations, in the background while the batch's tasks
        run (it touches only the old generations' names), when one is due."""
        if not self._replaced or batch_id % max(1, self.sweep_replaced_every) != 0:
            return None
        return _InBackground(self._sweep_replaced_generations)

    def open_ballot(self, batch_id: int, partitions: Callable[[int | None], int],
                    prog: BatchProgress) -> OpenedBallot | None:
        """Steps 1-3 of batch ``batch_id``: recovery when dirty, then either nothing to run (None:
        the batch was committed before, or is recommitted now from an earlier decision;
        ``prog.action`` says which) or a ballot of ours opened (its INTENT logged) for the tasks
        to write under.  ``partitions(planned)`` is :meth:`BatchWork.partitions`.

        A decision of this very batch that recovery proves void (every transaction gone, none ever
        visible: :class:`~twophase.errors.BatchVanishedError`) is recorded void and the batch gets
        a new ballot, in both forms: the coordinator's :meth:`run_batch` and the data source form's
        plan step, which calls this directly."""
        voided = 0
        while True:
            try:
                return self._open_ballot(batch_id, partitions, prog)
            except BatchVanishedError as e:
                if voided == _MAX_VOIDS or not self._void(batch_id, e):
                    raise
                voided += 1

    def _open_ballot(self, batch_id: int, partitions: Callable[[int | None], int],
                     prog: BatchProgress) -> OpenedBallot | None:
        tlog = self.tlog
        t0 = time.perf_counter()
        self.settle()
        tlog.heartbeat(force=False)
        recovered: set[tuple[int, int]] | None = None
        # The steady state: this object committed batch N-1 and nothing failed since.  Batch N's
        # records can then only exist if another coordinator wrote them, and the exclusive create
        # of our INTENT below finds that out; reading the view first would cost a listing (a
        # round trip on S3 or HDFS) on every batch and decide nothing.
        fast = not self.dirty and self._last_committed is not None and batch_id == self._last_committed + 1
        self._last_committed = None
        if self.dirty:
            try:
                recovered = self.recover()
            except CommitError as e:
                raise CommitError(f"batch {batch_id} was not started: an earlier decided batch is not fully "
                                  f"committed, and a new batch could abort its transactions. {e}") from e
            self.dirty = False
        if fast:
            view = BatchView(batch_id, int(tlog.generation or 0), [], None)
        else:
            view = tlog.view(batch_id)
            if not view.ballots and view.committed is None:
                tlog.refuse_pruned(batch_id, fresh=True)  # PrunedBatchError: committed, records pruned
        prog.log_ms += _ms(t0)

        t0 = time.perf_counter()
        qname = self.query_name
        for tries in range(_MAX_LATE_INTENTS + 1):
            if view.committed is None and view.decision is not None:
                # A commit decision: recovery was skipped (the fast path), or one landed after we
                # read (a late actor's decision in a ballot our late-INTENT loop found open).  It
                # stands: commit it.  Never open another ballot beside a decided one.
                recovered = (recovered or set()) | self.recover()
                view = tlog.view(batch_id)
            if view.committed is not None:                                          # steps 1-2
                prog.action = "recommitted" if (tlog.generation, batch_id) in (recovered or set()) else "skipped"
                decision = view.decision
                if prog.action == "recommitted" and decision is not None:
                    prog.handles = len(decision.handles)
                    prog.rows = int(decision.body.get("rows", 0))
                return None
            number = self._close_earlier_ballots(batch_id, view, prog, after_recovery=recovered is not None)
            if number is None:  # a ballot was decided while we closed it: commit that decision
                view = tlog.view(batch_id)
                continue
            planned = next((b.intent.body.get("num_partitions") for b in reversed(view.ballots)
                            if b.intent is not None), None)
            num_partitions = partitions(int(planned) if planned else None)
            if tlog.fenced:
                # Its heartbeat found a newer owner: no plan of ours (it could move a sink's plan
                # fence past the owner's ballot).  Only narrows the window: a plan already under
                # way lands when it lands, and the owner runs its batch again (_RunAgain).
                raise LogOwnershipError(f"batch {batch_id}: this coordinator (epoch {tlog.epoch}) was fenced by "
                                        "a newer one; it stops without planning (the owner runs the batch)")
            # A batch job (its query id is batch_query_id's, "batch:..."): its runs may overlap.
            plan = self.sink.plan_batch_job if self.batch_job else self.sink.plan_batch
            intent = plan(qname, batch_id, num_partitions)
            opened = tlog.write(batch_id, INTENT, {"intent": intent, "sink": self.sink.kind, "name": qname,
                                                   "num_partitions": num_partitions}, ballot=number)
            if tlog.mine(opened):
                self._refuse_pruned(batch_id, "INTENT", [])
                break
            # Another coordinator's INTENT holds this ballot's slot.
            self.dirty = True
            other = opened.body.get("epoch")
            if other is None or tlog.epoch is None or int(other) >= tlog.epoch or tries == _MAX_LATE_INTENTS:
                # A newer owner's (or one we cannot place): we are the deposed one, or racing it.
                raise LogOwnershipError(
                    f"batch {batch_id}: coordinator epoch {other} opened ballot {number} "
                    f"{'first' if fast else 'at the same time'}; this one (epoch {tlog.epoch}) stops without "
                    "writing (the owner runs the batch)")
            # A deposed coordinator's INTENT that landed late (paused, or held on the wire): the
            # batch is ours to run.  Its ballot is closed like any earlier one (its transactions
            # aborted only after its slot says abort; a decision that beat the close stands: it is
            # committed at the top of the loop, and no ballot of ours is opened), and we open the next.
            log.warning("%s: batch %d: ballot %d was opened by deposed coordinator epoch %s (a late INTENT); "
                        "closing it and opening the next", self.name, batch_id, number, other)
            view = tlog.view(batch_id)
            recovered = recovered or set()  # earlier ballots were handled: abort only what is closed now
        else:  # every try found a ballot decided while it closed it: others keep writing this batch
            raise LogOwnershipError(f"batch {batch_id}: no ballot could be opened ({_MAX_LATE_INTENTS + 1} tries "
                                    "found a ballot decided by another coordinator meanwhile)")
        prog.intent_ms = _ms(t0)
        crash.crash_point("after_intent", batch_id)
        # A late attempt of an earlier batch may hold what this ballot's tasks need: gone first.
        prog.aborted_lingering += sweep_late(self.sink, qname, batch_id, Settled(tlog))
        run = f"e{tlog.epoch}{uuid.uuid4().hex[:6]}"
        return OpenedBallot(batch_id, number, intent, run, qname)

    def check_prepared(self, opened: OpenedBallot, results: list[dict[str, Any]], *, started_at: float) -> None:
        """Before the decision: a pre-committed transaction the target may already have aborted on
        its own (Kafka's timeout) fails the batch now, while it is undecided."""
        self.sink.verify_prepared(opened.batch_id, [self.sink.decode_handle(r["handle"]) for r in results],
                                  prepare_started_at=started_at)

    def give_up(self, opened: OpenedBallot, error: BaseException) -> None:
        """Our ballot failed before its decision: see :meth:`_give_up`."""
        self._give_up(opened.batch_id, opened.number, opened.intent, error)

    def decide_and_commit(self, opened: OpenedBallot, results: list[dict[str, Any]], prog: BatchProgress, *,
                          source: dict[str, Any] | None = None) -> None:
        """Steps 4 (the decision) to 6 of our ballot, given its tasks' results (every partition's
        handle, checked with :meth:`check_prepared`)."""
        tlog, batch_id, number = self.tlog, opened.batch_id, opened.number
        payload: dict[str, Any] = {} if source is None else {"source": source}
        handles = [r["handle"] for r in results]
        prog.rows = sum(r["rows"] for r in results)
        prog.handles = len(handles)
        crash.crash_point("before_prepared_logged", batch_id)

        t0 = time.perf_counter()                                                    # the decision
        payload.update({"handles": handles, "rows": prog.rows, "partitions": [r["partition"] for r in results]})
        decided = tlog.decide(batch_id, number, payload)
        if not tlog.mine(decided):
            # Our ballot was closed (aborted) by someone else first: the batch is theirs to re-run.
            # What our tasks pre-committed belongs to our ballot alone.
            self.dirty = True
            self._abort_own(batch_id, handles)
            raise TwoPhaseError(f"batch {batch_id}: ballot {number} was closed by another coordinator "
                                f"({decided.body.get('reason') or 'aborted'}) before this one (epoch {tlog.epoch}) "
                                "decided it; its transactions were aborted and the batch is re-run by the owner")
        self._refuse_pruned(batch_id, "decision", handles)
        prog.log_ms += _ms(t0)
        crash.crash_point("after_prepared_logged", batch_id)

        t0 = time.perf_counter()                                                    # steps 5-6
        decoded = [self.sink.decode_handle(e) for e in handles]
        try:
            self._committer().commit(batch_id, decoded, recovering=False)
        except BatchVanishedError as e:
            e.generation, e.ballot = tlog.generation, number
            raise
        except DataLossError:
            # Part of the batch committed by us, the rest "gone" by evidence that can be deleted (a
            # marker row pruned once another run committed the batch and the log shows it COMMITTED):
            # rule: the verdict stands only if the log, read after it, does not show the batch finished.
            finished = finished_after_all(tlog, batch_id, tlog.generation)
            if finished is None:
                raise
            log.warning("%s: batch %d: some of its transactions read as gone, but the log shows it %s (another "
                        "run committed it, then pruned its evidence): not data loss", self.name, batch_id,
                        finished)
            self.dirty = True
            return
        # Leftovers of failed task attempts of this batch (they pre-committed but lost the race).
        aborted = abort_lingering(self.sink, opened.query_name, batch_id, opened.intent, decoded, Settled(tlog))
        if aborted:
            log.info("%s: batch %d: aborted %d transactions of failed task attempts", self.name, batch_id,
                     aborted)
        prog.commit_ms = _ms(t0)
        crash.crash_point("after_commit", batch_id)
        record = {"rows": prog.rows, "handles_committed": len(handles)}

        def mark_committed() -> None:
            tlog.write(batch_id, COMMITTED, record)
            crash.crash_point("after_committed_logged", batch_id)

        if self.committed_in_background:
            # Every handle is committed: the batch is visible and done. The COMMITTED record only
            # spares a replay its recommit (idempotent), so it need not hold up the batch: it is
            # written while Spark logs its own commit and plans the next batch, and the next batch
            # waits for it before it opens (settle). Lost to a crash, it is the state after
            # `after_commit`: recovery commits the decision again and writes it.
            # Not a daemon: a driver that ends after its last batch waits for the record (bounded
            # by the store's timeouts) rather than leaving that batch to be recommitted.
            self._committing = _InBackground(mark_committed, name="twophase-committed", daemon=False)
            return
        t0 = time.perf_counter()
        mark_committed()
        prog.log_ms += _ms(t0)

    def committed(self, batch_id: int) -> None:
        """After batch ``batch_id`` was committed by this object: the next batch may skip reading
        its view (see :meth:`open_ballot`), and old records are pruned now and then."""
        self._last_committed = batch_id
        tlog = self.tlog
        if batch_id % max(1, tlog.retain_batches // 10) == 0:  # a listing: not on every batch
            tlog.prune(batch_id)
