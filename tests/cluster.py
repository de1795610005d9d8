"""Chaos helpers for the Spark standalone cluster (tests/services/spark_cluster.py).

Faults: list the executor JVMs of an application, SIGKILL one, SIGKILL a worker (with its
executors), restart it and wait for the workers.  Drivers: only one SparkContext can live in a
Python process and the test session already has a local one, so cluster jobs run in a driver
*subprocess* (:func:`start_driver`) that talks back in JSON lines (:func:`emit`).  Shipping:
:func:`build_zip` / :func:`build_wheel` package this checkout for ``addPyFile`` / ``pyFiles``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.services import ServiceError, pid_alive, wait_until
from tests.services.spark_cluster import (
    MASTER_URL,
    SERVICE,
    WORKERS,
    Daemon,
    alive_workers,
    descendants,
    master_status,
)

REPO = Path(__file__).resolve().parent.parent
EXECUTOR_CLASS = "org.apache.spark.executor.CoarseGrainedExecutorBackend"

#: Confs every cluster driver gets (a test's own ``conf`` wins).  One 1-core executor per worker;
#: jobs wait until both executors registered; a task lost with a killed executor is retried
#: (``spark.task.maxFailures`` counts executor loss); no speculative second attempts.
DEFAULT_CONF: dict[str, str] = {
    "spark.executor.memory": "512m",
    "spark.executor.cores": "1",
    "spark.cores.max": "2",
    "spark.task.maxFailures": "4",
    "spark.speculation": "false",
    "spark.scheduler.minRegisteredResourcesRatio": "1.0",
    "spark.scheduler.maxRegisteredResourcesWaitingTime": "60s",
}
#: Environment variables of the driver that its executors get too (``spark.executorEnv.*``):
#: executors are forked by the workers and inherit nothing from the driver.
#: (None today: the coordinator ships its crash plan with its tasks, twophase.crash.carried_env.)
EXECUTOR_ENV_PASSTHROUGH: tuple[str, ...] = ()
#: Extra confs for :func:`cluster_session`, set by :func:`start_driver` (JSON object).
CONF_ENV = "TWOPHASE_CLUSTER_CONF"


# --------------------------------------------------------------------------- executors

@dataclass(frozen=True)
class Executor:
    """One executor JVM of one application, found in ``/proc``."""

    pid: int
    app_id: str
    executor_id: str
    worker: str  #: name of the worker daemon that forked it ("worker-1", "worker-2")


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0")]


def _arg(args: list[str], name: str) -> str | None:
    try:
        return args[args.index(name) + 1]
    except (ValueError, IndexError):
        return None


def _worker_of(worker_url: str | None) -> str | None:
    # --worker-url spark://Worker@127.0.0.1:7179
    for d in WORKERS:
        if worker_url and worker_url.endswith(f":{d.port}"):
            return d.name
    return None


def executors(app_id: str | None = None) -> list[Executor]:
    """Live executor JVMs forked by this cluster's workers (of ``app_id`` if given), by id."""
    found: list[Executor] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        args = _cmdline(int(entry.name))
        if EXECUTOR_CLASS not in args:
            continue
        worker = _worker_of(_arg(args, "--worker-url"))
        app, eid = _arg(args, "--app-id"), _arg(args, "--executor-id")
        if worker is None or app is None or eid is None or not pid_alive(int(entry.name)):
            continue
        if app_id is None or app == app_id:
            found.append(Executor(int(entry.name), app, eid, worker))
    return sorted(found, key=lambda e: (e.app_id, e.executor_id.zfill(9)))


def wait_for_executors(app_id: str, n: int, timeout: float = 60.0) -> list[Executor]:
    """Wait until ``app_id`` has at least ``n`` live executor JVMs; return them."""
    wait_until(lambda: len(executors(app_id)) >= n, timeout, f"{n} executors of {app_id}",
               interval=0.1)
    return executors(app_id)


def _wait_gone(pid: int, what: str, timeout: float) -> None:
    wait_until(lambda: not pid_alive(pid), timeout, f"{what} (pid {pid}) to die", interval=0.05)


