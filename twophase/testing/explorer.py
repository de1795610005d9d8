"""A deterministic schedule explorer for the protocol core (issue 45): every interleaving of a few
actors, up to a preemption bound, over an in-memory log store and an in-memory sink.

In the style of CHESS (Musuvathi and Qadeer, "Iterative context bounding for systematic testing
of multithreaded programs", PLDI 2007) and of FoundationDB's simulation: the
actors are real threads running the real protocol (:mod:`twophase.protocol`, :mod:`twophase.log`,
:mod:`twophase.recovery`), but only one runs at a time.  Every call to the log's store and every
method of the sink is a *scheduling point*: the actor stops there until the scheduler picks it.
A schedule is the sequence of those picks; the explorer enumerates every schedule with at most
``preemptions`` preemptions (a switch away from an actor that could have gone on; switching when
an actor ends is free), depth first, by stateless re-execution: each schedule runs from the start
on a fresh store and sink, its prefix replayed pick by pick (a replay that diverges is reported:
the explorer's determinism is checked, not assumed).

After every step it checks, from the store and the sink's target as they are:

- ``two-decisions``: at most one ballot of a batch ever holds a commit decision (a PREPARED record
  with outcome "commit" and no VOID record; the history is kept, since pruning deletes records).
  A record that lands in a batch the log says it pruned (a deposed coordinator's late write into
  a batch committed, whose records were deleted) is not a decision: it is noted in the trace, and
  committing it is ``visible-undecided``;
- ``visible-undecided``: no row (no transaction, for the memory sink) is visible unless a commit
  decision named it; ``duplicate-row``: no row is visible twice;
- ``decided-aborted``: no transaction a commit decision names is aborted (memory sink), no part
  file a commit decision names is gone, neither staged nor published (the shipped FileSink:
  :func:`file_sink`, whose storage calls are scheduling points too);
- ``decided-fenced``: no transaction a commit decision names is aborted by an InitProducerId on its
  transactional id (the shipped KafkaSink on an in-memory broker: :func:`kafka_sink`,
  :mod:`twophase.testing.kafka_model`, every broker request a scheduling point);
- ``data-loss``: a batch job's run (:func:`batch_job`) never stops with
  :class:`~twophase.errors.DataLossError`;
- ``pruned-forgotten``: the log never forgets a batch it said was pruned (its low-water mark
  never moves back; asked through the log's own reader, whatever the layout of its marks);
- ``older-closed-newer``: no ballot is closed by a coordinator of an older epoch than the one that
  opened it (a deposed coordinator interfering with its successor: the owner's batch fails).

At the end of a schedule (every actor finished, or stopped by a :class:`~twophase.errors.TwoPhaseError`;
any other exception is ``unexpected-error``), a final owner takes the log over, runs recovery,
replays every batch Spark's commit log does not hold (a batch is in it once a run of it returned)
and one batch more (whose cleanup sweeps late leftovers), alone.  Then: ``final-owner-failed`` if
it raised; ``rows-not-exactly-once`` unless every batch's rows are visible exactly once;
``leftovers`` if a transaction is still open or pre-committed (memory sink).  An actor that stops
outside a scheduling point for ``step_timeout`` seconds (a real lock, a join, a sleep) is
``blocked``; a schedule longer than ``max_steps`` is ``livelock``.

What it proves: for the actors modelled, every interleaving of their store and sink calls within
the bound keeps those invariants.  What it does not: the storage is linearizable here (one dict;
no lost, torn or reordered writes, no partial listings, no eventual consistency, no write whose
outcome is unknown), Spark is not there (the data source form's plan and commit steps are mirrored
from twophase/datasource.py; the coordinator's Spark glue is not run), the memory sink is a model
of the real sinks' contract (their own races, timeouts and fences are theirs to test:
:mod:`twophase.testing.conformance`), a process never crashes (an actor that stops early is the
same as one paused for ever; a crash that loses in-flight work is the conformance harness's),
time does not pass (leases never expire; only takeovers depose), schedules beyond the bound are
not explored, and what the protocol runs in background threads runs inline where it is started.

``python -m twophase.testing.explorer --help``; docs/explorer.md.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import logging
import os
import re
import sys
import threading
import time
import uuid as _uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

import twophase.log as _log_mod
import twophase.protocol as _protocol_mod
import twophase.recovery as _recovery_mod
from twophase.context import TransactionContext
from twophase.errors import DataLossError, PrunedBatchError, TransactionTakenError, TwoPhaseError
from twophase.evidence import Settled
from twophase.log import TransactionLog, parse_batch_name
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink
from twophase.sink import abort_lingering as _sink_abort_lingering
from twophase.storage import registry as _registry
from twophase.storage._base import LogStore

__all__ = [
    "BATCH_JOB_IDS",
    "SCENARIOS",
    "SINKS",
    "Actor",
    "ActorContext",
    "Finding",
    "MemTxn",
    "MemoryLogStore",
    "MemorySink",
    "MemoryTarget",
    "Report",
    "Scenario",
    "SinkUnderTest",
    "TaskFailed",
    "Violation",
    "batch_job",
    "datasource_run",
    "deposed",
    "deterministic",
    "explore",
    "file_sink",
    "kafka_sink",
    "late_attempt",
    "main",
    "memory_sink",
    "operator_recover",
    "owner",
    "parse_schedule",
    "replay",
    "rows_of",
    "schedule_text",
]

#: The URL scheme of the explorer's in-memory log store (registered only inside :func:`deterministic`).
SCHEME = "explorer"
LOG_URL = f"{SCHEME}://log"
_QUIET_URL = f"{SCHEME}://checks"  # the same store, as the explorer's checks read it
QUERY_ID = "explorer-query"
NAME = "pipe"

_local = threading.local()


# ============================================================================ findings
@dataclass
class Finding:
    """One broken invariant (or liveness failure) in one schedule, with the steps that led there."""

    kind: str
    message: str
    scenario: str
    schedule: int
    choices: list[int]
    preemptions: int
    trace: list[str]
    also: list[str] = field(default_factory=list)  # what else broke later in the same schedule
    count: int = 1  # schedules that broke the same invariant (collect mode)

    @property
    def schedule_text(self) -> str:
        """The schedule as ``--replay`` takes it: the actor index per step, run-length encoded."""
        return schedule_text(self.choices)

    def render(self) -> str:
        head = (f"explorer: scenario {self.scenario!r}, schedule #{self.schedule} "
                f"({self.preemptions} preemption{'s' if self.preemptions != 1 else ''}): {self.kind}")
        return "\n".join([head, *self.trace, f"invariant broken ({self.kind}): {self.message}",
                          *(f"and later: {a}" for a in self.also),
                          f"schedule (actor index per step; --replay): {self.schedule_text}"])


def schedule_text(choices: Sequence[int]) -> str:
    """``[0, 0, 1]`` -> ``"0*2 1"``."""
    items = []
    for actor, group in itertools.groupby(choices):
        n = len(list(group))
        items.append(f"{actor}*{n}" if n > 1 else str(actor))
    return " ".join(items)


def parse_schedule(text: str) -> list[int]:
    """Inverse of :func:`schedule_text` (commas or spaces between items)."""
    out: list[int] = []
    for item in text.replace(",", " ").split():
        actor, _, times = item.partition("*")
        out += [int(actor)] * (int(times) if times else 1)
    return out


class Violation(AssertionError):
    """Raised by :func:`explore` on the first finding (unless it collects them): carries it."""

    def __init__(self, finding: Finding):
        super().__init__(finding.render())
        self.finding = finding


class TaskFailed(TwoPhaseError):
    """A task attempt failed on its executor with the sink's own error (an ``OSError``, a driver
    library's): what the driver gets is a failed Spark job."""


class _Abandon(BaseException):
    """Unwinds an actor's thread once its schedule is over (a finding stopped it)."""


@dataclass
class _Entry:
    """One line of a schedule's trace, formatted only if it is printed."""

    label: str
    op: str
    detail: Callable[[], str] | str
    preempted: str | None = None

    def text(self) -> str:
        d = self.detail() if callable(self.detail) else self.detail
        return f"{self.label}: {self.op}{(' ' + _TARGET_PREFIX.sub('', d)) if d else ''}"


# ============================================================================ the sink
@dataclass
class MemTxn:
    """One transaction of the memory sink's target."""

    key: str
    query: str
    batch: int
    token: str | None
    partition: int
    attempt: int
    state: str = "open"  # open -> staged (pre-committed) -> committed | aborted
    rows: list[int] = field(default_factory=list)


class MemoryTarget:
    """What the memory sink writes to: transactions and the visible rows (a list, so duplicates
    show).  Shared by every :class:`MemorySink` object of one schedule (one per "process")."""

    def __init__(self, *, commit_twice_duplicates: bool = False):
        self.txns: dict[str, MemTxn] = {}
        self.visible: list[tuple[int, str]] = []  # (row id, transaction key)
        self.plans = 0
        #: (event, transaction key, its state before): "commit" / "abort", for the invariants
        self.events: list[tuple[str, str, str]] = []
        #: The deliberately broken target of the explorer's own tests: a repeated commit of a
        #: committed transaction makes its rows visible again.
        self.commit_twice_duplicates = commit_twice_duplicates

    def abort(self, t: MemTxn) -> None:
        if t.state in ("open", "staged"):
            self.events.append(("abort", t.key, t.state))
            t.state = "aborted"

    def leftovers(self) -> list[str]:
        return [f"{t.key} ({t.state})" for t in self.txns.values() if t.state in ("open", "staged")]


