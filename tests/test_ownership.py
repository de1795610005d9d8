"""Ownership that holds when processes pause, lag or linger (issue 25): no late actor destroys a
decided batch.

Each test is a scenario of the issue, played with two real coordinators on one log and the real
PostgreSQL server: one coordinator is held (a pause, or its decision's write held "on the wire")
while the other takes the batch over, then the held one goes on.  Each failed on the protocol
before ballots (one INTENT reused by every execution of a batch, a fence checked before the
decision was written), with ``DataLossError`` for a batch that then could never be committed.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter

import pytest

from twophase.coordinator import Coordinator
from twophase.errors import LogOwnershipError, TwoPhaseError
from twophase.log import TransactionLog, _process_space
from twophase.sinks.files import FileSink
from twophase.sinks.postgres import PostgresSink

pytestmark = [pytest.mark.timeout(600)]


def _table(db) -> str:
    name = f"own_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{name}" (id bigint PRIMARY KEY)')
    return name


def _ids(db, table: str) -> Counter:
    with db.cursor() as cur:
        cur.execute(f'SELECT id FROM "{table}"')
        return Counter(r[0] for r in cur.fetchall())


def _prepared(db, prefix: str) -> list[str]:
    with db.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s", (prefix, prefix))
        return [r[0] for r in cur.fetchall()]


class _HookMixin:
    """Driver-side test hooks (events, threads) on a sink; they never travel to executors."""

    hooks: dict

    def __getstate__(self):
        parent = getattr(super(), "__getstate__", None)
        state = dict(parent() if parent is not None else self.__dict__)
        state.pop("hooks", None)
        return state

    def __setstate__(self, state):
        parent = getattr(super(), "__setstate__", None)
        if parent is not None:
            parent(state)
        else:
            self.__dict__.update(state)
        self.hooks = {}


class _Hooked(_HookMixin, PostgresSink):
    def __init__(self, *args, hooks: dict | None = None, **kw):
        super().__init__(*args, **kw)
        self.hooks = hooks or {}


class _HookedFiles(_HookMixin, FileSink):
    def __init__(self, *args, hooks: dict | None = None, **kw):
        super().__init__(*args, **kw)
        self.hooks = hooks or {}


def _in_thread(fn) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, errors


@pytest.mark.postgres
@pytest.mark.spark
def test_deposed_coordinators_failure_cleanup_never_aborts_the_new_owners_decided_batch(
        postgres_service, spark, db, tmp_path):
    """Scenario 1: coordinator A pauses with batch 0 prepared; B takes the batch over and decides it;
    A wakes up, its executors' failure surfaces, and A cleans up what it owns.  Before: A's cleanup
    aborted everything the batch's one INTENT named, B's decided transactions included."""
    table, log_url = _table(db), str(tmp_path / "log")
    name = f"ballot{uuid.uuid4().hex[:6]}"  # unique: other tests look for their own marker rows by name
    prefix = f"o{uuid.uuid4().hex[:6]}"
    hooks = {"paused": threading.Event(), "wakes": threading.Event(), "lock": threading.Lock(),
             "woken": []}

    class PausedA(_Hooked):
        def verify_prepared(self, batch_id, handles, *, prepare_started_at):
            self.hooks["paused"].set()
            assert self.hooks["wakes"].wait(300)
            raise TwoPhaseError("A's executors failed while A was paused")

    class OwnerB(_Hooked):
        def commit(self, handle):
            with self.hooks["lock"]:
                if not self.hooks["woken"]:  # between B's decision and B's commit, A wakes and cleans up
                    self.hooks["woken"].append(True)
                    self.hooks["wakes"].set()
                    self.hooks["a_thread"].join(300)
            return super().commit(handle)

    df = spark.range(0, 40, numPartitions=2)
    a = Coordinator(PausedA(postgres_service["dsn"], table, gid_prefix=prefix, hooks=hooks),
                    log_location=log_url, name=name, parallelism=2)
    a_thread, a_errors = _in_thread(lambda: a.write(df, batch_id=0))
    hooks["a_thread"] = a_thread
    assert hooks["paused"].wait(300), a_errors
    b = Coordinator(OwnerB(postgres_service["dsn"], table, gid_prefix=prefix, hooks=hooks),
                    log_location=log_url, name=name, parallelism=2, takeover=True)
    b.write(df, batch_id=0)  # was: DataLossError, B's prepared transactions rolled back by A
    a_thread.join(300)
    assert not a_thread.is_alive() and len(a_errors) == 1 and isinstance(a_errors[0], TwoPhaseError)
    assert _ids(db, table) == Counter(range(40))
    assert _prepared(db, prefix + ":") == []
    view = TransactionLog(log_url, readonly=True)
    view.generation = 1
    ballots = view.view(0).ballots
    assert [(bl.ballot, bl.decision.aborted) for bl in ballots] == [(0, True), (1, False)]
    a.close()
    b.close()


@pytest.mark.postgres
@pytest.mark.spark
def test_a_decision_delayed_on_the_wire_past_a_takeover_is_refused_and_the_batch_lands_once(
        postgres_service, spark, db, tmp_path):
    """Scenario 2: A checks its fence, sends its decision, and the write is held on the network;
    B takes over, aborts batch 0's undecided transactions and re-runs it; then A's write lands.
    Before: the late decision named transactions B had rolled back (DataLossError at every
    restart); now B's close of A's ballot occupies the decision slot first and A's write fails."""
    table, log_url = _table(db), str(tmp_path / "log")
    name = f"ballot{uuid.uuid4().hex[:6]}"  # unique: other tests look for their own marker rows by name
    prefix = f"d{uuid.uuid4().hex[:6]}"
    hooks: dict = {"sent": threading.Event(), "deliver": threading.Event(), "landed": threading.Event()}

    class DelayedA(_Hooked):
        def verify_prepared(self, batch_id, handles, *, prepare_started_at):
            store = self.hooks["coordinator"].log.store
            real_create = store.create
            sent, deliver, landed = self.hooks["sent"], self.hooks["deliver"], self.hooks["landed"]

            def held_create(name, data):
                if ".prepared." in name and not sent.is_set():
                    sent.set()
                    assert deliver.wait(300)
                    try:
                        return real_create(name, data)
                    finally:
                        landed.set()
                return real_create(name, data)

            store.create = held_create

    class OwnerB(_Hooked):
        def verify_prepared(self, batch_id, handles, *, prepare_started_at):
            self.hooks["deliver"].set()  # A's delayed write arrives just before B decides
            assert self.hooks["landed"].wait(300)

    df = spark.range(0, 50, numPartitions=2)
    a = Coordinator(DelayedA(postgres_service["dsn"], table, gid_prefix=prefix, hooks=hooks),
                    log_location=log_url, name=name, parallelism=2)
    hooks["coordinator"] = a
    a_thread, a_errors = _in_thread(lambda: a.write(df, batch_id=0))
    assert hooks["sent"].wait(300), a_errors
    b = Coordinator(OwnerB(postgres_service["dsn"], table, gid_prefix=prefix, hooks=hooks),
                    log_location=log_url, name=name, parallelism=2, takeover=True)
    b.write(df, batch_id=0)  # was: TwoPhaseError "decided by coordinator epoch 1", then DataLossError
    a_thread.join(300)
    assert len(a_errors) == 1 and isinstance(a_errors[0], TwoPhaseError)
    assert "closed by another coordinator" in str(a_errors[0])
    assert _ids(db, table) == Counter(range(50))
    assert _prepared(db, prefix + ":") == []
    b.write(df, batch_id=0)  # a replay of the finished batch: skipped, not written twice
    assert _ids(db, table) == Counter(range(50))
    a.close()
    b.close()


