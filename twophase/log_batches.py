"""Batch records in the transaction log (:class:`twophase.log.TransactionLog`): read and written.

Each record is created atomically and never overwritten (:meth:`~_Batches.write`): a ballot's
INTENT, its decision slot (:meth:`~_Batches.decide` with the commit decision,
:meth:`~_Batches.close_ballot` with an abort), a decision proved void
(:meth:`~_Batches.void_ballot`), and the batch's COMMITTED record; and read back one by one
(:meth:`~_Batches.record`) or a batch, or a generation, at a time (:meth:`~_Batches.view`,
:meth:`~_Batches.views`).
A part of ``TransactionLog`` (its ``__init__`` in :mod:`twophase.log` sets the state it uses).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from twophase.errors import (
    CorruptLogError,
    LogError,
    LogOwnershipError,
    LogUnavailableError,
    PrunedBatchError,
    TwoPhaseError,
)
from twophase.log_records import (
    ABORT,
    COMMIT,
    COMMITTED,
    INTENT,
    PREPARED,
    STATES,
    VOID,
    Ballot,
    BatchRecord,
    BatchView,
    _advice,
    _batch_name,
    encode_record,
    parse_batch_name,
)

if TYPE_CHECKING:
    from twophase.storage import LogStore


class _Batches:
    """:class:`~twophase.log.TransactionLog`'s batch records: ballots, decisions, views."""

    if TYPE_CHECKING:  # set by TransactionLog.__init__ (twophase/log.py), and other parts' methods it calls
        url: str
        store: LogStore
        retain_batches: int
        owner: str
        epoch: int | None
        generation: int | None

        def _read(self, name: str, state: str = "", batch_id: int | None = None) -> dict[str, Any] | None: ...

        def _require_owner(self) -> None: ...

        def generations(self) -> list[dict[str, Any]]: ...

        def is_pruned(self, batch_id: int, generation: int | None = None, *, fresh: bool = False) -> bool: ...

        def low_water(self, generation: int | None = None, *, fresh: bool = False) -> int | None: ...

    # -- batches
    def record(self, batch_id: int, state: str, generation: int | None = None,
               ballot: int = 0) -> BatchRecord | None:
        g = generation if generation is not None else self.generation
        if g is None:
            raise LogError("no log generation selected")
        name = _batch_name(g, batch_id, state, ballot)
        body = self._read(name, state, batch_id)
        if body is None:
            return None
        if body.get("batch_id") != batch_id or body.get("state") != state or int(body.get("ballot", 0)) != ballot:
            raise CorruptLogError(f"transaction log record {self.store.location(name)} names batch "
                                  f"{body.get('batch_id')} state {body.get('state')}: a file was moved or "
                                  f"renamed by hand. {_advice(state, batch_id)}")
        return BatchRecord(batch_id, state, body, self.store.location(name))

    def state(self, batch_id: int) -> BatchRecord | None:
        """The most advanced record of a batch (COMMITTED > PREPARED > INTENT), or None.

        Raises :class:`PrunedBatchError` for a batch without records at or below the
        low-water mark: it was committed and pruned, and must never be written again.
        """
        view = self.view(batch_id)
        if view.committed is not None:
            decision = view.decision
            if decision is not None:
                view.committed.body.setdefault("handles", decision.handles)
            return view.committed
        if view.decision is not None:
            return view.decision
        for b in reversed(view.ballots):
            if b.intent is not None:
                return b.intent
        if not view.ballots:
            self.refuse_pruned(batch_id)
        return None

    def refuse_pruned(self, batch_id: int, *, fresh: bool = False) -> None:
        """Raise :class:`PrunedBatchError` if ``batch_id`` was committed and its records pruned
        (``fresh``: read what was pruned from the store, not this object's cache)."""
        if self.is_pruned(batch_id, fresh=fresh):
            raise PrunedBatchError(
                f"batch {batch_id} of {self.url} (generation {self.generation}) was committed and its records "
                f"pruned (retain_batches={self.retain_batches}, low-water mark {self.low_water()}). Writing it "
                "again would duplicate it, so it is refused. A re-run of an old job needs a batch id that "
                "was never committed; a streaming query restored from an old copy of its checkpoint would "
                "write these batches again: start it from a new checkpoint at the offsets 'twophase offsets' "
                "prints (a new query, with new_generation=True if it keeps this log).")

    def view(self, batch_id: int, generation: int | None = None) -> BatchView:
        """Every record of batch ``batch_id`` (one listing of the generation's folder)."""
        g = generation if generation is not None else self.generation
        if g is None:
            raise LogError("no log generation selected")
        return self.views(g, only=batch_id).get(batch_id) or BatchView(batch_id, g, [], None)

    def views(self, generation: int, only: int | None = None,
              skip_committed: bool = False) -> dict[int, BatchView]:
        """Every batch of a generation as a :class:`BatchView` (``only``: just that batch;
        ``skip_committed``: batches with a COMMITTED record are left out unread)."""
        found: dict[int, dict[tuple[str, int], str]] = {}
        for n in self.store.list(f"g{generation:04d}"):
            parsed = parse_batch_name(n)
            if parsed is None or (only is not None and parsed[0] != only):
                continue
            found.setdefault(parsed[0], {})[(parsed[1], parsed[2])] = n
        out: dict[int, BatchView] = {}
        for bid in sorted(found):
            names = found[bid]
            if skip_committed and (COMMITTED, 0) in names:
                continue
            committed = self.record(bid, COMMITTED, generation) if (COMMITTED, 0) in names else None
            numbers = sorted({b for (st, b) in names if st != COMMITTED})
            ballots = [Ballot(b, self.record(bid, INTENT, generation, b) if (INTENT, b) in names else None,
                              self.record(bid, PREPARED, generation, b) if (PREPARED, b) in names else None,
                              self.record(bid, VOID, generation, b) if (VOID, b) in names else None)
                       for b in numbers]
            out[bid] = BatchView(bid, generation, ballots, committed)
        return out

    def write(self, batch_id: int, state: str, payload: dict[str, Any],
              generation: int | None = None, ballot: int = 0) -> BatchRecord:
        """Atomically create a batch record.  If it already exists, return the existing one
        (compare :meth:`mine`).

        ``ballot``: which execution of the batch (INTENT and PREPARED only).  A PREPARED
        record is a ballot's decision slot: use :meth:`decide` and :meth:`close_ballot`.
        ``generation``: an older generation's batch (recovery finishes decided batches
        of every generation).
        """
        if state not in STATES and state != VOID:
            raise ValueError(state)
        if ballot and state == COMMITTED:
            raise ValueError("COMMITTED is per batch, not per ballot")
        self._require_owner()
        g = generation if generation is not None else self.generation
        body = dict(payload, batch_id=batch_id, state=state, epoch=self.epoch, generation=g,
                    written_at=time.time(), writer=self.owner)
        if ballot:
            body["ballot"] = ballot
        name = _batch_name(g or 0, batch_id, state, ballot)
        try:
            created = self.store.create(name, encode_record(body))
        except TwoPhaseError:
            raise
        except Exception as e:  # the store's own error (botocore, fsspec, OSError): name what was written
            what = {PREPARED: "decision", INTENT: "INTENT", COMMITTED: "COMMITTED record"}.get(state, state)
            if state == PREPARED and body.get("outcome") == ABORT:
                what = "abort (the close of a ballot)"
            raise LogUnavailableError(
                f"batch {batch_id}: the {what} could not be written to {self.store.location(name)}: "
                f"{type(e).__name__}: {str(e)[:300]}. Whether it landed is unknown; nothing is assumed: "
                "the batch's next run, or 'twophase recover', reads its slot again (a decision that "
                "landed is committed, never aborted)") from e
        if not created:
            existing = self.record(batch_id, state, generation=g, ballot=ballot)
            if existing is None:
                # Another writer's record was there and is gone, or the owner's prune swept this
                # writer's temp file: the batch was committed and its records pruned meanwhile, so
                # this writer is behind it (deposed, or late).
                raise LogOwnershipError(
                    f"{self.store.location(name)} could not be created by this coordinator (epoch {self.epoch}) "
                    "and is not there now: the batch was committed and its records pruned meanwhile; this one "
                    "stops")
            return existing
        return BatchRecord(batch_id, state, body, self.store.location(name))

    def mine(self, rec: BatchRecord) -> bool:
        """Did this log object write ``rec`` (as opposed to finding another writer's record)?"""
        return rec.body.get("writer") == self.owner

    def decide(self, batch_id: int, ballot: int, payload: dict[str, Any]) -> BatchRecord:
        """Fill ballot ``ballot``'s decision slot with the commit decision ``payload``.

        Returns the record in the slot: this one, or one written first by someone else
        (an abort that closed the ballot, when :meth:`mine` is False).
        """
        return self.write(batch_id, PREPARED, dict(payload, outcome=COMMIT), ballot=ballot)

    def close_ballot(self, batch_id: int, ballot: int, reason: str, generation: int | None = None) -> BatchRecord:
        """Close ballot ``ballot``'s decision slot with "abort" (before its transactions are aborted).

        Returns the record in the slot: the abort (this one or an earlier one), or a commit
        decision that was written first, which then stands and must be committed.
        """
        return self.write(batch_id, PREPARED, {"outcome": ABORT, "reason": reason[:500], "handles": []},
                          generation=generation, ballot=ballot)

    def void_ballot(self, batch_id: int, ballot: int, reason: str) -> BatchRecord:
        """Record that ballot ``ballot``'s commit decision is void: the sink proved every
        transaction it names gone, none of it visible (:class:`~twophase.errors.BatchVanishedError`).

        The ballot then counts as closed, and the batch is run again in a new ballot.  Safe
        against a late committer of the same decision: a transaction the target aborted can
        never commit.  Idempotent (exclusive create; an existing record is returned).
        """
        return self.write(batch_id, VOID, {"reason": reason[:500]}, ballot=ballot)

    def batches(self, generation: int | None = None) -> dict[int, dict[str, BatchRecord]]:
        """Every batch record of a generation, by batch id and state."""
        g = generation if generation is not None else self.generation
        if g is None:
            gens = self.generations()
            if not gens:
                return {}
            g = int(gens[-1]["generation"])
        out: dict[int, dict[str, BatchRecord]] = {}
        for bid, view in self.views(g).items():
            states: dict[str, BatchRecord] = {}
            if view.committed is not None:
                states[COMMITTED] = view.committed
            if view.decision is not None:
                states[PREPARED] = view.decision
            intents = [b.intent for b in view.ballots if b.intent is not None]
            if intents:
                states[INTENT] = intents[-1]
            if states:
                out[bid] = states
        return out

    def name_for(self, batch_id: int) -> str:
        """The coordinator name that wrote a batch's records (its INTENT's ``name``), for recovery."""
        rec = self.record(batch_id, INTENT)
        if rec is not None and rec.body.get("name"):
            return str(rec.body["name"])
        gens = [g for g in self.generations() if g["generation"] == self.generation]
        return str(gens[0].get("name", "twophase")) if gens else "twophase"

    def last_committed(self, generation: int | None = None) -> BatchRecord | None:
        batches = self.batches(generation)
        for bid in sorted(batches, reverse=True):
            if COMMITTED in batches[bid]:
                rec = batches[bid][COMMITTED]
                if PREPARED in batches[bid]:
                    rec.body.setdefault("handles", batches[bid][PREPARED].handles)
                    rec.body.setdefault("source", batches[bid][PREPARED].body.get("source"))
                return rec
        return None

