"""Issue 45, scenarios 6 and 7: late writes of a deposed coordinator into batches the owner already
committed and pruned, and a late prune.

Pruning deletes a committed batch's records, so its INTENT and decision slots are free again.  A
coordinator deposed for ``retain_batches`` batches (paused, or its requests held on the wire) could
then open a ballot there (its INTENT's exclusive create succeeds), run tasks, decide and commit:

6. Kafka: the deposed planner's plan snapshot lists the owner's open transactions (the owner is
   between its decision and its commit of a later batch); its tasks and its cleanup abort what the
   snapshot lists: the owner's decided batch is lost.  A late *decision* there (its INTENT landed
   before the owner ran the batch) was committed: a second copy of the batch where its transaction
   survived the owner's cleanup, a false DATA LOSS stop where it did not (Kafka, below).
7. ``prune()`` wrote the low-water mark by plain replace with a cached value: a deposed writer's late
   prune moved it backwards, and a pruned batch could be written again.

Now the mark is a file per value, created exclusively (the highest stands), raised before any record
goes; the protocol reads it afresh after its INTENT and after its decision lands, and a deposed
coordinator that finds its batch pruned stops, aborting only its own handles; recovery aborts and
forgets such late records, never commits them.  On the real Kafka broker and real local files.
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter

import pyarrow as pa
import pytest

from tests.inprocess import Driver, OneTask, ids
from twophase import LogOwnershipError, PrunedBatchError
from twophase.log import INTENT, TransactionLog
from twophase.protocol import BatchProgress, OpenedBallot
from twophase.recovery import Committer


def _values(tag: str, n: int = 5) -> pa.RecordBatch:
    return pa.RecordBatch.from_pydict({"value": [f"{tag}-{i}".encode() for i in range(n)]})


def _expect(*tags: str) -> Counter:
    return Counter(f"{t}-{i}".encode() for t in tags for i in range(5))


def _mark(log_url: str) -> int | None:
    """The low-water mark of generation 1, as a new reader of the log sees it."""
    return TransactionLog(log_url, readonly=True).low_water(generation=1)


def _owner_prunes_batches_up_to_2(make_sink, log_url: str) -> tuple[Driver, Driver]:
    """A commits batch 0 and is deposed; B (retain_batches=1) commits 1-3, pruning batches up to 2."""
    a = Driver(make_sink(), log_url, "q")
    assert a.batch(0, _values("b0")).action == "committed"
    b = Driver(make_sink(), log_url, "q", takeover=True)
    b.tlog.retain_batches = 1
    for n in (1, 2, 3):
        assert b.batch(n, _values(f"b{n}")).action == "committed"
    assert _mark(log_url) == 2
    return a, b


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_deposed_planners_intent_in_a_pruned_batch_aborts_nothing_of_the_owners_decided_batch(kafka_service,
                                                                                               tmp_path):
    from tests.test_kafka_sink import _topic, read_committed
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"prn-{uuid.uuid4().hex[:8]}"
    a, b = _owner_prunes_batches_up_to_2(lambda: KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000),
                                         str(tmp_path / "log"))
    try:
        # B decides batch 4; its transactions are open, not yet committed.
        prog = BatchProgress("pipe", 4, None, "committed")
        opened = b.protocol.open_ballot(4, lambda planned: 1, prog)
        assert opened is not None
        results = OneTask(b.sink, _values("b4")).prepare(opened.query_name, 4, opened.intent, opened.run)
        assert b.tlog.mine(b.tlog.decide(4, opened.number, {"handles": [r["handle"] for r in results], "rows": 5}))
        # A, deposed since batch 0, wakes on its fast path: batch 1, pruned.  Its plan lists B's open
        # transactions; its INTENT lands in the free slot.  It must stop there, aborting nothing.
        with pytest.raises(LogOwnershipError) as stopped:
            a.batch(1, _values("late"))
        # B commits batch 4: was DataLossError (A's task or cleanup aborted it as "listed").
        Committer(b.sink, backoff=0.05).commit(4, [b.sink.decode_handle(r["handle"]) for r in results],
                                               recovering=False)
        b.tlog.write(4, "committed", {})
        b.protocol.dirty = True   # B's recovery aborts and forgets A's late records in batch 1
        b.protocol.recover()
        assert b.tlog.view(1).ballots == []
        assert Counter(read_committed(bs, topic)) == _expect("b0", "b1", "b2", "b3", "b4")
        assert "pruned" in str(stopped.value)   # stopped by the fresh mark after its INTENT, before any task
    finally:
        a.close()
        b.close()


@pytest.mark.kafka
@pytest.mark.timeout(300)
def test_a_deposed_coordinators_late_decision_in_a_pruned_batch_is_never_committed(kafka_service, tmp_path):
    from tests.test_kafka_sink import _topic, read_committed
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs), f"prd-{uuid.uuid4().hex[:8]}"

    def sink():
        return KafkaSink(bs, topic, prefix, transaction_timeout_ms=120_000)

    a = Driver(sink(), str(tmp_path / "log"), "q")
    try:
        assert a.batch(0, _values("b0")).action == "committed"
        # A's INTENT of batch 1 lands, its task pre-commits; then A pauses before its decision.
        intent = a.sink.plan_batch(a.query_name, 1, 1)
        assert a.tlog.mine(a.tlog.write(1, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                                    "num_partitions": 1}))
        late = OneTask(a.sink, _values("b1")).prepare(a.query_name, 1, intent, f"e{a.tlog.epoch}late")
        # B takes over: closes A's ballot, runs batch 1 and three more, pruning batch 1.
        b = Driver(sink(), str(tmp_path / "log"), "q", takeover=True)
        b.tlog.retain_batches = 1
        for n in (1, 2, 3, 4):
            assert b.batch(n, _values(f"b{n}")).action == "committed"
        assert (_mark(str(tmp_path / "log")) or 0) >= 1
        # A wakes and decides batch 1: its slot is free again (pruned), the decision lands.
        opened = OpenedBallot(1, 0, intent, f"e{a.tlog.epoch}late", a.query_name)
        with pytest.raises(LogOwnershipError, match="pruned"):   # was: committed, batch 1 twice
            a.protocol.decide_and_commit(opened, late, BatchProgress("pipe", 1, None, "committed"))
        b.protocol.dirty = True
        b.protocol.recover()   # A's decision in batch 1: aborted and forgotten, never committed
        assert b.tlog.view(1).ballots == []
        assert Counter(read_committed(bs, topic)) == _expect("b0", "b1", "b2", "b3", "b4")
        b.close()
    finally:
        a.close()


def test_a_deposed_pruners_late_low_water_mark_does_not_move_it_backwards(tmp_path):
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    a = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    a.tlog.retain_batches = 2
    for n in range(4):
        a.batch(n, ids(n))
    assert _mark(log_url) == 1
    folder = f"g{a.tlog.generation:04d}"
    stale = a.tlog.store.list(folder)   # A lists the batches, then pauses before it writes the mark
    b = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
    b.tlog.retain_batches = 2
    for n in range(4, 9):
        assert b.batch(n, ids(n)).action == "committed"
    assert _mark(log_url) == 6
    # A's late prune lands now, with its stale listing: batch 2 was committed then, so mark 2.
    listing = a.tlog.store.list
    a.tlog.store.list = lambda name, hidden=False: stale if name == folder else listing(name, hidden)  # type: ignore[method-assign]
    a.tlog.prune(4)
    a.tlog.store.list = listing  # type: ignore[method-assign]
    assert _mark(log_url) == 6   # was: 2
    # So a re-run of pruned batch 5 is refused, not written twice.
    c = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
    try:
        with pytest.raises(PrunedBatchError):
            c.batch(5, ids(5))
        rows = Counter(json.loads(line)["id"] for p in os.listdir(out) if p.endswith(".jsonl")
                       for line in open(out / p) if line.strip())
        assert rows == Counter(range(9))
    finally:
        a.close()
        b.close()
        c.close()


def test_a_late_decision_whose_read_of_what_was_pruned_races_another_prune_is_still_refused(tmp_path):
    """Found by the second review: the deposed coordinator listed the pruned-batch files, paused, and
    meanwhile the owner pruned again (a new union file, the listed one deleted): the read found
    nothing and the late decision in pruned batch 1 was committed.  A file that vanished between the
    listing and its read is now looked for again in a new listing."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")

    def sink():
        return FileSink(str(out), format="jsonl")

    a = Driver(sink(), log_url, "q")
    b = None
    try:
        a.batch(0, ids(0))
        intent = a.sink.plan_batch(a.query_name, 1, 1)
        assert a.tlog.mine(a.tlog.write(1, INTENT, {"intent": intent, "sink": a.sink.kind, "name": a.query_name,
                                                    "num_partitions": 1}))
        late = OneTask(a.sink, ids(1)).prepare(a.query_name, 1, intent, f"e{a.tlog.epoch}late")
        b = Driver(sink(), log_url, "q", takeover=True)
        b.tlog.retain_batches = 1
        for n in (1, 2, 3, 4):
            assert b.batch(n, ids(n)).action == "committed"
        read, paused = a.tlog.store.read, []

        def a_read(name):   # A pauses between its listing of what was pruned and its read of a file
            if "low-water/" in name and not paused:
                paused.append(b.batch(5, ids(5)))   # B prunes again meanwhile
            return read(name)

        a.tlog.store.read = a_read  # type: ignore[method-assign]
        with pytest.raises(LogOwnershipError, match="pruned"):   # was: committed
            a.protocol.decide_and_commit(OpenedBallot(1, 0, intent, f"e{a.tlog.epoch}late", a.query_name), late,
                                         BatchProgress("pipe", 1, None, "committed"))
        assert paused
    finally:
        a.close()
        if b is not None:
            b.close()
    rows = Counter(json.loads(line)["id"] for p in os.listdir(out) if p.endswith(".jsonl")
                   for line in open(out / p) if line.strip())
    assert rows == Counter(range(6))


def test_an_owner_re_running_a_batch_a_late_prune_removed_after_its_cache_was_filled_is_refused_as_pruned(
        tmp_path):
    """Found by the second review: a deposed pruner's late prune removed batch 3 after the owner had
    read what was pruned; the owner's re-run of batch 3 passed its cached check, its INTENT landed in
    the pruned batch, and it was told it had been deposed.  The check before the INTENT is fresh now:
    PrunedBatchError, nothing written."""
    from twophase.sinks.files import FileSink

    out, log_url = tmp_path / "out", str(tmp_path / "log")
    d1 = Driver(FileSink(str(out), format="jsonl"), log_url, "q")
    d1.tlog.retain_batches = 1
    for n in range(4):
        d1.batch(n, ids(n))
    c = Driver(FileSink(str(out), format="jsonl"), log_url, "q", takeover=True)
    try:
        c.batch(10, ids(10))
        d1.tlog.prune(5)   # d1, deposed, prunes late: batch 3 was committed
        c.batch(11, ids(11))
        with pytest.raises(PrunedBatchError):
            c.batch(3, ids(3))
        assert c.tlog.view(3).ballots == []
    finally:
        d1.close()
        c.close()
