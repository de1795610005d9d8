"""One run of a batch's job in the crash machine (part of :mod:`twophase.testing.conformance`).

What Spark and the coordinator do between a batch's INTENT and its decision: the task attempts,
each on its own unpickled copy of the sink as on an executor (pre-committing, failing cleanly,
dying mid-write or before reporting, and retried), the coordinator's driver path
(``task_input="driver"``: the driver's own sink object writes a one-partition ballot), a sink's
``prepare_batch`` taking the whole batch over, and where the driver may die meanwhile.  The draw
mixes (task outcomes, crash points) live here, where they are drawn.
"""

from __future__ import annotations

import json
import logging
import pickle
import warnings
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.context import BatchContext, TransactionContext
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._conformance_commits import _Decisions
from twophase.testing._conformance_model import (
    Attempt,
    BatchModel,
    ConformanceWarning,
    _FrameNeeded,
    _NoFrame,
)
from twophase.testing._shared import (
    ABORT,
    DIE_AFTER_PRE_COMMIT,
    DIE_MID_WRITE,
    MAX_TASK_ATTEMPTS,
    PRE_COMMIT,
    ConformanceError,
    _close,
    _dumps_sink,
    _span,
    _split,
    note,
)

if TYPE_CHECKING:
    from hypothesis import strategies as st
else:  # the install hint when the "testing" extra is missing
    st = require("hypothesis.strategies", "twophase.testing")

_log = logging.getLogger("twophase.testing")

# The four task outcomes (twophase/testing/_shared.py: how a task attempt ends).
TASK_OUTCOMES = (PRE_COMMIT, ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE)
# Mostly successes (the first element is where hypothesis shrinks to); a task that fails mostly
# fails cleanly (its abort() runs), as an exception in a Spark task does.
_OUTCOME_MIX = (PRE_COMMIT,) * 5 + (ABORT, ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE)

# Where the driver can die inside a batch: the coordinator's crash points (twophase/crash.py).
CRASH_POINTS = ("after_intent", "after_pre_commit", "before_prepared_logged", "after_prepared_logged",
                "mid_commit", "after_commit")
#: What a batch with rows draws while the example may still crash: no crash in 4 of 13, each point
#: before the decision in 1, each after it in 2 (a decided batch recovered by a new driver's sink
#: object is where sinks' bugs hide: commit paths that lean on state only the deciding driver had).
_CRASH_MIX = (None,) * 4 + CRASH_POINTS + CRASH_POINTS[3:]
#: What the first batch of every example draws: the same points without "no crash", so that every
#: example reaches a driver crash and a new driver's recovery (or, if its tasks fail 4 times before
#: the crash point, a failed job and its replay) by construction, however few steps it has.
_FIRST_CRASH_MIX = CRASH_POINTS + CRASH_POINTS[3:]


