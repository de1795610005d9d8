"""The sink conformance harness: a hypothesis state machine that plays coordinator, executors and crashes.

Runs in the test process, without Spark: it calls the sink's methods directly,
in the orders the coordinator (coordinator/coordinator.py) and Spark can produce,
and checks what a reader sees through the user's ``read_committed``.
"""

from __future__ import annotations

import inspect
import itertools
import json
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from twophase._deps import require
from twophase.context import TransactionContext
from twophase.errors import HandleError
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink

hypothesis = require("hypothesis", "twophase.testing")
st = require("hypothesis.strategies", "twophase.testing")
stateful = require("hypothesis.stateful", "twophase.testing")
pa = require("pyarrow", "twophase.testing")

note = hypothesis.note
rule, precondition, initialize = stateful.rule, stateful.precondition, stateful.initialize

SinkFactory = Callable[[], TwoPhaseCommitSink]

#: Ids of example n live in [floor + n * ID_SPAN, floor + (n + 1) * ID_SPAN); ``floor`` is above every id
#: the storage held when the run started, so earlier data (other runs, other tests) is ignored.
ID_SPAN = 100_000
#: Batch ids of example n are n * BATCH_SPAN + k.
BATCH_SPAN = 1_000

# How a task attempt ends (Spark's view of one partition's task).
PRE_COMMIT = "pre_commit"            # begin, write, pre_commit, result reaches the driver
ABORT = "abort"                      # the task fails cleanly: the sink's abort() runs, Spark retries it
DIE_AFTER_PRE_COMMIT = "die_after_pre_commit"  # pre-committed, then the executor died before reporting
DIE_MID_WRITE = "die_mid_write"      # the executor died while writing: no abort, objects just vanish
TASK_OUTCOMES = (PRE_COMMIT, ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE)


class ConformanceError(AssertionError):
    """The sink broke the exactly-once contract; the message (and hypothesis' notes) tell the story."""


def default_make_batch(ids: list[int]) -> pa.RecordBatch:
    """Rows with a unique ``id`` (int64) and a ``payload`` string: the harness' default row builder."""
    return pa.RecordBatch.from_pydict({
        "id": pa.array(ids, pa.int64()),
        "payload": pa.array([f"row {i} · ünïcode" for i in ids], pa.string()),
    })


def default_id_of(record: Any) -> int:
    """The id of one record returned by ``read_committed``: a mapping's ``"id"``, or the record itself."""
    if isinstance(record, Mapping):
        return int(record["id"])
    return int(record)


@dataclass
class Attempt:
    """One task attempt of one partition, as the harness ran it."""

    partition: int
    attempt: int
    outcome: str
    ids: list[int]
    handle_desc: str = ""
    life: int = 0

    def label(self, batch_id: int) -> str:
        return f"batch {batch_id} partition {self.partition} attempt {self.attempt}"


@dataclass
class BatchModel:
    """The coordinator's and the log's view of one batch."""

    batch_id: int
    ids: list[int]
    intent_json: str
    num_partitions: int               # as planned in the INTENT
    run_partitions: int = 0           # partitions of the current run (<= planned on a replay)
    assignment: dict[int, list[int]] = field(default_factory=dict)  # partition -> ids, current run
    next_attempt: dict[int, int] = field(default_factory=dict)
    results: dict[int, str] = field(default_factory=dict)           # partition -> envelope JSON
    result_ids: dict[int, list[int]] = field(default_factory=dict)
    attempts: list[Attempt] = field(default_factory=list)
    runs: int = 1
    prepared_json: str | None = None  # the PREPARED record: the decision
    handle_ids: list[list[int]] = field(default_factory=list)      # rows of each decided handle
    committed_handles: set[int] = field(default_factory=set)       # indexes into the decision
    committed_logged: bool = False

    @property
    def decided(self) -> bool:
        return self.prepared_json is not None

    def pending_partitions(self) -> list[int]:
        return [p for p, ids in sorted(self.assignment.items()) if ids and p not in self.results]


