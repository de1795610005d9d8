"""The durable transaction log: one record per batch state (INTENT, PREPARED, COMMITTED).

PREPARED is the commit decision: once its file exists, the batch's handles are
committed, after any crash, by whoever owns the log next.  Records are written by
atomic create (never overwritten), carry a SHA-256 checksum, and a record that
cannot be read stops the job with an error naming the file; it is never skipped.

Layout under the log URL::

    log.json                       format marker
    generations/0001.json          the streaming query id this generation belongs to
    epochs/0000000003.json         one per coordinator start; the highest epoch owns the log
    lease.json                     owner, host, pid and heartbeat of the current epoch
    g0001/batch-000000000042.intent.json / .prepared.json      ballot 0 of batch 42
    g0001/batch-000000000042.intent.1.json / .prepared.1.json  ballot 1 (a re-run of batch 42)
    g0001/batch-000000000042.committed.json

Ballots: every execution of a batch is a *ballot* with an INTENT of its own (its own
transaction names) and one decision slot, the PREPARED file of that ballot, which is
filled exactly once by exclusive create: with the commit decision (handles, offsets)
by the ballot's coordinator, or with an *abort* decision by whoever gives up on the
ballot (its own coordinator after a failure, or a later owner that wants to re-run
the batch).  A ballot's transactions are aborted only after its slot holds "abort",
and a new ballot is opened only after every earlier one is closed, so at most one
ballot of a batch is ever decided "commit", and a late decision (a paused
coordinator, a request delayed on the wire) either lands before the abort and is
committed by everyone, or is refused and knows it.  The storage's exclusive create
is the fence; no check is followed by an act.

Ownership: a coordinator takes the next epoch by exclusive create.  Before a decision
it checks that no newer epoch exists (an early exit that saves useless work; the
ballot's slot is what makes a late decision safe).  A second coordinator is refused
while the lease holder is alive (judged by the holder's heartbeat against the
holder's own ``lease_timeout``; on the same host also by its pid).

The log's parts live beside this module, which keeps :class:`TransactionLog` (its state, and its
format marker) and every name importable from here: the records, their encoding and validation
in :mod:`twophase.log_records`; ownership (epochs, lease, fence) in :mod:`twophase.log_ownership`;
generations in :mod:`twophase.log_generations`; batch records in :mod:`twophase.log_batches`;
what was pruned, and the prune, in :mod:`twophase.log_pruning`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from twophase.errors import ConfigurationError, LogError
from twophase.log_batches import _Batches
from twophase.log_generations import _FORMER_TARGETS as _FORMER_TARGETS
from twophase.log_generations import _describe_query as _describe_query
from twophase.log_generations import _Generations, batch_query_id, remember_former_target
from twophase.log_ownership import Lease, _Ownership
from twophase.log_ownership import _process_space as _process_space
from twophase.log_pruning import _LOW_WATER as _LOW_WATER
from twophase.log_pruning import _LOW_WATER_DIR as _LOW_WATER_DIR
from twophase.log_pruning import _in as _in
from twophase.log_pruning import _merge as _merge
from twophase.log_pruning import _Pruning
from twophase.log_records import _BALLOT_STATES as _BALLOT_STATES
from twophase.log_records import (
    ABORT,
    COMMIT,
    COMMITTED,
    FORMAT,
    FORMAT_VERSION,
    INTENT,
    PREPARED,
    STATES,
    VOID,
    Ballot,
    BatchRecord,
    BatchView,
    _advice,
    _canonical,
    decode_record,
    encode_record,
    parse_batch_name,
    temp_record_name,
)
from twophase.log_records import _batch_name as _batch_name

# The stores live in twophase.storage (one module per backend, picked by URL scheme in its
# registry); these names stay importable from here.
from twophase.storage import LogStore, open_store, register_store  # noqa: F401
from twophase.storage.fsspec_store import FsspecStore  # noqa: F401
from twophase.storage.local import LocalStore  # noqa: F401

log = logging.getLogger("twophase.log")

__all__ = [
    "ABORT",
    "COMMIT",
    "COMMITTED",
    "FORMAT",
    "FORMAT_VERSION",
    "INTENT",
    "PREPARED",
    "STATES",
    "VOID",
    "Ballot",
    "BatchRecord",
    "BatchView",
    "FsspecStore",
    "Lease",
    "LocalStore",
    "LogStore",
    "TransactionLog",
    "batch_query_id",
    "decode_record",
    "encode_record",
    "open_store",
    "parse_batch_name",
    "register_store",
    "remember_former_target",
    "temp_record_name",
]


# ------------------------------------------------------------------------------ log
class TransactionLog(_Ownership, _Generations, _Batches, _Pruning):
    """The log of one coordinator: ownership, generation, and batch records.

    ``retain_batches``: how many committed batches keep their records (older ones
    are deleted after each commit; records of uncommitted batches are never deleted).
    """

    def __init__(self, url: str, *, storage_options: dict[str, Any] | None = None,
                 retain_batches: int = 100, lease_timeout: float = 120.0, readonly: bool = False):
        if retain_batches < 1:
            raise ConfigurationError("retain_batches must be at least 1")
        if lease_timeout <= 0:
            raise ConfigurationError("lease_timeout must be positive")
        self.url = url
        self.readonly = readonly
        if readonly and "://" not in url and not os.path.isdir(url):
            raise LogError(f"no transaction log at {url}: the directory does not exist (a mistyped path?)")
        self.store = open_store(url, storage_options, exclusive=not readonly)
        self.retain_batches = retain_batches
        self.lease_timeout = lease_timeout
        self.owner = uuid.uuid4().hex
        self.epoch: int | None = None
        self.generation: int | None = None
        self.query_id: str | None = None
        self._heartbeat_written = 0.0
        self._heartbeat_lock = threading.Lock()
        self._heartbeat_stop: threading.Event | None = None
        #: Called once, from whichever thread first finds this coordinator fenced (see on_fenced).
        self._fence_listeners: list[Callable[[], None]] = []
        self._fenced = threading.Event()
        #: generation -> (pruned ranges, the mark files they were read from)
        self._pruned: dict[int, tuple[list[list[int]], frozenset[str]]] = {}
        self._legacy_low_water: dict[int, int] = {}
        self._ensure_format()

    # -- basics
    def _read(self, name: str, state: str = "", batch_id: int | None = None) -> dict[str, Any] | None:
        data = self.store.read(name)
        if data is None:
            return None
        return decode_record(data, self.store.location(name), _advice(state, batch_id))

    def _ensure_format(self) -> None:
        rec = self._read("log.json")
        if rec is None:
            if self.readonly:
                raise LogError(f"no transaction log at {self.url} (no log.json there): a mistyped path? "
                               "Give the coordinator's log location, e.g. CHECKPOINT/twophase")
            self.store.create("log.json", encode_record({"kind": "log", "created_at": time.time(),
                                                         "log_id": uuid.uuid4().hex}))
            rec = self._read("log.json")
            assert rec is not None
        # The log's identity: a random id for logs made by this version, the record's own digest
        # for older ones (log.json is written once and never changes, so either is stable).
        self.log_id = str(rec.get("log_id") or hashlib.sha256(_canonical(rec)).hexdigest())

    def scope(self, generation: int | None = None) -> str:
        """A short token unique to this log and generation (``3f9a2b1cg1``).

        The coordinator appends it to the query name it gives sinks, so that two
        pipelines with the same coordinator name (or two generations of one log) never
        share staging directories, prepared-transaction gids or marker rows.
        """
        g = generation if generation is not None else self.generation
        return f"{self.log_id[:8]}g{g or 0}"