def kill_executor(executor: Executor, *, with_python: bool = True, timeout: float = 30.0) -> None:
    """SIGKILL one executor JVM and wait until it is gone.  ``with_python`` (default): its Python
    daemon and workers in the same instant, as when a container dies; otherwise the JVM alone
    (its Python workers then exit as soon as they notice the closed pipe)."""
    pids = [executor.pid, *(descendants(executor.pid) if with_python else [])]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        _wait_gone(pid, f"executor {executor.executor_id} of {executor.app_id} (or its Python)",
                   timeout)


def task_identity() -> dict[str, Any]:
    """Inside a task: the executor JVM running this Python worker (``executor_id``, ``app_id``,
    ``pid``, ``worker_port``), found by walking up the process tree.  Self-contained (stdlib
    only) because :func:`cluster_session` ships this module's functions to executors by value.
    """
    import os as _os

    pid = _os.getpid()
    for _ in range(8):
        with open(f"/proc/{pid}/stat") as f:
            pid = int(f.read().rsplit(")", 1)[1].split()[1])  # the parent's pid
        if pid <= 1:
            break
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode() for a in f.read().split(b"\0")]
        if "org.apache.spark.executor.CoarseGrainedExecutorBackend" in args:
            opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("--")}
            return {"executor_id": opt["--executor-id"], "app_id": opt["--app-id"], "pid": pid,
                    "worker_port": int(opt["--worker-url"].rsplit(":", 1)[1]),
                    "python_pid": _os.getpid()}
    return {"executor_id": "driver", "app_id": None, "pid": None, "worker_port": None,
            "python_pid": _os.getpid()}


# --------------------------------------------------------------------------- workers

def worker(which: int | str | Daemon) -> Daemon:
    """A worker daemon by index (0, 1), name ("worker-1") or itself."""
    if isinstance(which, Daemon):
        return which
    if isinstance(which, int):
        return WORKERS[which]
    for d in WORKERS:
        if d.name == which:
            return d
    raise ValueError(f"unknown worker {which!r}; known: {', '.join(d.name for d in WORKERS)}")


def worker_pid(which: int | str | Daemon) -> int | None:
    return SERVICE.daemon_pid(worker(which))


def kill_worker(which: int | str | Daemon, *, with_executors: bool = True,
                timeout: float = 30.0) -> int:
    """SIGKILL a worker JVM and wait until it is gone; return its pid.  ``with_executors``
    (default): with every process below it (executors and their Python) in the same instant, all
    gone on return: a lost machine.  Otherwise the worker JVM alone; its executors notice the lost
    connection and exit by themselves shortly after."""
    d = worker(which)
    scope = "tree" if with_executors else "process"
    pid = SERVICE.kill_daemon(d, signal.SIGKILL, timeout, scope=scope)
    if pid is None:
        raise ServiceError(f"{d.name} is not running; nothing to kill")
    return pid


def wait_for_workers(n: int = len(WORKERS), timeout: float = 60.0) -> list[dict[str, Any]]:
    """Wait until the master counts at least ``n`` ALIVE workers; return the master's records."""
    return SERVICE.wait_workers(n, timeout)


def restart_worker(which: int | str | Daemon, timeout: float = 60.0) -> dict[str, Any]:
    """Start a (killed) worker again; wait until the master counts it ALIVE; return its record."""
    d = worker(which)
    SERVICE.start_daemon(d, timeout)

    def registered() -> bool:
        SERVICE._check_exited()
        return any(w.get("port") == d.port for w in alive_workers())
    wait_until(registered, timeout, f"{d.name} to register with the master",
               SERVICE.daemon_log_path(d), interval=0.1)
    return next(w for w in alive_workers() if w.get("port") == d.port)


# --------------------------------------------------------------------------- faults while batches flow

