"""The actors of a scenario: :class:`Actor`, what its ``run`` gets (:class:`ActorContext`: a sink, a
log, a protocol, a task attempt of its own), the rows of a batch (:func:`rows_of`), and the actors
the named scenarios are made of: :func:`owner`, :func:`deposed`, :func:`datasource_run`,
:func:`late_attempt`, :func:`operator_recover`, :func:`batch_job`, and the final owner that runs
alone after every schedule."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import twophase.recovery as _recovery_mod
from twophase.context import TransactionContext
from twophase.errors import DataLossError, PrunedBatchError, TwoPhaseError
from twophase.log import TransactionLog, parse_batch_name
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink
from twophase.testing.explorer._base import (
    LOG_URL,
    NAME,
    TaskFailed,
    _Abandon,
    _RunView,
    _WorldView,
    query_id_of,
)
from twophase.testing.explorer.points import _body, _scheduled


# ============================================================================ actors
@dataclass
class Actor:
    """One actor of a scenario: ``run(ctx)`` runs in a thread of its own.

    Everything ``run`` does before it calls ``ctx.ready()`` is its prologue: run before any
    schedule branches, in the scenario's order, one actor after the other (e.g. a deposed
    coordinator's epoch, older than the owner's).  An actor that never calls it is ready at once.
    ``guard(world)``, if given, must return something true before the actor may start (what it
    returns is ``ctx.captured``): a late task attempt waits for its ballot's INTENT.  ``expected``:
    the exceptions it may stop with (default :class:`~twophase.errors.TwoPhaseError`: a
    coordinator's, or an operator tool's, deliberate stop).
    """

    name: str
    run: Callable[[ActorContext], None]
    guard: Callable[[_WorldView], Any] | None = None
    prologue: bool = False  # run() calls ctx.ready() itself
    #: What the actor may stop with; anything else is ``unexpected-error``.
    expected: tuple[type[BaseException], ...] = (TwoPhaseError,)
    #: What it must never stop with, although expected: ``data-loss`` (a batch job's run that
    #: finds its decided batch's data gone, :class:`~twophase.errors.DataLossError`).
    forbidden: tuple[type[BaseException], ...] = ()


class ActorContext:
    """What an actor's ``run`` gets: the schedule's world, and helpers that build what a process
    builds (a sink object, a log object, a protocol) on it."""

    def __init__(self, world: _WorldView, run: _RunView):
        self.world, self._run = world, run

    @property
    def batches(self) -> int:
        return self.world.batches

    @property
    def query_id(self) -> str:
        return query_id_of(self.world.batch_ids)

    @property
    def captured(self) -> Any:
        return self._run.captured

    def ready(self) -> None:
        """End of the prologue: from here on every scheduling point may switch actors."""
        self._run.ready()

    def label(self, tlog: TransactionLog | None = None, suffix: str = "") -> None:
        """Name this actor in the trace after its log's epoch (``deposed[e1]``)."""
        base = self._run.actor.name
        self._run.label = base + (f"[e{tlog.epoch}]" if tlog is not None and tlog.epoch is not None else "") + suffix

    def sink(self) -> TwoPhaseCommitSink[Any, Any]:
        """A sink object of a process of its own (scheduling points on every method)."""
        return _scheduled(self.world.sut.sink(self.world.target_obj), self.world)

    def tlog(self) -> TransactionLog:
        """A log object of a process of its own, on the schedule's store."""
        return TransactionLog(LOG_URL, retain_batches=self.world.retain_batches, lease_timeout=3600.0)

    def protocol(self, sink: TwoPhaseCommitSink[Any, Any], tlog: TransactionLog, name: str = NAME) -> TwoPhaseProtocol:
        query_name = f"{name}.{tlog.scope()}"
        p: TwoPhaseProtocol = self.world.protocol_factory(
            sink, tlog, name=name, query_name=query_name,
            committer=lambda: Committer(sink, parallelism=1, retries=1, backoff=0.0, max_backoff=0.0, name=name))
        return p

    def work(self, sink: TwoPhaseCommitSink[Any, Any], batch_id: int) -> _Work:
        return _Work(self, sink, batch_id)

    def note(self, text: str) -> None:
        self.world.log("note", text)

    def spark_committed(self, batch_id: int) -> None:
        """Spark wrote ``commits/N``: the batch's run returned (it is never replayed)."""
        self.world.spark_committed.add(batch_id)

    def task(self, sink: TwoPhaseCommitSink[Any, Any], batch_id: int, intent: dict[str, Any], run: str,
             query_name: str, *, partition: int = 0, attempt: int = 0) -> dict[str, Any]:
        """One task attempt as the executors run it: begin, write the batch's rows, pre-commit
        (abort what was begun if anything fails).  Returns the protocol's result row.  A sink error
        that is not a :class:`~twophase.errors.TwoPhaseError` is raised as :class:`TaskFailed`: Spark
        fails the job, and the driver never sees the executor's exception type."""
        self.world.task_ids += 1
        ctx = TransactionContext(query_name, batch_id, partition, attempt, intent, run,
                                 task_attempt_id=self.world.task_ids)
        rows = rows_of(batch_id, partition, self.world.sut.partitions)
        try:
            txn = sink.begin_transaction(ctx)
            try:
                sink.write(txn, self.world.sut.make_batch(rows))
                handle = sink.pre_commit(txn)
            except BaseException:
                with contextlib.suppress(Exception):
                    sink.abort(txn)
                raise
        except (TwoPhaseError, _Abandon):
            raise
        except Exception as e:  # the executor's own error: the driver sees a failed job, not its type
            raise TaskFailed(f"batch {batch_id} partition {partition} attempt {attempt}: {type(e).__name__}: {e}") from e
        return {"partition": partition, "attempt": attempt, "rows": len(rows), "handle": sink.encode_handle(handle)}


