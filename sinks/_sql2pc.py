"""What the SQL sinks (PostgreSQL's prepared transactions, MySQL's and MariaDB's XA) share: how a
transaction of one task attempt of one ballot is named, how a leftover is told to be this ballot's
or a late one of an earlier batch, the marker row that proves a commit, and upsert planning.

Names: ``{gid_prefix}:{query}:{batch}:{ballot token}:`` is a ballot's prefix (``plan_batch`` draws
the token once per INTENT), then ``{partition}:{attempt}.{task attempt id}[:{run}]`` names one
task attempt.  Only ``_safe`` characters (no ``:``) go into the query part, so a leftover's query
and batch are read back from its name alone.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from twophase.errors import TwoPhaseError

MAX_RUN_CHARS = 16  # a longer (or not name-safe) TransactionContext.run goes in as a digest
MAX_TASK_ATTEMPT_ID = 2 ** 63 - 1  # Spark's taskAttemptId() is a Long
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")

#: The marker row written inside each transaction, in this order (PostgreSQL's ``gid`` column is
#: MySQL's ``gtrid`` and ``bqual`` pair).
MARKER_COLUMNS = ("query_name", "batch_id", "partition_id", "attempt", "target_table", "row_count")


def safe(s: str) -> str:
    return _SAFE.sub("_", s)


def run_token(run: str) -> str:
    """``run`` as it goes into a name: itself if short and name-safe, else a stable digest of it."""
    if not run or (len(run) <= MAX_RUN_CHARS and safe(run) == run):
        return run
    return "h" + hashlib.sha1(run.encode()).hexdigest()[:MAX_RUN_CHARS - 1]


def attempt_part(attempt: int, task_attempt_id: int | None) -> str:
    """``{attempt}.{task attempt id}``, or ``{attempt}`` where the task attempt id is not known."""
    if task_attempt_id is None or task_attempt_id < 0:
        return f"{int(attempt)}"
    return f"{int(attempt)}.{int(task_attempt_id)}"


def attempt_name(attempt: int, task_attempt_id: int | None, run: str) -> str:
    """``{attempt}[.{task attempt id}][:{run}]``: one task attempt of one execution of a batch."""
    a = attempt_part(attempt, task_attempt_id)
    return f"{a}:{run_token(run)}" if run else a


def batch_of(query_head: str, name: str) -> int | None:
    """The batch number of a name under ``query_head`` (``{gid_prefix}:{query}:``), or None.

    The query part is matched whole, up to its ``:``, so ``q.1`` never reads as query ``q``; the
    batch is the digits before the next ``:``."""
    if not name.startswith(query_head):
        return None
    m = re.match(r"([0-9]+):", name[len(query_head):])
    return int(m.group(1)) if m else None


def split_leftovers(names: Iterable[str], *, ballot_prefix: str, query_head: str, batch_id: int,
                    keep: Iterable[str] = ()) -> tuple[list[str], list[str]]:
    """Leftovers found open at the target, sorted into ``(this ballot's, late ones of earlier batches)``.

    This ballot's: names under ``ballot_prefix`` not in ``keep``.  Late: names of this query whose batch
    is below ``batch_id`` (every decided batch before it is committed by then, so such a name is a late
    task attempt's and in no decision still to commit).  Later batches, other queries and ``keep`` are
    never returned."""
    kept = set(keep)
    own, late = [], []
    for name in names:
        if name in kept:
            continue
        if name.startswith(ballot_prefix):
            own.append(name)
        else:
            b = batch_of(query_head, name)
            if b is not None and b < int(batch_id):
                late.append(name)
    return own, late


def claims_name(marker_table: str, max_bytes: int) -> str:
    """The claims table's name: ``{marker_table}_claims``, or, where that would pass the server's
    identifier limit (PostgreSQL 63 bytes, MySQL 64 characters) and be cut or refused, a shortened
    marker name and a digest of the whole one."""
    name = f"{marker_table}_claims"
    if len(name.encode()) <= max_bytes:
        return name
    head = marker_table.encode()[:max_bytes - 14].decode(errors="ignore")
    return f"{head}_{hashlib.sha1(marker_table.encode()).hexdigest()[:6]}_claims"


_ATTEMPT_RE = re.compile(r"([0-9]+)(?:\.([0-9]+))?:(.+)")


def earlier_attempts(candidates: Iterable[tuple[Any, str]], *, attempt: int, task_attempt_id: int | None,
                     run: str) -> list[Any]:
    """Of ``(key, attempt name)`` pairs (the names of one partition of one ballot found prepared),
    the keys a retried task attempt may take for its own earlier attempts (to claim ``doomed``,
    then roll back): for each attempt number below ``attempt``, of the same ``run`` (its
    :func:`run_token`), the one with the highest task attempt id below ``task_attempt_id``.  Not
    knowing its own task attempt id, the lower attempts of the old form (no id) instead.  Names
    without a run, of another run, with higher ids, or lower ids of the same number (attempts of an
    older stage attempt, maybe the result Spark accepted) are never returned.  See
    ``PostgresSink._roll_back_earlier_attempts`` for why, and why it is only a guess that a claim fences.
    """
    token = run_token(run)
    own_id = task_attempt_id if task_attempt_id is not None else -1
    old_form: list[Any] = []
    latest: dict[int, tuple[int, Any]] = {}  # attempt number -> (task attempt id, key)
    for key, name in candidates:
        m = _ATTEMPT_RE.fullmatch(name)
        if not m or m.group(3) != token or int(m.group(1)) >= attempt:
            continue
        number, tid = int(m.group(1)), None if m.group(2) is None else int(m.group(2))
        if own_id < 0:
            if tid is None:
                old_form.append(key)
        elif tid is not None and tid < own_id and (number not in latest or latest[number][0] < tid):
            latest[number] = (tid, key)
    return sorted(old_form + [k for _, k in latest.values()])


def refuse_undecidable(batch_id: int, total: int, doomed: list[str], gone: list[str], *, where: str,
                       what: str) -> None:
    """:meth:`verify_prepared`'s verdict: raise (nothing decided) if a retried task doomed some of the
    batch's ``total`` prepared ``what`` (claimed first) or some are gone."""

    def some(xs: list[str]) -> str:
        return ", ".join(xs[:5]) + (", ..." if len(xs) > 5 else "")

    why = []
    if doomed:
        why.append(f"{len(doomed)} were doomed by a retried task attempt of their partition, which took "
                   f"each for its own earlier attempt (a resubmitted stage, SPARK-24589) and rolls it back "
                   f"({some(doomed)})")
    if gone:
        why.append(f"{len(gone)} no longer exist at {where} ({some(gone)}): someone rolled them back "
                   "(an operator, or another coordinator cleaning up this batch)")
    if why:
        raise TwoPhaseError(f"batch {batch_id}: of its {total} {what}, {'; '.join(why)}. Nothing was "
                            "decided; restart the query and the batch is written again.")


def marker_values(ctx: Any, target_table: str, rows: int) -> tuple[Any, ...]:
    """The values of :data:`MARKER_COLUMNS` for the transaction of ``ctx`` (a TransactionContext)."""
    return (ctx.query_name, ctx.batch_id, ctx.partition_id, ctx.attempt, target_table, rows)


def prune_below(batch_id: int, retention_batches: int) -> int | None:
    """Marker rows of a query's batches below this may be deleted (None: none yet).  By then the log
    has those batches COMMITTED, so no commit can need their markers."""
    below = int(batch_id) - int(retention_batches)
    return below if below > 0 else None


def prunable_ranges(settled: Any, query_name: str, batch_id: int,
                    retention_batches: int) -> list[tuple[int, int]]:
    """The batch ids whose marker rows a cleanup may delete: those the log shows finished
    (``settled``, a :class:`twophase.evidence.Settled`: COMMITTED, or pruned after it) and below
    ``batch_id - retention_batches``.  Never by batch-id order alone: a backfill's decided batch
    below the current id may still be committing, and its markers are what prove its commits
    (docs/design.md, "What may justify a destructive action").  No evidence (``None``): nothing."""
    below = prune_below(batch_id, retention_batches)
    if below is None or settled is None:
        return []
    return list(settled.ranges_below(query_name, below))


def update_columns(columns: Iterable[str], key_columns: Iterable[str]) -> list[str]:
    """Upsert: the columns an existing row of a key takes from the new one (all but the keys); empty:
    the statement only inserts new keys (``DO NOTHING``, ``INSERT IGNORE``-like)."""
    keys = set(key_columns)
    return [c for c in columns if c not in keys]


class ConnectError(TwoPhaseError):
    """Could not connect (internal: turned into retry_later, ConfigurationError or a task error)."""


def close_quietly(conn: Any) -> None:
    try:
        conn.close()
    except Exception:
        pass


class ConnectionPool:
    """Up to ``size`` idle driver connections, shared by the driver's threads (commits run in
    parallel).  Pickled empty: a sink unpickled on an executor opens its own connections."""

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._idle: list[Any] = []
        self._lock = threading.Lock()

    def take(self, connect: Callable[[], Any], alive: Callable[[Any], bool]) -> Any:
        """An idle connection that ``alive`` accepts (the others are closed), else ``connect()``."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                return connect()
            if alive(conn):
                return conn
            close_quietly(conn)

    def give(self, conn: Any, usable: bool) -> None:
        """Back to the pool if ``usable`` and there is room, else closed."""
        if usable:
            with self._lock:
                if len(self._idle) < self.size:
                    self._idle.append(conn)
                    return
        close_quietly(conn)

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            close_quietly(c)

    def __iter__(self) -> Iterator[Any]:
        with self._lock:
            return iter(list(self._idle))

    def __len__(self) -> int:
        return len(self._idle)

    def __getstate__(self) -> dict[str, Any]:
        return {"size": self.size}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["size"])  # type: ignore[misc]
