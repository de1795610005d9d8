"""Issue 45, scenario 1: ``Coordinator(new_generation=True)`` left in the job's code.

The flag starts a new log generation for a query restarted from a new checkpoint.  Users keep it in
the code; the driver dies after a batch's decision and before Spark's ``commits/N``; the restarted
driver (same checkpoint, same query id, the flag still set) must commit that decision again, not
open a new generation that has never heard of batch N and write it a second time.

Without Spark (tests/inprocess.py), on a real log and real local files.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.inprocess import Driver, OneTask, ids
from twophase.log import INTENT


def _visible(out) -> Counter:
    return Counter(json.loads(line)["id"] for p in os.listdir(out) if not p.startswith("_")
                   for line in open(out / p) if line.strip())


def _decide_and_die(d: Driver, batch_id: int, rows) -> None:
    """Batch ``batch_id`` decided (PREPARED logged), then the driver dies before any commit."""
    intent = d.sink.plan_batch(d.query_name, batch_id, 1)
    opened = d.tlog.write(batch_id, INTENT, {"intent": intent, "sink": d.sink.kind, "name": d.query_name,
                                             "num_partitions": 1})
    assert d.tlog.mine(opened)
    results = OneTask(d.sink, rows).prepare(d.query_name, batch_id, intent, f"e{d.tlog.epoch}run")
    decided = d.tlog.decide(batch_id, 0, {"handles": [r["handle"] for r in results], "rows": rows.num_rows})
    assert d.tlog.mine(decided)


def test_a_new_generation_flag_kept_in_the_code_recommits_the_replayed_batch_instead_of_writing_it_twice(tmp_path):
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")

    def sink():
        return FileSink(str(out), format="jsonl")

    # First start from a new checkpoint: the flag is what the docs ask for (the log had a query before).
    old = Driver(sink(), log_url, "old-query")
    assert old.batch(0, ids(100)).action == "committed"
    old.close()
    a = Driver(sink(), log_url, "q", new_generation=True)
    generation = a.tlog.generation
    assert generation == 2
    assert a.batch(0, ids(1, 2)).action == "committed"
    _decide_and_die(a, 1, ids(3, 4))   # the driver dies after the decision of batch 1
    a.close()

    # Restarted from the same checkpoint (query "q"), the flag still in the code.
    b = Driver(sink(), log_url, "q", new_generation=True)
    try:
        b.batch(1, ids(3, 4))   # Spark replays batch 1
        b.batch(2, ids(5))
    finally:
        b.close()
    assert _visible(out) == Counter([100, 1, 2, 3, 4, 5])   # before the fix: 3 and 4 twice
    assert b.tlog.generation == generation, "a kept flag must not open another generation for the same query"


def test_a_new_generation_flag_kept_by_two_drivers_of_one_new_query_binds_them_to_one_generation(tmp_path):
    """The new query's first two drivers (a restart soon after the first start) both pass the flag:
    the second finds the generation the first created for the same query and uses it."""
    from twophase.sinks.files import FileSink

    log_url = str(tmp_path / "log")
    Driver(FileSink(str(tmp_path / "out"), format="jsonl"), log_url, "old").close()
    a = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), log_url, "new", new_generation=True)
    a.close()
    b = Driver(FileSink(str(tmp_path / "out"), format="jsonl"), log_url, "new", new_generation=True)
    b.close()
    assert a.tlog.generation == b.tlog.generation == 2
    assert [g["query_id"] for g in b.tlog.generations()] == ["old", "new"]


def test_a_replaced_query_restarted_with_the_flag_kept_is_refused_not_given_a_third_generation(tmp_path):
    """Query A decides batch 1 and dies; query B replaces it (new_generation=True), and B's recovery
    commits A's batch 1.  A restarted with the flag still in its code got generation 3 and wrote
    batch 1 again on Spark's replay (found by the review of this change).  Now a query whose
    generation was replaced never writes to the log again."""
    from twophase import QueryMismatchError
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "A", new_generation=True)
    assert a.batch(0, ids(1)).action == "committed"
    _decide_and_die(a, 1, ids(2))
    a.close()
    b = Driver(FileSink(str(out), format="jsonl"), log_url, "B", new_generation=True)
    assert b.batch(0, ids(100)).action == "committed"   # its recovery committed A's batch 1 first
    b.close()
    try:
        with pytest.raises(QueryMismatchError, match="replaced"):
            Driver(FileSink(str(out), format="jsonl"), log_url, "A", new_generation=True)
    finally:
        assert _visible(out) == Counter([1, 2, 100])
