"""The abstract two-phase-commit sink: what runs on executors, what runs on the driver.

Modelled on Flink's ``TwoPhaseCommitSinkFunction``.  A *transaction* is one
partition's writes for one batch.  Executors call :meth:`begin_transaction`,
:meth:`write`, :meth:`pre_commit` (or :meth:`abort`); the driver-side coordinator
logs the returned handles as its commit decision, then calls :meth:`commit` on
each.  After a crash the coordinator calls :meth:`recover_and_commit` for
handles whose decision was logged and :meth:`abort_lingering` for anything an
unfinished attempt may have left open.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

from twophase import handles as _handles
from twophase.context import BatchContext, TransactionContext

if TYPE_CHECKING:
    import pyarrow as pa

    from twophase.evidence import Settled

TxnT = TypeVar("TxnT")
HandleT = TypeVar("HandleT")


class CommitOutcome(enum.Enum):
    """What :meth:`TwoPhaseCommitSink.commit` found, as a value rather than a guess from an exception."""

    COMMITTED = "committed"
    """This call made the transaction visible."""
    ALREADY_COMMITTED = "already_committed"
    """An earlier call (perhaps before a crash) made it visible; nothing was done."""
    RETRY_LATER = "retry_later"
    """A transient condition (coordinator moving, server busy): the coordinator retries with backoff."""
    LOST = "lost"
    """The transaction can never be committed (expired, aborted, fenced): data loss."""


@dataclass(frozen=True)
class CommitResult:
    outcome: CommitOutcome
    reason: str = ""
    #: LOST only: the target proves this transaction never became visible and never can (it was
    #: aborted or rolled back by the target, not committed).  When every handle of a decided
    #: batch is such, nothing of the batch is visible and the coordinator runs it again.
    never_visible: bool = False

    @classmethod
    def committed(cls) -> CommitResult:
        return cls(CommitOutcome.COMMITTED)

    @classmethod
    def already_committed(cls, reason: str = "") -> CommitResult:
        return cls(CommitOutcome.ALREADY_COMMITTED, reason)

    @classmethod
    def retry_later(cls, reason: str) -> CommitResult:
        return cls(CommitOutcome.RETRY_LATER, reason)

    @classmethod
    def lost(cls, reason: str, *, never_visible: bool = False) -> CommitResult:
        """Can never be committed.  ``never_visible=True`` only where the target *proves* that no
        part of the transaction is or ever was visible (say nothing when in doubt)."""
        return cls(CommitOutcome.LOST, reason, never_visible)

    @property
    def done(self) -> bool:
        return self.outcome in (CommitOutcome.COMMITTED, CommitOutcome.ALREADY_COMMITTED)


@dataclass(frozen=True)
class PreparedBatch(Generic[HandleT]):
    """What :meth:`TwoPhaseCommitSink.prepare_batch` pre-committed: the batch's handles and its
    row count."""

    handles: list[HandleT]
    rows: int


class TwoPhaseCommitSink(ABC, Generic[TxnT, HandleT]):
    """Base class of every exactly-once sink.

    Subclasses set :attr:`kind` (a short name, also the key in the config
    registry) and implement the abstract methods.  A sink object is built on
    the driver and shipped to executors by pickling, so it must hold only
    configuration until an executor-side method opens a connection.

    **Runs on executors:** :meth:`begin_transaction`, :meth:`write`,
    :meth:`pre_commit`, :meth:`abort`.

    **Runs on the driver** (or in an operator tool, from a config, without
    Spark): :meth:`open`, :meth:`plan_batch`, :meth:`commit`,
    :meth:`recover_and_commit`, :meth:`recover_and_abort`, :meth:`abort_lingering`,
    :meth:`to_config` / :meth:`from_config`.
    """

    #: Registry name, and the ``sink`` field of every handle envelope.
    kind: ClassVar[str] = ""
    #: The handle format written by this version.
    handle_version: ClassVar[int] = 1
    #: Every handle format this version can still read (old logs must stay recoverable).
    handle_versions: ClassVar[frozenset[int]] = frozenset({1})
    #: True only if two concurrent attempts of one task cannot both become visible
    #: (attempt-isolated transactions).  The coordinator refuses ``spark.speculation`` otherwise.
    #: A class default that a sink may set per instance (``FileSink(writer="spark")`` does: Spark's
    #: output committer lets one attempt of a task commit); the coordinator reads the instance's.
    supports_speculation: bool = False

    # ------------------------------------------------------------------ driver
    def open(self) -> None:
        """Validate configuration and reachability before the first batch (driver).

        Raise :class:`~twophase.errors.ConfigurationError` for settings that would
        break the guarantee (e.g. ``max_prepared_transactions = 0``).
        """

    def open_for_commit(self) -> None:
        """Get ready to commit or abort handles, where an equal sink's :meth:`open` already checked the
        configuration (driver): the data source form's commit step runs in another process than
        its plan, on a sink built afresh.  Default: :meth:`open`; a sink whose checks cost round
        trips the commits do not need may skip them."""
        self.open()

    def executor_modules(self) -> list[str]:
        """Python modules the executor-side methods import (driver).

        The coordinator imports them on the executors before its first batch on a cluster,
        so that a missing package fails at once, with what to ship, before anything is written.
        """
        return ["pyarrow"]

    def local_paths(self) -> list[str]:
        """Local filesystem paths the executors write to (driver).

        On a cluster every host must see them (a shared mount); the coordinator refuses
        them with a non-local master unless told the storage is shared.
        """
        return []

    def max_parallelism(self) -> int | None:
        """The most transactions one batch may open at this target, or None for no limit (driver).

        Asked after :meth:`open`.  The coordinator writes a batch with at most this many
        tasks (PostgreSQL: ``max_prepared_transactions`` bounds prepared transactions).
        """
        return None

    def plan_batch(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """Return the INTENT payload for a batch (driver): what transactions it may open.

        ``num_partitions`` is the number of Spark partitions (tasks) the batch runs
        with; partition ids are ``0 .. num_partitions-1``.

        Logged before any executor runs, and handed back to executors in
        :attr:`TransactionContext.intent` and to :meth:`abort_lingering`, so that
        recovery can find exactly the leftovers of this batch.  Must be JSON and
        secret-free.  Default: nothing beyond the batch identity.
        """
        return {}

    def plan_batch_job(self, query_name: str, batch_id: int, num_partitions: int) -> dict[str, Any]:
        """:meth:`plan_batch` for a ballot of a batch job (driver): ``Coordinator.write`` or
        ``df.write.format("twophase-*")``, whose batch ids the job picks itself.

        Two runs of one batch job may overlap (a backfill of an older id beside a run of a newer
        one, or a re-run beside a paused earlier run), where a streaming query's batches follow one
        another.  A sink whose plan hands out names that a later ballot reuses can give each batch
        job ballot names of its own here (KafkaSink: transactional ids no other ballot names).
        Default: :meth:`plan_batch`.
        """
        return self.plan_batch(query_name, batch_id, num_partitions)

    def prepare_batch(self, df: Any, ctx: BatchContext) -> PreparedBatch[HandleT] | None:
        """Pre-commit the whole batch with a Spark job of the sink's own (driver); None: not this way.

        The second way to write a sink.  Instead of per-task transactions
        (:meth:`begin_transaction` ... :meth:`pre_commit` in a Spark task per
        partition), the coordinator hands the batch's DataFrame to this method, which
        runs one Spark action (e.g. ``df.write.format(...).save(staging)``, where
        Spark's own output committer deals with task retries and speculation) and
        returns the handles of what it left durable but invisible.  The same rules as
        :meth:`pre_commit` hold for each handle; everything an interrupted call leaves
        behind must be found by :meth:`abort_lingering` from ``ctx.intent``.  Called after
        the INTENT is logged; the decision (PREPARED) is logged only after it returns.
        Default: None, so the coordinator runs the per-task transactions.
        """
        return None

    def prepares_batches(self) -> bool:
        """Whether :meth:`prepare_batch` takes batches over (driver): then the coordinator never
        writes a batch from the driver's own sink object (``task_input="driver"``), whose
        transactions would bypass it.  Default: whether the class overrides :meth:`prepare_batch`;
        a sink that does so only in some configurations answers for itself."""
        return type(self).prepare_batch is not TwoPhaseCommitSink.prepare_batch

    def plan_superseded(self, intent: dict[str, Any]) -> bool:
        """Whether a plan made after ``intent``'s (by :meth:`plan_batch`, in any process) now keeps
        that ballot's tasks from writing (driver).

        Asked only after a ballot of the log's owner failed before its decision.  A sink whose
        plans share one fence at the target (KafkaSink's plan fence: a task refuses to claim a
        transactional id once a newer plan exists) answers True when the fence has moved past
        ``intent``.  Then the failure was not the batch's own: a deposed coordinator's plan,
        made before its INTENT was refused (paused, or its request held on the network), moved
        the fence after the owner's.  The owner then plans the batch again and runs it in a new
        ballot, instead of failing the query.  Default: False (plans of other ballots never
        stop this one's tasks).
        """
        return False

    def verify_prepared(self, batch_id: int, handles: list[HandleT], *, prepare_started_at: float) -> None:
        """Check that every pre-committed transaction of a batch can still be committed (driver).

        Called after the executors returned their handles and *before* the decision
        (PREPARED) is logged.  A sink whose target can abort a pre-committed
        transaction on its own (Kafka's ``transaction.timeout.ms``) checks here that
        each one is still open and has a safe margin left, and raises
        :class:`~twophase.errors.TwoPhaseError` otherwise: the batch then fails while
        it is undecided (its leftovers are aborted and its replay writes it again),
        instead of being decided and reported as data loss later.  Raise
        :class:`~twophase.errors.TransactionTakenError` when another actor, not the batch's
        own age, aborted a transaction (a late task attempt): the coordinator then runs the
        batch again in a new ballot instead of failing the query.
        ``prepare_started_at`` is the ``time.time()`` at which the batch's executors
        started.  Default: nothing to check.
        """

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any],
                        keep: list[HandleT]) -> int:
        """Abort every transaction this batch's attempts may have left open, except ``keep`` (driver).

        Called before a batch's executors run (with ``keep=[]``: leftovers of a
        crashed attempt) and after its handles are committed (leftovers of failed
        task attempts).  Must be idempotent.  Returns how many it aborted.

        ``intent`` is the plan of the ballot being cleaned up, or ``{}`` for a batch that
        was never planned: after a new log generation started, recovery calls this once
        per replaced generation with that generation's query name and its last batch + 1,
        so that a sink that also sweeps what late task attempts left of a query's *earlier*
        batches finds the old generation's leftovers too.  With ``{}``, what is open under
        ``batch_id`` itself may be a paused coordinator's ballot, still to be decided:
        leave it, or abort it only through a fence the decision must pass (PostgresSink
        dooms a gid in its claims table before it rolls it back).

        A sink whose method also takes the keyword ``settled`` (a
        :class:`twophase.evidence.Settled`) is given it by the protocol: the log's evidence
        for anything of *other* batches this call destroys (a sweep of earlier batches' staged
        files, a prune of marker rows): only batches it names finished (COMMITTED, or pruned after
        it) may be touched, never by batch-id order (a backfill of an older id may be running).
        ``None``: no evidence at hand; touch nothing of other batches (docs/design.md, "What may
        justify a destructive action").
        """
        return 0

    def sweep_late(self, query_name: str, batch_id: int) -> int:
        """Abort what late actors left of this query's *earlier* batches, where a cheap look finds
        it (driver); return how many it aborted.  Default: 0 (nothing to look at).

        Called after batch ``batch_id``'s ballot is opened, before its tasks start (every decided
        batch before it is committed by then), and again after its tasks failed: a late task
        attempt of an earlier batch that pre-committed after that batch's cleanup may hold what
        this batch's tasks need (PostgreSQL: the row locks of an upsert's keys, until
        ``lock_timeout`` fails the task).  Found after a failure, the batch runs again in a new
        ballot instead of failing the query.  The same leftovers :meth:`abort_lingering` also
        removes; only leftovers that cannot be part of a decision still to commit may be touched:
        by a claim the sink holds, or, where the method takes the keyword ``settled``, by the log's
        evidence that their batch is finished (as for :meth:`abort_lingering`).
        """
        return 0

    @abstractmethod
    def commit(self, handle: HandleT) -> CommitResult:
        """Make a pre-committed transaction visible (driver).  Must be idempotent.

        Return ``ALREADY_COMMITTED`` when a previous call did it, ``RETRY_LATER`` for
        transient trouble, ``LOST`` when it can never be committed.  May raise for
        unexpected errors (retried, then the batch fails and its replay retries).
        """

    def recover_and_commit(self, handle: HandleT) -> CommitResult:
        """Commit a handle found in the log after a restart (driver).  Default: :meth:`commit`."""
        return self.commit(handle)

    def recover_and_abort(self, handle: HandleT) -> None:
        """Abort a pre-committed transaction from its handle (driver).  Default: does nothing."""

    # ---------------------------------------------------------------- executor
    @abstractmethod
    def begin_transaction(self, ctx: TransactionContext) -> TxnT:
        """Open a transaction for one partition of one batch (executor)."""

    @abstractmethod
    def write(self, txn: TxnT, batch: pa.RecordBatch) -> None:
        """Add rows to the transaction (executor; Flink's ``invoke``).  Called once per Arrow batch."""

    @abstractmethod
    def pre_commit(self, txn: TxnT) -> HandleT:
        """Make the transaction durable but invisible and return its handle (executor).

        After this returns, the transaction must survive the death of this
        process, and :meth:`commit` on the handle from any other process must
        make it visible.  The handle must be small, JSON-serialisable, secret-free.
        """

    @abstractmethod
    def abort(self, txn: TxnT) -> None:
        """Discard an open (not yet pre-committed) transaction (executor).  Best effort, idempotent."""

    # ----------------------------------------------------------------- handles
    def handle_to_json(self, handle: HandleT) -> dict[str, Any]:
        """Turn a handle into plain JSON data.  Default: the handle is already a dict."""
        return dict(handle)  # type: ignore[call-overload]

    def handle_from_json(self, data: dict[str, Any], version: int) -> HandleT:
        """Rebuild a handle from :meth:`handle_to_json` output of format ``version``."""
        return data  # type: ignore[return-value]

    def encode_handle(self, handle: HandleT) -> dict[str, Any]:
        """The versioned JSON envelope stored in the log."""
        return _handles.encode(self.kind, self.handle_version, self.handle_to_json(handle))

    def decode_handle(self, envelope: Any) -> HandleT:
        """Inverse of :meth:`encode_handle`; refuses other sinks and unknown versions."""
        v, data = _handles.decode(envelope, self.kind, self.handle_versions)
        return self.handle_from_json(data, v)

    def describe_handle(self, handle: HandleT) -> str:
        """A short, secret-free description for messages ("file part-3.parquet", "tid app-0-1 pid 7")."""
        return _handles.dumps(self.handle_to_json(handle))[:300]

    def target(self) -> str:
        """Where this sink's rows land, secret-free ("files s3://bucket/orders", "kafka ... topic t").

        A batch job's identity in its transaction log is its name plus this target (see
        :func:`twophase.log.batch_query_id`): two batch jobs that share one log are refused by it,
        instead of the second finding the first one's batch ids committed and writing nothing.
        Default: the sink's kind and a digest of :meth:`to_config` (or the class name where there is
        no config); override it with the target alone, so that a setting changed between two runs
        of one job does not make it another job.
        """
        import hashlib
        import json

        label = self.kind or type(self).__qualname__
        try:
            cfg = self.to_config()
        except Exception:  # noqa: BLE001 - no config: the class is all we know
            return label
        return f"{label} {hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode()).hexdigest()[:12]}"

    # ------------------------------------------------------------------ config
    def to_config(self) -> dict[str, Any]:
        """A plain dict from which :meth:`from_config` rebuilds this sink without Spark.

        Secrets appear only by reference (``{"env": "VAR"}``), never by value.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot be rebuilt from a config")

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> TwoPhaseCommitSink[Any, Any]:
        params = {k: v for k, v in config.items() if k != "sink"}
        return cls(**params)


_TAKES_SETTLED: dict[tuple[type, str], bool] = {}


def _with_settled(sink: TwoPhaseCommitSink[Any, Any], name: str, settled: Settled | None) -> dict[str, Any]:
    """``{"settled": settled}`` where the sink's method ``name`` takes that keyword, else ``{}`` (a
    user's sink written against the older signature keeps working)."""
    key = (type(sink), name)
    takes = _TAKES_SETTLED.get(key)
    if takes is None:
        import inspect

        try:
            takes = "settled" in inspect.signature(getattr(sink, name)).parameters
        except (TypeError, ValueError):
            takes = False
        _TAKES_SETTLED[key] = takes
    return {"settled": settled} if takes and settled is not None else {}


def abort_lingering(sink: TwoPhaseCommitSink[Any, Any], query_name: str, batch_id: int, intent: dict[str, Any],
                    keep: list[Any], settled: Settled | None) -> int:
    """``sink.abort_lingering``, with the log's evidence (``settled``) where the sink's method takes it."""
    method: Any = sink.abort_lingering
    return int(method(query_name, batch_id, intent, keep, **_with_settled(sink, "abort_lingering", settled)))


def sweep_late(sink: TwoPhaseCommitSink[Any, Any], query_name: str, batch_id: int, settled: Settled | None) -> int:
    """``sink.sweep_late``, with the log's evidence (``settled``) where the sink's method takes it."""
    method: Any = sink.sweep_late
    return int(method(query_name, batch_id, **_with_settled(sink, "sweep_late", settled)))
