"""Issue 59, FileSink: a backfill of an older batch id overlapping a newer run of one batch job.

Batch jobs pick their own batch ids, so "every id below the one being cleaned up is finished" is
false there: run Y decides batch 11 and pauses before its cleanup; run X, a backfill of batch 5,
takes the log over, recovers Y's batch 11, writes its INTENT, stages batch 5 and verifies it; Y
resumes, and its cleanup swept every lower ``b<id>`` staging folder (S3: aborted every open upload of
a lower id) by batch-id order, X's live staging included: X's decision found neither staged file nor
target (DataLossError, rows 50 and 51 lost) and every later run stopped on batch 5.  Now a FileSink
sweeps another batch's leftovers only where the log says that batch is finished
(:class:`twophase.evidence.Settled`: COMMITTED, or pruned after it), and with no evidence none.

Also here, issue 59's scenario 4: two batch jobs of one name and one log writing different data
sets into one folder (another prefix, format or partitionBy) were one job to the log (the target was
the folder alone): the second one's batch 0 was "skipped" and its rows never written.

Without Spark (tests/inprocess.py): a real transaction log on local disk and the real target (local
disk, HDFS, S3 on moto and MinIO).
"""

from __future__ import annotations

import io
import json
import os
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest

from tests.inprocess import Driver, ids, run_attempt
from twophase import TransactionContext
from twophase.errors import QueryMismatchError
from twophase.evidence import NothingSettled, Settled
from twophase.log import TransactionLog, batch_query_id
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sinks.files import FileSink

pytestmark = [pytest.mark.timeout(300)]


@dataclass
class Target:
    """One FileSink target (jsonl files) and how a test reads it back."""

    make_sink: Callable[[], FileSink]
    rows: Callable[[], list[int]]  # the ids in the committed files, sorted
    staged: Callable[[], list[str]]  # what is staged: local/HDFS files under _twophase, S3 open uploads


def _local(tmp_path) -> Target:
    out = tmp_path / "out"

    def rows() -> list[int]:
        if not out.exists():
            return []
        return sorted(json.loads(line)["id"] for p in os.listdir(out) if p.endswith(".jsonl")
                      for line in open(out / p) if line.strip())

    def staged() -> list[str]:
        return sorted(os.path.join(d, f) for d, _, fs in os.walk(out / "_twophase") for f in fs)

    return Target(lambda: FileSink(str(out), format="jsonl"), rows, staged)


@pytest.fixture
def hdfs_target(hdfs_service) -> Iterator[Target]:
    from hdfs import InsecureClient

    info = hdfs_service
    client = InsecureClient(info["webhdfs_url"], user=info["user"])
    path = f"/twophase-test/{uuid.uuid4().hex[:10]}"
    opts = {"webhdfs_url": info["webhdfs_url"], "user": info["user"]}

    def rows() -> list[int]:
        if client.status(path, strict=False) is None:
            return []
        out = []
        for name in client.list(path):
            if name.endswith(".jsonl"):
                with client.read(f"{path}/{name}") as r:
                    out += [json.loads(line)["id"] for line in r.read().decode().splitlines() if line.strip()]
        return sorted(out)

    def staged() -> list[str]:
        st = f"{path}/_twophase"
        if client.status(st, strict=False) is None:
            return []
        return sorted(f"{d}/{f}" for d, _, fs in client.walk(st) for f in fs)

    yield Target(lambda: FileSink(f"{info['namenode']}{path}", format="jsonl", writer="arrow",
                                  storage_options=opts), rows, staged)
    client.delete(path, recursive=True)


@pytest.fixture
def s3_target(s3_service, monkeypatch) -> Iterator[Target]:
    from tests.services.s3 import client as s3_client

    info, mp = s3_service, monkeypatch
    mp.setenv("TP_TEST_S3_KEY", info["key"])
    mp.setenv("TP_TEST_S3_SECRET", info["secret"])
    opts = {"key": {"env": "TP_TEST_S3_KEY"}, "secret": {"env": "TP_TEST_S3_SECRET"},
            "endpoint_url": info["endpoint_url"], "region_name": info["region"]}
    s3, bucket = s3_client(info), info["bucket"]
    prefix = f"twophase-test/{uuid.uuid4().hex[:10]}"

    def objects() -> list[str]:
        return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix + "/").get("Contents", [])]

    def rows() -> list[int]:
        out = []
        for key in objects():
            if key.endswith(".jsonl"):
                body = s3.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
                out += [json.loads(line)["id"] for line in io.StringIO(body) if line.strip()]
        return sorted(out)

    def uploads() -> list[tuple[str, str]]:
        # the bucket's listing, filtered (MinIO matches the Prefix of ListMultipartUploads only
        # against whole keys)
        return [(u["Key"], u["UploadId"]) for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
                if u["Key"].startswith(prefix + "/")]

    yield Target(lambda: FileSink(f"s3://{bucket}/{prefix}", format="jsonl", storage_options=opts), rows,
                 lambda: sorted(k for k, _ in uploads()))
    for key, upload_id in uploads():
        s3.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
    for key in objects():
        s3.delete_object(Bucket=bucket, Key=key)


