"""The driver's side of a batch in the crash machine (part of :mod:`twophase.testing.conformance`).

Once a batch's handles are back: the decision (PREPARED), the commits, run ``parallelism`` at
once as the coordinator's commit pool does through :class:`_HarnessCommitter` (which can make the
driver die part-way), COMMITTED, a failed job, the driver's death at a crash point, and a new
driver's recovery through the coordinator's own routine
(:func:`twophase.recovery.recover_pending`).  Runs in the test process (the harness' driver).
"""

from __future__ import annotations

import json
import threading
import time
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.errors import CommitError, DataLossError
from twophase.recovery import Committer, PendingBatch, recover_pending
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink
from twophase.testing._conformance_checks import _ConformanceChecks
from twophase.testing._conformance_model import BatchModel, _DriverDied
from twophase.testing._shared import MAX_TASK_ATTEMPTS, ConformanceError, _close, _span, note

if TYPE_CHECKING:
    from hypothesis import strategies as st
else:  # the install hint when the "testing" extra is missing
    st = require("hypothesis.strategies", "twophase.testing")


class _HarnessCommitter(Committer):
    """The coordinator's committer, which also tells the model what was committed and can make the
    driver die part-way through the commits (crash points ``mid_commit`` and during recovery).

    Commits still run ``parallelism`` at once, but nothing the model keeps (and so nothing a later
    precondition or draw sees) depends on which thread got there first, so that hypothesis replays
    an example exactly:

    - which handles are committed before the driver dies is decided up front by the draws
      (``survivors``: positions in the order the handles were tracked); the others never reach
      the sink, whatever the timing;
    - every commit of a call is awaited, then the results are applied to the model, noted and,
      for failures, raised in that fixed order (a failure of the sink before the driver's death).
    """

    def __init__(self, machine: _Decisions, parallelism: int, survivors: set[int] | None,
                 sink: TwoPhaseCommitSink | None = None):
        super().__init__(sink or machine.sink, parallelism=parallelism, retries=machine.commit_retries,
                         backoff=0.01, max_backoff=0.5, name=machine.query_name,
                         where="the harness' model of the log")
        self.machine = machine
        self.survivors = survivors  # None: the driver does not die, every handle is committed
        self.die_when_done = False   # the driver also dies once every survivor landed (after all commits)
        self.done = 0
        self.lock = threading.Lock()
        self.index: dict[str, tuple[BatchModel, int, int]] = {}  # key -> (batch, handle index, position)
        self.tracked = 0
        # Per commit() call, filled by the pool threads: position -> (handle, its result or exception).
        self.outcomes: dict[int, tuple[Any, CommitResult | BaseException]] = {}
        self.notes: list[str] = []  # hypothesis notes only in the test's thread

    def flush(self) -> None:
        notes, self.notes = self.notes, []
        for n in notes:
            note(n)

    def _key(self, handle: Any) -> str:
        return json.dumps(self.sink.encode_handle(handle), sort_keys=True)

    def track_all(self, pairs: list[tuple[BatchModel, list[Any]]], offset: int = 0) -> None:
        """Which decided handle (batch, index) each handle object is, to keep the model exact; its
        position (the order of tracking) is what ``survivors`` names."""
        for b, handles in pairs:
            for i, h in enumerate(handles):
                self.index.setdefault(self._key(h), (b, offset + i, self.tracked))
                self.tracked += 1

    def commit(self, batch_id: int, handles: list[Any], *, recovering: bool) -> list[CommitResult]:
        self.outcomes = {}
        try:
            results = super().commit(batch_id, handles, recovering=recovering)
        except BaseException as e:  # noqa: BLE001 - re-raised below, chosen in a fixed order
            if not self.outcomes:
                raise
            self._settle(batch_id, recovering)  # raises the call's first failure, in position order
            raise e  # nothing commit_one recorded failed: a BaseException of the sink, or the harness' bug
        self._settle(batch_id, recovering)
        return results

    def commit_one(self, batch_id: int, handle: Any, recovering: bool) -> CommitResult:
        """Runs in the commit pool: never touches the model, only records what happened."""
        _, _, pos = self.index[self._key(handle)]
        out: CommitResult | BaseException
        if self.survivors is not None and pos not in self.survivors:
            out = _DriverDied()
        else:
            try:
                out = super().commit_one(batch_id, handle, recovering)
            except Exception as e:  # noqa: BLE001 - recorded; _settle raises it in order
                out = e
        with self.lock:
            self.outcomes[pos] = (handle, out)
        if isinstance(out, BaseException):
            raise out
        return out

    def _settle(self, batch_id: int, recovering: bool) -> None:
        """Apply the call's outcomes to the model in position order; raise its first failure."""
        how = "recover_and_commit" if recovering else "commit"
        failure: BaseException | None = None
        died = False
        for pos in sorted(self.outcomes):
            handle, out = self.outcomes[pos]
            b, i, _ = self.index[self._key(handle)]
            desc = self.sink.describe_handle(handle)
            if isinstance(out, _DriverDied):
                died = True
                self.notes.append(f"  batch {batch_id}: {how}({desc}) never issued: the driver died first")
            elif isinstance(out, BaseException):
                self.notes.append(f"  batch {batch_id}: {how}({desc}) failed: {type(out).__name__}: {out}")
                failure = failure or self._conformance_error(out)
            else:
                self.notes.append(f"  batch {batch_id}: {how}({desc}) -> {out.outcome.value}")
                if i in b.committed_handles and out.outcome is CommitOutcome.COMMITTED:
                    self.notes.append(f"  (commit of {desc} again said COMMITTED, not ALREADY_COMMITTED: "
                                      "allowed, the output check decides)")
                b.committed_handles.add(i)
                self.done += 1
        self.outcomes = {}
        if failure is not None:
            raise failure
        if died or (self.die_when_done and self.survivors is not None and self.done >= len(self.survivors)):
            raise _DriverDied()

    def _conformance_error(self, e: BaseException) -> BaseException:
        if isinstance(e, DataLossError):
            return ConformanceError(f"{e} (last crash point: {self.machine.crash_point or 'none yet'})")
        if isinstance(e, CommitError):
            return ConformanceError(f"{e} (the harness retried like the coordinator)")
        if isinstance(e, TypeError):
            return ConformanceError(str(e))
        return e