class MemorySink(TwoPhaseCommitSink[MemTxn, dict]):
    """An in-memory sink with the real sinks' semantics (PostgresSink, FileSink):

    - a transaction is named by (query name, batch, its ballot's plan token, partition, attempt,
      run, task attempt id); ``plan_batch`` draws a token of its own per ballot (per INTENT);
    - ``pre_commit`` makes its rows durable and invisible (staged); ``commit`` makes them visible,
      is idempotent (``ALREADY_COMMITTED`` on repeat) and reports a transaction that was aborted
      as ``CommitResult.lost(..., never_visible=True)``;
    - ``abort_lingering(query, batch, intent, keep)`` aborts the open and staged transactions of
      that batch and plan not in ``keep``; with ``intent == {}`` it leaves the batch's own (a
      paused coordinator's ballot, still to be decided), and with ``sweep_earlier`` it aborts what
      is still open or staged of the query's *earlier* batches (late task attempts), as
      PostgresSink and FileSink do;
    - ``sweep_late(query, batch)`` aborts the same late leftovers of earlier batches (with
      ``sweep_earlier``);
    - ``verify_prepared`` raises :class:`~twophase.errors.TransactionTakenError` for a handle
      another actor aborted; ``recover_and_abort`` aborts a staged transaction.

    Not thread-safe and never blocks: the explorer runs one actor at a time.
    """

    kind: ClassVar[str] = "memory"
    supports_speculation = True

    def __init__(self, target: MemoryTarget, *, sweep_earlier: bool = True):
        self.memory = target  # not .target: TwoPhaseCommitSink.target() names where rows land
        self.sweep_earlier = sweep_earlier

    # -- driver
    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        self.memory.plans += 1
        return {"token": f"t{self.memory.plans}"}

    def verify_prepared(self, batch_id: int, handles: list[dict], *, prepare_started_at: float) -> None:
        for h in handles:
            t = self.memory.txns.get(str(h.get("txn")))
            if t is None or t.state != "staged":
                raise TransactionTakenError(f"batch {batch_id}: transaction {h.get('txn')} is "
                                            f"{'unknown' if t is None else t.state}, not pre-committed")

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict]) -> int:
        token = (intent or {}).get("token")
        kept = {str(h.get("txn")) for h in keep}
        n = 0
        for t in list(self.memory.txns.values()):
            if t.query != query_name or t.state not in ("open", "staged") or t.key in kept:
                continue
            if t.batch == batch_id:
                if token is None or t.token != token:
                    continue  # {}: a ballot of this batch may still be decided; another plan: not ours
            elif not (self.sweep_earlier and t.batch < batch_id):
                continue
            self.memory.abort(t)
            n += 1
        return n

    def sweep_late(self, query_name: str, batch_id: int) -> int:
        """What late attempts left open or staged of this query's earlier batches (as PostgresSink's
        look at ``pg_prepared_xacts``), when ``sweep_earlier``."""
        if not self.sweep_earlier:
            return 0
        doomed = [t for t in self.memory.txns.values()
                  if t.query == query_name and t.batch < batch_id and t.state in ("open", "staged")]
        for t in doomed:
            self.memory.abort(t)
        return len(doomed)

    def commit(self, handle: dict) -> CommitResult:
        t = self.memory.txns.get(str(handle.get("txn")))
        if t is None:
            return CommitResult.lost(f"transaction {handle.get('txn')} does not exist")
        if t.state == "aborted":
            return CommitResult.lost(f"transaction {t.key} was aborted", never_visible=True)
        if t.state == "open":
            return CommitResult.lost(f"transaction {t.key} was never pre-committed")
        if t.state == "committed":
            if self.memory.commit_twice_duplicates:
                self.memory.visible.extend((i, t.key) for i in t.rows)
                self.memory.events.append(("commit", t.key, "committed"))
                return CommitResult.committed()
            return CommitResult.already_committed()
        self.memory.events.append(("commit", t.key, t.state))
        t.state = "committed"
        self.memory.visible.extend((i, t.key) for i in t.rows)
        return CommitResult.committed()

    def recover_and_abort(self, handle: dict) -> None:
        t = self.memory.txns.get(str(handle.get("txn")))
        if t is not None and t.state == "staged":
            self.memory.abort(t)

    # -- executor
    def begin_transaction(self, ctx: TransactionContext) -> MemTxn:
        token = (ctx.intent or {}).get("token")
        key = f"b{ctx.batch_id}.{token}.p{ctx.partition_id}a{ctx.attempt}.{ctx.run or '-'}"
        if ctx.task_attempt_id >= 0:
            key += f"#{ctx.task_attempt_id}"
        if key in self.memory.txns:
            raise TwoPhaseError(f"transaction {key} exists already")
        t = MemTxn(key, ctx.query_name, ctx.batch_id, token, ctx.partition_id, ctx.attempt)
        self.memory.txns[key] = t
        return t

    def write(self, txn: MemTxn, batch: pa.RecordBatch) -> None:
        if txn.state != "open":
            raise TwoPhaseError(f"transaction {txn.key} is {txn.state}: cannot write")
        txn.rows.extend(int(i) for i in batch.column("id").to_pylist())

    def pre_commit(self, txn: MemTxn) -> dict:
        if txn.state != "open":
            raise TwoPhaseError(f"transaction {txn.key} is {txn.state}: cannot pre-commit")
        txn.state = "staged"
        return {"txn": txn.key, "rows": len(txn.rows)}

    def abort(self, txn: MemTxn) -> None:
        if txn.state == "open":
            self.memory.abort(txn)

    def describe_handle(self, handle: dict) -> str:
        return str(handle.get("txn"))

    def target(self) -> str:
        return "memory"


# ============================================================================ the sink under test
def _record_batch(rows: list[int]) -> pa.RecordBatch:
    """A batch's rows as the memory sink takes them: one ``id`` column."""
    return pa.record_batch({"id": pa.array(rows, pa.int64())})


@dataclass
class SinkUnderTest:
    """The sink the actors write to, and how the explorer reads its target (a sink author's hook).

    ``new_target()`` makes a fresh, empty target for one schedule (each schedule starts from
    nothing); ``sink(target)`` a sink object on it, one per "process" (every actor, every data
    source step gets its own, as executors get pickled copies); ``visible(target)`` the row ids a
    reader sees now, duplicates kept; ``leftovers(target)`` (optional) what is still open or
    pre-committed, by name; ``close_target(target)`` (optional) frees it after the schedule.
    ``make_batch(ids)`` turns a partition's row ids into the Arrow batch the tasks write (default:
    one ``id`` column; row ``2b`` and ``2b + 1`` belong to batch ``b``).

    The sink must never wait for another actor (a lock held across calls, a server-side lock that
    another actor's open transaction holds): the explorer runs one actor at a time, so that is a
    ``blocked`` finding, not a schedule.  The memory sink (:func:`memory_sink`) also reports each
    commit and abort by transaction, for ``visible-undecided`` and ``decided-aborted`` by handle;
    for any other sink those two are checked by row id (the rows of a batch that was never
    decided) only.
    """

    name: str
    new_target: Callable[[], Any]
    sink: Callable[[Any], TwoPhaseCommitSink[Any, Any]]
    visible: Callable[[Any], list[int]]
    leftovers: Callable[[Any], list[str]] | None = None
    close_target: Callable[[Any], None] | None = None
    make_batch: Callable[[list[int]], pa.RecordBatch] = _record_batch
    #: Whether every sink method is a scheduling point.  False for a sink whose own shared state is
    #: reached only through calls that are points themselves (:func:`file_sink`: its storage
    #: calls): a point before them would only repeat the same interleavings.
    sink_points: bool = True
    #: ``lost(target, envelopes)``: of the handles (as the log holds them) a commit decision names,
    #: a line for each whose data is gone, neither staged nor visible (``decided-aborted`` for a sink
    #: other than the memory sink, which reports aborts by transaction); or a pair (finding kind,
    #: message) in the sink's own words (:func:`kafka_sink`).
    lost: Callable[[Any, list[Any]], list[Any]] | None = None
    #: Spark partitions (tasks) of every batch: with 2, partition ``p`` of batch ``b`` writes row
    #: ``2b + p`` (:func:`rows_of`), so a batch half committed shows.
    partitions: int = 1
    #: A context manager entered around the whole exploration (inside :func:`deterministic`): the
    #: seams a sink needs (:func:`kafka_sink`: KafkaSink's clients on the broker model).
    patches: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
    #: ``expire(target)``: time passes after the final owner, before the end-of-schedule checks (a
    #: broker's transaction timeout aborts what is still open: :func:`kafka_sink`).
    expire: Callable[[Any], None] | None = None


def memory_sink(*, commit_twice_duplicates: bool = False, sweep_earlier: bool = True,
                sink_class: type[MemorySink] | None = None) -> SinkUnderTest:
    """The memory sink (see :class:`MemorySink`).  ``commit_twice_duplicates``: a broken target
    (a repeated commit makes the rows visible again); ``sink_class``: a subclass to use instead
    (a sink deliberately broken in another way)."""
    cls = sink_class or MemorySink
    return SinkUnderTest(
        f"{cls.__name__}{' (commits twice)' if commit_twice_duplicates else ''}",
        new_target=lambda: MemoryTarget(commit_twice_duplicates=commit_twice_duplicates),
        sink=lambda target: cls(target, sweep_earlier=sweep_earlier),
        visible=lambda target: [i for i, _ in target.visible],
        leftovers=lambda target: target.leftovers())


# ---------------------------------------------------------------------------- the shipped FileSink
#: Methods of FileSink's storage object (``LocalStorage``) that are no scheduling point: pure path
#: arithmetic, and ``open()``'s checks, which touch only probe files of the caller's own.
_STORAGE_NO_POINT = {"join", "normpath", "hadoop_url", "ensure_writable", "probe_publish"}


class _ScheduledStorage:
    """FileSink's storage object with a scheduling point (and a trace line) before every call that
    reads or changes the target's files: ``create``, ``close_durably``, ``publish``, ``exists``,
    ``size``, ``delete``, ``list``, ``sizes``, ``delete_under``, ...  A check and the act it
    guards (a listing, then the deletes of a sweep) are two steps, so another actor may run
    between them, as in production."""

    def __init__(self, inner: Any, root: str):
        self._inner, self._root = inner, root.rstrip(os.sep) + os.sep
        self.root, self.fsync = inner.root, inner.fsync

    def _rel(self, value: Any) -> str:
        if isinstance(value, str):
            return value[len(self._root):] if value.startswith(self._root) else value
        if isinstance(value, (set, frozenset, list, tuple)):
            return "[" + ", ".join(sorted(self._rel(v) for v in value)) + "]"
        return repr(value)[:60]

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name.startswith("_") or name in _STORAGE_NO_POINT or not callable(attr):
            return attr

        def call(*args: Any) -> Any:
            _point()
            world = _WORLD[0]
            where = " ".join(self._rel(a) for a in args if isinstance(a, (str, set, list)))
            try:
                out = attr(*args)
            except _Abandon:
                raise
            except BaseException as e:
                if world is not None:
                    world.log(f"fs.{name}", f"{where} -> raised {type(e).__name__}", where)
                raise
            if world is not None:
                shown = "file" if name == "create" else self._rel(out) if isinstance(out, (str, list)) else repr(out)
                world.log(f"fs.{name}", f"{where} -> {shown[:120]}", where)
            return out

        return call


