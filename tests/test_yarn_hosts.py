"""YARN on the test hosts apart (tests/services/yarn_hosts.py: the ResourceManager on ``driver-b``,
NodeManagers on ``worker-1`` and ``worker-2``, staging on the ``hdfs`` host's HDFS; issue 50).

The job (tests/drivers/yarn_job.py ``--sink hdfs``) is submitted in cluster mode from the root
namespace and reads its input from, and writes its output, checkpoint and transaction log to, the
``hdfs`` host's HDFS: no host reads another's disk.  The AM and the executors get
``SPARK_LOCAL_IP={{NM_HOST}}``, which YARN expands in each container to its own host: the AM's
driver binds the host it landed on and the executors on the other host connect to it there.  The
AM's container is SIGKILLed mid-batch; YARN starts attempt 2 by itself on the other worker host,
which takes the log over once attempt 1's lease has expired (``--lease-timeout``); every id lands
once, nothing is left staged, Spark's own staging folder (on HDFS, listed there during the run) is
gone afterwards.

The scenario is the one tests/test_yarn.py runs on loopback in CI (the AM SIGKILLed mid-batch,
``[hdfs]``), without its executor kill; it runs with ``TWOPHASE_FULL_CHAOS=1``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from tests.services import hosts, pid_alive, wait_until, yarn
from tests.services.yarn_hosts import CONTAINER_IP
from tests.services.yarn_hosts import SERVICE as YARN_HOSTS
from tests.test_yarn import (
    AM_SIGKILL_CI,
    FILES,
    FULL,
    JOB,
    RECORDS,
    _check_target,
    _committed,
    _end,
    _hdfs_target,
    _mid_batch,
    _stop,
    _submit,
)
from twophase.demo import write_input

BASE = YARN_HOSTS.rm_rest
#: The coordinator's lease_timeout: attempt 2, on the other host, cannot tell by pid that attempt 1
#: is dead; it is refused the log until attempt 1's last heartbeat is this old (docs/clusters.md,
#: YARN).  Attempt 2 reached the log 1 to 2.5 min after the kill here (a new AM JVM, SparkContext
#: and executors first): with the default 120 s it can be refused (LogOwnershipError) and fail.
LEASE_TIMEOUT = 10
#: Both tests that start YARN on the hosts (three more JVMs): not in CI.
ON_HOSTS = [pytest.mark.spark, pytest.mark.hosts,
            pytest.mark.skipif(hosts.available() is not None, reason=f"test hosts: {hosts.available()}"),
            pytest.mark.skipif(not FULL, reason=f"CI time (YARN on the test hosts, and a job with two attempts: "
                                                f"minutes on a loaded 2-core machine): tests/test_yarn.py::"
                                                f"{AM_SIGKILL_CI} runs this scenario on loopback in CI; "
                                                "TWOPHASE_FULL_CHAOS=1 runs it")]


def on_hosts(test):
    for mark in ON_HOSTS:
        test = mark(test)
    return test


@pytest.fixture(scope="module")
def yarn_hosts_service() -> dict:
    from tests.conftest import _service

    return _service("yarn_hosts")


def _app_named(name: str, timeout: float = 120.0) -> dict:
    found: list[dict] = []

    def submitted() -> bool:
        found[:] = yarn.apps_named(name, base=BASE)
        return bool(found)
    wait_until(submitted, timeout, f"the ResourceManager at {BASE} to list application {name}")
    assert len(found) == 1, found
    return found[0]


def _kill_app(app_id: str) -> None:
    """Kill the application if it still runs (killing spark-submit does not end it)."""
    if (yarn.app(app_id, base=BASE) or {}).get("state") not in (None, "FINISHED", "FAILED", "KILLED"):
        req = urllib.request.Request(f"{BASE}/apps/{app_id}/state", method="PUT", data=b'{"state": "KILLED"}',
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=10).close()


def _listening(host: str, pid: int) -> list[str]:
    """Addresses process ``pid`` listens on (TCP), as seen on test host ``host``."""
    out = hosts.run(host, ["ss", "-ltnpH"], capture_output=True, text=True, timeout=60).stdout
    return sorted(line.split()[3] for line in out.splitlines() if f"pid={pid}," in line)


def _skipped_for(attempt: dict) -> list[str]:
    """The nodes the ResourceManager kept an attempt's AM off (after an AM failed there)."""
    return [h for h in attempt.get("nodesBlacklistedBySystem", "").split(",") if h]


def _lease(t) -> dict:
    """The log's lease: the host (its hostname) and epoch of the coordinator that holds it."""
    return json.loads(t.log_read("lease.json"))["body"]