@pytest.mark.postgres
@pytest.mark.spark
def test_a_failure_reading_the_source_offsets_leaves_no_transaction_prepared(postgres_service, spark, db,
                                                                              tmp_path):
    """Scenario 10: the checkpoint store fails between verify and the decision.  Before: the
    batch's prepared transactions held their locks until a replay came."""
    table, prefix = _table(db), f"s{uuid.uuid4().hex[:6]}"
    c = Coordinator(PostgresSink(postgres_service["dsn"], table, gid_prefix=prefix),
                    log_location=str(tmp_path / "log"), name="offs", parallelism=2)

    def unreachable(batch_id):
        raise OSError("checkpoint store unreachable")

    c._source_offsets = unreachable  # type: ignore[method-assign]
    with pytest.raises(OSError, match="unreachable"):
        c.write(spark.range(0, 20, numPartitions=2), batch_id=0)
    assert _prepared(db, prefix + ":") == []  # was: 2 prepared transactions, found by nobody
    del c._source_offsets
    c.write(spark.range(0, 20, numPartitions=2), batch_id=0)
    assert _ids(db, table) == Counter(range(20))
    c.close()


# ------------------------------------------------------------------ the lease (scenario 7)
def _lease_of_another_process_space(log_url: str, lease_timeout: float, heartbeat_age: float) -> None:
    import socket

    from twophase.log import encode_record

    holder = TransactionLog(log_url, lease_timeout=lease_timeout)
    holder.acquire("q-1", "holder", takeover=True)
    holder.store.replace("lease.json", encode_record({
        "kind": "lease", "epoch": holder.epoch, "owner": holder.owner, "host": socket.gethostname(),
        "pid": 2 ** 22 + 17,  # no such process here: a pid of another container
        "heartbeat_at": time.time() - heartbeat_age, "query_id": "q-1", "released": False,
        "lease_timeout": lease_timeout, "process_space": "another-boot|pid:[4026530000]"}))


