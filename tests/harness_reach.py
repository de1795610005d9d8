"""How often the ownership harness catches each bug class of issue 25 at its defaults.

``python -m tests.harness_reach --runs 20 [--postgres DSN] [--only NAME]`` runs
:func:`~twophase.testing.ownership.run_ownership_conformance` at its defaults ``runs`` times (a new
random seed each) against each broken protocol or sink, and prints ``caught/runs`` per class with
the seconds per run.  The broken pieces are also what tests/test_conformance_ownership.py shows the
harness failing on:

- ``WholeIntentCleanupProtocol`` (scenario 1): a406f01's failure cleanup: abort everything the
  batch's INTENT named (then one INTENT served every execution: every ballot's names), without
  closing the ballot or checking the fence;
- ``CheckThenWriteProtocol`` (scenario 2): a406f01's decision: check the fence, check the slot is
  empty, then write it (not an exclusive create), so a write delayed on the wire overwrites the
  abort a new owner put there;
- ``NoGenerationSweepProtocol``: recovery without the sweep of replaced generations, so a late
  task attempt of an old generation leaves its staged file for good;
- ``BlindIntentProtocol``: a406f01's INTENT: created, its result ignored, so a coordinator whose
  INTENT was held on the wire past a takeover (the new owner opened the same ballot first) goes on
  under its own plan: its tasks pre-commit and it decides a ballot another coordinator opened;
- a406f01's ``PostgresSink`` (scenarios 4 and 6) and ``FileSink`` (scenario 5), loaded from git.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

from examples.sqlite_sink import (
    COMMITS,
    SQLiteSink,
    _closing,
    quote,
    read_table,
    staged_transactions,
)
from twophase.log import COMMIT, INTENT, PREPARED, BatchRecord, _batch_name, encode_record
from twophase.protocol import TwoPhaseProtocol
from twophase.sink import CommitResult

OLD = "a406f01"


class WholeIntentCleanupProtocol(TwoPhaseProtocol):
    """Scenario 1 as a406f01 had it: a failed batch's cleanup aborts every transaction the batch's
    INTENT named (one INTENT for every execution then: here, every ballot's names), unfenced, and
    never closes its ballot first."""

    def _give_up(self, batch_id: int, ballot: int, intent: dict[str, Any], error: BaseException) -> None:
        for b in self.tlog.view(batch_id).ballots:
            self.sink.abort_lingering(str(b.name or self.query_name), batch_id, b.plan, [])


class CheckThenWriteProtocol(TwoPhaseProtocol):
    """Scenario 2 as a406f01 had it: the decision is fence-check, slot-check, then write (a
    replace), so a decision delayed on the wire lands over a newer owner's abort."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        tlog = self.tlog

        def decide(batch_id: int, ballot: int, payload: dict[str, Any]) -> BatchRecord:
            tlog.check_fence()
            existing = tlog.record(batch_id, PREPARED, ballot=ballot)
            if existing is not None:
                return existing
            body = dict(payload, outcome=COMMIT, batch_id=batch_id, state=PREPARED, epoch=tlog.epoch,
                        generation=tlog.generation, written_at=time.time(), writer=tlog.owner)
            if ballot:
                body["ballot"] = ballot
            name = _batch_name(tlog.generation or 0, batch_id, PREPARED, ballot)
            tlog.store.replace(name, encode_record(body))  # the write that may be held on the wire
            return BatchRecord(batch_id, PREPARED, body, tlog.store.location(name))

        tlog.decide = decide  # type: ignore[method-assign]


class BlindIntentProtocol(TwoPhaseProtocol):
    """The INTENT as a406f01 wrote it (``coordinator/coordinator.py``: ``tlog.write(batch_id, INTENT,
    ...)``, the result unused): a create that finds another coordinator's INTENT in the slot is taken
    as success, and the coordinator goes on with its own plan (tasks, decision)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        tlog = self.tlog
        write = tlog.write

        def write_blind(batch_id: int, state: str, payload: dict[str, Any], generation: int | None = None,
                        ballot: int = 0) -> BatchRecord:
            rec = write(batch_id, state, payload, generation=generation, ballot=ballot)
            if state == INTENT and not tlog.mine(rec):
                return BatchRecord(batch_id, INTENT, dict(rec.body, writer=tlog.owner), rec.location)  # "ours"
            return rec

        tlog.write = write_blind  # type: ignore[method-assign]


class NoGenerationSweepProtocol(TwoPhaseProtocol):
    """Recovery as before the replaced-generation sweep: a late task attempt of a generation that
    a new generation replaced leaves its transaction under the old scoped name, and nobody looks."""

    def _sweep_replaced_generations(self) -> None:
        return None


def load_old_sink(path: str, rev: str = OLD, repo: str | None = None) -> Any:
    """The module ``path`` (e.g. ``sinks/postgres.py``) as it was at ``rev``, imported under its own
    name (``twophase_old_postgres``) on today's core modules.  Needs the git repository."""
    repo = repo or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    text = subprocess.run(["git", "-C", repo, "show", f"{rev}:{path}"], check=True, capture_output=True).stdout
    name = "twophase_old_" + os.path.basename(path)[:-3]
    if name in sys.modules:
        return sys.modules[name]
    folder = tempfile.mkdtemp(prefix="twophase-old-")
    file = os.path.join(folder, name + ".py")
    with open(file, "wb") as f:
        f.write(text)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------ targets
def files_target(root: str, sink_class: Any = None) -> dict[str, Any]:
    """``run_ownership_conformance`` arguments for a FileSink (today's, or ``sink_class``) in ``root``."""
    import pyarrow.parquet as pq

    from twophase.sinks.files import STAGING_DIR, FileSink

    cls = sink_class or FileSink
    os.makedirs(root, exist_ok=True)

    def read() -> list[int]:
        ids: list[int] = []
        for n in sorted(os.listdir(root)):
            if n.endswith(".parquet") and not n.startswith(("_", ".")):
                ids.extend(pq.read_table(os.path.join(root, n), columns=["id"]).column("id").to_pylist())
        return ids

    def pending() -> list[str]:
        return [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(root, STAGING_DIR)) for f in fs]

    return {"sink_factory": lambda: cls(root, "parquet"), "read_committed": read, "pending": pending}