def _jsonl_ids(root: str) -> list[int]:
    ids: list[int] = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".jsonl"):
            with open(os.path.join(root, name)) as f:
                ids += [json.loads(line)["id"] for line in f if line.strip()]
    return ids


def _staged_leftovers(root: str) -> list[str]:
    base = os.path.join(root, "_twophase")
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(base) for f in fs)


def _files_lost(root: str, envelopes: list[Any]) -> list[str]:
    """Decided FileSink handles (local) whose part file is neither staged nor in the target."""
    out = []
    for env in envelopes:
        data = env.get("data") if isinstance(env, dict) else None
        if not isinstance(data, dict):
            continue
        for e in data.get("files") or [data]:
            staging, final = e.get("staging"), e.get("final")
            if isinstance(staging, str) and isinstance(final, str) \
                    and not os.path.exists(staging) and not os.path.exists(final):
                out.append(f"{os.path.relpath(staging, root)} (to {os.path.relpath(final, root)})")
    return out


def file_sink(*, base: str | None = None) -> SinkUnderTest:
    """The shipped :class:`twophase.sinks.files.FileSink` (``format="jsonl"``, no fsync) on a local
    folder of its own per schedule (under ``base``; default: ``/dev/shm`` where it exists, else the
    system's temp folder), each call of its storage object a scheduling point
    (:class:`_ScheduledStorage`, in place of ``sink._backend.storage``; the sink's methods are
    traced, not points).  ``decided-aborted`` is checked by file: a part file a commit decision
    names that is neither staged nor published."""
    import shutil
    import tempfile

    from twophase.sinks.files import FileSink

    where = base or ("/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None)

    def new_target() -> str:
        return tempfile.mkdtemp(prefix="twophase-explorer-", dir=where)

    def sink(root: str) -> TwoPhaseCommitSink[Any, Any]:
        s = FileSink(root, format="jsonl", fsync=False)
        backend = s._backend
        backend.storage = _ScheduledStorage(backend.storage, backend.root)
        return s

    return SinkUnderTest("FileSink (local, shipped)", new_target=new_target, sink=sink, visible=_jsonl_ids,
                         leftovers=_staged_leftovers, close_target=lambda root: shutil.rmtree(root, ignore_errors=True),
                         make_batch=lambda ids: pa.record_batch({"id": pa.array(ids, pa.int64()),
                                                                 "v": [f"v{i}" for i in ids]}),
                         sink_points=False, lost=_files_lost)


# ---------------------------------------------------------------------------- the shipped KafkaSink
#: The bootstrap servers of :func:`kafka_sink`'s model broker (one per schedule, registered under it).
KAFKA_MODEL_BOOTSTRAP = "kafka-model:9092"
KAFKA_TOPIC = "events"


def _kafka_visible(broker: Any) -> list[int]:
    """The row ids a ``read_committed`` reader of the topic sees (values ``"<id>"``), duplicates kept."""
    out: list[int] = []
    for p in range(len(broker.topics[KAFKA_TOPIC].partitions)):
        out += [int(v) for _, v in broker.committed_records(f"{KAFKA_TOPIC}:{p}") if v is not None]
    return out


def _kafka_lost(broker: Any, envelopes: list[Any]) -> list[tuple[str, str]]:
    """Decided KafkaSink handles whose transaction (producer id and epoch) the broker aborted:
    ``decided-aborted`` by an EndTxn(abort) (someone's cleanup or a task took it for a leftover),
    ``decided-fenced`` by an InitProducerId on its id (someone initialised the id: a claim, a
    producer's ``init_transactions``)."""
    out = []
    for env in envelopes:
        h = env.get("data") if isinstance(env, dict) else None
        if not isinstance(h, dict) or "transactional_id" not in h:
            continue
        pid, epoch, tid = int(h["producer_id"]), int(h["producer_epoch"]), h["transactional_id"]
        for t in broker.txns:
            if t.producer_id == pid and t.epoch == epoch and t.outcome == "abort":
                if t.ended_by == "timeout":
                    out.append(("decided-aborted", f"a commit decision names the transaction of {tid} (producer id "
                                f"{pid}, epoch {epoch}), still open after the final owner: the broker's transaction "
                                "timeout aborted it"))
                elif t.ended_by == "init_producer_id":
                    out.append(("decided-fenced", f"a commit decision names the transaction of {tid} (producer id "
                                f"{pid}, epoch {epoch}), which an InitProducerId on its id aborted (fenced)"))
                else:
                    out.append(("decided-aborted", f"a commit decision names the transaction of {tid} (producer id "
                                f"{pid}, epoch {epoch}), which an EndTxn(abort) aborted"))
    return out


def kafka_sink(*, partitions: int = 2, slots_per_partition: int | None = None) -> SinkUnderTest:
    """The shipped :class:`twophase.sinks.kafka.KafkaSink` (its pool, plan fence, claims, held and open
    snapshots, verdicts) on an in-memory broker per schedule (:mod:`twophase.testing.kafka_model`:
    a topic of two partitions; every broker request, the driver's and the executors' kafka-python
    requests and the producers' and consumers' alike, is a scheduling point and a ``kafka.*`` trace
    line).  Batches have ``partitions`` tasks (default 2: a batch half committed shows).
    ``decided-aborted`` is checked by transaction: a decided handle whose transaction the broker
    aborted by an EndTxn; ``decided-fenced``: by an InitProducerId on its id.  No ``leftovers``
    check: the sink leaves a transaction it cannot attribute to the broker's transaction timeout,
    which runs once the final owner is done (``expire``: every open transaction aborted; one of
    them decided is ``decided-aborted``)."""
    from twophase.sinks.kafka import KafkaSink
    from twophase.testing import kafka_model as km

    def new_target() -> Any:
        broker = km.ModelBroker({KAFKA_TOPIC: 2})

        def after(op: str, key: str, text: Callable[[], str]) -> None:
            world = _WORLD[0]
            if world is not None and not world.quiet:
                world.log(f"kafka.{op}", text, key)

        broker.before, broker.after = _point, after
        km.register(KAFKA_MODEL_BOOTSTRAP, broker)
        return broker

    def sink(broker: Any) -> TwoPhaseCommitSink[Any, Any]:
        if slots_per_partition is None:
            return KafkaSink(KAFKA_MODEL_BOOTSTRAP, KAFKA_TOPIC, NAME + "-ids")
        return KafkaSink(KAFKA_MODEL_BOOTSTRAP, KAFKA_TOPIC, NAME + "-ids", slots_per_partition=slots_per_partition)

    return SinkUnderTest(
        "KafkaSink (shipped, broker model)", new_target=new_target, sink=sink, visible=_kafka_visible,
        close_target=lambda broker: km.unregister(KAFKA_MODEL_BOOTSTRAP, broker),
        make_batch=lambda ids: pa.record_batch({"value": [str(i) for i in ids],
                                                "partition": pa.array([i % 2 for i in ids], pa.int32()),
                                                "id": pa.array(ids, pa.int64())}),
        sink_points=False, lost=_kafka_lost, partitions=partitions, patches=km.patched,
        expire=lambda broker: broker.expire())


#: ``--sink`` of the command line: name -> builder of the sink under test.
SINKS: dict[str, Callable[[], SinkUnderTest]] = {"memory": lambda: memory_sink(), "files": lambda: file_sink(),
                                               "kafka": lambda: kafka_sink()}


_SCHEDULED: dict[str, type] = {}

#: Sink methods that are no scheduling point: pure functions of their arguments and the configuration.
_NO_POINT = {"handle_to_json", "handle_from_json", "encode_handle", "decode_handle", "describe_handle",
             "to_config", "from_config", "target", "executor_modules", "local_paths", "max_parallelism"}


def _scheduled(inner: TwoPhaseCommitSink[Any, Any], world: _World) -> TwoPhaseCommitSink[Any, Any]:
    """``inner`` with a scheduling point before every driver and executor method (and a trace line).

    A method of :class:`~twophase.sink.TwoPhaseCommitSink` the wrapper does not name (one added
    later) is forwarded too, with a scheduling point: never the base class's default instead of
    the sink's own."""
    cls = _SCHEDULED.get(inner.kind)
    if cls is None:
        attrs: dict[str, Any] = {"kind": inner.kind}
        for name, value in vars(TwoPhaseCommitSink).items():
            if (callable(value) and not name.startswith("_") and name not in _NO_POINT
                    and name not in vars(_ScheduledSink)):
                attrs[name] = _forward(name)
        cls = _SCHEDULED[inner.kind] = type(f"Scheduled[{inner.kind}]", (_ScheduledSink,), attrs)
    sink: TwoPhaseCommitSink[Any, Any] = cls(inner, world)
    return sink


def _forward(name: str) -> Callable[..., Any]:
    def method(self: _ScheduledSink, *args: Any, **kwargs: Any) -> Any:
        return self._call(name, lambda: ", ".join([*(repr(a)[:60] for a in args),
                                                   *(f"{k}={v!r:.60}" for k, v in kwargs.items())]),
                          lambda: getattr(self.inner, name)(*args, **kwargs), lambda out: repr(out)[:80])

    method.__name__ = name
    return method


#: A folder :func:`file_sink` made for one schedule, as it appears in paths (left out of the trace).
_TARGET_PREFIX = re.compile(r"/\S*?/twophase-explorer-[^/\s]+/")


def _intent_text(intent: dict[str, Any] | None) -> str:
    if not intent:
        return "{}"
    if set(intent) == {"token"}:
        return f"plan {intent['token']}"
    pool = intent.get("pool")
    if isinstance(pool, dict) and "fence_producer" in pool:  # KafkaSink: the plan fence, its snapshots
        def ids(d: Any) -> str:
            return "{" + ", ".join(f"{str(t).rsplit('-', 1)[-1]}: {pe[0]}/{pe[1]}" for t, pe in sorted((d or {}).items())) + "}"
        fence = pool.get("fence_producer") or ["?", "?"]
        return (f"fence {fence[0]}/{fence[1]}, open {ids(pool.get('open'))}"
                + (f", held {ids(pool.get('held'))}" if "held" in pool else ""))
    if set(intent) == {"staging"} and isinstance(intent["staging"], str):
        return f"staging {_TARGET_PREFIX.sub('', intent['staging'])}"
    return json.dumps(intent, sort_keys=True)[:80]


class _ScheduledSink(TwoPhaseCommitSink[Any, Any]):
    """A sink whose every method is a scheduling point of the explorer; delegates to ``inner``."""

    def __init__(self, inner: TwoPhaseCommitSink[Any, Any], world: _World):
        self.inner, self.world = inner, world
        self.supports_speculation = inner.supports_speculation
        self.points = world.sut.sink_points

    def _call(self, op: str, args: Callable[[], str], fn: Callable[[], Any],
              show: Callable[[Any], str] = repr) -> Any:
        if self.points:
            _point()
        try:
            out = fn()
        except _Abandon:
            raise
        except BaseException as e:
            def failed(e: BaseException = e) -> str:
                return f"{args()} -> raised {type(e).__name__}: {str(e)[:160]}".lstrip()

            self.world.log(f"sink.{op}", failed)
            raise
        self.world.log(f"sink.{op}", lambda: f"{args()} -> {show(out)}".lstrip())
        return out

    def _h(self, handle: Any) -> str:
        try:
            return self.inner.describe_handle(handle)
        except Exception:  # noqa: BLE001 - only a label
            return repr(handle)[:80]

    # -- driver
    def open(self) -> None:
        self._call("open", lambda: "", self.inner.open, lambda _: "ok")

    def open_for_commit(self) -> None:
        self._call("open_for_commit", lambda: "", self.inner.open_for_commit, lambda _: "ok")

    def max_parallelism(self) -> int | None:
        return self.inner.max_parallelism()

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        out: dict[str, Any] = self._call("plan_batch", lambda: f"b{batch_id}, {num_partitions} partitions",
                                         lambda: self.inner.plan_batch(query_name, batch_id, num_partitions),
                                         _intent_text)
        return out

    def plan_superseded(self, intent: dict[str, Any]) -> bool:
        return bool(self._call("plan_superseded", lambda: _intent_text(intent),
                               lambda: self.inner.plan_superseded(intent)))

    def verify_prepared(self, batch_id: int, handles: list[Any], *, prepare_started_at: float) -> None:
        self._call("verify_prepared", lambda: f"b{batch_id} [{', '.join(self._h(h) for h in handles)}]",
                   lambda: self.inner.verify_prepared(batch_id, handles, prepare_started_at=prepare_started_at),
                   lambda _: "ok")

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[Any], *,
                        settled: Settled | None = None) -> int:
        # The log's evidence goes on to the sink when its own method takes it (as the protocol does).
        return int(self._call(
            "abort_lingering", lambda: f"b{batch_id}, {_intent_text(intent)}, keep [{', '.join(self._h(h) for h in keep)}]"
            + (", settled" if settled is not None else ""),
            lambda: _sink_abort_lingering(self.inner, query_name, batch_id, intent, keep, settled),
            lambda n: f"{n} aborted"))

    def sweep_late(self, query_name: str, batch_id: int) -> int:
        return int(self._call("sweep_late", lambda: f"b{batch_id}", lambda: self.inner.sweep_late(query_name, batch_id),
                              lambda n: f"{n} aborted"))

    def commit(self, handle: Any) -> CommitResult:
        out: CommitResult = self._call("commit", lambda: self._h(handle), lambda: self.inner.commit(handle),
                                       _result_text)
        return out

    def recover_and_commit(self, handle: Any) -> CommitResult:
        out: CommitResult = self._call("recover_and_commit", lambda: self._h(handle),
                                       lambda: self.inner.recover_and_commit(handle), _result_text)
        return out

    def recover_and_abort(self, handle: Any) -> None:
        self._call("recover_and_abort", lambda: self._h(handle), lambda: self.inner.recover_and_abort(handle),
                   lambda _: "ok")

    # -- executor
    def begin_transaction(self, ctx: TransactionContext) -> Any:
        return self._call("begin_transaction",
                          lambda: f"b{ctx.batch_id} p{ctx.partition_id} a{ctx.attempt} {_intent_text(ctx.intent)}",
                          lambda: self.inner.begin_transaction(ctx), _txn_text)

    def write(self, txn: Any, batch: pa.RecordBatch) -> None:
        self._call("write", lambda: f"{_txn_text(txn)} {_rows_text(batch)}",
                   lambda: self.inner.write(txn, batch), lambda _: "ok")

    def pre_commit(self, txn: Any) -> Any:
        return self._call("pre_commit", lambda: _txn_text(txn), lambda: self.inner.pre_commit(txn),
                          lambda h: self._h(h))

    def abort(self, txn: Any) -> None:
        self._call("abort", lambda: _txn_text(txn), lambda: self.inner.abort(txn), lambda _: "ok")

    # -- handles and configuration: no scheduling point
    def handle_to_json(self, handle: Any) -> dict[str, Any]:
        return self.inner.handle_to_json(handle)

    def handle_from_json(self, data: dict[str, Any], version: int) -> Any:
        return self.inner.handle_from_json(data, version)

    def encode_handle(self, handle: Any) -> dict[str, Any]:
        return self.inner.encode_handle(handle)

    def decode_handle(self, envelope: Any) -> Any:
        return self.inner.decode_handle(envelope)

    def describe_handle(self, handle: Any) -> str:
        return self._h(handle)

    def to_config(self) -> dict[str, Any]:
        return self.inner.to_config()

    def target(self) -> str:
        return str(getattr(self.inner, "target", lambda: self.inner.kind)())


