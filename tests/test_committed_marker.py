"""Issue 29: a streaming batch's COMMITTED record is written off the batch's critical path.

Once every handle of a batch is committed, the batch is visible and done; its COMMITTED record only
spares a replay the recommit (idempotent).  The coordinator's streaming batches therefore write it
in the background, while Spark logs its own commit and plans the next batch, and the next batch
waits for it before it opens.  These tests hold that write, fail it, and end the process while it
is in flight, on a real transaction log and FileSink's real target folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.inprocess import Driver, ids
from twophase.log import COMMITTED, INTENT

REPO = Path(__file__).resolve().parent.parent


def _rows(out: Path) -> list[int]:
    return sorted(json.loads(line)["id"] for p in out.glob("*.jsonl") for line in p.read_text().splitlines())


def _driver(tmp_path: Path) -> Driver:
    from twophase.sinks.files import FileSink

    d = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), str(tmp_path / "log"), "q1")
    d.protocol.committed_in_background = True  # as Coordinator sets it for streaming batches
    return d


def _hold_committed(d: Driver, *, fail: bool = False) -> threading.Event:
    """Hold (or fail, once released) the driver's COMMITTED writes until the returned event is set."""
    release, write = threading.Event(), d.tlog.write

    def held(batch_id, state, *args, **kw):
        if state == COMMITTED:
            assert release.wait(60), "never released"
            if fail:
                raise OSError("the log store did not answer")
        return write(batch_id, state, *args, **kw)

    d.tlog.write = held  # type: ignore[method-assign]
    return release


def test_a_batch_returns_before_its_committed_record_and_the_next_batch_waits_for_it(tmp_path):
    d = _driver(tmp_path)
    try:
        release = _hold_committed(d)
        d.batch(0, ids(1, 2, 3))
        # Returned with the record still held: the rows are visible, the batch not yet marked.
        assert _rows(tmp_path / "out") == [1, 2, 3]
        assert d.tlog.view(0).committed is None
        nxt = threading.Thread(target=d.batch, args=(1, ids(4, 5)))
        nxt.start()
        time.sleep(1.0)
        assert d.tlog.record(1, INTENT) is None, "batch 1 opened before batch 0's COMMITTED record was written"
        release.set()
        nxt.join(30)
        assert not nxt.is_alive()
        assert d.tlog.view(0).committed is not None and d.tlog.record(1, INTENT) is not None
        d.protocol.settle()
        assert d.tlog.view(1).committed is not None
        assert _rows(tmp_path / "out") == [1, 2, 3, 4, 5]
    finally:
        d.close()


def test_a_committed_record_that_fails_in_the_background_is_written_by_recovery_before_the_next_batch(tmp_path):
    d = _driver(tmp_path)
    try:
        release = _hold_committed(d, fail=True)
        d.batch(0, ids(1, 2, 3))
        release.set()
        d.tlog.write = type(d.tlog).write.__get__(d.tlog)  # type: ignore[method-assign]  # the store answers again
        prog = d.batch(1, ids(4, 5))
        assert prog.action == "committed"
        # Recovery found batch 0 decided without its record: committed it again (all "already") and wrote it.
        assert d.tlog.view(0).committed is not None
        assert _rows(tmp_path / "out") == [1, 2, 3, 4, 5]
    finally:
        d.close()


@pytest.mark.timeout(120)
def test_a_driver_that_ends_right_after_its_last_batch_still_writes_that_batchs_committed_record(tmp_path):
    """The record's thread is not a daemon: an interpreter that exits after the last batch waits
    for it, so the batch is not left to be recommitted by the next run."""
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from tests.test_committed_marker import _driver
from tests.inprocess import ids
from twophase.log import COMMITTED
from pathlib import Path
d = _driver(Path({str(tmp_path)!r}))
write = d.tlog.write
def slow(batch_id, state, *a, **kw):
    if state == COMMITTED:
        time.sleep(2.0)
    return write(batch_id, state, *a, **kw)
d.tlog.write = slow
d.batch(0, ids(1, 2))
print("returned", flush=True)
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100, cwd=REPO)
    assert r.returncode == 0 and "returned" in r.stdout, r.stderr[-3000:]
    from twophase.log import TransactionLog

    assert TransactionLog(str(tmp_path / "log")).view(0, generation=1).committed is not None