def rows_of(batch_id: int, partition: int = 0, partitions: int = 1) -> list[int]:
    """The row ids of one partition of a batch (the same on every replay): ``2b`` and ``2b + 1``
    in partition 0 of a one-partition batch; of two partitions, ``2b + p`` in partition ``p``."""
    if partitions == 2:
        return [2 * batch_id + partition] if partition in (0, 1) else []
    return [2 * batch_id, 2 * batch_id + 1] if partition == 0 else []


def _batch_of(row: int) -> int:
    return row // 2


class _Work:
    """The engine's side of a batch (``BatchWork``): one partition, its task run in-process on a
    sink object of its own (as an executor's pickled copy)."""

    def __init__(self, ctx: ActorContext, sink: TwoPhaseCommitSink[Any, Any], batch_id: int):
        self.ctx, self.sink, self.batch_id = ctx, sink, batch_id

    def partitions(self, planned: int | None) -> int:
        return self.ctx.world.sut.partitions

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        return [self.ctx.task(self.ctx.sink(), batch_id, intent, run, query_name, partition=p)
                for p in range(self.ctx.world.sut.partitions)]

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        return None


def _batches(ctx: ActorContext, batches: Sequence[int] | None, until_last: bool) -> list[int]:
    """``batches``, or (None) what a query (re)started now runs: from the first batch Spark's commit
    log lacks, to the scenario's last (``until_last``) or just that one (a run paused in it)."""
    if batches is not None:
        return list(batches)
    first = next((b for b in range(ctx.batches) if b not in ctx.world.spark_committed), None)
    if first is None:
        return []
    return list(range(first, ctx.batches)) if until_last else [first]


def _run_batches(ctx: ActorContext, protocol: TwoPhaseProtocol, sink: TwoPhaseCommitSink[Any, Any],
                 batches: list[int]) -> None:
    for b in batches:
        prog = BatchProgress(NAME, b, ctx.query_id, "committed")
        protocol.run_batch(b, ctx.work(sink, b), prog)
        ctx.note(f"batch {b} {prog.action}")
        ctx.spark_committed(b)


def _take_log(ctx: ActorContext) -> tuple[TwoPhaseCommitSink[Any, Any], TwoPhaseProtocol]:
    """A coordinator's start: its sink opened, the log taken over (a new epoch), its protocol."""
    sink = ctx.sink()
    sink.open()
    tlog = ctx.tlog()
    tlog.acquire(ctx.query_id, NAME, takeover=True)
    ctx.label(tlog)
    return sink, ctx.protocol(sink, tlog)


def owner(batches: Sequence[int] | None = None, *, name: str = "owner", until_last: bool = True) -> Actor:
    """The log's owner: a coordinator that takes the log over (``takeover=True``: a newer epoch, at a
    point the explorer picks) and runs ``run_batch`` for ``batches``, one after the other, as
    Spark's ``foreachBatch`` calls it.  Default: from the first batch Spark has not committed when
    it starts (a restarted query replays that one) to the scenario's last."""

    def run(ctx: ActorContext) -> None:
        todo = _batches(ctx, batches, until_last)
        sink, protocol = _take_log(ctx)
        _run_batches(ctx, protocol, sink, todo)

    return Actor(name, run)


