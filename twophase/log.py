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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twophase.errors import (
    ConfigurationError,
    CorruptLogError,
    LogError,
    LogOwnershipError,
    LogUnavailableError,
    PrunedBatchError,
    QueryMismatchError,
    TwoPhaseError,
)

# The stores live in twophase.storage (one module per backend, picked by URL scheme in its
# registry); these names stay importable from here.
from twophase.storage import LogStore, open_store, register_store  # noqa: F401
from twophase.storage.fsspec_store import FsspecStore  # noqa: F401
from twophase.storage.local import LocalStore  # noqa: F401

log = logging.getLogger("twophase.log")

FORMAT = "twophase-log"
FORMAT_VERSION = 1

INTENT, PREPARED, COMMITTED = "intent", "prepared", "committed"
#: A decided ballot proved void: every transaction it named is gone and none ever became visible
#: (see :meth:`TransactionLog.void_ballot`).  Its batch runs again in a new ballot.
VOID = "void"
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


@dataclass
class Lease:
    epoch: int
    owner: str
    host: str
    pid: int
    heartbeat_at: float
    query_id: str | None = None
    released: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    lease_timeout: float | None = None  # the holder's own; older leases: None (the reader's is used)
    process_space: str | None = None    # see _process_space(); None on older leases


def _process_space() -> str:
    """Which processes a pid names here: the kernel's boot id and this pid namespace.

    Two containers (or network namespaces with their own UTS name) may share a hostname, and
    a pid in one names nothing, or another process, in the other: a lease holder's pid is
    checked only by a reader in the same process space.
    """
    parts = []
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/pid"):
        try:
            parts.append(os.readlink(path) if path.endswith("/pid") else open(path).read().strip())
        except OSError:
            return ""
    return "|".join(parts)


def batch_query_id(name: str, target: str) -> str:
    """The query id a batch job (``Coordinator.write``, ``df.write.format("twophase-*")``) binds
    its log generation to: its name and a digest of its sink's target
    (:meth:`~twophase.sink.TwoPhaseCommitSink.target`).  Streaming queries use Spark's query id.

    A batch job has no Spark query id; with the name alone, two jobs given one log location (and
    the default name) shared a generation, and the second found the first one's batch ids
    committed and silently wrote nothing.  With the target in it, the second job is refused.
    """
    return f"batch:{name}@{hashlib.sha256(target.encode()).hexdigest()[:16]}"


#: Targets whose string changed between versions: new target -> (the form older versions gave, the
#: test of a handle's data that says it was written by this target) (:func:`remember_former_target`).
#: Process-wide: a sink computes its target in the driver, which binds the log there too.
_FORMER_TARGETS: dict[str, tuple[str, Callable[[dict[str, Any]], bool]]] = {}


def remember_former_target(target: str, former: str, wrote: Callable[[dict[str, Any]], bool]) -> None:
    """A sink whose :meth:`~twophase.sink.TwoPhaseCommitSink.target` now names what it writes more
    precisely (PostgresSink: the schema a ``search_path`` resolved, left out before) says which
    string older versions gave for it, and how to tell from a handle's data (the envelope's
    ``data``) that this target wrote it.  A batch job's log generation bound with the former one is
    then taken over by a job of this target only where the generation's decided handles prove it
    wrote them (at least one handle, each one this target's), by exclusive create (one job, never
    two); otherwise refused, naming both: two jobs of one former target (same-named tables of two
    schemas) were one to an older version, and the log is the only witness of which wrote it."""
    if former != target:
        _FORMER_TARGETS[target] = (former, wrote)


def _describe_query(rec: dict[str, Any]) -> str:
    q = str(rec.get("query_id"))
    if not q.startswith("batch:"):
        return f"streaming query {q}"
    target = rec.get("target")
    return f"batch job {q[6:].split('@', 1)[0]!r}" + (f" writing to {target}" if target else "")


