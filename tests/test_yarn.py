"""PySpark jobs on a real YARN (tests/services/yarn.py: a ResourceManager and two NodeManagers on
127.0.0.1), submitted with ``spark-submit --master yarn --deploy-mode cluster`` as
:func:`tests.services.yarn.spark_submit_command` builds it (issue 50).

The job (tests/drivers/yarn_files_job.py) copies JSON-lines files, one per micro-batch, through
``foreachBatch(Coordinator(FileSink(...)))`` into a local folder every NodeManager here sees.  In
cluster mode its driver runs in the ApplicationMaster's container.  Checks: every id once in the
committed output, nothing left staged, and the application's final state and attempts as the
ResourceManager's REST API reports them.  The kill test SIGKILLs the first attempt's AM container
(its whole process group: ``launch_container.sh``, the AM JVM and the Python driver under it) while
batches flow; YARN starts attempt 2 by itself (``spark.yarn.maxAppAttempts=2``), whose coordinator
takes the transaction log over (epoch 2) and finishes the job.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.services import pid_alive, wait_until, yarn
from twophase import chaos
from twophase.demo import read_output_ids, staging_left, write_input

pytestmark = [pytest.mark.spark]

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "drivers" / "yarn_files_job.py"


def _job(tmp_path: Path, name: str, files: int, records: int, *extra: str) -> tuple[list[str], list[str]]:
    ids = write_input(tmp_path / "in", files, records)
    cmd = yarn.spark_submit_command(
        JOB, "--input", str(tmp_path / "in"), "--output", str(tmp_path / "out"),
        "--checkpoint", str(tmp_path / "ck"), "--name", name, *extra,
        deploy_mode="cluster", name=name, max_app_attempts=2)
    return cmd, ids


def _app_named(name: str, timeout: float = 120.0) -> dict:
    found: list[dict] = []

    def submitted() -> bool:
        found[:] = yarn.apps_named(name)
        return bool(found)
    wait_until(submitted, timeout, f"the ResourceManager to list application {name}")
    assert len(found) == 1, found
    return found[0]


def _log_files(ck: Path) -> int:
    """Files of the transaction log (INTENT, PREPARED, COMMITTED records...): grows while batches flow."""
    return sum(len(f) for _, _, f in os.walk(ck / "twophase"))


def _committed_batches(ck: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1].split(".")[0])
                  for p in (ck / "twophase").glob("g*/batch-*.committed.json"))


def _lease(ck: Path) -> dict:
    return json.loads((ck / "twophase" / "lease.json").read_text())["body"]


def _driver_lines(service: yarn.YarnService, app_id: str, attempt: dict) -> list[str]:
    """The Python driver's line naming its container, from the AM container's log (the AM's
    PythonRunner copies the Python process's output to its stdout)."""
    d = service.nodemanager(attempt["nodeId"])
    log = service.container_log_dir(d) / app_id / attempt["containerId"] / "stdout"
    return [line for line in log.read_text(errors="replace").splitlines()
            if line.startswith("yarn-files driver:")]


def _check_output(tmp_path: Path, ids: list[str]) -> None:
    verdict = chaos.verify(ids, read_output_ids(tmp_path / "out", "parquet"))
    assert verdict.exactly_once, verdict.to_dict()
    assert verdict.records_out == len(ids)
    left = staging_left(tmp_path / "out")
    assert left == 0, f"{left} files left staged under {tmp_path / 'out' / '_twophase'}"


@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time (~1.5 min): the ApplicationMaster kill test below submits the same "
                           "job the same way and checks all of this too (ids once, nothing staged, "
                           "FINISHED/SUCCEEDED, the driver in the AM container); TWOPHASE_FULL_CHAOS=1 "
                           "runs it")
def test_a_pyspark_job_in_cluster_mode_writes_every_id_once(yarn_service, tmp_path):
    name = f"twophase-yarn-{uuid.uuid4().hex[:8]}"
    cmd, ids = _job(tmp_path, name, 4, 25)
    t0 = time.monotonic()
    with open(tmp_path / "submit.log", "wb") as log:
        r = subprocess.run(cmd, env=yarn.submit_env(), stdout=log, stderr=subprocess.STDOUT,
                           stdin=subprocess.DEVNULL, cwd=tmp_path, timeout=600)
    took = time.monotonic() - t0
    tail = (tmp_path / "submit.log").read_text(errors="replace")[-3000:]
    assert r.returncode == 0, tail
    app = _app_named(name, timeout=10)
    assert (app["state"], app["finalStatus"]) == ("FINISHED", "SUCCEEDED"), app
    attempts = yarn.app_attempts(app["id"])
    assert len(attempts) == 1, attempts
    # The Python driver ran inside the ApplicationMaster's container (cluster mode), on one of
    # the NodeManagers.
    assert attempts[0]["nodeId"] in yarn_service["nodes"], (attempts, yarn_service)
    assert _driver_lines(yarn.SERVICE, app["id"], attempts[0]) == [
        f"yarn-files driver: application {app['id']} container {attempts[0]['containerId']}"]
    _check_output(tmp_path, ids)
    assert _lease(tmp_path / "ck")["epoch"] == 1
    print(f"spark-submit --deploy-mode cluster: {took:.1f}s")


