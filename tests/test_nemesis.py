"""The nemesis's short schedules (issue 27): faults injected while batches flow, on hosts that
really are apart, then the history checker's verdict.  ``python -m tests.nemesis --cluster
--minutes 30`` is the long run; these are the CI ones, per sink (PostgreSQL upserts, MariaDB
upserts by XA branches, FileSink on S3 and on HDFS, Kafka), the drivers' batches on the Spark
cluster across the worker hosts, checked by unique id (on PostgreSQL and MariaDB the ids of a
journal of every committed write, which an upserted table cannot show twice), and each fault
checked to have made what it is there for (a stage retry's two attempts of a partition at once, a
decision delivered during the takeover).  The fault kinds (driver: kill, pause past the lease, a
decision held on the wire past a takeover, the log store cut from the driver only, the driver's
host isolated; executor: SIGKILL with its shuffle output (a stage retry beside the old attempt),
SIGSTOP past the network timeout (a zombie), cut from the driver only) are shared out: two to
three per sink instead of all eight, every kind on the sink it matters most to and the stage retry
on three (``SCHEDULES``), 12 faults in all, 10 in CI (``CI_SINKS``: HDFS's two kinds are
Kafka's and MariaDB's there too).  Kafka has the isolated driver (its plan fence:
tests/test_late_plan.py) and the executor faults that leave a late attempt running; FileSink on
HDFS the executor faults that leave a late attempt's staged files (paused, cut); FileSink on S3
the driver's SIGKILL and the log cut from the driver (the log is on S3); PostgreSQL the stage
retry (prepared transactions of two attempts) and the delayed decision; MariaDB the stage retry
(XA branches of two attempts), the cut executor (when the batch is written by tasks: the cut
attempt's branch prepared, holding the row locks its retry's upsert of those ids waits for) and a
paused driver (a zombie woken while its successor recovers its branches)."""

from __future__ import annotations

import os

import pytest

from tests import nemesis
from tests.services import hosts

#: The marks of a nemesis run (the checker's own tests below need none of this).
RUN_MARKS = [pytest.mark.nemesis, pytest.mark.hosts, pytest.mark.chaos, pytest.mark.s3,  # the log is on S3
             pytest.mark.timeout(900),
             pytest.mark.cluster,
             pytest.mark.skipif(hosts.available() is not None, reason=f"test hosts: {hosts.available()}"),
             pytest.mark.alone("cuts test hosts off the bridge, blackholes routes, SIGKILLs/SIGSTOPs executors "
                               "of the test hosts' shared Spark cluster, which it needs free")]


def _run_marks(f):
    for m in RUN_MARKS:
        f = m(f)
    return f


#: Each sink's schedule, played in order after a quiet spell each: every fault kind on the sink it
#: matters most to (see above), the stage retry (``executor-kill``) on three, 12 faults in all (each
#: costs about 20 s of CI; 17 until YARN's kill tests joined CI, issue 50).  A driver's SIGKILL is
#: on S3's (the log there too); every sink's own kill tests kill its drivers (e.g.
#: tests/test_kafka_chaos.py, tests/test_postgres_chaos.py, tests/test_mysql_chaos.py,
#: tests/test_files_remote_chaos.py, tests/test_yarn.py).  The kinds dropped from a second sink
#: still run there under ``python -m tests.nemesis --cluster --minutes N``, which draws every kind.
SCHEDULES = {
    "kafka": ["executor-kill", "isolate", "executor-pause"],
    "postgres-upsert": ["executor-kill", "delay"],
    "mysql-upsert": ["executor-kill", "executor-cut", "pause"],
    "files-s3": ["kill", "partition-log"],
    "files-hdfs": ["executor-pause", "executor-cut"],
}
#: CI plays four of them (10 faults, about 64 s less): FileSink on HDFS only with
#: ``TWOPHASE_FULL_CHAOS=1``.  Its two kinds are Kafka's (executor-pause) and MariaDB's
#: (executor-cut) in CI too; a late attempt's staged HDFS files are what its kill tests
#: (tests/test_files_remote_chaos.py) and the YARN AM kill (tests/test_yarn.py) leave behind.
CI_SINKS = ["postgres-upsert", "mysql-upsert", "files-s3", "kafka"]
_SEEN = [k for s in CI_SINKS for k in SCHEDULES[s]]
assert set(_SEEN) == set(nemesis.ALL_FAULTS) and _SEEN.count("executor-kill") == 3 and len(_SEEN) == 10, \
    "in CI every fault kind on the sink it matters most to, the stage retry on three, 10 faults"
