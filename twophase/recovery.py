"""Recovery: the one routine the coordinator, ``twophase recover`` and the conformance harness share.

After a crash (or a failed commit) a log may hold decided batches whose handles are
not all committed, and undecided batches whose attempts left transactions open.
:func:`recover_pending` finishes them in the only safe order:

1. every decided, uncommitted batch, of every log generation, oldest first: commit
   all its handles (in parallel, transient failures retried).  If one cannot be
   committed now, stop there: nothing is aborted;
2. then, per decided batch: close its other ballots (an abort decision in each open
   ballot's slot), abort what they and the decided ballot's failed task attempts left
   (keeping its handles) and log COMMITTED;
3. only then close the ballots of undecided batches and abort their leftovers.  A
   close that finds a commit decision written first (a late coordinator) commits that
   batch instead: a decision is never overruled.

Sinks reuse transaction names across batches (KafkaSink's transactional-id pool), so
fencing an undecided batch's names before a decided batch on the same names is
committed would abort the decided batch.  After step 1 no decided transaction is
open anywhere, so no abort can touch one.

:func:`recover` is ``twophase recover`` / ``twophase abort-lingering``: it takes
ownership of the log (a new epoch, so a live coordinator is refused or fenced),
rebuilds the sink from its config and runs the routine.  :func:`describe` is
``twophase status`` (read-only).
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import Any

from twophase import crash
from twophase.errors import (
    BatchVanishedError,
    CommitError,
    ConfigurationError,
    DataLossError,
    LogError,
    LogOwnershipError,
)
from twophase.evidence import Settled
from twophase.log import ABORT, COMMIT, COMMITTED, INTENT, PREPARED, BatchView, TransactionLog
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink, abort_lingering

log = logging.getLogger("twophase.recovery")


# ------------------------------------------------------------------ what is pending
@dataclass
class BallotInfo:
    """One ballot (execution) of a pending batch, as recovery needs it."""

    ballot: int
    name: str                          # the query name its transactions were opened under
    intent: dict[str, Any]
    outcome: str | None                # "commit", "abort", or None while open
    epoch: int | None = None           # the coordinator epoch that opened it (its INTENT's)


@dataclass
class PendingBatch:
    """A batch of the log that is not COMMITTED: decided (``handles`` set) or not (``None``).

    ``name``/``intent`` are the decided ballot's (else the latest ballot's); ``ballots`` lists
    every ballot of the batch (empty for a harness' model, which has one implicit ballot).
    """

    generation: int
    batch_id: int
    name: str                          # the query name its transactions were opened under
    intent: dict[str, Any]
    sink_kind: str | None              # the INTENT's sink kind (None for records without one)
    handles: list[dict[str, Any]] | None = None  # the decision's handle envelopes
    decided_at: float | None = None
    ballot: int = 0                    # the decided ballot (else the latest)
    ballots: list[BallotInfo] = field(default_factory=list)
    #: Committed, then its records pruned (see :meth:`TransactionLog.pruned`): the records found now
    #: are a deposed coordinator's late writes (a decision among them is never committed: its
    #: transactions are aborted, its records forgotten).
    pruned: bool = False

    @property
    def decided(self) -> bool:
        return self.handles is not None

    @property
    def label(self) -> str:
        return f"batch {self.batch_id} (generation {self.generation})"


def pending_batches(tlog: TransactionLog, generations: list[int] | None = None) -> list[PendingBatch]:
    """Every batch of the log that is not COMMITTED, of every generation, oldest first.

    Reads only the records of batches without a COMMITTED record (one listing per
    generation), so it stays cheap on logs that keep many committed batches.
    """
    if generations is None:
        generations = [int(g["generation"]) for g in tlog.generations()]
    out: list[PendingBatch] = []
    for g in sorted(generations):
        default_name = _generation_name(tlog, g)
        views = tlog.views(g, skip_committed=True)
        pruned = tlog.pruned(g, fresh=True) if views else []
        for view in views.values():
            pb = pending_from_view(view, default_name)
            if pb is not None:
                pb.pruned = any(a <= pb.batch_id <= b for a, b in pruned)
                out.append(pb)
    return out


def pending_from_view(view: BatchView, default_name: str) -> PendingBatch | None:
    """The :class:`PendingBatch` of a batch's records, or None when it is COMMITTED or has none."""
    if view.committed is not None or not view.ballots:
        return None
    infos = []
    for b in view.ballots:
        # A decision proved void counts as closed: its names are garbage, like an abort's.
        outcome = None if b.decision is None else (COMMIT if b.committed else ABORT)
        epoch = None if b.intent is None or b.intent.body.get("epoch") is None else int(b.intent.body["epoch"])
        infos.append(BallotInfo(b.ballot, str(b.name or default_name), b.plan, outcome, epoch))
    decided = next((b for b in view.ballots if b.committed), None)
    main = decided or view.ballots[-1]
    kinds = [b.intent.body.get("sink") for b in view.ballots if b.intent is not None]
    return PendingBatch(
        generation=view.generation, batch_id=view.batch_id, name=str(main.name or default_name),
        intent=main.plan, sink_kind=kinds[-1] if kinds else None,
        handles=decided.decision.handles if decided is not None and decided.decision is not None else None,
        decided_at=decided.decision.written_at if decided is not None and decided.decision is not None else None,
        ballot=main.ballot, ballots=infos)


def _generation_name(tlog: TransactionLog, generation: int) -> str:
    for g in tlog.generations():
        if int(g["generation"]) == generation:
            return str(g.get("name") or "twophase")
    return "twophase"


# ------------------------------------------------------------------------ committing
class Committer:
    """Commits a decided batch's handles as the coordinator does: ``parallelism`` at once, each
    retried ``retries`` times with exponential backoff; a handle the sink reports LOST is data loss.

    Runs on the driver (or in ``twophase recover``).  The first handle is committed alone, then
    the others (see :meth:`commit`); once it succeeded (or is lost for good), every other handle
    is tried even when another one fails, so that as much of the batch as possible becomes
    visible; then the first failure is raised: :class:`~twophase.errors.DataLossError` for a lost handle (unless
    ``ignore_lost``, which reports it in the results and goes on), else
    :class:`~twophase.errors.CommitError` (the decision stays logged: a replay commits again).
    """

    def __init__(self, sink: TwoPhaseCommitSink[Any, Any], *, parallelism: int = 8, retries: int = 5,
                 backoff: float = 0.2, max_backoff: float = 10.0, ignore_lost: bool = False,
                 where: str = "the transaction log", name: str = "twophase"):
        if parallelism < 1 or retries < 0:
            raise ConfigurationError("commit parallelism must be >= 1 and retries >= 0")
        self.sink = sink
        self.parallelism = parallelism
        self.retries = retries
        self.backoff = backoff
        self.max_backoff = max_backoff
        self.ignore_lost = ignore_lost
        self.where = where
        self.name = name

    def commit(self, batch_id: int, handles: list[Any], *, recovering: bool) -> list[CommitResult]:
        """Commit every (decoded) handle of one decided batch; results in the handles' order."""
        if not handles:
            return []
        # A mid_commit crash point commits one at a time, so that it really leaves some uncommitted;
        # every other crash plan (and a random kill) meets the parallel commits.
        workers = 1 if crash.planned("mid_commit", batch_id) else min(self.parallelism, len(handles))
        results: list[CommitResult | None] = [None] * len(handles)
        errors: list[tuple[int, BaseException]] = []
        # The first handle alone, then the others in parallel.  Until a commit succeeds nothing of
        # the batch is committed by this committer, so a first transaction the target shows gone
        # and never visible (aborted: a timeout while the driver was down, another actor's claim
        # between the decision's check and the commit) proves the batch can never be whole: the
        # others are aborted too and the batch is void (it runs again) instead of half visible.
        # A first commit that fails otherwise (retries spent, its fate not readable) does not hold the
        # others back: they may be what keeps its fate from being read (a Kafka transaction open
        # before it holds the partition's last stable offset back), and they would time out.
        try:
            results[0] = self.commit_one(batch_id, handles[0], recovering)
        except Exception as e:  # noqa: BLE001 - raised below, after the others were tried
            errors.append((0, e))
        first = results[0]
        if first is not None and first.outcome is CommitOutcome.LOST and first.never_visible:
            if len(handles) > 1:
                self._abort_rest(batch_id, handles[1:], first)
        elif first is not None and len(handles) > 1:
            crash.crash_point("mid_commit", batch_id)
        done = 1
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="twophase-commit") as pool:
            futures = {pool.submit(self.commit_one, batch_id, h, recovering): i
                       for i, h in enumerate(handles) if i > 0}
            for fut in as_completed(futures):
                try:
                    results[futures[fut]] = fut.result()
                except Exception as e:  # noqa: BLE001 - raised below, after the others were tried
                    errors.append((futures[fut], e))
                    continue
                done += 1
                if done < len(handles):
                    crash.crash_point("mid_commit", batch_id)
        vanished = [i for i, r in enumerate(results)
                    if r is not None and r.outcome is CommitOutcome.LOST and r.never_visible]
        if vanished and len(vanished) == len(handles):
            # Nothing of the batch is, or ever was, visible: it can run again rather than be lost
            # (even with ignore_lost, which would drop it).
            reasons = "; ".join(f"{self.sink.describe_handle(handles[i])}: {results[i].reason}"  # type: ignore[union-attr]
                                for i in vanished[:3])
            more = f" (and {len(vanished) - 3} more)" if len(vanished) > 3 else ""
            raise BatchVanishedError(
                f"batch {batch_id} was decided (its PREPARED record is in {self.where}) but every one of its "
                f"{len(handles)} transactions is gone and the target shows none of it was ever visible: "
                f"{reasons}{more}. Nothing of the batch is visible: the coordinator runs it again when "
                "Spark replays it", batch_id=batch_id, reason="every transaction gone, none visible")
        if errors:
            # The first in the handles' order (data loss before anything else), not the first to
            # finish: the same failure reads the same whatever the threads' timing.
            ordered = [e for _, e in sorted(errors, key=lambda ie: ie[0])]
            lost = [e for e in ordered if isinstance(e, DataLossError)]
            raise (lost or ordered)[0]
        for i in vanished:  # some of the batch is visible, some gone: data loss after all
            what, reason = self.sink.describe_handle(handles[i]), results[i].reason  # type: ignore[union-attr]
            msg = (f"DATA LOSS: batch {batch_id} was decided (its PREPARED record is in {self.where}) but "
                   f"transaction {what} can no longer be committed: {reason}")
            if not self.ignore_lost:
                raise DataLossError(msg, batch_id=batch_id, handle=what, reason=reason)
            log.error("%s (ignored: ignore_failures_after_transaction_timeout)", msg)
        return [r for r in results if r is not None]

    def _abort_rest(self, batch_id: int, rest: list[Any], first: CommitResult) -> None:
        """The first transaction of a decided batch is gone and never was visible, and this committer
        committed nothing of the batch: abort the others, so that the batch is void as a whole
        rather than half visible.  Each abort must be confirmed (``recover_and_abort`` returns):
        if one fails, nothing is committed (a commit after an abort that did not land would make
        the batch half visible) and :class:`~twophase.errors.CommitError` keeps the decision for
        the next try, which aborts again.  Then each handle's commit only reads its fate: aborted
        (never visible), or committed by another committer (the batch is data loss)."""
        log.warning("%s: batch %d: its first transaction is gone and was never visible (%s); nothing of the "
                    "batch is committed, so its %d other transaction(s) are aborted and the batch runs again",
                    self.name, batch_id, first.reason, len(rest))
        failed = []
        for h in rest:
            try:
                self.sink.recover_and_abort(h)
            except Exception as e:  # noqa: BLE001 - reported below
                failed.append(f"{self.sink.describe_handle(h)}: {type(e).__name__}: {e}")
        if failed:
            raise CommitError(
                f"batch {batch_id}: its first transaction is gone and was never visible, so the batch is to run "
                f"again, but aborting {len(failed)} of its other transactions failed ({'; '.join(failed[:3])}). "
                "Nothing of the batch was committed; the decision stays logged and the next try (a restart, "
                "'twophase recover') aborts them again.")

    def commit_one(self, batch_id: int, handle: Any, recovering: bool) -> CommitResult:
        sink = self.sink
        attempt = 0
        while True:
            reason: str
            try:
                res = sink.recover_and_commit(handle) if recovering else sink.commit(handle)
            except DataLossError:
                raise
            except Exception as e:  # unexpected: retried, then the batch fails and its replay retries
                reason = f"{type(e).__name__}: {e}"
            else:
                if not isinstance(res, CommitResult):
                    raise TypeError(f"{type(sink).__name__}.commit returned {res!r}, not a CommitResult")
                if res.done:
                    return res
                reason = res.reason
                if res.outcome is CommitOutcome.LOST and res.never_visible:
                    return res  # judged with the batch's other handles (commit())
                if res.outcome is CommitOutcome.LOST:
                    what = sink.describe_handle(handle)
                    msg = (f"DATA LOSS: batch {batch_id} was decided (its PREPARED record is in "
                           f"{self.where}) but transaction {what} can no longer be committed: {reason}")
                    if self.ignore_lost:
                        log.error("%s (ignored: ignore_failures_after_transaction_timeout)", msg)
                        return res
                    raise DataLossError(msg, batch_id=batch_id, handle=what, reason=reason)
            attempt += 1
            if attempt > self.retries:
                raise CommitError(
                    f"batch {batch_id}: committing {sink.describe_handle(handle)} failed "
                    f"{attempt} times, last: {reason}. The decision is logged: restarting the query "
                    "(or 'twophase recover') commits it again.")
            delay = min(self.max_backoff, self.backoff * (2 ** (attempt - 1))) * (0.5 + random.random())
            log.warning("%s: batch %d: commit of %s failed (%s); retry %d/%d in %.2fs", self.name, batch_id,
                        sink.describe_handle(handle), reason, attempt, self.retries, delay)
            time.sleep(delay)


