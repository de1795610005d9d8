"""The base of :class:`~twophase.protocol.TwoPhaseProtocol`: its state, recovery between batches,
and the ballots it closes, gives up or refuses.

Runs on the driver, without Spark.  :class:`_ProtocolRecovery` holds the protocol's state (its
``__init__``), recovery before a batch (:meth:`~_ProtocolRecovery.recover`: the shared routine of
:mod:`twophase.recovery`, then the sweep of replaced generations), the wait for a COMMITTED
record written in the background (:meth:`~_ProtocolRecovery.settle`), and what a batch does
about ballots it cannot use: closing what earlier ballots left open (step 3), giving up a
ballot of ours that failed before its decision, aborting our own handles after a lost decision,
and refusing an INTENT or decision that landed in a batch committed and pruned meanwhile.  The
steps of a batch that call these are in :mod:`twophase.protocol`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twophase.errors import BatchVanishedError, DataLossError, LogOwnershipError, PrunedBatchError
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
from twophase.sink import TwoPhaseCommitSink, abort_lingering

if TYPE_CHECKING:
    from twophase.protocol_model import BatchProgress, _InBackground

log = logging.getLogger("twophase.protocol")  # as before the split: log filters and traces name it


class _ProtocolRecovery:
    """The state of a :class:`~twophase.protocol.TwoPhaseProtocol` (its constructor's arguments are
    documented there), its recovery between batches, and its handling of ballots it cannot use."""

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

    @property
    def batch_job(self) -> bool:
        """Whether the log is a batch job's (``Coordinator.write``, a data source batch write: its
        query id is :func:`~twophase.log.batch_query_id`'s): its ballots are planned with the sink's
        :meth:`~twophase.sink.TwoPhaseCommitSink.plan_batch_job`, since its runs may overlap."""
        return str(self.tlog.query_id or "").startswith("batch:")

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

    # ------------------------------------------------------------------ ballots closed, given up, refused
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
