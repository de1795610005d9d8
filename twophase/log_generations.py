"""Generations of the transaction log (:class:`twophase.log.TransactionLog`): which query owns it.

Each generation (``generations/0001.json``) is bound to one streaming query id, or to a batch
job (:func:`batch_query_id`: its name and its target).  :meth:`~_Generations._bind_generation`
finds the generation that belongs to the acquiring query, starts a new one when asked, and
refuses any other query with a message naming the one the log belongs to; a target whose string
changed between versions is taken over only where the log proves it wrote the generation
(:func:`remember_former_target`).
A part of ``TransactionLog`` (its ``__init__`` in :mod:`twophase.log` sets the state it uses).
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from twophase.errors import LogOwnershipError, QueryMismatchError
from twophase.log_records import BatchView, encode_record

if TYPE_CHECKING:
    from twophase.storage import LogStore

log = logging.getLogger("twophase.log")


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


class _Generations:
    """:class:`~twophase.log.TransactionLog`'s generations and their binding to a query."""

    if TYPE_CHECKING:  # set by TransactionLog.__init__ (twophase/log.py), and other parts' methods it calls
        url: str
        store: LogStore

        def _read(self, name: str, state: str = "", batch_id: int | None = None) -> dict[str, Any] | None: ...

        def views(self, generation: int, only: int | None = None,
                  skip_committed: bool = False) -> dict[int, BatchView]: ...

        def pruned(self, generation: int | None = None, *, fresh: bool = False,
                   at_least: int | None = None) -> list[list[int]]: ...

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
