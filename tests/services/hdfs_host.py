"""HDFS on a test host of its own (tests/services/hosts.py): ``hdfs`` at its address.

Not the loopback service's MiniDFSCluster, which binds its DataNode to 127.0.0.1 and makes it
advertise that address whatever the configuration says: here a NameNode and a DataNode run as
HDFS's own daemons (``org.apache.hadoop.hdfs.server.namenode.NameNode`` and ``...DataNode``, from
the same Hadoop jars), two JVMs started by one shell in the ``hdfs`` host's network and UTS
namespaces, with their data in the host's folder::

    NameNode  10.231.0.33:18020 (RPC), :19870 (HTTP, WebHDFS)
    DataNode  10.231.0.33:19866 (data), :19864 (HTTP: WebHDFS's CREATE and OPEN are redirected
              here, by the address the DataNode advertises), :19867 (IPC)

Every start formats a fresh namespace.  Clients on the other test hosts (FileSink's WebHDFS
writes in executors on the worker hosts) and the test runner, on the bridge, reach it at the
host's address only.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from typing import Any

from tests.services import ServiceError, hosts, popen
from tests.services.hdfs import (
    CONF,
    HADOOP_VERSION,
    JAVA17_OPENS,
    NN_HTTP_PORT,
    NN_PORT,
    USER,
    HdfsService,
)

DN_PORT, DN_HTTP_PORT, DN_IPC_PORT = 19866, 19864, 19867
NAMENODE = "org.apache.hadoop.hdfs.server.namenode.NameNode"
DATANODE = "org.apache.hadoop.hdfs.server.datanode.DataNode"


class HdfsOnHostService(hosts.OnHost, HdfsService):
    name = "hdfs_host"
    on_host = hosts.host("hdfs")
    address = on_host.address

    def conf(self) -> dict[str, str]:
        a, d = self.address, self.dir / "data"
        return {
            **CONF,
            "fs.defaultFS": f"hdfs://{a}:{NN_PORT}",
            "dfs.namenode.rpc-address": f"{a}:{NN_PORT}",
            "dfs.namenode.http-address": f"{a}:{NN_HTTP_PORT}",
            "dfs.namenode.name.dir": str(d / "name"),
            "dfs.datanode.data.dir": str(d / "data"),
            "dfs.datanode.address": f"{a}:{DN_PORT}",
            "dfs.datanode.http.address": f"{a}:{DN_HTTP_PORT}",
            "dfs.datanode.ipc.address": f"{a}:{DN_IPC_PORT}",
            "dfs.datanode.hostname": a,
            "hadoop.tmp.dir": str(self.dir / "tmp"),
            # a lone DataNode on a small disk: do not hold the NameNode in safe mode for space
            "dfs.namenode.resource.du.reserved": "0",
            "dfs.datanode.du.reserved": "0",
        }

    def _java(self, main: str, heap: str, *args: str) -> list[str]:
        java = shutil.which("java")
        if not java:
            raise ServiceError("`java` not found; install a JDK 17 (Debian: openjdk-17-jre-headless)")
        assert self._jars is not None
        cmd = [java, f"-Xmx{heap}", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC",
               *(f"--add-opens={m}=ALL-UNNAMED" for m in JAVA17_OPENS),
               "-Djava.net.preferIPv4Stack=true", f"-Djdk.net.hosts.file={self.dir / 'hosts'}",
               f"-Dhadoop.log.dir={self.dir}", f"-Djava.io.tmpdir={self.dir / 'tmp'}",
               "-cp", ":".join(str(p) for p in self._jars), main]
        for k, v in self.conf().items():
            cmd += ["-D", f"{k}={v}"]
        return cmd + list(args)

    def launch(self, log):
        if self._jars is None:
            self.install()
        for d in ("data", "tmp"):
            shutil.rmtree(self.dir / d, ignore_errors=True)
            (self.dir / d).mkdir(parents=True)
        # Hadoop resolves its own hostname (the host's name, which no DNS here knows): the JVMs
        # read names from a hosts file of the host's own instead of /etc/hosts.
        (self.dir / "hosts").write_text(f"127.0.0.1 localhost\n{self.address} {self.on_host.name}\n")
        fmt = subprocess.run(self.command(self._java(NAMENODE, "256m", "-format", "-nonInteractive", "-force")),
                             stdout=log, stderr=subprocess.STDOUT, cwd=self.dir, timeout=120)
        if fmt.returncode != 0:
            raise ServiceError(f"hdfs_host: formatting the NameNode failed (exit {fmt.returncode}); "
                               f"log: {self.log_path}")
        nn = shlex.join(self._java(NAMENODE, "384m"))
        dn = shlex.join(self._java(DATANODE, "256m"))
        # One process group: the service's stop takes both daemons.
        script = f"{nn} & {dn} & wait"
        return popen(self.command(["sh", "-c", script]), log, cwd=self.dir)

    def info(self) -> dict[str, Any]:
        return {"namenode": f"hdfs://{self.address}:{NN_PORT}", "webhdfs_url": self.webhdfs, "user": USER,
                "version": HADOOP_VERSION, "host": self.on_host.name}


SERVICE = HdfsOnHostService()
