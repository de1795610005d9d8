"""Exactly-once MySQL / MariaDB sink: each partition's rows in an XA branch, XA COMMIT on the driver.

Executors ``XA START`` a branch named for one attempt of one task of one ballot, write the
partition's rows (insert mode: each Arrow batch by ``LOAD DATA LOCAL INFILE`` of CSV made in memory,
see ``MySqlSink._load``; upsert mode: multi-row ``INSERT ... ON DUPLICATE KEY UPDATE``), insert a
marker row naming the branch, then ``XA END`` and ``XA PREPARE`` and close the connection.  The
driver runs ``XA COMMIT`` on a connection of its own after the coordinator logged its decision.

How it recovers: a prepared XA branch survives the death of the executor, of the driver and a
restart of the server (MariaDB >= 10.5.2, MySQL >= 5.7.7); its handle (gtrid, bqual, database) is in
the log and ``XA COMMIT`` can be run from any session.  A second ``XA COMMIT`` fails with 1397
XAER_NOTA, the same answer as for a branch rolled back: the marker row, written inside the branch,
tells "already committed" (present) from "lost" (absent).  Branches of attempts that never reached
the decision are found by ``XA RECOVER`` and rolled back by the driver (``abort_lingering``), and
so are late attempts' branches of earlier batches (``sweep_late``): they hold their row locks.

Who may roll back a branch is settled by one row per branch in a claims table beside the marker
table (as the PostgreSQL sink's): the driver claims every branch of a batch ``decided`` before the
decision, a retried task claims its earlier attempt's branch ``doomed`` before it rolls it back, and
so do the cleanup and a retried task for a late leftover of an earlier batch; whichever claim comes
first wins, so a decided branch is never rolled back.  On MariaDB a prepared branch stays attached to its preparing session until that
session disconnects (``XA COMMIT`` elsewhere answers 1397 meanwhile): the handle names that session,
and a commit that meets a lingering one kills it (only a connection of the sink's own user).

Names: the XID's gtrid (at most 64 bytes) is the ballot's prefix and the partition,
``{gid_prefix}:{query}:{batch}:{token}:{partition}``; its bqual (at most 64 bytes) is the attempt,
``{attempt}.{task attempt id}[:{run}]`` (see ``sinks/_sql2pc.py``, shared with the PostgreSQL sink).
A query name longer than 24 bytes (or not name-safe) goes into the gtrid as a digest.
"""

# The module's constants, importable from here as before the split (read where they are used:
# a patch of a tuning constant goes to sinks/mysql/common.py and the modules that read it).
from twophase.sinks.mysql.common import (
    DETACH_WAIT_SECONDS,
    ER_LOCK_DEADLOCK,
    ER_LOCK_WAIT_TIMEOUT,
    ER_NO_SUCH_TABLE,
    ER_NO_SUCH_THREAD,
    ER_XA_RBROLLBACK,
    ER_XAER_DUPID,
    ER_XAER_NOTA,
    ER_XAER_OUTSIDE,
    ER_XAER_RMERR,
    ER_XAER_RMFAIL,
    MAX_PLANNED_ATTEMPTS,
    MAX_QUERY_CHARS,
    MAX_XID_PART_BYTES,
    MODES,
    PREPARED_SESSION_IDLE_SECONDS,
    SESSION_GONE_WAIT_SECONDS,
    MySqlTransaction,
    MySqlWriteError,
    query_token,
    quote_ident,
)
from twophase.sinks.mysql.infile import _LOAD_CHUNK, _load_connection_class
from twophase.sinks.mysql.jdbc import sink_from_jdbc_options
from twophase.sinks.mysql.sink import MySqlSink
from twophase.sinks.mysql.values import _csv_options, _csv_table, _py_value

__all__ = ["DETACH_WAIT_SECONDS", "ER_LOCK_DEADLOCK", "ER_LOCK_WAIT_TIMEOUT", "ER_NO_SUCH_TABLE", "ER_NO_SUCH_THREAD", "ER_XAER_DUPID", "ER_XAER_NOTA", "ER_XAER_OUTSIDE", "ER_XAER_RMERR", "ER_XAER_RMFAIL", "ER_XA_RBROLLBACK", "MAX_PLANNED_ATTEMPTS", "MAX_QUERY_CHARS", "MAX_XID_PART_BYTES", "MODES", "PREPARED_SESSION_IDLE_SECONDS", "SESSION_GONE_WAIT_SECONDS",
           "MySqlSink", "MySqlTransaction", "MySqlWriteError", "quote_ident", "query_token",
           "sink_from_jdbc_options", "_LOAD_CHUNK", "_load_connection_class", "_csv_options", "_csv_table",
           "_py_value"]
