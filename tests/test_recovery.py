"""Recovery that can never fence a decided batch: one routine for the coordinator, the CLI and the harness.

Each test is a scenario from the review of the landed code (issue 13), against the real servers
where a sink is involved; each failed on the code before the shared recovery routine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.test_cli_backends import cli, write_log
from twophase import CommitResult, PrunedBatchError, TransactionContext
from twophase.coordinator import Coordinator
from twophase.errors import CommitError, ConfigurationError, LogOwnershipError
from twophase.log import COMMITTED, INTENT, PREPARED, TransactionLog, batch_query_id
from twophase.sinks.files import FileSink

REPO = Path(__file__).resolve().parents[1]


def output_ids(folder: Path) -> list[int]:
    ids: list[int] = []
    for p in sorted(folder.rglob("*.parquet")):
        if "_twophase" not in p.parts:
            ids.extend(pq.read_table(p).column("id").to_pylist())
    return ids


# ------------------------------------------------------------------ 1. order of recovery
def _kafka_decided_after_undecided(kafka_service, tmp_path):
    """Batch 5 failed after its INTENT (undecided); batch 6 on the same pooled id was decided and the
    driver died before COMMITTED(6). Batch 6's transaction is open on transactional id prefix-0."""
    from tests.test_kafka_sink import _child_transaction, _topic
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"ord-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, prefix)
    handle = _child_transaction(bs, topic, prefix, n=30)  # pre-committed on prefix-0, producer killed
    log = tmp_path / "log"
    write_log(log, [(5, INTENT, {"intent": sink.plan_batch("q", 5, 1), "name": "q", "sink": "kafka"}),
                    (6, INTENT, {"intent": sink.plan_batch("q", 6, 1), "name": "q", "sink": "kafka"}),
                    (6, PREPARED, {"handles": [sink.encode_handle(handle)], "rows": 30})])
    return bs, topic, prefix, sink, log


@pytest.mark.kafka
def test_recover_commits_a_decided_kafka_batch_before_fencing_an_older_undecided_one(kafka_service, tmp_path):
    from tests.test_kafka_sink import read_committed

    bs, topic, prefix, sink, log = _kafka_decided_after_undecided(kafka_service, tmp_path)
    r = cli("recover", str(log), "--sink-config", json.dumps(sink.to_config()), "--json")
    assert r.returncode == 0, r.stdout + r.stderr  # was: batch 6 LOST (fenced by batch 5's abort)
    assert json.loads(r.stdout)["committed_batches"] == [6]
    assert Counter(read_committed(bs, topic)) == Counter(f"{prefix}-{i}".encode() for i in range(30))
    st = json.loads(cli("status", str(log), "--json").stdout)
    assert {b["batch_id"]: b["state"] for b in st["batches"]} == {5: "intent", 6: "committed"}


@pytest.mark.kafka
def test_abort_lingering_refuses_while_a_decided_kafka_batch_is_uncommitted(kafka_service, tmp_path):
    from tests.test_kafka_sink import read_committed

    bs, topic, prefix, sink, log = _kafka_decided_after_undecided(kafka_service, tmp_path)
    cfg = json.dumps(sink.to_config())
    r = cli("abort-lingering", str(log), "--sink-config", cfg)
    assert r.returncode == 2, r.stdout + r.stderr  # was: 0, after fencing batch 6's transaction
    assert "batch 6 (generation 1)" in r.stderr and "twophase recover" in r.stderr
    r = cli("recover", str(log), "--sink-config", cfg, "--json")
    assert r.returncode == 0, r.stderr  # batch 6 is still committable
    assert len(read_committed(bs, topic)) == 30


# ----------------------------------------------------- 2. no new batch over a pending decision
class _CoordinatorMoving:
    """Mixin: commit answers RETRY_LATER ``failures`` times (a transaction coordinator moving)."""

    failures = 0

    def commit(self, handle):
        if type(self).failures > 0:
            type(self).failures -= 1
            return CommitResult.retry_later("NOT_COORDINATOR (test)")
        return super().commit(handle)