class _BatchRuns(_Decisions):
    """Part of :class:`~twophase.testing.conformance.SinkConformanceMachine`: one run of a batch's
    job, from its INTENT to the handles its decision takes (or the driver's death before)."""

    def _execute(self, b: BatchModel, data: Any) -> None:
        """One run of a batch's job, then (unless the driver dies) its decision and commits."""
        b.runs += 1
        run = f"l{self.life}r{b.runs}"
        parts = b.num_partitions if b.runs == 1 else \
            self._draw(data, st.integers(1, b.num_partitions), "replay partitions", b.num_partitions)
        # The first rows go round-robin (every partition gets work when there are rows enough),
        # the rest where hypothesis puts them.
        spread = min(parts, len(b.ids))
        where = [i % parts for i in range(spread)] + self._draw(
            data, st.lists(st.integers(0, parts - 1), min_size=len(b.ids) - spread, max_size=len(b.ids) - spread),
            "row partitions", [i % parts for i in range(spread, len(b.ids))])
        assignment: dict[int, list[int]] = {p: [] for p in range(parts)}
        for i, p in zip(b.ids, where):
            assignment[p].append(i)
        note(f"batch {b.batch_id} run {b.runs} over {parts} partitions: "
             + "; ".join(f"p{p}={_span(v)}" for p, v in sorted(assignment.items())))
        crash_at = None
        if self.crashes_left > 0 and b.ids:  # a crash in an empty batch rarely shows anything: ration them
            crash_at = self._draw(data, st.sampled_from(_FIRST_CRASH_MIX if self.first_batch else _CRASH_MIX),
                                  "driver dies at", None)
        self.first_batch = False
        if crash_at == "after_intent":
            return self._crash(f"after_intent of batch {b.batch_id}")
        if self.make_frame is not None:
            ctx = BatchContext(self.query_name, b.batch_id, json.loads(b.intent_json), run)
            whole = self.sink.prepare_batch(self.make_frame(b.ids, parts), ctx)
            if whole is not None:
                return self._prepared_whole(b, data, whole, run, crash_at)
        elif not type(self)._frame_probed:
            type(self)._frame_probed = True
            self._probe_prepare_batch(BatchContext(self.query_name, b.batch_id, json.loads(b.intent_json), run))

        # The coordinator never takes the driver path for a sink whose prepare_batch takes batches over.
        if self.driver_path and parts == 1 and b.ids and not self.sink.prepares_batches() and self._draw(
                data, st.sampled_from((False, True)), "prepared in the driver (task_input='driver')", False):
            return self._driver_prepared(b, data, run, crash_at)

        shipped = _dumps_sink(self.sink)  # what Spark serialises into the job, once per job
        todo = [p for p in range(parts) if assignment[p]]  # an empty partition opens no transaction
        die_after_tasks = None
        if crash_at == "after_pre_commit" and len(todo) > 1:
            die_after_tasks = self._draw(data, st.integers(1, len(todo) - 1), "tasks done before the crash", 1)
        attempts = {p: 0 for p in todo}
        results: dict[int, str] = {}
        if len(todo) > 1:
            self.stats["batches with 2+ tasks"] += 1
        while todo:
            # One wave of tasks: how each attempt ends is drawn first, then the order they end in.
            # Spark runs them in parallel, so a failure often comes after siblings pre-committed.
            ends = {p: self._draw(data, st.sampled_from(_OUTCOME_MIX),
                                  f"outcome of p{p} attempt {attempts[p]}", PRE_COMMIT) for p in todo}
            order = self._draw(data, st.permutations(todo), "task order", list(todo))
            if self._draw(data, st.sampled_from((True, True, False)), "failures end after the successes", True):
                order = sorted(order, key=lambda q: ends[q] != PRE_COMMIT)
            for p in order:
                outcome, envelope = self._run_attempt(b, p, attempts[p], assignment[p], run, shipped, data,
                                                      ends[p])
                attempts[p] += 1
                if outcome == PRE_COMMIT:
                    assert envelope is not None  # a pre-committed attempt returns its handle
                    results[p] = envelope
                    todo.remove(p)
                    if die_after_tasks is not None and len(results) >= die_after_tasks:
                        return self._crash(f"after_pre_commit of batch {b.batch_id} ({len(results)} of "
                                           f"{len(results) + len(todo)} tasks done)")
                elif results and attempts[p] == 1:
                    self.stats["task failures after a sibling pre-committed"] += 1
                if outcome != PRE_COMMIT and attempts[p] >= MAX_TASK_ATTEMPTS:
                    return self._job_failed(b, p)
        return self._decide(b, data, results, assignment, crash_at)

    def _driver_prepared(self, b: BatchModel, data: Any, run: str, crash_at: str | None) -> None:
        """The coordinator's driver path (``task_input="driver"``, a ballot planned for one partition):
        no task; the driver's own sink object (not a pickled copy) begins partition 0 attempt 0 of
        the ballot's run, writes every row, pre-commits, and decides.  A failure while writing
        aborts it there (``run_transaction``) and fails the batch, undecided, like a failed job; the
        driver dying mid-write leaves a begun transaction, and ``after_pre_commit`` on this path is
        the driver itself dying with its one transaction pre-committed and undecided: both are
        recovery's to abort, from the INTENT."""
        ctx = TransactionContext(self.query_name, b.batch_id, 0, 0, json.loads(b.intent_json), run)
        chunks = _split(b.ids, self._draw(data, st.integers(1, 3), "arrow batches", 1))
        ends = (PRE_COMMIT,) * 3 + (ABORT,) + ((DIE_MID_WRITE,) if self.crashes_left > 0 else ())
        outcome = self._draw(data, st.sampled_from(ends), "the driver's transaction ends", PRE_COMMIT)
        if outcome == DIE_MID_WRITE:
            chunks = chunks[:self._draw(data, st.integers(0, len(chunks)), "chunks written before death", 0)]
        rec = Attempt(0, 0, outcome, [i for c in chunks for i in c], life=self.life, run=run)
        b.attempts.append(rec)
        self.stats["driver-prepared batches"] += 1
        label = f"{rec.label(b.batch_id)} (in the driver)"
        before = self._pending() if outcome == ABORT else None
        txn = self.sink.begin_transaction(ctx)
        for chunk in chunks:
            self.sink.write(txn, self.make_batch(chunk))
        if outcome == DIE_MID_WRITE:
            del txn
            note(f"{label}: wrote {_span(rec.ids)}, then the driver DIED mid-write")
            return self._crash(f"mid-write of batch {b.batch_id} on the driver path")
        if outcome == ABORT:
            self.sink.abort(txn)
            note(f"{label}: wrote {_span(rec.ids)}, then the write FAILED and abort() ran in the driver")
            self._check_aborted(before, rec, b)
            self._check(f"after {label} was aborted")
            return self._job_failed(b, None, "its transaction in the driver failed")
        handle = self.sink.pre_commit(txn)
        del txn
        envelope = self._round_trip(self.sink, handle, label)
        rec.handle_desc = self.sink.describe_handle(self.sink.decode_handle(json.loads(envelope)))
        note(f"{label}: pre-committed {rec.handle_desc} with rows {_span(b.ids)}")
        self._check(f"after {label} pre-committed")
        if crash_at == "after_pre_commit":
            self.stats["driver-prepared: driver died after its pre-commit"] += 1
            return self._crash(f"after_pre_commit of batch {b.batch_id} (driver path: the driver itself, its "
                               "transaction pre-committed and undecided)")
        return self._decide(b, data, {0: envelope}, {0: list(b.ids)}, crash_at)

    def _probe_prepare_batch(self, ctx: BatchContext) -> None:
        """Without ``make_frame``, whether the sink writes its batches from the driver in a query
        (its ``prepare_batch`` takes them over), a path this run then does not drive: asked once per
        run, with a DataFrame stand-in that raises when used.  If it is used, the run warns
        (:class:`ConformanceWarning`) and its statistics say so (``prepare_batch not driven``)."""
        if type(self.sink).prepare_batch is TwoPhaseCommitSink.prepare_batch:
            return  # per-task transactions only: the path the harness drives
        try:
            whole = self.sink.prepare_batch(_NoFrame(), ctx)
        except Exception as e:  # noqa: BLE001 - _FrameNeeded, or whatever it failed with on the stand-in
            why = "it used the DataFrame" if isinstance(e, _FrameNeeded) else f"it raised {type(e).__name__}: {e}"
        else:
            if whole is None:
                return  # this sink, so configured, runs per-task transactions: the path driven here
            why = "it returned handles without reading the DataFrame"
        self.stats["prepare_batch not driven"] += 1
        msg = (f"{self._sink_name()}.prepare_batch takes batches over in a query ({why}), but no make_frame "
               "was given: this run drove the per-task transactions (begin_transaction ... pre_commit) "
               "only, not the path the sink writes with. Pass make_frame=(ids, partitions) -> a Spark "
               "DataFrame to drive prepare_batch, or configure the sink for per-task transactions "
               "(FileSink: writer='arrow') to say that this is the path under test.")
        note(msg)
        _log.warning("%s", msg)
        warnings.warn(ConformanceWarning(msg), stacklevel=2)

    def _prepared_whole(self, b: BatchModel, data: Any, whole: Any, run: str, crash_at: str | None) -> None:
        """The sink prepared the whole batch with one Spark job of its own (``prepare_batch``).

        Which rows each handle carries is the sink's business, so any committed handle of a batch
        allows all of that batch's rows (duplicates, rows of undecided batches and, at quiescent
        checks, missing rows are still caught).
        """
        if whole.rows != len(b.ids):
            raise ConformanceError(
                f"batch {b.batch_id}: prepare_batch reported {whole.rows} rows for a batch of {len(b.ids)}")
        rec = Attempt(-1, 0, PRE_COMMIT, list(b.ids), life=self.life, run=run)
        b.attempts.append(rec)
        self.stats["whole-batch jobs"] += 1
        results: dict[int, str] = {}
        for i, h in enumerate(whole.handles):
            results[i] = self._round_trip(self.sink, h, f"batch {b.batch_id} handle {i}")
        rec.handle_desc = f"{len(results)} handles"
        note(f"batch {b.batch_id}: prepare_batch pre-committed {len(results)} handles with rows {_span(b.ids)}")
        self._check(f"after batch {b.batch_id} was prepared whole")
        return self._decide(b, data, results, {i: list(b.ids) for i in results}, crash_at)

    def _run_attempt(self, b: BatchModel, p: int, attempt: int, ids: list[int], run: str, shipped: bytes,
                     data: Any, outcome: str) -> tuple[str, str | None]:
        """One Spark task attempt, on its own unpickled copy of the sink (as on an executor)."""
        ctx = TransactionContext(self.query_name, b.batch_id, p, attempt, json.loads(b.intent_json), run)
        chunks = _split(ids, self._draw(data, st.integers(1, 3), "arrow batches", 1))
        if outcome == DIE_MID_WRITE:
            chunks = chunks[:self._draw(data, st.integers(0, len(chunks)), "chunks written before death", 0)]
        rec = Attempt(p, attempt, outcome, [i for c in chunks for i in c], life=self.life, run=run)
        b.attempts.append(rec)
        self.stats["task_attempts"] += 1
        if attempt:
            self.stats["task_retries"] += 1
        if outcome != PRE_COMMIT:
            self.stats["task_failures"] += 1
        before = self._pending() if outcome == ABORT else None
        executor = pickle.loads(shipped)
        try:
            txn = executor.begin_transaction(ctx)
            for chunk in chunks:
                executor.write(txn, self.make_batch(chunk))
            if outcome == DIE_MID_WRITE:
                del txn  # the executor is gone: no abort, no pre_commit; recovery must clean up
                note(f"{rec.label(b.batch_id)}: wrote {_span(rec.ids)}, then the executor DIED (no abort)")
                self._check(f"after {rec.label(b.batch_id)} died mid-write")
                return outcome, None
            if outcome == ABORT:
                executor.abort(txn)
                note(f"{rec.label(b.batch_id)}: wrote {_span(rec.ids)}, then the task FAILED and abort() ran")
                self._check_aborted(before, rec, b)
                self._check(f"after {rec.label(b.batch_id)} was aborted")
                return outcome, None
            handle = executor.pre_commit(txn)
            del txn
            envelope_json = self._round_trip(executor, handle, rec.label(b.batch_id))
        finally:
            _close(executor)
        rec.handle_desc = self.sink.describe_handle(self.sink.decode_handle(json.loads(envelope_json)))
        if outcome == DIE_AFTER_PRE_COMMIT:
            note(f"{rec.label(b.batch_id)}: pre-committed {rec.handle_desc} with rows {_span(rec.ids)}, then "
                 "the executor DIED before reporting it; Spark will retry the task")
            self._check(f"after {rec.label(b.batch_id)} pre-committed (handle never reached the driver)")
            return outcome, None
        note(f"{rec.label(b.batch_id)}: pre-committed {rec.handle_desc} with rows {_span(ids)}")
        self._check(f"after {rec.label(b.batch_id)} pre-committed")
        return outcome, envelope_json
