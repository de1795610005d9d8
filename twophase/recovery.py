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

What is pending (:func:`pending_batches`, :class:`PendingBatch`) lives in
:mod:`twophase.pending`, the commit of a decided batch's handles (:class:`Committer`) in
:mod:`twophase.committer`; this module holds the routine, its log-backed callbacks and the
operator tools, and re-exports the other two.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twophase import crash as crash
from twophase.committer import Committer
from twophase.errors import (
    BatchVanishedError,
    ConfigurationError,
    DataLossError,
    LogError,
    LogOwnershipError,
)
from twophase.errors import CommitError as CommitError
from twophase.evidence import Settled
from twophase.log import ABORT, COMMIT, COMMITTED, INTENT, PREPARED, TransactionLog
from twophase.log import BatchView as BatchView
from twophase.pending import BallotInfo as BallotInfo
from twophase.pending import PendingBatch, pending_batches
from twophase.pending import pending_from_view as pending_from_view
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink, abort_lingering

log = logging.getLogger("twophase.recovery")


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
