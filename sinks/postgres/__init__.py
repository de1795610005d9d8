"""Exactly-once PostgreSQL sink: COPY each partition's rows into a prepared transaction, commit it on the driver.

Executors stream Arrow batches into the target table with ``COPY ... FROM STDIN``
(CSV encoded by Arrow's C++ writer), insert a marker row naming the transaction,
and ``PREPARE TRANSACTION`` under a deterministic gid.  The driver runs ``COMMIT
PREPARED`` after the coordinator logged its decision.

Delivery guarantee: with the coordinator, every row of a batch becomes visible
exactly once (insert mode), or the table ends as if each batch were upserted
once (upsert mode), after any number of driver, executor or server crashes.

How it recovers: a prepared transaction survives the death of the executor, of
the driver and a restart of PostgreSQL; its handle (gid and database) is in the
log and ``COMMIT PREPARED`` can be run from any process.  A second ``COMMIT
PREPARED`` fails with 42704 ("does not exist"); the marker row, written inside
the transaction, then tells "already committed" (present) from "lost" (absent).
Prepared transactions of attempts that never reached the decision are found in
``pg_prepared_xacts`` by the batch's gid prefix and rolled back, promptly,
because they hold their locks until then: by the driver (``abort_lingering``), and
by a retried task for its own earlier attempts of the same run, before it writes.
Who may roll back a gid is settled by one row per gid in a claims table beside the
marker table: a retried task rolls back only a gid it claimed as doomed, and before
the decision the driver claims every returned gid as decided (and checks it is still
prepared); whichever claim comes first wins, so a decided gid is never rolled back.
"""

from twophase.sinks.postgres.columns import encode_csv
from twophase.sinks.postgres.common import (
    MAX_GID_BYTES,
    MAX_RUN_CHARS,
    MAX_TASK_ATTEMPT_ID,
    MODES,
    PostgresWriteError,
    scrub,
)
from twophase.sinks.postgres.common import (
    _claims_name as _claims_name,  # the claims table's name (tests)
)
from twophase.sinks.postgres.sink import PostgresSink
from twophase.sinks.postgres.writer import PostgresTransaction

__all__ = [
    "MAX_GID_BYTES",
    "MAX_RUN_CHARS",
    "MAX_TASK_ATTEMPT_ID",
    "MODES",
    "PostgresSink",
    "PostgresTransaction",
    "PostgresWriteError",
    "encode_csv",
    "scrub",
]
