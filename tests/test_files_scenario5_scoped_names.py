"""Issue 25, scenario 5: FileSink's final names carry the pipeline and the generation.

Before, a part file was named ``part-<batch>-<partition>.<ext>`` whoever wrote it: a new
generation (``Coordinator(new_generation=True)``, the documented restart from a new
checkpoint) on the same output met the old generation's ``part-00000000-00000.parquet`` at
its first commit, after the decision (CommitError), and every later batch refused to start;
two pipelines appending to one folder stalled the same way; on S3 one pipeline's cleanup
(``abort_lingering``, which lists the multipart uploads under the prefix) aborted another
pipeline's decided uploads.  Now the name ends with the scope token of the coordinator's
query name (``<name>.<log id>g<generation>``), and cleanup matches only its own scope.
"""

# ruff: noqa: F811 - the fixtures hdfs, hroot, s3, sroot and s3env come from test_files_remote

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tests.test_files_remote import (  # noqa: F401 - fixtures
    hdfs,
    hopts,
    hroot,
    hstaged,
    hvisible,
    prepare,
    s3,
    s3env,
    sopen,
    sroot,
    svisible,
)
from tests.test_recovery import output_ids
from twophase import CommitOutcome
from twophase.sinks.files import FileSink

GEN1, GEN2, OTHER = "p.3f9a2b1cg1", "p.3f9a2b1cg2", "p.77e0c4d2g1"


def frame(spark, lo, hi, parts=2):
    return spark.range(lo, hi, numPartitions=parts).selectExpr("id", "concat('v', id) as v")


def staged(out: Path) -> list[Path]:
    return [p for p in (out / "_twophase").rglob("*") if p.is_file()] if (out / "_twophase").exists() else []


def test_scenario5_name_scope_is_the_log_and_generation_token():
    from twophase.sinks.files import name_scope

    assert name_scope(GEN1) == "3f9a2b1cg1" and name_scope(GEN2) == "3f9a2b1cg2"
    assert name_scope("my.app.name.3f9a2b1cg12") == "3f9a2b1cg12"
    assert name_scope("q") == "q" and name_scope("app_1") == "app_1"
    long = name_scope("a query name with spaces/and-dashes")
    assert len(long) == 8 and long == name_scope("a query name with spaces/and-dashes")
    sink = FileSink("/tmp/x")
    assert sink.final_name(3, 1, GEN1) == "part-00000003-00001-3f9a2b1cg1.parquet"
    assert sink.final_name(3, 1) == "part-00000003-00001.parquet"  # the unscoped name of old handles


# ------------------------------------------------------------------ through the coordinator
@pytest.mark.spark
@pytest.mark.parametrize("writer", ["arrow", "spark"])
def test_scenario5_new_generation_on_the_same_output_folder(spark, tmp_path, writer):
    """Restart from a new checkpoint: batch ids start again at 0 on the same output folder."""
    from twophase.coordinator import Coordinator

    out, log = tmp_path / "out", str(tmp_path / "log")
    c = Coordinator(FileSink(str(out), writer=writer), log_location=log, name="p")
    c.write(frame(spark, 0, 100), batch_id=0)
    c.write(frame(spark, 100, 150), batch_id=1)
    c.close()
    # A new query (a streaming query's new checkpoint; here a batch job of another name): its batch
    # ids start again at 0.  (The same job with the flag kept reuses its generation: the flag is bound
    # to the query it starts the generation for, tests/test_kept_new_generation.py.)
    c2 = Coordinator(FileSink(str(out), writer=writer), log_location=log, name="p2", new_generation=True)
    # Was: CommitError after the decision (the old generation's part-00000000-00000.parquet), and
    # "batch 1 was not started" for every later batch.
    assert c2.write(frame(spark, 150, 250), batch_id=0)["action"] == "committed"
    assert c2.write(frame(spark, 250, 300), batch_id=1)["action"] == "committed"
    c2.close()
    ids = output_ids(out)
    assert sorted(ids) == list(range(300)) and len(ids) == len(set(ids))
    assert staged(out) == []
    scopes = {p.name.rsplit("-", 1)[1] for p in out.rglob("part-*")}
    assert len(scopes) == 2 and all(s.endswith(".parquet") for s in scopes)


