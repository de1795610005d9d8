"""Unit tests of handles, crash points, config registry and optional-dependency errors."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from twophase import crash, handles
from twophase._deps import require
from twophase.config import resolve_secret, sink_from_config
from twophase.errors import ConfigurationError, HandleError, MissingDependencyError
from twophase.sinks.files import FileSink


def test_handle_envelope_round_trip_through_json(tmp_path):
    sink = FileSink(str(tmp_path))
    env = sink.encode_handle({"staging": "/a", "final": "/b", "size": 3, "rows": 1})
    again = sink.decode_handle(json.loads(json.dumps(env)))
    assert again == {"staging": "/a", "final": "/b", "size": 3, "rows": 1}


def test_unknown_handle_version_is_refused(tmp_path):
    sink = FileSink(str(tmp_path))
    env = sink.encode_handle({"staging": "/a", "final": "/b", "size": 3, "rows": 1})
    env["v"] = 999
    with pytest.raises(HandleError, match="version 999.*upgrade twophase"):
        sink.decode_handle(env)


def test_handle_of_another_sink_is_refused(tmp_path):
    with pytest.raises(HandleError, match="belongs to sink 'kafka'"):
        FileSink(str(tmp_path)).decode_handle({"sink": "kafka", "v": 1, "data": {}})


@pytest.mark.parametrize("key", ["password", "sasl.password", "secret_key", "api_key", "token"])
def test_handles_refuse_secret_looking_keys(key):
    with pytest.raises(HandleError, match="looks like a secret"):
        handles.encode("x", 1, {"nested": {key: "hunter2"}})


def test_crash_point_parsing_and_unknown_name(monkeypatch):
    monkeypatch.setenv(crash.ENV, "mid_commit:3,after_intent")
    crash.reload()
    assert crash.armed()
    monkeypatch.setenv(crash.ENV, "nope")
    with pytest.raises(ValueError, match="unknown crash point 'nope'"):
        crash.reload()
    monkeypatch.delenv(crash.ENV)
    crash.reload()
    assert not crash.armed()


@pytest.mark.parametrize("spec,batch,dies", [("mid_commit:3", 3, True), ("mid_commit:3", 2, False),
                                             ("mid_commit", 7, True), ("after_intent", 7, False)])
def test_crash_point_kills_the_process_only_where_armed(spec, batch, dies):
    code = f"from twophase.crash import crash_point; crash_point('mid_commit', {batch}); print('alive')"
    r = subprocess.run([sys.executable, "-c", code], env={**__import__("os").environ, crash.ENV: spec},
                       capture_output=True, text=True)
    if dies:
        assert r.returncode == crash.EXIT_CODE and "alive" not in r.stdout
    else:
        assert r.returncode == 0 and "alive" in r.stdout


def test_sink_from_config_and_secret_references(tmp_path, monkeypatch):
    sink = sink_from_config({"sink": "files", "url": str(tmp_path), "format": "jsonl"})
    assert isinstance(sink, FileSink) and sink.format == "jsonl"
    assert sink_from_config(json.dumps(sink.to_config())).to_config() == sink.to_config()
    monkeypatch.setenv("MY_SECRET", "s3cr3t")
    assert resolve_secret({"env": "MY_SECRET"}) == "s3cr3t"
    with pytest.raises(ConfigurationError, match="'NOT_SET_ANYWHERE', which is not set"):
        resolve_secret({"env": "NOT_SET_ANYWHERE"})
    with pytest.raises(ConfigurationError, match="unknown sink kind 'nosuch'"):
        sink_from_config({"sink": "nosuch"})


@pytest.mark.spark
def test_a_secret_missing_on_an_executor_says_to_set_spark_executor_env(spark):
    """In a Spark task, an unset ``{"env": NAME}`` names spark.executorEnv.NAME (executors on a
    cluster do not inherit the driver's environment); on the driver it does not."""
    def task(_):
        from twophase.config import resolve_secret
        from twophase.errors import ConfigurationError

        try:
            resolve_secret({"env": "TWOPHASE_NOT_SET_ON_EXECUTORS"}, "PostgresSink password")
        except ConfigurationError as e:
            yield str(e)

    msgs = spark.sparkContext.parallelize([0], 1).mapPartitions(task).collect()
    assert len(msgs) == 1 and "give it to them as spark.executorEnv.TWOPHASE_NOT_SET_ON_EXECUTORS" in msgs[0]
    with pytest.raises(ConfigurationError) as e:
        resolve_secret({"env": "TWOPHASE_NOT_SET_ON_EXECUTORS"})
    assert "executorEnv" not in str(e.value)


def test_missing_optional_dependency_names_the_pip_install():
    with pytest.raises(MissingDependencyError, match=r"pip install 'twophase\[kafka\]'"):
        require("confluent_kafka.this_module_does_not_exist", "KafkaSink")


def test_packaging_installs_no_top_level_sinks_or_coordinator(tmp_path):
    r = subprocess.run([sys.executable, "-c", "import sinks"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'sinks'" in r.stderr
    r = subprocess.run([sys.executable, "-c", "import coordinator"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
    r = subprocess.run([sys.executable, "-c", "import twophase.sinks.files, twophase.coordinator"],
                       cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_parallel_commits_report_the_first_failure_in_handle_order_not_the_first_to_finish():
    """Found by the harness (issue 30): which error a batch's failed commits raised depended on
    the threads' timing. Handle 0 fails slowly, handle 1 fast: handle 0's error is the one raised."""
    import time

    from twophase.errors import CommitError
    from twophase.recovery import Committer
    from twophase.sink import TwoPhaseCommitSink

    class Failing(TwoPhaseCommitSink):
        kind = "failing"

        def commit(self, handle):
            time.sleep(handle["delay"])
            raise RuntimeError(f"handle {handle['i']} failed")

        def begin_transaction(self, ctx):
            raise NotImplementedError

        def write(self, txn, batch):
            raise NotImplementedError

        def pre_commit(self, txn):
            raise NotImplementedError

        def abort(self, txn):
            raise NotImplementedError

    committer = Committer(Failing(), parallelism=2, retries=0)
    for _ in range(3):
        with pytest.raises(CommitError, match="handle 0 failed"):
            committer.commit(7, [{"i": 0, "delay": 0.2}, {"i": 1, "delay": 0.0}], recovering=False)


_CONCURRENCY = """
import sys, threading, time
from twophase.recovery import Committer
from twophase.sink import CommitResult, TwoPhaseCommitSink
lock, state = threading.Lock(), {"now": 0}

class Counting(TwoPhaseCommitSink):
    kind = "counting"
    def commit(self, handle):
        with lock:
            state["now"] += 1
            print("concurrent", state["now"], flush=True)
        time.sleep(0.1)
        with lock:
            state["now"] -= 1
        return CommitResult.committed()
    def begin_transaction(self, ctx): raise NotImplementedError
    def write(self, txn, batch): raise NotImplementedError
    def pre_commit(self, txn): raise NotImplementedError
    def abort(self, txn): raise NotImplementedError

Committer(Counting(), parallelism=4).commit(5, [{"i": i} for i in range(4)], recovering=False)
print("all committed", flush=True)
"""


@pytest.mark.parametrize("spec,parallel", [("", True), ("after_commit,after_intent:5", True),
                                           ("mid_commit:4", True), ("mid_commit:5", False), ("mid_commit", False)])
def test_commits_run_in_parallel_unless_a_mid_commit_crash_is_planned_for_the_batch(spec, parallel):
    """The kill tests arm crash points; only mid_commit needs one commit at a time (so that it leaves
    some uncommitted), every other plan meets the parallel commit path (issue 27: it never did)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != crash.ENV}
    if spec:
        env[crash.ENV] = spec
    r = subprocess.run([sys.executable, "-c", _CONCURRENCY], env=env, capture_output=True, text=True, timeout=60)
    # (a line the crash cut short, os._exit while another thread printed, counts as nothing)
    most = max(int(m.group(1)) for m in re.finditer(r"^concurrent (\d+)$", r.stdout, re.M))
    if parallel:
        assert r.returncode == 0 and "all committed" in r.stdout, r.stdout + r.stderr
        assert most > 1, f"the commits ran one at a time under TWOPHASE_CRASH_AT={spec!r}"
    else:  # one at a time, and the crash point ends the process after the first
        assert r.returncode != 0 and "all committed" not in r.stdout, r.stdout + r.stderr
        assert most == 1, r.stdout


def test_a_batch_is_vanished_only_when_every_handle_is_lost_and_never_visible():
    """The committer's side of re-running a vanished batch (the real-server twin is
    tests/test_vanished_batches.py): all handles lost and never visible -> BatchVanishedError,
    even with ignore_lost (which would drop the batch); one of them visible -> data loss."""
    from twophase.errors import BatchVanishedError, DataLossError
    from twophase.recovery import Committer
    from twophase.sink import CommitResult, TwoPhaseCommitSink

    class Gone(TwoPhaseCommitSink):
        kind = "gone"

        def commit(self, handle):
            if handle["visible"]:
                return CommitResult.already_committed("it is there")
            return CommitResult.lost(f"handle {handle['i']} rolled back", never_visible=True)

        def begin_transaction(self, ctx):
            raise NotImplementedError

        def write(self, txn, batch):
            raise NotImplementedError

        def pre_commit(self, txn):
            raise NotImplementedError

        def abort(self, txn):
            raise NotImplementedError

    gone = [{"i": 0, "visible": False}, {"i": 1, "visible": False}]
    for ignore in (False, True):
        with pytest.raises(BatchVanishedError, match="every one of its 2 transactions is gone") as e:
            Committer(Gone(), retries=0, ignore_lost=ignore).commit(3, gone, recovering=True)
        assert e.value.batch_id == 3
    partly = [{"i": 0, "visible": True}, {"i": 1, "visible": False}]
    with pytest.raises(DataLossError, match="handle 1 rolled back") as e:
        Committer(Gone(), retries=0).commit(3, partly, recovering=True)
    assert not isinstance(e.value, BatchVanishedError)
    results = Committer(Gone(), retries=0, ignore_lost=True).commit(3, partly, recovering=True)
    assert [r.outcome.value for r in results] == ["already_committed", "lost"]