def _result_text(r: CommitResult) -> str:
    out = r.outcome.name
    if r.outcome is CommitOutcome.LOST:
        out += f" ({'never visible: ' if r.never_visible else ''}{r.reason[:60]})"
    return out


def _rows_text(batch: pa.RecordBatch) -> str:
    if "id" in batch.schema.names:
        return f"ids {batch.column('id').to_pylist()}"
    return f"{batch.num_rows} rows"


def _txn_text(txn: Any) -> str:
    key = getattr(txn, "key", None)
    if key is None and isinstance(getattr(txn, "ctx", None), TransactionContext):
        c = txn.ctx
        key = f"b{c.batch_id}.p{c.partition_id}a{c.attempt}.{c.run or '-'}#{c.task_attempt_id}"
    return str(key or repr(txn)[:60])


# ============================================================================ the log store
def _short(name: str) -> str:
    """``g0001/batch-000000000002.prepared.1.json`` -> ``b2.prepared.1`` (for listings)."""
    leaf = name.rsplit("/", 1)[-1]
    parsed = parse_batch_name(leaf)
    if parsed is None:
        return leaf[:-5] if leaf.endswith(".json") else leaf
    bid, state, ballot = parsed
    return f"b{bid}.{state}{f'.{ballot}' if ballot else ''}"


def _body(data: bytes | None) -> dict[str, Any]:
    if data is None:
        return {}
    try:
        body = json.loads(data.decode("utf-8")).get("body")
    except (ValueError, AttributeError, UnicodeDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


def _record_text(name: str, data: bytes | None) -> str:
    """What a record says, in a few words (for the trace)."""
    if data is None:
        return "None"
    b = _body(data)
    kind = b.get("kind") or b.get("state") or "?"
    if kind == "prepared":
        out = f"{b.get('outcome')}, epoch {b.get('epoch')}"
        if b.get("outcome") == "commit":
            out += f", {len(b.get('handles') or [])} handle(s)"
        return f"prepared ({out})"
    if kind == "intent":
        return f"intent (epoch {b.get('epoch')}, {_intent_text(b.get('intent'))})"
    if kind in ("committed", "void"):
        return f"{kind} (epoch {b.get('epoch')})"
    if kind == "low-water":
        return f"low-water {b.get('batch_id')}"
    if kind in ("epoch", "lease"):
        return f"{kind} {b.get('epoch')}{' released' if b.get('released') else ''}"
    return str(kind)


class MemoryLogStore(LogStore):
    """The transaction log's store, in memory and shared by every log object of one schedule.

    Linearizable (one dict, one actor at a time); every call is a scheduling point.
    """

    def __init__(self, world: _World, url: str):
        self.world, self.url = world, url

    def read(self, name: str) -> bytes | None:
        _point()
        data = self.world.files.get(name)
        self.world.log("store.read", lambda: f"{name} -> {_record_text(name, data)}", name)
        return data

    def create(self, name: str, data: bytes) -> bool:
        _point()
        w = self.world
        created = name not in w.files
        if created:
            w.files[name] = data
        w.log("store.create", lambda: f"{name} ({_record_text(name, data)}) -> {created}", name)
        if created:
            w.on_write(name, data)
        return created

    def replace(self, name: str, data: bytes) -> None:
        _point()
        w = self.world
        w.files[name] = data
        w.log("store.replace", lambda: f"{name} ({_record_text(name, data)})", name)
        w.on_write(name, data)

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        _point()
        out = _listing(self.world.files, folder, hidden)
        self.world.log("store.list", lambda: f"{folder or '/'} -> [{', '.join(_short(n) for n in out)}]", folder)
        return out

    def delete(self, name: str) -> None:
        _point()
        existed = self.world.files.pop(name, None) is not None
        self.world.log("store.delete", lambda: f"{name}{'' if existed else ' (absent)'}", name)
        self.world.on_change(name)


def _listing(files: dict[str, bytes], folder: str, hidden: bool) -> list[str]:
    prefix = folder.rstrip("/") + "/" if folder else ""
    return sorted(n[len(prefix):] for n in files
                  if n.startswith(prefix) and "/" not in n[len(prefix):]
                  and (hidden or not n[len(prefix):].startswith(".")))


class _QuietStore(LogStore):
    """The same files, read by the explorer's checks: no scheduling point, no trace, read only."""

    def __init__(self, world: _World, url: str):
        self.world, self.url = world, url

    def read(self, name: str) -> bytes | None:
        return self.world.files.get(name)

    def create(self, name: str, data: bytes) -> bool:
        raise TwoPhaseError("the explorer's checks write nothing")

    def replace(self, name: str, data: bytes) -> None:
        raise TwoPhaseError("the explorer's checks write nothing")

    def list(self, folder: str, hidden: bool = False) -> list[str]:
        return _listing(self.world.files, folder, hidden)

    def delete(self, name: str) -> None:
        raise TwoPhaseError("the explorer's checks write nothing")


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
    guard: Callable[[_World], Any] | None = None
    prologue: bool = False  # run() calls ctx.ready() itself
    #: What the actor may stop with; anything else is ``unexpected-error``.
    expected: tuple[type[BaseException], ...] = (TwoPhaseError,)
    #: What it must never stop with, although expected: ``data-loss`` (a batch job's run that
    #: finds its decided batch's data gone, :class:`~twophase.errors.DataLossError`).
    forbidden: tuple[type[BaseException], ...] = ()


class ActorContext:
    """What an actor's ``run`` gets: the schedule's world, and helpers that build what a process
    builds (a sink object, a log object, a protocol) on it."""

    def __init__(self, world: _World, run: _Run):
        self.world, self._run = world, run

    @property
    def batches(self) -> int:
        return self.world.batches

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
        prog = BatchProgress(NAME, b, QUERY_ID, "committed")
        protocol.run_batch(b, ctx.work(sink, b), prog)
        ctx.note(f"batch {b} {prog.action}")
        ctx.spark_committed(b)


def _take_log(ctx: ActorContext) -> tuple[TwoPhaseCommitSink[Any, Any], TwoPhaseProtocol]:
    """A coordinator's start: its sink opened, the log taken over (a new epoch), its protocol."""
    sink = ctx.sink()
    sink.open()
    tlog = ctx.tlog()
    tlog.acquire(QUERY_ID, NAME, takeover=True)
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
    twophase/datasource.py runs them.  Default batches: the first batch Spark has not committed
    when it starts, alone (a run paused in it) or (``until_last``) to the scenario's last (a
    restarted run).

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
            tlog.acquire(QUERY_ID, NAME, takeover=True)
            ctx.label(tlog)
            planner = ctx.protocol(psink, tlog)
            prog = BatchProgress(NAME, b, QUERY_ID, "committed")
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
                rlog.resume(owner=owner_id, epoch=epoch, generation=generation, query_id=QUERY_ID)
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
            committer.decide_and_commit(opened, results, BatchProgress(NAME, b, QUERY_ID, "committed"))
            committer.committed(b)
            ctx.note(f"batch {b} committed (ballot {opened.number})")
            ctx.spark_committed(b)

    return Actor(name, run)


