"""Real servers for tests, benchmarks and the demo, started on loopback by the project itself.

Each backend is one module (``kafka``, ``postgres``, ``hdfs``, ``s3`` (moto), ``minio``,
``spark_cluster`` (a Spark standalone master and two workers), ``yarn`` (a ResourceManager and two
NodeManagers; ``yarn_hosts`` the same across the test hosts; neither in ``start all``: see
``ON_DEMAND``)) defining a :class:`Service` subclass.  ``python -m tests.services
start|stop|status [NAME ...]`` drives them by hand; pytest session fixtures call :func:`ensure`.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

#: Where pids, logs and data of the services live (outside the repository).
STATE_DIR = Path(os.environ.get("TWOPHASE_SERVICES_DIR", Path.home() / ".cache" / "twophase" / "services"))
#: Where downloaded jars are cached (outside the repository; never committed).
JAR_CACHE = Path(os.environ.get("TWOPHASE_JAR_CACHE", Path.home() / ".cache" / "twophase" / "jars"))

NAMES = ("hosts", "kafka", "kafka_host", "postgres", "postgres_host", "mariadb", "mariadb_host", "hdfs", "hdfs_host", "s3", "minio", "minio_host",
         "spark_cluster", "spark_hosts", "spark_connect", "yarn", "yarn_hosts")
#: Started by name or by their pytest fixture only, not by ``start all`` (``stop all`` and
#: ``status all`` include them): YARN (three JVMs) is needed by tests/test_yarn.py alone, YARN
#: on the test hosts by tests/test_yarn_hosts.py alone.
ON_DEMAND = ("yarn", "yarn_hosts")


class ServiceError(RuntimeError):
    """A service could not be installed, started or reached; the message says where its log is."""


def port_open(port: int, host: str = "127.0.0.1", timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is not alive for our purposes.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def wait_until(pred, timeout: float, what: str, log: Path | None = None, interval: float = 0.25) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    tail = ""
    if log is not None and log.exists():
        last = "\n".join(log.read_text(errors="replace").splitlines()[-30:])
        tail = f"\n--- last lines of {log} ---\n{last}"
    raise ServiceError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock across processes (CLI, pytest sessions) on one service's start/stop."""
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


class Service:
    """One real server.  Subclasses set ``name`` and implement ``install``, ``launch``, ``ready``, ``info``.

    ``start`` is idempotent (a running, ready server is left alone); ``stop`` kills
    only the process group whose pid this module recorded.
    """

    name: str = ""
    start_timeout: float = 120.0
    _proc: subprocess.Popen | None = None

    @property
    def dir(self) -> Path:
        d = STATE_DIR / self.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    @property
    def log_path(self) -> Path:
        return self.dir / f"{self.name}.log"

    @property
    def pid_path(self) -> Path:
        return self.dir / f"{self.name}.pid"

    # -- to implement -------------------------------------------------------
    def install(self) -> None:
        """Download / install what the server needs (idempotent, cached)."""

    def launch(self, log) -> subprocess.Popen | None:
        """Start the server; return the Popen (its pid is recorded) or None if it manages its own pid."""
        raise NotImplementedError

    def ready(self) -> bool:
        """True when the server answers real requests."""
        raise NotImplementedError

    def after_ready(self) -> None:
        """Create databases, buckets, topics... (idempotent)."""

    def info(self) -> dict[str, Any]:
        """Connection facts for clients (ports, urls, dsn); never secrets beyond test credentials."""
        raise NotImplementedError

    def stop_extra(self) -> None:
        """Stop anything not covered by the recorded process group."""

    # -- shared -------------------------------------------------------------
    def pid(self) -> int | None:
        try:
            pid = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def running(self) -> bool:
        return (self.pid() is not None or self.pid_path.exists() is False) and self.ready()

    def start(self) -> dict[str, Any]:
        # Serialised across processes: exactly one server is launched, and a half-started one is
        # never killed by a concurrent stop.
        with locked(self.dir / ".start.lock"):
            if self._proc is not None and self._proc.poll() is not None:
                self._proc = None  # died earlier (crash): start afresh
            if self.ready():
                self.after_ready()
                return self.info()
            self.install()
            log = open(self.log_path, "ab")
            proc = self.launch(log)
            if proc is not None:
                self._proc = proc
                self.pid_path.write_text(str(proc.pid))
            wait_until(self._ready_or_exited, self.start_timeout, f"{self.name} to become ready", self.log_path)
            self.after_ready()
            return self.info()

    def _ready_or_exited(self) -> bool:
        """ready(), but raise at once (instead of waiting out start_timeout) if the server died."""
        proc = self._proc
        if proc is not None and proc.poll() is not None:
            self._proc = None
            tail = ""
            if self.log_path.exists():
                tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-30:])
            raise ServiceError(f"{self.name} exited with code {proc.returncode}; log: {self.log_path}\n{tail}")
        return self.ready()

    def stop(self) -> None:
        with locked(self.dir / ".start.lock"):
            self.terminate()
            self._proc = None

    def terminate(self) -> None:
        """Kill the recorded process group (SIGTERM, then SIGKILL) and whatever stop_extra finds."""
        pid = self.pid()
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 20
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if pid_alive(pid):
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.pid_path.unlink(missing_ok=True)
        self.stop_extra()

    def status(self) -> dict[str, Any]:
        up = self.ready()
        st: dict[str, Any] = {"name": self.name, "ready": up, "pid": self.pid(), "log": str(self.log_path)}
        if up:
            st.update(self.info())
        return st


def ensure_python_packages(service: str, needs: dict[str, str]) -> None:
    """Install into this interpreter's environment the Python packages a server needs that are
    missing (``needs``: import name -> pip requirement), as moto's server is installed: so that
    ``python -m tests.services start`` works in the venv ``bash scripts/demo.sh`` made (extras
    ``all``, without the test extras).  A failed install says what to run instead."""
    import importlib.util
    import sys

    missing = [req for mod, req in needs.items() if importlib.util.find_spec(mod) is None]
    if not missing:
        return
    cmd = [sys.executable, "-m", "pip", "install", "--disable-pip-version-check", *missing]
    print(f"{service} needs {', '.join(missing)}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
        raise ServiceError(f"{service} needs the Python packages {', '.join(missing)} and `{' '.join(cmd)}` "
                           f"failed (exit {r.returncode}); install them into {sys.prefix}, or run "
                           f"`bash scripts/setup.sh` (the test extras):\n{tail}")
    importlib.invalidate_caches()


def popen(cmd: list[str], log, env: dict[str, str] | None = None, cwd: str | Path | None = None) -> subprocess.Popen:
    """Start a server in its own process group (so ``stop`` can kill it and its children)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    return subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=full_env, cwd=cwd, start_new_session=True,
    )


def get(name: str) -> Service:
    if name not in NAMES:
        raise ServiceError(f"unknown service {name!r}; known: {', '.join(NAMES)}")
    mod = importlib.import_module(f"tests.services.{name}")
    return mod.SERVICE


def ensure(*names: str) -> dict[str, dict[str, Any]]:
    """Start the named services if they are not running; return their connection info."""
    return {n: get(n).start() for n in names}


def stop(*names: str) -> None:
    for n in names:
        get(n).stop()


def status(*names: str) -> list[dict[str, Any]]:
    return [get(n).status() for n in names]


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=2, default=str)
