"""Unit tests of the transaction log: atomic records, fencing, corruption, retention, query binding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from twophase.errors import (
    ConfigurationError,
    CorruptLogError,
    LogOwnershipError,
    QueryMismatchError,
)
from twophase.log import COMMITTED, INTENT, PREPARED, LocalStore, TransactionLog, encode_record


def make_log(tmp_path, **kw) -> TransactionLog:
    tlog = TransactionLog(str(tmp_path / "log"), **kw)
    tlog.acquire("q-1", "test")
    return tlog


def test_records_round_trip_and_state_order(tmp_path):
    tlog = make_log(tmp_path)
    assert tlog.state(0) is None
    tlog.write(0, INTENT, {"intent": {"staging": "/x"}})
    assert tlog.state(0).state == INTENT
    tlog.write(0, PREPARED, {"handles": [{"sink": "files", "v": 1, "data": {"a": 1}}], "rows": 3})
    st = tlog.state(0)
    assert st.state == PREPARED and st.handles[0]["data"] == {"a": 1} and st.body["rows"] == 3
    tlog.write(0, COMMITTED, {})
    st = tlog.state(0)
    assert st.state == COMMITTED and st.handles[0]["data"] == {"a": 1}


def test_records_are_never_overwritten(tmp_path):
    tlog = make_log(tmp_path)
    first = tlog.write(5, PREPARED, {"handles": [], "rows": 1})
    second = tlog.write(5, PREPARED, {"handles": [], "rows": 999})
    assert second.body["rows"] == 1 and first.body["rows"] == 1


def test_local_store_create_is_exclusive_and_leaves_no_temp_files(tmp_path):
    store = LocalStore(str(tmp_path / "s"))
    assert store.create("a/b.json", b"1") is True
    assert store.create("a/b.json", b"2") is False
    assert store.read("a/b.json") == b"1"
    store.replace("a/b.json", b"3")
    assert store.read("a/b.json") == b"3"
    assert sorted(os.listdir(tmp_path / "s" / "a")) == ["b.json"]


@pytest.mark.parametrize("garbage", [b"{not json", b'{"format": "twophase-log", "version": 1}', b"\xff\xfe"])
def test_corrupt_record_stops_with_file_name_and_advice(tmp_path, garbage):
    tlog = make_log(tmp_path)
    tlog.write(3, PREPARED, {"handles": [], "rows": 0})
    path = tmp_path / "log" / "g0001" / "batch-000000000003.prepared.json"
    path.write_bytes(garbage)
    with pytest.raises(CorruptLogError) as e:
        tlog.state(3)
    msg = str(e.value)
    assert str(path) in msg and "do NOT delete" in msg and "batch 3" in msg


def test_checksum_catches_an_edited_record(tmp_path):
    tlog = make_log(tmp_path)
    tlog.write(1, PREPARED, {"handles": [{"sink": "files", "v": 1, "data": {"size": 10}}], "rows": 10})
    path = tmp_path / "log" / "g0001" / "batch-000000000001.prepared.json"
    obj = json.loads(path.read_text())
    obj["body"]["rows"] = 11  # valid JSON, wrong content
    path.write_text(json.dumps(obj))
    with pytest.raises(CorruptLogError, match="checksum mismatch"):
        tlog.state(1)


def test_a_renamed_record_is_detected(tmp_path):
    tlog = make_log(tmp_path)
    tlog.write(1, INTENT, {"intent": {}})
    d = tmp_path / "log" / "g0001"
    os.rename(d / "batch-000000000001.intent.json", d / "batch-000000000002.intent.json")
    with pytest.raises(CorruptLogError, match="moved or renamed"):
        tlog.state(2)


def test_second_live_coordinator_is_refused(tmp_path):
    make_log(tmp_path)  # this process holds the lease
    # Another process on this host while we are alive: refused.
    code = (
        "import sys; from twophase.log import TransactionLog; from twophase.errors import LogOwnershipError\n"
        f"t = TransactionLog({str(tmp_path / 'log')!r})\n"
        "try:\n    t.acquire('q-1', 'other')\nexcept LogOwnershipError as e:\n    print('REFUSED', e); sys.exit(3)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "owned by a live coordinator" in r.stdout


def test_dead_owner_is_taken_over_and_old_owner_is_fenced(tmp_path):
    url = str(tmp_path / "log")
    # A process that acquires and dies: its pid no longer exists, so a new coordinator may take over.
    subprocess.run([sys.executable, "-c",
                    f"from twophase.log import TransactionLog; TransactionLog({url!r}).acquire('q-1', 'dead')"],
                   check=True)
    old = TransactionLog(url)
    old.acquire("q-1", "a")
    new = TransactionLog(url)
    new.acquire("q-1", "b")  # same pid as `old`: an earlier coordinator object in this process
    assert new.epoch == old.epoch + 1
    with pytest.raises(LogOwnershipError, match="fenced"):
        old.check_fence()  # the early exit before a decision; the ballot's slot is the fence
    with pytest.raises(LogOwnershipError, match="fenced"):
        old.heartbeat()    # and a deposed coordinator never overwrites its successor's lease
    assert new.lease().epoch == new.epoch
    new.decide(0, 0, {"handles": []})  # the newer owner may decide


def test_fence_listeners_are_told_once_by_the_heartbeat_or_the_fence_check(tmp_path):
    """A deposed coordinator's listeners (the coordinator cancels its batch's Spark job) are
    called once, by whichever finds the fence first: the heartbeat thread, or check_fence; a
    listener registered after that is called at once; a failing listener hides nothing."""
    url = str(tmp_path / "log")
    old = TransactionLog(url, lease_timeout=0.4)  # heartbeat every 0.1 s
    old.acquire("q-1", "a")
    told: list[str] = []
    fired = threading.Event()
    old.on_fenced(lambda: 1 / 0)
    old.on_fenced(lambda: (told.append("first"), fired.set()))
    old.start_heartbeat()
    assert not old.fenced
    time.sleep(0.5)
    assert told == [] and not old.fenced  # its own beats are not a fence
    new = TransactionLog(url)
    new.acquire("q-1", "b", takeover=True)
    assert fired.wait(10), "the heartbeat did not find the newer epoch"
    assert old.fenced
    with pytest.raises(LogOwnershipError, match="fenced"):
        old.check_fence()
    assert told == ["first"]  # once
    old.on_fenced(lambda: told.append("late"))
    assert told == ["first", "late"]
    old.close()
    new.close()


def test_a_ballot_is_decided_once_and_a_late_decision_loses_to_the_close(tmp_path):
    """Scenario 2 at the log's level: a decision created after its ballot was closed as aborted
    is refused by the storage (exclusive create), and the writer can tell."""
    url = str(tmp_path / "log")
    old = TransactionLog(url)
    old.acquire("q-1", "a")
    old.write(4, INTENT, {"intent": {}, "name": "a"})
    new = TransactionLog(url)
    new.acquire("q-1", "b", takeover=True)
    closed = new.close_ballot(4, 0, "re-run")
    assert new.mine(closed) and closed.aborted
    late = old.decide(4, 0, {"handles": [{"sink": "x", "v": 1, "data": {}}]})  # the delayed PUT lands
    assert not old.mine(late) and late.aborted
    assert new.view(4).decision is None and new.state(4).state == INTENT
    # The next ballot decides; closing it afterwards finds the decision and keeps it.
    assert new.mine(new.write(4, INTENT, {"intent": {}, "name": "b"}, ballot=1))
    assert new.mine(new.decide(4, 1, {"handles": [], "rows": 7}))
    again = old.close_ballot(4, 1, "late close")
    assert not again.aborted and again.body["rows"] == 7
    view = new.view(4)
    assert [b.ballot for b in view.ballots] == [0, 1] and view.decision.ballot == 1
    assert new.state(4).state == PREPARED


def test_log_of_another_query_is_refused_unless_new_generation(tmp_path):
    url = str(tmp_path / "log")
    t1 = TransactionLog(url)
    t1.acquire("query-A", "x")
    t1.write(0, COMMITTED, {})
    t2 = TransactionLog(url)
    with pytest.raises(QueryMismatchError, match="checkpoint was probably deleted"):
        t2.acquire("query-B", "x")
    t3 = TransactionLog(url)
    t3.acquire("query-B", "x", new_generation=True)
    assert t3.generation == 2 and t3.state(0) is None  # batch ids restart: nothing is skipped
    assert t3.record(0, COMMITTED, generation=1) is not None  # the old generation is kept


def test_retention_keeps_recent_and_uncommitted_batches(tmp_path):
    tlog = make_log(tmp_path, retain_batches=3)
    for b in range(10):
        tlog.write(b, INTENT, {"intent": {}})
        tlog.write(b, PREPARED, {"handles": []})
        if b != 2:
            tlog.write(b, COMMITTED, {})
        tlog.prune(b)
    left = tlog.batches()
    assert sorted(left) == [2, 7, 8, 9]  # the last 3 committed, and the uncommitted one
    assert COMMITTED not in left[2] and PREPARED in left[2]  # undecided/uncommitted never pruned
    # The log keeps which batches it pruned: the pending one is not among them (a record found in a
    # pruned batch is a deposed coordinator's late write; batch 2's are not).
    reader = make_log(tmp_path, retain_batches=3)
    reader.generation = tlog.generation
    assert reader.pruned(fresh=True) == [[0, 1], [3, 6]] and not reader.is_pruned(2)
    tlog.write(2, COMMITTED, {})
    tlog.prune(9)
    assert sorted(tlog.batches()) == [7, 8, 9] and reader.pruned(fresh=True) == [[0, 6]]
    assert len(tlog.store.list(f"g{tlog.generation:04d}/low-water")) == 1  # one file holds the union


def test_a_killed_writers_temp_records_go_with_their_pruned_batch(tmp_path):
    """A driver SIGKILLed between a record's temp file and its rename leaves the temp file (CI saw
    ``.batch-000000000004.prepared.json.<uuid>.tmp`` on HDFS).  It is never read as a record, and
    prune deletes those of the batches it prunes; a temp of a batch still kept stays."""
    tlog = make_log(tmp_path, retain_batches=2)
    folder = tmp_path / "log" / f"g{tlog.generation:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    temp = {b: folder / f".batch-{b:012d}.prepared.json.{os.urandom(16).hex()}.tmp" for b in (0, 4)}
    for t in temp.values():
        t.write_bytes(b"half a rec")
    other = folder / ".notes.tmp"  # not a record's temp file: never ours to delete
    other.write_bytes(b"x")
    for b in range(5):
        tlog.write(b, INTENT, {"intent": {}})
        tlog.write(b, PREPARED, {"handles": []})
        tlog.write(b, COMMITTED, {})
        assert set(tlog.batches()[b]) == {INTENT, PREPARED, COMMITTED}  # the temp file is no record
        tlog.prune(b)
    assert sorted(tlog.batches()) == [3, 4]
    assert not temp[0].exists()  # batch 0 was pruned: its temp file went with it
    assert temp[4].exists() and other.exists()  # batch 4 is kept: its temp file too
    from twophase.log import temp_record_name
    assert temp_record_name(temp[4].name) == "batch-000000000004.prepared.json"
    assert temp_record_name(".batch-000000000004.prepared.json.tmp") is None
    assert temp_record_name(other.name) is None


def test_object_store_without_exclusive_create_is_refused(tmp_path):
    # (S3 is accepted only where the endpoint honours conditional writes: tests/test_files_remote.py.)
    for url in ("gs://bucket/log", "abfs://container/log"):
        with pytest.raises(ConfigurationError, match="atomic exclusive create"):
            TransactionLog(url)


def test_records_are_valid_json_with_checksum(tmp_path):
    data = encode_record({"a": 1})
    obj = json.loads(data)
    assert obj["format"] == "twophase-log" and len(obj["sha256"]) == 64


def test_per_batch_heartbeat_writes_the_lease_at_most_every_quarter_timeout(tmp_path, monkeypatch):
    import twophase.log_ownership as tlog_mod  # the heartbeat reads its clock there

    clock = [1000.0]
    monkeypatch.setattr(tlog_mod.time, "time", lambda: clock[0])
    log = TransactionLog(str(tmp_path / "log"), lease_timeout=120.0)
    log.acquire("q-1", "test")
    first = log.lease().heartbeat_at
    clock[0] += 29.0
    log.heartbeat(force=False)          # a batch 29 s later: the lease is fresh enough
    assert log.lease().heartbeat_at == first
    clock[0] += 2.0
    log.heartbeat(force=False)          # 31 s > 120/4: written
    assert log.lease().heartbeat_at == first + 31.0
    clock[0] += 1.0
    log.heartbeat()                     # forced: always written
    assert log.lease().heartbeat_at == first + 32.0


def test_short_write_of_a_prepared_record_is_completed_not_linked_truncated(tmp_path, monkeypatch):
    """os.write may write fewer bytes than asked (a nearly full disk): the record is written whole."""
    tlog = make_log(tmp_path)
    real_write = os.write

    def short_write(fd, data):
        return real_write(fd, bytes(data[: max(1, len(data) // 3)]))

    monkeypatch.setattr(os, "write", short_write)
    tlog.write(4, PREPARED, {"handles": [{"sink": "files", "v": 1, "data": {"x": "y" * 500}}], "rows": 9})
    monkeypatch.undo()
    st = tlog.state(4)  # would be CorruptLogError with a truncated record
    assert st.state == PREPARED and st.body["rows"] == 9


@pytest.fixture
def tiny_fs(tmp_path):
    """A 64 KiB tmpfs: a disk that fills up (needs root, as CI and this project's machines run)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_full_disk_prepared_record_fails_and_leaves_no_record(tiny_fs):
    from twophase.errors import LogError

    tlog = TransactionLog(str(tiny_fs / "log"))
    tlog.acquire("q-1", "test")
    big = {"handles": [{"sink": "files", "v": 1, "data": {"blob": "z" * 200_000}}], "rows": 1}
    with pytest.raises(LogError, match="disk full"):
        tlog.write(7, PREPARED, big)
    assert tlog.state(7) is None  # no record, and certainly no corrupt one
    assert not [n for n in os.listdir(tiny_fs / "log" / "g0001") if n.endswith(".tmp")]
    tlog.write(7, PREPARED, {"handles": [], "rows": 1})  # room for a small one: the log still works
    assert tlog.state(7).body["rows"] == 1


def test_a_record_the_store_did_not_answer_is_a_clear_log_error_naming_batch_and_record(tmp_path):
    """The log store times out on the decision's write (a partition, tests/nemesis.py): the
    coordinator sees a LogUnavailableError naming the batch, the record and the log's location,
    saying the outcome is unknown, not the store's own exception."""
    from twophase import LogUnavailableError
    from twophase.log import PREPARED

    log = TransactionLog(str(tmp_path / "log"))
    log.acquire("q", "pipe")
    real = log.store.create

    def timing_out(name, data):
        if ".prepared" in name:
            raise TimeoutError("read timed out")
        return real(name, data)

    log.store.create = timing_out  # type: ignore[method-assign]
    with pytest.raises(LogUnavailableError) as e:
        log.decide(7, 0, {"handles": [], "rows": 0})
    msg = str(e.value)
    assert "batch 7: the decision could not be written to" in msg and "batch-000000000007.prepared" in msg, msg
    assert "TimeoutError: read timed out" in msg and "unknown" in msg, msg
    assert isinstance(e.value.__cause__, TimeoutError)
    assert log.record(7, PREPARED) is None