@pytest.mark.spark
@pytest.mark.parametrize("writer", ["arrow", "spark"])
def test_scenario5_two_pipelines_append_to_one_folder(spark, tmp_path, writer):
    """Two pipelines (two logs, the same coordinator name) appending to one folder, as Spark's own
    file sink allows: alternately, then concurrently."""
    from twophase.coordinator import Coordinator

    out = tmp_path / "out"
    a = Coordinator(FileSink(str(out), writer=writer), log_location=str(tmp_path / "log-a"), name="p")
    b = Coordinator(FileSink(str(out), writer=writer), log_location=str(tmp_path / "log-b"), name="p")
    a.write(frame(spark, 0, 50), batch_id=0)
    b.write(frame(spark, 1000, 1050), batch_id=0)  # was: CommitError (a's part-00000000-00000.parquet)
    a.write(frame(spark, 50, 100), batch_id=1)
    b.write(frame(spark, 1050, 1100), batch_id=1)
    errors: list[BaseException] = []

    def run(c, lo):
        try:
            c.write(frame(spark, lo, lo + 50), batch_id=2)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(a, 100)), threading.Thread(target=run, args=(b, 1100))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    a.close()
    b.close()
    ids = output_ids(out)
    assert sorted(ids) == list(range(150)) + list(range(1000, 1150)) and len(ids) == len(set(ids))
    assert staged(out) == []


# -------------------------------------------------------------------- the sink, on HDFS and S3
@pytest.mark.hdfs
def test_scenario5_hdfs_new_generation_reuses_batch_ids_without_meeting_the_old_files(hdfs_service, hdfs,
                                                                                     hroot):
    url, path = hroot
    sink = FileSink(url, storage_options=hopts(hdfs_service))
    old = prepare(sink, 0, 0, [1, 2, 3], query=GEN1)
    assert sink.commit(old).outcome is CommitOutcome.COMMITTED
    gen2 = sink.plan_batch(GEN2, 0, 1)  # the new generation's execution of batch 0
    new = prepare(sink, 0, 0, [4, 5], query=GEN2, intent=gen2)
    assert sink.commit(new).outcome is CommitOutcome.COMMITTED  # was: TwoPhaseError "already exists"
    other = prepare(sink, 0, 0, [6], query=OTHER)
    assert sink.abort_lingering(GEN2, 0, gen2, [new]) == 0
    assert sink.commit(other).outcome is CommitOutcome.COMMITTED
    assert hvisible(hdfs, path) == ["part-00000000-00000-3f9a2b1cg1.parquet", "part-00000000-00000-3f9a2b1cg2.parquet",
                                    "part-00000000-00000-77e0c4d2g1.parquet"]
    assert hstaged(hdfs, path) == []


@pytest.mark.s3
def test_scenario5_s3_new_generation_reuses_batch_ids_without_meeting_the_old_objects(s3_service, s3, sroot,
                                                                                     s3env):
    url, prefix = sroot
    sink = FileSink(url, storage_options=s3env)
    old_intent = sink.plan_batch(GEN1, 0, 1)
    # The new generation's ballot token is the old one's: only the scope keeps their names apart.
    new_intent = dict(sink.plan_batch(GEN2, 0, 1), ballot=old_intent["ballot"])
    old = prepare(sink, 0, 0, [1, 2, 3], query=GEN1, intent=old_intent)
    assert sink.commit(old).outcome is CommitOutcome.COMMITTED
    new = prepare(sink, 0, 0, [4, 5], query=GEN2, intent=new_intent)
    assert sink.commit(new).outcome is CommitOutcome.COMMITTED  # was: TwoPhaseError "already exists"
    ballot = old_intent["ballot"]
    assert svisible(s3, s3_service["bucket"], prefix) == [f"part-00000000-00000-3f9a2b1cg1-{ballot}.parquet",
                                                          f"part-00000000-00000-3f9a2b1cg2-{ballot}.parquet"]