# ------------------------------------------------------------------------------ log
class TransactionLog:
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

    # -- generations
    def generations(self) -> list[dict[str, Any]]:
        out = []
        for n in self.store.list("generations"):
            if n.endswith(".json") and n[:-5].isdigit():
                rec = self._read(f"generations/{n}")
                if rec is not None:
                    out.append(rec)
        return sorted(out, key=lambda r: r["generation"])

    def _bind_generation(self, query_id: str, name: str, new_generation: bool, target: str | None = None) -> int:
        """The generation of this log that belongs to ``query_id``: the latest one, or a new one.

        ``new_generation`` asks for a new generation only when the latest belongs to *another*
        query: it is bound to the query it replaces.  A flag kept in the job's code after the first
        start (the same checkpoint, so the same query id) finds the latest generation its own and
        reuses it; a new generation there would have no record of a batch decided just before a
        crash, and the replay would write it a second time.
        """
        gens = self.generations()
        latest = gens[-1] if gens else None
        found = _FORMER_TARGETS.get(target) if target and query_id.startswith("batch:") else None
        former, wrote = found if found is not None else (None, None)
        former_id = None if former is None else batch_query_id(query_id[len("batch:"):].rsplit("@", 1)[0], former)
        # A generation bound with this job's former target counts as its own here (refusal is the safe side).
        replaced = next((g for g in gens[:-1] if g["query_id"] in (query_id, former_id)), None)
        if replaced is not None and latest is not None and latest["query_id"] != query_id:
            # Its generation was replaced by another query's: that query may have committed (or
            # recovered) this one's batches, so it never writes again, flag or not.
            raise QueryMismatchError(
                f"{_describe_query(replaced)} owned generation {replaced['generation']} of {self.url}, which "
                f"{_describe_query(latest)} replaced (generation {latest['generation']}): a replaced query "
                "never writes to this log again (its batches may have been recovered by the new one, and "
                "a replay would write them twice). Run it with a log location of its own, or restart it "
                "from a new checkpoint.")
        if latest is not None and latest["query_id"] == query_id:
            if new_generation:
                log.info("transaction log %s: generation %s already belongs to query %s; new_generation=True "
                         "reuses it (the flag starts a generation only for a query the log has not seen last)",
                         self.url, latest["generation"], query_id)
            return int(latest["generation"])
        if latest is not None and query_id.startswith("batch:") and latest["query_id"] == query_id.split("@", 1)[0]:
            # A batch job's generation from before batch ids carried the target: the first job of
            # that name to come binds it to its target (exclusive create); another target is refused.
            g = int(latest["generation"])
            name_ = f"generations/{g:04d}.target.json"
            self.store.create(name_, encode_record({"kind": "target", "query_id": query_id, "target": target}))
            bound = self._read(name_) or {}
            if bound.get("query_id") == query_id:
                return g
            raise QueryMismatchError(self._mismatch(dict(latest, target=bound.get("target")), query_id, target))
        if latest is not None and former_id is not None and latest["query_id"] == former_id:
            # Bound by an older version with this target's former string (PostgresSink's search_path
            # schema left out, so jobs writing same-named tables of two schemas shared it): the first
            # job to come rebinds it to its precise target (exclusive create); any other is refused.
            g = int(latest["generation"])
            name_ = f"generations/{g:04d}.retarget.json"
            if self._read(name_) is None and not self._generation_written_by(g, wrote):
                # rule: a generation's batches are skipped as committed by whoever binds it: only a job
                # the generation's own handles name may (never the first to come).
                raise QueryMismatchError(
                    self._mismatch(latest, query_id, target) + f". Its generation {g} was bound by an older "
                    f"twophase version as {former!r}, and its decided transactions do not show that this job "
                    f"({target}) wrote them: it is not taken over")
            self.store.create(name_, encode_record({"kind": "retarget", "query_id": query_id, "target": target,
                                                    "former": former}))
            bound = self._read(name_) or {}
            if bound.get("query_id") == query_id:
                return g
            raise QueryMismatchError(self._mismatch(dict(latest, query_id=bound.get("query_id"),
                                                         target=bound.get("target")), query_id, target))
        if latest is not None and not new_generation:
            raise QueryMismatchError(self._mismatch(latest, query_id, target))
        g = (int(latest["generation"]) + 1) if latest is not None else 1
        body = {"kind": "generation", "generation": g, "query_id": query_id, "name": name,
                "created_at": time.time()}
        if target:
            body["target"] = target
        if not self.store.create(f"generations/{g:04d}.json", encode_record(body)):
            # Another driver created it first: ours too if it is the same query (two drivers of one
            # new query, both with the flag), else refused.
            rec = self._read(f"generations/{g:04d}.json")
            if rec is not None and rec.get("query_id") == query_id:
                return g
            raise LogOwnershipError(f"another coordinator created generation {g} of {self.url} at the same time "
                                    f"(for query {None if rec is None else rec.get('query_id')})")
        return g

    def _generation_written_by(self, generation: int, wrote: Callable[[dict[str, Any]], bool] | None) -> bool:
        """Do the decided handles of ``generation`` (those its records still hold) all pass ``wrote``,
        and is there at least one?  A generation with no batch record at all committed nothing: any
        job may take it."""
        views = self.views(generation)
        if wrote is None:
            return False
        if not views and not self.pruned(generation, fresh=True):
            return True
        datas = [env.get("data") for v in views.values() for b in v.ballots
                 if b.committed and b.decision is not None for env in b.decision.handles if isinstance(env, dict)]
        return bool(datas) and all(isinstance(d, dict) and wrote(d) for d in datas)

    def _mismatch(self, latest: dict[str, Any], query_id: str, target: str | None = None) -> str:
        if str(query_id).startswith("batch:") or str(latest["query_id"]).startswith("batch:"):
            return (f"the transaction log {self.url} belongs to {_describe_query(latest)} (generation "
                    f"{latest['generation']}), but this is {_describe_query({'query_id': query_id, 'target': target})}. "
                    "Two jobs must not share one log: batch ids are per job, so the second job would find the "
                    "first one's batches committed and write nothing. Give each job its own log location "
                    "(Coordinator(log_location=...), option twophase.logLocation). A batch job is its name and "
                    "its target: if only the target's address changed (another host name for the same "
                    "server), keep the address the log names, or move the job to a new log knowing that a "
                    "batch id already written there would be written again.")
        return (f"the transaction log {self.url} belongs to streaming query {latest['query_id']} "
                f"(generation {latest['generation']}, coordinator {latest.get('name')!r}), but this "
                f"is query {query_id}. The checkpoint was probably deleted or replaced: Spark restarts "
                "batch ids at 0, and the log would wrongly skip them as already committed. Either "
                "point log_location at a fresh location, or start a new log generation explicitly "
                "(Coordinator(..., new_generation=True): it is bound to the query it starts the generation "
                "for, so it may stay in the code); first finish the old generation's pending batches "
                "('twophase status', 'twophase recover'), then 'twophase offsets' prints where its "
                "committed input ends.")

    # -- ownership
    def epochs(self) -> list[int]:
        out = []
        for n in self.store.list("epochs"):
            stem = n.split(".", 1)[0]
            if stem.isdigit():
                out.append(int(stem))
        return sorted(out)

    def lease(self) -> Lease | None:
        rec = self._read("lease.json")
        if rec is None:
            return None
        return Lease(epoch=rec["epoch"], owner=rec["owner"], host=rec["host"], pid=rec["pid"],
                     heartbeat_at=rec["heartbeat_at"], query_id=rec.get("query_id"),
                     released=bool(rec.get("released")), lease_timeout=rec.get("lease_timeout"),
                     process_space=rec.get("process_space"))

    def _holder_alive(self, lease: Lease) -> bool:
        """Is the lease's holder alive?  Judged by its heartbeat against the holder's own
        ``lease_timeout`` (the one it beats by), on every host.  A pid check can only shorten
        that: a holder in this very process space whose pid is gone is dead at once."""
        if lease.owner == self.owner or lease.released:
            return False
        timeout = float(lease.lease_timeout or self.lease_timeout)
        if time.time() - lease.heartbeat_at >= timeout:
            return False
        space = _process_space()
        if space and lease.process_space == space and lease.host == socket.gethostname():
            if lease.pid == os.getpid():
                return False  # an earlier coordinator object in this very process
            try:
                os.kill(lease.pid, 0)
            except ProcessLookupError:
                return False
            except PermissionError:
                return True
        return True

    def acquire(self, query_id: str, name: str, *, new_generation: bool = False, takeover: bool = False,
                target: str | None = None) -> None:
        """Become the owner of this log for ``query_id`` (or refuse, naming the live owner).

        ``target``: where the sink writes (secret-free), kept with a new generation so that a
        refusal can name the job the log belongs to."""
        lease = self.lease()
        if lease is not None and not takeover and self._holder_alive(lease):
            raise LogOwnershipError(
                f"the transaction log {self.url} is owned by a live coordinator (epoch {lease.epoch}, "
                f"host {lease.host}, pid {lease.pid}, last heartbeat {time.time() - lease.heartbeat_at:.0f}s "
                "ago). Two coordinators must never commit for one log. Stop the other query first; if it "
                f"is dead on another host, wait {self.lease_timeout:.0f}s for its lease to expire or "
                "pass takeover=True.")
        self.generation = self._bind_generation(query_id, name, new_generation, target)
        self.query_id = query_id
        current = self.epochs()
        epoch = (current[-1] + 1) if current else 1
        body = {"kind": "epoch", "epoch": epoch, "owner": self.owner, "host": socket.gethostname(),
                "pid": os.getpid(), "query_id": query_id, "name": name, "started_at": time.time()}
        if not self.store.create(f"epochs/{epoch:010d}.json", encode_record(body)):
            raise LogOwnershipError(f"another coordinator took epoch {epoch} of {self.url} at the same time; "
                                    "only one may own the log")
        self.epoch = epoch
        self.heartbeat()
        # Keep the epoch folder small: older epochs are fenced and only the highest matters.
        for old in current[:-2]:
            self.store.delete(f"epochs/{old:010d}.json")

    def resume(self, *, owner: str, epoch: int | None, generation: int | None, query_id: str) -> None:
        """Act as the owner that acquired ``epoch`` in another process: the data source's commit
        step (twophase/datasource.py) decides the ballot its plan opened, in a process of its
        own.  Its records carry that owner, so :meth:`mine` tells them apart as the plan's would.
        The fence stays the ballots' slots; nothing is written here."""
        self.owner, self.epoch, self.generation, self.query_id = owner, epoch, generation, query_id

    def heartbeat(self, force: bool = True) -> None:
        """Refresh the lease.  ``force=False`` (once per batch) writes only when the last refresh
        by this process is older than a quarter of ``lease_timeout``: the lease is a liveness
        hint for other hosts (fencing is by epoch), and a durable write per batch would cost a
        file write and two fsyncs on every batch."""
        self._require_owner()
        with self._heartbeat_lock:
            now = time.time()
            if not force and now - self._heartbeat_written < self.lease_timeout / 4:
                return
            current = self.lease()
            if current is not None and current.epoch is not None and self.epoch is not None \
                    and int(current.epoch) > self.epoch:
                # A deposed coordinator must not overwrite its successor's lease (a third driver
                # would then judge the successor by the deposed one's heartbeat).
                raise LogOwnershipError(
                    f"this coordinator (epoch {self.epoch}) was fenced: coordinator epoch {current.epoch} "
                    f"(host {current.host}) holds the lease of {self.url}; this one stops.")
            self._write_lease(now, released=False)
            self._heartbeat_written = now

    def _write_lease(self, now: float, released: bool) -> None:
        self.store.replace("lease.json", encode_record({
            "kind": "lease", "epoch": self.epoch, "owner": self.owner, "host": socket.gethostname(),
            "pid": os.getpid(), "heartbeat_at": now, "query_id": self.query_id, "released": released,
            "lease_timeout": self.lease_timeout, "process_space": _process_space()}))

    def start_heartbeat(self) -> None:
        """Refresh the lease every ``lease_timeout / 4`` from a daemon thread, until :meth:`close`.

        A healthy query that stays idle longer than ``lease_timeout`` (a trigger every
        10 minutes, a source with no data) must not look dead to a driver started on
        another host: that one would take the log over.  The thread stops by itself once
        this coordinator is fenced (a newer epoch exists).
        """
        self._require_owner()
        if self._heartbeat_stop is not None:
            return
        stop = self._heartbeat_stop = threading.Event()
        interval = self.lease_timeout / 4

        def beat() -> None:
            while not stop.wait(interval):
                try:
                    latest = self.epochs()
                    if latest and latest[-1] != self.epoch:
                        log.info("transaction log %s: epoch %s was fenced by epoch %s; heartbeat stops",
                                 self.url, self.epoch, latest[-1])
                        self._was_fenced()
                        return
                    self.heartbeat(force=True)
                except LogOwnershipError as e:
                    log.info("transaction log %s: %s; heartbeat stops", self.url, e)
                    self._was_fenced()
                    return
                except Exception as e:  # noqa: BLE001 - a missed beat is retried; the lease is a hint
                    log.warning("transaction log %s: lease heartbeat failed: %s", self.url, e)

        threading.Thread(target=beat, name=f"twophase-lease-{self.epoch}", daemon=True).start()

    def close(self) -> None:
        """Stop the heartbeat and release the lease, so that a driver started elsewhere need not
        wait ``lease_timeout``.  The epoch stays: a later coordinator takes the next one."""
        if self._heartbeat_stop is not None:
            self._heartbeat_stop.set()
            self._heartbeat_stop = None
        if self.epoch is None or self.readonly:
            return
        try:
            lease = self.lease()
            if lease is not None and lease.owner == self.owner:
                with self._heartbeat_lock:
                    self._write_lease(time.time(), released=True)
        except Exception as e:  # noqa: BLE001 - best effort: the lease then expires on its own
            log.warning("transaction log %s: could not release the lease: %s", self.url, e)

    def _require_owner(self) -> None:
        if self.epoch is None:
            raise LogOwnershipError("the transaction log was not acquired: call acquire() first")

    def on_fenced(self, listener: Callable[[], None]) -> None:
        """Call ``listener()`` once when this coordinator is found fenced (by its heartbeat or
        :meth:`check_fence`), from the thread that found it: the coordinator stops the Spark job
        it is waiting on, so that a deposed driver ends rather than lingers (a job whose executors
        were lost with a partition can wait for resources for ever).  Never a fence itself: the
        ballot's slot is."""
        self._fence_listeners.append(listener)
        if self._fenced.is_set():
            self._was_fenced()

    def _was_fenced(self) -> None:
        self._fenced.set()
        listeners, self._fence_listeners = self._fence_listeners, []
        for listener in listeners:
            try:
                listener()
            except Exception:  # noqa: BLE001 - a listener's failure must not hide the fence
                log.warning("transaction log %s: a fence listener failed", self.url, exc_info=True)

    @property
    def fenced(self) -> bool:
        """Whether this coordinator was found fenced (a newer epoch exists); False until then."""
        return self._fenced.is_set()

    def check_fence(self) -> None:
        """Raise LogOwnershipError if a newer coordinator has taken this log over."""
        self._require_owner()
        latest = self.epochs()
        if latest and latest[-1] != self.epoch:
            self._was_fenced()
            raise LogOwnershipError(
                f"this coordinator (epoch {self.epoch}) was fenced: coordinator epoch {latest[-1]} took "
                f"over the transaction log {self.url}. It stops without committing; the newer one "
                "finishes the batch.")

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

