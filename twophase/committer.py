"""The commit of a decided batch's handles: :class:`Committer` (its order, retries and verdicts).

Runs on the driver (the coordinator's step 5, and :func:`twophase.recovery.recover_pending`,
which ``twophase recover`` runs too): the first handle alone, then the others in parallel,
transient failures retried with backoff, and what the sink's answers mean for the batch (data
loss, or a batch void as a whole because nothing of it is or was visible).
"""

from __future__ import annotations

import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

from twophase import crash
from twophase.errors import BatchVanishedError, CommitError, ConfigurationError, DataLossError
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink

log = logging.getLogger("twophase.recovery")  # as before the split: log filters and traces name it


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
