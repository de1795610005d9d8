"""A Spark Connect server of its own: the pyspark wheel's ``SparkConnectServer`` on 127.0.0.1:7190.

Started as ``sbin/start-connect-server.sh --wait`` does it (``spark-submit --class
org.apache.spark.sql.connect.service.SparkConnectServer``), with ``--master local[2]``, in its own
process group, so a test can SIGKILL the server (its driver JVM, its Python ``foreachBatch`` workers
and their children) apart from the clients, and start it again.  Clients connect with
``SparkSession.builder.remote("sc://127.0.0.1:7190")``.

The server's Python workers (``foreachBatch`` functions and tasks) run the venv's Python
(``PYSPARK_PYTHON``), which has twophase installed.  The port is below Linux's ephemeral range.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.services import Service, pid_alive, popen, port_open

HOST = "127.0.0.1"
PORT = 7190
URL = f"sc://{HOST}:{PORT}"
#: A second server of the kill test's own (tests/test_connect.py kills and restarts it, never the
#: shared one on PORT that other tests may be using).
KILL_TEST_PORT = 7191
CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
CONF = {
    "spark.connect.grpc.binding.address": HOST,
    "spark.connect.grpc.binding.port": str(PORT),
    "spark.driver.bindAddress": HOST,
    "spark.driver.host": HOST,
    "spark.driver.memory": "1g",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.log.level": "WARN",
    "spark.port.maxRetries": "0",
}


def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


class SparkConnectService(Service):
    name = "spark_connect"
    start_timeout = 180.0

    def __init__(self, name: str = "spark_connect", port: int = PORT) -> None:
        self.name, self.port = name, port

    def launch(self, log) -> subprocess.Popen | None:
        cmd = [str(spark_home() / "bin" / "spark-submit"), "--class", CLASS, "--name", "twophase-connect-server",
               "--master", "local[2]"]
        for k, v in dict(CONF, **{"spark.connect.grpc.binding.port": str(self.port)}).items():
            cmd += ["--conf", f"{k}={v}"]
        cmd.append("spark-internal")
        bindir = str(Path(sys.executable).parent)
        env = {"SPARK_HOME": str(spark_home()), "PYSPARK_PYTHON": sys.executable,
               "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "SPARK_LOCAL_IP": HOST,
               "SPARK_CONNECT_MODE": "0"}
        return popen(cmd, log, env=env, cwd=self.dir)

    def ready(self) -> bool:
        return port_open(self.port, HOST)

    def info(self) -> dict[str, Any]:
        return {"url": f"sc://{HOST}:{self.port}", "host": HOST, "port": self.port, "log": str(self.log_path)}

    def kill(self) -> None:
        """SIGKILL the server's whole process group (a lost driver host) and wait until it is gone."""
        pid = self.pid()
        if pid is None:
            return
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 30
        while (pid_alive(pid) or port_open(self.port, HOST)) and time.monotonic() < deadline:
            time.sleep(0.2)
        self._proc = None
        self.pid_path.unlink(missing_ok=True)


SERVICE = SparkConnectService()