def checkpoint_batches(checkpoint: str | os.PathLike[str]) -> int:
    """A progress counter for kill tests (``run_with_faults(progress_probe=...)``, :class:`Saboteur`):
    the batches a streaming query planned plus those it completed, from its Spark checkpoint's
    ``offsets/`` and ``commits/`` logs.  It moves while batches flow and not otherwise: a run that
    finds nothing left to do (or only starts its JVM, or takes a transaction log) leaves it as
    it was, so a SIGKILL that ended a run below the completing run's count landed mid-work."""
    root = Path(checkpoint)
    n = 0
    for sub in ("offsets", "commits"):
        try:
            n += sum(1 for f in (root / sub).iterdir() if f.name.isdigit())
        except OSError:
            pass
    return n


def _alive_or_raise(aimed: list[Executor], what: str) -> None:
    """Refuse to count a kill of executors that already died on their own (a zombie too)."""
    dead = [e.pid for e in aimed if not pid_alive(e.pid)]
    if dead:
        raise ServiceError(f"{what}: executor(s) {dead} died before the SIGKILL")


def app_ids(name: str) -> set[str]:
    """Ids of the running applications called ``name`` (``spark.app.name``), by the master."""
    st = master_status() or {}
    return {a["id"] for a in st.get("activeapps", []) if a.get("name") == name and "id" in a}


@dataclass(frozen=True)
class Strike:
    """One fault of a :class:`Saboteur` that really struck: every process it aimed at was alive
    when the signal went out and is gone now, among them an executor of the application under
    test, and ``progress`` is the counter's value at that instant."""

    fault: str  #: "executor" or "worker"
    victim: str  #: "executor 3 of app-..." / "worker-2 (restarted)"
    executors: tuple[int, ...]  #: pids of the application's executor JVMs it killed
    progress: int

    def __str__(self) -> str:
        return f"{self.victim} at progress {self.progress}"


class Saboteur:
    """A thread that injects cluster faults while a driver's batches flow.

    Each fault in ``faults`` waits until ``progress()`` (e.g. the number of transaction-log
    records) moved and the application called ``app`` (the driver's ``spark.app.name``; any
    application if None) has an executor, then a random 0.3-1.5 s so it lands mid-batch, then
    strikes that application:

    * ``"executor"``: SIGKILL one of its executor JVMs with its Python workers (a lost
      container); the worker forks a new executor for the application;
    * ``"worker"``: SIGKILL a worker that runs one of its executors, with every process below it
      (a lost host), and start it again ``down`` seconds later (the host comes back; the master
      gives the application a new executor there).

    A fault counts as struck (:attr:`struck`, a :class:`Strike`) only if the executor it aimed
    at was alive when the SIGKILL went out (not one that died on its own meanwhile, e.g. with
    its driver at a crash point) and is gone afterwards; anything else is recorded in ``done``
    as missed.  Between faults it waits ``gap`` seconds.  Use as a context manager; on exit
    every worker is back and registered.
    """

    def __init__(self, progress: Callable[[], int], faults: Sequence[str], *, seed: int,
                 gap: float = 15.0, down: float = 4.0, app: str | None = None):
        unknown = set(faults) - {"executor", "worker"}
        if unknown:
            raise ValueError(f"unknown fault(s) {sorted(unknown)}: use 'executor' or 'worker'")
        self.progress, self.faults, self.gap, self.down = progress, list(faults), gap, down
        self.app = app
        self.rng = random.Random(seed)
        self.done: list[str] = []
        self.strikes: list[Strike] = []
        self.stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="saboteur", daemon=True)

    def __enter__(self) -> Saboteur:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self._thread.join(60)
        for d in WORKERS:
            if worker_pid(d) is None:
                restart_worker(d)
        wait_for_workers()

    def targets(self) -> list[Executor]:
        """The live executors of the application under test."""
        if self.app is None:
            return executors()
        ids = app_ids(self.app)
        return [e for e in executors() if e.app_id in ids]

    def _run(self) -> None:
        for fault in self.faults:
            seen = self.progress()
            while not self.stop.is_set() and (self.progress() <= seen or not self.targets()):
                self.stop.wait(0.2)
            if self.stop.wait(self.rng.uniform(0.3, 1.5)):
                return
            try:
                self._strike(fault)
            except Exception as e:  # noqa: BLE001 - it died on its own meanwhile; try the next
                self.done.append(f"{fault}: missed ({type(e).__name__}: {e})")
            if self.stop.wait(self.gap):
                return

    def _strike(self, fault: str) -> None:
        aimed = self.targets()
        if not aimed:
            raise ServiceError(f"no executor of {self.app or 'any application'} left to strike")
        if fault == "executor":
            victim = self.rng.choice(aimed)
            hit = [victim]
            what = f"executor {victim.executor_id} of {victim.app_id}"
            progress = self.progress()
            _alive_or_raise(hit, what)
            kill_executor(victim)  # SIGKILL (JVM and Python workers), returns once all are gone
        else:
            d = worker(self.rng.choice(sorted({e.worker for e in aimed})))
            hit = [e for e in aimed if e.worker == d.name]
            what = f"{d.name} (restarted)"
            progress = self.progress()
            _alive_or_raise(hit, what)
            kill_worker(d)  # with every process below it, all gone on return
        survivors = [e.pid for e in hit if pid_alive(e.pid)]
        if survivors:
            raise ServiceError(f"{what}: executor(s) {survivors} survived")
        self.strikes.append(Strike(fault, what, tuple(e.pid for e in hit), progress))
        self.done.append(f"{what} at progress {progress}")
        if fault == "worker":
            self.stop.wait(self.down)
            restart_worker(d)

    @property
    def struck(self) -> list[Strike]:
        """The faults that really struck (not missed)."""
        return list(self.strikes)