# ----------------------------------------------------------------------------- scenario 1
def backfill_staged_while_a_newer_run_cleans_up(target: Target, tmp_path) -> None:
    """Issue 59 scenario 1: Y decides batch 11 and pauses before its commit and cleanup; X (a
    backfill of batch 5) takes the log over, recovers 11, stages batch 5 and verifies it; Y resumes
    (its commit finds 11 already committed) and cleans up batch 11.  X's staged batch 5 must still
    be there for X's decision: before the fix Y's sweep of lower ids deleted it (local, HDFS) or
    aborted its uploads (S3), and X's commit raised DataLossError, rows 50 and 51 lost."""
    log_url = str(tmp_path / "log")
    qid = batch_query_id("daily", target.make_sink().target())
    y = Driver(target.make_sink(), log_url, qid, takeover=True)
    x_verified, y_paused = threading.Event(), threading.Event()
    y_error: list[BaseException] = []
    y_commit = y.sink.commit

    def y_commit_paused(handle):
        # Y has decided batch 11; it pauses here, before its commit and its cleanup.
        y_paused.set()
        assert x_verified.wait(120), "X never verified its batch"
        return y_commit(handle)

    y.sink.commit = y_commit_paused  # type: ignore[method-assign]

    def run_y() -> None:
        try:
            y.batch(11, ids(110))
        except BaseException as e:  # noqa: BLE001 - Y was deposed by X: whatever it says, recorded
            y_error.append(e)

    ty = threading.Thread(target=run_y, name="run-Y")
    ty.start()
    assert y_paused.wait(120), "Y never decided batch 11"
    x = Driver(target.make_sink(), log_url, qid, takeover=True)
    x_verify = x.sink.verify_prepared

    def x_verify_then_let_y_clean_up(batch_id, handles, *, prepare_started_at):
        x_verify(batch_id, handles, prepare_started_at=prepare_started_at)  # X's batch 5 is staged
        if batch_id == 5:
            x_verified.set()
            ty.join(120)  # Y resumes: commits (already committed by X's recovery), cleans up batch 11
            assert not ty.is_alive(), "Y never finished"

    x.sink.verify_prepared = x_verify_then_let_y_clean_up  # type: ignore[method-assign]
    try:
        prog = x.batch(5, ids(50, 51))  # before the fix: DataLossError, its staged files gone
        assert prog.action == "committed"
        assert x_verified.is_set(), "the interleaving did not happen"
        assert target.rows() == [50, 51, 110]
        # Batch 5 stays settled for any later run (before the fix: every later run stopped on it).
        z = Driver(target.make_sink(), log_url, qid, takeover=True)
        try:
            assert z.batch(12, ids(120)).action == "committed"
        finally:
            z.close()
        assert target.rows() == [50, 51, 110, 120]
    finally:
        x_verified.set()
        ty.join(120)
        x.close()
        y.close()


def late_leftover_of_a_committed_earlier_batch(target: Target, tmp_path) -> None:
    """The fix is not "never sweep": a late task attempt of batch 2 that staged after batch 2 was
    COMMITTED and cleaned up is removed by batch 3's cleanup (the log says 2 is finished), while a
    staged batch the log says nothing of (batch 1, never decided) is left alone."""
    d = Driver(target.make_sink(), str(tmp_path / "log"), batch_query_id("daily", target.make_sink().target()),
               takeover=True)
    try:
        assert d.batch(2, ids(20)).action == "committed"
        assert target.staged() == []
        late = run_attempt(d.sink, TransactionContext(d.query_name, 2, 0, 1, d.intent(2)), ids(99))
        undecided = run_attempt(d.sink, TransactionContext(d.query_name, 1, 0, 0, d.sink.plan_batch(d.query_name, 1, 1)),
                                ids(10))
        before = target.staged()
        assert len(before) == 2
        assert d.batch(3, ids(30)).action == "committed"
        left = target.staged()
        assert len(left) == 1, f"batch 3's cleanup left {left}"
        # What is left is batch 1's (not settled), not the late attempt of batch 2 (settled).
        assert "00000001" in left[0] and "00000002" not in left[0]
        assert late and undecided
        assert target.rows() == [20, 30]
    finally:
        d.close()