FULL_CHAOS_ONLY = pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                                     reason="not in CI_SINKS: its fault kinds run in CI on other sinks; "
                                            "TWOPHASE_FULL_CHAOS=1 runs it")


# PostgreSQL and MariaDB as upserts (the schedule: a zombie's prepared transaction, or XA
# branch, holds the locks of rows the successor upserts), each id counted in a journal of committed
# writes (a trigger), so a row committed twice counts twice as it would in an insert table;
# PostgreSQL's inserts meet the same faults in tests/test_ownership_processes.py and the PostgreSQL
# kill tests.
@_run_marks
@pytest.mark.parametrize("sink", [
    pytest.param(sink, marks=marks + ([] if sink in CI_SINKS else [FULL_CHAOS_ONLY]))
    for sink, marks in [("postgres-upsert", [pytest.mark.postgres]), ("mysql-upsert", [pytest.mark.mysql]),
                        ("files-s3", []), ("files-hdfs", [pytest.mark.hdfs]), ("kafka", [pytest.mark.kafka])]])
def test_short_schedule(sink, tmp_path):
    n = nemesis.Nemesis(sink, seed=27, minutes=0.0, out=tmp_path, faults=nemesis.ALL_FAULTS, cluster=True,
                        quiet=(1, 3))
    n.schedule = list(SCHEDULES[sink])
    history = n.run()
    verdicts = nemesis.check(history, n.target, progress_bound=n.lease * 4 + 60)
    report = nemesis.table(verdicts, history)
    print(report)
    nemesis.timeline(history, tmp_path / "timeline.png")
    assert [f.kind for f in history.faults] == SCHEDULES[sink], report
    assert all(v.ok for v in verdicts), report
    # Every executor fault found a write task running on both workers and hit one's executor.
    missed = [(f.kind, f.note) for f in history.faults if f.kind in nemesis.EXECUTOR_FAULTS and "not injected" in f.note]
    assert not missed, (missed, report)
    # Every deposed driver stopped by itself: killed by its fault, or failed with an error that is
    # not data loss (fenced, its log or target unreachable), within the nemesis's wait; none went
    # on beside its successor, none lingered until the nemesis killed it (exit -9 after a fault
    # that is not a kill).
    kinds = {f.driver: f.kind for f in history.faults if f.kind in nemesis.FAULTS}
    for d in history.drivers:
        if d.label in kinds:
            last = d.events[-1] if d.events else {}
            if kinds[d.label] == "kill":
                assert d.exit == -9, (d.label, d.exit, last)
            else:
                assert d.exit in (1, 3) and last.get("event") == "error" and not last.get("data_loss"), \
                    (d.label, kinds[d.label], d.exit, last)
    n.target.cleanup()


# ------------------------------------------------------------------------- the checker itself
@pytest.mark.postgres
def test_the_upsert_journal_counts_a_row_committed_twice(postgres_service):
    """The PostgreSQL upsert target's ids are its journal's: an id two transactions committed is
    one row of the table, and two of the journal, so "every id exactly once" fails; a write rolled
    back leaves nothing."""
    target = nemesis.journaled_upsert_target(postgres_service)
    upsert = (f'INSERT INTO "{target.table}" (id, v) SELECT i, %s FROM unnest(%s::bigint[]) AS i '
              'ON CONFLICT (id) DO UPDATE SET v = EXCLUDED.v')
    history = nemesis.History("postgres-upsert", 0, 0.0, 6.0)
    history.drivers.append(nemesis.DriverLife("d1", "driver-a", 0.0, exit=0, events=[{"event": "done", "last": 0}]))

    def once() -> nemesis.Verdict:
        return next(v for v in nemesis.check(history, target, progress_bound=60) if v.name == "every id exactly once")
    try:
        with target._conn() as c, c.cursor() as cur:
            cur.execute(upsert, ("a", list(range(nemesis.ROWS))))
            assert once().ok, once()
            c.autocommit = False
            cur.execute(upsert, ("rolled back", [3]))
            c.rollback()
            assert once().ok, once()
            c.autocommit = True
            cur.execute(upsert, ("b", [3]))  # a second attempt's transaction committed too
            cur.execute(f'SELECT count(*), count(DISTINCT id) FROM "{target.table}"')
            assert cur.fetchone() == (nemesis.ROWS, nemesis.ROWS)  # the table cannot show it
        v = once()
        assert not v.ok and "duplicated 1 [3]" in v.detail, v
    finally:
        target.cleanup()


