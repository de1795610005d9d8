"""Issue 45, scenario 5: a fenced coordinator that is used again.

A ``Coordinator`` object found fenced (a newer coordinator took its log over) kept its fenced log
and never ran again in its process, even after the newer one was gone; and a fenced protocol's
retry first ran recovery under its stale epoch, closing the owner's open ballot (the owner's
decision was then refused, and its batch ran again).  Now recovery never closes a ballot whose
INTENT names a newer epoch (the INTENT is written once: no check-then-act), and a fenced
``Coordinator`` takes the log anew at its next batch: refused while the newer owner lives, its
own again once that one is gone.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.inprocess import Driver, OneTask, ids
from twophase import LogOwnershipError
from twophase.protocol import BatchProgress


def _visible(out) -> Counter:
    return Counter(json.loads(line)["id"] for p in os.listdir(out) if p.endswith(".jsonl")
                   for line in open(out / p) if line.strip())


def test_a_deposed_coordinators_recovery_leaves_the_owners_open_ballot_alone(tmp_path):
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    assert a.batch(0, ids(1)).action == "committed"
    b = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
    try:
        # B (the owner) opens batch 1's ballot, and its task pre-commits; B pauses before deciding.
        prog = BatchProgress("pipe", 1, None, "committed")
        opened = b.protocol.open_ballot(1, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(b.sink, ids(2, 3)).prepare(opened.query_name, 1, opened.intent, opened.run)
        # A, deposed but not told so (its heartbeat has not run), retries after a failure: recovery.
        a.protocol.dirty = True
        with pytest.raises(LogOwnershipError, match="newer than this one"):
            a.protocol.recover()
        assert b.tlog.view(1).ballots[-1].open, "the deposed coordinator closed the owner's ballot"
        b.protocol.decide_and_commit(opened, results, prog)   # was: refused, the batch ran again
        assert _visible(out) == Counter([1, 2, 3])
    finally:
        a.close()
        b.close()


@pytest.mark.spark
def test_a_fenced_coordinator_object_runs_again_once_the_newer_owner_is_gone(spark, tmp_path):
    from twophase.coordinator import Coordinator
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    c1 = Coordinator(FileSink(str(out), format="jsonl"), log_location=log_url, name="daily")
    c1.write(spark.range(0, 10, 1, 1), batch_id=0)
    c2 = Coordinator(FileSink(str(out), format="jsonl"), log_location=log_url, name="daily", takeover=True)
    c2.write(spark.range(10, 20, 1, 1), batch_id=1)
    # c1 learns it was fenced at its next batch: refused, nothing written.
    with pytest.raises(LogOwnershipError, match="was fenced"):
        c1.write(spark.range(20, 30, 1, 1), batch_id=2)
    assert c1.log is not None and c1.log.fenced
    c2.close()
    # c2 is gone: c1 takes the log again (a new epoch) and writes.  Was: fenced for ever.  (A lease
    # holder that lives in another process refuses it meanwhile: tests/test_ownership_processes.py.)
    assert c1.write(spark.range(20, 30, 1, 1), batch_id=2)["action"] == "committed"
    assert c1.log.epoch == 3 and not c1.log.fenced
    c1.close()
    assert _visible(out) == Counter(range(30))