class SinkConformanceMachine(stateful.RuleBasedStateMachine):
    """Drives one sink through batches, task failures, driver crashes and recoveries.

    Configure through :func:`make_state_machine`; the class attributes below are
    filled in there.  One hypothesis example = one fresh query name, a fresh
    range of row ids and fresh batch ids, so examples never see each other's rows.
    """

    sink_factory: SinkFactory
    read_committed: Callable[[], Iterable[Any]]
    make_batch: Callable[[list[int]], Any] = staticmethod(default_make_batch)
    id_of: Callable[[Any], int] = staticmethod(default_id_of)
    reset: Callable[[], None] | None = None
    pending: Callable[[], Iterable[Any]] | None = None
    max_rows: int = 12
    max_partitions: int = 3
    check_every_step: bool = True
    settle_timeout: float = 0.0
    commit_retries: int = 5
    query_prefix: str = "conformance"
    rebuild_from_config: bool = True

    _run_token: str = ""
    _examples: itertools.count
    _id_floor: int | None = None

    def __init__(self) -> None:
        super().__init__()
        self.sink: TwoPhaseCommitSink | None = None
        self.batches: dict[int, BatchModel] = {}
        self.current: BatchModel | None = None
        self.crashed = False
        self.crash_point = ""
        self.life = 0
        self.progress = 0  # protocol steps since the last recovery: a crash needs at least one

    # ================================================================ set-up
    @initialize()
    def start_query(self) -> None:
        cls = type(self)
        n = next(cls._examples)
        if self.reset is not None:
            self.reset()
        if cls._id_floor is None:
            seen = [self.id_of(r) for r in self.read_committed()]
            cls._id_floor = (max(seen) // ID_SPAN + 1) * ID_SPAN if seen else 0
        self.example = n
        self.query_name = f"{self.query_prefix}-{self._run_token}-{n}"
        self.id_base = cls._id_floor + n * ID_SPAN
        self.next_id = self.id_base
        self.next_batch = n * BATCH_SPAN
        self.last_batch = self.next_batch + BATCH_SPAN - 1
        self.pending_baseline = self._pending()
        self.sink = self._new_sink("factory")
        self.sink.open()
        note(f"query {self.query_name}: sink {self._sink_name()} opened; row ids from {self.id_base}")

    def _new_sink(self, how: str) -> TwoPhaseCommitSink:
        if how == "config" and self.sink is not None:
            cls = type(self.sink)
            config = json.loads(json.dumps(self.sink.to_config()))
            return cls.from_config(config)
        sink = self.sink_factory()
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConformanceError(f"sink_factory returned {type(sink).__name__}, not a TwoPhaseCommitSink")
        return sink

    def _sink_name(self) -> str:
        return f"{type(self.sink).__name__}(kind={self.sink.kind!r})"

    # ================================================================ phases
    def _idle(self) -> bool:
        return not self.crashed and self.current is None

    def _executing(self) -> bool:
        return not self.crashed and self.current is not None and not self.current.decided

    def _deciding(self) -> bool:
        return not self.crashed and self.current is not None and self.current.decided

    def _phase_name(self) -> str:
        """The coordinator crash point (twophase/crash.py) this moment corresponds to."""
        b = self.current
        if b is None:
            return "after_committed_logged (between batches)"
        if not b.decided:
            if not b.results and not b.attempts:
                return f"after_intent of batch {b.batch_id}"
            if b.pending_partitions():
                return f"after_pre_commit of batch {b.batch_id} (some tasks done, some not)"
            return f"before_prepared_logged of batch {b.batch_id}"
        if not b.committed_handles:
            return f"after_prepared_logged of batch {b.batch_id}"
        if len(b.committed_handles) < len(b.handle_ids):
            return f"mid_commit of batch {b.batch_id}"
        return f"after_commit of batch {b.batch_id} (before COMMITTED is logged)"

    # ================================================================ rules
    @precondition(lambda self: self._idle() and self.next_batch < self.last_batch
                  and self.next_id + self.max_rows < self.id_base + ID_SPAN)
    @rule(data=st.data())
    def start_batch(self, data: Any) -> None:
        """Coordinator step 3: plan the batch and log its INTENT (a JSON record)."""
        self.progress += 1
        n_rows = data.draw(st.integers(0, self.max_rows), label="rows")
        parts = data.draw(st.integers(1, self.max_partitions), label="partitions")
        bid = self.next_batch
        self.next_batch += 1
        ids = list(range(self.next_id, self.next_id + n_rows))
        self.next_id += n_rows
        intent = self.sink.plan_batch(self.query_name, bid, parts)
        try:
            intent_json = json.dumps(intent, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ConformanceError(f"plan_batch({bid}) returned an INTENT that is not plain JSON: {e}") from None
        b = BatchModel(bid, ids, intent_json, parts)
        self._assign(b, parts, data)
        self.batches[bid] = b
        self.current = b
        note(f"batch {bid}: INTENT logged, {parts} partitions, rows {_span(ids)}: "
             + "; ".join(f"p{p}={_span(v)}" for p, v in sorted(b.assignment.items())))

    def _assign(self, b: BatchModel, parts: int, data: Any) -> None:
        """Spread the batch's rows over ``parts`` partitions (Spark may spread them differently on replay)."""
        where = data.draw(st.lists(st.integers(0, parts - 1), min_size=len(b.ids), max_size=len(b.ids)),
                          label="row partitions")
        b.run_partitions = parts
        b.assignment = {p: [] for p in range(parts)}
        for i, p in zip(b.ids, where):
            b.assignment[p].append(i)
        b.results, b.result_ids, b.next_attempt = {}, {}, {}

    @precondition(lambda self: self._executing() and bool(self.current.pending_partitions()))
    @rule(data=st.data())
    def run_tasks(self, data: Any) -> None:
        """Spark runs one attempt of some of the batch's unfinished partitions (one after another)."""
        b = self.current
        todo = data.draw(st.lists(st.sampled_from(b.pending_partitions()), min_size=1, unique=True),
                         label="partitions")
        for p in todo:
            self._run_attempt(b, p, data)
        self.progress += 1

    def _run_attempt(self, b: BatchModel, p: int, data: Any) -> None:
        """One Spark task attempt of one partition: begin, write in chunks, then pre_commit, abort or die."""
        # Mostly successes (and the first element is where hypothesis shrinks to).
        outcome = data.draw(st.sampled_from((PRE_COMMIT,) * 4 + TASK_OUTCOMES[1:]), label="outcome")
        ids = b.assignment[p]
        attempt = b.next_attempt.get(p, 0)
        b.next_attempt[p] = attempt + 1
        ctx = TransactionContext(self.query_name, b.batch_id, p, attempt, json.loads(b.intent_json))
        chunks = _split(ids, data.draw(st.integers(1, 3), label="arrow batches"))
        if outcome == DIE_MID_WRITE:
            chunks = chunks[:data.draw(st.integers(0, len(chunks)), label="chunks written before death")]
        rec = Attempt(p, attempt, outcome, [i for c in chunks for i in c], life=self.life)
        b.attempts.append(rec)
        before = self._pending() if outcome == ABORT else None

        txn = self.sink.begin_transaction(ctx)
        for chunk in chunks:
            self.sink.write(txn, self.make_batch(chunk))
        if outcome == DIE_MID_WRITE:
            del txn  # the executor is gone: no abort, no pre_commit; recovery must clean up
            note(f"{rec.label(b.batch_id)}: wrote {_span(rec.ids)}, then the executor DIED (no abort)")
            self._check(f"after {rec.label(b.batch_id)} died mid-write")
            return
        if outcome == ABORT:
            self.sink.abort(txn)
            note(f"{rec.label(b.batch_id)}: wrote {_span(rec.ids)}, then the task FAILED and abort() ran")
            self._check_aborted(before, rec, b)
            self._check(f"after {rec.label(b.batch_id)} was aborted")
            return

        handle = self.sink.pre_commit(txn)
        del txn
        envelope_json = self._round_trip(handle, rec.label(b.batch_id))
        rec.handle_desc = self.sink.describe_handle(self.sink.decode_handle(json.loads(envelope_json)))
        if outcome == DIE_AFTER_PRE_COMMIT:
            note(f"{rec.label(b.batch_id)}: pre-committed {rec.handle_desc} with rows {_span(rec.ids)}, then "
                 "the executor DIED before reporting it; Spark will retry the task")
            self._check(f"after {rec.label(b.batch_id)} pre-committed (handle never reached the driver)")
            return
        b.results[p] = envelope_json
        b.result_ids[p] = ids
        note(f"{rec.label(b.batch_id)}: pre-committed {rec.handle_desc} with rows {_span(ids)}")
        self._check(f"after {rec.label(b.batch_id)} pre-committed")

    def _round_trip(self, handle: Any, label: str) -> str:
        """The handle as it travels: encode_handle, JSON text, back. Also: unknown versions are refused."""
        envelope = self.sink.encode_handle(handle)
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

    @precondition(lambda self: self._executing() and not self.current.pending_partitions())
    @rule()
    def log_decision(self) -> None:
        """Coordinator step 4: durably log PREPARED with every partition's handle. This is the decision."""
        self.progress += 1
        b = self.current
        parts = sorted(b.results)
        b.prepared_json = json.dumps([json.loads(b.results[p]) for p in parts])
        b.handle_ids = [b.result_ids[p] for p in parts]
        b.committed_handles = set()
        note(f"batch {b.batch_id}: PREPARED logged with {len(parts)} handles (the commit decision); "
             f"rows {_span(b.ids)} must now appear exactly once")

    @precondition(lambda self: self._deciding() and len(self.current.committed_handles) < len(self.current.handle_ids))
    @rule(data=st.data())
    def commit_handles(self, data: Any) -> None:
        """Coordinator step 5: commit some (or all) of the decided handles."""
        self.progress += 1
        b = self.current
        todo = [i for i in range(len(b.handle_ids)) if i not in b.committed_handles]
        chosen = data.draw(st.lists(st.sampled_from(todo), min_size=1, unique=True), label="handles to commit")
        handles = self._decided_handles(b)
        for i in chosen:
            res = self._commit(b, i, handles[i], recovering=False)
            note(f"batch {b.batch_id}: commit({self.sink.describe_handle(handles[i])}) -> {res.outcome.value}")
        self._check(f"after committing {len(chosen)} handle(s) of batch {b.batch_id}")

    @precondition(lambda self: self._deciding() and len(self.current.committed_handles) == len(self.current.handle_ids))
    @rule()
    def finish_batch(self) -> None:
        """Coordinator steps 5-6: abort leftovers of failed task attempts, log COMMITTED."""
        self.progress += 1
        b = self.current
        handles = self._decided_handles(b)
        n = self.sink.abort_lingering(self.query_name, b.batch_id, json.loads(b.intent_json), handles)
        b.committed_logged = True
        self.current = None
        note(f"batch {b.batch_id}: abort_lingering(keep={len(handles)} handles) aborted {n}; COMMITTED logged")
        self._check(f"after batch {b.batch_id} finished", exact=True)

    @precondition(lambda self: not self.crashed and any(b.committed_handles for b in self.batches.values()))
    @rule(data=st.data())
    def commit_again(self, data: Any) -> None:
        """Commit an already committed handle again (a retry after a lost reply, or a replay): a no-op."""
        self.progress += 1
        choices = [(bid, i) for bid, b in sorted(self.batches.items()) for i in sorted(b.committed_handles)]
        bid, i = data.draw(st.sampled_from(choices), label="committed handle")
        recovering = data.draw(st.booleans(), label="via recover_and_commit")
        b = self.batches[bid]
        handle = self._decided_handles(b)[i]
        res = self._commit(b, i, handle, recovering=recovering)
        note(f"batch {bid}: {'recover_and_commit' if recovering else 'commit'} AGAIN of "
             f"{self.sink.describe_handle(handle)} -> {res.outcome.value}")
        self._check(f"after committing a handle of batch {bid} a second time", exact=self._quiescent())

    @precondition(lambda self: not self.crashed and any(b.committed_logged for b in self.batches.values()))
    @rule(data=st.data())
    def abort_lingering_again(self, data: Any) -> None:
        """abort_lingering on a finished batch again (a replay of a finished batch): must keep its data."""
        self.progress += 1
        bid = data.draw(st.sampled_from([k for k, b in sorted(self.batches.items()) if b.committed_logged]),
                        label="finished batch")
        b = self.batches[bid]
        handles = self._decided_handles(b)
        n = self.sink.abort_lingering(self.query_name, bid, json.loads(b.intent_json), handles)
        note(f"batch {bid}: abort_lingering again (keep {len(handles)} handles) aborted {n}")
        self._check(f"after abort_lingering ran again on finished batch {bid}", exact=self._quiescent())

    @precondition(lambda self: not self.crashed and self.progress > 0)
    @rule()
    def crash(self) -> None:
        """The driver dies (and with it every executor-side object): only the log and the sink's storage stay."""
        self.crash_point = self._phase_name()
        # self.sink is kept only to rebuild a sink from its to_config(); no method is called on it again.
        self.crashed = True
        note(f"CRASH at {self.crash_point}: driver and executors die, live objects are dropped")

    @precondition(lambda self: self.crashed)
    @rule(data=st.data())
    def recover(self, data: Any) -> None:
        """A new driver: rebuild the sink, finish decided batches, abort undecided leftovers, replay."""
        how = "config" if self.rebuild_from_config and data.draw(st.booleans(), label="rebuild from to_config") \
            else "factory"
        old = self.sink
        try:
            self.sink = self._new_sink(how)
        except NotImplementedError:
            how, self.sink = "factory", self._new_sink("factory")
        _close(old)  # the dead driver's connections: the OS would have closed them
        self.life += 1
        self.sink.open()
        note(f"RECOVER: new sink from {'to_config()/from_config()' if how == 'config' else 'sink_factory()'}")
        ops = [(bid, i) for bid, b in sorted(self.batches.items())
               if b.decided and not b.committed_logged for i in range(len(b.handle_ids))]
        stop_after = None
        if ops and data.draw(st.booleans(), label="crash again during recovery"):
            stop_after = data.draw(st.integers(0, len(ops) - 1), label="commits before the second crash")
        done = 0
        for bid, b in sorted(self.batches.items()):
            if b.committed_logged:
                continue
            intent = json.loads(b.intent_json)
            if b.decided:
                handles = self._decided_handles(b)
                for i, h in enumerate(handles):
                    if stop_after is not None and done >= stop_after:
                        note(f"CRASH AGAIN during recovery, after {done} recovery commit(s)")
                        self.crash_point = f"recovery of batch {bid}"
                        return
                    res = self._commit(b, i, h, recovering=True)
                    done += 1
                    note(f"  batch {bid} was decided: recover_and_commit({self.sink.describe_handle(h)}) -> "
                         f"{res.outcome.value}")
                n = self.sink.abort_lingering(self.query_name, bid, intent, handles)
                b.committed_logged = True
                note(f"  batch {bid}: abort_lingering(keep={len(handles)}) aborted {n}; COMMITTED logged")
            else:
                n = self.sink.abort_lingering(self.query_name, bid, intent, [])
                note(f"  batch {bid} was not decided: abort_lingering(keep=[]) aborted {n}")
        self.crashed = False
        self.progress = 0
        self._check(f"after recovery from the crash at {self.crash_point}", exact=True)
        b = self.current
        if b is not None and b.committed_logged:
            self.current = None
        elif b is not None:
            # Spark replays the batch: same rows, maybe spread differently, never more partitions than planned.
            parts = data.draw(st.integers(1, b.num_partitions), label="replay partitions")
            self._assign(b, parts, data)
            b.runs += 1
            note(f"  batch {b.batch_id} REPLAYED over {parts} partitions: "
                 + "; ".join(f"p{p}={_span(v)}" for p, v in sorted(b.assignment.items())))

    # ================================================================ helpers
    def _decided_handles(self, b: BatchModel) -> list[Any]:
        """The decision's handles as a driver reads them back from the log (fresh objects from JSON)."""
        return [self.sink.decode_handle(env) for env in json.loads(b.prepared_json)]

    def _commit(self, b: BatchModel, i: int, handle: Any, recovering: bool) -> CommitResult:
        """Commit like the coordinator: retry RETRY_LATER and exceptions, LOST is data loss."""
        what = self.sink.describe_handle(handle)
        last = ""
        for attempt in range(self.commit_retries + 1):
            try:
                res = self.sink.recover_and_commit(handle) if recovering else self.sink.commit(handle)
            except Exception as e:  # noqa: BLE001 - the coordinator retries these too
                last = f"{type(e).__name__}: {e}"
                if attempt == self.commit_retries:
                    raise
            else:
                if not isinstance(res, CommitResult):
                    raise ConformanceError(f"commit({what}) returned {res!r}, not a CommitResult")
                if res.done:
                    if i in b.committed_handles and res.outcome is CommitOutcome.COMMITTED:
                        note(f"  (commit of {what} again said COMMITTED, not ALREADY_COMMITTED: allowed, "
                             "the output check decides)")
                    b.committed_handles.add(i)
                    return res
                if res.outcome is CommitOutcome.LOST:
                    raise ConformanceError(
                        f"DATA LOSS: batch {b.batch_id} was decided, but commit({what}) says the transaction is "
                        f"lost: {res.reason}. (Crash point: {self.crash_point or 'none yet'}.)")
                last = res.reason
            time.sleep(min(2.0, 0.05 * 2 ** attempt))
        raise ConformanceError(f"batch {b.batch_id}: commit({what}) did not succeed after "
                               f"{self.commit_retries + 1} tries; last: {last}")

    def _quiescent(self) -> bool:
        return not self.crashed and self.current is None

    def _pending(self) -> set[str] | None:
        if self.pending is None:
            return None
        return {str(x) for x in self.pending()}

    def _check_aborted(self, before: set[str] | None, rec: Attempt, b: BatchModel) -> None:
        if before is None:
            return
        left = self._pending() - before
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
            b = self._batch_of(i)
            why = ("its batch was never decided" if b and not b.decided else
                   "no committed handle carries it yet" if b else "no batch of this example wrote it")
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
            left = self._pending() - self.pending_baseline
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

    def teardown(self) -> None:
        """Leave nothing open for the next example: finish decided batches, abort the rest (errors ignored)."""
        try:
            if self.sink is None:
                return
            if self.crashed:
                old, self.sink = self.sink, self._new_sink("factory")
                _close(old)
            for bid, b in sorted(self.batches.items()):
                if b.committed_logged:
                    continue
                intent = json.loads(b.intent_json)
                if b.decided:
                    handles = self._decided_handles(b)
                    for h in handles:
                        self.sink.recover_and_commit(h)
                    self.sink.abort_lingering(self.query_name, bid, intent, handles)
                else:
                    self.sink.abort_lingering(self.query_name, bid, intent, [])
        except Exception:  # noqa: BLE001 - the example's own outcome matters more
            pass
        finally:
            _close(self.sink)
            self.sink = None


def _close(sink: Any) -> None:
    """Close a sink's connections if it has a ``close()`` (KafkaSink, PostgresSink do); errors ignored."""
    close = getattr(sink, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - best effort, like a dying process
            pass


def _split(ids: list[int], n: int) -> list[list[int]]:
    """Cut ``ids`` into at most ``n`` non-empty consecutive chunks (one Arrow batch each)."""
    n = max(1, min(n, len(ids)))
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        out.append(ids[start:end])
        start = end
    return [c for c in out if c]


def _span(ids: list[int]) -> str:
    """A compact view of a list of row ids: ``[1000003..1000007]`` or ``[1000001, 1000004]``."""
    if not ids:
        return "[]"
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"[{ids[0]}..{ids[-1]}]"
    return "[" + ", ".join(map(str, ids)) + "]"


def make_state_machine(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
) -> type[SinkConformanceMachine]:
    """The configured state machine class (for ``run_state_machine_as_test`` or its ``TestCase``).

    Arguments as for :func:`run_sink_conformance`.
    """
    if max_rows < 0 or max_partitions < 1:
        raise ValueError("max_rows must be >= 0 and max_partitions >= 1")
    attrs: dict[str, Any] = {
        "sink_factory": staticmethod(sink_factory),
        "read_committed": staticmethod(read_committed),
        "make_batch": staticmethod(make_batch or default_make_batch),
        "id_of": staticmethod(id_of or default_id_of),
        "reset": staticmethod(reset) if reset is not None else None,
        "pending": staticmethod(pending) if pending is not None else None,
        "max_rows": max_rows,
        "max_partitions": max_partitions,
        "check_every_step": check_every_step,
        "settle_timeout": settle_timeout,
        "commit_retries": commit_retries,
        "query_prefix": query_prefix,
        "rebuild_from_config": rebuild_from_config,
        "_run_token": f"{random.getrandbits(24):06x}",
        "_examples": itertools.count(1),
        "_id_floor": None,
    }
    return type("SinkConformance", (SinkConformanceMachine,), attrs)


def default_settings(max_examples: int = 25, steps: int = 30) -> Any:
    """Settings for sinks that do I/O: no deadline, no too-slow health check."""
    return hypothesis.settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large,
                               hypothesis.HealthCheck.filter_too_much],
    )


def run_sink_conformance(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    settings: Any = None,
    max_examples: int | None = None,
    steps: int | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
) -> None:
    """Prove (by search) that a sink is exactly-once under the twophase coordinator; raise if not.

    Runs in the calling process, without Spark.  Hypothesis generates sequences of
    batches, task attempts that pre-commit, abort or die, commit decisions, partial
    and repeated commits, driver crashes and recoveries, and checks what
    ``read_committed`` returns against a model.  A failure raises
    :class:`ConformanceError` (an ``AssertionError``) after shrinking; hypothesis
    prints the steps and the notes, which read as the story of the failure.

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

    ``settings`` is a ``hypothesis.settings`` (default: :func:`default_settings`);
    ``max_examples`` and ``steps`` (steps per example) override it.  Each example
    uses its own query name, ids and batch ids ``example * 100 + k``.
    ``settle_timeout`` re-reads for that many seconds while decided rows are
    missing (for stores whose committed data becomes readable with a lag).
    """
    machine = make_state_machine(
        sink_factory, read_committed, make_batch=make_batch, id_of=id_of, reset=reset, pending=pending,
        max_rows=max_rows, max_partitions=max_partitions, check_every_step=check_every_step,
        settle_timeout=settle_timeout, commit_retries=commit_retries, query_prefix=query_prefix,
        rebuild_from_config=rebuild_from_config)
    s = settings if settings is not None else default_settings()
    overrides: dict[str, Any] = {}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if steps is not None:
        overrides["stateful_step_count"] = steps
    if overrides:
        s = hypothesis.settings(s, **overrides)
    stateful.run_state_machine_as_test(machine, settings=s)


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
    steps: int = 30
    conformance_settings: Any = None
    max_rows: int = 12
    max_partitions: int = 3
    check_every_step: bool = True
    settle_timeout: float = 0.0

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
            check_every_step=self.check_every_step, settle_timeout=self.settle_timeout)


def _overrides(cls: type, name: str) -> bool:
    return inspect.getattr_static(cls, name) is not inspect.getattr_static(SinkConformanceTests, name)