def test_a_backfill_staged_while_a_newer_run_cleans_up_is_not_swept(tmp_path):
    backfill_staged_while_a_newer_run_cleans_up(_local(tmp_path), tmp_path)


@pytest.mark.hdfs
def test_a_backfill_staged_while_a_newer_run_cleans_up_is_not_swept_on_hdfs(hdfs_target, tmp_path):
    backfill_staged_while_a_newer_run_cleans_up(hdfs_target, tmp_path)


@pytest.mark.s3
def test_a_backfill_staged_while_a_newer_run_cleans_up_is_not_aborted_on_s3(s3_target, tmp_path):
    backfill_staged_while_a_newer_run_cleans_up(s3_target, tmp_path)


def test_a_late_leftover_of_a_committed_earlier_batch_is_still_swept_by_the_next_cleanup(tmp_path):
    late_leftover_of_a_committed_earlier_batch(_local(tmp_path), tmp_path)


@pytest.mark.hdfs
def test_a_late_leftover_of_a_committed_earlier_batch_is_still_swept_on_hdfs(hdfs_target, tmp_path):
    late_leftover_of_a_committed_earlier_batch(hdfs_target, tmp_path)


@pytest.mark.s3
def test_a_late_upload_of_a_committed_earlier_batch_is_still_aborted_on_s3(s3_target, tmp_path):
    late_leftover_of_a_committed_earlier_batch(s3_target, tmp_path)


def test_without_the_logs_evidence_a_cleanup_sweeps_no_other_batch(tmp_path):
    """``abort_lingering`` without ``settled`` (a user's call, the CLI's) or with nothing settled
    touches the batch's own ballot only; with the log's evidence, the settled batches' leftovers."""
    out = tmp_path / "out"
    sink = FileSink(str(out), format="jsonl")
    old = run_attempt(sink, TransactionContext("q", 2, 0, 0, sink.plan_batch("q", 2, 1)), ids(1))
    intent = sink.plan_batch("q", 3, 1)
    mine = run_attempt(sink, TransactionContext("q", 3, 0, 0, intent), ids(2))
    assert sink.abort_lingering("q", 3, intent, []) == 1  # its own ballot's staged file
    assert not os.path.exists(mine["staging"]) and os.path.exists(old["staging"])
    assert sink.abort_lingering("q", 3, intent, [], settled=NothingSettled()) == 0
    assert os.path.exists(old["staging"])

    class Two(Settled):
        def __init__(self) -> None:
            self._ranges = {}

        def ranges(self, query_name: str) -> list[tuple[int, int]]:
            return [(2, 2)] if query_name == "q" else []

    assert sink.abort_lingering("q", 3, intent, [], settled=Two()) == 1
    assert not os.path.exists(old["staging"])


# ----------------------------------------------------------------------------- scenario 4
def _job(sink: FileSink, log_url: str, name: str = "daily", target: str | None = None
         ) -> tuple[TransactionLog, TwoPhaseProtocol]:
    """What a batch job's run does before its batch (twophase.datasource_plan._plan): its query id is its
    name and its sink's target (``target``: what an older version named it), and it takes the log
    over."""
    target = target or sink.target()
    tlog = TransactionLog(log_url)
    tlog.acquire(batch_query_id(name, target), name, takeover=True, target=target)
    return tlog, TwoPhaseProtocol(sink, tlog, name=name, query_name=f"{name}.{tlog.scope()}",
                                  committer=lambda: Committer(sink, backoff=0.01))


def _run(protocol: TwoPhaseProtocol, sink: FileSink, batch_id: int, rows) -> str:
    from tests.inprocess import OneTask

    prog = BatchProgress("daily", batch_id, None, "committed")
    protocol.run_batch(batch_id, OneTask(sink, rows), prog)
    return prog.action


