"""The sink conformance harness: a hypothesis state machine that plays coordinator, executors and crashes.

Runs in the test process, without Spark: it calls the sink's methods directly,
in the orders the coordinator (coordinator/coordinator.py) and Spark produce, and
checks what a reader sees through the user's ``read_committed``.  What Spark does
to a sink is reproduced where it matters: executor-side methods run on a pickled
copy of the sink (one per task attempt), driver-side methods on the driver's
object; a batch's handles are committed concurrently, as the coordinator's commit
pool does; recovery after a crash goes through the very routine the coordinator
and ``twophase recover`` use (:func:`twophase.recovery.recover_pending`).
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import pickle
import random
import sys
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.context import BatchContext, TransactionContext
from twophase.errors import CommitError, DataLossError, HandleError
from twophase.recovery import Committer, PendingBatch, recover_pending
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink
from twophase.testing._shared import (  # the names both state machines use; re-exported here
    ABORT,
    DIE_AFTER_PRE_COMMIT,
    DIE_MID_WRITE,
    ID_SPAN,
    MAX_TASK_ATTEMPTS,
    PRE_COMMIT,
    ConformanceError,
    _close,
    _dumps_sink,
    _format_stats,
    _span,
    _split,
    _story,
    check_reach,
    default_id_of,
    default_make_batch,
    default_settings,
    example_id_base,
    note,
)

if TYPE_CHECKING:
    import hypothesis
    from hypothesis import stateful
    from hypothesis import strategies as st
else:  # the install hint when the "testing" extra is missing
    hypothesis = require("hypothesis", "twophase.testing")
    st = require("hypothesis.strategies", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

_log = logging.getLogger("twophase.testing")
rule, precondition, initialize = stateful.rule, stateful.precondition, stateful.initialize

SinkFactory = Callable[[], TwoPhaseCommitSink]

#: Batch ids of example n are n * BATCH_SPAN + k.
BATCH_SPAN = 1_000

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


class _DriverDied(BaseException):
    """Raised inside a commit to stop the driver there (a crash point); never caught as an error."""


class ConformanceWarning(UserWarning):
    """The run passed but did not drive the path the sink takes in a query (e.g. its ``prepare_batch``
    wants a Spark DataFrame and no ``make_frame`` was given): what was proven is named in the message."""


class _FrameNeeded(Exception):
    """Raised by :class:`_NoFrame` when the sink's ``prepare_batch`` uses the DataFrame it was given."""


class _NoFrame:
    """What the harness hands ``prepare_batch`` when it has no ``make_frame``: any use of it raises
    :class:`_FrameNeeded`, which tells the harness that the sink writes batches from the driver."""

    def _used(self, *_: Any, **__: Any) -> Any:
        raise _FrameNeeded("prepare_batch used the DataFrame")

    __getattr__ = __iter__ = __len__ = __bool__ = __getitem__ = _used


@dataclass
class Attempt:
    """One task attempt of one partition, as the harness ran it."""

    partition: int
    attempt: int
    outcome: str
    ids: list[int]
    handle_desc: str = ""
    life: int = 0
    run: str = ""

    def label(self, batch_id: int) -> str:
        return f"batch {batch_id} partition {self.partition} attempt {self.attempt}"


