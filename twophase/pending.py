"""What recovery finds pending in a transaction log: every batch that is not COMMITTED.

:func:`pending_batches` reads a log's batches without a COMMITTED record, each as a
:class:`PendingBatch` (decided or not) with its ballots (:class:`BallotInfo`), for the routine
in :mod:`twophase.recovery` (:func:`~twophase.recovery.recover_pending`: the coordinator's
recovery, ``twophase recover``) and for ``twophase offsets``.  Read-only: nothing here writes to
the log.  Runs on the driver (or in the ``twophase`` command).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from twophase.log import ABORT, COMMIT, BatchView, TransactionLog


# ------------------------------------------------------------------ what is pending
@dataclass
class BallotInfo:
    """One ballot (execution) of a pending batch, as recovery needs it."""

    ballot: int
    name: str                          # the query name its transactions were opened under
    intent: dict[str, Any]
    outcome: str | None                # "commit", "abort", or None while open
    epoch: int | None = None           # the coordinator epoch that opened it (its INTENT's)


@dataclass
class PendingBatch:
    """A batch of the log that is not COMMITTED: decided (``handles`` set) or not (``None``).

    ``name``/``intent`` are the decided ballot's (else the latest ballot's); ``ballots`` lists
    every ballot of the batch (empty for a harness' model, which has one implicit ballot).
    """

    generation: int
    batch_id: int
    name: str                          # the query name its transactions were opened under
    intent: dict[str, Any]
    sink_kind: str | None              # the INTENT's sink kind (None for records without one)
    handles: list[dict[str, Any]] | None = None  # the decision's handle envelopes
    decided_at: float | None = None
    ballot: int = 0                    # the decided ballot (else the latest)
    ballots: list[BallotInfo] = field(default_factory=list)
    #: Committed, then its records pruned (see :meth:`TransactionLog.pruned`): the records found now
    #: are a deposed coordinator's late writes (a decision among them is never committed: its
    #: transactions are aborted, its records forgotten).
    pruned: bool = False

    @property
    def decided(self) -> bool:
        return self.handles is not None

    @property
    def label(self) -> str:
        return f"batch {self.batch_id} (generation {self.generation})"


def pending_batches(tlog: TransactionLog, generations: list[int] | None = None) -> list[PendingBatch]:
    """Every batch of the log that is not COMMITTED, of every generation, oldest first.

    Reads only the records of batches without a COMMITTED record (one listing per
    generation), so it stays cheap on logs that keep many committed batches.
    """
    if generations is None:
        generations = [int(g["generation"]) for g in tlog.generations()]
    out: list[PendingBatch] = []
    for g in sorted(generations):
        default_name = _generation_name(tlog, g)
        views = tlog.views(g, skip_committed=True)
        pruned = tlog.pruned(g, fresh=True) if views else []
        for view in views.values():
            pb = pending_from_view(view, default_name)
            if pb is not None:
                pb.pruned = any(a <= pb.batch_id <= b for a, b in pruned)
                out.append(pb)
    return out


def pending_from_view(view: BatchView, default_name: str) -> PendingBatch | None:
    """The :class:`PendingBatch` of a batch's records, or None when it is COMMITTED or has none."""
    if view.committed is not None or not view.ballots:
        return None
    infos = []
    for b in view.ballots:
        # A decision proved void counts as closed: its names are garbage, like an abort's.
        outcome = None if b.decision is None else (COMMIT if b.committed else ABORT)
        epoch = None if b.intent is None or b.intent.body.get("epoch") is None else int(b.intent.body["epoch"])
        infos.append(BallotInfo(b.ballot, str(b.name or default_name), b.plan, outcome, epoch))
    decided = next((b for b in view.ballots if b.committed), None)
    main = decided or view.ballots[-1]
    kinds = [b.intent.body.get("sink") for b in view.ballots if b.intent is not None]
    return PendingBatch(
        generation=view.generation, batch_id=view.batch_id, name=str(main.name or default_name),
        intent=main.plan, sink_kind=kinds[-1] if kinds else None,
        handles=decided.decision.handles if decided is not None and decided.decision is not None else None,
        decided_at=decided.decision.written_at if decided is not None and decided.decision is not None else None,
        ballot=main.ballot, ballots=infos)


def _generation_name(tlog: TransactionLog, generation: int) -> str:
    for g in tlog.generations():
        if int(g["generation"]) == generation:
            return str(g.get("name") or "twophase")
    return "twophase"