@pytest.mark.chaos
def test_the_application_master_sigkilled_mid_batch_is_restarted_by_yarn_and_every_id_lands_once(
        yarn_service, tmp_path):
    name = f"twophase-yarn-kill-{uuid.uuid4().hex[:8]}"
    files = 5
    cmd, ids = _job(tmp_path, name, files, 25)
    ck = tmp_path / "ck"
    t0 = time.monotonic()
    log = open(tmp_path / "submit.log", "wb")
    proc = subprocess.Popen(cmd, env=yarn.submit_env(), stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, cwd=tmp_path, start_new_session=True)
    try:
        app_id = _app_named(name)["id"]
        # Batch 0 committed (a coordinator's first batch probes the executors: slow), then the
        # next batch's first log record: the kill lands 0.2-1.5 s after it, mid-batch (a batch
        # takes seconds here).
        wait_until(lambda: 0 in _committed_batches(ck), 300, "batch 0 to commit", tmp_path / "submit.log")
        before = _log_files(ck)
        wait_until(lambda: _log_files(ck) > before, 120, "the next batch to start",
                   tmp_path / "submit.log", interval=0.05)
        delay = random.uniform(0.2, 1.5)
        time.sleep(delay)
        first = yarn.app_attempts(app_id)
        assert len(first) == 1, first
        am = yarn.SERVICE.container_pid(app_id, first[0]["containerId"], first[0]["nodeId"])
        assert am is not None, first
        progress_at_kill = _log_files(ck)
        committed_at_kill = _committed_batches(ck)
        os.killpg(am, signal.SIGKILL)
        killed_at = time.monotonic() - t0
        wait_until(lambda: not pid_alive(am), 30, f"the AM container's process group {am} to die")
        rc = proc.wait(timeout=540)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
    took = time.monotonic() - t0
    tail = (tmp_path / "submit.log").read_text(errors="replace")[-3000:]
    assert rc == 0, tail
    app = yarn.app(app_id)
    assert app is not None and (app["state"], app["finalStatus"]) == ("FINISHED", "SUCCEEDED"), app
    # An attempt is FINISHING until its AM container has exited, which may come after
    # spark-submit saw the application FINISHED.
    attempts: list[dict] = []

    def settled() -> bool:
        attempts[:] = yarn.app_attempts(app_id)
        return bool(attempts) and attempts[-1]["appAttemptState"] not in ("RUNNING", "FINISHING")
    wait_until(settled, 60, f"the last attempt of {app_id} to end")
    # YARN itself started the second attempt (nobody resubmitted): same application, attempt 2 in
    # a new AM container, after attempt 1's container exited killed.
    assert [a["id"] for a in attempts] == [1, 2], attempts
    assert attempts[0]["containerId"] == first[0]["containerId"]
    assert attempts[1]["containerId"] != attempts[0]["containerId"]
    assert [a["appAttemptState"] for a in attempts] == ["FAILED", "FINISHED"], attempts
    rm_log = yarn.SERVICE.daemon_log_path(yarn.RESOURCEMANAGER).read_text(errors="replace")
    assert (f"Updating application attempt {attempts[0]['appAttemptId']} with final state: FAILED, "
            f"and exit status: 137") in rm_log
    for a in attempts:
        assert _driver_lines(yarn.SERVICE, app_id, a) == [
            f"yarn-files driver: application {app_id} container {a['containerId']}"], a
    # The kill landed mid-work (batches left to commit) and attempt 2's coordinator took the log
    # over from attempt 1's (a new epoch); every batch is committed.
    assert progress_at_kill < _log_files(ck)
    assert committed_at_kill != list(range(files)), committed_at_kill
    assert _committed_batches(ck) == list(range(files))
    lease = _lease(ck)
    assert lease["epoch"] == 2, lease
    _check_output(tmp_path, ids)
    print(f"AM killed at {killed_at:.1f}s ({delay:.1f}s into batch {len(committed_at_kill)}); "
          f"spark-submit with two attempts: {took:.1f}s")


def test_start_all_leaves_yarn_to_its_fixture_and_stop_all_stops_it(monkeypatch):
    from tests.services import NAMES
    from tests.services import __main__ as cli

    calls: list[tuple[str, str]] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self) -> dict:
            calls.append(("start", self.name))
            return {}

        def stop(self) -> None:
            calls.append(("stop", self.name))

    monkeypatch.setattr(cli, "get", Fake)
    assert cli.main(["start", "all"]) == 0
    assert [n for _, n in calls] == [n for n in NAMES if n != "yarn"]
    calls.clear()
    assert cli.main(["start", "yarn"]) == 0
    assert calls == [("start", "yarn")]
    calls.clear()
    assert cli.main(["stop", "all"]) == 0
    assert [n for _, n in calls] == list(reversed(NAMES)) and ("stop", "yarn") in calls