def deposed(batches: Sequence[int] | None = None, *, name: str = "deposed", history: int = 0,
            until_last: bool = False) -> Actor:
    """A deposed coordinator: it took the log (its epoch) in the prologue, before the owner, and
    committed batches ``0 .. history-1`` there itself (so its protocol is clean, and its next batch
    takes the fast path: no view before its INTENT).  Then it runs ``batches`` (default: the first
    batch Spark has not committed, alone) on its own log object; every write of its may land
    anywhere in the owner's run (it was paused, or held on the wire)."""

    def run(ctx: ActorContext) -> None:
        sink, protocol = _take_log(ctx)
        _run_batches(ctx, protocol, sink, list(range(history)))
        ctx.ready()
        _run_batches(ctx, protocol, sink, _batches(ctx, batches, until_last))

    return Actor(name, run, prologue=True)


def datasource_run(batches: Sequence[int] | None = None, *, name: str = "ds", until_last: bool = False) -> Actor:
    """One run of a query written with the data source form (``format("twophase-...")``): per batch
    its plan step, its task and its commit step, each a process of its own, as
    twophase/datasource_plan.py and twophase/datasource_writer.py run them.  Default batches: the
    first batch Spark has not committed when it starts, alone (a run paused in it) or
    (``until_last``) to the scenario's last (a restarted run).

    Plan (``_plan``): a fresh log taken over (a new epoch), ``open_ballot``.  Task: begin, write,
    pre-commit under the plan's INTENT.  Commit (``_Steps._commit``): a log ``resume``-d as the
    plan's owner, ``check_prepared`` (a failure closes the ballot: ``give_up``), then
    ``decide_and_commit`` with no epoch check, then ``committed``.  A failed task makes Spark abort
    the write (``_Steps._abort``: ``give_up`` from a resumed log).  Mirrored here (that module needs
    pyspark): keep the two in step."""

    def run(ctx: ActorContext) -> None:
        for b in _batches(ctx, batches, until_last):
            psink = ctx.sink()                                           # plan step
            psink.open()
            tlog = ctx.tlog()
            tlog.acquire(ctx.query_id, NAME, takeover=True)
            ctx.label(tlog)
            planner = ctx.protocol(psink, tlog)
            prog = BatchProgress(NAME, b, ctx.query_id, "committed")
            opened = planner.open_ballot(b, lambda planned: planned or 1, prog)
            owner_id, epoch, generation = tlog.owner, tlog.epoch, tlog.generation
            if opened is None:
                ctx.note(f"batch {b} planned: {prog.action}")
                ctx.spark_committed(b)
                continue
            ctx.note(f"batch {b} planned: ballot {opened.number}")

            def resumed(sink: TwoPhaseCommitSink[Any, Any], owner_id: str = owner_id, epoch: int | None = epoch,
                        generation: int | None = generation) -> TwoPhaseProtocol:
                rlog = ctx.tlog()
                rlog.resume(owner=owner_id, epoch=epoch, generation=generation, query_id=ctx.query_id)
                p = ctx.protocol(sink, rlog)
                p.dirty = False
                return p

            try:                                                         # the task
                results = [ctx.task(ctx.sink(), b, opened.intent, opened.run, opened.query_name)]
            except Exception as e:
                asink = ctx.sink()                                       # Spark aborts the write
                asink.open_for_commit()
                resumed(asink).give_up(opened, TwoPhaseError(f"Spark aborted batch {b}: {e}"))
                raise
            csink = ctx.sink()                                           # commit step
            csink.open_for_commit()
            committer = resumed(csink)
            try:
                committer.check_prepared(opened, results, started_at=0.0)
            except BaseException as e:
                committer.give_up(opened, e)
                raise
            committer.decide_and_commit(opened, results, BatchProgress(NAME, b, ctx.query_id, "committed"))
            committer.committed(b)
            ctx.note(f"batch {b} committed (ballot {opened.number})")
            ctx.spark_committed(b)

    return Actor(name, run)


