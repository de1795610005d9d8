"""YARN: a ResourceManager and two NodeManagers on 127.0.0.1, from the HDFS minicluster's Hadoop jars.

The jars are the ones :mod:`tests.services.hdfs` resolves (``hadoop-minicluster`` pulls the
ResourceManager and NodeManager in), so no download of its own.  Each daemon is a JVM of its own
process group, its pid in ``<service dir>/<daemon>.pid``, its log in ``<service dir>/<daemon>.log``,
its configuration in ``<service dir>/conf-<daemon>/`` (first on its classpath)::

    resourcemanager  client 18032, scheduler 18030, resource tracker 18031, admin 18033, web/REST 18088
    nodemanager-1    containers 18041, localizer 18040, web 18042   (NodeId localhost:18041)
    nodemanager-2    containers 18044, localizer 18043, web 18045   (NodeId localhost:18044)

(a NodeId's host is the name 127.0.0.1 resolves to: ``localhost``.)

FIFO scheduler, memory checks off, 2048 MB and 2 vcores per NodeManager (a 512m driver or executor
with Spark's 384 MB overhead takes 896 MB: an ApplicationMaster and two executors fit, with room
for a second attempt's AM), ``yarn.resourcemanager.am.max-attempts`` 2 (YARN's default; Spark's
``spark.yarn.maxAppAttempts`` may only lower it).  Every address of the daemons is on 127.0.0.1;
applications give their containers ``SPARK_LOCAL_IP=127.0.0.1`` (:func:`spark_submit_command`):
without it Spark binds the machine's outward interface.  ``fs.defaultFS`` is the local filesystem: staging
(``spark.yarn.stagingDir``) is ``<service dir>/staging``, which every NodeManager here reads.

Clients (``spark-submit --master yarn``) use ``HADOOP_CONF_DIR=<service dir>/conf`` (the
ResourceManager's addresses): see :func:`spark_submit_command` and :func:`submit_env`.

Containers are launched by the DefaultContainerExecutor with ``setsid``: each container is a process
group of its own (``bash launch_container.sh`` and the JVM and Python under it), whose leader's pid the
NodeManager writes to ``nmPrivate/<app>/<container>/<container>.pid`` in its local dir
(:func:`container_pid`).  ``stop`` ends the NodeManagers first (they end their containers), then
SIGKILLs whatever container process they left.
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
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from tests.services import Service, ServiceError, locked, pid_alive, popen, port_open, wait_until

HOST = "127.0.0.1"
RM_PORT = 18032
RM_SCHEDULER_PORT = 18030
RM_TRACKER_PORT = 18031
RM_ADMIN_PORT = 18033
RM_WEB_PORT = 18088
RM_REST = f"http://{HOST}:{RM_WEB_PORT}/ws/v1/cluster"
#: Resources each NodeManager advertises (not enforced: the memory checks are off).
NM_MEMORY_MB = 2048
NM_VCORES = 2
#: Heap of each daemon JVM (they schedule and launch; the containers are separate JVMs).
DAEMON_HEAP = "320m"
DAEMON_JAVA_OPTS = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", "-Djava.net.preferIPv4Stack=true"]

RM_CLASS = "org.apache.hadoop.yarn.server.resourcemanager.ResourceManager"
NM_CLASS = "org.apache.hadoop.yarn.server.nodemanager.NodeManager"


@dataclass(frozen=True)
class Daemon:
    """One JVM: its name (pid, log, conf dir), main class and its fixed ports."""

    name: str
    main_class: str
    ports: tuple[int, ...]  #: the first is the one that names it (RM client port, NM container port)
    host: str = ""  #: the test host it runs on (tests/services/hosts.py); "" for this machine


RESOURCEMANAGER = Daemon("resourcemanager", RM_CLASS,
                         (RM_PORT, RM_SCHEDULER_PORT, RM_TRACKER_PORT, RM_ADMIN_PORT, RM_WEB_PORT))
#: (container manager, localizer, web) of each NodeManager.
NODEMANAGERS = (
    Daemon("nodemanager-1", NM_CLASS, (18041, 18040, 18042)),
    Daemon("nodemanager-2", NM_CLASS, (18044, 18043, 18045)),
)

CORE_SITE = {
    "fs.defaultFS": "file:///",
    "hadoop.security.authentication": "simple",
}


def rm_site(host: str, rm: Daemon) -> dict[str, str]:
    """The configuration of a ResourceManager at ``host`` with ``rm``'s ports (client, scheduler,
    resource tracker, admin, web), which is also what clients get as HADOOP_CONF_DIR."""
    port, scheduler, tracker, admin, web = rm.ports
    return {
        "yarn.resourcemanager.hostname": host,
        "yarn.resourcemanager.bind-host": host,
        "yarn.resourcemanager.address": f"{host}:{port}",
        "yarn.resourcemanager.scheduler.address": f"{host}:{scheduler}",
        "yarn.resourcemanager.resource-tracker.address": f"{host}:{tracker}",
        "yarn.resourcemanager.admin.address": f"{host}:{admin}",
        "yarn.resourcemanager.webapp.address": f"{host}:{web}",
        **RM_SCHEDULING,
    }


#: What every ResourceManager here is, whatever its addresses.
RM_SCHEDULING = {
    "yarn.resourcemanager.scheduler.class":
        "org.apache.hadoop.yarn.server.resourcemanager.scheduler.fifo.FifoScheduler",
    "yarn.scheduler.minimum-allocation-mb": "128",
    "yarn.scheduler.maximum-allocation-mb": str(NM_MEMORY_MB),
    "yarn.scheduler.maximum-allocation-vcores": str(NM_VCORES),
    "yarn.resourcemanager.am.max-attempts": "2",
    "yarn.resourcemanager.recovery.enabled": "false",
    "yarn.timeline-service.enabled": "false",
    "yarn.log-aggregation-enable": "false",
    # A NodeManager gone silent is dropped after 30 s (default 10 min), so a killed one does not
    # hold containers the scheduler counts on.
    "yarn.nm.liveness-monitor.expiry-interval-ms": "30000",
}


def nm_site(d: Daemon, host: str, rm: dict[str, str], local: Path, logs: Path) -> dict[str, str]:
    """The configuration of NodeManager ``d`` at ``host``, of the ResourceManager whose
    configuration is ``rm``, its local and container log dirs ``local`` and ``logs``."""
    port, localizer, web = d.ports
    return {
        **rm,
        "yarn.nodemanager.hostname": host,
        "yarn.nodemanager.bind-host": host,
        "yarn.nodemanager.address": f"{host}:{port}",
        "yarn.nodemanager.localizer.address": f"{host}:{localizer}",
        "yarn.nodemanager.webapp.address": f"{host}:{web}",
        "yarn.nodemanager.local-dirs": str(local),
        "yarn.nodemanager.log-dirs": str(logs),
        "yarn.nodemanager.resource.memory-mb": str(NM_MEMORY_MB),
        "yarn.nodemanager.resource.cpu-vcores": str(NM_VCORES),
        "yarn.nodemanager.pmem-check-enabled": "false",
        "yarn.nodemanager.vmem-check-enabled": "false",
        # Container logs stay 6 h in log-dirs (no aggregation); app dirs go at once.
        "yarn.nodemanager.log.retain-seconds": str(6 * 3600),
        # The shared test machine's disk may be fuller than YARN's 90 % default allows.
        "yarn.nodemanager.disk-health-checker.max-disk-utilization-per-disk-percentage": "99",
        "yarn.nodemanager.recovery.enabled": "false",
    }


RM_SITE = rm_site(HOST, RESOURCEMANAGER)

LOG4J_PROPERTIES = """\
# Written by tests/services/yarn.py; first on the daemons' classpath (Hadoop logs through reload4j).
log4j.rootLogger=WARN,console
log4j.appender.console=org.apache.log4j.ConsoleAppender
log4j.appender.console.target=System.err
log4j.appender.console.layout=org.apache.log4j.PatternLayout
log4j.appender.console.layout.ConversionPattern=%d{yy/MM/dd HH:mm:ss} %p %c{1}: %m%n
# Applications, attempts and containers changing state: what a kill test reads.
log4j.logger.org.apache.hadoop.yarn.server.resourcemanager.rmapp=INFO
log4j.logger.org.apache.hadoop.yarn.server.resourcemanager.ResourceTrackerService=INFO
log4j.logger.org.apache.hadoop.yarn.server.nodemanager.containermanager.container=INFO
log4j.logger.org.apache.hadoop.yarn.server.nodemanager.containermanager.launcher=INFO
log4j.logger.org.apache.hadoop.yarn.server.nodemanager.NodeStatusUpdaterImpl=INFO
"""


def _site_xml(conf: dict[str, str]) -> str:
    props = "".join(f"  <property><name>{escape(k)}</name><value>{escape(v)}</value></property>\n"
                    for k, v in conf.items())
    return f'<?xml version="1.0"?>\n<!-- written by tests/services/yarn.py -->\n<configuration>\n{props}</configuration>\n'


def rest(path: str, timeout: float = 3.0, base: str = RM_REST) -> Any:
    """GET ``<RM REST>/<path>`` as JSON (``apps/<id>``, ``nodes``...); None if the RM does not answer.
    ``base``: another ResourceManager's REST root (``YarnService.rm_rest``)."""
    req = urllib.request.Request(f"{base}/{path.lstrip('/')}", headers={"Accept": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read().decode())
    except (OSError, ValueError, urllib.error.URLError):
        return None


def running_nodes(base: str = RM_REST) -> list[str]:
    """NodeIds (``host:port``) the ResourceManager counts as RUNNING."""
    got = rest("nodes", base=base)
    nodes = ((got or {}).get("nodes") or {}).get("node") or []
    return sorted(n["id"] for n in nodes if n.get("state") == "RUNNING")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def java_home() -> str:
    """JAVA_HOME for the containers (Spark's AM command is ``{{JAVA_HOME}}/bin/java``)."""
    if os.environ.get("JAVA_HOME"):
        return os.environ["JAVA_HOME"]
    java = shutil.which("java")
    if not java:
        raise ServiceError("`java` not found; install a JDK 17 (Debian: openjdk-17-jre-headless)")
    return str(Path(java).resolve().parent.parent)


class YarnService(Service):
    name = "yarn"
    start_timeout = 120.0
    resourcemanager = RESOURCEMANAGER
    nodemanagers: tuple[Daemon, ...] = NODEMANAGERS
    rm_rest = RM_REST

    def __init__(self) -> None:
        self._jars: list[Path] | None = None
        self._procs: dict[str, subprocess.Popen] = {}

    # -- layout ---------------------------------------------------------------
    @property
    def pid_path(self) -> Path:
        return self.daemon_pid_path(self.resourcemanager)

    @property
    def log_path(self) -> Path:
        return self.daemon_log_path(self.resourcemanager)

    @property
    def conf_dir(self) -> Path:
        """HADOOP_CONF_DIR for clients (the ResourceManager's own configuration)."""
        return self.dir / "conf"

    @property
    def staging_dir(self) -> Path:
        return self.dir / "staging"

    @property
    def staging_url(self) -> str:
        """``spark.yarn.stagingDir`` of the applications (a local folder here, every NodeManager's)."""
        return self.staging_dir.as_uri()

    def host_of(self, d: Daemon) -> str:
        """The address daemon ``d`` binds and advertises."""
        return HOST

    def wrap(self, d: Daemon, argv: list[str]) -> list[str]:
        """``argv`` as daemon ``d`` is started (as is here; on its test host in a subclass)."""
        return argv

    def daemon_dir(self, d: Daemon) -> Path:
        """Daemon ``d``'s own folder: its local dirs, container logs, tmp."""
        return self.dir / d.name

    def daemon_conf_dir(self, d: Daemon) -> Path:
        return self.conf_dir if d is self.resourcemanager else self.dir / f"conf-{d.name}"

    def daemon_pid_path(self, d: Daemon) -> Path:
        return self.dir / f"{d.name}.pid"

    def daemon_log_path(self, d: Daemon) -> Path:
        return self.dir / f"{d.name}.log"

    def local_dir(self, d: Daemon) -> Path:
        return self.daemon_dir(d) / "local"

    def container_log_dir(self, d: Daemon) -> Path:
        return self.daemon_dir(d) / "logs"

    def is_node(self, d: Daemon, node_id: str) -> bool:
        """Whether NodeId ``node_id`` is NodeManager ``d``'s: by its container port here (the host
        part is the name the NodeManager's address resolves to, ``localhost`` here)."""
        return node_id.rsplit(":", 1)[-1] == str(d.ports[0])

    def nodemanager(self, node_id: str) -> Daemon:
        """The NodeManager of a NodeId."""
        for d in self.nodemanagers:
            if self.is_node(d, node_id):
                return d
        raise ServiceError(f"no NodeManager of this service is {node_id}")

    def site(self, d: Daemon) -> dict[str, str]:
        """Daemon ``d``'s yarn-site.xml."""
        rm = rm_site(self.host_of(self.resourcemanager), self.resourcemanager)
        if d is self.resourcemanager:
            return rm
        return nm_site(d, self.host_of(d), rm, self.local_dir(d), self.container_log_dir(d))

    def core_site(self) -> dict[str, str]:
        return CORE_SITE

    # -- processes ------------------------------------------------------------
    def daemon_pid(self, d: Daemon) -> int | None:
        """Pid of daemon ``d`` if the recorded process is alive and is that daemon (not a reuse)."""
        try:
            pid = int(self.daemon_pid_path(d).read_text().strip())
        except (OSError, ValueError):
            return None
        cmd = _cmdline(pid)
        # Its conf dir is the first classpath entry (conf/ is a prefix of conf-nodemanager-1/).
        ours = d.main_class.encode() in cmd and f"\0{self.daemon_conf_dir(d)}:".encode() in cmd
        return pid if ours and pid_alive(pid) else None

    def _command(self, d: Daemon) -> list[str]:
        java = str(Path(java_home()) / "bin" / "java")
        from tests.services.hdfs import JAVA17_OPENS

        assert self._jars is not None
        cp = ":".join([str(self.daemon_conf_dir(d)), *(str(p) for p in self._jars)])
        own = self.daemon_dir(d)
        return [java, f"-Xmx{DAEMON_HEAP}", *DAEMON_JAVA_OPTS,
                *(f"--add-opens={m}=ALL-UNNAMED" for m in JAVA17_OPENS),
                f"-Dhadoop.log.dir={own}", f"-Dyarn.log.dir={own}",
                f"-Dhadoop.tmp.dir={own / 'tmp'}", f"-Djava.io.tmpdir={own / 'tmp'}",
                "-cp", cp, d.main_class]

    def _env(self, d: Daemon) -> dict[str, str]:
        venv_bin = str(Path(sys.executable).parent)
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SPARK_", "PYSPARK_", "HADOOP_", "YARN_"))
               and k not in ("PYTHONPATH", "PYTHONHOME", "CLASSPATH")}
        # PATH is in YARN's env whitelist: containers find the venv's python3 first.
        env.update(JAVA_HOME=java_home(), SPARK_LOCAL_IP=self.host_of(d),
                   PATH=venv_bin + os.pathsep + env.get("PATH", ""))
        return env

    def start_daemon(self, d: Daemon) -> int:
        """Start daemon ``d`` unless it runs; return its pid (does not wait for it)."""
        pid = self.daemon_pid(d)
        if pid is not None:
            return pid
        for port in d.ports:
            if port_open(port, self.host_of(d)):
                raise ServiceError(
                    f"port {port} ({d.name}) is taken by a process this module did not start "
                    f"(no live {d.name} pid in {self.daemon_pid_path(d)}); stop it first")
        if d.main_class == NM_CLASS:
            # A NodeManager starts with empty local dirs (no recovery): what a dead one left goes.
            shutil.rmtree(self.local_dir(d), ignore_errors=True)
            self.local_dir(d).mkdir(parents=True)
            self.container_log_dir(d).mkdir(parents=True, exist_ok=True)
        (self.daemon_dir(d) / "tmp").mkdir(parents=True, exist_ok=True)
        with open(self.daemon_log_path(d), "ab") as log:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} starting {d.name}\n".encode())
            log.flush()
            proc = popen(self.wrap(d, self._command(d)), log, env=self._env(d), cwd=self.daemon_dir(d))
        self._procs[d.name] = proc
        self.daemon_pid_path(d).write_text(str(proc.pid))
        return proc.pid

    def kill_daemon(self, d: Daemon, sig: int = signal.SIGKILL, timeout: float = 30.0) -> int | None:
        """Send ``sig`` to daemon ``d``'s process group and wait until it is gone (SIGKILL after
        ``timeout``); then SIGKILL every process that was below it (a NodeManager's containers are
        process groups of their own).  Returns the pid it had, None if it was not running."""
        from tests.services.spark_cluster import descendants

        pid = self.daemon_pid(d)
        if pid is None:
            self.daemon_pid_path(d).unlink(missing_ok=True)
            return None
        below = descendants(pid)
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass
        proc = self._procs.pop(d.name, None)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            if proc is not None:
                proc.poll()
            time.sleep(0.1)
        if pid_alive(pid):
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            wait_until(lambda: not pid_alive(pid), 10, f"{d.name} (pid {pid}) to die")
        for p in below:
            if pid_alive(p):
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.daemon_pid_path(d).unlink(missing_ok=True)
        return pid

    def _check_exited(self) -> None:
        for name, proc in list(self._procs.items()):
            if proc.poll() is not None:
                del self._procs[name]
                log = self.dir / f"{name}.log"
                lines = log.read_text(errors="replace").splitlines()[-30:] if log.exists() else []
                raise ServiceError(f"{self.name} {name} exited with code {proc.returncode}; log: {log}\n"
                                   + "\n".join(lines))

    # -- Service API ----------------------------------------------------------
    def install(self) -> None:
        from tests.services.hdfs import COORDS, HADOOP_VERSION
        from tests.services.maven import resolve

        java_home()
        self._jars = resolve(COORDS, f"hadoop-{HADOOP_VERSION}")
        for cls in ("resourcemanager", "nodemanager"):
            if not any(p.name.startswith(f"hadoop-yarn-server-{cls}-") for p in self._jars):
                raise ServiceError(f"the resolved Hadoop jars lack hadoop-yarn-server-{cls}: "
                                   f"{self._jars[0].parent}")
        self.make_staging()
        # Each daemon's configuration, then the clients' (the ResourceManager's own here).
        for d in (self.resourcemanager, *self.nodemanagers, None):
            conf = self.conf_dir if d is None else self.daemon_conf_dir(d)
            conf.mkdir(parents=True, exist_ok=True)
            (conf / "yarn-site.xml").write_text(_site_xml(self.site(d or self.resourcemanager)))
            (conf / "core-site.xml").write_text(_site_xml(self.core_site()))
            (conf / "log4j.properties").write_text(LOG4J_PROPERTIES)

    def make_staging(self) -> None:
        self.staging_dir.mkdir(parents=True, exist_ok=True)

    def launch(self, log) -> None:
        if self._jars is None:
            self.install()
        # All at once: a NodeManager retries its registration until the ResourceManager answers.
        for d in (self.resourcemanager, *self.nodemanagers):
            self.start_daemon(d)

    def _ready_or_exited(self) -> bool:
        self._check_exited()
        return self.ready()

    def ready(self) -> bool:
        """The daemons this module started are alive, the ResourceManager is STARTED and counts
        each of the NodeManagers RUNNING."""
        if any(self.daemon_pid(d) is None for d in (self.resourcemanager, *self.nodemanagers)):
            return False
        info = (rest("info", base=self.rm_rest) or {}).get("clusterInfo") or {}
        if info.get("state") != "STARTED":
            return False
        nodes = running_nodes(self.rm_rest)
        return all(any(self.is_node(d, n) for n in nodes) for d in self.nodemanagers)

    def info(self) -> dict[str, Any]:
        return {
            "resourcemanager": f"{self.host_of(self.resourcemanager)}:{self.resourcemanager.ports[0]}",
            "rest": self.rm_rest,
            "hadoop_conf_dir": str(self.conf_dir),
            "staging_dir": self.staging_url,
            "nodes": running_nodes(self.rm_rest),
            "node_memory_mb": NM_MEMORY_MB,
            "node_vcores": NM_VCORES,
        }

    def stop(self) -> None:
        with locked(self.dir / ".start.lock"):
            self.terminate()

    def terminate(self) -> None:
        # NodeManagers first (they stop their containers), so the RM schedules nothing more.
        for d in (*self.nodemanagers, self.resourcemanager):
            self.kill_daemon(d, signal.SIGTERM)
        self._procs.clear()

    def status(self) -> dict[str, Any]:
        st = super().status()
        st["pids"] = {d.name: self.daemon_pid(d) for d in (self.resourcemanager, *self.nodemanagers)}
        return st

    # -- applications ---------------------------------------------------------
    def container_pid(self, app_id: str, container_id: str, node_id: str) -> int | None:
        """Pid of the process-group leader of a running container (None if it has none yet or
        ended): from the pid file its NodeManager wrote."""
        d = self.nodemanager(node_id)
        p = self.local_dir(d) / "nmPrivate" / app_id / container_id / f"{container_id}.pid"
        try:
            pid = int(p.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None


SERVICE = YarnService()


# --------------------------------------------------------------------------- clients

def app(app_id: str, base: str = RM_REST) -> dict[str, Any] | None:
    """The ResourceManager's report of an application (state, finalStatus, diagnostics...)."""
    got = rest(f"apps/{app_id}", base=base)
    return (got or {}).get("app")


def app_attempts(app_id: str, base: str = RM_REST) -> list[dict[str, Any]]:
    """The application's attempts, oldest first (id, containerId, nodeId, appAttemptState...)."""
    got = rest(f"apps/{app_id}/appattempts", base=base)
    return ((got or {}).get("appAttempts") or {}).get("appAttempt") or []


def apps_named(name: str, base: str = RM_REST) -> list[dict[str, Any]]:
    """Applications (any state) whose name is ``name``, newest first."""
    got = rest("apps", base=base)
    found = [a for a in ((got or {}).get("apps") or {}).get("app") or [] if a.get("name") == name]
    return sorted(found, key=lambda a: a.get("startedTime", 0), reverse=True)


def submit_env(conf_dir: str | Path | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for ``spark-submit --master yarn`` on this machine: the ResourceManager's
    HADOOP_CONF_DIR, the wheel's SPARK_HOME, loopback binding, the venv's Python; plus ``extra``
    (what a client-mode driver needs, which runs in spark-submit's process)."""
    from tests.services.spark_cluster import spark_home

    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARK_", "PYSPARK_", "HADOOP_", "YARN_")) and k != "PYTHONPATH"}
    env.update(HADOOP_CONF_DIR=str(conf_dir or SERVICE.conf_dir), SPARK_HOME=str(spark_home()),
               SPARK_LOCAL_IP=HOST, PYSPARK_PYTHON=sys.executable)
    env.update(extra or {})
    return env


def spark_submit_command(script: str | Path, *args: str, deploy_mode: str = "cluster",
                         name: str = "twophase-yarn", python: str | None = None,
                         staging_dir: str | Path | None = None, max_app_attempts: int = 2,
                         executors: int = 2, conf: dict[str, str] | None = None,
                         py_files: Sequence[str] = (), env: dict[str, str] | None = None,
                         container_ip: str = HOST) -> list[str]:
    """``spark-submit --master yarn --deploy-mode cluster|client ...`` for a PySpark script.

    Loopback (this machine's YARN): the driver and executors run ``python`` (default: this
    interpreter, which has twophase), the AM and executors bind 127.0.0.1 (SPARK_LOCAL_IP in
    their environment; :func:`submit_env` sets it for spark-submit and a client-mode driver),
    the Spark jars are the wheel's (``spark.yarn.jars=local:``,
    nothing uploaded), staging is ``staging_dir`` (default the service's, on the local
    filesystem).  On a real cluster the hosts do not share this venv: ship one packed with
    venv-pack as ``--archives env.tar.gz#env`` with ``spark.pyspark.python=./env/bin/python``
    (``spark.yarn.appMasterEnv.PYSPARK_PYTHON`` too in cluster mode), as the ``[hdfs]`` AM-kill test
    of tests/test_yarn.py submits it (tests/packing.py packs the venv by docs/clusters.md), drop ``spark.yarn.jars`` (or point it at the jars on HDFS), and put staging
    on HDFS (the default: the submitting user's home there).

    ``staging_dir`` is a local path or a URL (``hdfs://namenode:port/dir``: the NodeManagers
    localize the job's files from HDFS, as on a real cluster).  ``env``: variables the driver
    and the executors need (a password a sink reads by ``{"env": ...}``, a crash plan), as
    ``spark.yarn.appMasterEnv.*`` (cluster mode: the driver is the AM; every attempt gets them)
    and ``spark.executorEnv.*``; a client-mode driver has spark-submit's environment instead
    (:func:`submit_env`'s ``extra``).  Spark redacts such values in its logs when the name says
    secret/password/token, but they are on spark-submit's command line.  ``container_ip``: the
    AM's and the executors' ``SPARK_LOCAL_IP``; ``{{NM_HOST}}`` (YARN writes ``$NM_HOST`` into
    each container's launch script: its NodeManager's host name) when the containers run on
    several hosts (tests/services/yarn_hosts.py).
    """
    from tests.services.spark_cluster import spark_home

    if deploy_mode not in ("cluster", "client"):
        raise ValueError(f"deploy_mode {deploy_mode!r}: cluster or client")
    home = spark_home()
    py = python or sys.executable
    staging = str(staging_dir or SERVICE.staging_url)
    confs: dict[str, str] = {
        "spark.yarn.jars": f"local:{home / 'jars'}/*",
        "spark.yarn.stagingDir": staging if "://" in staging else Path(staging).as_uri(),
        "spark.yarn.maxAppAttempts": str(max_app_attempts),
        "spark.yarn.submit.waitAppCompletion": "true",
        "spark.pyspark.python": py,
        "spark.yarn.appMasterEnv.PYSPARK_PYTHON": py,
        "spark.executorEnv.PYSPARK_PYTHON": py,
        # Not the NodeManagers' admin-env: YARN appends a variable set there to the application's
        # with ':' and the executors get the AM's (SPARK_LOCAL_IP=127.0.0.1:127.0.0.1: refused).
        # Nor their env-whitelist: the AM passes its own SPARK_* variables on to the executors.
        "spark.yarn.appMasterEnv.SPARK_LOCAL_IP": container_ip,
        "spark.executorEnv.SPARK_LOCAL_IP": container_ip,
        # In cluster mode the driver is the AM (driver memory); in client mode the AM only asks
        # for executors (spark.yarn.am.memory) and the driver binds here.
        "spark.driver.memory": "512m",
        "spark.yarn.am.memory": "512m",
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.executor.instances": str(executors),
        "spark.dynamicAllocation.enabled": "false",
        "spark.speculation": "false",
        "spark.task.maxFailures": "4",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.scheduler.minRegisteredResourcesRatio": "1.0",
        "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
    }
    if deploy_mode == "client":
        confs.update({"spark.driver.host": HOST, "spark.driver.bindAddress": HOST})
    for k, v in (env or {}).items():
        if deploy_mode == "cluster":
            confs[f"spark.yarn.appMasterEnv.{k}"] = v
        confs[f"spark.executorEnv.{k}"] = v
    confs.update(conf or {})
    cmd = [str(home / "bin" / "spark-submit"), "--master", "yarn", "--deploy-mode", deploy_mode,
           "--name", name]
    if py_files:
        cmd += ["--py-files", ",".join(py_files)]
    for k, v in confs.items():
        cmd += ["--conf", f"{k}={v}"]
    return [*cmd, str(script), *args]
