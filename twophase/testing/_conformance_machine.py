"""The crash machine itself (part of :mod:`twophase.testing.conformance`): :class:`SinkConformanceMachine`.

Its configuration (class attributes, filled in by
:func:`~twophase.testing.conformance.make_state_machine`), the set-up of an example, the
hypothesis rules (a micro-batch, the replay of an undecided one, a committed handle committed
again, ``abort_lingering`` again on a finished batch) and the teardown that finishes every
example as a restarted query would.  Its parts: the oracle (:mod:`twophase.testing._conformance_checks`),
the driver's decisions, commits and recovery (:mod:`twophase.testing._conformance_commits`) and a
run of a batch's job (:mod:`twophase.testing._conformance_tasks`).
"""

from __future__ import annotations

import itertools
import json
import logging
import sys
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.recovery import Committer, PendingBatch, recover_pending
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._conformance_commits import _HarnessCommitter
from twophase.testing._conformance_model import BATCH_SPAN, BatchModel, SinkFactory
from twophase.testing._conformance_tasks import _BatchRuns
from twophase.testing._shared import (
    ID_SPAN,
    ConformanceError,
    _close,
    _span,
    _story,
    default_id_of,
    default_make_batch,
    example_id_base,
    note,
)

if TYPE_CHECKING:
    from hypothesis import stateful
    from hypothesis import strategies as st
else:  # the install hint when the "testing" extra is missing
    st = require("hypothesis.strategies", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

_log = logging.getLogger("twophase.testing")
rule, precondition, initialize = stateful.rule, stateful.precondition, stateful.initialize


class SinkConformanceMachine(_BatchRuns, stateful.RuleBasedStateMachine):
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
