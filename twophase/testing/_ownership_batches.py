"""How the ownership machine runs a batch (part of :mod:`twophase.testing.ownership`).

A coordinator runs a batch through the protocol (``run_batch``) on the engine's side of
:class:`~twophase.testing._ownership_processes._Work`; the owner's batches draw a crash point
(armed as hooks on its log's writes and its committer) and a late duplicate of one of their
tasks; what the run ended with is then checked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from twophase.context import TransactionContext
from twophase.errors import DataLossError
from twophase.testing._ownership_checks import _OwnershipChecks
from twophase.testing._ownership_common import (
    _EXPECTED,
    CRASH_POINTS,
    LATE_WHEN,
    _Died,
    _Plan,
    note,
)
from twophase.testing._ownership_processes import _Coord, _TaskAttempts, _Work
from twophase.testing._shared import (
    ABORT,
    DIE_MID_WRITE,
    PRE_COMMIT,
    ConformanceError,
    _dumps_sink,
    _span,
)

if TYPE_CHECKING:
    from hypothesis import strategies as st
else:
    from twophase._deps import require

    st = require("hypothesis.strategies", "twophase.testing")


class _OwnershipBatches(_TaskAttempts, _OwnershipChecks):
    """Part of :class:`~twophase.testing.ownership.OwnershipMachine`: a batch run by a coordinator,
    the owner's batches with their drawn crash points and late duplicate tasks."""

    # The machine's state used here: set by OwnershipMachine (start); declared for the type checker.
    next_batch: int
    next_id: int
    max_rows: int
    contexts: dict[tuple[str, int, int], list[tuple[TransactionContext, list[int]]]]
    current: tuple[int, list[int]] | None
    crashed: bool
    crashes_left: int
    committed_rows: bool

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
