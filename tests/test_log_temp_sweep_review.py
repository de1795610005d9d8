"""Review R6: the temp-file sweep in ``TransactionLog.prune`` (a record's hidden temp file of a pruned
batch is deleted with the batch's records).

Each test puts a late writer, a second pruner or a look-alike name next to the sweep for real (local
store in tmp_path, HDFS through the ``hdfs_service`` fixture) and checks what each side sees.  The
finding (a late write to a filled slot whose temp file the sweep deleted got "whether it landed is
unknown" instead of the slot's record) is fixed: the stores' ``create`` takes a vanished temp file
for "not created", and the write reads the slot again; the rest held.
"""

from __future__ import annotations

import os
import uuid

import pytest

from twophase.errors import LogOwnershipError
from twophase.log import COMMITTED, INTENT, TransactionLog, temp_record_name

G = "g0001"


def _owner_and_deposed(url: str, **kw) -> tuple[TransactionLog, TransactionLog]:
    """(owner, deposed): the deposed coordinator acquired first; the owner took the log over."""
    deposed = TransactionLog(url, retain_batches=1, **kw)
    deposed.acquire("q-1", "test")
    owner = TransactionLog(url, retain_batches=1, **kw)
    owner.acquire("q-1", "test", takeover=True)
    assert owner.generation == deposed.generation == 1
    return owner, deposed


def _commit(tlog: TransactionLog, b: int) -> None:
    tlog.write(b, INTENT, {"intent": {}})
    tlog.decide(b, 0, {"handles": []})
    tlog.write(b, COMMITTED, {})


def _batch_files(tlog: TransactionLog, b: int) -> list[str]:
    """Every name of batch ``b`` in the generation folder, records and temp files alike."""
    return [n for n in tlog.store.list(G, hidden=True) if f"batch-{b:012d}." in n]


def _sweep_after_temp(monkeypatch, writer: TransactionLog, owner: TransactionLog, committed: int) -> list[str]:
    """Run the owner's prune right after the writer's temp file exists and before its link/rename
    (a writer paused between the two lines).  Returns the temp names the writer made."""
    made: list[str] = []
    real = writer.store._write_tmp

    def write_tmp(path, data):
        tmp = real(path, data)
        made.append(os.path.basename(tmp))
        if len(made) == 1:  # once (the owner's prune writes its low-water file through a store too)
            assert os.path.exists(tmp)
            owner.prune(committed)
        return tmp

    monkeypatch.setattr(writer.store, "_write_tmp", write_tmp)
    return made


# ------------------------------------------------------------------------------------- local
def test_late_decision_whose_temp_is_swept_fails_cleanly_and_lands_nothing(tmp_path, monkeypatch):
    """A deposed coordinator's decision for a batch the owner committed and now prunes: the sweep
    deletes its temp file between write and link.  It must fail (an error), never land, never
    return a record; nothing of the batch is left."""
    owner, deposed = _owner_and_deposed(str(tmp_path / "log"))
    for b in range(4):
        _commit(owner, b)
    made = _sweep_after_temp(monkeypatch, deposed, owner, committed=3)
    with pytest.raises(LogOwnershipError, match="committed and its records pruned meanwhile"):
        deposed.decide(0, 1, {"handles": [{"sink": "x"}]})  # ballot 1: its slot was never filled
    assert len(made) == 1 and temp_record_name(made[0]) == "batch-000000000000.prepared.1.json"
    assert _batch_files(owner, 0) == []  # record, temp and the owner's records all gone
    assert owner.is_pruned(0, fresh=True)
    assert sorted(owner.batches()) == [3]


class _Paused(Exception):
    pass


def _pause_before_record_deletes(monkeypatch, owner: TransactionLog) -> None:
    """The owner's prune stops (a pause longer than anything, or a SIGKILL) right after its sweep,
    before it deletes the first record."""
    real = owner.store.delete

    def delete(name):
        if name.startswith(f"{G}/batch-"):
            raise _Paused(name)
        real(name)

    monkeypatch.setattr(owner.store, "delete", delete)


def test_late_decision_on_a_filled_slot_whose_temp_is_swept_still_sees_the_slots_record(tmp_path, monkeypatch):
    owner, deposed = _owner_and_deposed(str(tmp_path / "log"))
    for b in range(4):
        _commit(owner, b)
    _pause_before_record_deletes(monkeypatch, owner)
    real = deposed.store._write_tmp

    def write_tmp(path, data):
        tmp = real(path, data)
        with pytest.raises(_Paused):
            owner.prune(3)  # sweeps batches 0-2's temp files (this one too), then pauses
        return tmp

    monkeypatch.setattr(deposed.store, "_write_tmp", write_tmp)
    got = deposed.decide(0, 0, {"handles": [{"sink": "x"}]})  # ballot 0's slot holds the owner's decision
    assert not deposed.mine(got) and got.body["outcome"] == "commit" and got.body["writer"] == owner.owner