def _check_listening(host: str, java: int) -> None:
    """A container's JVM listens on its host's address (the driver's and the block manager's
    ports), and else on loopback only (its Python workers' sockets)."""
    address = hosts.host(host).address
    listening = [a.removeprefix("[::ffff:").replace("]:", ":") for a in _listening(host, java)]
    assert any(a.startswith(f"{address}:") for a in listening), (host, listening)
    assert all(a.startswith((f"{address}:", "127.0.0.1:")) for a in listening), (host, listening)


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode(errors="replace").split("=", 1) for i in items if b"=" in i)


def _containers(app_id: str) -> dict[str, tuple[str, int]]:
    """The application's running containers: id -> (the test host it runs on, its leader's pid)."""
    found = {}
    for d in YARN_HOSTS.nodemanagers:
        for f in (YARN_HOSTS.local_dir(d) / "nmPrivate" / app_id).glob("container_*/container_*.pid"):
            try:
                pid = int(f.read_text().strip())
            except (OSError, ValueError):
                continue
            if pid_alive(pid):
                found[f.parent.name] = (d.host, pid)
    return found


def _java_below(leader: int) -> int:
    """The JVM a container's launch script (its process group leader) started."""
    from tests.services.spark_cluster import _cmdline, descendants

    javas = [p for p in (leader, *descendants(leader)) if _cmdline(p).split(b"\0")[0].endswith(b"/java")]
    assert javas, f"no JVM below container leader {leader}"
    return javas[0]


@on_hosts
def test_the_daemons_listen_on_their_own_hosts_address_only(yarn_hosts_service):
    """Each daemon runs on its test host (in its network namespace) and every socket it listens on
    is on that host's address; the NodeManagers registered under their hosts' names."""
    assert yarn_hosts_service["nodes"] == [f"{h}:28041" for h in ("worker-1", "worker-2")]
    for d in (YARN_HOSTS.resourcemanager, *YARN_HOSTS.nodemanagers):
        pid = YARN_HOSTS.daemon_pid(d)
        assert pid is not None and pid in hosts.pids(d.host), (d, pid)
        address = hosts.host(d.host).address
        assert _listening(d.host, pid) == sorted(f"{address}:{p}" for p in d.ports), d


