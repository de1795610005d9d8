"""HDFS: Hadoop's MiniDFSCluster (one NameNode + one DataNode in one JVM) on loopback.

Jars: ``org.apache.hadoop:hadoop-minicluster`` and its runtime deps from Maven Central
(via :mod:`tests.services.maven`), plus JUnit 4, which the test-jar code behind
``MiniDFSCluster`` calls (``GenericTestUtils`` -> ``org.junit.Assert``).  Started as::

    java -Xmx1g -cp <jars> org.apache.hadoop.mapreduce.MiniHadoopClusterManager \\
         -nomr -format -nnport 18020 -nnhttpport 19870 -D ...

Every start formats a fresh namespace (the data lives under the service dir and is
wiped first).  WebHDFS is on the NameNode http port; writes are redirected to the
DataNode's http port, which MiniDFSCluster binds to and advertises as 127.0.0.1.
On Java 17 it needs ``--add-opens java.base/java.lang=ALL-UNNAMED`` (see JAVA17_OPENS).
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from typing import Any

from tests.services import Service, ServiceError, popen

HADOOP_VERSION = "3.4.3"
COORDS = [
    f"org.apache.hadoop:hadoop-minicluster:{HADOOP_VERSION}",
    "junit:junit:4.13.2",
]
NN_PORT = 18020
NN_HTTP_PORT = 19870
USER = "root"
#: Java 17: JAXB (WebHDFS JSON/exception responses) calls ClassLoader.defineClass
#: reflectively; without java.lang opened every WebHDFS request that reaches it fails
#: with InaccessibleObjectException -> HTTP 500, forever (class init error).  The rest
#: are the usual set Hadoop/Spark open on Java 17.
JAVA17_OPENS = [
    "java.base/java.lang", "java.base/java.lang.reflect", "java.base/java.io",
    "java.base/java.net", "java.base/java.nio", "java.base/java.util",
    "java.base/java.util.concurrent", "java.base/sun.nio.ch", "java.base/sun.security.action",
]
WEBHDFS = f"http://127.0.0.1:{NN_HTTP_PORT}"

#: Configuration handed to the minicluster with ``-D`` (it copies them into its Configuration).
CONF = {
    "dfs.permissions.enabled": "false",
    "hadoop.security.authentication": "simple",
    "dfs.webhdfs.enabled": "true",
    "dfs.replication": "1",
    # The DataNode must advertise loopback: WebHDFS redirects CREATE/OPEN/APPEND to it.
    "dfs.datanode.hostname": "127.0.0.1",
    # Small, fast-failing clients inside the JVM; no trash, no safe-mode extension.
    "dfs.namenode.safemode.extension": "0",
    "fs.trash.interval": "0",
    # A WebHDFS CREATE closes the file from the DFSClient *inside* the DataNode, which
    # usually asks the NameNode to complete the file before the DataNode's own
    # block-received report has arrived; the NameNode refuses ("COMMITTED but not
    # COMPLETE") and that client sleeps this long before asking again (default 400 ms,
    # doubling).  Measured here: 28 of 44 FileSink (WebHDFS) files paid it, 3 of 72 of
    # Spark's (native client, another process).  With replication 1 the NameNode's own
    # remedy (dfs.namenode.file.close.num-committed-allowed) does not apply.  Operators
    # writing through WebHDFS set the same on their DataNodes: docs/files.md.
    "dfs.client.block.write.locateFollowingBlock.initial.delay.ms": "20",
}


def _get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read().decode())


class HdfsService(Service):
    name = "hdfs"
    start_timeout = 120.0
    #: The address clients reach the NameNode and the DataNode at (WebHDFS's redirects name it).
    address = "127.0.0.1"

    @property
    def webhdfs(self) -> str:
        return f"http://{self.address}:{NN_HTTP_PORT}"

    def __init__(self) -> None:
        self._jars: list | None = None

    # -- install --------------------------------------------------------------
    def install(self) -> None:
        from tests.services.maven import resolve

        self._jars = resolve(COORDS, f"hadoop-{HADOOP_VERSION}")
        if not any(p.name.startswith("hadoop-mapreduce-client-jobclient") and p.name.endswith("-tests.jar")
                   for p in self._jars):
            raise ServiceError(f"resolved hadoop jars lack the jobclient test-jar (MiniHadoopClusterManager): "
                               f"{self._jars[0].parent}")

    # -- launch ---------------------------------------------------------------
    def launch(self, log):
        if self._jars is None:
            self.install()
        java = shutil.which("java")
        if not java:
            raise ServiceError("`java` not found; install a JDK 17 (Debian: openjdk-17-jre-headless)")
        data = self.dir / "data"
        tmp = self.dir / "tmp"
        for d in (data, tmp):
            shutil.rmtree(d, ignore_errors=True)
            d.mkdir(parents=True)
        cp = ":".join(str(p) for p in self._jars)
        cmd = [
            java, "-Xmx1g",
            *(f"--add-opens={m}=ALL-UNNAMED" for m in JAVA17_OPENS),
            "-Djava.net.preferIPv4Stack=true",
            f"-Djava.io.tmpdir={tmp}",          # jetty unpacks its webapps here
            f"-Dtest.build.data={data}",        # MiniDFSCluster's base directory
            f"-Dhadoop.log.dir={self.dir}",
            "-cp", cp,
            "org.apache.hadoop.mapreduce.MiniHadoopClusterManager",
            "-nomr", "-format",
            "-nnport", str(NN_PORT), "-nnhttpport", str(NN_HTTP_PORT),
            "-writeConfig", str(self.dir / "hdfs-conf.xml"),
            "-writeDetails", str(self.dir / "details.json"),
        ]
        for k, v in CONF.items():
            cmd += ["-D", f"{k}={v}"]
        return popen(cmd, log, cwd=self.dir)

    # -- readiness ------------------------------------------------------------
    def ready(self) -> bool:
        """WebHDFS answers, the NameNode is out of safe mode and one DataNode is live."""
        try:
            st = _get_json(f"{self.webhdfs}/webhdfs/v1/?op=GETFILESTATUS&user.name={USER}")
            if st.get("FileStatus", {}).get("type") != "DIRECTORY":
                return False
            beans = _get_json(f"{self.webhdfs}/jmx?qry=Hadoop:service=NameNode,name=NameNodeInfo")["beans"]
            if not beans:
                return False
            info = beans[0]
            live = json.loads(info.get("LiveNodes") or "{}")
            return info.get("Safemode", "x") == "" and len(live) >= 1
        except (OSError, ValueError, KeyError, urllib.error.URLError):
            return False

    def after_ready(self) -> None:
        """Prove the DataNode write path from outside the JVM (CREATE -> 307 -> DataNode)."""
        path = "/tmp/.twophase-probe"
        base = f"{self.webhdfs}/webhdfs/v1{path}"
        try:
            req = urllib.request.Request(
                f"{self.webhdfs}/webhdfs/v1/tmp?op=MKDIRS&permission=777&user.name={USER}", method="PUT")
            urllib.request.urlopen(req, timeout=10).close()
            req = urllib.request.Request(f"{base}?op=CREATE&overwrite=true&user.name={USER}", method="PUT")
            try:
                urllib.request.urlopen(req, timeout=10).close()
                raise ServiceError("WebHDFS CREATE did not redirect to a DataNode")
            except urllib.error.HTTPError as e:
                if e.code != 307:
                    raise
                location = e.headers["Location"]
            if not location.startswith(f"http://{self.address}:"):
                raise ServiceError(f"DataNode advertises {location}, not {self.address}")
            req = urllib.request.Request(location, data=b"ok", method="PUT",
                                         headers={"Content-Type": "application/octet-stream"})
            urllib.request.urlopen(req, timeout=10).close()
            req = urllib.request.Request(f"{base}?op=DELETE&user.name={USER}", method="DELETE")
            urllib.request.urlopen(req, timeout=10).close()
        except (OSError, urllib.error.URLError) as e:
            raise ServiceError(f"HDFS is up but a WebHDFS write failed: {e}; log: {self.log_path}") from e

    def info(self) -> dict[str, Any]:
        return {
            "namenode": f"hdfs://{self.address}:{NN_PORT}",
            "webhdfs_url": self.webhdfs,
            "user": USER,
            "version": HADOOP_VERSION,
            "conf": str(self.dir / "hdfs-conf.xml"),
        }


SERVICE = HdfsService()
