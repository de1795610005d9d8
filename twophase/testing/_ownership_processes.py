"""The processes the ownership machine plays (part of :mod:`twophase.testing.ownership`).

A coordinator (:class:`_Coord`): its sink, its own log object on the shared log folder, whose
store (:class:`_FaultyStore`) dies with its driver and fires hooks around its writes, its
protocol, and a committer that can die mid-commit (:class:`_DyingCommitter`).  The engine's side
of a batch run (:class:`_Work`, the protocol's ``BatchWork``) and the task attempts
(:class:`_TaskAttempts`), each on its own unpickled copy of the sink as on an executor, run only
under an INTENT the log holds as their coordinator's own.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twophase.context import TransactionContext
from twophase.errors import TwoPhaseError
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
from twophase.testing._ownership_common import _OUTCOMES, _Died, _Plan, note
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
)

if TYPE_CHECKING:
    from hypothesis import strategies as st
else:
    from twophase._deps import require

    st = require("hypothesis.strategies", "twophase.testing")


class _Coord:
    """One coordinator process: its sink, its log object (store wrapped for faults), its protocol."""

    def __init__(self, machine: _TaskAttempts, label: str, url: str, query_id: str, sink: TwoPhaseCommitSink,
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


class _Work:
    """The engine's side of one batch run (``BatchWork``): tasks in-process on pickled sink copies."""

    def __init__(self, machine: _TaskAttempts, coord: _Coord, ids: list[int], plan: _Plan):
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


class _TaskAttempts:
    """Part of :class:`~twophase.testing.ownership.OwnershipMachine`: task attempts, each on its own
    copy of the sink (executor side, in-process), and the drawn plan of a batch run."""

    # The machine's configuration and state read here and by the coordinators: set by
    # OwnershipMachine (class attributes, start) and make_ownership_machine; declared here for the
    # type checker only.
    make_batch: Callable[[list[int]], Any]
    protocol_factory: Callable[..., Any]
    max_partitions: int
    commit_retries: int
    commit_parallelism: int
    stats: Counter
    name: str
    task_ids: int
    handle_rows: dict[str, list[int]]

    def next_task_id(self) -> int:
        self.task_ids += 1
        return self.task_ids

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