@dataclass
class BatchModel:
    """The coordinator's and the log's view of one batch."""

    batch_id: int
    ids: list[int]
    intent_json: str
    num_partitions: int               # as planned in the INTENT
    attempts: list[Attempt] = field(default_factory=list)
    runs: int = 0
    prepared_json: str | None = None  # the PREPARED record: the decision
    handle_ids: list[list[int]] = field(default_factory=list)      # rows of each decided handle
    committed_handles: set[int] = field(default_factory=set)       # indexes into the decision
    committed_logged: bool = False

    @property
    def decided(self) -> bool:
        return self.prepared_json is not None


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

    def __init__(self, machine: SinkConformanceMachine, parallelism: int, survivors: set[int] | None,
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


class SinkConformanceMachine(stateful.RuleBasedStateMachine):
    """Drives one sink through batches, task failures, driver crashes and recoveries.

    Configure through :func:`make_state_machine`; the class attributes below are
    filled in there.  One hypothesis example = one fresh query name, a fresh range
    of row ids and fresh batch ids, so examples never see each other's rows.

    One ``run_batch`` step is a whole micro-batch as Spark and the coordinator run
    it: INTENT, task attempts (failures and retries included), the decision,
    concurrent commits, COMMITTED; a drawn crash point may stop the driver inside
    it.  Crashes are rationed per example, so most batches run to the end.
    """

    sink_factory: SinkFactory
    read_committed: Callable[[], Iterable[Any]]
    make_batch: Callable[[list[int]], Any] = staticmethod(default_make_batch)
    make_frame: Callable[[list[int], int], Any] | None = None
    id_of: Callable[[Any], int] = staticmethod(default_id_of)
    reset: Callable[[], None] | None = None
    pending: Callable[[], Iterable[Any]] | None = None
    max_rows: int = 12
    max_partitions: int = 3
    check_every_step: bool = True
    settle_timeout: float = 0.0
    commit_retries: int = 5
    commit_parallelism: int = 8
    query_prefix: str = "conformance"
    rebuild_from_config: bool = True
    #: Drive the coordinator's driver path too: a batch planned for one partition is, half the time,
    #: written by the driver's own sink object instead of a task's pickled copy (see _driver_prepared).
    driver_path: bool = True

    _run_token: str = ""
    _examples: itertools.count
    _id_floor: int | None = None
    _frame_probed: bool = False
    stats: Counter
    failures: list[str]
    first_story: list[str]

    def __init__(self) -> None:
        super().__init__()
        self._sink: TwoPhaseCommitSink | None = None
        self.shipped: bytes = b""
        self.batches: dict[int, BatchModel] = {}
        self.current: BatchModel | None = None
        self.crashed = False
        self.crash_point = ""
        self.life = 0
        self.crashes_left = 0
        self.committed_rows = False
        self.faulted = False       # a driver crash was recovered, or a failed job replayed, in this example
        self.first_batch = False   # the batch being run is the example's first (it draws a crash for sure)

    # ================================================================ set-up
    @initialize(data=st.data())
    def start_query(self, data: Any) -> None:
        cls = type(self)
        n = next(cls._examples)
        _story.clear()
        self.example = n
        self.query_name = f"{self.query_prefix}-{self._run_token}-{n}"
        self.id_base = example_id_base(self, n)
        self.next_id = self.id_base
        self.next_batch = n * BATCH_SPAN
        self.last_batch = self.next_batch + BATCH_SPAN - 1
        self.pending_baseline = self._pending()
        self.crashes_left = data.draw(st.integers(1, 2), label="driver crashes this example may have")
        self.sink = self._new_sink("factory")
        self.sink.open()
        note(f"query {self.query_name}: sink {self._sink_name()} opened; row ids from {self.id_base}; "
             f"up to {self.crashes_left} driver crash(es)")
        # The example's first batch runs here, in the step hypothesis always runs (it also ends
        # examples after this one step, or with every rule turned off by its swarm testing): it has
        # rows, and the driver dies in it (_FIRST_CRASH_MIX), so that every example, however short,
        # commits rows of its own and goes through a crash and a recovery (or a failed job and its
        # replay), which the run's check in run_sink_conformance counts.
        self._run_batch(data, first=True)

    @property
    def sink(self) -> TwoPhaseCommitSink:
        """The driver's sink object: made by the first rule, dropped when the example ends."""
        if self._sink is None:
            raise RuntimeError("the conformance machine has no sink outside an example")
        return self._sink

    @sink.setter
    def sink(self, sink: TwoPhaseCommitSink) -> None:
        self._sink = sink

    def _new_sink(self, how: str) -> TwoPhaseCommitSink:
        if how == "config" and self._sink is not None:
            cls = type(self.sink)
            config = json.loads(json.dumps(self.sink.to_config()))
            return cls.from_config(config)
        sink = self.sink_factory()
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConformanceError(f"sink_factory returned {type(sink).__name__}, not a TwoPhaseCommitSink")
        return sink

    def _sink_name(self) -> str:
        return f"{type(self.sink).__name__}(kind={self.sink.kind!r})"

    @staticmethod
    def _draw(data: Any, strategy: Any, label: str, default: Any) -> Any:
        """A hypothesis draw, or ``default`` when the teardown finishes an example without drawing."""
        return default if data is None else data.draw(strategy, label=label)

    # ================================================================ rules
    def _room(self) -> bool:
        return self.next_batch < self.last_batch - 1 and self.next_id + self.max_rows < self.id_base + ID_SPAN

    @precondition(lambda self: not self.crashed and self.current is None and self._room())
    @rule(data=st.data())
    def run_batch(self, data: Any) -> None:
        """A micro-batch as the coordinator runs it: INTENT, tasks (failing and retried), decision,
        concurrent commits, COMMITTED; a drawn crash point may stop the driver anywhere inside."""
        self._run_batch(data)

    def _run_batch(self, data: Any, first: bool = False) -> None:
        empty = self.max_rows == 0 or (not first and self._draw(
            data, st.sampled_from((False,) * 7 + (True,)), "empty batch", False))
        rows = 0 if empty else self._draw(data, st.integers(1, self.max_rows), "rows", 1)
        # Most batches have several tasks (shrinking goes to two): what siblings do to each other matters.
        choices = sorted(range(1, self.max_partitions + 1), key=lambda k: (k != 2, k))
        self.first_batch = first
        self._new_batch(data, rows, self._draw(data, st.sampled_from(choices), "partitions", choices[0]))
        self._restart(data)

    def _new_batch(self, data: Any, n_rows: int, parts: int) -> None:
        bid = self.next_batch
        self.next_batch += 1
        ids = list(range(self.next_id, self.next_id + n_rows))
        self.next_id += n_rows
        intent = self.sink.plan_batch(self.query_name, bid, parts)
        try:
            intent_json = json.dumps(intent, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConformanceError(f"plan_batch({bid}) returned an INTENT that is not plain JSON: {e}") from None
        if self.sink.plan_superseded(intent):
            raise ConformanceError(f"plan_superseded() is True for batch {bid}'s INTENT right after plan_batch "
                                   "made it, with no plan since: the owner would run every batch again")
        b = BatchModel(bid, ids, intent_json, parts)
        self.batches[bid] = b
        self.current = b
        self.stats["batches"] += 1
        note(f"batch {bid}: INTENT logged ({parts} partitions planned), rows {_span(ids)}")
        self._execute(b, data)

    @precondition(lambda self: not self.crashed and self.current is not None and not self.current.decided)
    @rule(data=st.data())
    def replay_batch(self, data: Any) -> None:
        """Spark replays the undecided batch: the coordinator reuses its INTENT and aborts what earlier
        runs left, then runs it again (same rows, maybe other partitions, attempts from 0 again)."""
        self._replay(data)
        self._restart(data)

    def _replay(self, data: Any) -> None:
        b = self.current
        assert b is not None
        n = self.sink.abort_lingering(self.query_name, b.batch_id, json.loads(b.intent_json), [])
        self.stats["replays"] += 1
        note(f"batch {b.batch_id} REPLAYED: abort_lingering(keep=[]) aborted {n}")
        self._check(f"after abort_lingering before replaying batch {b.batch_id}")
        self._execute(b, data)

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

    @precondition(lambda self: not self.crashed and any(b.committed_handles for b in self.batches.values()))
    @rule(data=st.data())
    def commit_again(self, data: Any) -> None:
        """Commit an already committed handle again (a retry after a lost reply, or a replay): a no-op.
        Sometimes from a new sink object, as a driver restarted after its commits landed (a crash
        before COMMITTED was logged) commits them again in its recovery."""
        choices = [(bid, i) for bid, b in sorted(self.batches.items()) for i in sorted(b.committed_handles)]
        bid, i = data.draw(st.sampled_from(choices), label="committed handle")
        recovering = data.draw(st.booleans(), label="via recover_and_commit")
        fresh = data.draw(st.booleans(), label="by a new sink object (a restarted driver)")
        b = self.batches[bid]
        sink = self._new_sink("factory") if fresh else self.sink
        try:
            if fresh:
                sink.open()
                note(f"a new sink object (a restarted driver) commits a handle of batch {bid} again")
            handle = sink.decode_handle(json.loads(b.prepared_json or "[]")[i])
            committer = _HarnessCommitter(self, 1, None, sink=sink)
            committer.track_all([(b, [handle])], offset=i)
            try:
                committer.commit(bid, [handle], recovering=recovering)
            finally:
                committer.flush()
        finally:
            if fresh:
                _close(sink)
        self._check(f"after committing a handle of batch {bid} a second time"
                    + (" from a new sink object" if fresh else ""), exact=self._quiescent())

    @precondition(lambda self: not self.crashed and any(b.committed_logged for b in self.batches.values()))
    @rule(data=st.data())
    def abort_lingering_again(self, data: Any) -> None:
        """abort_lingering on a finished batch again (a replay of a finished batch): must keep its data."""
        bid = data.draw(st.sampled_from([k for k, b in sorted(self.batches.items()) if b.committed_logged]),
                        label="finished batch")
        b = self.batches[bid]
        handles = self._decided_handles(b)
        n = self.sink.abort_lingering(self.query_name, bid, json.loads(b.intent_json), handles)
        note(f"batch {bid}: abort_lingering again (keep {len(handles)} handles) aborted {n}")
        self._check(f"after abort_lingering ran again on finished batch {bid}", exact=self._quiescent())

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

    # ================================================================ teardown
    def teardown(self) -> None:
        """Finish the example as a restarted query would, then run one clean batch, and check it all.

        Every example thus ends with a committed batch and a verified, quiescent store; a
        failure here is a failure of the sink like any other.
        """
        try:
            failure = sys.exc_info()[1]
            if isinstance(failure, ConformanceError):
                self._record_failure(failure)
            if self._sink is None:
                return
            if failure is not None:
                # The example failed, or hypothesis stopped it half-way: nothing to check, but
                # nothing may stay open either (a prepared transaction would block the next
                # example's reset, e.g. a TRUNCATE, for ever).
                self._quiesce()
                return
            for _ in range(5):  # a recovery or replay here never crashes nor fails a task
                if self.crashed:
                    self._recover(None)
                elif self.current is not None and not self.current.decided:
                    self._replay(None)
                else:
                    break
            self.stats["examples"] += 1  # valid examples (hypothesis discards some it stops half-way)
            if self.committed_rows:  # by its own batches (recovered ones too), before the closing batch
                self.stats["examples_with_committed_rows"] += 1
            if self.faulted:
                self.stats["examples_with_crash_or_job_failure"] += 1
            if not self.crashed and self.current is None and self.next_batch < self.last_batch:
                self._new_batch(None, max(1, self.max_rows // 2), self.max_partitions)
            if self.crashed or self.current is not None:
                raise ConformanceError(f"the example could not be finished: {self.crash_point or 'batch pending'}")
            self._check("at the end of the example", exact=True)
        except ConformanceError as e:
            self._record_failure(e)
            raise
        finally:
            _close(self._sink)
            self._sink = None

    # ================================================================ helpers
    def _quiesce(self) -> None:
        """Best effort, no checks: finish decided batches and abort every other transaction of
        this example, through a fresh sink and the coordinator's recovery routine."""
        unfinished = [b for b in self.batches.values() if not b.committed_logged and b.intent_json]
        if not unfinished:
            return
        sink = None
        try:
            sink = self._new_sink("factory")
            sink.open()
            pending = [PendingBatch(generation=1, batch_id=b.batch_id, name=self.query_name,
                                    intent=json.loads(b.intent_json), sink_kind=sink.kind,
                                    handles=None if b.prepared_json is None else json.loads(b.prepared_json))
                       for b in unfinished]
            committer = Committer(sink, parallelism=1, retries=self.commit_retries, backoff=0.01,
                                  max_backoff=0.5, name=self.query_name, where="the harness' model of the log")
            recover_pending(sink, pending, committer, mark_committed=lambda pb: None)
        except BaseException as e:  # noqa: BLE001 - the example's own failure is what gets reported
            _log.warning("%s: could not clean up after the example stopped: %s: %s", self.query_name,
                         type(e).__name__, e)
        finally:
            _close(sink)

    def _record_failure(self, e: BaseException) -> None:
        if not self.failures:
            self.first_story.extend(_story)
        self.failures.append(str(e))

    def _decided_handles(self, b: BatchModel) -> list[Any]:
        """The decision's handles as a driver reads them back from the log (fresh objects from JSON)."""
        if b.prepared_json is None:
            raise ConformanceError(f"batch {b.batch_id} has no decision yet")  # the harness' own bug
        return [self.sink.decode_handle(env) for env in json.loads(b.prepared_json)]

    def _round_trip(self, executor: TwoPhaseCommitSink, handle: Any, label: str) -> str:
        """The handle as it travels: encoded on the executor, JSON text, decoded on the driver.
        Also: unknown handle versions are refused."""
        envelope = executor.encode_handle(handle)
        try:
            text = json.dumps(envelope, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ConformanceError(f"{label}: encode_handle() is not plain JSON: {e}") from None
        back = json.loads(text)
        decoded = self.sink.decode_handle(back)
        if back.get("v") == self.sink.handle_version:
            again = json.dumps(self.sink.encode_handle(decoded), allow_nan=False, sort_keys=True)
            if again != text:
                raise ConformanceError(f"{label}: a handle does not survive a JSON round trip:\n"
                                       f"  logged:   {text}\n  re-encoded: {again}")
        bogus = dict(back, v=999)
        try:
            self.sink.decode_handle(bogus)
        except HandleError:
            pass
        else:
            raise ConformanceError(f"{label}: decode_handle accepted handle version 999, which "
                                   f"{type(self.sink).__name__} does not know; it must raise HandleError")
        return text


    def _quiescent(self) -> bool:
        return not self.crashed and self.current is None

    def _pending(self) -> set[str] | None:
        if self.pending is None:
            return None
        return {str(x) for x in self.pending()}

    def _check_aborted(self, before: set[str] | None, rec: Attempt, b: BatchModel) -> None:
        if before is None:
            return
        now = self._pending()
        assert now is not None  # ``before`` came from the same pending()
        left = now - before
        if left:
            raise ConformanceError(
                f"{rec.label(b.batch_id)} was aborted, but it left {len(left)} transaction(s) open: "
                f"{sorted(left)[:5]}. abort() must discard what the transaction wrote.")

    def _read(self) -> Counter:
        records = list(self.read_committed())
        lo, hi = self.id_base, self.id_base + ID_SPAN
        return Counter(i for i in map(self.id_of, records) if lo <= i < hi)

    def _check(self, where: str, exact: bool = False) -> None:
        """Compare what a reader sees with the model.

        Always: no row twice, no row that no committed handle carries.  At quiescent
        moments (``exact``): every row of every decided batch is there, and no
        transaction of this query is still open.
        """
        if not (exact or self.check_every_step):
            return
        allowed: dict[int, tuple[int, int]] = {}  # id -> (batch, handle index) of committed handles
        expected: set[int] = set()
        for b in self.batches.values():
            for i in b.committed_handles:
                for row in b.handle_ids[i]:
                    allowed[row] = (b.batch_id, i)
            if b.decided:
                expected.update(b.ids)
        deadline = time.monotonic() + self.settle_timeout
        while True:
            seen = self._read()
            dup = {i: c for i, c in seen.items() if c > 1}
            unexpected = sorted(set(seen) - set(allowed))
            missing = sorted(expected - set(seen)) if exact else []
            if dup or unexpected or not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.2)  # missing rows may be a visibility lag (settle_timeout); dup/unexpected never are
        problems = []
        for i in sorted(dup)[:5]:
            problems.append(f"row {i} appears {dup[i]} times ({self._provenance(i)})")
        for i in unexpected[:5]:
            owner = self._batch_of(i)
            why = ("its batch was never decided" if owner and not owner.decided else
                   "no committed handle carries it yet" if owner else "no batch of this example wrote it")
            problems.append(f"row {i} is visible but {why} ({self._provenance(i)})")
        for i in missing[:5]:
            problems.append(f"row {i} is missing although its batch was decided ({self._provenance(i)})")
        if problems:
            counts = (f"{len(dup)} duplicated, {len(unexpected)} visible too early or never decided, "
                      f"{len(missing)} missing")
            hint = ("" if not missing or dup or unexpected else
                    " If the sink's reads lag behind commits, pass settle_timeout=seconds.")
            msg = (f"{where}: exactly-once violated for {type(self.sink).__name__}: {counts}.\n  "
                   + "\n  ".join(problems) + f"\n  (last crash point: {self.crash_point or 'none'})" + hint)
            note(msg)
            raise ConformanceError(msg)
        if exact and self.pending is not None:
            now, baseline = self._pending(), self.pending_baseline
            assert now is not None and baseline is not None  # both from pending(), which is set
            left = now - baseline
            if left:
                msg = (f"{where}: {len(left)} transaction(s) are still open although every batch is committed "
                       f"or aborted: {sorted(left)[:5]}. abort_lingering must abort what failed attempts and "
                       "crashed runs left behind (open transactions hold locks or block readers).")
                note(msg)
                raise ConformanceError(msg)
        note(f"  check {'(exact) ' if exact else ''}{where}: {sum(seen.values())} rows visible, as expected")

    def _batch_of(self, row: int) -> BatchModel | None:
        for b in self.batches.values():
            if b.ids and b.ids[0] <= row <= b.ids[-1]:
                return b
        return None

    def _provenance(self, row: int) -> str:
        b = self._batch_of(row)
        if b is None:
            return "unknown row"
        wrote = [a for a in b.attempts if row in a.ids]
        state = ("decided" if b.decided else "undecided") + (", COMMITTED logged" if b.committed_logged else "")
        parts = [f"batch {b.batch_id} ({state})"]
        for a in wrote:
            parts.append(f"p{a.partition} attempt {a.attempt} run {a.life} {a.outcome}"
                         + (f" [{a.handle_desc}]" if a.handle_desc else ""))
        return "; ".join(parts)


def make_state_machine(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    make_frame: Callable[[list[int], int], Any] | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    commit_parallelism: int = 8,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
) -> type[SinkConformanceMachine]:
    """The configured state machine class (for ``run_state_machine_as_test`` or its ``TestCase``).

    Arguments as for :func:`run_sink_conformance`.
    """
    if max_rows < 0 or max_partitions < 1 or commit_parallelism < 1:
        raise ValueError("max_rows must be >= 0, max_partitions and commit_parallelism >= 1")
    attrs: dict[str, Any] = {
        "sink_factory": staticmethod(sink_factory),
        "read_committed": staticmethod(read_committed),
        "make_batch": staticmethod(make_batch or default_make_batch),
        "make_frame": staticmethod(make_frame) if make_frame is not None else None,
        "id_of": staticmethod(id_of or default_id_of),
        "reset": staticmethod(reset) if reset is not None else None,
        "pending": staticmethod(pending) if pending is not None else None,
        "max_rows": max_rows,
        "max_partitions": max_partitions,
        "check_every_step": check_every_step,
        "settle_timeout": settle_timeout,
        "commit_retries": commit_retries,
        "commit_parallelism": commit_parallelism,
        "query_prefix": query_prefix,
        "rebuild_from_config": rebuild_from_config,
        "_run_token": f"{random.getrandbits(24):06x}",
        "_examples": itertools.count(1),
        "_id_floor": None,
        "_frame_probed": False,
        "stats": Counter(),
        "failures": [],
        "first_story": [],
    }
    return type("SinkConformance", (SinkConformanceMachine,), attrs)


def run_sink_conformance(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    make_frame: Callable[[list[int], int], Any] | None = None,
    settings: Any = None,
    max_examples: int | None = None,
    steps: int | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    commit_parallelism: int = 8,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
    min_useful_share: float = 0.3,
    seed: int | None = None,
    ownership: bool = True,
    protocol_factory: Callable[..., Any] | None = None,
    ownership_examples: int | None = None,
) -> dict[str, int]:
    """Prove (by search) that a sink is exactly-once under the twophase coordinator; raise if not.

    Runs in the calling process, without Spark.  Hypothesis generates sequences of
    micro-batches: task attempts that pre-commit, abort or die and are retried,
    commit decisions, commits (``commit_parallelism`` at once, like the
    coordinator), repeated commits, driver crashes at the coordinator's crash
    points and recoveries through the coordinator's own recovery routine; and
    checks what ``read_committed`` returns against a model.  Executor-side methods
    run on a pickled copy of the sink per task attempt, as Spark ships it.  A
    failure raises :class:`ConformanceError` (an ``AssertionError``) after
    shrinking; hypothesis prints the steps and the notes, which read as the story
    of the failure.

    Returns the run's statistics (examples, batches, task failures and retries,
    crashes by point, recoveries, concurrent commits ...), also logged on
    ``twophase.testing``.  Every example's first step runs a batch with rows in which the
    driver dies (or, if a task fails 4 times first, whose job fails); the ownership machine's
    first step is a takeover.  At any number of examples, the run fails as degenerate if fewer
    than ``ceil(min_useful_share * examples)`` of its examples committed a batch with rows of
    their own (directly, by recovery or by the replay that finishes the example) before the
    closing batch every example ends with, or fewer went through a driver crash and recovery or a
    failed job and its replay (the ownership machine: committed rows, a takeover); by
    construction a run whose sink works reaches both in every example, so this fails runs
    that cannot exercise the sink (``max_rows=0``; a harness change that loses the guarantee).

    A sink whose ``prepare_batch`` takes batches over (``FileSink(writer="spark")``, the default on
    ``hdfs://``) is written by one Spark job per batch in a query; without ``make_frame`` the
    harness drives its per-task transactions instead, and says so with a
    :class:`ConformanceWarning` (and ``prepare_batch not driven`` in the statistics).  With
    ``make_frame``, a run in which ``prepare_batch`` never took a batch over warns too.

    ``sink_factory()`` returns a new sink on the same storage (called at the start
    of each example and after crashes; recovery also rebuilds sinks through
    ``to_config()``/``from_config()`` unless ``rebuild_from_config=False``).

    ``read_committed()`` returns what a reader sees now (rows, records, or ids);
    ``id_of(record)`` extracts the integer id (default: ``record["id"]`` for
    mappings, else ``int(record)``).  Ids outside the current example's range are
    ignored, so the storage may hold other data.

    ``make_batch(ids)`` builds the ``pyarrow.RecordBatch`` written for a list of ids
    (default: columns ``id`` int64 and ``payload`` string).

    ``reset()`` (optional) empties the storage before each example (keeps reads fast).

    ``pending()`` (optional) returns names of the sink's transactions that are still
    open (staged files, prepared gids, ongoing transactional ids).  With it the
    harness also checks that ``abort`` and ``abort_lingering`` leave nothing open.

    ``make_frame(ids, partitions)`` (optional) builds a Spark DataFrame of those rows over that
    many partitions.  With it the harness first offers each batch run to the sink's
    :meth:`~twophase.TwoPhaseCommitSink.prepare_batch` (the driver-side way to write a sink,
    e.g. ``FileSink(writer="spark")``); when that returns handles, they take the place of the
    task attempts, and the decision, commits, crashes and recovery follow as for any sink.

    ``settings`` is a ``hypothesis.settings`` (default: :func:`default_settings`);
    ``max_examples`` and ``steps`` (steps per example) override it; the ownership machine
    below runs under the same settings (phases, database, deadline), with its own steps.
    Each example uses its own query name, ids and batch ids ``example * 1000 + k``.
    ``settle_timeout`` re-reads for that many seconds while decided rows are
    missing (for stores whose committed data becomes readable with a lag).

    ``ownership`` (default on; off for ``make_frame`` sinks) then runs the ownership machine
    (:mod:`twophase.testing.ownership`): the real protocol (``protocol_factory``, default
    :class:`twophase.protocol.TwoPhaseProtocol`) on a real transaction log, a coordinator deposed
    mid-batch whose held actions land after a new owner's, late and duplicate task attempts, and a
    second pipeline or generation on the same target.  ``ownership_examples`` sets its examples
    (default: ``max_examples``, else 25).

    ``seed`` fixes hypothesis' random seed (``hypothesis.seed``): the same seed, sink and
    arguments run the same examples again.  Every choice the harness makes is a hypothesis
    draw, commits run concurrently but which of them land before a crash is drawn too, so
    an example replays exactly as long as the sink answers the same calls the same way.
    """
    machine = make_state_machine(
        sink_factory, read_committed, make_batch=make_batch, id_of=id_of, reset=reset, pending=pending,
        make_frame=make_frame, max_rows=max_rows, max_partitions=max_partitions, check_every_step=check_every_step,
        settle_timeout=settle_timeout, commit_retries=commit_retries, commit_parallelism=commit_parallelism,
        query_prefix=query_prefix, rebuild_from_config=rebuild_from_config)
    s = settings if settings is not None else default_settings()
    overrides: dict[str, Any] = {}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if steps is not None:
        overrides["stateful_step_count"] = steps
    if overrides:
        s = hypothesis.settings(s, **overrides)
    if seed is not None:
        machine = hypothesis.seed(seed)(machine)
    try:
        stateful.run_state_machine_as_test(machine, settings=s)
    except hypothesis.errors.Flaky as e:
        if not machine.failures:
            raise
        err = ConformanceError(
            f"{machine.failures[0]}\n(This failure did not happen again when hypothesis replayed the same "
            "steps: the sink answers the same calls differently from run to run, the mark of a race "
            "(e.g. between concurrent commits) or of state kept outside the sink's storage. The notes "
            "below are the failing run's story.)")
        for line in machine.first_story:
            err.add_note(line)
        raise err from e
    stats = dict(machine.stats)
    _log.info("conformance run of %s: %s", machine.query_prefix, _format_stats(stats))
    check_reach(stats, min_useful_share, {
        "examples_with_committed_rows": "committed a batch with rows of their own",
        "examples_with_crash_or_job_failure": "went through a driver crash and a new driver's recovery, "
                                              "or a failed job and its replay",
    }, "Raise max_rows=... (every example's first batch has 1 to max_rows rows), or check that the "
       "sink's batches are not failing (see the run's notes).")
    if make_frame is not None and not stats.get("whole-batch jobs"):
        msg = ("make_frame was given, but the sink's prepare_batch never took a batch over (it returned "
               "None every time): this run drove the per-task transactions only")
        _log.warning("%s", msg)
        warnings.warn(ConformanceWarning(msg), stacklevel=2)
    if ownership and make_frame is None:
        # The second half: the real protocol (protocol_factory) with two coordinators on one log,
        # late and duplicate task attempts and a second pipeline on the same target.
        from twophase.testing.ownership import (
            DEFAULT_EXAMPLES,
            DEFAULT_STEPS,
            run_ownership_conformance,
        )

        # The caller's settings (phases, database, deadline ...) hold for this half too, with its
        # own steps per example (CI once spent 5 minutes here shrinking a failure that the
        # caller's settings had told hypothesis not to shrink).
        own = run_ownership_conformance(
            sink_factory, read_committed, protocol_factory=protocol_factory,
            settings=None if settings is None else hypothesis.settings(settings, stateful_step_count=DEFAULT_STEPS),
            max_examples=ownership_examples if ownership_examples is not None else
            (DEFAULT_EXAMPLES if settings is None and max_examples is None else s.max_examples),
            seed=seed, make_batch=make_batch, id_of=id_of, reset=reset, pending=pending, max_rows=max_rows,
            max_partitions=max_partitions, settle_timeout=settle_timeout, commit_retries=commit_retries,
            commit_parallelism=commit_parallelism, query_prefix=f"{query_prefix}-own",
            rebuild_from_config=rebuild_from_config, min_useful_share=min_useful_share)
        stats.update({f"ownership: {k}": v for k, v in own.items()})
    return stats


class SinkConformanceTests:
    """Pytest mixin: inherit it in a ``Test...`` class and implement ``make_sink`` and ``read_committed``.

    ::

        class TestMySink(SinkConformanceTests):
            max_examples = 20

            @pytest.fixture(autouse=True)
            def _where(self, tmp_path):
                self.path = tmp_path / "db.sqlite"

            def make_sink(self):
                return MySink(self.path)

            def read_committed(self):
                return read_ids(self.path)

    Optional overrides: ``make_batch``, ``id_of``, ``reset``, ``pending``, and the
    class attributes below.  Needs no pytest import itself.
    """

    max_examples: int = 25
    steps: int = 8
    conformance_settings: Any = None
    max_rows: int = 12
    max_partitions: int = 3
    check_every_step: bool = True
    settle_timeout: float = 0.0
    conformance_seed: int | None = None
    ownership: bool = True            # also run the ownership machine (twophase.testing.ownership)
    ownership_examples: int | None = None

    def make_sink(self) -> TwoPhaseCommitSink:
        raise NotImplementedError("override make_sink() to return a new sink on the test's storage")

    def read_committed(self) -> Iterable[Any]:
        raise NotImplementedError("override read_committed() to return what a reader sees (rows or ids)")

    def make_batch(self, ids: list[int]) -> Any:
        return default_make_batch(ids)

    def id_of(self, record: Any) -> int:
        return default_id_of(record)

    def reset(self) -> None:
        """Empty the storage before each example (optional)."""

    def pending(self) -> Iterable[Any]:
        """Names of still-open transactions (optional; override to enable the leftover checks)."""
        return ()

    def test_sink_conformance(self) -> None:
        overridden = _overrides(type(self), "pending")
        run_sink_conformance(
            self.make_sink, self.read_committed, make_batch=self.make_batch, id_of=self.id_of,
            reset=self.reset if _overrides(type(self), "reset") else None,
            pending=self.pending if overridden else None,
            settings=self.conformance_settings, max_examples=self.max_examples, steps=self.steps,
            max_rows=self.max_rows, max_partitions=self.max_partitions,
            check_every_step=self.check_every_step, settle_timeout=self.settle_timeout,
            seed=self.conformance_seed, ownership=self.ownership, ownership_examples=self.ownership_examples)


def _overrides(cls: type, name: str) -> bool:
    return inspect.getattr_static(cls, name) is not inspect.getattr_static(SinkConformanceTests, name)