def test_a_live_holder_in_another_container_with_the_same_hostname_is_not_taken_over(tmp_path):
    """Two containers share a hostname; the holder's pid means nothing in the reader's pid
    namespace.  Before: same hostname meant a pid check only, and a live holder was judged dead."""
    url = str(tmp_path / "log")
    _lease_of_another_process_space(url, lease_timeout=120.0, heartbeat_age=1.0)
    with pytest.raises(LogOwnershipError, match="live coordinator"):
        TransactionLog(url).acquire("q-1", "second")


def test_a_holders_staleness_is_judged_by_its_own_lease_timeout(tmp_path):
    """The holder beats every 600/4 s; a reader configured with 120 s must not call it dead after
    200 s.  Before: the reader's own lease_timeout decided."""
    url = str(tmp_path / "log")
    _lease_of_another_process_space(url, lease_timeout=600.0, heartbeat_age=200.0)
    with pytest.raises(LogOwnershipError, match="live coordinator"):
        TransactionLog(url, lease_timeout=120.0).acquire("q-1", "second")
    _lease_of_another_process_space(url, lease_timeout=60.0, heartbeat_age=200.0)
    TransactionLog(url, lease_timeout=600.0).acquire("q-1", "second")  # the holder's 60 s are long past


def test_a_dead_holder_in_this_process_space_is_taken_over_at_once(tmp_path):
    import subprocess
    import sys

    url = str(tmp_path / "log")
    subprocess.run([sys.executable, "-c",
                    f"from twophase.log import TransactionLog; TransactionLog({url!r}).acquire('q-1', 'dead')"],
                   check=True)
    assert TransactionLog(url, readonly=True).lease().process_space == _process_space()
    TransactionLog(url).acquire("q-1", "next")  # its pid is gone: no wait for the heartbeat to age


