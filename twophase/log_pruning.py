"""Retention in the transaction log (:class:`twophase.log.TransactionLog`): what was pruned.

After each commit the records of committed batches but the last ``retain_batches`` are deleted
(:meth:`~_Pruning.prune`); what a generation pruned is kept first, as ranges of batch ids in
files created exclusively, and read back by :meth:`~_Pruning.pruned` (a batch never committed is
never read as pruned; a record found later in a pruned batch is a deposed writer's late write).
A part of ``TransactionLog`` (its ``__init__`` in :mod:`twophase.log` sets the state it uses).
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from twophase.errors import LogError, LogUnavailableError
from twophase.log_records import COMMITTED, encode_record, parse_batch_name, temp_record_name

if TYPE_CHECKING:
    from twophase.storage import LogStore

_LOW_WATER = "low-water.json"      # logs of earlier versions: one mark, every batch up to it pruned (read only)
#: What a generation pruned: files ``<highest batch>-<token>.json``, each created exclusively and never
#: replaced, each holding the ranges of batch ids whose records were deleted after they were
#: committed.  The pruned set is the union of the files: a pruner writes the union it read plus
#: what it prunes, then deletes only the files it read, so nothing pruned is ever forgotten (a
#: deposed pruner's late file only adds batches that were committed).
_LOW_WATER_DIR = "low-water"


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    """Inclusive ``[first, last]`` ranges, sorted and merged."""
    out: list[list[int]] = []
    for a, b in sorted((int(a), int(b)) for a, b in ranges):
        if out and a <= out[-1][1] + 1:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _in(ranges: list[list[int]], batch_id: int) -> bool:
    return any(a <= batch_id <= b for a, b in ranges)


class _Pruning:
    """:class:`~twophase.log.TransactionLog`'s pruned ranges and its prune."""

    if TYPE_CHECKING:  # set by TransactionLog.__init__ (twophase/log.py)
        store: LogStore
        generation: int | None
        epoch: int | None
        retain_batches: int
        _pruned: dict[int, tuple[list[list[int]], frozenset[str]]]
        _legacy_low_water: dict[int, int]

        def _read(self, name: str, state: str = "", batch_id: int | None = None) -> dict[str, Any] | None: ...

    def pruned(self, generation: int | None = None, *, fresh: bool = False,
               at_least: int | None = None) -> list[list[int]]:
        """The ranges ``[first, last]`` of batch ids whose records were pruned after they were committed.

        ``fresh``: list the mark files again instead of trusting this object's cache; with
        ``at_least``, only files that can hold a batch id that high are read (their names carry
        their highest id), so asking about the current batch costs one small listing.  The
        protocol asks afresh after its INTENT and after its decision land: a deposed
        coordinator's late record in a batch whose records were pruned (its slots free again) is
        found that way, since the pruner writes its file before it deletes any record.
        """
        g = generation if generation is not None else self.generation
        if g is None:
            return []
        cached = self._pruned.get(g)
        if cached is not None and not fresh:
            return cached[0]
        folder = f"g{g:04d}/{_LOW_WATER_DIR}"
        ranges = [] if cached is None else list(cached[0])   # never forget what was seen
        done = cached[1] if cached is not None else frozenset()
        for _ in range(100):
            names = frozenset(n for n in self.store.list(folder) if n.endswith(".json") and n[:12].isdigit())
            vanished = False
            for n in sorted(names - done):
                if at_least is not None and int(n[:12]) < at_least:
                    continue  # cannot hold it; read when someone asks about a lower batch
                rec = self._read(f"{folder}/{n}")
                if rec is None:
                    # Deleted since the listing: a pruner folded it into a file it wrote before
                    # deleting it, which a new listing shows.  Never read as "nothing pruned".
                    vanished = True
                    continue
                ranges += [list(r) for r in rec.get("ranges", [])]
                done |= {n}
            if not vanished:
                break
        else:
            raise LogUnavailableError(f"{self.store.location(folder)}: its files kept vanishing between a listing "
                                      "and their reads; what was pruned could not be read")
        if g not in self._legacy_low_water:  # written once by older versions, never again: read once
            rec = self._read(f"g{g:04d}/{_LOW_WATER}")
            self._legacy_low_water[g] = int(rec["batch_id"]) if rec is not None else -1
        if self._legacy_low_water[g] >= 0:
            ranges.append([0, self._legacy_low_water[g]])
        ranges = _merge(ranges)
        self._pruned[g] = (ranges, done)
        return ranges

    def settled_ranges(self, generation: int) -> list[list[int]]:
        """Ranges ``[first, last]`` of the batch ids of a generation the log shows finished: a
        COMMITTED record, or a pruned range (a pruner records only ids it saw COMMITTED).

        The evidence :class:`twophase.evidence.Settled` hands a sink's cleanup.  The listing comes
        first and what was pruned is read afresh after it: a batch whose COMMITTED record a prune
        deleted before the listing is in a pruned range written before that deletion.
        """
        committed = {p[0] for p in map(parse_batch_name, self.store.list(f"g{generation:04d}"))
                     if p is not None and p[1] == COMMITTED}
        return _merge(self.pruned(generation, fresh=True) + [[b, b] for b in committed])

    def is_pruned(self, batch_id: int, generation: int | None = None, *, fresh: bool = False) -> bool:
        """Was ``batch_id`` committed and its records pruned?"""
        return _in(self.pruned(generation, fresh=fresh, at_least=batch_id if fresh else None), batch_id)

    def low_water(self, generation: int | None = None, *, fresh: bool = False) -> int | None:
        """The highest batch id whose records were pruned, or None (for messages and ``status``)."""
        ranges = self.pruned(generation, fresh=fresh)
        return ranges[-1][1] if ranges else None

    def prune(self, committed_batch: int) -> int:
        """Delete the records of committed batches but the last ``retain_batches`` (by batch id).

        ``committed_batch`` is the batch just committed (it is kept).  What is pruned is written
        first, as a file of its own created exclusively (see :meth:`pruned`), then the records
        go; a record found later in a pruned batch is a deposed coordinator's late write, never a
        decision to commit.  Pending batches are never pruned, and a batch id never committed is
        never refused as pruned (a backfill of a date skipped before writes).
        """
        if self.generation is None:
            return 0
        g = self.generation
        folder = f"g{g:04d}"
        listed = self.store.list(folder, hidden=True)  # records, and temp files (swept below)
        names = [n for n in listed if not n.startswith(".")]
        committed = sorted({p[0] for p in map(parse_batch_name, names) if p is not None and p[1] == COMMITTED})
        doomed = set(committed[:-self.retain_batches]) - {committed_batch}
        if not doomed:
            return 0
        marks = f"{folder}/{_LOW_WATER_DIR}"
        ranges = self.pruned(fresh=True)
        read = self._pruned[g][1]
        ranges = _merge(ranges + [[b, b] for b in doomed])
        top = ranges[-1][1]
        self.store.create(f"{marks}/{top:012d}-{uuid.uuid4().hex[:8]}.json", encode_record(
            {"kind": "pruned", "ranges": ranges, "generation": g, "epoch": self.epoch, "at": time.time()}))
        self._pruned[g] = (ranges, read)
        for n in read:  # only files whose ranges the new one holds (another pruner's new file stays)
            self.store.delete(f"{marks}/{n}")
        deleted = 0
        # A driver killed between a record's temp file and its rename left the temp file (hidden:
        # never read as a record).  Those of pruned batches go with their records.  A late writer
        # whose temp file goes here finds it not created and reads the slot (the stores' create);
        # one whose temp file appears after the listing is refused by is_pruned, as before.
        for n in listed:
            stem = temp_record_name(n)
            parsed = parse_batch_name(stem) if stem else None
            if parsed is not None and parsed[0] in doomed:
                self.store.delete(f"{folder}/{n}")
        # Delete the committed marker last, so a crash mid-prune leaves a batch still marked committed.
        for n in sorted(names, key=lambda x: x.endswith(".committed.json")):
            parsed = parse_batch_name(n)
            if parsed is not None and parsed[0] in doomed:
                self.store.delete(f"{folder}/{n}")
                deleted += 1
        return deleted

    def forget_pruned(self, batch_id: int, generation: int | None = None) -> int:
        """Delete the records of a batch at or below the low-water mark (a deposed coordinator's late
        writes, after recovery aborted their transactions).  Refuses any other batch."""
        g = generation if generation is not None else self.generation
        if g is None or not self.is_pruned(batch_id, g, fresh=True):
            raise LogError(f"batch {batch_id} of generation {g} was not pruned: its records are not forgotten")
        n = 0
        for name in self.store.list(f"g{g:04d}"):
            parsed = parse_batch_name(name)
            if parsed is not None and parsed[0] == batch_id:
                self.store.delete(f"g{g:04d}/{name}")
                n += 1
        return n
