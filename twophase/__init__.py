"""twophase: exactly-once sinks for PySpark by two-phase commit (Flink's TwoPhaseCommitSinkFunction).

The protocol core: the abstract sink, transaction context and handles, the
transaction log, crash points and config registry.  Sinks live in
``twophase.sinks``, the Spark coordinator in ``twophase.coordinator``, the
conformance harness in ``twophase.testing``.
"""

from twophase.context import BatchContext, TransactionContext
from twophase.errors import (
    CommitError,
    ConfigurationError,
    CorruptLogError,
    DataLossError,
    HandleError,
    LogError,
    LogOwnershipError,
    LogUnavailableError,
    MissingDependencyError,
    PrunedBatchError,
    QueryMismatchError,
    TransactionTakenError,
    TwoPhaseError,
)
from twophase.sink import CommitOutcome, CommitResult, PreparedBatch, TwoPhaseCommitSink

__version__ = "0.1.0"


def register(spark) -> None:
    """Register ``format("twophase-files")``, ``-jdbc`` and ``-kafka`` with ``spark`` (a classic or
    Spark Connect session).  Only needed where Spark does not discover them by itself (an
    editable install hides them from its discovery): see :mod:`twophase.datasource`.  Needs pyspark."""
    from twophase.datasource import register as _register

    _register(spark)

__all__ = [
    "BatchContext",
    "CommitError",
    "CommitOutcome",
    "CommitResult",
    "ConfigurationError",
    "CorruptLogError",
    "DataLossError",
    "HandleError",
    "LogError",
    "LogOwnershipError",
    "LogUnavailableError",
    "MissingDependencyError",
    "PreparedBatch",
    "PrunedBatchError",
    "QueryMismatchError",
    "TransactionContext",
    "TransactionTakenError",
    "TwoPhaseCommitSink",
    "TwoPhaseError",
    "__version__",
    "register",
]