class PostgresTarget:
    """A fresh table and gid prefix on a PostgreSQL server, for today's or an old PostgresSink."""

    def __init__(self, dsn: str, sink_class: Any = None):
        import psycopg2

        from twophase.sinks.postgres import PostgresSink

        self.cls = sink_class or PostgresSink
        self.dsn = dsn
        uid = uuid.uuid4().hex[:8]
        self.table, self.prefix, self.markers = f"own_{uid}", f"to{uid}", f"own_markers_{uid}"
        self.admin = psycopg2.connect(dsn)
        self.admin.autocommit = True
        with self.admin.cursor() as cur:
            cur.execute(f'CREATE TABLE "{self.table}" (id bigint NOT NULL, payload text)')

    def read(self) -> list[int]:
        with self.admin.cursor() as cur:
            cur.execute(f'SELECT id FROM "{self.table}"')
            return [r[0] for r in cur.fetchall()]

    def pending(self) -> list[str]:
        with self.admin.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE database = current_database() "
                        "AND left(gid, length(%s)) = %s", (self.prefix + ":", self.prefix + ":"))
            return [r[0] for r in cur.fetchall()]

    def kwargs(self) -> dict[str, Any]:
        return {"sink_factory": lambda: self.cls(self.dsn, self.table, gid_prefix=self.prefix,
                                                 marker_table=self.markers, lock_timeout="5s"),
                "read_committed": self.read, "pending": self.pending,
                # the DSN carries the password, which to_config() leaves out
                "rebuild_from_config": False}

    def close(self) -> None:
        with self.admin.cursor() as cur:
            for g in self.pending():
                cur.execute("ROLLBACK PREPARED %s", (g,))
            # today's PostgresSink.open() adds a claims table beside the marker table
            cur.execute(f'DROP TABLE IF EXISTS "{self.table}", "{self.markers}", "{self.markers}_claims"')
        self.admin.close()


# ------------------------------------------------------------------ sinks broken only across a crash
# Each is the SQLite example sink with one realistic defect that shows only when a driver crashed
# after the decision (PREPARED) and a new driver, with a new sink object, commits the decided
# handles in recovery; in the driver that ran the batch everything is right.  The crash machine
# (run_sink_conformance, ownership=False) is what must catch them.