@pytest.mark.mysql
@pytest.mark.hosts
@pytest.mark.skipif(hosts.available() is not None, reason=f"test hosts: {hosts.available()}")
def test_the_mysql_upsert_journal_counts_a_branch_committed_twice_and_a_row_lost():
    """The MariaDB upsert target's ids are its journal's, written inside each XA branch: a branch
    committed adds its ids, one rolled back (after XA PREPARE) none, and an id two committed branches
    upserted is one row of the table and two of the journal ("duplicated"); an id no committed
    branch wrote is "lost"; a prepared branch of the run's gtrid prefix is left behind until
    cleanup rolls it back."""
    from tests.services import ensure

    target = nemesis.journaled_mysql_upsert_target(ensure("mariadb_host")["mariadb_host"])
    upsert = f"INSERT INTO `{target.table}` (`id`, `v`) VALUES (%s, %s) ON DUPLICATE KEY UPDATE `v` = VALUES(`v`)"
    history = nemesis.History("mysql-upsert", 0, 0.0, 6.0)
    history.drivers.append(nemesis.DriverLife("d1", "driver-a", 0.0, exit=0, events=[{"event": "done", "last": 0}]))

    def verdict(name: str) -> nemesis.Verdict:
        return next(v for v in nemesis.check(history, target, progress_bound=60) if v.name == name)

    def branch(cur, n: int, ids: list[int], end: str | None) -> None:
        xid = (f"{target.gid_prefix}:q:0:t:{n}", "0.1")
        cur.execute("XA START %s, %s", xid)
        cur.executemany(upsert, [(i, f"row-{i}") for i in ids])
        cur.execute("XA END %s, %s", xid)
        cur.execute("XA PREPARE %s, %s", xid)
        if end is not None:
            cur.execute(f"XA {end} %s, %s", xid)
    try:
        with target._conn() as cur:
            branch(cur, 0, list(range(nemesis.ROWS - 1)), "COMMIT")
            v = verdict("every id exactly once")
            assert not v.ok and f"lost 1 [{nemesis.ROWS - 1}]" in v.detail, v
            branch(cur, 1, [nemesis.ROWS - 1], "COMMIT")
            assert verdict("every id exactly once").ok, verdict("every id exactly once")
            branch(cur, 2, [3], "ROLLBACK")  # prepared, then rolled back: nothing
            assert verdict("every id exactly once").ok, verdict("every id exactly once")
            branch(cur, 3, [3], None)  # prepared and left: its row lock is held, its id not counted
            assert verdict("every id exactly once").ok, verdict("every id exactly once")
            v = verdict("nothing left behind")
            assert not v.ok and f"{target.gid_prefix}:q:0:t:3/0.1" in v.detail, v
            cur.execute("XA COMMIT %s, %s", (f"{target.gid_prefix}:q:0:t:3", "0.1"))  # a second attempt's, committed too
            cur.execute(f"SELECT count(*), count(DISTINCT id) FROM `{target.table}`")
            assert cur.fetchone() == (nemesis.ROWS, nemesis.ROWS)  # the table cannot show it
        v = verdict("every id exactly once")
        assert not v.ok and "duplicated 1 [3]" in v.detail, v
        assert verdict("nothing left behind").ok, verdict("nothing left behind")
    finally:
        target.cleanup()


