"""YARN across the test hosts (tests/services/hosts.py): the ResourceManager on the host
``driver-b``, a NodeManager on each of ``worker-1`` and ``worker-2``, staging on the ``hdfs`` host's
HDFS (tests/services/hdfs_host.py), since those hosts share no disk.

The same daemons as the loopback ``yarn`` service (tests/services/yarn.py), on other ports, each in
its host's network and UTS namespaces and bound to its host's address only::

    resourcemanager  10.231.0.11 (driver-b): client 28032, scheduler 28030, resource tracker 28031,
                     admin 28033, web/REST 28088
    nodemanager-1    10.231.0.21 (worker-1): containers 28041, localizer 28040, web 28042
    nodemanager-2    10.231.0.22 (worker-2): the same ports            (NodeIds worker-1:28041, worker-2:28041)

The ResourceManager skips a failed AM's node for the application's next attempt
(:data:`AM_NODE_SKIPPING`): a killed AM's attempt 2 starts on the other worker host.

``fs.defaultFS`` is the ``hdfs`` host's NameNode and ``spark.yarn.stagingDir`` a folder there
(:attr:`YarnOnHostsService.staging_url`): spark-submit uploads the job's files to HDFS and each
NodeManager localizes them from there.  Each daemon keeps its local dirs, container logs and
configuration in its own host's folder; pid files, daemon logs and the clients' HADOOP_CONF_DIR
(``conf/``) are in the service dir, where the test runner reads them.

Names: each host gets a hosts file (every test host's address and name, what ``/etc/hosts`` is on
a real cluster; ``-Djdk.net.hosts.file`` through ``JAVA_TOOL_OPTIONS``), so a NodeManager's NodeId
is its host's name and the JVMs resolve their own and each other's names without DNS; containers
inherit that ``JAVA_TOOL_OPTIONS`` from their NodeManager (``yarn.nodemanager.env-whitelist``).  An
application gives its AM and executors ``SPARK_LOCAL_IP={{NM_HOST}}`` (:data:`CONTAINER_IP`), which
YARN expands in each container to its host's name: each binds the host it lands on.  (Not one
address for all, nor the NodeManager's own ``SPARK_LOCAL_IP`` through the whitelist: Spark's AM
passes its ``SPARK_*`` variables on to the executors, on other hosts.)

Not in ``start all`` (like ``yarn``): ``python -m tests.services start yarn_hosts`` or the test
(tests/test_yarn_hosts.py) starts it; it starts the hosts and ``hdfs_host`` first.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tests.services import hosts
from tests.services.yarn import NM_CLASS, RM_CLASS, Daemon, YarnService

RM_HOST = "driver-b"
NM_HOSTS = ("worker-1", "worker-2")
RESOURCEMANAGER = Daemon("resourcemanager", RM_CLASS, (28032, 28030, 28031, 28033, 28088), RM_HOST)
NODEMANAGERS = tuple(Daemon(f"nodemanager-{i}", NM_CLASS, (28041, 28040, 28042), h)
                     for i, h in enumerate(NM_HOSTS, 1))
RM_REST = f"http://{hosts.host(RM_HOST).address}:{RESOURCEMANAGER.ports[4]}/ws/v1/cluster"
#: YARN's default env whitelist, and what a container here takes from its NodeManager besides.
ENV_WHITELIST = ("JAVA_HOME,HADOOP_COMMON_HOME,HADOOP_HDFS_HOME,HADOOP_CONF_DIR,CLASSPATH_PREPEND_DISTCACHE,"
                 "HADOOP_YARN_HOME,HADOOP_HOME,PATH,LANG,TZ,JAVA_TOOL_OPTIONS")
#: The node of a failed AM is skipped for the application's next attempt (a failed machine, as
#: YARN guesses; off by default): attempt 2 starts on the other host.  Skipping is dropped once
#: more than this share of the nodes would be skipped (default 0.2: with two nodes, always).
AM_NODE_SKIPPING = {
    "yarn.resourcemanager.am-scheduling.node-blacklisting-enabled": "true",
    "yarn.resourcemanager.am-scheduling.node-blacklisting-disable-threshold": "0.8",
}
#: ``spark_submit_command(container_ip=...)`` here: each container's NodeManager's host (its name,
#: which the hosts file resolves to the host's address).
CONTAINER_IP = "{{NM_HOST}}"


class YarnOnHostsService(YarnService):
    name = "yarn_hosts"
    start_timeout = 180.0
    resourcemanager = RESOURCEMANAGER
    nodemanagers = NODEMANAGERS
    rm_rest = RM_REST

    # -- layout ---------------------------------------------------------------
    def host_folder(self, d: Daemon) -> Path:
        """The service's folder on daemon ``d``'s host (what only that host sees)."""
        return hosts.host(d.host).folder / self.name

    def daemon_dir(self, d: Daemon) -> Path:
        return self.host_folder(d) / d.name

    def daemon_conf_dir(self, d: Daemon) -> Path:
        return self.daemon_dir(d) / "conf"

    def hosts_file(self, d: Daemon) -> Path:
        return self.host_folder(d) / "hosts"

    @property
    def staging_url(self) -> str:
        from tests.services.hdfs_host import SERVICE as hdfs_host

        return f"{hdfs_host.info()['namenode']}/yarn-hosts-staging"

    def make_staging(self) -> None:
        """Nothing: Spark makes its staging folder on HDFS."""

    def host_of(self, d: Daemon) -> str:
        return hosts.host(d.host).address

    def wrap(self, d: Daemon, argv: list[str]) -> list[str]:
        return hosts.command(d.host, argv)

    def is_node(self, d: Daemon, node_id: str) -> bool:
        return node_id == f"{d.host}:{d.ports[0]}"

    # -- configuration --------------------------------------------------------
    def site(self, d: Daemon) -> dict[str, str]:
        site = {**super().site(d), **AM_NODE_SKIPPING}
        if d is not self.resourcemanager:
            site["yarn.nodemanager.env-whitelist"] = ENV_WHITELIST
        return site

    def core_site(self) -> dict[str, str]:
        from tests.services.hdfs_host import SERVICE as hdfs_host

        return {**super().core_site(), "fs.defaultFS": hdfs_host.info()["namenode"]}

    def _env(self, d: Daemon) -> dict[str, str]:
        env = super()._env(d)
        # The daemon's JVM and (whitelisted) its containers' JVMs.
        opts = [o for o in os.environ.get("JAVA_TOOL_OPTIONS", "").split() if o]
        env["JAVA_TOOL_OPTIONS"] = " ".join([*opts, f"-Djdk.net.hosts.file={self.hosts_file(d)}"])
        return env

    # -- Service API ----------------------------------------------------------
    def install(self) -> None:
        from tests.services import hdfs_host

        hosts.SERVICE.start()  # the hosts, then the HDFS staging lives on (both idempotent)
        hdfs_host.SERVICE.start()
        names = "".join(f"{h.address} {h.name}\n" for h in hosts.HOSTS.values())
        for d in (self.resourcemanager, *self.nodemanagers):
            self.hosts_file(d).parent.mkdir(parents=True, exist_ok=True)
            self.hosts_file(d).write_text(f"127.0.0.1 localhost\n{names}")
        super().install()

    def info(self) -> dict[str, Any]:
        return {**super().info(),
                "hosts": {d.name: d.host for d in (self.resourcemanager, *self.nodemanagers)}}


SERVICE = YarnOnHostsService()