# --------------------------------------------------------------------------- routine
@dataclass
class RecoveryReport:
    committed_batches: list[int] = field(default_factory=list)
    handles_committed: int = 0
    handles_already_committed: int = 0
    aborted: dict[int, int] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)
    #: Batches whose decision was proved void (every transaction gone, none ever visible): the
    #: query's replay runs them again.
    voided: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"committed_batches": self.committed_batches, "handles_committed": self.handles_committed,
                "handles_already_committed": self.handles_already_committed,
                "aborted": {str(k): v for k, v in self.aborted.items()}, "lost": self.lost,
                "voided": self.voided}


def recover_pending(
    sink: TwoPhaseCommitSink[Any, Any],
    batches: list[PendingBatch],
    committer: Committer,
    *,
    mark_committed: Callable[[PendingBatch], None],
    abort_undecided: bool = True,
    after_commits: Callable[[PendingBatch, list[CommitResult]], None] | None = None,
    close_ballot: Callable[[PendingBatch, int], dict[str, Any]] | None = None,
    forget: Callable[[PendingBatch], None] | None = None,
    settled: Settled | None = None,
) -> RecoveryReport:
    """Finish ``batches`` (from :func:`pending_batches`, or a harness' model) in the safe order.

    ``mark_committed(batch)`` records COMMITTED for a decided batch once its handles are
    committed and its failed attempts' leftovers aborted.  ``after_commits`` (optional) sees
    each decided batch's commit results.  ``abort_undecided=False`` leaves undecided
    batches alone (their replay aborts their leftovers).

    ``close_ballot(batch, ballot)`` fills an open ballot's decision slot with "abort" by
    exclusive create and returns the body that holds the slot (:func:`closer_for`).  No
    ballot's transactions are aborted before its slot says "abort"; a slot found holding a
    commit decision (written late by a paused coordinator) makes its batch decided, and
    it is committed like the others.  Without it (a harness' model) open ballots are
    aborted directly.

    ``settled`` (:class:`~twophase.evidence.Settled`) is the log's evidence handed to each
    ``abort_lingering`` for what it may destroy of other batches (their late leftovers, marker
    rows); without it a cleanup touches only the ballots it is called for.
    Raises whatever the commit of a decided batch raised; then nothing was aborted.
    """
    report = RecoveryReport()
    late = [b for b in batches if b.pruned]
    batches = [b for b in batches if not b.pruned]
    for b in batches:
        if b.sink_kind and b.sink_kind != sink.kind:
            raise ConfigurationError(
                f"{b.label} was written by a {b.sink_kind!r} sink, but the sink given is {sink.kind!r}: "
                "recover with the sink configuration the query used")
    ordered = sorted(batches, key=lambda b: (b.generation, b.batch_id))
    if close_ballot is not None and abort_undecided:
        # Close the open ballots of undecided batches first: a late commit decision found in a
        # slot is committed in step 1 with the others, oldest first.
        for b in ordered:
            if not b.decided:
                _close_open_ballots(b, close_ballot)
    decided = [b for b in ordered if b.decided]
    decoded: dict[tuple[int, int], list[Any]] = {}
    for b in decided:                                                        # 1. commit, oldest first
        handles = [sink.decode_handle(e) for e in b.handles or []]
        decoded[(b.generation, b.batch_id)] = handles
        if handles:
            log.warning("%s: %s was decided but not fully committed: committing its %d handles",
                        committer.name, b.label, len(handles))
        try:
            results = committer.commit(b.batch_id, handles, recovering=True)
        except BatchVanishedError as e:
            e.generation, e.ballot = b.generation, b.ballot  # which decision it is (for void_ballot)
            raise
        except DataLossError as e:
            e.generation = b.generation  # which generation's batch (twophase recover reads the log again)
            raise
        for h, res in zip(handles, results):
            if res.outcome is CommitOutcome.COMMITTED:
                report.handles_committed += 1
            elif res.outcome is CommitOutcome.ALREADY_COMMITTED:
                report.handles_already_committed += 1
            elif res.outcome is CommitOutcome.LOST:
                report.lost.append({"batch_id": b.batch_id, "generation": b.generation,
                                    "handle": sink.describe_handle(h), "reason": res.reason})
        if after_commits is not None:
            after_commits(b, results)
    for b in decided:                                                        # 2. leftovers, COMMITTED
        if close_ballot is not None:
            _close_open_ballots(b, close_ballot)
        n = 0
        for other in b.ballots:
            if other.ballot != b.ballot and other.outcome == ABORT:
                n += abort_lingering(sink, other.name, b.batch_id, other.intent, [], settled)
        n += abort_lingering(sink, b.name, b.batch_id, b.intent, decoded[(b.generation, b.batch_id)], settled)
        if n:
            report.aborted[b.batch_id] = report.aborted.get(b.batch_id, 0) + n
        mark_committed(b)
        report.committed_batches.append(b.batch_id)
    for b in late:                          # 3. late writes in pruned batches: aborted, never committed
        n = 0
        for env in b.handles or []:
            sink.recover_and_abort(sink.decode_handle(env))
            n += 1
        for ballot in b.ballots:
            n += abort_lingering(sink, ballot.name, b.batch_id, ballot.intent, [], settled)
        log.warning("%s: %s was committed and its records pruned: the records found there now "
                    "are a deposed coordinator's late writes%s; aborted %d transactions, never committed",
                    committer.name, b.label, " (a decision among them)" if b.decided else "", n)
        if forget is not None:
            forget(b)
    if abort_undecided:                                                      # 4. undecided leftovers
        for b in ordered:
            if b.decided:
                continue
            n = 0
            if not b.ballots:  # a harness' model: one implicit ballot, aborted directly
                n = abort_lingering(sink, b.name, b.batch_id, b.intent, [], settled)
            for ballot in b.ballots:
                if ballot.outcome == ABORT or (close_ballot is None and ballot.outcome is None):
                    n += abort_lingering(sink, ballot.name, b.batch_id, ballot.intent, [], settled)
            if n:
                log.warning("%s: aborted %d transactions left by undecided %s", committer.name, n, b.label)
                report.aborted[b.batch_id] = report.aborted.get(b.batch_id, 0) + n
    return report


