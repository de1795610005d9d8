"""The sinks under test: :class:`SinkUnderTest` (how the explorer builds a sink and reads its target),
the in-memory model of the real sinks (:class:`MemorySink`, :func:`memory_sink`), the shipped
FileSink with its storage calls as scheduling points (:func:`file_sink`), the shipped KafkaSink on
the broker model (:func:`kafka_sink`), and the command line's ``--sink`` names (:data:`SINKS`)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import TransactionTakenError, TwoPhaseError
from twophase.sink import CommitResult, TwoPhaseCommitSink
from twophase.testing.explorer._base import _WORLD, NAME, _Abandon, _point


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


def kafka_sink(*, partitions: int = 2, slots_per_partition: int | None = None,
               transactional_ids: str | None = None) -> SinkUnderTest:
    """The shipped :class:`twophase.sinks.kafka.KafkaSink` (its pool, plan fence, claims, held and open
    snapshots, verdicts) on an in-memory broker per schedule (:mod:`twophase.testing.kafka_model`:
    a topic of two partitions; every broker request, the driver's and the executors' kafka-python
    requests and the producers' and consumers' alike, is a scheduling point and a ``kafka.*`` trace
    line).  Batches have ``partitions`` tasks (default 2: a batch half committed shows).
    ``transactional_ids``: the sink's (default its own default: a batch job's ballots on ids of
    their own; ``"pool"``: on the shared pool).
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
        kwargs: dict[str, Any] = {}
        if slots_per_partition is not None:
            kwargs["slots_per_partition"] = slots_per_partition
        if transactional_ids is not None:
            kwargs["transactional_ids"] = transactional_ids
        return KafkaSink(KAFKA_MODEL_BOOTSTRAP, KAFKA_TOPIC, NAME + "-ids", **kwargs)

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
