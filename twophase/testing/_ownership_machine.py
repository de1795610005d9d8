"""The ownership state machine itself (part of :mod:`twophase.testing.ownership`): :class:`OwnershipMachine`.

Its configuration (class attributes, filled in by
:func:`~twophase.testing.ownership.make_ownership_machine`), the set-up of an example (a fresh log
folder and coordinator A), the hypothesis rules (a batch, its replay, a new driver's recovery,
the takeovers, a late task attempt, a second pipeline or generation on the same target) and the
teardown that finishes every example with two clean batches.  Its parts: the coordinators and
tasks (:mod:`twophase.testing._ownership_processes`), the checks
(:mod:`twophase.testing._ownership_checks`) and a batch run
(:mod:`twophase.testing._ownership_batches`).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twophase.context import TransactionContext
from twophase.errors import DataLossError
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._ownership_batches import _OwnershipBatches
from twophase.testing._ownership_common import (
    _EXPECTED,
    BATCH_SPAN,
    PAUSES,
    RELEASES,
    _deferred,
    _Died,
    _Plan,
    _test_thread,
    note,
)
from twophase.testing._ownership_processes import _Coord
from twophase.testing._shared import (
    ABORT,
    DIE_MID_WRITE,
    PRE_COMMIT,
    ConformanceError,
    _dumps_sink,
    _span,
    _story,
    default_id_of,
    default_make_batch,
    example_id_base,
)

if TYPE_CHECKING:
    from hypothesis import stateful
    from hypothesis import strategies as st
else:
    from twophase._deps import require

    st = require("hypothesis.strategies", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

rule, precondition, initialize = stateful.rule, stateful.precondition, stateful.initialize


class OwnershipMachine(_OwnershipBatches, stateful.RuleBasedStateMachine):
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

    # ------------------------------------------------------------------ running a batch
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