@pytest.mark.kafka
@pytest.mark.spark
def test_new_batch_after_commit_error_commits_the_pending_decided_batch_first(kafka_service, spark, tmp_path):
    from tests.test_kafka_sink import _topic, read_committed
    from twophase.sinks.kafka import KafkaSink

    class MovingKafkaSink(_CoordinatorMoving, KafkaSink):
        pass

    bs = kafka_service["bootstrap_servers"]
    topic, prefix = _topic(bs, partitions=1), f"pend-{uuid.uuid4().hex[:8]}"
    sink = MovingKafkaSink(bs, topic, prefix)
    c = Coordinator(sink, log_location=str(tmp_path / "log"), name="pend", commit_retries=1,
                    retry_backoff=0.01, parallelism=1)

    def frame(lo, hi):
        return spark.range(lo, hi, numPartitions=1).selectExpr("CAST(id AS STRING) AS value")

    MovingKafkaSink.failures = 2  # more than the retries: batch 0 is decided, its commit fails
    with pytest.raises(CommitError):
        c.write(frame(0, 50), batch_id=0)
    # The same coordinator moves on to batch 1, whose transaction reuses batch 0's transactional id.
    # Before the fix it fenced batch 0's open transaction: 50 decided records lost for good.
    c.write(frame(50, 80), batch_id=1)
    tlog = TransactionLog(str(tmp_path / "log"))
    assert set(tlog.batches(1)[0]) == {INTENT, PREPARED, COMMITTED}
    assert Counter(read_committed(bs, topic)) == Counter(str(i).encode() for i in range(80))
    c.close()


# ------------------------------------------------------- 3. the loser aborts its own work
@pytest.mark.postgres
@pytest.mark.spark
def test_coordinator_fenced_before_deciding_aborts_its_own_prepared_transactions(postgres_service, spark,
                                                                                 tmp_path):
    import psycopg2

    from twophase.sinks.postgres import PostgresSink

    log_url = str(tmp_path / "log")
    db = psycopg2.connect(postgres_service["dsn"])
    db.autocommit = True
    table = f"fence_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{table}" (id bigint PRIMARY KEY)')

    class TakenOver(PostgresSink):
        def plan_batch(self, query_name, batch_id, num_partitions):
            # While this coordinator plans the batch, an operator starts a second one on the log.
            other = TransactionLog(log_url)
            other.acquire(batch_query_id("fence", self.target()), "fence", takeover=True)
            return super().plan_batch(query_name, batch_id, num_partitions)

    sink = TakenOver(postgres_service["dsn"], table, gid_prefix=f"f{table[-6:]}")
    c = Coordinator(sink, log_location=log_url, name="fence", parallelism=2)
    with pytest.raises(LogOwnershipError):
        c.write(spark.range(0, 40, numPartitions=2), batch_id=0)
    with db.cursor() as cur:
        cur.execute("SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (sink.gid_prefix + ":%",))
        left = [r[0] for r in cur.fetchall()]
        cur.execute(f'SELECT count(*) FROM "{table}"')
        visible = cur.fetchone()[0]
    assert left == [] and visible == 0  # was: 2 prepared transactions holding their locks, found by nobody
    assert set(TransactionLog(log_url).batches(1)[0]) == {INTENT}  # undecided: a replay runs it
    db.close()


# ----------------------------------------------------- 4. idempotence beyond retention
@pytest.mark.spark
def test_rerun_of_a_pruned_batch_id_is_refused_not_rewritten(spark, tmp_path):
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="prune", retain_batches=2)
    for b in range(5):
        c.write(spark.range(b * 10, b * 10 + 10, numPartitions=1), batch_id=b)
    assert TransactionLog(str(tmp_path / "log")).batches(1).keys() == {3, 4}  # 0, 1 and 2 pruned
    for c2 in (c, Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="prune")):
        with pytest.raises(PrunedBatchError, match="low-water mark 2"):
            c2.write(spark.range(0, 10, numPartitions=1), batch_id=0)  # was: written a second time
    assert c2.write(spark.range(40, 50, numPartitions=1), batch_id=4)["action"] == "skipped"
    assert sorted(output_ids(out)) == list(range(50))
    st = json.loads(cli("status", str(tmp_path / "log"), "--json").stdout)
    assert st["low_water"] == 2


# ---------------------------------------------------------------- 5. generations
def _decided_files_batch(tmp_path, out: Path, query_id: str, batch_id: int, ids: list[int]) -> None:
    """A generation whose batch was decided, then the driver died (nothing committed)."""
    sink = FileSink(str(out))
    intent = sink.plan_batch("old", batch_id, 1)
    txn = sink.begin_transaction(TransactionContext("old", batch_id, 0, 0, intent))
    sink.write(txn, pa.RecordBatch.from_pydict({"id": pa.array(ids, pa.int64())}))
    h = sink.encode_handle(sink.pre_commit(txn))
    code = ("import json, sys; from twophase.log import TransactionLog\n"
            "t = TransactionLog(sys.argv[1]); t.acquire(sys.argv[2], 'old')\n"
            "for b, st, body in json.loads(sys.argv[3]): t.write(b, st, body)\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "log"), query_id, json.dumps(
        [(batch_id, INTENT, {"intent": intent, "name": "old", "sink": "files"}),
         (batch_id, PREPARED, {"handles": [h], "rows": len(ids)})])], check=True, cwd=REPO)