def test_sweep_spares_every_temp_file_that_is_not_a_pruned_batchs(tmp_path, monkeypatch):
    """Only temp files of the batches this prune deletes go: not the batch just committed, a kept
    one, an uncommitted one, look-alike names, another generation's or the low-water folder's; and
    a live writer of an uncommitted batch paused between its temp file and its link still lands."""
    owner, writer = _owner_and_deposed(str(tmp_path / "log"))
    root = tmp_path / "log"
    hexa = uuid.uuid4().hex
    keep = [f".batch-{b:012d}.prepared.json.{hexa}.tmp" for b in (3, 9)]  # just committed; uncommitted
    keep += [f".batch-000000000000.prepared.json.{hexa.upper()}.tmp",          # not a uuid4().hex tag
             f".batch-000000000000.prepared.json.{hexa[:31]}.tmp",
             ".batch-000000000000.prepared.json.tmp",
             f".batch-000000000000.json.{hexa}.tmp",
             f".low-water.json.{hexa}.tmp", f"batch-000000000000.prepared.json.{hexa}.tmp"]
    gone = [f".batch-{b:012d}.{s}.json.{uuid.uuid4().hex}.tmp" for b in (0, 1, 2) for s in ("intent", "prepared")]
    gone.append(f".batch-000000000001.prepared.2.json.{uuid.uuid4().hex}.tmp")
    for b in range(4):
        _commit(owner, b)
    (root / G).mkdir(exist_ok=True)
    for n in keep + gone:
        (root / G / n).write_bytes(b"half")
    for other in ("g0002", f"{G}/low-water"):
        (root / other).mkdir(exist_ok=True)
        (root / other / f".batch-000000000000.prepared.json.{hexa}.tmp").write_bytes(b"half")
    # batch 9 is uncommitted: its live writer pauses between its temp file and its link while the
    # owner prunes (retain 1: batches 0-2 go, 3 is the one just committed)
    made = _sweep_after_temp(monkeypatch, writer, owner, committed=3)
    rec = writer.write(9, INTENT, {"intent": {}})
    assert writer.mine(rec) and owner.state(9).state == INTENT and len(made) == 1
    left = set(os.listdir(root / G))
    assert sorted(set(keep) - left) == []      # every look-alike and every temp of a kept batch stays
    assert sorted(set(gone) & left) == []      # every temp of a pruned batch went
    assert (root / "g0002" / f".batch-000000000000.prepared.json.{hexa}.tmp").exists()
    assert (root / G / "low-water" / f".batch-000000000000.prepared.json.{hexa}.tmp").exists()
    assert sorted(owner.batches()) == [3, 9]


def test_two_pruners_deleting_one_temp_file_both_succeed(tmp_path, monkeypatch):
    """A second pruner deletes the temp file between this one's listing and its delete: no error
    (prune runs after a commit; an error there fails a batch that committed)."""
    owner, deposed = _owner_and_deposed(str(tmp_path / "log"))
    for b in range(4):
        _commit(owner, b)
    temp = tmp_path / "log" / G / f".batch-000000000001.intent.json.{uuid.uuid4().hex}.tmp"
    temp.write_bytes(b"half")
    real = owner.store.list

    def listing(folder, hidden=False):
        names = real(folder, hidden)
        if hidden:
            assert deposed.prune(3) == 9  # the other pruner runs to the end, temp file included
        return names

    monkeypatch.setattr(owner.store, "list", listing)
    owner.prune(3)  # raises nothing (its count is of the names it listed, gone or not)
    assert not temp.exists()
    assert sorted(owner.batches()) == [3] and owner.is_pruned(2, fresh=True)


# -------------------------------------------------------------------------------------- HDFS
def test_hdfs_late_decision_whose_temp_is_swept_fails_cleanly_and_lands_nothing(hdfs_service, monkeypatch):
    """HDFS: the sweep deletes the temp file between the writer's write and its rename2: the rename
    fails (FileNotFoundException), the write raises, nothing lands and nothing is left."""
    from hdfs import InsecureClient

    path = f"/twophase-test/r6-{uuid.uuid4().hex[:10]}"
    opts = {"webhdfs_url": hdfs_service["webhdfs_url"], "user": hdfs_service["user"]}
    try:
        owner, deposed = _owner_and_deposed(f"{hdfs_service['namenode']}{path}/log", storage_options=opts)
        for b in range(4):
            _commit(owner, b)
        real = deposed.store.storage.write_bytes
        seen: list[str] = []

        def write_bytes(p, data):
            real(p, data)
            if not seen:
                seen.append(p)
                owner.prune(3)

        monkeypatch.setattr(deposed.store.storage, "write_bytes", write_bytes)
        with pytest.raises(LogOwnershipError, match="committed and its records pruned meanwhile"):
            deposed.decide(0, 1, {"handles": [{"sink": "x"}]})
        assert len(seen) == 1 and temp_record_name(seen[0].rsplit("/", 1)[1])
        assert _batch_files(owner, 0) == [] and sorted(owner.batches()) == [3]
    finally:
        InsecureClient(hdfs_service["webhdfs_url"], user=hdfs_service["user"]).delete(path, recursive=True)