def _intent_of(world: _World, batch_id: int, ballot: int | None) -> dict[str, Any] | None:
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
        prog = BatchProgress(NAME, batch_id, QUERY_ID, "committed")
        protocol.run_batch(batch_id, ctx.work(sink, batch_id), prog)
        ctx.note(f"batch {batch_id} {prog.action}")
        ctx.spark_committed(batch_id)

    return Actor(name or f"b{batch_id}", run, forbidden=(DataLossError,))


def _final_owner(world: _World) -> Actor:
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
            prog = BatchProgress(NAME, b, QUERY_ID, "committed")
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


@dataclass
class Scenario:
    """A named list of actors over ``batches`` batches (their rows: :func:`rows_of`).

    ``batch_ids``: the batch ids of batch jobs, which their runs pick themselves (out of order: a
    backfill of an older id beside a run of a newer one); the final owner then re-runs each of
    them (a re-run of each job) and one id more above them, instead of the batches Spark lacks.
    ``sut``: the sink the scenario runs on unless :func:`explore` is given one (default: the
    memory sink)."""

    name: str
    description: str
    actors: list[Actor]
    batches: int
    batch_ids: list[int] | None = None
    sut: Callable[[], SinkUnderTest] | None = None

    def expected_batches(self) -> list[int]:
        """The batches whose rows must be visible, each once, after the final owner."""
        if self.batch_ids is not None:
            return sorted({*self.batch_ids, max(self.batch_ids, default=-1) + 1})
        return list(range(self.batches + 1))