def _close_open_ballots(b: PendingBatch, close_ballot: Callable[[PendingBatch, int], dict[str, Any]]) -> None:
    """Close every open ballot of ``b``; a slot that holds a commit decision makes ``b`` decided."""
    for ballot in b.ballots:
        if ballot.outcome is not None:
            continue
        body = close_ballot(b, ballot.ballot)
        if body.get("outcome") == ABORT:
            ballot.outcome = ABORT
            continue
        ballot.outcome = COMMIT  # a decision written before our close: it stands
        if b.decided and b.ballot != ballot.ballot:
            raise LogError(f"{b.label} has commit decisions in ballots {b.ballot} and {ballot.ballot}: the "
                           "log was edited by hand or written by two coordinators without exclusive create")
        log.warning("%s: ballot %d was decided while recovery closed it (a late coordinator): it is "
                    "committed", b.label, ballot.ballot)
        b.handles = list(body.get("handles") or [])
        b.decided_at = float(body.get("written_at", time.time()))
        b.ballot, b.name, b.intent = ballot.ballot, ballot.name, ballot.intent


def finished_after_all(tlog: TransactionLog, batch_id: int, generation: int | None) -> str | None:
    """Read after a sink's verdict that every transaction of a decided batch is gone and none of it
    was ever visible (:class:`~twophase.errors.BatchVanishedError`): does the log show the batch
    finished after all?  Returns what it shows ("COMMITTED", "pruned") or None.

    Such a verdict rests on evidence that can be deleted (PostgreSQL's and MySQL's marker rows are
    pruned; a Kafka record can be compacted away).  A marker row is pruned only once the log holds
    its batch's COMMITTED record (or a pruned range, written only over COMMITTED batches), so a read
    of the log made *after* the sink found the marker absent sees that record, if that is why it
    was absent.  Then the batch is not vanished: someone committed it, all of it (COMMITTED is
    written only after every handle's commit), and voiding it would write it twice.  The listing
    first, then what was pruned, read afresh (a prune writes its range before it deletes records).
    """
    g = generation if generation is not None else tlog.generation
    if g is None:
        return None
    if tlog.view(batch_id, generation=g).committed is not None:
        return COMMITTED
    if tlog.is_pruned(batch_id, g, fresh=True):
        return "pruned"
    return None


