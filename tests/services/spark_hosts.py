"""A Spark standalone cluster across the test hosts (tests/services/hosts.py): the master on the
bridge's root address, one worker on each of the hosts ``worker-1`` and ``worker-2`` (in their
network and UTS namespaces, each advertising its own address), four cores each (two drivers, each holding one two-core executor on each).

The same daemons as ``tests/services/spark_cluster.py`` (the loopback cluster), on other ports::

    master    10.231.0.1:7277,  web UI (JSON status) :7278   (the root namespace: no fault reaches it)
    worker-1  10.231.0.21:7279, web UI :7280, 4 cores, 1g
    worker-2  10.231.0.22:7279, web UI :7280, 4 cores, 1g

A driver on a test host (the nemesis's ``driver-a`` or ``driver-b``) uses ``MASTER_URL`` and
advertises its own address (``spark.driver.host``); its executors run on the worker hosts, so an
executor can be cut from its driver, paused or killed apart from it.  Two cores per worker let a
stage retry run its new attempt of a partition while the old attempt still runs on the other
worker.
"""

from __future__ import annotations

from tests.services import hosts
from tests.services.spark_cluster import MASTER_CLASS, WORKER_CLASS, Daemon, SparkClusterService

HOST = hosts.ROOT_ADDRESS
MASTER_PORT, MASTER_UI_PORT = 7277, 7278
MASTER_URL = f"spark://{HOST}:{MASTER_PORT}"
MASTER_JSON = f"http://{HOST}:{MASTER_UI_PORT}/json/"
#: Worker daemons by test host (the daemon's name is its host's).
WORKER_HOSTS = ("worker-1", "worker-2")


class SparkOnHostsService(SparkClusterService):
    name = "spark_hosts"
    master = Daemon("master", MASTER_CLASS, MASTER_PORT, MASTER_UI_PORT)
    workers = tuple(Daemon(h, WORKER_CLASS, 7279, 7280) for h in WORKER_HOSTS)
    worker_cores = 4
    master_url = MASTER_URL
    master_json = MASTER_JSON

    def install(self) -> None:
        hosts.SERVICE.start()  # the hosts must exist first (idempotent)
        super().install()

    def host_of(self, d: Daemon) -> str:
        return HOST if d is self.master else hosts.host(d.name).address

    def wrap(self, d: Daemon, argv: list[str]) -> list[str]:
        return argv if d is self.master else hosts.command(d.name, argv)


SERVICE = SparkOnHostsService()