def check_fault_runs(runs: list[Any], saboteur: Saboteur) -> None:
    """What every cluster kill test asserts of its runs (``twophase.chaos.Run``) and its saboteur:
    every fault landed where and when it was aimed (:func:`twophase.chaos.check_runs`: each
    ``crash:POINT:N`` run died there, ``after_pre_commit`` inside executors, whose crash log
    lists only that point at that batch, while the driver itself did not exit 137; no run failed
    for another reason; the last one completed), at least one of the saboteur's faults struck,
    and every one that struck killed an executor of the application while batches still flowed:
    the progress counter at the strike is below its final count (the completing run's)."""
    from twophase import chaos

    print(f"faults: {saboteur.done}; runs: {[r.to_dict() for r in runs]}")
    chaos.check_runs(runs)
    assert saboteur.struck, f"no executor or worker died while batches flowed: {saboteur.done}"
    final = runs[-1].progress if runs[-1].progress is not None else saboteur.progress()
    late = [s for s in saboteur.struck if s.progress >= final]
    assert not late, f"faults struck after the work was done (progress {final}): {late}; {saboteur.done}"


# --------------------------------------------------------------------------- drivers

def cluster_session(app_name: str, conf: dict[str, Any] | None = None):
    """In a driver process: a SparkSession on the cluster (``DEFAULT_CONF``, then the confs
    :func:`start_driver` passed in ``TWOPHASE_CLUSTER_CONF``, then ``conf``).

    Also makes this module's functions (e.g. :func:`task_identity`) usable in tasks: executors
    cannot import ``tests``, so cloudpickle ships them by value.
    """
    from pyspark import cloudpickle

    from twophase.spark import local_session

    merged: dict[str, Any] = dict(DEFAULT_CONF)
    python = os.environ.get("PYSPARK_PYTHON")
    if python:
        merged["spark.executorEnv.PYSPARK_PYTHON"] = python
    for name in EXECUTOR_ENV_PASSTHROUGH:
        if name in os.environ:
            merged[f"spark.executorEnv.{name}"] = os.environ[name]
    merged.update(json.loads(os.environ.get(CONF_ENV) or "{}"))
    merged.update(conf or {})
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return local_session(MASTER_URL, app_name=app_name, conf=merged)