def closer_for(tlog: TransactionLog, reason: str) -> Callable[[PendingBatch, int], dict[str, Any]]:
    """A ``close_ballot`` for :func:`recover_pending` that closes slots in ``tlog``.

    A ballot opened by a newer epoch than ``tlog``'s is never closed: its INTENT, written once and
    never changed, proves that a newer coordinator owns the log, so this one is deposed (a fenced
    driver retrying its batch, a paused plan step) and raises :class:`LogOwnershipError` instead of
    aborting the owner's ballot under it."""
    def close(b: PendingBatch, ballot: int) -> dict[str, Any]:
        info = next((x for x in b.ballots if x.ballot == ballot), None)
        if info is not None and info.epoch is not None and tlog.epoch is not None and info.epoch > tlog.epoch:
            raise LogOwnershipError(
                f"{b.label}: ballot {ballot} was opened by coordinator epoch {info.epoch}, newer than this one "
                f"(epoch {tlog.epoch}) of {tlog.url}: this one was deposed and leaves the owner's ballot alone")
        return tlog.close_ballot(b.batch_id, ballot, reason, generation=b.generation).body
    return close


def forgetter_for(tlog: TransactionLog) -> Callable[[PendingBatch], None]:
    """A ``forget`` for :func:`recover_pending`: deletes a pruned batch's late records from ``tlog``."""
    def forget(b: PendingBatch) -> None:
        tlog.forget_pruned(b.batch_id, generation=b.generation)
    return forget


