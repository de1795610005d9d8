"""Recovery without Spark: what ``twophase recover`` and ``twophase abort-lingering`` do.

Both take ownership of the log (a new epoch, so a coordinator still running is
refused or fenced), rebuild the sink from its config, and then either commit
every decided-but-uncommitted batch (``recover``) or only abort what undecided
batches left open (``abort_lingering``).  Both are idempotent.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from twophase.errors import DataLossError, LogError
from twophase.log import COMMITTED, INTENT, PREPARED, TransactionLog
from twophase.sink import CommitOutcome, TwoPhaseCommitSink


@dataclass
class RecoveryReport:
    committed_batches: list[int] = field(default_factory=list)
    handles_committed: int = 0
    handles_already_committed: int = 0
    aborted: dict[int, int] = field(default_factory=dict)
    lost: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"committed_batches": self.committed_batches, "handles_committed": self.handles_committed,
                "handles_already_committed": self.handles_already_committed,
                "aborted": {str(k): v for k, v in self.aborted.items()}, "lost": self.lost}


def _open(log_url: str, storage_options: dict[str, Any] | None, takeover: bool) -> TransactionLog:
    tlog = TransactionLog(log_url, storage_options=storage_options)
    gens = tlog.generations()
    if not gens:
        raise LogError(f"{log_url} holds no log generation: nothing was ever written there")
    latest = gens[-1]
    tlog.acquire(latest["query_id"], "twophase-recover", takeover=takeover)
    return tlog


def recover(log_url: str, sink: TwoPhaseCommitSink[Any, Any], *, storage_options: dict[str, Any] | None = None,
            takeover: bool = False, abort_only: bool = False, ignore_lost: bool = False,
            parallelism: int = 8) -> RecoveryReport:
    """Commit decided batches (unless ``abort_only``) and abort leftovers of undecided ones."""
    tlog = _open(log_url, storage_options, takeover)
    report = RecoveryReport()
    batches = tlog.batches()
    for bid in sorted(batches):
        states = batches[bid]
        if COMMITTED in states:
            continue
        intent = states[INTENT].body.get("intent", {}) if INTENT in states else {}
        if PREPARED in states:
            if abort_only:
                continue
            handles = [sink.decode_handle(e) for e in states[PREPARED].handles]
            # In parallel, as the coordinator does: one round trip per handle otherwise.
            with ThreadPoolExecutor(max_workers=max(1, min(parallelism, len(handles)))) as pool:
                results = list(pool.map(sink.recover_and_commit, handles))
            for h, res in zip(handles, results):
                if res.outcome is CommitOutcome.COMMITTED:
                    report.handles_committed += 1
                elif res.outcome is CommitOutcome.ALREADY_COMMITTED:
                    report.handles_already_committed += 1
                elif res.outcome is CommitOutcome.LOST:
                    report.lost.append({"batch_id": bid, "handle": sink.describe_handle(h), "reason": res.reason})
                    if not ignore_lost:
                        raise DataLossError(f"DATA LOSS: batch {bid}: {sink.describe_handle(h)} can no longer "
                                            f"be committed: {res.reason}", batch_id=bid,
                                            handle=sink.describe_handle(h), reason=res.reason)
                else:
                    raise LogError(f"batch {bid}: {sink.describe_handle(h)}: {res.reason}; run recover again")
            n = sink.abort_lingering(tlog.name_for(bid), bid, intent, handles)
            if n:
                report.aborted[bid] = n
            tlog.write(bid, COMMITTED, {"recovered_by": "twophase recover", "at": time.time()})
            report.committed_batches.append(bid)
        else:
            n = sink.abort_lingering(tlog.name_for(bid), bid, intent, [])
            if n:
                report.aborted[bid] = n
    return report


def describe(log_url: str, storage_options: dict[str, Any] | None = None,
             sink: TwoPhaseCommitSink[Any, Any] | None = None) -> dict[str, Any]:
    """Everything ``twophase status`` shows, as JSON-able data (read-only: takes no ownership)."""
    tlog = TransactionLog(log_url, storage_options=storage_options)
    now = time.time()
    lease = tlog.lease()
    gens = tlog.generations()
    out: dict[str, Any] = {
        "log": log_url,
        "generations": gens,
        "owner": None if lease is None else {
            "epoch": lease.epoch, "host": lease.host, "pid": lease.pid,
            "heartbeat_age_s": round(now - lease.heartbeat_at, 1), "query_id": lease.query_id},
        "batches": [],
    }
    batches = tlog.batches()
    for bid in sorted(batches):
        states = batches[bid]
        state = COMMITTED if COMMITTED in states else PREPARED if PREPARED in states else INTENT
        handles = states[PREPARED].handles if PREPARED in states else []
        rec = states[state]
        entry: dict[str, Any] = {
            "batch_id": bid, "state": state, "handles": len(handles),
            "rows": (states[PREPARED].body.get("rows") if PREPARED in states else None),
            "age_s": round(now - rec.written_at, 1),
        }
        if state != COMMITTED:
            entry["pending_handles"] = handles
            if PREPARED in states:
                age = now - states[PREPARED].written_at
                entry["decided_age_s"] = round(age, 1)
                if sink is not None and hasattr(sink, "pending_age_warning"):
                    warnings = []
                    for env in handles:
                        w = sink.pending_age_warning(sink.decode_handle(env), age)
                        if w:
                            warnings.append(w)
                    entry["warnings"] = warnings
        out["batches"].append(entry)
    last = tlog.last_committed()
    out["last_committed"] = None if last is None else last.batch_id
    return out


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