def _intent_of(world: _WorldView, batch_id: int, ballot: int | None) -> dict[str, Any] | None:
    """The INTENT of a ballot of a batch in the store (``ballot=None``: its latest), or None."""
    best: tuple[int, dict[str, Any]] | None = None
    for name, data in world.files.items():
        parsed = parse_batch_name(name.rsplit("/", 1)[-1])
        if parsed is None or parsed[0] != batch_id or parsed[1] != "intent":
            continue
        if ballot is not None and parsed[2] != ballot:
            continue
        if best is None or parsed[2] > best[0]:
            best = (parsed[2], _body(data))
    if best is None:
        return None
    return {"ballot": best[0], "intent": best[1].get("intent") or {}, "name": best[1].get("name") or NAME}


def late_attempt(batch_id: int = 0, *, ballot: int | None = None, partition: int = 0, attempt: int = 1,
                 name: str = "late") -> Actor:
    """A late task attempt: once a ballot of ``batch_id`` has an INTENT (``ballot``: that one; else
    the latest when it starts), an attempt of its partition begins, writes and pre-commits under
    that ballot's plan, at any point after (before or after the decision, the commits, later
    batches): a stage retry's duplicate, a zombie executor.  It never reports to anyone; it may
    fail (:class:`TaskFailed`, say a real sink's error once its staging was cleaned up)."""

    def run(ctx: ActorContext) -> None:
        found = ctx.captured
        ctx.label(None, f"[b{batch_id} ballot {found['ballot']}]")
        ctx.task(ctx.sink(), batch_id, found["intent"], "late", found["name"], partition=partition, attempt=attempt)

    return Actor(name, run, guard=lambda world: _intent_of(world, batch_id, ballot))


def operator_recover(*, name: str = "recover") -> Actor:
    """An operator's ``twophase recover --takeover`` (:func:`twophase.recovery.recover`), run at a
    point the explorer picks: a newer epoch, recovery of every pending batch, the lease released."""

    def run(ctx: ActorContext) -> None:
        report = _recovery_mod.recover(LOG_URL, ctx.sink(), takeover=True, parallelism=1)
        ctx.note(f"recovered: committed batches {report.committed_batches}, aborted {report.aborted}")

    return Actor(name, run)


def batch_job(batch_id: int, *, name: str | None = None) -> Actor:
    """One run of a batch job (a ``df.write`` of batch ``batch_id``, the id the job picks itself):
    it opens its sink, takes the log over (``takeover=True``: a new epoch, as every batch write and
    data source plan does) and runs ``run_batch(batch_id)`` (recovery first).  Two of them with
    other ids, out of order, are two runs of one job (same name, target and log) that overlap: a
    backfill of an older id beside a run of a newer one.  It may be deposed (a
    :class:`~twophase.errors.TwoPhaseError`), but never stop with
    :class:`~twophase.errors.DataLossError` (``data-loss``: its decided batch's data is gone)."""

    def run(ctx: ActorContext) -> None:
        sink, protocol = _take_log(ctx)
        prog = BatchProgress(NAME, batch_id, ctx.query_id, "committed")
        protocol.run_batch(batch_id, ctx.work(sink, batch_id), prog)
        ctx.note(f"batch {batch_id} {prog.action}")
        ctx.spark_committed(batch_id)

    return Actor(name or f"b{batch_id}", run, forbidden=(DataLossError,))


def _final_owner(world: _WorldView) -> Actor:
    """After every actor: a restarted query's coordinator, alone: recovery, then every batch Spark
    has not committed, then one batch more (its cleanup sweeps what late attempts left).  Batch
    jobs (``Scenario.batch_ids``): a re-run of every job whose run did not return, in id order (one
    refused as committed and pruned is finished: its rows are checked), then one id more."""

    def run(ctx: ActorContext) -> None:
        sink, protocol = _take_log(ctx)
        protocol.recover()
        protocol.dirty = False
        for b in world.expected:
            if b in world.spark_committed:
                continue
            prog = BatchProgress(NAME, b, ctx.query_id, "committed")
            if world.batch_ids is not None:
                try:  # a re-run of a batch job whose run did not return
                    protocol.run_batch(b, ctx.work(sink, b), prog)
                except PrunedBatchError as e:  # committed (by the other run's recovery) and pruned: finished
                    ctx.note(f"batch {b} refused as committed and pruned: {str(e)[:80]}")
                    world.spark_committed.add(b)
                    continue
            else:
                protocol.run_batch(b, ctx.work(sink, b), prog)
            ctx.note(f"batch {b} {prog.action}")
            world.spark_committed.add(b)

    return Actor("final", run)
