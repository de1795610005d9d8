"""A deposed coordinator's INTENT that lands late, in the slot the new owner was about to take.

Found by the nemesis (tests/nemesis.py, the log store cut from driver d3): d3's PUT of batch 18's
INTENT was answered only after the heal, once its successor d4 (epoch 4) had taken the log over
and reached batch 18; d4's exclusive create of ballot 0 found d3's record, and d4 stopped with
"another coordinator opened ballot 0 at the same time; this one stops": the *owner's* query
failed because of a deposed driver's late write.  Now the owner closes the deposed ballot (an
abort in its decision slot, then its transactions aborted), opens the next ballot and runs the
batch; the deposed coordinator's decision then finds its slot closed.  A late INTENT of a *newer*
owner still stops the older one (``LogOwnershipError``).

Without Spark (tests/inprocess.py), on a real log and real targets: local files, PostgreSQL.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest

from tests.inprocess import Driver, OneTask, PgTable, ids
from twophase import LogOwnershipError
from twophase.log import INTENT

pytestmark = [pytest.mark.timeout(300)]


def late_intent_lands_after_the_takeover(make_sink, log_url: str) -> tuple[Driver, Driver]:
    """A commits batch 0; B takes the log over and commits batch 1 (so batch 2 is B's fast path:
    no listing before its INTENT); A's INTENT of batch 2 (ballot 0), with its task pre-committed
    under it, lands now; then B runs batch 2.  Returns (A, B)."""
    a = Driver(make_sink(), log_url, "q")
    assert a.batch(0, ids(1, 2)).action == "committed"
    b = Driver(make_sink(), log_url, "q", takeover=True)
    assert b.tlog.epoch > a.tlog.epoch
    assert b.batch(1, ids(3)).action == "committed"
    # A, paused before batch 2's INTENT was answered: it lands now, and A's task pre-commits.
    intent = a.sink.plan_batch(a.query_name, 2, 1)
    opened = a.tlog.write(2, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                      "num_partitions": 1}, ballot=0)
    assert a.tlog.mine(opened)
    a_results = OneTask(a.sink, ids(4, 5)).prepare(a.query_name, 2, intent, f"e{a.tlog.epoch}late")
    assert b.batch(2, ids(4, 5)).action == "committed"
    # A's decision, late too, finds its slot closed by B.
    decided = a.tlog.decide(2, 0, {"handles": [r["handle"] for r in a_results], "rows": 2})
    assert not a.tlog.mine(decided) and decided.body.get("outcome") == "abort", decided.body
    ballots = b.tlog.view(2).ballots
    assert [(x.ballot, x.decision is not None and x.decision.aborted) for x in ballots] == [(0, True), (1, False)]
    return a, b


def test_a_deposed_coordinators_late_intent_in_the_owners_slot_is_closed_and_the_batch_runs_files(tmp_path):
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a, b = late_intent_lands_after_the_takeover(lambda: FileSink(str(out), format="jsonl"), str(tmp_path / "log"))
    try:
        rows = Counter(json.loads(line)["id"] for p in os.listdir(out) if not p.startswith("_")
                       for line in open(out / p) if line.strip())
        assert rows == Counter([1, 2, 3, 4, 5])
        staged = [f for _, _, fs in os.walk(out / "_twophase") for f in fs] if (out / "_twophase").exists() else []
        assert staged == [], staged  # A's pre-committed file of its closed ballot was aborted
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_a_deposed_coordinators_late_intent_in_the_owners_slot_is_closed_and_the_batch_runs_postgres(
        postgres_service, tmp_path):
    with PgTable(postgres_service["dsn"], "lateint") as t:
        a, b = late_intent_lands_after_the_takeover(t.sink, str(tmp_path / "log"))
        try:
            assert t.ids() == [1, 2, 3, 4, 5]
            assert t.prepared() == []  # A's prepared transaction of its closed ballot was rolled back
        finally:
            a.close()
            b.close()


def test_a_newer_owners_intent_in_the_slot_stops_the_older_coordinator(tmp_path):
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q")
    assert a.batch(0, ids(1)).action == "committed"
    b = Driver(FileSink(str(out), format="jsonl"), str(tmp_path / "log"), "q", takeover=True)
    intent = b.sink.plan_batch(b.query_name, 1, 1)
    assert b.tlog.mine(b.tlog.write(1, INTENT, {"intent": intent, "sink": b.sink.kind, "name": b.query_name,
                                                "num_partitions": 1}, ballot=0))
    # A is on its fast path for batch 1 (it committed batch 0): its create finds B's INTENT.
    with pytest.raises(LogOwnershipError, match="stops without writing"):
        a.batch(1, ids(2))
    assert b.tlog.view(1).ballots[0].decision is None  # A closed nothing of the newer owner's
    a.close()
    b.close()


def a_late_decision_lands_while_the_owner_reads_again_after_a_late_intent(make_sink, log_url: str):
    """Issue 45, scenario 3.  A (the older epoch: a paused driver, or the data source form's earlier
    run, whose commit step decides with no epoch check) and B (the owner) both run batch 2.  A's
    INTENT of ballot 0 lands late, just before B's: B's create finds it and B reads the batch again;
    A's decision of ballot 0 lands in between.  B must commit that decision, not open ballot 1 and
    decide the batch a second time.  Returns (A, B)."""
    from twophase.recovery import Committer

    a = Driver(make_sink(), log_url, "q")
    assert a.batch(0, ids(1, 2)).action == "committed"
    b = Driver(make_sink(), log_url, "q", takeover=True)
    assert b.batch(1, ids(3)).action == "committed"
    held: dict = {}
    write = b.tlog.write

    def b_write(batch_id, state, payload, generation=None, ballot=0):
        if state != INTENT or batch_id != 2 or held:
            return write(batch_id, state, payload, generation=generation, ballot=ballot)
        # A's INTENT (ballot 0) lands first, and A's task pre-commits under it.
        intent = a.sink.plan_batch(a.query_name, 2, 1)
        mine = a.tlog.write(2, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                        "num_partitions": 1}, ballot=0)
        assert a.tlog.mine(mine)
        results = OneTask(a.sink, ids(4, 5)).prepare(a.query_name, 2, intent, f"e{a.tlog.epoch}late")
        found = write(batch_id, state, payload, generation=generation, ballot=ballot)   # B's: finds A's
        assert not b.tlog.mine(found)
        # A's decision lands before B reads the batch again.
        held["decision"] = a.tlog.decide(2, 0, {"handles": [r["handle"] for r in results], "rows": 2})
        assert a.tlog.mine(held["decision"])
        return found

    b.tlog.write = b_write  # type: ignore[method-assign]
    b.batch(2, ids(4, 5))
    # A goes on: it commits what it decided (idempotent beside B's commit of the same decision).
    Committer(a.sink, backoff=0.01).commit(2, [a.sink.decode_handle(h) for h in held["decision"].handles],
                                           recovering=False)
    decided = [x.ballot for x in b.tlog.view(2).ballots if x.committed]
    assert decided == [0], f"ballots decided 'commit': {decided}"
    return a, b


def test_a_late_decision_racing_the_owners_reread_after_a_late_intent_is_committed_once_files(tmp_path):
    from twophase.sinks.files import FileSink

    out = tmp_path / "out"
    a, b = a_late_decision_lands_while_the_owner_reads_again_after_a_late_intent(
        lambda: FileSink(str(out), format="jsonl"), str(tmp_path / "log"))
    try:
        rows = Counter(json.loads(line)["id"] for p in os.listdir(out) if not p.startswith("_")
                       for line in open(out / p) if line.strip())
        assert rows == Counter([1, 2, 3, 4, 5])
    finally:
        a.close()
        b.close()


@pytest.mark.postgres
def test_a_late_decision_racing_the_owners_reread_after_a_late_intent_is_committed_once_postgres(
        postgres_service, tmp_path):
    with PgTable(postgres_service["dsn"], "latedec") as t:
        a, b = a_late_decision_lands_while_the_owner_reads_again_after_a_late_intent(t.sink, str(tmp_path / "log"))
        try:
            assert t.ids() == [1, 2, 3, 4, 5]
            assert t.prepared() == []
        finally:
            a.close()
            b.close()
