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
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from twophase import crash
from twophase.errors import (
    BatchVanishedError,
    CommitError,
    DataLossError,
    LogOwnershipError,
    PrunedBatchError,
    TransactionTakenError,
    TwoPhaseError,
)
from twophase.evidence import Settled
from twophase.log import COMMITTED, INTENT, BatchView, TransactionLog, parse_batch_name
from twophase.recovery import (
    Committer,
    closer_for,
    finished_after_all,
    forgetter_for,
    pending_batches,
    recover_pending,
)
from twophase.sink import TwoPhaseCommitSink, abort_lingering, sweep_late

log = logging.getLogger("twophase.protocol")


@dataclass
class BatchProgress:
    """Figures of one batch, as logged and kept in ``Coordinator.last_progress``."""

    name: str
    batch_id: int
    query_id: str | None
    action: str  # "committed" | "recommitted" | "skipped"
    rows: int = 0
    handles: int = 0
    aborted_lingering: int = 0
    intent_ms: float = 0.0
    prepare_ms: float = 0.0
    log_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BatchWork(Protocol):
    """What the engine does for one batch; the protocol decides when.

    Optionally ``run_again(error) -> str | None``: after a ballot whose tasks failed (nothing
    decided; the ballot is closed and its leftovers aborted), a reason why a new ballot would
    not fail the same way (the coordinator's: the rows path refused a row, and the next ballot
    takes the Arrow path), or None.  The batch then runs again, at most ``_MAX_REPLANS`` times.
    """

    def partitions(self, planned: int | None) -> int:
        """How many transactions (partitions) this ballot writes.  ``planned``: what the batch's
        last ballot planned (a re-run stays inside it, so a sink's bounded pool of transaction
        names keeps its size), or ``None`` for a batch's first ballot."""

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        """Run every partition's transaction; return one result per pre-committed partition:
        ``{"partition", "attempt", "rows", "handle"}`` (the handle as the sink encoded it)."""

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        """The source offsets to record in the decision (``None``: none known)."""


@dataclass
class OpenedBallot:
    """A ballot this coordinator opened for a batch (its INTENT logged): what its tasks need
    (``query_name``, ``intent``, ``run``) and what its decision names."""

    batch_id: int
    number: int
    intent: dict[str, Any]
    run: str
    query_name: str


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