@pytest.mark.spark
def test_new_generation_commits_the_previous_generations_decided_batch_first(spark, tmp_path):
    out = tmp_path / "out"
    _decided_files_batch(tmp_path, out, "old-query", 7, list(range(100, 110)))
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="new", new_generation=True)
    c.write(spark.range(0, 10, numPartitions=1), batch_id=0)
    # Was: generation 1's decided batch 7 ignored, its staged file abandoned (rows 100-109 never visible).
    assert sorted(output_ids(out)) == list(range(10)) + list(range(100, 110))
    tlog = TransactionLog(str(tmp_path / "log"))
    assert set(tlog.batches(1)[7]) == {INTENT, PREPARED, COMMITTED}
    assert [g["generation"] for g in tlog.generations()] == [1, 2]
    c.close()


def test_twophase_recover_sees_every_generation(tmp_path):
    out = tmp_path / "out"
    _decided_files_batch(tmp_path, out, "old-query", 7, [1, 2, 3])
    # A newer generation exists (the query restarted from a new checkpoint) before anyone recovered.
    subprocess.run([sys.executable, "-c", "import sys; from twophase.log import TransactionLog; "
                    "TransactionLog(sys.argv[1]).acquire('new-query', 'new', new_generation=True)",
                    str(tmp_path / "log")], check=True, cwd=REPO)
    st = cli("status", str(tmp_path / "log"))
    assert st.returncode == 0 and "decided, NOT yet fully committed" in st.stdout, st.stdout
    r = cli("recover", str(tmp_path / "log"), "--sink-config", json.dumps({"sink": "files", "url": str(out)}),
            "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["committed_batches"] == [7]  # was: [] (only the latest generation)
    assert sorted(output_ids(out)) == [1, 2, 3]


# --------------------------------------------------------------------- 6. liveness
_HOLDER = """
import socket, sys, time
socket.gethostname = lambda: "another-host"          # the lease holder runs on another machine
from twophase.log import TransactionLog
t = TransactionLog(sys.argv[1], lease_timeout=float(sys.argv[2]))
t.acquire("q-idle", "idle")
t.start_heartbeat()
print("owner", flush=True)
time.sleep(float(sys.argv[3]))                     # a healthy query, idle between triggers
if sys.argv[4] == "close":
    t.close()
    print("closed", flush=True)
time.sleep(60)
"""


@pytest.mark.alone("a 1 s lease kept by 0.25 s heartbeats (two fsyncs each): a stall of 0.75 s under "
                   "another worker's load lets the second driver take it over")
def test_idle_query_keeps_its_lease_and_a_second_driver_is_refused(tmp_path):
    url = str(tmp_path / "log")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url, "1.0", "30", "keep"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "owner"
        time.sleep(3.0)  # three lease timeouts without a batch
        second = TransactionLog(url, lease_timeout=1.0)
        with pytest.raises(LogOwnershipError, match="owned by a live coordinator"):
            second.acquire("q-idle", "idle")  # was: silently taken over (lease refreshed only per batch)
    finally:
        holder.kill()
        holder.wait()
    time.sleep(1.5)  # the holder is dead now: its lease expires and the log can be taken
    TransactionLog(url, lease_timeout=1.0).acquire("q-idle", "idle")


def test_closed_coordinator_releases_its_lease_at_once(tmp_path):
    url = str(tmp_path / "log")
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, url, "600", "0.1", "close"],
                              stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "owner"
        assert holder.stdout.readline().strip() == "closed"
        TransactionLog(url, lease_timeout=600).acquire("q-idle", "idle")  # no 10-minute wait
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.spark
@pytest.mark.alone("asserts a heartbeat (two fsyncs) within 1 s of a 0.8 s lease: a stall under another "
                   "worker's load fails it")
def test_coordinator_heartbeats_while_it_lives_and_close_releases(spark, tmp_path):
    c = Coordinator(FileSink(str(tmp_path / "out")), log_location=str(tmp_path / "log"), name="hb",
                    lease_timeout=0.8)
    c.write(spark.range(0, 5, numPartitions=1), batch_id=0)
    t0 = TransactionLog(str(tmp_path / "log")).lease().heartbeat_at
    time.sleep(1.0)
    assert TransactionLog(str(tmp_path / "log")).lease().heartbeat_at > t0
    with c:
        pass
    assert TransactionLog(str(tmp_path / "log")).lease().released


# ----------------------------------------------------------- 8-9. operator input
def test_status_and_offsets_on_a_mistyped_path_write_nothing(tmp_path):
    for cmd in ("status", "offsets"):
        r = cli(cmd, str(tmp_path / "typo" / "twophase"))
        assert r.returncode == 2 and "no transaction log at" in r.stderr, r.stderr
    assert not (tmp_path / "typo").exists()  # was: the directory and log.json created
    (tmp_path / "empty").mkdir()
    r = cli("status", str(tmp_path / "empty"))
    assert r.returncode == 2 and "no log.json" in r.stderr
    assert os.listdir(tmp_path / "empty") == []


