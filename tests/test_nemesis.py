"""The nemesis's short schedules (issue 27): faults injected while batches flow, on hosts that
really are apart, then the history checker's verdict.  ``python -m tests.nemesis --cluster
--minutes 30`` is the long run; these are the CI ones, per sink (PostgreSQL upserts, FileSink on S3
and on HDFS, Kafka), the drivers' batches on the Spark cluster across the worker hosts, checked by
unique id.  The fault kinds (driver: kill, pause past the lease, a decision held on the wire past a
takeover, the log store cut from the driver only, the driver's host isolated; executor: SIGKILL
with its shuffle output (a stage retry beside the old attempt), SIGSTOP past the network timeout
(a zombie), cut from the driver only) are shared out: four or five per sink instead of all
eight, every kind on two or three sinks (``SCHEDULES``), which saves about 5 of CI's minutes.
Where a kind matters most to a sink, that sink has it: Kafka the isolated driver (its plan fence:
tests/test_late_plan.py) and the executor faults that leave a late attempt running; FileSink on HDFS
all three executor faults (its staged files); PostgreSQL the stage retry and the cut executor
(prepared transactions of two attempts)."""

from __future__ import annotations

import pytest

from tests import nemesis
from tests.services import hosts

pytestmark = [pytest.mark.nemesis, pytest.mark.hosts, pytest.mark.chaos, pytest.mark.s3,  # the log is on S3
              pytest.mark.timeout(900),
              pytest.mark.cluster,
              pytest.mark.skipif(hosts.available() is not None, reason=f"test hosts: {hosts.available()}")]


#: Each sink's schedule, played in order after a quiet spell each: every fault kind on two sinks,
#: the stage retry (``executor-kill``) on three (see above), 17 faults in all (each costs about
#: 19 s of CI).  A driver's SIGKILL is on Kafka's and S3's; PostgreSQL's and HDFS's kill tests
#: kill their drivers (tests/test_postgres_chaos.py, tests/test_files_remote_chaos.py).
SCHEDULES = {
    "kafka": ["kill", "executor-kill", "isolate", "executor-pause", "pause"],
    "postgres-upsert": ["executor-kill", "delay", "executor-cut", "pause"],
    "files-s3": ["kill", "partition-log", "delay", "isolate"],
    "files-hdfs": ["executor-kill", "partition-log", "executor-pause", "executor-cut"],
}
_SEEN = [k for kinds in SCHEDULES.values() for k in kinds]
assert all(_SEEN.count(k) >= 2 for k in nemesis.ALL_FAULTS) and len(_SEEN) == 17, \
    "every fault kind on two sinks' schedules at least, 17 faults"


# PostgreSQL as upserts (the schedule); its inserts meet the same faults in
# tests/test_ownership_processes.py and the PostgreSQL kill tests.
@pytest.mark.parametrize("sink", [pytest.param("postgres-upsert", marks=pytest.mark.postgres), "files-s3",
                                  pytest.param("files-hdfs", marks=pytest.mark.hdfs),
                                  pytest.param("kafka", marks=pytest.mark.kafka)])
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