class _InBackground:
    """Run ``fn`` in a thread now (a daemon unless ``daemon=False``: then the interpreter waits for
    it at exit); :meth:`result` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Any], *, name: str = "twophase-fence", daemon: bool = True):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=daemon)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class TwoPhaseProtocol:
    """One log owner's protocol: the steps of a batch, and recovery between batches.

    ``name`` labels logs and errors; ``query_name`` is what the sink sees (the coordinator's
    name scoped by the log's identity and generation).  ``committer`` commits a batch's handles.
    ``dirty`` means: run the recovery routine before the next batch (at the start, and after
    any batch failed).
    """

    def __init__(self, sink: TwoPhaseCommitSink[Any, Any], tlog: TransactionLog, *, name: str,
                 query_name: str, committer: Callable[[], Committer]):
        self.sink = sink
        self.tlog = tlog
        self.name = name
        self.query_name = query_name
        self._committer = committer
        self.dirty = True
        #: The batch this object committed last, while clean: the next batch's records can only
        #: exist if another coordinator wrote them, so its view need not be read (see _run_batch).
        self._last_committed: int | None = None
        #: (generation, scoped name, last batch) of each replaced generation: read at recovery.
        self._replaced: list[tuple[int, str, int]] | None = None
        #: Write each batch's COMMITTED record in the background (the coordinator's streaming
        #: batches): see :meth:`decide_and_commit` and :meth:`settle`.
        self.committed_in_background = False
        self._committing: _InBackground | None = None

    #: Every this many batches (by batch id), the leftovers of late actors of replaced generations
    #: are swept again, in the background (see :meth:`_sweep_replaced_generations`): one
    #: ``abort_lingering`` per replaced generation, which may cost the sink a listing.
    sweep_replaced_every: int = 10

    # ------------------------------------------------------------------ recovery
    def recover(self) -> set[tuple[int, int]]:
        """Decided batches of every generation are committed first, oldest first; only then are
        undecided batches' open ballots closed and their leftovers aborted, and the leftovers of
        late actors of replaced generations swept (:meth:`_sweep_replaced_generations`).
        Returns the (generation, batch) pairs it committed."""
        self.settle()
        tlog = self.tlog
        committed: set[tuple[int, int]] = set()
        pending = pending_batches(tlog)

        def mark(b) -> None:
            tlog.write(b.batch_id, COMMITTED, {"recovered": True, "at": time.time()}, generation=b.generation)
            committed.add((b.generation, b.batch_id))

        seen: set[int] = set()
        while pending:
            try:
                recover_pending(self.sink, pending, self._committer(), mark_committed=mark,
                                close_ballot=closer_for(tlog, f"closed by coordinator epoch {tlog.epoch} (recovery)"),
                                forget=forgetter_for(tlog), settled=Settled(tlog))
                break
            except DataLossError as e:
                # rule: part of a decided batch read as gone is data loss only if the log, read after
                # that verdict, does not show the batch finished (another run committed it, then pruned
                # the evidence the verdict read).  A vanished batch goes to _void, which asks the same.
                if isinstance(e, BatchVanishedError) or e.batch_id is None or e.batch_id in seen \
                        or finished_after_all(tlog, e.batch_id, e.generation) is None:
                    raise
                log.warning("%s: batch %d: some of its transactions read as gone, but the log shows it finished "
                            "(another run committed it): not data loss", self.name, e.batch_id)
                seen.add(e.batch_id)
                pending = pending_batches(tlog)
        self._replaced = None  # read the replaced generations' last batches again
        self._sweep_replaced_generations()
        return committed

    def _sweep_replaced_generations(self) -> None:
        """Run, for every earlier generation of the log, the cleanup its next batch would have run.

        A late actor of a replaced generation (a zombie task of the old query, a stage retry that
        began after its batch was cleaned up) leaves its transaction under the old generation's
        scoped name, and no batch of that generation ever runs again to find it (the sinks' own
        sweep of a query's earlier batches is by name).  So each earlier generation gets
        ``abort_lingering(its name, its last batch + 1, {}, [])``: a batch it never ran, whose
        cleanup takes what the generation's late attempts left.  Run after recovery (every
        decided batch of every generation committed, every ballot seen closed) and, in the
        background, every :attr:`sweep_replaced_every` batches, since a zombie of the old
        query may resume after the new one started.  Best effort: a failure is logged and the
        next sweep tries again.
        """
        tlog = self.tlog
        replaced = self._replaced  # one read: recovery may reset it meanwhile (this may run in the background)
        if replaced is None:
            replaced = []
            for g in range(1, int(tlog.generation or 0)):
                try:
                    found = self._last_batch(g)
                except Exception:  # noqa: BLE001 - see the docstring
                    log.warning("%s: could not read generation %d of the log", self.name, g, exc_info=True)
                    continue
                if found is not None:
                    replaced.append((g, *found))
            self._replaced = replaced
        for g, name, last in replaced:
            try:
                n = abort_lingering(self.sink, name, last + 1, {}, [], Settled(tlog))
            except Exception:  # noqa: BLE001 - see the docstring
                log.warning("%s: could not sweep leftovers of generation %d of the log", self.name, g, exc_info=True)
                continue
            if n:
                log.info("%s: aborted %d transactions of late actors of replaced generation %d (%s)", self.name,
                         n, g, name)

    def _start_replaced_sweep(self, batch_id: int) -> _InBackground | None:
        """The periodic sweep of replaced generations, in the background while the batch's tasks
        run (it touches only the old generations' names), when one is due."""
        if not self._replaced or batch_id % max(1, self.sweep_replaced_every) != 0:
            return None
        return _InBackground(self._sweep_replaced_generations)

    def _last_batch(self, generation: int) -> tuple[str, int] | None:
        """(scoped query name, highest batch id) of a generation's INTENTs, or None if it has none."""
        tlog = self.tlog
        intents: dict[int, int] = {}  # batch -> its highest ballot with an INTENT
        for n in tlog.store.list(f"g{generation:04d}"):
            parsed = parse_batch_name(n)
            if parsed is not None and parsed[1] == INTENT:
                intents[parsed[0]] = max(parsed[2], intents.get(parsed[0], 0))
        if not intents:
            return None
        last = max(intents)
        rec = tlog.record(last, INTENT, generation=generation, ballot=intents[last])
        name = None if rec is None else rec.body.get("name")
        return (str(name), last) if name else None

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
            intent = self.sink.plan_batch(qname, batch_id, num_partitions)
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

    def settle(self) -> None:
        """Wait for the last batch's COMMITTED record written in the background; if it failed,
        recovery runs before the next batch (it writes the record)."""
        pending, self._committing = self._committing, None
        if pending is None:
            return
        try:
            pending.result()
        except Exception as e:  # noqa: BLE001 - the batch is committed; only its marker is missing
            log.warning("%s: a committed batch's COMMITTED record was not written (%s); recovery writes it "
                        "before the next batch", self.name, e)
            self.dirty = True
            self._last_committed = None

    def committed(self, batch_id: int) -> None:
        """After batch ``batch_id`` was committed by this object: the next batch may skip reading
        its view (see :meth:`open_ballot`), and old records are pruned now and then."""
        self._last_committed = batch_id
        tlog = self.tlog
        if batch_id % max(1, tlog.retain_batches // 10) == 0:  # a listing: not on every batch
            tlog.prune(batch_id)

    def _refuse_pruned(self, batch_id: int, what: str, handles: list[dict[str, Any]]) -> None:
        """After our INTENT or decision landed (exclusive create): was the batch committed and pruned
        meanwhile?  Then its slot was free only because its records were deleted, and we are a
        deposed coordinator (paused, or our request held on the wire, for ``retain_batches``
        batches).  The owner writes what it prunes before it deletes a record, so this read,
        made after our create, sees it: a fence, not a check before an act.  We abort nothing but
        our own handles (a plan of ours may list the owner's open transactions) and stop; the
        owner's recovery aborts and forgets what we wrote there."""
        try:
            self.tlog.refuse_pruned(batch_id, fresh=True)
        except PrunedBatchError as e:
            self.dirty = True
            self._abort_own(batch_id, handles)
            raise LogOwnershipError(
                f"batch {batch_id}: this coordinator's {what} (epoch {self.tlog.epoch}) landed after the batch "
                "was committed and its records pruned (it was deposed, paused or its request late, or a late "
                f"prune raced its re-run); it stops, aborting only its own transactions. {e}") from e

    def _close_earlier_ballots(self, batch_id: int, view: BatchView, prog: BatchProgress, *,
                               after_recovery: bool) -> int | None:
        """Close what earlier ballots of this batch left open, abort their names; return the number
        of the ballot to open, or None when a ballot turned out decided (in ``view`` already, or a
        late decision that beat our close): that decision stands and is committed, never skipped."""
        tlog = self.tlog
        if any(b.committed for b in view.ballots):
            return None
        closed_now = []
        for ballot in view.ballots:
            if ballot.open:
                epoch = None if ballot.intent is None else ballot.intent.body.get("epoch")
                if epoch is not None and tlog.epoch is not None and int(epoch) > tlog.epoch:
                    # Its INTENT (immutable) proves a newer owner: we are deposed, and leave it alone.
                    raise LogOwnershipError(
                        f"batch {batch_id}: ballot {ballot.ballot} was opened by coordinator epoch {epoch}, newer "
                        f"than this one (epoch {tlog.epoch}); this one stops without closing it (the owner runs "
                        "the batch)")
                slot = tlog.close_ballot(batch_id, ballot.ballot, f"re-run by coordinator epoch {tlog.epoch}")
                if not slot.aborted:
                    # Decided while we looked (a paused coordinator's late decision): it stands.
                    self.dirty = True
                    log.warning("%s: batch %d: ballot %d was decided by another coordinator while this one "
                                "closed it; committing that decision", self.name, batch_id, ballot.ballot)
                    return None
                closed_now.append(ballot)
        # Every earlier ballot is closed as aborted now: its names are garbage. Recovery (when it ran
        # just now) already aborted those closed before.  rule: a closed ballot (its slot says abort).
        for ballot in (closed_now if after_recovery else view.ballots):
            n = abort_lingering(self.sink, str(ballot.name or self.query_name), batch_id, ballot.plan, [],
                                Settled(tlog))
            prog.aborted_lingering += n
        if prog.aborted_lingering:
            log.info("%s: batch %d: aborted %d transactions left by earlier ballots", self.name, batch_id,
                     prog.aborted_lingering)
        return view.next_ballot

    def _give_up(self, batch_id: int, ballot: int, intent: dict[str, Any], error: BaseException) -> None:
        """A ballot of ours failed before its decision: close it as aborted, then abort its transactions.

        Only after the slot says "abort" (ours or an earlier close) are its names aborted, and only
        its own names: a later ballot, a newer owner's, is never touched.  Best effort: the replay
        (or recovery) closes and aborts what is left.
        """
        try:
            slot = self.tlog.close_ballot(batch_id, ballot, f"failed: {type(error).__name__}: {str(error)[:200]}")
        except Exception:  # noqa: BLE001 - the log is unreachable: the replay closes the ballot
            log.warning("%s: batch %d: could not close ballot %d after its failure; the replay closes it and "
                        "aborts its transactions", self.name, batch_id, ballot, exc_info=True)
            return
        if not slot.aborted:  # cannot be: only this coordinator decides its ballot
            log.error("%s: batch %d: ballot %d holds a commit decision after its failure: left as is",
                      self.name, batch_id, ballot)
            return
        try:  # rule: a closed ballot (the slot above says abort), and our own ballot's names only
            abort_lingering(self.sink, self.query_name, batch_id, intent, [], Settled(self.tlog))
        except Exception:
            log.warning("%s: batch %d: aborting leftovers after failed executors failed too; the "
                        "replay aborts them", self.name, batch_id, exc_info=True)

    def _abort_own(self, batch_id: int, envelopes: list[dict[str, Any]]) -> None:
        """Abort the pre-committed transactions of a ballot of ours that another coordinator closed.

        Best effort: a failure is logged, and the closer's (or the next replay's)
        ``abort_lingering`` finds what is left by the ballot's INTENT.
        """
        for env in envelopes:
            try:
                self.sink.recover_and_abort(self.sink.decode_handle(env))
            except Exception as e:  # noqa: BLE001 - best effort, see above
                log.warning("%s: batch %d: could not abort own transaction %s after losing the decision: %s",
                            self.name, batch_id, env, e)
        if envelopes:
            log.warning("%s: batch %d: lost the decision to another coordinator; aborted %d own transactions",
                        self.name, batch_id, len(envelopes))
