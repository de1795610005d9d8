"""Exceptions raised by twophase.  Every message names the batch, the handle or the file
involved and what the user can do; none carries a secret."""

from __future__ import annotations


class TwoPhaseError(Exception):
    """Base class of every error twophase raises on purpose."""


class ConfigurationError(TwoPhaseError):
    """A setting would break the exactly-once guarantee or cannot work (raised before any write)."""


class MissingDependencyError(TwoPhaseError, ImportError):
    """An optional dependency is not installed; the message names the ``pip install`` that fixes it."""


class HandleError(TwoPhaseError):
    """A transaction handle cannot be decoded (unknown version, wrong sink, malformed)."""


class LogError(TwoPhaseError):
    """The transaction log cannot be used."""


class LogUnavailableError(LogError):
    """The log's store did not answer a write (a timeout, a refused connection, a server error).

    Whether the record landed is unknown; nothing is assumed: the batch's next run (or
    ``twophase recover``) reads the record's slot again, and a decision that did land is committed."""


class CorruptLogError(LogError):
    """A log record is unreadable or fails its checksum.  The job stops; the record is never skipped."""


class LogOwnershipError(LogError):
    """Another coordinator owns this log (or owns a newer epoch of it): this one must not commit."""


class PrunedBatchError(LogError):
    """A batch id committed long ago, whose records were pruned (the log keeps which ones).

    Writing it again would duplicate it, so it is refused (idempotence must not end at the
    retention window)."""


class QueryMismatchError(LogError):
    """The log belongs to another streaming query (a deleted or replaced checkpoint)."""


class CommitError(TwoPhaseError):
    """Committing a pre-committed transaction failed after retries; replaying the batch retries it."""


class TransactionTakenError(TwoPhaseError):
    """Before a batch's decision: one of its pre-committed transactions was aborted by another
    actor at the target (a late task attempt initialising the same transactional id), not by the
    transaction's own timeout.

    Nothing of the batch is decided or visible, and the next ballot plans afresh, so the
    coordinator closes the ballot and runs the batch again in a new one (at most twice in one
    call) instead of failing the query; raised again after that."""


class DataLossError(TwoPhaseError):
    """A transaction whose commit was decided can no longer be committed (expired, aborted, fenced)."""

    def __init__(self, message: str, *, batch_id: int | None = None, handle: object = None,
                 reason: str | None = None):
        super().__init__(message)
        self.batch_id = batch_id
        self.handle = handle
        self.reason = reason

    #: The log generation of the decided batch, when known (recovery sets it).
    generation: int | None = None


class BatchVanishedError(DataLossError):
    """Every transaction of a decided batch is gone and the target proves none of it ever became
    visible (each one aborted or rolled back by the target, none committed).

    Nothing of the batch is visible, so it can run again instead of being lost: the coordinator
    voids the decision and re-runs the batch when Spark replays it (the batch it is running), in
    both forms; ``twophase recover`` voids a decision of the query's current generation and leaves
    the batch to the query's replay.  Elsewhere (an older generation's batch, which Spark never
    replays) it is reported like any data loss, with that advice."""

    generation: int | None = None  # the decided ballot, when known
    ballot: int | None = None