def test_cli_sink_config_errors_are_one_line_naming_the_field(tmp_path):
    out = tmp_path / "out"
    c = Coordinator(FileSink(str(out)), log_location=str(tmp_path / "log"), name="x")
    del c
    _decided_files_batch(tmp_path, out, "q", 0, [1])
    log = str(tmp_path / "log")
    cases = [({"sink": "files", "urll": str(out)}, "unknown parameter 'urll'; did you mean 'url'?"),
             ({"sink": "files", "url": str(out), "fsync": "yes"}, "parameter 'fsync' must be true or false"),
             ({"sink": "files", "url": str(out), "part_size": "8MB"}, "parameter 'part_size' must be an integer"),
             ({"sink": "files"}, "parameter 'url' is required")]
    for cfg, msg in cases:
        r = cli("recover", log, "--sink-config", json.dumps(cfg))
        assert r.returncode == 2 and msg in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    # A config of another kind than the one that wrote the log is refused, before anything is done.
    r = cli("recover", log, "--sink-config", json.dumps({"sink": "postgres", "dsn": "host=127.0.0.1",
                                                          "table": "t"}))
    assert r.returncode == 2 and "written by a 'files' sink" in r.stderr, r.stderr
    assert output_ids(out) == []


# ------------------------------------------------------------------------ 10. names
@pytest.mark.parametrize("bad", ["..", ".", "a/b", "", "-x", "a" * 65, "x y", "x\\y", "naïve"])
def test_coordinator_names_are_safe_tokens(tmp_path, bad):
    with pytest.raises(ConfigurationError, match="name must be"):
        Coordinator(FileSink(str(tmp_path / "o")), log_location=str(tmp_path / "l"), name=bad)


@pytest.mark.postgres
@pytest.mark.spark
def test_two_pipelines_with_the_default_name_never_share_markers(postgres_service, spark, tmp_path):
    """Pipeline A's marker pruning must not delete pipeline B's marker (issue 14, item 6)."""
    import psycopg2

    from twophase.sinks.postgres import PostgresSink

    db = psycopg2.connect(postgres_service["dsn"])
    db.autocommit = True
    ta, tb = f"pa_{uuid.uuid4().hex[:8]}", f"pb_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        for t in (ta, tb):
            cur.execute(f'CREATE TABLE "{t}" (id bigint PRIMARY KEY)')

    class DiesAfterCommit(PostgresSink):
        """The driver dies after COMMIT PREPARED, before COMMITTED is logged."""

        def abort_lingering(self, query_name, batch_id, intent, keep):
            if keep:
                raise RuntimeError("driver died after commit (test)")
            return super().abort_lingering(query_name, batch_id, intent, keep)

    dsn = postgres_service["dsn"]
    b_log = str(tmp_path / "b")
    b = Coordinator(DiesAfterCommit(dsn, tb, marker_retention_batches=1), log_location=b_log, parallelism=1)
    with pytest.raises(RuntimeError, match="driver died"):
        b.write(spark.range(0, 10, numPartitions=1), batch_id=0)
    b.close()
    # Pipeline A: same default coordinator name, same database, another table and log; it prunes.
    a = Coordinator(PostgresSink(dsn, ta, marker_retention_batches=1), log_location=str(tmp_path / "a"),
                    parallelism=1)
    for k in range(4):
        a.write(spark.range(100 + k, 101 + k, numPartitions=1), batch_id=k)
    a.close()
    # B restarts: its batch 0 was committed in PostgreSQL; the marker row must still prove it.
    b2 = Coordinator(PostgresSink(dsn, tb, marker_retention_batches=1), log_location=b_log, parallelism=1)
    b2.write(spark.range(10, 20, numPartitions=1), batch_id=1)  # was: DataLossError for batch 0
    with db.cursor() as cur:
        cur.execute(f'SELECT id FROM "{tb}" ORDER BY id')
        assert [r[0] for r in cur.fetchall()] == list(range(20))
    b2.close()
    db.close()


def test_scope_is_stable_per_log_and_differs_between_logs(tmp_path):
    t1 = TransactionLog(str(tmp_path / "a"))
    t1.acquire("q", "n")
    again = TransactionLog(str(tmp_path / "a"))
    again.acquire("q", "n")
    t2 = TransactionLog(str(tmp_path / "b"))
    t2.acquire("q", "n")
    assert t1.scope() == again.scope() != t2.scope()
    assert t1.scope().endswith("g1") and socket.gethostname()
