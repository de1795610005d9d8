"""The ownership part of the conformance harness: the real protocol, two coordinators, late actors.

Where :mod:`twophase.testing.conformance` models the coordinator's steps, this state machine runs
the protocol itself (:class:`twophase.protocol.TwoPhaseProtocol`, or the ``protocol_factory`` a
coordinator author passes) on a real :class:`~twophase.log.TransactionLog` in a temporary folder,
with the sink's executor methods run in-process on pickled copies of the sink (one per task
attempt).  On top of task failures and driver crashes it plays what issue 25 lists:

- **takeover**: coordinator A is deposed in the middle of a batch (with its INTENT held on the
  wire, after its INTENT, after its tasks pre-committed, or with its decision held on the wire);
  coordinator B (a new log object, ``takeover=True``) runs the batch; A's held actions land at a
  drawn point of B's run: its INTENT (which then finds B's record: A must stop there), its
  decision, its failure cleanup, optionally a late recovery of its own;
- **late task attempts**: an attempt of a decided ballot's partition run again (the same attempt
  number, or the next one: a stage retry, whose attempt numbers start again) between the decision
  and the commits, after the commits, or batches later; its leftovers must be gone within two
  batches and it must never destroy decided data;
- **a second pipeline on one target**: another log (another pipeline) or a new generation of the
  same log writes the same batch ids to the same target.

The truth is the log itself: a reader must see exactly the rows of the handles of commit
decisions (a batch decided twice is reported as such), each once.
"""

from __future__ import annotations

import json
import logging
import pickle
import shutil
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twophase.context import TransactionContext
from twophase.errors import DataLossError, TwoPhaseError
from twophase.log import (
    COMMITTED,
    INTENT,
    PREPARED,
    TransactionLog,
    decode_record,
    parse_batch_name,
)
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._shared import (
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
)
from twophase.testing._shared import note as _note_here

if TYPE_CHECKING:
    import hypothesis
    from hypothesis import stateful
    from hypothesis import strategies as st
