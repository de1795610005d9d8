"""Smoke tests proving the Spark standalone cluster (tests/services/spark_cluster.py) is a real one.

Each driver runs in its own process (tests/drivers/cluster_jobs.py) on a master and two one-core
workers: its tasks run in two executor JVMs of their own; an executor SIGKILLed mid-job costs a
retried task, not the job; a worker SIGKILLed with its executors mid-job leaves the job to the
other worker, and once restarted it registers and runs the application's next job.  twophase
reaches executors whose Python lacks it through ``addPyFile`` of a zip of the checkout, and that
zip holds what the wheel installs.  ``start`` brings back a worker killed a moment ago.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tests import cluster
from tests.services import pid_alive, wait_until
from tests.services.spark_cluster import SERVICE, WORKERS, alive_workers

pytestmark = [pytest.mark.services, pytest.mark.cluster]

JOBS = "tests.drivers.cluster_jobs"


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _markers(d: Path) -> list[dict]:
    """What the tasks of a ``chaos`` job wrote when they started (one file per attempt)."""
    out = []
    for p in d.glob("p*-a*"):
        out.append(json.loads(p.read_text()))
    return out


def _wait_running_on_both(markers: Path, app_id: str, timeout: float = 120.0) -> list[dict]:
    """Wait until each of the application's two executors has started a task; return the markers."""
    def both() -> bool:
        return len({m["executor_id"] for m in _markers(markers) if m["app_id"] == app_id}) >= 2
    wait_until(both, timeout, f"tasks of {app_id} running on two executors", interval=0.05)
    return _markers(markers)


def _check_rows(tasks: list[dict], n: int) -> None:
    assert sorted(t["partition"] for t in tasks) == list(range(n))
    assert all(t["rows"] == 10 for t in tasks), tasks


def test_a_job_runs_on_two_executors_each_in_its_own_jvm(cluster_driver):
    drv = cluster_driver(JOBS, "where", "4", "1")
    started = drv.wait_event("started")
    app_id = started["app_id"]
    listed = cluster.wait_for_executors(app_id, 2)
    parents = {_ppid(e.pid) for e in listed}  # while the application runs
    tasks = drv.result()["tasks"]

    _check_rows(tasks, 4)
    assert sorted(e.executor_id for e in listed) == ["0", "1"]
    assert {t["executor_id"] for t in tasks} == {"0", "1"}
    jvm = {e.executor_id: e.pid for e in listed}
    assert all(t["pid"] == jvm[t["executor_id"]] for t in tasks), (tasks, listed)
    # Two JVMs, neither the driver's Python nor its JVM: each is a child of one of the workers.
    assert len(set(jvm.values())) == 2
    assert started["driver_pid"] not in jvm.values()
    assert parents == {SERVICE.daemon_pid(w) for w in WORKERS}
    assert {t["worker_port"] for t in tasks} == {w.port for w in WORKERS}
    assert {t["python"] for t in tasks} == {sys.executable}
    # The driver has gone: the master ends the application and the workers kill its executors.
    wait_until(lambda: not cluster.executors(app_id), 60, f"the executors of {app_id} to exit")


@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time: an executor SIGKILLed mid-job and its task retried in another is the "
                           "nemesis's executor-kill (tests/test_nemesis.py, on three sinks, checking that the "
                           "killed attempt's partition ran again beside it), on the cluster of the test hosts; "
                           "TWOPHASE_FULL_CHAOS=1 runs it")
