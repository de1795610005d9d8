"""The scheduling points the actors meet: every sink method (:class:`_ScheduledSink`, a wrapper with a
trace line per call) and every call of the log's store (:class:`MemoryLogStore`, the in-memory store
of one schedule; :class:`_QuietStore`, the same files as the explorer's checks read them), and how
the trace shows intents, records, results, rows and transactions."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pyarrow as pa

from twophase.context import TransactionContext
from twophase.errors import TwoPhaseError
from twophase.evidence import Settled
from twophase.log import parse_batch_name
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink
from twophase.sink import abort_lingering as _sink_abort_lingering
from twophase.storage._base import LogStore
from twophase.testing.explorer._base import _TARGET_PREFIX, _Abandon, _point, _WorldView

_SCHEDULED: dict[str, type] = {}

#: Sink methods that are no scheduling point: pure functions of their arguments and the configuration.
_NO_POINT = {"handle_to_json", "handle_from_json", "encode_handle", "decode_handle", "describe_handle",
             "to_config", "from_config", "target", "executor_modules", "local_paths", "max_parallelism"}


def _scheduled(inner: TwoPhaseCommitSink[Any, Any], world: _WorldView) -> TwoPhaseCommitSink[Any, Any]:
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
        if pool.get("ids"):  # ids of its own (plan_batch_job)
            return f"fence {fence[0]}/{fence[1]}, own ids {pool['ids']}-*"
        return (f"fence {fence[0]}/{fence[1]}, open {ids(pool.get('open'))}"
                + (f", held {ids(pool.get('held'))}" if "held" in pool else ""))
    if set(intent) == {"staging"} and isinstance(intent["staging"], str):
        return f"staging {_TARGET_PREFIX.sub('', intent['staging'])}"
    return json.dumps(intent, sort_keys=True)[:80]


class _ScheduledSink(TwoPhaseCommitSink[Any, Any]):
    """A sink whose every method is a scheduling point of the explorer; delegates to ``inner``."""

    def __init__(self, inner: TwoPhaseCommitSink[Any, Any], world: _WorldView):
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

    def plan_batch_job(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        out: dict[str, Any] = self._call("plan_batch_job", lambda: f"b{batch_id}, {num_partitions} partitions",
                                         lambda: self.inner.plan_batch_job(query_name, batch_id, num_partitions),
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

    def __init__(self, world: _WorldView, url: str):
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

    def __init__(self, world: _WorldView, url: str):
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