@pytest.mark.spark
def test_deposed_coordinators_late_cleanup_never_deletes_the_new_owners_staged_files(spark, tmp_path):
    """Scenario 1 for FileSink (local disk): A's late cleanup of batch 0 ran between B's decision
    and B's renames.  Before: both executions staged in one batch folder, A's sweep emptied it,
    and B's decided files were lost."""
    import pyarrow.parquet as pq

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    name = f"ballot{uuid.uuid4().hex[:6]}"
    hooks = {"paused": threading.Event(), "wakes": threading.Event(), "lock": threading.Lock(),
             "woken": []}

    class PausedA(_HookedFiles):
        def verify_prepared(self, batch_id, handles, *, prepare_started_at):
            self.hooks["paused"].set()
            assert self.hooks["wakes"].wait(300)
            raise TwoPhaseError("A's executors failed while A was paused")

    class OwnerB(_HookedFiles):
        def commit(self, handle):
            with self.hooks["lock"]:
                if not self.hooks["woken"]:
                    self.hooks["woken"].append(True)
                    self.hooks["wakes"].set()
                    self.hooks["a_thread"].join(300)
            return super().commit(handle)

    df = spark.range(0, 60, numPartitions=2)
    a = Coordinator(PausedA(str(out), writer="arrow", hooks=hooks), log_location=log_url, name=name,
                    parallelism=2)
    a_thread, a_errors = _in_thread(lambda: a.write(df, batch_id=0))
    hooks["a_thread"] = a_thread
    assert hooks["paused"].wait(300), a_errors
    b = Coordinator(OwnerB(str(out), writer="arrow", hooks=hooks), log_location=log_url, name=name,
                    parallelism=2, takeover=True)
    b.write(df, batch_id=0)  # was: DataLossError, B's staged files deleted by A's sweep
    a_thread.join(300)
    assert len(a_errors) == 1 and isinstance(a_errors[0], TwoPhaseError)
    ids = [i for p in sorted(out.glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]
    assert Counter(ids) == Counter(range(60))
    assert not [p for p in (out / "_twophase").rglob("*") if p.is_file()]  # nothing left staged
    a.close()
    b.close()


@pytest.mark.spark
def test_a_deposed_driver_stuck_in_its_batch_job_stops_when_its_fence_is_found(spark, tmp_path):
    """The nemesis's isolate schedule (issue 27): a driver cut off mid-batch loses its executors
    (and its master may drop its application), so its batch's job waits for resources for ever;
    its successor takes the log over.  Before: the deposed driver's heartbeat found the newer
    epoch and stopped, and the driver lingered in that job until it was killed (78 s in the
    nemesis).  Now the fence cancels the job: its write fails with LogOwnershipError, the batch
    is the successor's, once."""
    import pyarrow.parquet as pq

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    name = f"stuck{uuid.uuid4().hex[:6]}"
    started, release = tmp_path / "started", tmp_path / "release"

    class StuckA(FileSink):
        def begin_transaction(self, ctx):
            started.touch()
            deadline = time.monotonic() + 300
            while not release.exists() and time.monotonic() < deadline:  # a job that gets nowhere
                time.sleep(0.1)
            return super().begin_transaction(ctx)

    df = spark.range(0, 30, numPartitions=1)
    a = Coordinator(StuckA(str(out), writer="arrow"), log_location=log_url, name=name, parallelism=1,
                    lease_timeout=2.0)
    a_thread, a_errors = _in_thread(lambda: a.write(df, batch_id=0))
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert time.monotonic() < deadline and a_thread.is_alive(), a_errors
            time.sleep(0.1)
        # The successor takes over (A's lease is live: an operator's takeover) and writes batch 0.
        b = Coordinator(FileSink(str(out), writer="arrow"), log_location=log_url, name=name, parallelism=1,
                        takeover=True)
        b.write(df, batch_id=0)
        a_thread.join(60)  # A's heartbeat (every 0.5 s) finds the new epoch; its job is cancelled
        assert not a_thread.is_alive(), "the deposed coordinator still waits on its stuck job"
        assert len(a_errors) == 1 and isinstance(a_errors[0], LogOwnershipError), a_errors
        assert "fenced" in str(a_errors[0])
    finally:
        release.touch()
        a_thread.join(60)
    ids = [i for p in sorted(out.glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]
    assert Counter(ids) == Counter(range(30))
    a.close()
    b.close()