@pytest.mark.chaos
@on_hosts
def test_the_am_sigkilled_on_its_host_is_restarted_by_yarn_and_every_id_lands_once(yarn_hosts_service, tmp_path,
                                                                                   request):
    from hdfs import InsecureClient

    from tests.conftest import _service

    info = _service("hdfs_host")
    client = InsecureClient(info["webhdfs_url"], user=info["user"])
    t = _hdfs_target(tmp_path, info)
    request.addfinalizer(t.cleanup)
    name = f"yarn-hosts-{uuid.uuid4().hex[:8]}"
    request.addfinalizer(lambda: client.delete(f"/twophase-yarn-hosts/{name}", recursive=True))
    ids = write_input(tmp_path / "in", FILES, RECORDS)
    input_dir = f"/twophase-yarn-hosts/{name}/in"
    for f in sorted((tmp_path / "in").glob("*.json")):
        client.upload(f"{input_dir}/{f.name}", str(f))
    args = t.args(tmp_path, name)
    args[args.index("--input") + 1] = f"{info['namenode']}{input_dir}"
    args += ["--lease-timeout", str(LEASE_TIMEOUT)]
    staging = YARN_HOSTS.staging_url
    assert staging.startswith(f"{info['namenode']}/")
    cmd = yarn.spark_submit_command(JOB, *args, deploy_mode="cluster", name=name, max_app_attempts=2,
                                    staging_dir=staging, container_ip=CONTAINER_IP)
    log = tmp_path / "submit.log"
    t0 = time.monotonic()
    proc = _submit(cmd, yarn.submit_env(YARN_HOSTS.conf_dir, extra={"SPARK_LOCAL_IP": hosts.ROOT_ADDRESS}),
                   log, tmp_path)
    app_id = ""
    try:
        app_id = _app_named(name)["id"]
        # Spark's staging folder is on the hdfs host's HDFS: spark-submit says it uploaded the job
        # there, and it is there.
        uploaded = re.findall(r"Uploading resource file:\S+ -> (\S+)/__spark_conf__\.zip", log.read_text())
        assert len(uploaded) == 1 and uploaded[0].startswith(f"{staging}/"), uploaded
        assert uploaded[0].endswith(f"/.sparkStaging/{app_id}"), uploaded
        app_staging = uploaded[0].removeprefix(info["namenode"])
        staged = client.list(app_staging, status=False)
        assert {"__spark_conf__.zip", JOB.name} <= set(staged), staged
        first: list[dict] = []

        def am_launched() -> bool:
            first[:] = yarn.app_attempts(app_id, base=BASE)
            return len(first) == 1 and bool(first[0].get("containerId"))
        wait_until(am_launched, 120, f"the AM container of {app_id}", log)
        am_host = first[0]["nodeId"].split(":")[0]
        assert am_host in ("worker-1", "worker-2"), first

        delay = _mid_batch(t, log)
        running = _containers(app_id)
        # Attempt 1's AM and executors run on both worker hosts (one NodeManager has room for the
        # AM and one executor), each JVM with its own host as SPARK_LOCAL_IP, listening there.
        assert {h for h, _ in running.values()} == {"worker-1", "worker-2"}, running
        for container, (host, leader) in running.items():
            java = _java_below(leader)
            assert java in hosts.pids(host), (container, host)
            assert _environ(java).get("SPARK_LOCAL_IP") == host, (container, host)
            _check_listening(host, java)
        am = YARN_HOSTS.container_pid(app_id, first[0]["containerId"], first[0]["nodeId"])
        assert am is not None and running[first[0]["containerId"]] == (am_host, am), (first, running)
        holder = _lease(t)
        os.killpg(am, signal.SIGKILL)
        killed_at = time.time()
        wait_until(lambda: not pid_alive(am), 30, f"the AM container's process group {am} to die")
        progress_at_kill, committed_at_kill = len(t.log_names()), _committed(t)  # what attempt 1 did
        rc = _end(proc, 540)
    finally:
        _stop(proc)
        if app_id:
            _kill_app(app_id)
    took = time.monotonic() - t0
    assert rc == 0, log.read_text(errors="replace")[-3000:]
    app = yarn.app(app_id, base=BASE)
    assert app is not None and (app["state"], app["finalStatus"]) == ("FINISHED", "SUCCEEDED"), app
    attempts: list[dict] = []

    def settled() -> bool:
        attempts[:] = yarn.app_attempts(app_id, base=BASE)
        return bool(attempts) and attempts[-1]["appAttemptState"] not in ("RUNNING", "FINISHING")
    wait_until(settled, 60, f"the last attempt of {app_id} to end")
    # YARN itself started attempt 2 (nobody resubmitted), in a new AM container on a worker host.
    assert [a["id"] for a in attempts] == [1, 2], attempts
    assert [a["appAttemptState"] for a in attempts] == ["FAILED", "FINISHED"], attempts
    assert attempts[0]["containerId"] == first[0]["containerId"] != attempts[1]["containerId"]
    # On the other worker host (the ResourceManager skips a failed AM's node), which took the
    # log over once attempt 1's lease (held on the first host) had expired.
    second_host = attempts[1]["nodeId"].split(":")[0]
    assert {am_host, second_host} == {"worker-1", "worker-2"}, attempts
    assert _skipped_for(attempts[1]) == [am_host], attempts
    assert (holder["host"], holder["epoch"]) == (am_host, 1), holder
    assert (_lease(t)["host"], _lease(t)["epoch"]) == (second_host, 2), _lease(t)
    taken = json.loads(t.log_read("epochs/0000000002.json"))["body"]["started_at"] - killed_at
    rm_log = YARN_HOSTS.daemon_log_path(YARN_HOSTS.resourcemanager).read_text(errors="replace")
    assert (f"Updating application attempt {attempts[0]['appAttemptId']} with final state: FAILED, "
            f"and exit status: 137") in rm_log
    assert progress_at_kill < len(t.log_names())
    assert committed_at_kill != list(range(FILES)), committed_at_kill
    assert _committed(t) == list(range(FILES))
    _check_target(t, ids)
    # Spark removed its staging folder on HDFS when the application succeeded.
    assert not client.status(app_staging, strict=False), client.list(app_staging)
    print(f"AM SIGKILLed on {am_host} {delay:.1f}s into batch {len(committed_at_kill)}; attempt 2 on "
          f"{second_host}, took the log {taken:.0f}s after the kill; staging {info['namenode']}{app_staging}: {took:.1f}s")


def test_start_all_leaves_yarn_hosts_to_its_fixture(monkeypatch):
    from tests.services import NAMES, ON_DEMAND
    from tests.services import __main__ as cli

    started: list[str] = []

    class Fake:
        def __init__(self, name: str) -> None:
            self.name = name

        def start(self) -> dict:
            started.append(self.name)
            return {}

    monkeypatch.setattr(cli, "get", Fake)
    assert "yarn_hosts" in NAMES and "yarn_hosts" in ON_DEMAND
    assert cli.main(["start", "all"]) == 0
    assert "yarn_hosts" not in started and "hdfs_host" in started
    started.clear()
    assert cli.main(["start", "yarn_hosts"]) == 0
    assert started == ["yarn_hosts"]