class _Decisions(_ConformanceChecks):
    """Part of :class:`~twophase.testing.conformance.SinkConformanceMachine`: a batch's decision,
    its commits and COMMITTED, a failed job, the driver's death, and a new driver's recovery."""

    def _decide(self, b: BatchModel, data: Any, results: dict[int, str], assignment: dict[int, list[int]],
                crash_at: str | None) -> None:
        """The rest of a batch once its handles are back: verify, decide (PREPARED), commit, COMMITTED."""
        handles_now = [self.sink.decode_handle(json.loads(results[p])) for p in sorted(results)]
        try:
            self.sink.verify_prepared(b.batch_id, handles_now, prepare_started_at=time.time())
        except Exception as e:  # noqa: BLE001 - the coordinator fails the batch, undecided
            note(f"batch {b.batch_id}: verify_prepared refused the batch ({type(e).__name__}: {e})")
            return self._job_failed(b, None)
        if crash_at in ("after_pre_commit", "before_prepared_logged"):
            return self._crash(f"before_prepared_logged of batch {b.batch_id}")

        parts_done = sorted(results)
        b.prepared_json = json.dumps([json.loads(results[p]) for p in parts_done])
        b.handle_ids = [assignment[p] for p in parts_done]
        b.committed_handles = set()
        note(f"batch {b.batch_id}: PREPARED logged with {len(parts_done)} handles (the commit decision); "
             f"rows {_span(b.ids)} must now appear exactly once")
        if crash_at == "after_prepared_logged":
            return self._crash(f"after_prepared_logged of batch {b.batch_id}")

        handles = self._decided_handles(b)
        concurrent = self._draw(data, st.booleans(), "commit concurrently", True) and len(handles) > 1
        survivors = None  # the handles committed before the driver dies (None: it does not die here)
        if crash_at == "mid_commit" and handles:
            # Some land and some do not; of a batch of one handle, none or all (then as after_commit).
            lo, hi = (0, 1) if len(handles) == 1 else (1, len(handles) - 1)
            k = self._draw(data, st.integers(lo, hi), "commits before the crash", lo)
            # One after another, the first k land; at once, any k of them (which ones is drawn,
            # never left to the threads' timing, so that hypothesis can replay the example).
            order = self._draw(data, st.permutations(range(len(handles))), "commits that land first",
                               list(range(len(handles)))) if concurrent else range(len(handles))
            survivors = set(list(order)[:k])
        committer = _HarnessCommitter(self, self.commit_parallelism if concurrent else 1, survivors)
        committer.track_all([(b, handles)])
        if concurrent:
            self.stats["concurrent_commits"] += 1
        try:
            committer.commit(b.batch_id, handles, recovering=False)
        except ConformanceError:
            committer.flush()
            raise
        except _DriverDied:
            committer.flush()
            return self._crash(f"mid_commit of batch {b.batch_id} ({len(b.committed_handles)} of "
                               f"{len(handles)} handles committed)")
        committer.flush()
        self._check(f"after committing batch {b.batch_id}"
                    + (f" ({committer.parallelism} commits at once)" if concurrent else ""))
        if crash_at in ("after_commit", "mid_commit"):
            return self._crash(f"after_commit of batch {b.batch_id} (before COMMITTED is logged)")
        n = self.sink.abort_lingering(self.query_name, b.batch_id, json.loads(b.intent_json), handles)
        b.committed_logged = True
        self.current = None
        self.stats["committed_batches"] += 1
        if b.ids:
            self.committed_rows = True
        note(f"batch {b.batch_id}: abort_lingering(keep={len(handles)} handles) aborted {n}; COMMITTED logged")
        self._check(f"after batch {b.batch_id} finished", exact=True)

    def _job_failed(self, b: BatchModel, partition: int | None, why: str = "") -> None:
        """The job failed (a task failed MAX_TASK_ATTEMPTS times, or verify_prepared refused, or the
        driver path's transaction failed): the coordinator aborts the batch's leftovers at once and
        fails; Spark replays it later."""
        n = self.sink.abort_lingering(self.query_name, b.batch_id, json.loads(b.intent_json), [])
        self.stats["job_failures"] += 1
        why = why or (f"partition {partition} failed {MAX_TASK_ATTEMPTS} times" if partition is not None
                      else "verify_prepared refused it")
        self.faulted = True  # replayed later: by a replay_batch step or at the end of the example
        note(f"batch {b.batch_id}: the JOB FAILED ({why}); abort_lingering(keep=[]) aborted {n}; undecided")
        self._check(f"after batch {b.batch_id}'s job failed", exact=True)

    def _crash(self, where: str) -> None:
        """The driver dies (and with it every executor-side object): only the log and the storage stay."""
        self.crash_point = where
        self.crashed = True
        self.crashes_left -= 1
        self.stats["crashes"] += 1
        self.stats["crash: " + where.split(" ")[0]] += 1
        note(f"CRASH at {where}: driver and executors die, live objects are dropped")

    def _restart(self, data: Any) -> None:
        """A driver that died is restarted in the same step: a new driver, a new sink, recovery
        (:meth:`_recover`), again if it dies during recovery.

        Not a rule of its own: after a crash nothing but a restart can happen, and hypothesis'
        swarm testing turns rules off per example; a ``recover`` rule that was off ended every
        crashed example unchecked (hypothesis dropped it as invalid), about half of the crashes,
        so a sink whose bug shows only in a new driver's recovery was caught in 12-15 runs of 20."""
        while self.crashed:
            self._recover(data)

    def _recover(self, data: Any) -> None:
        how = "config" if self.rebuild_from_config and \
            self._draw(data, st.booleans(), "rebuild from to_config", False) else "factory"
        old = self.sink
        try:
            self.sink = self._new_sink(how)
        except NotImplementedError:
            how, self.sink = "factory", self._new_sink("factory")
        _close(old)  # the dead driver's connections: the OS would have closed them
        self.life += 1
        self.sink.open()
        self.stats["recoveries"] += 1
        note(f"RECOVER: new sink from {'to_config()/from_config()' if how == 'config' else 'sink_factory()'}")
        unfinished = [b for _, b in sorted(self.batches.items()) if not b.committed_logged]
        decided = [b for b in unfinished if b.decided]
        n_handles = sum(len(b.handle_ids) for b in decided)
        survivors = None
        if n_handles and self.crashes_left > 0 and \
                self._draw(data, st.booleans(), "crash again during recovery", False):
            # Handles are committed batch by batch, oldest first: the first k of them land (all of
            # them: the driver dies after its commits, before any COMMITTED is logged).
            k = self._draw(data, st.integers(0, n_handles), "recovery commits before the crash", 0)
            survivors = set(range(k))
        concurrent = self._draw(data, st.booleans(), "commit concurrently", True)
        committer = _HarnessCommitter(self, self.commit_parallelism if concurrent else 1, survivors)
        committer.die_when_done = survivors is not None and len(survivors) == n_handles
        committer.track_all([(b, self._decided_handles(b)) for b in decided])
        pending = [PendingBatch(generation=1, batch_id=b.batch_id, name=self.query_name,
                                intent=json.loads(b.intent_json), sink_kind=self.sink.kind,
                                handles=None if b.prepared_json is None else json.loads(b.prepared_json))
                   for b in unfinished]

        def mark(pb: PendingBatch) -> None:
            committer.flush()
            self.batches[pb.batch_id].committed_logged = True
            self.stats["committed_batches"] += 1
            if self.batches[pb.batch_id].ids:
                self.committed_rows = True
            note(f"  batch {pb.batch_id}: leftovers aborted, COMMITTED logged")

        try:
            report = recover_pending(self.sink, pending, committer, mark_committed=mark)
        except ConformanceError:
            committer.flush()
            raise
        except _DriverDied:
            committer.flush()
            self._crash(f"recovery ({committer.done} recovery commits done)")
            return
        committer.flush()
        note(f"  recovery aborted leftovers: {report.aborted or 'none'}")
        self.crashed = False
        self.faulted = True
        self._check(f"after recovery from the crash at {self.crash_point}", exact=True)
        if self.current is not None and self.current.committed_logged:
            self.current = None