class VerifiedRangeSink(SQLiteSink):
    """Defect: commit moves the staging rowid range that ``verify_prepared`` (driver, before the
    decision) looked up for the transaction, a cheap range move; a new driver never verified the
    decided transactions, finds no range, moves nothing and records them as committed."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self._ranges: dict[str, tuple[int | None, int | None]] = {}

    def verify_prepared(self, batch_id: int, handles: list[dict], *, prepare_started_at: float) -> None:
        with _closing(self._connect()) as con:
            if not self._has_staging(con):
                return
            for h in handles:
                lo, hi = con.execute(f"SELECT min(rowid), max(rowid) FROM {quote(self.staging)} WHERE _txn = ?",
                                     (h["txn"],)).fetchone()
                self._ranges[h["txn"]] = (lo, hi)

    def commit(self, handle: dict) -> CommitResult:
        txn = handle["txn"]
        lo, hi = self._ranges.get(txn, (None, None))
        with _closing(self._connect()) as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                if con.execute(f"SELECT 1 FROM {quote(COMMITS)} WHERE txn = ?", (txn,)).fetchone():
                    con.execute("ROLLBACK")
                    return CommitResult.already_committed()
                if int(handle["rows"]):
                    cols = ", ".join(quote(c) for c in self._columns(con))
                    con.execute(f"INSERT INTO {quote(self.table)} ({cols}) SELECT {cols} FROM {quote(self.staging)} "
                                "WHERE rowid BETWEEN ? AND ? AND _txn = ? ORDER BY rowid", (lo, hi, txn))
                    con.execute(f"DELETE FROM {quote(self.staging)} WHERE _txn = ?", (txn,))
                con.execute(f"INSERT INTO {quote(COMMITS)} VALUES (?, ?, ?, ?, ?)",
                            (txn, handle.get("query"), handle.get("batch"), int(handle["rows"]), time.time()))
                con.execute("COMMIT")
            except BaseException:
                if con.in_transaction:
                    con.execute("ROLLBACK")
                raise
        return CommitResult.committed()


class SlimHandleSink(SQLiteSink):
    """Defect: the logged handle keeps only what ``commit`` needs (``txn``, ``rows``); the recovery
    path, ``recover_and_commit``, also looks the transaction's staged rows up by query and batch,
    which the handle no longer carries, finds none and takes the transaction for committed by the
    dead driver."""

    def handle_to_json(self, handle: dict) -> dict[str, Any]:
        return {"txn": handle["txn"], "rows": handle["rows"]}

    def recover_and_commit(self, handle: dict) -> CommitResult:
        # After a restart: did the dead driver commit it?  Committed (moved) rows are no longer staged.
        with _closing(self._connect()) as con:
            if con.execute(f"SELECT 1 FROM {quote(COMMITS)} WHERE txn = ?", (handle["txn"],)).fetchone():
                return CommitResult.already_committed()
            staged = con.execute(f"SELECT count(*) FROM {quote(self.staging)} WHERE _query = ? AND _batch = ? "
                                 "AND _txn = ?", (handle.get("query"), handle.get("batch"), handle["txn"])
                                 ).fetchone()[0] if self._has_staging(con) else 0
        if int(handle["rows"]) and not staged:
            return CommitResult.already_committed("nothing staged any more: the dead driver moved it")
        return self.commit(handle)


class MemoryIdempotentSink(SQLiteSink):
    """Defect: commit copies the staged rows and remembers the transaction in the sink object, not
    in the database: a second commit in the same driver is a no-op, but a new driver's recovery of
    a batch whose commits had landed before the crash copies them again (staging is emptied by the
    cleanup after COMMITTED)."""

    def __init__(self, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self._committed: set[str] = set()

    def commit(self, handle: dict) -> CommitResult:
        if handle["txn"] in self._committed:
            return CommitResult.already_committed()
        with _closing(self._connect()) as con:
            if int(handle["rows"]):
                cols = ", ".join(quote(c) for c in self._columns(con))
                con.execute(f"INSERT INTO {quote(self.table)} ({cols}) SELECT {cols} FROM {quote(self.staging)} "
                            "WHERE _txn = ?", (handle["txn"],))
        self._committed.add(handle["txn"])
        return CommitResult.committed()

    def abort_lingering(self, query_name: str, batch_id: int, intent: dict[str, Any], keep: list[dict]) -> int:
        # Once a batch is COMMITTED all its execution staged can go (its committed rows were copied).
        with _closing(self._connect()) as con:
            if not self._has_staging(con):
                return 0
            return con.execute(f"DELETE FROM {quote(self.staging)} WHERE _query = ? AND "
                               "((_batch = ? AND _ballot = ?) OR _batch < ?)",
                               (query_name, batch_id, str(intent.get("ballot", "")), batch_id)).rowcount


def sqlite_target(folder: str, sink_class: Any = None) -> dict[str, Any]:
    """``run_sink_conformance`` arguments for the SQLite example sink (or ``sink_class``) in ``folder``."""
    cls = sink_class or SQLiteSink
    db = os.path.join(folder, "events.db")
    return {"sink_factory": lambda: cls(db), "read_committed": lambda: read_table(db),
            "pending": lambda: staged_transactions(db)}


#: Broken sinks for the crash machine: bugs that show only after a crash after PREPARED and a
#: recovery in a new sink object.
CRASH_CLASSES = {
    "after-PREPARED crash: commit needs a range only the verifying driver knows (SQLite)": VerifiedRangeSink,
    "after-PREPARED crash: the handle drops what recover_and_commit needs (SQLite)": SlimHandleSink,
    "after-PREPARED crash: commit idempotent in one sink object only (SQLite)": MemoryIdempotentSink,
}


# ------------------------------------------------------------------ the reach run
Maker = Callable[[str], tuple[dict[str, Any], Callable[[], None]]]


def _classes(dsn: str | None) -> dict[str, tuple[str, Maker]]:
    """name -> (machine, folder -> (its run_*_conformance kwargs, cleanup)); machine is "ownership"
    (run_ownership_conformance) or "crash" (run_sink_conformance, ownership=False)."""
    def files(protocol: Any = None, old: bool = False) -> tuple[str, Maker]:
        def make(folder: str) -> tuple[dict[str, Any], Callable[[], None]]:
            cls = load_old_sink("sinks/files.py").FileSink if old else None
            kw = files_target(os.path.join(folder, "out"), cls)
            if protocol is not None:
                kw["protocol_factory"] = protocol
            return kw, lambda: None
        return "ownership", make

    def sqlite(cls: Any) -> tuple[str, Maker]:
        return "crash", lambda folder: (sqlite_target(folder, cls), lambda: None)

    out = {
        "scenario 1: deposed owner's whole-INTENT cleanup (FileSink)": files(WholeIntentCleanupProtocol),
        "scenario 2: check-then-write decision (FileSink)": files(CheckThenWriteProtocol),
        "late INTENT: its create's result ignored (FileSink)": files(BlindIntentProtocol),
        "replaced generation's late leftovers never swept (FileSink)": files(NoGenerationSweepProtocol),
        "scenario 5: a406f01 FileSink (unscoped final names)": files(old=True),
    }
    if dsn:
        def pg(folder: str) -> tuple[dict[str, Any], Callable[[], None]]:
            t = PostgresTarget(dsn, load_old_sink("sinks/postgres.py").PostgresSink)
            return t.kwargs(), t.close
        out["scenarios 4+6: a406f01 PostgresSink (late prepares, attempt-number gids)"] = ("ownership", pg)
    out.update({name: sqlite(cls) for name, cls in CRASH_CLASSES.items()})
    return out


def main(argv: list[str] | None = None) -> int:
    from twophase.testing.conformance import ConformanceError, run_sink_conformance
    from twophase.testing.ownership import run_ownership_conformance

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--postgres", default=os.environ.get("TWOPHASE_REACH_PG_DSN"),
                    help="a PostgreSQL DSN (the old PostgresSink's class is skipped without one)")
    ap.add_argument("--only", default=None, help="run the classes whose name contains this")
    ap.add_argument("--good", action="store_true",
                    help="also time today's FileSink (ownership) and SQLite example (crash machine): must pass")
    args = ap.parse_args(argv)
    import logging

    logging.getLogger("twophase").setLevel(logging.ERROR)
    import hypothesis

    from twophase.testing.conformance import default_settings
    from twophase.testing.ownership import DEFAULT_EXAMPLES, DEFAULT_STEPS

    # The defaults, without shrinking (reach is about finding; shrinking a failure only costs time).
    find = [hypothesis.Phase.explicit, hypothesis.Phase.generate]
    no_shrink = {"ownership": hypothesis.settings(default_settings(DEFAULT_EXAMPLES, DEFAULT_STEPS), phases=find),
                 "crash": hypothesis.settings(default_settings(), phases=find)}
    classes = _classes(args.postgres)
    if args.good:
        classes = {"today's FileSink and protocol (must pass)":
                   ("ownership", lambda f: (files_target(os.path.join(f, "out")), lambda: None)),
                   "today's SQLite example, crash machine (must pass)":
                   ("crash", lambda f: (sqlite_target(f), lambda: None)), **classes}
    for name, (machine, make) in classes.items():
        if args.only and args.only not in name:
            continue
        caught, kinds, secs = 0, [], []
        for _ in range(args.runs):
            folder = tempfile.mkdtemp(prefix="twophase-reach-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
            kw, cleanup = make(folder)
            seed = random.getrandbits(32)
            t0 = time.perf_counter()
            try:
                if machine == "crash":
                    run_sink_conformance(seed=seed, settings=no_shrink[machine], ownership=False, **kw)
                else:
                    run_ownership_conformance(seed=seed, settings=no_shrink[machine], **kw)
            except ConformanceError as e:
                caught += 1
                first = str(e).splitlines()
                kinds.append(next((ln.strip() for ln in first[1:] if ln.strip()), first[0])[:90])
            finally:
                secs.append(time.perf_counter() - t0)
                cleanup()
                shutil.rmtree(folder, ignore_errors=True)
        print(f"{name} [{machine} machine]: caught {caught}/{args.runs}, {sum(secs) / len(secs):.1f} s per run",
              flush=True)
        for k in sorted(set(kinds), key=kinds.count, reverse=True)[:4]:
            print(f"    {kinds.count(k)}x {k}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