def mark_committed_in(tlog: TransactionLog, how: dict[str, Any]) -> Callable[[PendingBatch], None]:
    """A ``mark_committed`` for :func:`recover_pending` that writes COMMITTED into ``tlog``."""
    def mark(b: PendingBatch) -> None:
        tlog.write(b.batch_id, COMMITTED, dict(how, at=time.time()), generation=b.generation)
    return mark


# -------------------------------------------------------------------- operator tools
def _open(log_url: str, storage_options: dict[str, Any] | None, takeover: bool) -> TransactionLog:
    TransactionLog(log_url, storage_options=storage_options, readonly=True)  # no log there: refused, nothing written
    tlog = TransactionLog(log_url, storage_options=storage_options)
    gens = tlog.generations()
    if not gens:
        raise LogError(f"{log_url} holds no log generation: nothing was ever written there")
    tlog.acquire(gens[-1]["query_id"], "twophase-recover", takeover=takeover)
    # A long recovery (many handles, a slow target) must not look dead to a driver started meanwhile.
    tlog.start_heartbeat()
    return tlog


def recover(log_url: str, sink: TwoPhaseCommitSink[Any, Any], *, storage_options: dict[str, Any] | None = None,
            takeover: bool = False, abort_only: bool = False, ignore_lost: bool = False,
            parallelism: int = 8) -> RecoveryReport:
    """``twophase recover``: commit decided batches of every generation, then abort leftovers.

    ``abort_only`` (``twophase abort-lingering``) refuses while a decided batch is not
    fully committed, since aborting first could abort it: run ``recover`` then.
    """
    tlog = _open(log_url, storage_options, takeover)
    try:
        pending = pending_batches(tlog)
        if abort_only:
            decided = [b for b in pending if b.decided]
            if decided:
                raise LogError(
                    f"{', '.join(b.label for b in decided)} of {log_url} "
                    f"{'is' if len(decided) == 1 else 'are'} decided but not fully committed. Aborting "
                    "leftovers first could abort transactions of a decided batch (sinks reuse transaction "
                    "names across batches), so abort-lingering refuses: run 'twophase recover', which "
                    "commits decided batches first and then aborts the leftovers.")
        committer = Committer(sink, parallelism=parallelism, ignore_lost=ignore_lost, where=log_url,
                              name="twophase recover")
        voided: list[int] = []
        finished_seen: list[int] = []
        while True:
            try:
                report = recover_pending(sink, pending, committer,
                                         mark_committed=mark_committed_in(tlog, {"recovered_by": "twophase recover"}),
                                         close_ballot=closer_for(tlog, "closed by twophase recover"),
                                         forget=forgetter_for(tlog), settled=Settled(tlog))
                report.voided = voided
                return report
            except BatchVanishedError as e:
                # A decided batch of the query's generation of which nothing exists or was ever
                # visible: its decision is void (as the coordinator records it), and the query's
                # replay runs the batch again.  An older generation's batch is never replayed by
                # Spark (its checkpoint was replaced): that stays data loss.
                if e.batch_id is None or e.ballot is None or e.generation != tlog.generation \
                        or e.batch_id in voided:
                    raise
                # rule: a void needs the log's word that the batch is not finished, read after the
                # sink's verdict (its evidence, marker rows, can be pruned once the batch is COMMITTED).
                finished = finished_after_all(tlog, e.batch_id, e.generation)
                if finished is not None:
                    log.warning("twophase recover: batch %d: its transactions are gone and no marker is left, but "
                                "the log shows it %s (another run committed it, then its markers were pruned): it "
                                "is not void and is not run again", e.batch_id, finished)
                    if e.batch_id in finished_seen:
                        raise
                    finished_seen.append(e.batch_id)  # once: a second verdict on it is raised
                    pending = pending_batches(tlog)
                    continue
                tlog.void_ballot(e.batch_id, e.ballot, str(e))
                log.warning("twophase recover: batch %d: its decision (ballot %d) is void: %s. The query runs it "
                            "again when Spark replays it.", e.batch_id, e.ballot, e)
                voided.append(e.batch_id)
                pending = pending_batches(tlog)
            except DataLossError as e:
                if e.batch_id is None:
                    raise
                # Part of a decided batch read as gone: by evidence that can be deleted once another
                # run committed the batch (a marker row pruned after its COMMITTED record)?
                # rule: data loss is reported only if the log, read after the verdict, does not show
                # the batch finished.
                if finished_after_all(tlog, e.batch_id, e.generation) is None or e.batch_id in finished_seen:
                    raise
                log.warning("twophase recover: batch %d: some of its transactions read as gone, but the log shows "
                            "it finished (another run committed it, then pruned its evidence): not data loss",
                            e.batch_id)
                finished_seen.append(e.batch_id)
                pending = pending_batches(tlog)
    finally:
        tlog.close()