else:
    from twophase._deps import require

    hypothesis = require("hypothesis", "twophase.testing")
    st = require("hypothesis.strategies", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

_log = logging.getLogger("twophase.testing")
rule, precondition, initialize = stateful.rule, stateful.precondition, stateful.initialize

#: Batch ids of example n are n * BATCH_SPAN + k (examples share the sink's target).
BATCH_SPAN = 1_000
_OUTCOMES = (PRE_COMMIT,) * 5 + (ABORT, ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE)
#: Where the driver dies inside a batch (the names of twophase/crash.py).
CRASH_POINTS = ("after_intent", "after_pre_commit", "before_prepared_logged", "after_prepared_logged",
                "mid_commit", "after_commit")
#: Where coordinator A is deposed (paused) in the middle of its batch (``intent_on_wire``: its
#: INTENT's create is held, and lands after B opened the same ballot).
PAUSES = ("after_intent", "tasks_pre_committed", "decision_on_wire", "intent_on_wire")
#: Where in B's run A's held actions land.
RELEASES = ("after_b_intent", "after_b_decision", "after_b_commit", "after_b_finished")
#: When a late task attempt of a batch runs.
LATE_WHEN = ("between_decision_and_commit", "after_commit")
#: Exceptions a deposed or failed coordinator may end with (anything else is reported).
_EXPECTED = (TwoPhaseError,)


_test_thread: list[int] = [0]
_deferred: list[str] = []


def note(msg: str) -> None:
    """A hypothesis note from the test's thread; from a deposed coordinator's thread, kept until
    the test's thread takes it (hypothesis notes belong to the test's thread)."""
    if threading.get_ident() == _test_thread[0]:
        flush_notes()
        _note_here(msg)
    else:
        _deferred.append(msg)


def flush_notes() -> None:
    while _deferred:
        _note_here(_deferred.pop(0))


class _Died(BaseException):
    """The driver dies here: raised through the protocol, never handled by it."""


class _Coord:
    """One coordinator process: its sink, its log object (store wrapped for faults), its protocol."""

    def __init__(self, machine: OwnershipMachine, label: str, url: str, query_id: str, sink: TwoPhaseCommitSink,
                 *, new_generation: bool = False):
        self.machine, self.label, self.url = machine, label, url
        self.sink = sink
        self.dead = False
        self.hooks: dict[str, list[Callable[[], None]]] = {}  # one-shot: event -> actions
        self.commit_budget: int | None = None  # mid_commit: commits that land before the driver dies
        sink.open()
        self.tlog = TransactionLog(url, lease_timeout=3600.0)
        self.tlog.store = _FaultyStore(self.tlog.store, self)  # type: ignore[assignment]  # same duck type
        self.tlog.acquire(query_id, machine.name, new_generation=new_generation, takeover=True)
        self.generation = self.tlog.generation
        self.query_name = f"{machine.name}.{self.tlog.scope()}"
        self.protocol = machine.protocol_factory(sink, self.tlog, name=machine.name, query_name=self.query_name,
                                                 committer=self._committer)
        if hasattr(self.protocol, "sweep_replaced_every"):
            # Replaced generations' late leftovers swept on every batch, not every 10th: the
            # machine checks leftovers two batches after a late attempt.
            self.protocol.sweep_replaced_every = 1

    def _committer(self) -> Committer:
        return _DyingCommitter(self)

    def on(self, event: str, action: Callable[[], None]) -> None:
        self.hooks.setdefault(event, []).append(action)

    def fire(self, event: str) -> None:
        for action in self.hooks.pop(event, []):
            action()

    def close(self) -> None:
        _close(self.sink)


class _FaultyStore:
    """The log's store as one coordinator sees it: dead after its driver died, with hooks on writes."""

    def __init__(self, inner: Any, coord: _Coord):
        self._inner, self._coord = inner, coord

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _alive(self) -> None:
        if self._coord.dead:
            raise _Died()

    def read(self, name: str) -> Any:
        self._alive()
        return self._inner.read(name)

    def list(self, *a: Any, **kw: Any) -> Any:
        self._alive()
        return self._inner.list(*a, **kw)

    @staticmethod
    def _event(name: str, data: bytes) -> str | None:
        parsed = parse_batch_name(name.rsplit("/", 1)[-1])
        if parsed is None:
            return None
        state = parsed[1]
        if state == PREPARED:
            try:
                body = decode_record(data, name, "")
            except Exception:  # noqa: BLE001 - a record the harness cannot read is no decision
                return "abort"
            return "decision" if body.get("outcome") != "abort" else "abort"
        return {INTENT: "intent", COMMITTED: "committed"}.get(state)

    def _write(self, how: str, name: str, data: bytes) -> Any:
        self._alive()
        ev = self._event(name, data)
        if ev:
            self._coord.fire(f"before_{ev}")
            self._alive()
        out = getattr(self._inner, how)(name, data)
        if ev:
            self._coord.fire(f"after_{ev}")
            self._alive()
        return out

    def create(self, name: str, data: bytes) -> bool:
        return self._write("create", name, data)

    def replace(self, name: str, data: bytes) -> None:
        return self._write("replace", name, data)

    def delete(self, name: str) -> None:
        self._alive()
        return self._inner.delete(name)


class _DyingCommitter(Committer):
    """The coordinator's committer; with a budget, the driver dies after that many commits."""

    def __init__(self, coord: _Coord):
        m = coord.machine
        super().__init__(coord.sink, parallelism=1 if coord.commit_budget is not None else m.commit_parallelism,
                         retries=m.commit_retries, backoff=0.01, max_backoff=0.2, name=m.name,
                         where=f"the harness' log {coord.url}")
        self.coord = coord
        self.lock = threading.Lock()

    def commit_one(self, batch_id: int, handle: Any, recovering: bool) -> Any:
        with self.lock:
            if self.coord.dead:
                raise _Died()
            if self.coord.commit_budget is not None:
                if self.coord.commit_budget <= 0:
                    self.coord.dead = True
                    raise _Died()
                self.coord.commit_budget -= 1
        return super().commit_one(batch_id, handle, recovering)


class _Plan:
    """Every choice of one batch run, drawn in the test's thread before the run starts (a paused
    coordinator's tasks run in another thread, which must not draw)."""

    def __init__(self, parts: int, outcomes: list[list[str]], chunks: int):
        self.parts, self.outcomes, self.chunks = parts, outcomes, chunks


class _Work:
    """The engine's side of one batch run (``BatchWork``): tasks in-process on pickled sink copies."""

    def __init__(self, machine: OwnershipMachine, coord: _Coord, ids: list[int], plan: _Plan):
        self.machine, self.coord, self.ids, self.plan = machine, coord, ids, plan
        self.die_after_tasks: int | None = None  # crash after_pre_commit: after this many tasks
        self.results: list[dict[str, Any]] = []
        self.contexts: list[tuple[TransactionContext, list[int]]] = []

    def partitions(self, planned: int | None) -> int:
        self.n = max(1, min(self.plan.parts, planned or self.plan.parts))
        return self.n

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        return {"harness": batch_id}

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        m, coord = self.machine, self.coord
        m.check_own_intent(coord, batch_id, intent)
        parts = getattr(self, "n", None) or self.partitions(None)
        assign: dict[int, list[int]] = {p: [] for p in range(parts)}
        for k, i in enumerate(self.ids):
            assign[k % parts].append(i)
        shipped = _dumps_sink(coord.sink)
        results: list[dict[str, Any]] = []
        for p in range(parts):
            if not assign[p]:
                continue
            for attempt, outcome in enumerate(self.plan.outcomes[p]):
                ctx = TransactionContext(query_name, batch_id, p, attempt, intent, run, m.next_task_id())
                env = m.run_attempt(coord, shipped, ctx, assign[p], outcome, self.plan.chunks, label=coord.label)
                if outcome == PRE_COMMIT:
                    assert env is not None
                    results.append({"partition": p, "attempt": attempt, "rows": len(assign[p]),
                                    "handle": json.loads(env)})
                    self.contexts.append((ctx, assign[p]))
                    if self.die_after_tasks is not None and len(results) >= self.die_after_tasks:
                        coord.dead = True
                        note(f"CRASH ({coord.label}) at after_pre_commit of batch {batch_id}")
                        raise _Died()
                    break
            else:
                raise TwoPhaseError(f"batch {batch_id}: partition {p} failed {MAX_TASK_ATTEMPTS} times: the job "
                                    "failed")
        self.results = results
        coord.fire("tasks_done")
        if coord.dead:
            raise _Died()
        return results


class OwnershipMachine(stateful.RuleBasedStateMachine):
    """Runs the protocol for real on a sink: batches, crashes, takeovers, late attempts, pipelines.

    Configured by :func:`make_ownership_machine`.  One example = a fresh log folder, query name,
    row ids and batch ids; the sink's target is shared by the examples.
    """

    sink_factory: Callable[[], TwoPhaseCommitSink]
    read_committed: Callable[[], Iterable[Any]]
    make_batch: Callable[[list[int]], Any] = staticmethod(default_make_batch)
    id_of: Callable[[Any], int] = staticmethod(default_id_of)
    reset: Callable[[], None] | None = None
    pending: Callable[[], Iterable[Any]] | None = None
    protocol_factory: Callable[..., Any]
    max_rows: int = 12
    max_partitions: int = 3
    settle_timeout: float = 0.0
    commit_retries: int = 5
    commit_parallelism: int = 8
    query_prefix: str = "ownership"
    rebuild_from_config: bool = True
    pipelines: bool = True
    _run_token: str = ""
    _examples: Any
    _id_floor: int | None = None
    stats: Counter
    failures: list[str]
    first_story: list[str]

    def __init__(self) -> None:
        super().__init__()
        self.root: str | None = None
        self.owner: _Coord | None = None
        self.coords: list[_Coord] = []

    # ------------------------------------------------------------------ set-up
    @initialize(data=st.data())
    def start(self, data: Any) -> None:
        cls = type(self)
        n = next(cls._examples)
        _story.clear()
        _deferred.clear()
        _test_thread[0] = threading.get_ident()
        self.example = n
        self.name = f"{self.query_prefix}-{self._run_token}-{n}"
        self.id_base = example_id_base(self, n)
        self.next_id = self.id_base
        self.next_batch = n * BATCH_SPAN
        self.task_ids = 0
        self.root = tempfile.mkdtemp(prefix="twophase-ownership-")
        self.main_url = f"{self.root}/log"
        self.query_id = f"q-{self.name}"
        self.urls = [self.main_url]
        self.rows: dict[tuple[str, int, int], list[int]] = {}  # (log, generation, batch) -> its rows
        self.handle_rows: dict[str, list[int]] = {}             # encoded handle -> rows it carries
        self.contexts: dict[tuple[str, int, int], list[tuple[TransactionContext, list[int]]]] = {}
        self.current: tuple[int, list[int]] | None = None       # the main pipeline's unfinished batch
        self.crashed = False
        self.crashes_left = data.draw(st.integers(0, 2), label="driver crashes this example may have")
        # (log, generation) -> batches it finished since its last late task attempt
        self.late: dict[tuple[str, int], int] = {}
        self.committed_rows = False
        self.took_over = False
        self.pending_baseline = self._pending()
        self.owner = self._coord("A")
        note(f"query {self.name}: sink {type(self.owner.sink).__name__}, log {self.main_url}, protocol "
             f"{getattr(self.protocol_factory, '__name__', self.protocol_factory)}; rows from {self.id_base}")
        # The first batch of every example is taken over (any pause, any release point), here in the
        # step hypothesis always runs: however few steps an example has, or whichever rules its
        # swarm testing turned off, it plays a takeover and commits rows of its own, which the run's
        # check (check_reach in run_ownership_conformance) counts.
        self._takeover(data, PAUSES)

    def next_task_id(self) -> int:
        self.task_ids += 1
        return self.task_ids

    def _coord(self, label: str, url: str | None = None, query_id: str | None = None, *, how: str = "factory",
               new_generation: bool = False) -> _Coord:
        sink = self.sink_factory()
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConformanceError(f"sink_factory returned {type(sink).__name__}, not a TwoPhaseCommitSink")
        if how == "config":
            try:
                sink = type(sink).from_config(json.loads(json.dumps(sink.to_config())))
            except NotImplementedError:
                pass
        c = _Coord(self, label, url or self.main_url, query_id or self.query_id, sink, new_generation=new_generation)
        self.coords.append(c)
        return c

    # ------------------------------------------------------------------ tasks
    def check_own_intent(self, coord: _Coord, batch_id: int, intent: dict[str, Any]) -> None:
        """Tasks run only under an INTENT the log holds as this coordinator's own.

        The INTENT is written by exclusive create; a create that finds another coordinator's
        record (A's INTENT held on the wire while B opened the same ballot) must stop the batch.
        Going on would pre-commit transactions under a plan no INTENT records (no cleanup looks
        for them) and then decide a ballot that another coordinator opened."""
        view = TransactionLog(coord.url, readonly=True).view(batch_id, generation=coord.generation)
        want = json.dumps(intent, sort_keys=True)
        for b in view.ballots:
            if b.intent is not None and coord.tlog.mine(b.intent) and json.dumps(b.plan, sort_keys=True) == want:
                return
        opened = ", ".join(f"ballot {b.ballot} by epoch {b.intent.body.get('epoch')}" for b in view.ballots
                           if b.intent is not None) or "none"
        raise ConformanceError(
            f"{coord.label} (epoch {coord.tlog.epoch}): batch {batch_id}: its tasks were started under a plan that no "
            f"INTENT of its own in the log holds (INTENTs of the batch: {opened}): an INTENT whose exclusive create "
            "found another coordinator's record must stop the batch; going on pre-commits transactions no "
            "cleanup looks for and decides a ballot another coordinator opened")

    def run_attempt(self, coord: _Coord, shipped: bytes, ctx: TransactionContext, ids: list[int], outcome: str,
                    n_chunks: int, *, label: str) -> str | None:
        """One task attempt on its own copy of the sink; returns the handle's envelope (JSON text)."""
        chunks = _split(ids, n_chunks)
        if outcome == DIE_MID_WRITE:
            chunks = chunks[:1]
        where = f"{label}: batch {ctx.batch_id} p{ctx.partition_id} attempt {ctx.attempt} (run {ctx.run})"
        self.stats["task_attempts"] += 1
        executor = pickle.loads(shipped)
        try:
            txn = executor.begin_transaction(ctx)
            for c in chunks:
                executor.write(txn, self.make_batch(c))
            if outcome == DIE_MID_WRITE:
                note(f"{where}: wrote {_span([i for c in chunks for i in c])}, then the executor DIED")
                return None
            if outcome == ABORT:
                executor.abort(txn)
                note(f"{where}: FAILED, abort() ran")
                return None
            handle = executor.pre_commit(txn)
            env = executor.encode_handle(handle)
            text = json.dumps(env, sort_keys=True)
        finally:
            _close(executor)
        self.handle_rows[text] = list(ids)
        note(f"{where}: pre-committed {coord.sink.describe_handle(coord.sink.decode_handle(env))} rows {_span(ids)}"
             + (" then DIED before reporting" if outcome == DIE_AFTER_PRE_COMMIT else ""))
        return None if outcome == DIE_AFTER_PRE_COMMIT else text

    def _plan(self, data: Any) -> _Plan:
        parts = self._draw(data, st.integers(1, self.max_partitions), "partitions", self.max_partitions)
        outcomes = []
        for p in range(self.max_partitions):
            seq: list[str] = []
            while len(seq) < MAX_TASK_ATTEMPTS:
                o = self._draw(data, st.sampled_from(_OUTCOMES), f"p{p} attempt {len(seq)}", PRE_COMMIT)
                seq.append(o)
                if o == PRE_COMMIT:
                    break
            outcomes.append(seq)
        return _Plan(parts, outcomes, self._draw(data, st.integers(1, 2), "arrow batches", 1))

    @staticmethod
    def _draw(data: Any, strategy: Any, label: str, default: Any) -> Any:
        return default if data is None else data.draw(strategy, label=label)

    # ------------------------------------------------------------------ running a batch
    def _new_batch(self, data: Any) -> tuple[int, list[int]]:
        bid = self.next_batch
        self.next_batch += 1
        n = self._draw(data, st.integers(1, max(1, self.max_rows)), "rows", max(1, self.max_rows // 2))
        ids = list(range(self.next_id, self.next_id + n))
        self.next_id += n
        return bid, ids

    def _run(self, coord: _Coord, bid: int, ids: list[int], plan: _Plan, *, work: _Work | None = None,
             expect_failure: bool = False) -> BaseException | None:
        """``coord`` runs batch ``bid``; returns its failure (expected kinds only), None on success."""
        from twophase.protocol import BatchProgress

        self.rows[(coord.url, int(coord.generation or 0), bid)] = ids
        work = work or _Work(self, coord, ids, plan)
        prog = BatchProgress(self.name, bid, None, "committed")
        try:
            coord.protocol.run_batch(bid, work, prog)
        except _Died:
            coord.dead = True
            return _Died()
        except DataLossError as e:
            raise ConformanceError(f"{coord.label}: batch {bid}: {e}") from None
        except _EXPECTED as e:
            note(f"{coord.label}: batch {bid} FAILED: {type(e).__name__}: {str(e)[:300]}")
            return e
        finally:
            self.contexts.setdefault((coord.url, int(coord.generation or 0), bid), []).extend(work.contexts)
        note(f"{coord.label}: batch {bid} {prog.action} ({prog.handles} handles, rows {_span(ids)})")
        self.stats["batches finished"] += 1
        if prog.action == "skipped":
            # The batch was already committed (a batch id written again in the same generation):
            # nothing ran, no cleanup either, so it is not one of the two batches a late attempt's
            # leftovers have to be found in.
            return None
        key = (coord.url, int(coord.generation or 0))
        for k in self.late:
            if k == key:
                self.late[k] += 1
            elif k[0] == key[0] and k[1] < key[1]:
                # A newer generation of the log ran a batch: its recovery, or its sweep of replaced
                # generations (on every batch here), ran the cleanup that the replaced generation's
                # next batch would have: the old generation's late leftovers must be gone now.
                self.late[k] = max(self.late[k], 2)
        return None

    def _finish(self, failure: BaseException | None, bid: int, ids: list[int]) -> None:
        self.last_failure = failure
        if isinstance(failure, _Died):
            self.crashed = True
            self.current = (bid, ids)
            self.stats["crashes"] += 1
            self._check(f"after the driver died in batch {bid}")
        elif failure is not None:
            self.current = (bid, ids)
            self._check(f"after batch {bid} failed")
        else:
            self.current = None
            self.committed_rows = True
            self._check(f"after batch {bid} finished", exact=True)

    def _alive(self) -> bool:
        return not self.crashed

    @precondition(lambda self: not self.crashed and self.current is None)
    @rule(data=st.data())
    def run_batch(self, data: Any) -> None:
        """A batch by the owner: tasks failing and retried, maybe a crash point, maybe a late
        duplicate of one of its tasks between its decision and its commits or after them."""
        assert self.owner is not None
        bid, ids = self._new_batch(data)
        self._run_owned(data, bid, ids)

    @precondition(lambda self: not self.crashed and self.current is not None)
    @rule(data=st.data())
    def replay_batch(self, data: Any) -> None:
        """Spark replays the unfinished batch (same id, same rows)."""
        assert self.current is not None
        self.stats["replays"] += 1
        self._run_owned(data, *self.current)

    def _run_owned(self, data: Any, bid: int, ids: list[int]) -> None:
        coord = self.owner
        assert coord is not None
        plan = self._plan(data)
        work = _Work(self, coord, ids, plan)
        crash_at = None
        if self.crashes_left > 0:
            crash_at = self._draw(data, st.sampled_from((None,) * 4 + CRASH_POINTS), "driver dies at", None)
        late = self._draw(data, st.sampled_from((None, None) + LATE_WHEN), "late duplicate task", None)
        late_attempt = self._draw(data, st.sampled_from(("same attempt number", "next attempt number")),
                                  "late attempt's number", "same attempt number")
        late_outcome = self._draw(data, st.sampled_from((PRE_COMMIT, PRE_COMMIT, ABORT, DIE_MID_WRITE)),
                                  "late task ends", PRE_COMMIT)
        note(f"{coord.label}: batch {bid} rows {_span(ids)}"
             + (f", driver dies at {crash_at}" if crash_at else "")
             + (f", a late duplicate task ({late_attempt}) {late}" if late else ""))
        if crash_at:
            self.crashes_left -= 1
            self.stats[f"crash at {crash_at}"] += 1
            self._arm_crash(coord, work, crash_at, data)
        if late:
            ev = "after_decision" if late == "between_decision_and_commit" else "before_committed"
            coord.on(ev, lambda: self._late_of(coord, work, late_attempt, late_outcome, late))
        failure = self._run(coord, bid, ids, plan, work=work)
        coord.hooks.clear()
        coord.commit_budget = None  # a mid_commit budget this batch did not use up dies with it
        self._finish(failure, bid, ids)

    def _arm_crash(self, coord: _Coord, work: _Work, crash_at: str, data: Any) -> None:
        def die() -> None:
            note(f"CRASH ({coord.label}) at {crash_at}")
            coord.dead = True

        if crash_at == "after_intent":
            coord.on("after_intent", die)
        elif crash_at == "after_pre_commit":
            work.die_after_tasks = self._draw(data, st.integers(1, self.max_partitions), "tasks before the crash", 1)
        elif crash_at == "before_prepared_logged":
            coord.on("before_decision", die)
        elif crash_at == "after_prepared_logged":
            coord.on("after_decision", die)
        elif crash_at == "mid_commit":
            def budget() -> None:
                coord.commit_budget = self._draw(data, st.integers(0, self.max_partitions - 1),
                                                 "commits before the crash", 0)
            coord.on("after_decision", budget)
        elif crash_at == "after_commit":
            coord.on("before_committed", die)

    def _late_of(self, coord: _Coord, work: _Work, which: str, outcome: str, when: str) -> None:
        """A duplicate of one of this run's pre-committed tasks (a stage retry's attempt)."""
        if not work.contexts:
            return
        ctx, ids = work.contexts[0]
        attempt = ctx.attempt + (1 if which == "next attempt number" else 0)
        late = TransactionContext(ctx.query_name, ctx.batch_id, ctx.partition_id, attempt, ctx.intent, ctx.run,
                                  self.next_task_id())
        self.stats[f"late task {when}"] += 1
        self.late[(coord.url, int(coord.generation or 0))] = 0
        note(f"LATE TASK ({when}): batch {ctx.batch_id} p{ctx.partition_id} runs again as attempt {attempt} "
             f"of run {ctx.run} (a stage retry)")
        try:
            self.run_attempt(coord, _dumps_sink(coord.sink), late, ids, outcome, 1, label="late task")
        except Exception as e:  # noqa: BLE001 - a task may fail; Spark discards it
            note(f"late task failed: {type(e).__name__}: {str(e)[:200]}")

    # ------------------------------------------------------------------ faults
    @precondition(lambda self: self.crashed)
    @rule(data=st.data())
    def recover(self, data: Any) -> None:
        """A new driver: a new sink (factory or to_config/from_config), a new log object, recovery."""
        old = self.owner
        assert old is not None
        old.close()
        how = "config" if self.rebuild_from_config and self._draw(data, st.booleans(), "rebuild from config",
                                                                  False) else "factory"
        self.owner = self._coord(f"{old.label}'", old.url, how=how)
        self.crashed = False
        self.stats["recoveries"] += 1
        note(f"RECOVER: {self.owner.label}, a new sink from {how}, log epoch {self.owner.tlog.epoch}")
        self._recover_now(self.owner)

    def _recover_now(self, coord: _Coord) -> None:
        try:
            coord.protocol.recover()
        except DataLossError as e:
            raise ConformanceError(f"{coord.label}: recovery: {e}") from None
        coord.protocol.dirty = False
        if self.current is not None:
            bid, _ = self.current
            if coord.tlog.view(bid).committed is not None:
                self.current = None
        self._check("after recovery", exact=True)

    # Two rules, one per kind of pause, both a takeover: each kind finds bugs of its own (a paused
    # coordinator fails its fence check and cleans up; a held write lands after B's record), and
    # hypothesis draws among rules, so two rules make takeovers twice as frequent as one would.
    @precondition(lambda self: not self.crashed)
    @rule(data=st.data())
    def takeover_of_a_paused_owner(self, data: Any) -> None:
        """A pauses between two of its steps (after its INTENT, after its tasks pre-committed)."""
        self._takeover(data, PAUSES[:2])

    @precondition(lambda self: not self.crashed)
    @rule(data=st.data())
    def takeover_with_a_write_on_the_wire(self, data: Any) -> None:
        """A's decision or its INTENT is held on the wire."""
        self._takeover(data, PAUSES[2:])

    def _takeover(self, data: Any, pauses: tuple[str, ...]) -> None:
        """A is deposed mid-batch; B takes the log over and runs the batch; A's held actions land late."""
        a = self.owner
        assert a is not None
        if self.current is not None:
            bid, ids = self.current
        else:
            bid, ids = self._new_batch(data)
        pause = self._draw(data, st.sampled_from(pauses), "A is deposed", pauses[0])
        # Between B's decision and its commits is where a late actor does harm: drawn most often.
        release = self._draw(data, st.sampled_from(RELEASES[:2] + RELEASES[1:]), "A's held actions land",
                             "after_b_decision")
        late_recovery = self._draw(data, st.sampled_from((False, False, True)), "A recovers late", False)
        plan_a, plan_b = self._plan(data), self._plan(data)
        plan_a.outcomes = [[PRE_COMMIT] for _ in plan_a.outcomes]  # A's tasks succeed: its cleanup matters
        self.stats[f"takeover: A paused {pause}"] += 1
        note(f"TAKEOVER of batch {bid}: {a.label} is deposed {pause}; its held actions land {release}"
             + (", then it runs a late recovery" if late_recovery else ""))
        paused, wake = threading.Event(), threading.Event()
        a_errors: list[BaseException] = []

        def hold() -> None:
            paused.set()
            if not wake.wait(120):
                a_errors.append(RuntimeError("A was never released"))

        event = {"intent_on_wire": "before_intent", "after_intent": "after_intent",
                 "tasks_pre_committed": "tasks_done", "decision_on_wire": "before_decision"}[pause]
        a.on(event, hold)

        def run_a() -> None:
            try:
                f = self._run(a, bid, ids, plan_a)
                if f is None:
                    # Not an error in itself: A, woken after B's decision, may find the batch decided
                    # and return.  A second decision, or one by A's epoch, is what _check reports.
                    note(f"{a.label} (deposed) returned from its batch without an error")
                if late_recovery:
                    note(f"{a.label} (deposed) runs its recovery late")
                    a.protocol.recover()
            except BaseException as e:  # noqa: BLE001 - inspected below
                a_errors.append(e)

        t = threading.Thread(target=run_a, daemon=True, name="deposed-coordinator")
        t.start()
        if not paused.wait(120):
            t.join(120)
            if a_errors and isinstance(a_errors[0], ConformanceError):
                raise a_errors[0]
            raise ConformanceError(f"takeover: A never reached the pause point {pause} ({a_errors})")
        b = self._coord("B", a.url)
        released: list[bool] = []

        def let_a_go() -> None:
            if released:
                return
            released.append(True)
            note(f"{a.label} wakes up ({release})")
            wake.set()
            t.join(120)
            if t.is_alive():
                raise ConformanceError("takeover: the deposed coordinator did not finish within 120 s")

        ev = {"after_b_intent": "after_intent", "after_b_decision": "after_decision",
              "after_b_commit": "before_committed", "after_b_finished": None}[release]
        if ev:
            b.on(ev, let_a_go)
        failure = self._run(b, bid, ids, plan_b)
        b.hooks.clear()
        let_a_go()
        self.owner = b
        a.close()
        for e in a_errors:
            if isinstance(e, (ConformanceError, DataLossError)):
                raise ConformanceError(f"the deposed coordinator {a.label}, its actions landing {release} "
                                       f"(deposed {pause}): {e}") from None
            if not isinstance(e, (_EXPECTED + (_Died,))):
                note(f"{a.label} ended with {type(e).__name__}: {e}")
                raise ConformanceError(
                    f"the deposed coordinator {a.label}, its actions landing {release} (deposed {pause}), "
                    f"ended with {type(e).__name__}: {e}. A deposed coordinator may only stop with a "
                    "TwoPhaseError (fenced, lost its ballot, its batch failed); anything else is a bug "
                    "of the protocol or the sink that a real deposed driver would die of, its cleanup "
                    "undone") from e
        if isinstance(failure, _Died):
            failure = None if b.dead is False else failure
        self.stats["takeovers"] += 1
        self.took_over = True
        self._finish(failure, bid, ids)

    @precondition(lambda self: not self.crashed and any(self.contexts.values()))
    @rule(data=st.data())
    def late_task(self, data: Any) -> None:
        """A task attempt of an earlier batch (any ballot) runs again now: its leftovers must go."""
        assert self.owner is not None
        # Late attempts of the owner's pipeline and generation (a replaced generation's zombies
        # are played by new_generation, around the switch).
        self._late_attempt(data, (self.owner.url, int(self.owner.generation or 0)))

    def _late_attempt(self, data: Any, here: tuple[str, int]) -> None:
        """A late task attempt of an earlier batch of the pipeline and generation ``here``."""
        keys = sorted(k for k, v in self.contexts.items() if v and k[:2] == here)
        if not keys:
            return
        key = self._draw(data, st.sampled_from(keys), "late task's batch", keys[0])
        ctx, ids = self._draw(data, st.sampled_from(self.contexts[key]), "late task", self.contexts[key][0])
        bump = self._draw(data, st.sampled_from((0, 1, 7)), "late attempt number +", 0)
        outcome = self._draw(data, st.sampled_from((PRE_COMMIT, PRE_COMMIT, ABORT, DIE_MID_WRITE)),
                             "late task ends", PRE_COMMIT)
        late = TransactionContext(ctx.query_name, ctx.batch_id, ctx.partition_id, ctx.attempt + bump, ctx.intent,
                                  ctx.run, self.next_task_id())
        assert self.owner is not None
        self.stats["late task after later batches"] += 1
        self.late[here] = 0
        note(f"LATE TASK: batch {ctx.batch_id} p{ctx.partition_id} attempt {late.attempt} of run {ctx.run} "
             f"({ctx.query_name}) runs now")
        try:
            self.run_attempt(self.owner, _dumps_sink(self.owner.sink), late, ids, outcome, 1, label="late task")
        except Exception as e:  # noqa: BLE001
            note(f"late task failed: {type(e).__name__}: {str(e)[:200]}")
        self._check("after a late task attempt")

    @precondition(lambda self: self.pipelines and not self.crashed and self.current is None
                  and any(k[0] == self.main_url for k in self.rows))
    @rule(data=st.data())
    def second_pipeline(self, data: Any) -> None:
        """Another pipeline (another log) writes the same batch ids to the same target."""
        self._second_pipeline(data, "another log")

    @precondition(lambda self: self.pipelines and not self.crashed and self.current is None
                  and any(k[0] == self.main_url for k in self.rows))
    @rule(data=st.data())
    def new_generation(self, data: Any) -> None:
        """The pipeline restarts from a new checkpoint (a new generation of its log) and writes the
        same batch ids to the same target; a zombie of the replaced generation may run around it."""
        self._second_pipeline(data, "a new generation")

    def _second_pipeline(self, data: Any, kind: str) -> None:
        used = sorted({k[2] for k in self.rows if k[0] == self.main_url})
        bid = self._draw(data, st.sampled_from(used), "batch id it writes", used[0])
        _, ids = self._new_batch(data)
        self.stats[f"second pipeline: {kind}"] += 1
        zombie = None  # when a late attempt of the replaced generation runs (a zombie of the old query)
        if kind == "another log":
            url = f"{self.root}/log-{len(self.urls) + 1}"
            self.urls.append(url)
            c = self._coord("P2", url, f"q2-{self.name}")
        else:
            assert self.owner is not None
            old = (self.owner.url, int(self.owner.generation or 0))
            self.owner.close()
            c = self._coord("G2", self.main_url, f"q2-{self.name}", new_generation=True)
            self.query_id = f"q2-{self.name}"
            self.owner = c
            if any(v for k, v in self.contexts.items() if k[:2] == old):
                zombie = self._draw(data, st.sampled_from((None, "before its first batch", "after its first batch",
                                                           "after its first batch")),
                                    "a zombie of the replaced generation runs", None)
            if zombie == "before its first batch":
                note("a ZOMBIE of the replaced generation runs before the new generation's first batch")
                self._late_attempt(data, old)
        note(f"SECOND PIPELINE ({kind}, {c.query_name}) writes batch {bid} with rows {_span(ids)} to the same target")
        failure = self._run(c, bid, ids, _Plan(1, [[PRE_COMMIT]] * self.max_partitions, 1))
        if failure is not None:
            raise ConformanceError(f"a clean batch of a second pipeline ({kind}) failed: {failure}")
        if zombie == "after its first batch":
            note("a ZOMBIE of the replaced generation runs after the new generation's first batch")
            self._late_attempt(data, old)
        if c is not self.owner:
            c.close()
        self._check(f"after a second pipeline ({kind}) wrote batch {bid}", exact=True)

    # ------------------------------------------------------------------ teardown
    def teardown(self) -> None:
        import sys

        failure = sys.exc_info()[1]
        try:
            if isinstance(failure, ConformanceError):
                self._record(failure)
            if self.owner is None or failure is not None:
                return
            for _ in range(6):
                if self.crashed:
                    self.recover(None)
                elif self.current is not None:
                    self._run_owned(None, *self.current)
                else:
                    break
            if self.crashed or self.current is not None:
                why = getattr(self, "last_failure", None)
                raise ConformanceError("the example could not be finished (a batch failed on every replay): "
                                       f"{type(why).__name__}: {why}")
            self.stats["examples"] += 1
            if self.committed_rows:
                self.stats["examples_with_committed_rows"] += 1
            if self.took_over:
                self.stats["examples_with_takeover"] += 1
            for _ in range(2):  # late leftovers are the protocol's to clean within two batches
                bid, ids = self._new_batch(None)
                self._run_owned(None, bid, ids)
                if self.current is not None:
                    why = self.last_failure
                    raise ConformanceError(f"a clean closing batch {bid} failed: {type(why).__name__}: {why}")
            self._check("at the end of the example (two clean batches after everything)", exact=True, final=True)
        except ConformanceError as e:
            self._record(e)
            raise
        finally:
            for c in self.coords:
                c.close()
            self.coords = []
            if self.root:
                shutil.rmtree(self.root, ignore_errors=True)

    def _record(self, e: BaseException) -> None:
        if not self.failures:
            self.first_story.extend(_story)
        self.failures.append(str(e))

    # ------------------------------------------------------------------ checks
    def _pending(self) -> set[str] | None:
        return None if self.pending is None else {str(x) for x in self.pending()}

    def _truth(self) -> tuple[dict[int, tuple[str, int, int]], list[str]]:
        """Rows the log's commit decisions carry (row -> (log, generation, batch)); problems."""
        allowed: dict[int, tuple[str, int, int]] = {}
        problems: list[str] = []
        for url in self.urls:
            tl = TransactionLog(url, readonly=True)
            for g in tl.generations():
                gen = int(g["generation"])
                for bid, view in tl.views(gen).items():
                    commits = [b for b in view.ballots if b.decision is not None and not b.decision.aborted]
                    if len(commits) > 1:
                        problems.append(f"batch {bid} (log {url} generation {gen}) has {len(commits)} commit "
                                        f"decisions (ballots {[b.ballot for b in commits]}): a decision was "
                                        "written twice")
                    for b in commits:
                        opener = None if b.intent is None else b.intent.body.get("writer")
                        if opener != b.decision.body.get("writer"):  # type: ignore[union-attr]
                            problems.append(
                                f"batch {bid} ballot {b.ballot} (log {url} generation {gen}) holds a commit "
                                f"decision by epoch {b.decision.body.get('epoch')}, but "  # type: ignore[union-attr]
                                + ("no INTENT" if b.intent is None else
                                   f"its INTENT is epoch {b.intent.body.get('epoch')}'s")
                                + ": a ballot is decided only by the coordinator that opened it (its "
                                "decision names transactions its INTENT did not plan)")
                        for env in b.decision.handles:  # type: ignore[union-attr]
                            for row in self.handle_rows.get(json.dumps(env, sort_keys=True), []):
                                allowed[row] = (url, gen, bid)
        return allowed, problems

    def _read(self) -> Counter:
        lo, hi = self.id_base, self.id_base + ID_SPAN
        return Counter(i for i in map(self.id_of, self.read_committed()) if lo <= i < hi)

    def _check(self, where: str, exact: bool = False, final: bool = False) -> None:
        allowed, problems = self._truth()
        deadline = time.monotonic() + self.settle_timeout
        while True:
            seen = self._read()
            dup = sorted(i for i, c in seen.items() if c > 1)
            unexpected = sorted(set(seen) - set(allowed))
            missing = sorted(set(allowed) - set(seen)) if exact else []
            if dup or unexpected or not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        for i in dup[:5]:
            problems.append(f"row {i} appears {seen[i]} times ({self._whose(i)})")
        for i in unexpected[:5]:
            problems.append(f"row {i} is visible but no commit decision in the log carries it ({self._whose(i)})")
        for i in missing[:5]:
            problems.append(f"row {i} is missing although the log decided its batch ({self._whose(i)}): "
                            "decided data was destroyed or never committed")
        # Late leftovers are due two batches after the late attempt (a new generation's: after its
        # first batch); at the end of an example every late attempt is that far behind.
        unsettled = [] if final else [k for k, n in self.late.items() if n < 2]
        if not problems and exact and self.pending is not None and not unsettled:
            left = (self._pending() or set()) - (self.pending_baseline or set())
            if left:
                problems.append(f"{len(left)} transaction(s) still open at a quiescent point: {sorted(left)[:5]}"
                                + (" (after a late task attempt: its leftovers must be found within two "
                                   "batches of its generation, or by the first batch of a generation that "
                                   "replaced it)" if self.late else
                                   " (abort_lingering must abort what failed attempts and crashed runs left)"))
        if problems:
            msg = (f"{where}: exactly-once violated for {type(self.owner.sink).__name__ if self.owner else '?'} "
                   f"under the protocol {getattr(self.protocol_factory, '__name__', self.protocol_factory)}:\n  "
                   + "\n  ".join(problems))
            note(msg)
            raise ConformanceError(msg)
        note(f"  check {'(exact) ' if exact else ''}{where}: {sum(seen.values())} rows visible, as expected")

    def _whose(self, row: int) -> str:
        for (url, gen, bid), ids in self.rows.items():
            if row in ids:
                return f"batch {bid} of log {url.rsplit('/', 1)[-1]} generation {gen}"
        return "no batch of this example"


def make_ownership_machine(sink_factory: Callable[[], TwoPhaseCommitSink], read_committed: Callable[[], Iterable[Any]],
                           *, protocol_factory: Callable[..., Any] | None = None, **options: Any
                           ) -> type[OwnershipMachine]:
    """The configured ownership state machine class (options as for ``run_sink_conformance``)."""
    import itertools
    import random

    from twophase.protocol import TwoPhaseProtocol

    attrs: dict[str, Any] = {
        "sink_factory": staticmethod(sink_factory),
        "read_committed": staticmethod(read_committed),
        "protocol_factory": staticmethod(protocol_factory or TwoPhaseProtocol),
        "_run_token": f"{random.getrandbits(24):06x}",
        "_examples": itertools.count(1),
        "_id_floor": None,
        "stats": Counter(),
        "failures": [],
        "first_story": [],
    }
    for k, v in options.items():
        if v is None:
            continue
        attrs[k] = staticmethod(v) if callable(v) and k in ("make_batch", "id_of", "reset", "pending") else v
    return type("SinkOwnershipConformance", (OwnershipMachine,), attrs)


def run_ownership_conformance(sink_factory: Callable[[], TwoPhaseCommitSink],
                              read_committed: Callable[[], Iterable[Any]], *, settings: Any = None,
                              max_examples: int | None = None, steps: int | None = None, seed: int | None = None,
                              protocol_factory: Callable[..., Any] | None = None, min_useful_share: float = 0.3,
                              **options: Any) -> dict[str, int]:
    """Run the ownership machine alone (``run_sink_conformance`` runs it after the crash machine).

    Fails as degenerate (at any number of examples) if fewer than ``ceil(min_useful_share *
    examples)`` examples committed rows of their own before their closing batches, or played a
    takeover: every example's first step is a takeover, so a working run has both in every example."""
    machine = make_ownership_machine(sink_factory, read_committed, protocol_factory=protocol_factory, **options)
    s = settings if settings is not None else default_settings(max_examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    overrides: dict[str, Any] = {k: v for k, v in (("max_examples", max_examples), ("stateful_step_count", steps))
                                 if v is not None}
    if overrides:
        s = hypothesis.settings(s, **overrides)
    if seed is not None:
        machine = hypothesis.seed(seed)(machine)
    try:
        stateful.run_state_machine_as_test(machine, settings=s)
    except hypothesis.errors.Flaky as e:
        if not machine.failures:
            raise
        err = ConformanceError(f"{machine.failures[0]}\n(This failure did not happen again when hypothesis "
                               "replayed the same steps: the sink or the protocol answered differently, the mark "
                               "of a race. The notes below are the failing run's story.)")
        for line in machine.first_story:
            err.add_note(line)
        raise err from e
    except ConformanceError as e:
        if seed is not None:
            e.add_note(f"reproduce: the same call with seed={seed}")
        raise
    stats = dict(machine.stats)
    _log.info("ownership conformance run of %s: %s", machine.query_prefix, _format_stats(stats))
    check_reach(stats, min_useful_share, {
        "examples_with_committed_rows": "committed a batch with rows of their own",
        "examples_with_takeover": "played a takeover of a deposed coordinator's batch",
    }, "Check that the protocol's batches and takeovers are not failing (see the run's notes).", half="ownership")
    return stats


#: The ownership machine's defaults (examples, steps per example).
DEFAULT_EXAMPLES = 25
DEFAULT_STEPS = 6