@pytest.mark.alone("SIGKILLs an executor JVM on the shared Spark standalone cluster")
def test_an_executor_sigkilled_mid_job_costs_a_retried_task_not_the_job(cluster_driver, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    drv = cluster_driver(JOBS, "chaos", str(markers), "4", "3")
    app_id = drv.wait_event("started")["app_id"]
    _wait_running_on_both(markers, app_id)
    victim = next(e for e in cluster.executors(app_id) if e.executor_id == "0")
    cluster.kill_executor(victim)
    # Partitions that had started on the victim; none can have finished (3 s per task) unless the
    # victim finished one before the other executor started its first.
    on_victim = {m["partition"] for m in _markers(markers) if m["executor_id"] == "0"}
    tasks = drv.result()["tasks"]

    assert not pid_alive(victim.pid)
    assert not any(pid_alive(m["python_pid"]) for m in _markers(markers) if m["pid"] == victim.pid)
    _check_rows(tasks, 4)
    final = {t["partition"]: t for t in tasks}
    lost = [p for p in on_victim if final[p]["executor_id"] != "0"]
    assert lost, f"no task of the killed executor was retried: {tasks}"
    for p in lost:
        assert final[p]["attempt"] >= 1, final[p]
        assert (markers / f"p{p}-a0").exists()
        assert (markers / f"p{p}-a{final[p]['attempt']}").exists()


@pytest.mark.skipif(not os.environ.get("TWOPHASE_FULL_CHAOS"),
                    reason="CI time: a worker SIGKILLed mid-job and brought back is what the PostgreSQL "
                           "cluster kill test's saboteur does (tests/test_postgres_chaos.py), its next job's rows "
                           "checked there by id; TWOPHASE_FULL_CHAOS=1 runs it")
@pytest.mark.alone("SIGKILLs a Spark standalone cluster worker and its executors, then restarts it")
def test_a_worker_sigkilled_mid_job_comes_back_and_runs_the_next_job(cluster_driver, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    drv = cluster_driver(JOBS, "chaos", str(markers), "4", "3", "again")
    app_id = drv.wait_event("started")["app_id"]
    _wait_running_on_both(markers, app_id)
    lost_worker = WORKERS[1]
    doomed = [e for e in cluster.executors(app_id) if e.worker == lost_worker.name]
    assert len(doomed) == 1
    cluster.kill_worker(lost_worker.name)  # with its executors, like a lost machine

    # Gone on return: the executor JVM and the Python workers that ran its tasks.
    assert not pid_alive(doomed[0].pid)
    ran_there = [m["python_pid"] for m in _markers(markers) if m["pid"] == doomed[0].pid]
    assert not any(pid_alive(p) for p in ran_there)
    wait_until(lambda: len(alive_workers()) == 1, 30, "the master to drop the killed worker")
    first = drv.wait_event("first", timeout=300)["tasks"]
    _check_rows(first, 4)
    assert {t["worker_port"] for t in first if t["attempt"] > 0} <= {WORKERS[0].port}
    assert any(t["attempt"] > 0 for t in first), f"no task retried after losing the worker: {first}"

    cluster.restart_worker(lost_worker.name)
    assert len(cluster.wait_for_workers(2)) == 2
    drv.send("go")  # the driver waits for two executors, then runs its second job
    second = drv.result()["second"]
    _check_rows(second, 4)
    assert {t["worker_port"] for t in second} == {w.port for w in WORKERS}
    # The restarted worker runs a new executor of the same application (ids are never reused).
    new = {t["executor_id"] for t in second if t["worker_port"] == lost_worker.port}
    assert new and doomed[0].executor_id not in new


def test_twophase_reaches_executors_without_it_by_addpyfile_of_a_zip(cluster_driver, tmp_path):
    zip_path = cluster.build_zip(tmp_path / "dist")
    python = cluster.python_without_twophase(tmp_path / "bare-venv")
    drv = cluster_driver(JOBS, "ship", str(zip_path), "4", python=python)
    res = drv.result()

    # Before addPyFile the executors' Python cannot import twophase at all...
    assert len(res["before"]) == 4
    for b in res["before"]:
        assert b.get("error", "").startswith("ModuleNotFoundError"), b
        assert b["python"] == str(python)
    # ...after it, every task imports the package, a sink and the coordinator from the zip.
    assert len(res["after"]) == 4
    for a in res["after"]:
        assert a["executor_id"] in {"0", "1"} and a["python"] == str(python)
        init, kafka, coord = a["files"]
        assert init.endswith("twophase.zip/twophase/__init__.py"), a
        assert kafka.endswith("twophase.zip/twophase/sinks/kafka/__init__.py"), a
        assert coord.endswith("twophase.zip/twophase/coordinator/__init__.py"), a
        assert a["sink"] == "KafkaSink"


def test_coordinator_checks_executors_before_the_first_batch_on_a_cluster(cluster_driver, tmp_path):
    """Issue 17: on a cluster master the first batch refuses local paths (unless shared) and
    executors that cannot import twophase, before anything is logged or written."""
    zip_path = cluster.build_zip(tmp_path / "dist")
    python = cluster.python_without_twophase(tmp_path / "bare-venv")
    root, log = tmp_path / "out", tmp_path / "log"
    res = cluster_driver(JOBS, "probe", str(zip_path), str(root), str(log), python=python).result()
    local, imports = res["refused"]
    assert "writes to local paths" in local and "shared_storage=True" in local, local
    assert "cannot import" in imports and "twophase on" in imports and "--py-files" in imports, imports
    assert "Nothing was written" in imports
    assert res["progress"]["rows"] == 100 and res["progress"]["action"] == "committed"
    visible = sorted(p.name for p in root.iterdir() if not p.name.startswith(("_", ".")))
    assert len(visible) == res["progress"]["handles"] >= 1


def test_the_readme_spark_submit_command_runs_on_the_cluster(spark_cluster_service, tmp_path):
    """docs/clusters.md, "On a cluster": spark-submit with twophase's wheel as --py-files, executors whose
    Python lacks twophase, the file-copy example on a path both workers mount; every input line
    is then in the output exactly once."""
    import os
    import shutil
    import subprocess

    from tests.services.spark_cluster import MASTER_URL, master_status

    repo = Path(cluster.REPO)
    # A wheel is a zip with the packages at its root, but Spark puts only .zip/.egg/.jar
    # py-files on the executors' sys.path: docs/clusters.md copies it to a .zip.
    wheel = cluster.build_wheel(tmp_path / "dist")
    shipped = tmp_path / "twophase.zip"
    shutil.copy(wheel, shipped)
    bare = cluster.python_without_twophase(tmp_path / "bare-venv")
    data = tmp_path / "shared"
    ex = [sys.executable, "-m", "examples.file_copy"]
    subprocess.run([*ex, "generate", "--input", str(data / "in"), "--files", "3", "--lines", "200"],
                   cwd=repo, check=True, timeout=120)
    cmd = [str(Path(sys.executable).parent / "spark-submit"), "--master", MASTER_URL,
           "--py-files", str(shipped),
           "--conf", f"spark.pyspark.python={bare}", "--conf", "spark.speculation=false",
           "--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=512m",
           "--conf", "spark.cores.max=2", "--conf", "spark.driver.host=127.0.0.1",
           "examples/file_copy.py", "run", "--input", str(data / "in"), "--output", str(data / "out"),
           "--checkpoint", str(data / "ck"), "--shared-storage"]
    env = dict(os.environ, PYTHONPATH=str(repo), PYSPARK_DRIVER_PYTHON=sys.executable,
               SPARK_LOCAL_IP="127.0.0.1")
    env.pop("PYSPARK_PYTHON", None)
    started_ms = time.time() * 1000
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    # It ran as an application of the cluster (not in local mode), which has finished.
    apps = [a for a in master_status()["completedapps"]
            if a["name"] == "file-copy" and a["starttime"] >= started_ms]
    assert len(apps) == 1 and apps[0]["state"] == "FINISHED", master_status()["completedapps"][:3]
    v = subprocess.run([*ex, "verify", "--input", str(data / "in"), "--output", str(data / "out")],
                       cwd=repo, capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and "600" in v.stdout, (v.stdout, v.stderr)


def test_the_zip_holds_the_modules_the_wheel_installs(tmp_path):
    """build_zip lays the checkout out as pip installs it (sinks/ as twophase/sinks/...)."""
    import zipfile

    wheel = cluster.build_wheel(tmp_path / "wheel")
    with zipfile.ZipFile(wheel) as w:
        installed = {n for n in w.namelist() if not n.split("/", 1)[0].endswith(".dist-info")}
    with zipfile.ZipFile(cluster.build_zip(tmp_path / "zip")) as z:
        assert set(z.namelist()) == installed


@pytest.mark.alone("SIGKILLs a Spark standalone cluster worker, then restarts it")
def test_start_brings_back_a_worker_sigkilled_a_moment_ago(spark_cluster_service):
    """What `python -m tests.services start` and cluster_driver's teardown do after chaos."""
    lost = WORKERS[1]
    old = cluster.kill_worker(lost.name)
    SERVICE.start()  # at once: the master may still count the dead worker as ALIVE

    new = SERVICE.daemon_pid(lost)
    assert new is not None and new != old
    assert SERVICE.ready()
    assert {w["port"] for w in alive_workers()} == {w.port for w in WORKERS}


def test_a_saboteur_counts_only_live_executors_it_killed_while_batches_still_flowed(monkeypatch):
    """Issue 46: a fault "struck" only if the executor it aimed at was alive at the SIGKILL and is
    gone after it, and check_fault_runs refuses a strike at or after the completing run's
    progress (the work was done).  Stand-ins for the executors; no cluster needed."""
    import subprocess

    from twophase import chaos

    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "120"])
    try:
        saboteur = cluster.Saboteur(lambda: 5, ["executor"], seed=1, app="twophase-stand-in")
        monkeypatch.setattr(saboteur, "targets",
                            lambda: [cluster.Executor(dead.pid, "app-stand-in", "0", WORKERS[0].name)])
        with pytest.raises(Exception, match="died before the SIGKILL"):
            saboteur._strike("executor")
        assert saboteur.struck == []
        monkeypatch.setattr(saboteur, "targets",
                            lambda: [cluster.Executor(live.pid, "app-stand-in", "0", WORKERS[0].name)])
        saboteur._strike("executor")
        assert live.poll() == -9
        assert [(s.executors, s.progress) for s in saboteur.struck] == [((live.pid,), 5)]
    finally:
        live.kill()
        live.wait()

    def runs(final: int) -> list[chaos.Run]:
        return [chaos.Run(1, "crash:mid_commit:1", 137, 1.0, False, "crash point fired", ["mid_commit 1 7"], 3),
                chaos.Run(2, "none", 0, 1.0, True, "completed", [], final)]

    cluster.check_fault_runs(runs(6), saboteur)  # struck at 5 of 6: batches still flowed
    with pytest.raises(AssertionError, match="after the work was done"):
        cluster.check_fault_runs(runs(5), saboteur)
    with pytest.raises(AssertionError, match="no executor or worker died"):
        cluster.check_fault_runs(runs(6), cluster.Saboteur(lambda: 5, ["executor"], seed=1))
    with pytest.raises(AssertionError, match=r"crash:mid_commit:1\) failed"):
        cluster.check_fault_runs([chaos.Run(1, "crash:mid_commit:1", 1, 1.0, False, "failed", [], 3),
                                  *runs(6)[1:]], saboteur)