@pytest.mark.parametrize("other", [
    {"prefix": "refunds"}, {"format": "csv"}, {"partition_by": ["v"]},
], ids=["prefix", "format", "partitionBy"])
def test_two_batch_jobs_writing_other_data_sets_into_one_folder_are_not_taken_for_one(tmp_path, other):
    """Issue 59 scenario 4: job A and job B, one name and one log, write into one folder, B with
    another prefix, format or partitionBy.  Before the fix the target was the folder alone, so B was
    A to the log: its batch 0 was reported "skipped" and its rows never written.  Now B is refused,
    by a message naming both jobs' targets, and nothing of it is written."""
    out, log_url = str(tmp_path / "out"), str(tmp_path / "log")
    a = FileSink(out, format="jsonl") if "format" in other else FileSink(out)
    tlog, protocol = _job(a, log_url)
    assert _run(protocol, a, 0, ids(1, 2)) == "committed"
    tlog.close()
    files = sorted(os.listdir(out))
    b = FileSink(out, **other)
    with pytest.raises(QueryMismatchError) as refused:
        tlog_b, protocol_b = _job(b, log_url)
        try:  # before the fix: "skipped", B's rows 3 and 4 never written
            action = _run(protocol_b, b, 0, ids(3, 4))
        finally:
            tlog_b.close()
        pytest.fail(f"job B's batch 0 was {action!r} on job A's log")
    assert a.target() in str(refused.value) and b.target() in str(refused.value)
    assert sorted(os.listdir(out)) == files


def test_a_job_with_the_default_file_settings_keeps_its_log_across_the_upgrade(tmp_path):
    """A log bound by an older version (the target was the folder alone): a job with the default
    prefix, format and no partitionBy has that very target still, so it is the same job after the
    upgrade (its batch 0 is found committed, batch 1 written), not refused."""
    out, log_url = str(tmp_path / "out"), str(tmp_path / "log")
    old_target = "files " + out  # what FileSink.target() was for this folder before issue 59
    sink = FileSink(out)
    tlog, protocol = _job(sink, log_url, target=old_target)  # the older version's run
    assert _run(protocol, sink, 0, ids(1, 2)) == "committed"
    tlog.close()
    tlog, protocol = _job(FileSink(out), log_url)  # this version's
    try:
        assert tlog.generation == 1
        assert _run(protocol, sink, 0, ids(1, 2)) != "committed"  # found committed: not written twice
        assert _run(protocol, sink, 1, ids(3)) == "committed"
    finally:
        tlog.close()
    import pyarrow.parquet as pq

    rows = sorted(i for p in os.listdir(out) if p.endswith(".parquet")
                  for i in pq.read_table(os.path.join(out, p)).column("id").to_pylist())
    assert rows == [1, 2, 3]


def test_a_job_with_another_prefix_bound_by_an_older_version_is_refused_naming_both_targets(tmp_path):
    """The other side of the upgrade: a job with a prefix of its own whose log an older version bound
    to the folder alone is refused (a clear message naming both targets), never run as another job
    that finds its batches committed and writes nothing."""
    out, log_url = str(tmp_path / "out"), str(tmp_path / "log")
    old_target = "files " + out
    tlog, protocol = _job(FileSink(out, prefix="orders"), log_url, target=old_target)  # older version's run
    assert _run(protocol, FileSink(out, prefix="orders"), 0, ids(1)) == "committed"
    tlog.close()
    sink = FileSink(out, prefix="orders")
    with pytest.raises(QueryMismatchError) as refused:
        _job(sink, log_url)[0].close()
    assert old_target in str(refused.value) and sink.target() in str(refused.value)


def test_the_target_names_what_a_file_job_writes_not_how_it_reaches_it(tmp_path):
    out = str(tmp_path / "out")
    base = FileSink(out).target()
    assert FileSink(out + "/").target() == FileSink("file://" + out).target() == base
    assert FileSink(out, compression="zstd", fsync=False).target() == base  # how, not what
    names = {base, FileSink(out, prefix="x").target(), FileSink(out, format="jsonl").target(),
             FileSink(out, partition_by=["v"]).target(), FileSink(out, partition_by=["v", "w"]).target(),
             FileSink(out, partition_by=["w", "v"]).target()}
    assert len(names) == 6
    assert FileSink(out, format="json").target() == FileSink(out, format="jsonl").target()
