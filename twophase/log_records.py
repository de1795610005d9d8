"""The transaction log's records (the log itself: :mod:`twophase.log`).

Their states (INTENT, PREPARED, COMMITTED, and VOID), their encoding (canonical JSON with a
SHA-256 checksum) and its validation (a record that cannot be read raises
:class:`~twophase.errors.CorruptLogError` naming the file, with advice on what to do), the names
of batch records in a generation folder (and of the temp files a dead writer left), and what a
reader gets back: :class:`BatchRecord`, a batch's ballots (:class:`Ballot`) and its :class:`BatchView`.
No I/O here: the log reads and writes records through its store.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from twophase.errors import CorruptLogError

FORMAT = "twophase-log"
FORMAT_VERSION = 1

INTENT, PREPARED, COMMITTED = "intent", "prepared", "committed"
#: A decided ballot proved void: every transaction it named is gone and none ever became visible
#: (see :meth:`TransactionLog.void_ballot`).  Its batch runs again in a new ballot.
VOID = "void"
STATES = (INTENT, PREPARED, COMMITTED)
_BALLOT_STATES = (INTENT, PREPARED, VOID)
#: The ``outcome`` of a PREPARED record (a ballot's decision slot).
COMMIT, ABORT = "commit", "abort"


# -------------------------------------------------------------------------- records
def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def encode_record(body: dict[str, Any]) -> bytes:
    digest = hashlib.sha256(_canonical(body)).hexdigest()
    return json.dumps({"format": FORMAT, "version": FORMAT_VERSION, "body": body, "sha256": digest},
                      sort_keys=True, indent=1).encode()


def decode_record(data: bytes, location: str, advice: str) -> dict[str, Any]:
    def corrupt(why: str) -> CorruptLogError:
        return CorruptLogError(f"transaction log record {location} is unreadable ({why}). "
                               f"The job stops rather than skip it. {advice}")

    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(f"not JSON: {e}") from None
    if not isinstance(obj, dict) or obj.get("format") != FORMAT or "body" not in obj:
        raise corrupt("not a twophase log record")
    if obj.get("version") != FORMAT_VERSION:
        raise corrupt(f"record format version {obj.get('version')!r}, this twophase reads {FORMAT_VERSION}")
    body = obj["body"]
    if not isinstance(body, dict) or hashlib.sha256(_canonical(body)).hexdigest() != obj.get("sha256"):
        raise corrupt("checksum mismatch: the file was changed or partly written")
    return body


def _advice(state: str, batch_id: int | None) -> str:
    if state == PREPARED:
        return (f"It holds the commit decision and the transaction handles of batch {batch_id}: do NOT "
                "delete it. Restore it from a backup or a filesystem snapshot; 'twophase status' shows "
                "the other batches. If it cannot be restored, the batch's pre-committed transactions "
                "must be found and committed by hand in the target system.")
    if state == COMMITTED:
        return (f"Batch {batch_id} was fully committed before its PREPARED record; if the PREPARED "
                f"record of batch {batch_id} is intact you may delete this file and restart: the "
                "coordinator re-commits idempotently.")
    if state == INTENT:
        return (f"No commit decision was taken for batch {batch_id} yet; if no PREPARED record exists "
                "for it you may delete this file and restart: the batch is re-run and leftovers of "
                "the crashed attempt are aborted.")
    return "Restore it from a backup, or move the log aside and start a new log generation."


def _batch_name(generation: int, batch_id: int, state: str, ballot: int = 0) -> str:
    if ballot:
        return f"g{generation:04d}/batch-{batch_id:012d}.{state}.{ballot}.json"
    return f"g{generation:04d}/batch-{batch_id:012d}.{state}.json"


def temp_record_name(name: str) -> str | None:
    """The record a store's temp file was to become (``.batch-...json.<uuid hex>.tmp``, the name a
    write leaves when its process dies between the temp file and its rename), else None."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    stem, _, tag = name[1:-4].rpartition(".")
    if len(tag) != 32 or any(c not in "0123456789abcdef" for c in tag):
        return None
    return stem if parse_batch_name(stem) is not None else None


def parse_batch_name(name: str) -> tuple[int, str, int] | None:
    """(batch id, state, ballot) of a record's file name in a generation folder, else None."""
    parts = name.split(".")
    if parts[-1] != "json" or not parts[0].startswith("batch-") or not parts[0][6:].isdigit():
        return None
    if len(parts) == 3 and (parts[1] in STATES or parts[1] == VOID):
        return int(parts[0][6:]), parts[1], 0
    if len(parts) == 4 and parts[1] in _BALLOT_STATES and parts[2].isdigit() and int(parts[2]) > 0:
        return int(parts[0][6:]), parts[1], int(parts[2])
    return None


@dataclass
class BatchRecord:
    batch_id: int
    state: str
    body: dict[str, Any]
    location: str

    @property
    def handles(self) -> list[dict[str, Any]]:
        return list(self.body.get("handles", []))

    @property
    def written_at(self) -> float:
        return float(self.body.get("written_at", 0.0))

    @property
    def ballot(self) -> int:
        return int(self.body.get("ballot", 0))

    @property
    def aborted(self) -> bool:
        """A decision slot closed with "abort" (its ballot's transactions are garbage)."""
        return self.state == PREPARED and self.body.get("outcome") == ABORT


@dataclass
class Ballot:
    """One execution of a batch: its INTENT and its decision slot (None while open)."""

    ballot: int
    intent: BatchRecord | None
    decision: BatchRecord | None
    void: BatchRecord | None = None  # a commit decision proved void (nothing of it exists or was seen)

    @property
    def open(self) -> bool:
        return self.decision is None

    @property
    def committed(self) -> bool:
        """Holds the batch's commit decision (not an abort, not a decision proved void)."""
        return self.decision is not None and not self.decision.aborted and self.void is None

    @property
    def name(self) -> str | None:
        return None if self.intent is None else self.intent.body.get("name")

    @property
    def plan(self) -> dict[str, Any]:
        """The sink's INTENT payload (what the ballot's transactions are named)."""
        return {} if self.intent is None else dict(self.intent.body.get("intent") or {})


@dataclass
class BatchView:
    """Every record of one batch: its ballots (oldest first) and COMMITTED, if written."""

    batch_id: int
    generation: int
    ballots: list[Ballot]
    committed: BatchRecord | None

    @property
    def decision(self) -> BatchRecord | None:
        """The commit decision (at most one ballot of a batch holds one), or None."""
        for b in self.ballots:
            if b.committed:
                return b.decision
        return None

    @property
    def next_ballot(self) -> int:
        return (self.ballots[-1].ballot + 1) if self.ballots else 0
