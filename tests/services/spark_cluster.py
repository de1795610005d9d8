"""Spark standalone cluster: a master and two one-core workers on 127.0.0.1, from the pyspark wheel.

Every daemon is started with the wheel's own ``bin/spark-class`` (``SPARK_HOME`` = the installed
``pyspark`` package), in its own process group, its pid in ``<service dir>/<daemon>.pid`` and its
log in ``<service dir>/<daemon>.log``::

    master    org.apache.spark.deploy.master.Master  127.0.0.1:7177, web UI (JSON status) :7178
    worker-1  org.apache.spark.deploy.worker.Worker  127.0.0.1:7179, web UI :7180, 1 core, 1g
    worker-2  org.apache.spark.deploy.worker.Worker  127.0.0.1:7181, web UI :7182, 1 core, 1g

Fixed ports are below Linux's ephemeral range (32768-60999), so no outgoing connection can hold
them; ``spark.port.maxRetries=0`` makes a daemon fail instead of drifting onto a neighbour's port.
The master's REST submission server is off.  Readiness is read from the master's JSON status
(``/json/``): status ALIVE and both workers ALIVE.

Executors are JVMs the workers fork per application (``CoarseGrainedExecutorBackend``), in their
worker's process group; each forks a Python daemon (``pyspark.daemon``, a process group of its own)
whose children run the tasks.  ``kill_daemon(..., scope="tree")`` kills all of that at once (a
lost machine); ``stop`` lets the workers end their executors.

Which Python runs an executor's tasks is decided by the *driver*: PySpark sends its own
``PYSPARK_PYTHON`` (default ``python3``) with every task, and neither ``spark.pyspark.python`` nor
``spark.executorEnv.PYSPARK_PYTHON`` changes it for a driver started as a plain Python process.
The workers therefore get the venv's ``bin`` first on ``PATH`` (so a driver's default ``python3``
is the venv's) as well as ``PYSPARK_PYTHON``; drivers started with
:func:`tests.cluster.start_driver` set ``PYSPARK_PYTHON`` themselves.  ``PYTHONPATH`` is not
passed to the workers: tasks see what the application ships and what the interpreter has.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.services import Service, ServiceError, locked, pid_alive, popen, port_open, wait_until

HOST = "127.0.0.1"
MASTER_PORT = 7177
MASTER_UI_PORT = 7178
MASTER_URL = f"spark://{HOST}:{MASTER_PORT}"
MASTER_JSON = f"http://{HOST}:{MASTER_UI_PORT}/json/"
WORKER_CORES = 1
WORKER_MEMORY = "1g"
#: Heap of the master and worker JVMs themselves (they only schedule and fork executors).
DAEMON_MEMORY = "256m"
#: The daemons are short-lived and mostly idle: C1 only and the serial GC start faster and use
#: less CPU on a 2-core machine shared with Kafka, HDFS and the test JVMs.
DAEMON_JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC -Djava.net.preferIPv4Stack=true"

MASTER_CLASS = "org.apache.spark.deploy.master.Master"
WORKER_CLASS = "org.apache.spark.deploy.worker.Worker"

#: For master *and* workers: the master drops a worker silent this long (a killed worker's
#: dropped connection drops it at once), and a worker sends heartbeats every quarter of it (a
#: worker left at the 60 s default would beat every 15 s and be dropped by a 20 s master).
COMMON_CONF = {
    "spark.worker.timeout": "20",
    "spark.port.maxRetries": "0",
}
MASTER_CONF = {
    **COMMON_CONF,
    "spark.master.rest.enabled": "false",
}
WORKER_CONF = {
    **COMMON_CONF,
    # Finished applications' dirs (executor logs, shipped files) go after 6 h.
    "spark.worker.cleanup.enabled": "true",
    "spark.worker.cleanup.interval": "1800",
    "spark.worker.cleanup.appDataTtl": str(6 * 3600),
}

LOG4J2_PROPERTIES = """\
# Written by tests/services/spark_cluster.py; on the classpath of the daemons and the executors.
rootLogger.level = warn
rootLogger.appenderRef.stdout.ref = console
appender.console.type = Console
appender.console.name = console
appender.console.target = SYSTEM_ERR
appender.console.layout.type = PatternLayout
appender.console.layout.pattern = %d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n%ex
# Registration, executor launch/exit and task loss are what a chaos test needs to read.
logger.deploy.name = org.apache.spark.deploy
logger.deploy.level = info
logger.executor.name = org.apache.spark.executor
logger.executor.level = info
"""


@dataclass(frozen=True)
class Daemon:
    """One JVM of the cluster: its name (pid and log file stem), main class and fixed ports."""

    name: str
    main_class: str
    port: int
    ui_port: int


MASTER = Daemon("master", MASTER_CLASS, MASTER_PORT, MASTER_UI_PORT)
WORKERS = (
    Daemon("worker-1", WORKER_CLASS, 7179, 7180),
    Daemon("worker-2", WORKER_CLASS, 7181, 7182),
)


def spark_home() -> Path:
    """The installed ``pyspark`` package directory, which is a complete ``SPARK_HOME``."""
    try:
        import pyspark
    except ImportError:
        raise ServiceError("pyspark is not installed in this interpreter "
                           "(pip install -e .[test])") from None
    return Path(pyspark.__file__).resolve().parent


def master_status(timeout: float = 2.0, url: str = MASTER_JSON) -> dict[str, Any] | None:
    """The master's JSON status (workers, applications), or None if it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def alive_workers(status: dict[str, Any] | None = None, url: str = MASTER_JSON) -> list[dict[str, Any]]:
    """The workers the master counts as ALIVE (a killed one is DEAD or gone)."""
    st = master_status(url=url) if status is None else status
    if not st:
        return []
    return [w for w in st.get("workers", []) if w.get("state") == "ALIVE"]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, their children...), from one scan of ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _spark_version(home: Path) -> str | None:
    """Spark version of a ``SPARK_HOME`` from its ``jars/spark-core_<scala>-<version>.jar``."""
    for jar in home.glob("jars/spark-core_*.jar"):
        return jar.stem.rsplit("-", 1)[1]
    return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class SparkClusterService(Service):
    """Master + two workers; ``start`` starts each daemon that is not running, ``stop`` all."""

    name = "spark_cluster"
    start_timeout = 90.0
    master = MASTER
    workers = WORKERS
    worker_cores = WORKER_CORES
    master_url = MASTER_URL
    master_json = MASTER_JSON

    def __init__(self) -> None:
        self._procs: dict[str, subprocess.Popen] = {}

    # -- layout ---------------------------------------------------------------
    @property
    def pid_path(self) -> Path:
        return self.daemon_pid_path(self.master)

    @property
    def log_path(self) -> Path:
        return self.daemon_log_path(self.master)

    @property
    def conf_dir(self) -> Path:
        return self.dir / "conf"

    def daemon_pid_path(self, d: Daemon) -> Path:
        return self.dir / f"{d.name}.pid"

    def daemon_log_path(self, d: Daemon) -> Path:
        return self.dir / f"{d.name}.log"

    def work_dir(self, d: Daemon) -> Path:
        """Where worker ``d`` keeps a directory per application and executor (logs, files)."""
        return self.dir / d.name / "work"

    # -- processes ------------------------------------------------------------
    def daemon_pid(self, d: Daemon) -> int | None:
        """Pid of daemon ``d`` if the recorded process is alive and is that daemon (not a reuse)."""
        try:
            pid = int(self.daemon_pid_path(d).read_text().strip())
        except (OSError, ValueError):
            return None
        cmd = _cmdline(pid)
        ours = d.main_class.encode() in cmd and f"--port\0{d.port}\0".encode() in cmd
        if not ours or not pid_alive(pid):
            return None
        return pid

    def host_of(self, d: Daemon) -> str:
        """The address daemon ``d`` binds and advertises."""
        return HOST

    def wrap(self, d: Daemon, argv: list[str]) -> list[str]:
        """``argv`` as daemon ``d`` is started (as is here; on its test host in a subclass)."""
        return argv

    def _env(self, d: Daemon) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_"))
               and k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(
            SPARK_HOME=str(spark_home()),
            SPARK_CONF_DIR=str(self.conf_dir),
            SPARK_LOCAL_IP=self.host_of(d),
            SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
            SPARK_DAEMON_JAVA_OPTS=DAEMON_JAVA_OPTS,
            PYSPARK_PYTHON=sys.executable,
            PATH=venv_bin + os.pathsep + env.get("PATH", ""),
        )
        return env

    def _command(self, d: Daemon) -> list[str]:
        cmd = [str(spark_home() / "bin" / "spark-class"), d.main_class,
               "--host", self.host_of(d), "--port", str(d.port), "--webui-port", str(d.ui_port)]
        if d.main_class == MASTER_CLASS:
            return cmd + ["--properties-file", str(self.conf_dir / "master.conf")]
        return cmd + ["--cores", str(self.worker_cores), "--memory", WORKER_MEMORY,
                      "--work-dir", str(self.work_dir(d)),
                      "--properties-file", str(self.conf_dir / "worker.conf"), self.master_url]

    def start_daemon(self, d: Daemon, timeout: float = 60.0) -> int:
        """Start daemon ``d`` unless it runs; return its pid.  Does not wait for it to register.

        A worker killed a moment ago may still be ALIVE to the master, which then refuses a new
        worker at the same address: wait until the master has dropped it first.
        """
        pid = self.daemon_pid(d)
        if pid is not None:
            return pid
        if d.main_class == WORKER_CLASS:
            me = (self.host_of(d), d.port)
            wait_until(lambda: all((w.get("host"), w.get("port")) != me
                                   for w in alive_workers(url=self.master_json)), timeout,
                       f"the master to drop the dead {d.name}", self.log_path, interval=0.1)
        for port in (d.port, d.ui_port):
            if port_open(port, self.host_of(d)):
                raise ServiceError(
                    f"port {port} ({d.name}) is taken by a process this module did not start "
                    f"(no live {d.name} pid in {self.daemon_pid_path(d)}); stop it first")
        if d.main_class == WORKER_CLASS:
            self.work_dir(d).mkdir(parents=True, exist_ok=True)
        with open(self.daemon_log_path(d), "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {d.name}\n".encode())
            log.flush()
            proc = popen(self.wrap(d, self._command(d)), log, env=self._env(d), cwd=self.dir)
        self._procs[d.name] = proc
        self.daemon_pid_path(d).write_text(str(proc.pid))
        return proc.pid

    def kill_daemon(self, d: Daemon, sig: int = signal.SIGKILL, timeout: float = 30.0,
                    scope: str = "group") -> int | None:
        """Send ``sig`` to daemon ``d`` and wait until it is gone; return the pid it had (None if it
        was not running).  ``scope``: ``"process"`` the daemon JVM alone; ``"group"`` its process
        group (a worker's executors are in it); ``"tree"`` the group and every descendant, found
        before the signal (the executors' Python daemons make groups of their own), all awaited:
        a lost machine."""
        pid = self.daemon_pid(d)
        if pid is None:
            self.daemon_pid_path(d).unlink(missing_ok=True)
            return None
        others = descendants(pid) if scope == "tree" else []
        try:
            if scope == "process":
                os.kill(pid, sig)
            else:
                os.killpg(pid, sig)
            for p in others:
                os.kill(p, sig)
        except ProcessLookupError:
            pass
        proc = self._procs.pop(d.name, None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc is not None:
                proc.poll()  # reap our own child so it does not linger as a zombie
            if not pid_alive(pid) and not any(pid_alive(p) for p in others):
                break
            time.sleep(0.05)
        else:
            if sig != signal.SIGKILL:
                return self.kill_daemon(d, signal.SIGKILL, timeout, scope)
            raise ServiceError(f"{d.name} (pid {pid}) or a descendant still alive {timeout:.0f}s "
                               f"after signal {sig}")
        self.daemon_pid_path(d).unlink(missing_ok=True)
        return pid

    def _check_exited(self) -> None:
        """Raise at once (instead of waiting out a timeout) if a daemon this call started died."""
        for name, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[name]
                log = self.dir / f"{name}.log"
                lines = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
                raise ServiceError(f"spark_cluster {name} exited with code {proc.returncode}; "
                                   f"log: {log}\n" + "\n".join(lines))

    def wait_workers(self, n: int | None = None, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Wait until the master counts at least ``n`` (default: all) ALIVE workers; return them."""
        n = len(self.workers) if n is None else n
        def enough() -> bool:
            self._check_exited()
            return len(alive_workers(url=self.master_json)) >= n
        wait_until(enough, timeout, f"{n} ALIVE Spark workers at {self.master_json}", self.log_path,
                   interval=0.2)
        return alive_workers(url=self.master_json)

    # -- Service API ----------------------------------------------------------
    def install(self) -> None:
        if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
            raise ServiceError("`java` not found; install a JDK 17 "
                               "(Debian: openjdk-17-jre-headless)")
        home = spark_home()
        if not (home / "bin" / "spark-class").exists() or _spark_version(home) is None:
            raise ServiceError(f"{home} lacks bin/spark-class or jars/spark-core_*.jar: "
                               "reinstall pyspark")
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        (self.conf_dir / "log4j2.properties").write_text(LOG4J2_PROPERTIES)
        for fname, conf in (("master.conf", MASTER_CONF), ("worker.conf", WORKER_CONF)):
            (self.conf_dir / fname).write_text("".join(f"{k} {v}\n" for k, v in conf.items()))

    def launch(self, log) -> None:
        # The master first: a worker that finds no master retries only after 5-15 s.
        if self.daemon_pid(self.master) is None:
            self.start_daemon(self.master)

        def master_alive() -> bool:
            self._check_exited()
            st = master_status(url=self.master_json)
            return bool(st) and st.get("status") == "ALIVE"
        wait_until(master_alive, self.start_timeout, f"the Spark master at {self.master_json}",
                   self.log_path, 0.2)
        for w in self.workers:
            self.start_daemon(w)

    def _ready_or_exited(self) -> bool:
        self._check_exited()
        return self.ready()

    def ready(self) -> bool:
        """The three daemons this module started are alive, and the master is ALIVE and counts
        both workers (by address and port) as ALIVE: the master alone still counts a worker killed a moment
        ago."""
        if any(self.daemon_pid(d) is None for d in (self.master, *self.workers)):
            return False
        st = master_status(url=self.master_json)
        if not st or st.get("status") != "ALIVE":
            return False
        found = {(w.get("host"), w.get("port")) for w in alive_workers(st)}
        return all((self.host_of(w), w.port) in found for w in self.workers)

    def after_ready(self) -> None:
        """Refuse a cluster that another environment started with a Spark this one cannot drive.

        The cluster is shared by every checkout on the machine (fixed ports, one state dir); its
        workers run executors from the ``SPARK_HOME`` they were started with.  A driver and
        executors of different Spark versions fail in obscure ways, and a deleted venv leaves
        executors that cannot start at all.
        """
        home = self.running_env("SPARK_HOME")
        if home is None or Path(home) == spark_home():
            return
        import pyspark

        theirs = _spark_version(Path(home))
        if theirs != pyspark.__version__:
            raise ServiceError(
                f"the running Spark cluster was started from {home} (Spark {theirs or 'missing'}), "
                f"this interpreter has pyspark {pyspark.__version__}: run `python -m "
                f"tests.services stop spark_cluster` and start it again from this environment")

    def info(self) -> dict[str, Any]:
        return {
            "master_url": self.master_url,
            "master_json": self.master_json,
            "workers": [f"{self.host_of(w)}:{w.port}" for w in self.workers],
            "worker_cores": self.worker_cores,
            "worker_memory": WORKER_MEMORY,
            "spark_home": self.running_env("SPARK_HOME"),
            "pyspark_python": self.running_env("PYSPARK_PYTHON"),
        }

    def running_env(self, name: str) -> str | None:
        """Environment variable ``name`` of the running workers (None if unknown): what the
        cluster really runs with, whichever environment started it."""
        for d in self.workers:
            pid = self.daemon_pid(d)
            if pid is None:
                continue
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for item in environ:
                if item.startswith(name.encode() + b"="):
                    return item.split(b"=", 1)[1].decode()
        return None

    def stop(self) -> None:
        with locked(self.dir / ".start.lock"):
            self.terminate()

    def terminate(self) -> None:
        # Workers first (with their executors), so the master does not relaunch anything.
        for d in (*self.workers, self.master):
            self.kill_daemon(d, signal.SIGTERM)
        self._procs.clear()

    def status(self) -> dict[str, Any]:
        st = super().status()
        st["pids"] = {d.name: self.daemon_pid(d) for d in (self.master, *self.workers)}
        return st


SERVICE = SparkClusterService()
