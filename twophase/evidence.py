"""What the log proves finished: the evidence a sink's cleanup of *other* batches may rest on.

The rule (docs/design.md, "What may justify a destructive action"): a sweep, an abort, a rollback,
a prune or a void needs a record in the log or a claim the sink itself holds, never batch-id order
and never the absence of evidence that someone else can delete.  Batch jobs pick their own ids (a
backfill of batch 5 may run while a run of batch 11 cleans up), so "every id below the current one
is finished" is false there, however true it is of a streaming query.

:class:`Settled` answers one question for a sink cleaning up: *is batch B of this query finished,
by the log?*  Yes only where the log holds B's COMMITTED record, or a pruned range covers B (a
pruner records only ids it saw COMMITTED, before it deletes anything).  Both are permanent: once
true for a batch it stays true, no ballot of that batch is ever opened again, and what is left
under its names is late attempts' garbage.  A batch the log says nothing of (pending, undecided,
decided but not yet COMMITTED, of another log or of a query name it cannot place) is *not* settled,
and its leftovers are left for a later cleanup that can prove it.

It is lazy (nothing is read until a sink asks) and caches per generation for its own life: one
object per cleanup call.  A stale answer can only be "not settled" (a batch committed after the
read), which leaves garbage for the next cleanup, never deletes what may still be decided.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Protocol


class SettledSource(Protocol):
    """What :class:`Settled` reads: a log (``twophase.log.TransactionLog``) by its id and its
    settled ranges.  A protocol, so that this module, which the sinks import, imports no log."""

    log_id: str

    def settled_ranges(self, generation: int) -> Iterable[Sequence[int]]: ...


class Settled:
    """Which batches of a log's generations are finished (COMMITTED, or pruned after it).

    ``query_name`` is the scoped name sinks are given (``name.<log id[:8]>g<generation>``): its
    suffix says which generation of which log; a name of another log is never settled here.
    """

    def __init__(self, tlog: SettledSource) -> None:
        self._tlog = tlog
        self._scope_re = re.compile(r"\." + re.escape(tlog.log_id[:8]) + r"g(\d+)$")
        self._ranges: dict[int, list[tuple[int, int]]] = {}

    def generation_of(self, query_name: str) -> int | None:
        m = self._scope_re.search(query_name)
        return int(m.group(1)) if m else None

    def ranges(self, query_name: str) -> list[tuple[int, int]]:
        """The settled batch ids of that query's generation, as merged ``(first, last)`` ranges."""
        g = self.generation_of(query_name)
        if g is None:
            return []
        if g not in self._ranges:
            self._ranges[g] = [(int(r[0]), int(r[1])) for r in self._tlog.settled_ranges(g)]
        return self._ranges[g]

    def ranges_below(self, query_name: str, below: int) -> list[tuple[int, int]]:
        """The settled ranges clipped to ids ``< below``."""
        return [(a, min(b, below - 1)) for a, b in self.ranges(query_name) if a < below]

    def __call__(self, query_name: str, batch_id: int) -> bool:
        """Is ``batch_id`` of that query finished, by the log?"""
        return any(a <= batch_id <= b for a, b in self.ranges(query_name))


class NothingSettled(Settled):
    """No evidence at hand (a sink called without a log: the CLI's ``abort-lingering`` on one batch,
    a user's own call): no batch but the one being cleaned up may be touched."""

    def __init__(self) -> None:  # noqa: D107 - no log
        self._ranges = {}

    def generation_of(self, query_name: str) -> int | None:
        return None

    def ranges(self, query_name: str) -> list[tuple[int, int]]:
        return []


class Committed(Settled):
    """Evidence a caller holds already, by name: these batch ids of ``query_name`` are COMMITTED in its
    log (a test, or an operator's own cleanup that read the log itself)."""

    def __init__(self, query_name: str, *batch_ids: int) -> None:  # noqa: D107
        self._ranges = {}
        self._query, self._ids = query_name, sorted(int(b) for b in batch_ids)

    def generation_of(self, query_name: str) -> int | None:
        return None

    def ranges(self, query_name: str) -> list[tuple[int, int]]:
        return [(b, b) for b in self._ids] if query_name == self._query else []