@pytest.mark.s3
def test_scenario5_s3_cleanup_of_one_pipeline_never_aborts_anothers_uploads(s3_service, s3, sroot, s3env):
    """Pipeline A's abort_lingering (before a batch and after its commit) lists the uploads under the
    shared prefix: pipeline B's decided and pending uploads of the same batch ids must survive it."""
    url, prefix = sroot
    bucket = s3_service["bucket"]
    sink_a, sink_b = FileSink(url, storage_options=s3env), FileSink(url, storage_options=s3env)
    intent3, intent4 = sink_a.plan_batch(GEN1, 3, 1), sink_a.plan_batch(GEN1, 4, 1)  # A's ballots
    # B's ballots carry A's ballot tokens: only the scope keeps B's uploads out of A's cleanup.
    b_intent3 = dict(sink_b.plan_batch(OTHER, 3, 1), ballot=intent3["ballot"])
    b_intent4 = dict(sink_b.plan_batch(OTHER, 4, 1), ballot=intent4["ballot"])
    decided_b = prepare(sink_b, 3, 0, [1, 2, 3], query=OTHER, intent=b_intent3)  # B logged PREPARED, commit pending
    pending_b = prepare(sink_b, 4, 0, [4], query=OTHER, intent=b_intent4)        # B's batch 4, still preparing
    assert sink_a.abort_lingering(GEN1, 3, intent3, []) == 0    # A starts batch 3
    won = prepare(sink_a, 3, 0, [10, 11], query=GEN1, intent=intent3)
    lost = prepare(sink_a, 3, 0, [10, 11], attempt=1, query=GEN1, intent=intent3)  # A's failed task attempt
    assert sink_a.commit(won).outcome is CommitOutcome.COMMITTED
    assert sink_a.abort_lingering(GEN1, 3, intent3, [won]) == 1  # was: 2 (B's decided upload too)
    assert sink_a.abort_lingering(GEN1, 4, intent4, []) == 0     # was: 1 (B's pending upload)
    assert {u for _, u in sopen(s3, bucket, prefix)} == {decided_b["files"][0]["upload_id"],
                                                         pending_b["files"][0]["upload_id"]}
    assert lost["files"][0]["upload_id"] not in {u for _, u in sopen(s3, bucket, prefix)}
    assert sink_b.commit(decided_b).outcome is CommitOutcome.COMMITTED  # was: LOST
    assert sink_b.commit(pending_b).outcome is CommitOutcome.COMMITTED
    assert svisible(s3, bucket, prefix) == [f"part-00000003-00000-3f9a2b1cg1-{intent3['ballot']}.parquet",
                                            f"part-00000003-00000-77e0c4d2g1-{intent3['ballot']}.parquet",
                                            f"part-00000004-00000-77e0c4d2g1-{intent4['ballot']}.parquet"]


@pytest.mark.s3
def test_scenario5_s3_replay_of_an_intent_logged_before_scoped_names_aborts_its_old_uploads(
        s3_service, s3, sroot, s3env):
    """An INTENT without ``scope`` (logged by the previous version) still finds the unscoped uploads
    its crashed attempt left; another pipeline's scoped ones stay."""
    url, prefix = sroot
    bucket = s3_service["bucket"]
    sink = FileSink(url, storage_options=s3env)
    key = f"{prefix}/part-00000005-00001.parquet"            # what the old version wrote
    old = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    theirs = prepare(sink, 5, 0, [1], query=OTHER)
    legacy = {"fs": "s3", "bucket": bucket, "prefix": prefix + "/", "names": "part-00000005-"}
    assert sink.abort_lingering(GEN1, 5, legacy, []) == 1
    assert sopen(s3, bucket, prefix) == [(theirs["files"][0]["key"], theirs["files"][0]["upload_id"])]
    assert old not in {u for _, u in sopen(s3, bucket, prefix)}