def describe(log_url: str, storage_options: dict[str, Any] | None = None,
             sink: TwoPhaseCommitSink[Any, Any] | None = None) -> dict[str, Any]:
    """Everything ``twophase status`` shows, as JSON-able data (read-only: writes nothing)."""
    tlog = TransactionLog(log_url, storage_options=storage_options, readonly=True)
    now = time.time()
    lease = tlog.lease()
    gens = tlog.generations()
    out: dict[str, Any] = {
        "log": log_url,
        "generations": gens,
        "owner": None if lease is None else {
            "epoch": lease.epoch, "host": lease.host, "pid": lease.pid, "released": lease.released,
            "heartbeat_age_s": round(now - lease.heartbeat_at, 1), "query_id": lease.query_id},
        "batches": [],
    }
    latest = int(gens[-1]["generation"]) if gens else None
    for g in gens:
        gen = int(g["generation"])
        batches = tlog.batches(gen)
        for bid in sorted(batches):
            states = batches[bid]
            state = COMMITTED if COMMITTED in states else PREPARED if PREPARED in states else INTENT
            if gen != latest and state == COMMITTED:
                continue  # older generations: only what is still pending
            handles = states[PREPARED].handles if PREPARED in states else []
            rec = states[state]
            entry: dict[str, Any] = {
                "generation": gen, "batch_id": bid, "state": state, "handles": len(handles),
                "rows": (states[PREPARED].body.get("rows") if PREPARED in states else None),
                "age_s": round(now - rec.written_at, 1),
            }
            if state != COMMITTED:
                entry["pending_handles"] = handles
                if PREPARED in states:
                    age = now - states[PREPARED].written_at
                    entry["decided_age_s"] = round(age, 1)
                    if sink is not None and hasattr(sink, "pending_age_warning"):
                        warnings = []
                        for env in handles:
                            w = sink.pending_age_warning(sink.decode_handle(env), age)
                            if w:
                                warnings.append(w)
                        entry["warnings"] = warnings
            out["batches"].append(entry)
    last = tlog.last_committed(latest) if latest is not None else None
    out["last_committed"] = None if last is None else last.batch_id
    out["low_water"] = tlog.low_water(latest) if latest is not None else None
    out["pruned"] = tlog.pruned(latest) if latest is not None else []
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