def test_each_executor_kill_must_overlap_and_each_delay_arrive_in_the_takeover():
    """The verdicts on what the faults made: an executor-kill whose batch had no two attempts of a
    partition alive at once (the killed attempt and one that failed its fetch have no end), or a
    delay delivered at the heal, or after the successor was done with its batch, fails."""
    mark = "b5-p1-s19-t27-a0-worker-2"
    h = nemesis.History("postgres-upsert", 0, 0.0, 6.0)
    h.faults.append(nemesis.Fault("executor-kill", "d1", 10.0, 10.0, mark=mark))
    h.tasks = [{"batch": 5, "partition": 0, "task": 26, "attempt": 0, "at": 9.9, "end": 14.0},
               {"batch": 5, "partition": 1, "task": 27, "attempt": 0, "at": 9.9, "end": None},  # killed
               {"batch": 5, "partition": 1, "task": 28, "attempt": 1, "at": 11.0, "end": None},  # fetch failed
               {"batch": 5, "partition": 0, "task": 30, "attempt": 0, "at": 14.5, "end": 18.6},  # after 26 ended
               {"batch": 5, "partition": 1, "task": 31, "attempt": 0, "at": 14.5, "end": 18.6}]

    def verdict(name: str) -> nemesis.Verdict:
        return next(v for v in nemesis.exercised(h) if v.name.startswith(name))
    assert not verdict("executor-kill").ok, verdict("executor-kill")
    h.tasks[3]["at"] = 12.0  # the stage retry's attempt of partition 0 began while task 26 ran
    assert verdict("executor-kill").ok and "batch 5: partitions [0]" in verdict("executor-kill").detail
    h.tasks.append({"batch": 6, "partition": 1, "task": 40, "attempt": 0, "at": 12.5, "end": 16.0})
    assert h.overlaps(6) == [] and h.overlaps(5) == [(5, 0)]

    d = nemesis.Fault("delay", "d1", 20.0, 30.0, held_batch=9)
    h.faults.append(d)
    h.drivers.append(nemesis.DriverLife("d2", "driver-b", 0.0, events=[
        {"event": "batch", "batch": 8, "action": "skipped", "at": 26.0},
        {"event": "batch", "batch": 9, "action": "committed", "at": 27.0}]))
    assert not verdict("delay").ok, verdict("delay")  # delivered at the heal
    d.took_over, d.delivered = 25.0, 27.5
    assert not verdict("delay").ok, verdict("delay")  # after the successor committed batch 9
    d.delivered = 25.4
    assert verdict("delay").ok and "it lost" in verdict("delay").detail, verdict("delay")


def test_executor_faults_must_hit_batches_written_by_tasks():
    """The verdict that executor faults hit writing tasks: the fault's batch (its mark's) must be
    reported by the victim driver with a task path and no collect of the driver path.  A batch the
    driver path wrote (no task), or whose driver collect ran before falling back to tasks, fails,
    as does a fault whose batch the driver never reported."""
    h = nemesis.History("files-hdfs", 0, 0.0, 6.0)
    h.faults.append(nemesis.Fault("executor-pause", "d1", 10.0, 22.0, mark="b4-p0-s7-t9-a0-worker-1"))
    h.faults.append(nemesis.Fault("executor-cut", "d1", 30.0, 42.0, mark=None))  # not injected: reported
    batch4 = {"event": "batch", "batch": 4, "action": "committed", "at": 25.0, "task_input": "arrow",
              "collect_ms": 0.0}
    h.drivers.append(nemesis.DriverLife("d1", "driver-a", 0.0, events=[
        {"event": "batch", "batch": 3, "action": "committed", "at": 9.0, "task_input": "driver", "collect_ms": 5.0},
        batch4]))

    def verdict() -> nemesis.Verdict:
        return next(v for v in nemesis.exercised(h) if v.name == "executor faults hit writing tasks")
    v = verdict()
    assert v.ok and "executor-pause batch 4: 'arrow'" in v.detail and "executor-cut: not injected" in v.detail, v
    batch4["task_input"] = "rows"
    assert verdict().ok, verdict()
    batch4["task_input"] = "driver"  # written by the driver path: the fault hit no writing task
    assert not verdict().ok, verdict()
    batch4.update(task_input="arrow", collect_ms=12.0)  # the driver's collect ran first (and failed)
    assert not verdict().ok, verdict()
    batch4.update(collect_ms=0.0, batch=5)  # batch 4 never reported by the victim
    v = verdict()
    assert not v.ok and "no batch 4 reported by d1" in v.detail, v
    h.faults[0].mark = None  # no fault injected at all: nothing was shown
    assert not verdict().ok, verdict()