def emit(event: str, **fields: Any) -> None:
    """In a driver process: tell the test something (one JSON line on stdout, with the time)."""
    print(json.dumps({"event": event, "time": time.time(), **fields}, default=str), flush=True)


def wait_for_go() -> str:
    """In a driver process: block until the test calls :meth:`Driver.send` (returns the line)."""
    return sys.stdin.readline().strip()


@dataclass
class Driver:
    """A driver subprocess started by :func:`start_driver`: its JSON events and its log."""

    proc: subprocess.Popen
    log_path: Path
    events: list[dict[str, Any]] = field(default_factory=list)
    _cond: threading.Condition = field(default_factory=threading.Condition)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self._cond:
                self.events.append(ev)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_event(self, name: str, timeout: float = 120.0) -> dict[str, Any]:
        """The first event called ``name``; raises if the driver exits or times out without it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for ev in self.events:
                    if ev.get("event") == name:
                        return ev
                if self.proc.poll() is not None and self._reader_done():
                    raise AssertionError(f"driver exited with {self.proc.returncode} before event "
                                         f"{name!r}; log {self.log_path}:\n{self.log_tail()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"no event {name!r} from the driver within "
                                         f"{timeout:.0f}s; log {self.log_path}:\n{self.log_tail()}")
                self._cond.wait(min(left, 0.5))

    def _reader_done(self) -> bool:
        return self.proc.stdout is None or self.proc.stdout.closed or not self._thread.is_alive()

    def send(self, line: str = "go") -> None:
        """Answer :func:`wait_for_go` in the driver."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait(self, timeout: float = 300.0) -> int:
        """Wait for the driver to exit; its exit code."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"driver still running after {timeout:.0f}s; "
                                 f"log {self.log_path}:\n{self.log_tail()}") from None

    def result(self, timeout: float = 300.0) -> dict[str, Any]:
        """The driver's ``result`` event after it exited 0 (else an error with its log)."""
        code = self.wait(timeout)
        self._thread.join(10)
        if code != 0:
            raise AssertionError(f"driver exited with {code}; log {self.log_path}:\n"
                                 f"{self.log_tail()}")
        return self.wait_event("result", timeout=1)

    def kill(self) -> None:
        """SIGKILL the driver's process group (its Python and its JVM); the master then ends the
        application and the workers kill its executors."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait()


def start_driver(module: str, *args: str, log_dir: Path, conf: dict[str, Any] | None = None,
                 executor_env: dict[str, str] | None = None, python: str | Path | None = None,
                 env: dict[str, str] | None = None) -> Driver:
    """Run ``python -m module args...`` from the repository as a driver on the cluster.

    The driver calls :func:`cluster_session`; ``conf`` reaches it through ``TWOPHASE_CLUSTER_CONF``,
    ``executor_env`` as ``spark.executorEnv.*``.  ``python`` is the interpreter of the executors'
    Python workers (default: this one): PySpark takes it from the driver's ``PYSPARK_PYTHON``
    (which :func:`twophase.spark.local_session` sets to the driver's own interpreter if unset).
    The driver runs in its own process group; stdout carries events, stderr goes to a log file.
    """
    conf = dict(conf or {})
    for k, v in (executor_env or {}).items():
        conf[f"spark.executorEnv.{k}"] = v
    full_env = dict(os.environ)
    full_env.pop("PYTHONPATH", None)
    full_env.update(env or {})
    full_env.update({
        CONF_ENV: json.dumps(conf),
        "PYSPARK_PYTHON": str(python or sys.executable),
        "PYSPARK_DRIVER_PYTHON": sys.executable,
        "SPARK_LOCAL_IP": "127.0.0.1",
    })
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = f"driver-{module.rsplit('.', 1)[-1]}-{time.strftime('%H%M%S')}-{os.getpid()}"
    log_path = log_dir / f"{stem}.log"
    with open(log_path, "ab") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=full_env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, start_new_session=True)
    drv = Driver(proc, log_path)
    drv._thread = threading.Thread(target=drv._read, name=f"driver-{proc.pid}", daemon=True)
    drv._thread.start()
    return drv


# --------------------------------------------------------------------------- shipping twophase

def _package_map() -> dict[str, Path]:
    """Import path of each package -> its source directory, from pyproject's setuptools tables
    (``sinks/`` and ``coordinator/`` install as ``twophase.sinks`` and ``twophase.coordinator``)."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = tool.get("package-dir", {})

    def source(pkg: str) -> Path:
        # setuptools' rule: the nearest enclosing package named in package-dir, then the rest of the
        # name as folders (twophase.sinks.kafka -> sinks/kafka).
        parts = pkg.split(".")
        for n in range(len(parts), 0, -1):
            head = ".".join(parts[:n])
            if head in dirs:
                return REPO / dirs[head] / "/".join(parts[n:])
        return REPO / dirs.get("", ".") / "/".join(parts)

    return {pkg: source(pkg) for pkg in tool["packages"]}


def _top_level_modules() -> list[Path]:
    """The top-level modules pyproject installs (``py-modules``, from ``package-dir[""]``): Spark's
    ``pyspark_twophase_*`` discovery modules."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    root = REPO / tool.get("package-dir", {}).get("", ".")
    return [root / f"{m}.py" for m in tool.get("py-modules", [])]


def build_zip(dest_dir: Path) -> Path:
    """``twophase.zip`` of this checkout laid out as installed (``twophase/sinks/...``), for
    ``SparkContext.addPyFile`` or ``spark.submit.pyFiles``.  Pure Python: zipimport loads it."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / "twophase.zip"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for pkg, src in sorted(_package_map().items()):
            base = pkg.replace(".", "/")
            for f in sorted(src.iterdir()):
                if f.is_file() and (f.suffix == ".py" or f.name == "py.typed"):
                    z.write(f, f"{base}/{f.name}")
        for f in _top_level_modules():
            z.write(f, f.name)
    return out


def wheel_build_lock():
    """Held while pip builds a wheel of this checkout: setuptools builds in the source tree
    (``build/``, ``*.egg-info``), so two builds at once (two test processes, pytest-xdist) would
    delete each other's files mid-build.  The services' cross-process lock, on a file named after
    the checkout."""
    import hashlib
    import tempfile

    from tests.services import locked

    tag = hashlib.sha256(str(REPO).encode()).hexdigest()[:12]
    return locked(Path(tempfile.gettempdir()) / f"twophase-wheel-build-{tag}.lock")


def build_wheel(dest_dir: Path) -> Path:
    """A (non-editable) wheel of this checkout, built by pip without dependencies; for a venv that
    is then packed for ``spark.archives`` or installed on the workers."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    with wheel_build_lock():
        r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--disable-pip-version-check", "-q", "-w", str(dest_dir), str(REPO)],
                           check=False, capture_output=True, text=True, timeout=600)
    wheels = sorted(dest_dir.glob("twophase-*.whl"))
    if r.returncode != 0 or not wheels:
        raise RuntimeError(f"pip wheel of {REPO} failed (exit {r.returncode}):\n"
                           f"{r.stdout}{r.stderr}")
    return wheels[-1]


def python_without_twophase(dest_dir: Path) -> Path:
    """A venv (no pip) whose interpreter sees this venv's third-party packages (pyarrow, pandas,
    confluent-kafka...) but not twophase: the shape of a worker image without the project.

    The editable install of twophase is a meta-path finder that this venv's
    ``__editable__*.pth`` installs at start-up; a plain path entry to the site-packages does not
    run those ``.pth`` files, so ``import twophase`` fails there.  Returns the interpreter.
    """
    py = dest_dir / "bin" / "python"
    if not py.exists():
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(dest_dir)], check=True,
                       capture_output=True, timeout=120)
        import sysconfig

        ours = sysconfig.get_paths()["purelib"]
        probe = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
        theirs = subprocess.run([str(py), "-c", probe],
                                check=True, capture_output=True, text=True).stdout.strip()
        Path(theirs, "_host_site_packages.pth").write_text(ours + "\n")
    return py