# ============================================================================ determinism
class _SyncExecutor:
    """``ThreadPoolExecutor`` stand-in: runs each task at ``submit``, in the caller's thread."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> _SyncExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised by fut.result(), as a pool's would be
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, **kwargs: Any) -> None:
        pass


class _Inline:
    """``twophase.protocol._InBackground`` stand-in: runs ``fn`` where it is started; ``result()``
    raises what it raised.  (In production it runs in a thread, beside the batch's tasks.)"""

    def __init__(self, fn: Callable[[], Any], *, name: str = "", daemon: bool = True):
        self._error: BaseException | None = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result(), as the real one does
            self._error = e

    def result(self) -> None:
        if self._error is not None:
            raise self._error


class _Uuids:
    """``uuid`` for the log and the protocol: ``uuid4()`` counts per schedule, so every name (log
    ids, owners, runs) is the same on a replay."""

    UUID = _uuid.UUID

    def uuid4(self) -> _uuid.UUID:
        world = _WORLD[0]
        if world is None or world.quiet:
            return _uuid.uuid4()
        world.uuids += 1
        return _uuid.UUID(int=world.uuids << 104)

    def __getattr__(self, name: str) -> Any:
        return getattr(_uuid, name)


class _Clock:
    """``time`` for the log: ``time()`` is the schedule's clock (it moves 1 ms per call)."""

    def time(self) -> float:
        world = _WORLD[0]
        if world is None or world.quiet:
            return time.time()
        world.clock += 0.001
        return world.clock

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


_WORLD: list[_World | None] = [None]
_PATCH_LOCK = threading.Lock()


class _TraceLog(logging.Handler):
    """The protocol's warnings, into the schedule's trace (and nowhere else while exploring)."""

    def emit(self, record: logging.LogRecord) -> None:
        world = _WORLD[0]
        if world is not None:
            msg = record.getMessage()
            world.log(f"({record.name.split('.')[-1]} {record.levelname.lower()})", msg[:300])


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Make the protocol core deterministic for the explorer, and restore everything after.

    - ``twophase.protocol._InBackground`` (the fence check, the replaced generations' sweep, a
      background COMMITTED record) runs inline where it is started;
    - ``twophase.recovery.ThreadPoolExecutor`` (the committer's pool) runs each commit at submit;
    - ``uuid4`` of the log and the protocol counts, ``time.time`` of the log is a clock per schedule
      (so the lease's heartbeat never comes due); ``TransactionLog.start_heartbeat`` starts nothing;
    - the ``explorer://`` scheme opens the schedule's in-memory store;
    - the ``twophase`` loggers write into the schedule's trace instead of the console.
    """
    with _PATCH_LOCK:
        saved: list[tuple[Any, str, Any]] = []

        def patch(obj: Any, attr: str, value: Any) -> None:
            if hasattr(obj, attr):
                saved.append((obj, attr, getattr(obj, attr)))
                setattr(obj, attr, value)

        patch(_protocol_mod, "_InBackground", _Inline)
        patch(_recovery_mod, "ThreadPoolExecutor", _SyncExecutor)
        patch(_log_mod, "uuid", _Uuids())
        patch(_protocol_mod, "uuid", _Uuids())
        for module in ("twophase.sinks.files.sink", "twophase.sinks.files.spark_writer",
                       "twophase.storage.parts"):  # FileSink's tokens and staged names
            if module in sys.modules:
                patch(sys.modules[module], "uuid", _Uuids())
        patch(_log_mod, "time", _Clock())
        patch(TransactionLog, "start_heartbeat", lambda self: None)
        factories = _registry._FACTORIES
        had = factories.get(SCHEME)
        factories[SCHEME] = _open_store
        logger = logging.getLogger("twophase")
        handler = _TraceLog(logging.WARNING)
        old_propagate, old_level = logger.propagate, logger.level
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET or logger.level > logging.WARNING:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate, logger.level = old_propagate, old_level
            if had is None:
                factories.pop(SCHEME, None)
            else:
                factories[SCHEME] = had
            for obj, attr, value in reversed(saved):
                setattr(obj, attr, value)


@contextlib.contextmanager
def _one_cpu(pin: bool) -> Iterator[None]:
    """Pin the calling thread (and so the threads it starts) to one of its CPUs, then restore."""
    getaff = getattr(os, "sched_getaffinity", None)
    setaff = getattr(os, "sched_setaffinity", None)
    if not pin or getaff is None or setaff is None:
        yield
        return
    before = getaff(0)
    try:
        setaff(0, {min(before)})
    except OSError:
        yield
        return
    try:
        yield
    finally:
        setaff(0, before)


def _open_store(url: str, storage_options: dict[str, Any] | None, exclusive: bool) -> LogStore:
    world = _WORLD[0]
    if world is None:
        raise TwoPhaseError(f"{url}: the explorer's store exists only while a schedule runs")
    return _QuietStore(world, url) if url == _QUIET_URL else MemoryLogStore(world, url)


# ============================================================================ one schedule
def _point() -> None:
    """A scheduling point: the calling actor stops here until the scheduler picks it again."""
    run: _Run | None = getattr(_local, "run", None)
    if run is not None:
        run.point()


class _Run:
    """One actor's thread in one schedule."""

    def __init__(self, world: _World, index: int, actor: Actor):
        self.world, self.index, self.actor = world, index, actor
        self.label = actor.name
        self.sem = threading.Lock()  # a binary semaphore, held while the actor must wait (C-level: fast)
        self.sem.acquire()
        self.state = "new"          # new | prologue | waiting | running | done
        self.started = False        # past ready(), picked at least once
        self.in_prologue = True
        self.free_point = False     # its first step runs through its first scheduling point
        self.inline = False         # runs in the explorer's own thread (the final owner, alone)
        self.steps = 0
        self.captured: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"explorer-{actor.name}", daemon=True)

    def _main(self) -> None:
        _local.run = self
        self.sem.acquire()
        try:
            if self.world.abandoned:
                raise _Abandon()
            if not self.actor.prologue:
                self.ready()
            self.actor.run(ActorContext(self.world, self))
        except BaseException as e:  # noqa: BLE001 - judged by the explorer
            self.error = e
        finally:
            self.state = "done"
            if not self.world.abandoned:
                self.world.main_sem.release()

    def ready(self) -> None:
        if not self.in_prologue:
            return
        self.in_prologue = False
        self.state = "waiting"
        self.world.main_sem.release()
        self.sem.acquire()
        if self.world.abandoned:
            raise _Abandon()
        self.free_point = True

    def point(self) -> None:
        if self.inline:  # alone: nothing to schedule; the last call's effects are checked
            self.world.check()
            self.steps += 1
            if self.steps > self.world.explorer.max_steps:
                self.world.fail("livelock", f"{self.label} ran {self.steps} steps without ending", fatal=True)
                raise _Abandon()
            return
        if self.world.abandoned:
            raise _Abandon()
        if self.in_prologue:
            return
        if self.free_point:
            self.free_point = False
            return
        self.state = "waiting"
        self.world.main_sem.release()
        self.sem.acquire()
        if self.world.abandoned:
            raise _Abandon()


class _World:
    """One schedule: the store's files, the sink's target, the actors' threads, the checks."""

    def __init__(self, explorer: _Explorer):
        self.explorer = explorer
        self.batches = explorer.scenario.batches
        self.batch_ids = explorer.scenario.batch_ids
        self.expected = explorer.scenario.expected_batches()
        self.retain_batches = explorer.retain_batches
        self.protocol_factory = explorer.protocol_factory
        self.files: dict[str, bytes] = {}
        sut = explorer.sut
        self.sut = sut
        self.target_obj = sut.new_target()
        self.target = self.target_obj if isinstance(self.target_obj, MemoryTarget) else None
        self.main_sem = threading.Lock()  # held while an actor runs; released when it stops
        self.main_sem.acquire()
        self.abandoned = False
        self.trace: list[_Entry] = []
        self.step_ops: list[tuple[str, str]] = []  # what the current step did (replays must do the same)
        self.uuids = 0
        self.clock = 1_700_000_000.0
        self.task_ids = 0
        self.spark_committed: set[int] = set()
        self.runs: list[_Run] = []
        self.broken: tuple[str, str] | None = None
        self.also: list[str] = []   # later failures of the same schedule (after the first)
        self.stopped = False        # a failure the schedule cannot go on after (blocked, livelock)
        # the checks' memory: (generation, batch) -> {decision key: [ballot, epoch, handle keys, void]}
        self.decisions: dict[tuple[int, int], dict[str, list[Any]]] = {}
        self.pruned: dict[int, set[int]] = {}  # generation -> batches the log said were pruned
        self.late_writes = 0                    # records that landed in pruned batches
        self.envelopes: dict[str, Any] = {}     # handle key -> the handle as a decision holds it
        self.lost_seen: set[Any] = set()        # decided files (transactions) found gone (reported once each)
        self.quiet = False                      # the checks read the log (no uuid, no clock)
        self._target_events = 0

    # -- trace and checks
    def log(self, op: str, detail: Callable[[], str] | str, key: str = "") -> None:
        run: _Run | None = getattr(_local, "run", None)
        label = run.label if run is not None and run.world is self else "setup"
        self.trace.append(_Entry(label, op, detail))
        self.step_ops.append((op, key))

    def fail(self, kind: str, message: str, *, fatal: bool = False) -> None:
        """Record a broken invariant.  The schedule still runs to its end (without branching any
        more), so that the trace shows what the break leads to; later ones are kept as ``also``."""
        self.stopped = self.stopped or fatal
        message = _TARGET_PREFIX.sub("", message)
        if self.broken is None:
            self.broken = (kind, message)
        elif len(self.also) < 5 and (kind, message) != self.broken and f"{kind}: {message}" not in self.also:
            self.also.append(f"{kind}: {message}")

    def decided_handles(self) -> set[str]:
        out: set[str] = set()
        for entries in self.decisions.values():
            for _ballot, _epoch, keys, void in entries.values():
                if not void:
                    out.update(keys)
        return out

    def decided_batches(self) -> set[int]:
        return {b for (g, b), entries in self.decisions.items() if any(not e[3] for e in entries.values())}

    def log_pruned(self, generation: int) -> set[int]:
        """The batches the log itself says were committed and pruned, as any log object reads them
        now (``TransactionLog.pruned``, or the single low-water mark of older versions)."""
        self.quiet = True
        try:
            reader = TransactionLog(_QUIET_URL, readonly=True)
            pruned = getattr(reader, "pruned", None)
            if pruned is not None:
                return {b for first, last in pruned(generation, fresh=True) for b in range(int(first), int(last) + 1)}
            low = reader.low_water(generation)
            return set(range(int(low) + 1)) if low is not None else set()
        finally:
            self.quiet = False

    def on_change(self, name: str) -> None:
        """After a write or delete of a generation's file other than a batch record (the log's
        pruned marks, whatever their layout): the log never forgets a batch it said was pruned."""
        folder, _, leaf = name.partition("/")
        if not (folder.startswith("g") and folder[1:].isdigit()) or parse_batch_name(leaf) is not None:
            return
        generation = int(folder[1:])
        now, before = self.log_pruned(generation), self.pruned.get(generation, set())
        forgotten = sorted(before - now)
        if forgotten:
            self.fail("pruned-forgotten", f"the log no longer says batches {forgotten} of generation {generation} were "
                      f"pruned ({name}): a late write there is no longer refused (its low-water mark moved back)")
        self.pruned[generation] = before | now

    def on_write(self, name: str, data: bytes) -> None:
        """Checks of the log's records, as they land."""
        self.on_change(name)
        folder, _, leaf = name.rpartition("/")
        parsed = parse_batch_name(leaf)
        if parsed is None or not folder.startswith("g") or not folder[1:].isdigit():
            return
        bid, state, ballot = parsed
        generation = int(folder[1:])
        body = _body(data)
        if bid in self.pruned.get(generation, ()):
            # A late write of a deposed coordinator into a batch committed and pruned: garbage, never
            # a decision (committing it would be "visible-undecided"; its rows twice "duplicate-row").
            self.late_writes += 1
            self.log("note", f"{_short(name)} landed in a batch the log pruned: a late write, not a decision")
            return
        entries = self.decisions.setdefault((generation, bid), {})
        if state == "prepared" and body.get("outcome") == "commit":
            keys = [_handle_key(h) for h in body.get("handles") or []]
            for h in body.get("handles") or []:
                self.envelopes.setdefault(_handle_key(h), h)
            entries[f"{name}#{body.get('writer')}"] = [ballot, body.get("epoch"), keys, False]
            live = sorted((e[0], e[1]) for e in entries.values() if not e[3])
            if len(live) > 1:
                self.fail("two-decisions", f"batch {bid} (generation {generation}) holds commit decisions in "
                          + " and ".join(f"ballot {b} (epoch {e})" for b, e in live)
                          + ("" if len({b for b, _ in live}) == len(live) else
                             ": one slot decided twice, its first decision pruned"))
        elif state == "void":
            for e in entries.values():
                if e[0] == ballot:
                    e[3] = True
        elif state == "prepared":  # an abort: who closes whose ballot
            intent = self.files.get(f"{folder}/batch-{bid:012d}.intent{f'.{ballot}' if ballot else ''}.json")
            opener, closer = _body(intent).get("epoch"), body.get("epoch")
            if opener is not None and closer is not None and int(closer) < int(opener):
                self.fail("older-closed-newer", f"ballot {ballot} of batch {bid}, opened by epoch {opener}, was "
                          f"closed by epoch {closer} (an older coordinator, deposed): "
                          f"{str(body.get('reason'))[:120]}")

    def check(self) -> None:
        """The invariants that hold after every step."""
        if self.target is not None:
            events = self.target.events
            decided = None
            while self._target_events < len(events):
                ev, key, before = events[self._target_events]
                self._target_events += 1
                decided = self.decided_handles() if decided is None else decided
                if ev == "commit" and key not in decided:
                    self.fail("visible-undecided", f"transaction {key} was made visible, but no commit decision "
                              "names it")
                elif ev == "abort" and key in decided:
                    self.fail("decided-aborted", f"transaction {key} ({before}) was aborted, but a commit "
                              "decision names it")
        if self.sut.lost is not None and self.envelopes:
            decided = self.decided_handles()
            found = [x for x in self.sut.lost(self.target_obj, [self.envelopes[k] for k in sorted(decided)])
                     if x not in self.lost_seen]
            self.lost_seen.update(found)
            gone = [x for x in found if isinstance(x, str)]
            if gone:
                self.fail("decided-aborted", f"a commit decision names {', '.join(gone)}, which is neither staged "
                          "nor visible: deleted after the batch was decided")
            for kind, message in (x for x in found if isinstance(x, tuple)):  # a sink's own kind and words
                self.fail(kind, message)
        seen = Counter(self.sut.visible(self.target_obj))
        twice = sorted(i for i, n in seen.items() if n > 1)
        if twice:
            self.fail("duplicate-row", f"row ids {twice} are visible {', '.join(str(seen[i]) for i in twice)} times")
        undecided = sorted({_batch_of(i) for i in seen} - self.decided_batches())
        if undecided:
            self.fail("visible-undecided", f"rows of batches {undecided} are visible, and no commit decision of "
                      "theirs was ever written")

    def state_text(self) -> str:
        shown = sorted(self.sut.visible(self.target_obj))
        left = self.sut.leftovers(self.target_obj) if self.sut.leftovers is not None else []
        return f"visible rows {shown}" + (f"; open or pre-committed: {', '.join(left)}" if left else "")

    def final_check(self) -> None:
        seen = Counter(self.sut.visible(self.target_obj))
        want = Counter(i for b in self.expected for i in rows_of(b))
        if seen != want:
            missing = sorted((want - seen).elements())
            extra = sorted((seen - want).elements())
            self.fail("rows-not-exactly-once", "after the final recovery and replays"
                      + (f", rows {missing} are missing" if missing else "")
                      + (f", rows {extra} are visible once too often" if extra else "")
                      + f" (visible: {sorted(seen.elements())})")
        if self.sut.leftovers is not None:
            left = self.sut.leftovers(self.target_obj)
            if left:
                self.fail("leftovers", f"after the final recovery and one more batch, still open or pre-committed: "
                          f"{', '.join(left)}")


def _handle_key(envelope: Any) -> str:
    data = envelope.get("data") if isinstance(envelope, dict) else None
    if isinstance(data, dict) and "txn" in data:
        return str(data["txn"])
    return json.dumps(envelope, sort_keys=True)


# ============================================================================ the explorer
@dataclass
class Report:
    """What one exploration covered, and what it found."""

    scenario: str
    preemptions: int
    batches: int
    actors: list[str]
    schedules: int = 0
    steps: int = 0
    longest: int = 0
    seconds: float = 0.0
    complete: bool = False  # every schedule within the bound was run (no max_schedules cut)
    stopped: bool = False   # stopped at a finding
    late_writes: int = 0    # records that landed in batches the log had pruned (deposed actors' late writes)
    findings: list[Finding] = field(default_factory=list)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def summary(self) -> str:
        how = "all" if self.complete else "stopped at a finding" if self.stopped else "cut at max-schedules"
        lines = [f"explored {self.schedules} schedules ({how}) of "
                 f"scenario {self.scenario!r}: preemption bound {self.preemptions}, actors "
                 f"{', '.join(self.actors)}, {self.batches} batch{'es' if self.batches != 1 else ''}; "
                 f"{self.steps} steps (longest schedule {self.longest}) in {self.seconds:.1f} s"
                 + (f"; {self.late_writes} late writes into pruned batches" if self.late_writes else "")]
        for actor, outcomes in self.outcomes.items():
            lines.append(f"  {actor}: " + ", ".join(f"{k} x{n}" for k, n in outcomes.most_common()))
        if self.findings:
            lines.append("findings: " + ", ".join(f"{f.kind} ({f.count} schedules)" for f in self.findings))
        else:
            lines.append("findings: none")
        return "\n".join(lines)


@dataclass
class _Node:
    """A step of the depth-first search: who could run, who ran, the preemptions before it."""

    enabled: tuple[int, ...]
    options: list[int]
    idx: int
    preemptions: int
    did: tuple[tuple[str, str], ...] | None = None  # what the step did when first run
    done_idx: int = -1                               # ... with which option


class _Explorer:
    def __init__(self, scenario: Scenario, *, preemptions: int, sut: SinkUnderTest,
                 protocol_factory: Callable[..., TwoPhaseProtocol], retain_batches: int, step_timeout: float,
                 max_steps: int):
        self.scenario, self.bound, self.sut = scenario, preemptions, sut
        self.protocol_factory, self.retain_batches = protocol_factory, retain_batches
        self.step_timeout, self.max_steps = step_timeout, max_steps
        self._template: tuple[dict[str, bytes], int, float] | None = None

    def run(self, prefix: list[_Node], number: int, forced: Sequence[int] = ()) -> tuple[list[_Node], _World, int]:
        """Run one schedule: replay ``prefix``, then go on by default choices, recording new nodes
        (after a broken invariant, nodes without alternatives: a broken schedule is not branched).
        ``forced``: the actor to pick at each step while it can run (:func:`replay`)."""
        world = _World(self)
        _WORLD[0] = world
        nodes = list(prefix)
        preemptions = 0
        try:
            self._setup(world)
            runs = world.runs = [_Run(world, i, a) for i, a in enumerate(self.scenario.actors)]
            for r in runs:  # prologues, in order: none of them branches
                r.thread.start()
                self._step(world, r, prologue=True)
            current: _Run | None = None
            step = 0
            while not world.stopped:
                enabled = tuple(r.index for r in runs if self._enabled(world, r))
                if not enabled:
                    break
                if step >= self.max_steps:
                    world.fail("livelock", f"the schedule ran {step} steps without ending", fatal=True)
                    break
                if step < len(nodes):
                    node = nodes[step]
                    if node.enabled != enabled:
                        raise RuntimeError(f"explorer: schedule #{number} is not deterministic: at step {step + 1} "
                                           f"actors {enabled} could run, {node.enabled} on an earlier run")
                else:
                    if current is not None and current.index in enabled:
                        others = [i for i in enabled if i != current.index]
                        options = [current.index] + (others if preemptions < self.bound else [])
                    else:
                        options = list(enabled)
                    if step < len(forced) and forced[step] in enabled:
                        options = [forced[step]]
                    elif world.broken is not None:
                        options = options[:1]
                    node = _Node(enabled, options, 0, preemptions)
                    nodes.append(node)
                choice = node.options[node.idx]
                chosen = runs[choice]
                if current is not None and current.index in enabled and choice != current.index:
                    preemptions += 1
                    world.trace.append(_Entry("--", f"preempted {current.label}, {chosen.label} runs", ""))
                if not chosen.started:
                    chosen.started = True
                    chosen.captured = self._guard(world, chosen)
                world.step_ops = []
                self._step(world, chosen)
                did = tuple(world.step_ops)
                if node.did is None or node.idx != node.done_idx:
                    node.did, node.done_idx = did, node.idx
                elif node.did != did:
                    raise RuntimeError(f"explorer: schedule #{number} is not deterministic: step {step + 1} "
                                       f"({chosen.label}) did {list(did)}, on an earlier run {list(node.did)}")
                current = chosen
                step += 1
                world.check()
            if not world.stopped:
                self._finish(world)
            if world.broken is not None:
                world.trace.append(_Entry("--", "end:", world.state_text()))
        finally:
            self._abandon(world)
            _WORLD[0] = None
        return nodes, world, preemptions

    def _setup(self, world: _World) -> None:
        """The log exists and its generation is bound (no epoch taken) before any actor runs: made
        once, then copied into every schedule (with the uuid count and clock it leaves)."""
        if self._template is None:
            tlog = TransactionLog(LOG_URL, retain_batches=world.retain_batches)
            tlog.acquire(QUERY_ID, NAME)
            for name in [n for n in world.files if n.startswith("epochs/") or n == "lease.json"]:
                del world.files[name]
            self._template = (dict(world.files), world.uuids, world.clock)
        files, world.uuids, world.clock = self._template
        world.files = dict(files)
        world.trace.clear()
        world.step_ops.clear()

    @staticmethod
    def _guard(world: _World, r: _Run) -> Any:
        return True if r.actor.guard is None else r.actor.guard(world)

    def _enabled(self, world: _World, r: _Run) -> bool:
        if r.state != "waiting":
            return False
        return r.started or bool(self._guard(world, r))

    def _step(self, world: _World, r: _Run, *, prologue: bool = False) -> None:
        r.state = "prologue" if prologue else "running"
        r.sem.release()
        if not world.main_sem.acquire(timeout=self.step_timeout):
            world.fail("blocked", f"{r.label} did not reach its next scheduling point within {self.step_timeout:.0f} s "
                       "(it waits outside the explorer: a lock, a join, a sleep)", fatal=True)
            return
        if r.state == "done":
            self._ended(world, r)

    def _ended(self, world: _World, r: _Run) -> None:
        e = r.error
        if e is None:
            world.trace.append(_Entry(r.label, "ends", ""))
        elif isinstance(e, _Abandon):
            return
        elif isinstance(e, r.actor.expected):
            world.trace.append(_Entry(r.label, "stops:", f"{type(e).__name__}: {str(e)[:300]}"))
            if isinstance(e, r.actor.forbidden):
                world.fail("data-loss", f"{r.label} stopped with {type(e).__name__}: {str(e)[:300]}")
        else:
            world.trace.append(_Entry(r.label, "CRASHES:", f"{type(e).__name__}: {e}"))
            world.fail("unexpected-error", f"{r.label} raised {type(e).__name__} (not a TwoPhaseError): {e}")

    def _finish(self, world: _World) -> None:
        """The final owner, alone, then the end-of-schedule checks."""
        final = _Run(world, len(world.runs), _final_owner(world))
        world.runs.append(final)
        # Alone, it runs in this thread: its scheduling points only check the invariants.
        final.inline, final.started, final.in_prologue = True, True, False
        _local.run = final
        try:
            final.actor.run(ActorContext(world, final))
        except _Abandon:
            return
        except BaseException as e:  # noqa: BLE001 - judged below
            final.error = e
        finally:
            _local.run = None
            final.state = "done"
        world.check()
        if world.sut.expire is not None:
            world.sut.expire(world.target_obj)
            world.check()
        self._ended(world, final)
        if final.error is not None:
            world.fail("final-owner-failed", f"the final owner (recovery, then the batches Spark replays) "
                       f"raised {type(final.error).__name__}: {final.error}")
        world.final_check()

    def _abandon(self, world: _World) -> None:
        world.abandoned = True
        for r in world.runs:
            if r.thread.is_alive() and r.sem.locked():
                r.sem.release()
        for r in world.runs:
            if r.thread.ident is not None:
                r.thread.join(timeout=self.step_timeout)
        if world.sut.close_target is not None:
            world.sut.close_target(world.target_obj)


def explore(scenario: Scenario | str, *, preemptions: int = 2, max_schedules: int | None = None,
            sut: SinkUnderTest | None = None, protocol_factory: Callable[..., TwoPhaseProtocol] | None = None,
            collect: bool = False, retain_batches: int = 1, batches: int | None = None,
            step_timeout: float = 30.0, max_steps: int = 2000,
            progress: Callable[[str], None] | None = None, progress_every: float = 5.0,
            out: Callable[[str], None] | None = None, pin_cpu: bool = True) -> Report:
    """Run every schedule of ``scenario`` with at most ``preemptions`` preemptions (depth first).

    ``scenario``: a :class:`Scenario` or the name of one of :data:`SCENARIOS` (``batches``: how many
    batches a named one covers).  ``sut``: the sink (default: the scenario's own, else
    :func:`memory_sink`; :func:`file_sink` runs the shipped FileSink).
    ``protocol_factory(sink, tlog, *, name, query_name, committer)``: the protocol every actor runs
    (default :class:`~twophase.protocol.TwoPhaseProtocol`; a subclass to test).  On the first
    finding raises :class:`Violation` (its message is the trace), unless ``collect``: then every
    schedule runs and the report lists each kind of finding once, with its first trace.
    ``out`` gets the trace of each finding and the coverage summary (e.g. ``print``).
    ``pin_cpu``: run the calling thread and the actors' threads on one CPU while exploring (Linux;
    restored after): one runs at a time, and a hand-off between threads on one CPU costs about a
    quarter of one between two.
    """
    scenario = _scenario(scenario, batches)
    explorer = _Explorer(scenario, preemptions=preemptions, sut=sut or _default_sut(scenario),
                         protocol_factory=protocol_factory or TwoPhaseProtocol, retain_batches=retain_batches,
                         step_timeout=step_timeout, max_steps=max_steps)
    report = Report(scenario.name, preemptions, scenario.batches, [a.name for a in scenario.actors])
    t0 = last = time.monotonic()
    found: dict[str, Finding] = {}
    stack: list[_Node] = []
    with deterministic(), _sut_patches(explorer.sut), _one_cpu(pin_cpu):
        while True:
            number = report.schedules + 1
            stack, world, used = explorer.run(stack, number)
            report.schedules = number
            report.steps += len(stack)
            report.longest = max(report.longest, len(stack))
            report.late_writes += world.late_writes
            for r in world.runs[:len(scenario.actors)]:
                outcome = ("never ran" if not r.started else "ended" if r.error is None
                           else type(r.error).__name__ if not isinstance(r.error, _Abandon) else "cut off")
                report.outcomes.setdefault(r.actor.name, Counter())[outcome] += 1
            if world.broken is not None:
                kind, message = world.broken
                if kind in found:
                    found[kind].count += 1
                else:
                    finding = Finding(kind, message, scenario.name, number,
                                      [n.options[n.idx] for n in stack], used,
                                      [f"{i:4d}. {e.text()}" for i, e in enumerate(world.trace, 1)],
                                      list(world.also))
                    found[kind] = finding
                    report.findings.append(finding)
                    if out is not None:
                        out(finding.render())
                    if not collect or kind == "blocked":  # (a thread left blocked: nothing after is sure)
                        report.seconds, report.stopped = time.monotonic() - t0, True
                        if out is not None:
                            out(report.summary())
                        if collect:
                            return report
                        raise Violation(finding)
            # backtrack: the deepest step with a choice not tried yet
            while stack:
                node = stack[-1]
                node.idx += 1
                if node.idx < len(node.options):
                    break
                stack.pop()
            if not stack:
                report.complete = True
                break
            if max_schedules is not None and report.schedules >= max_schedules:
                break
            now = time.monotonic()
            if progress is not None and now - last >= progress_every:
                last = now
                progress(f"explorer: {report.schedules} schedules of {scenario.name!r} in {now - t0:.0f} s, "
                         f"backtracking at step {len(stack)}, findings: {', '.join(found) or 'none'}")
    report.seconds = time.monotonic() - t0
    if out is not None:
        out(report.summary())
    return report


def replay(scenario: Scenario | str, choices: Sequence[int], *, batches: int | None = None,
           sut: SinkUnderTest | None = None, protocol_factory: Callable[..., TwoPhaseProtocol] | None = None,
           retain_batches: int = 1, step_timeout: float = 30.0, max_steps: int = 2000) -> tuple[list[str], str | None]:
    """Run one schedule: at each step the actor ``choices`` names (an index into the scenario's
    actors; a :class:`Finding`'s ``choices``) while it can run, else the default one.  Returns the
    numbered trace and the finding's message (or None)."""
    scenario = _scenario(scenario, batches)
    explorer = _Explorer(scenario, preemptions=len(choices), sut=sut or _default_sut(scenario),
                         protocol_factory=protocol_factory or TwoPhaseProtocol, retain_batches=retain_batches,
                         step_timeout=step_timeout, max_steps=max_steps)
    with deterministic(), _sut_patches(explorer.sut):
        _, world, _ = explorer.run([], 1, forced=choices)
        trace = [f"{i:4d}. {e.text()}" for i, e in enumerate(world.trace, 1)]
    return trace, None if world.broken is None else f"{world.broken[0]}: {world.broken[1]}"


def _sut_patches(sut: SinkUnderTest) -> contextlib.AbstractContextManager[Any]:
    return sut.patches() if sut.patches is not None else contextlib.nullcontext()


def _default_sut(scenario: Scenario) -> SinkUnderTest:
    return scenario.sut() if scenario.sut is not None else memory_sink()


def _scenario(scenario: Scenario | str, batches: int | None) -> Scenario:
    if not isinstance(scenario, str):
        return scenario
    try:
        _, build, default = SCENARIOS[scenario]
    except KeyError:
        raise ValueError(f"no scenario {scenario!r}; known: {', '.join(SCENARIOS)}") from None
    return build(batches if batches is not None else default)


# ============================================================================ scenarios
def _datasource(batches: int) -> Scenario:
    return Scenario("datasource", "two runs of one checkpoint written with the data source form: the first "
                    "run, on batch 0 (paused anywhere), and a restarted run, from the first batch Spark has not "
                    "committed to the last", [datasource_run(name="ds1"), datasource_run(name="ds2", until_last=True)],
                    batches)


def _deposed(batches: int) -> Scenario:
    return Scenario("deposed", "a deposed coordinator (an older epoch) committed the batches before the last two "
                    "itself and runs the next one; the owner takes the log over and runs from there to the last",
                    [deposed(history=max(0, batches - 2)), owner()], batches)


def _deposed_recovery(batches: int) -> Scenario:
    return Scenario("deposed-recovery", "a deposed coordinator (an older epoch, just started: its first batch "
                    "runs recovery) runs batch 0; the owner takes the log over and runs every batch",
                    [deposed(), owner()], batches)


def _late(batches: int) -> Scenario:
    return Scenario("late-attempt", "the owner runs every batch; a late task attempt of batch 0 pre-commits "
                    "under the latest ballot's INTENT at any point after it exists",
                    [owner(), late_attempt(0)], batches)


def _recover(batches: int) -> Scenario:
    return Scenario("recover", "the owner runs every batch; an operator's 'twophase recover --takeover' runs "
                    "at any point", [owner(), operator_recover()], batches)


def _owner_and_datasource(batches: int) -> Scenario:
    return Scenario("owner-datasource", "a data source run (every plan a new epoch: older or newer than the "
                    "owner's, as the schedule has it) plans and commits batch 0; a coordinator takes the log "
                    "over and runs from the first batch Spark has not committed to the last",
                    [datasource_run(name="ds"), owner()], batches)


#: The ids the runs of ``batch-jobs`` write, in the order the runs are listed (first: the newer run).
BATCH_JOB_IDS = (11, 5, 8, 3)


def _batch_jobs(batches: int) -> Scenario:
    ids = list(BATCH_JOB_IDS[:max(1, min(batches, len(BATCH_JOB_IDS)))])
    return Scenario("batch-jobs", "two runs of one batch job (same name, target and log; each takes the log "
                    f"over): a run of batch {ids[0]} and a backfill of batch "
                    f"{', '.join(map(str, ids[1:])) or '-'} (older ids), overlapping, either paused anywhere; "
                    "then a re-run of each; on the shipped FileSink (issue 59, scenario 1)",
                    [batch_job(b) for b in ids], len(ids), batch_ids=ids, sut=file_sink)


#: name -> (description, builder(batches), default batches)
SCENARIOS: dict[str, tuple[str, Callable[[int], Scenario], int]] = {
    "datasource": ("two data source runs of one checkpoint (scenario 3)", _datasource, 2),
    "deposed": ("a deposed coordinator on its fast path beside the owner", _deposed, 3),
    "deposed-recovery": ("a deposed coordinator's first batch beside the owner", _deposed_recovery, 2),
    "late-attempt": ("the owner and a late task attempt of batch 0", _late, 2),
    "recover": ("the owner and an operator's recover", _recover, 2),
    "owner-datasource": ("the owner and a data source run", _owner_and_datasource, 2),
    "batch-jobs": ("two runs of one batch job, ids 11 and 5, on the shipped FileSink (--batches: how many runs)",
                   _batch_jobs, 2),
}


# ============================================================================ CLI
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twophase.testing.explorer",
        description="Explore every interleaving of a scenario's actors (the protocol core on an in-memory log "
                    "and sink) up to a preemption bound; print the trace of the first broken invariant, or "
                    "the coverage. Exit status 1 on a finding.",
        epilog="scenarios: " + "; ".join(f"{k}: {v[0]} (default --batches {v[2]})" for k, v in SCENARIOS.items()))
    parser.add_argument("--scenario", default="datasource", choices=sorted(SCENARIOS))
    parser.add_argument("--preemptions", type=int, default=2, metavar="N",
                        help="preemption bound (default 2)")
    parser.add_argument("--batches", type=int, default=None, metavar="N",
                        help="batches the scenario covers (default: the scenario's own)")
    parser.add_argument("--max-schedules", type=int, default=None, metavar="N",
                        help="stop after N schedules (default: all within the bound)")
    parser.add_argument("--retain-batches", type=int, default=1, metavar="N",
                        help="the logs' retain_batches (default 1: pruning happens within 3 batches)")
    parser.add_argument("--all", action="store_true",
                        help="go on after a finding; report each kind once (with its first trace)")
    parser.add_argument("--replay", metavar="SCHEDULE",
                        help="run one schedule, as a finding prints it (e.g. '0*17 1*17 0*11 1*15'), and print "
                             "its trace")
    parser.add_argument("--sink", choices=sorted(SINKS), default=None,
                        help="the sink: 'memory' (the model), 'files' (the shipped FileSink on a local folder, "
                             "each storage call a scheduling point) or 'kafka' (the shipped KafkaSink on an "
                             "in-memory broker, each broker request a scheduling point, two tasks a batch); "
                             "default: the scenario's own (batch-jobs: files; the others: memory)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    sut = SINKS[args.sink]() if args.sink else None
    if args.replay is not None:
        trace, broken = replay(args.scenario, parse_schedule(args.replay), batches=args.batches,
                               retain_batches=args.retain_batches, sut=sut)
        print("\n".join(trace))
        print(f"invariant broken ({broken})" if broken else "no invariant broken")
        return 1 if broken else 0
    progress = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    common: dict[str, Any] = {"preemptions": args.preemptions, "batches": args.batches,
                              "max_schedules": args.max_schedules, "retain_batches": args.retain_batches,
                              "progress": progress, "sut": sut}
    if not args.all:
        try:
            explore(args.scenario, out=print, **common)
        except Violation:
            return 1
        return 0
    report = explore(args.scenario, collect=True, **common)
    for f in report.findings:
        print(f.render())
        print()
    print(report.summary())
    return 1 if report.findings else 0


if __name__ == "__main__":
    sys.exit(main())
