"""Session-wide fixtures: one Spark session and one set of real servers per test session.

Servers are started on demand by the fixtures (so ``pytest`` alone brings up what the
selected tests need) and stopped at the end of the session if this session started
them, unless ``TWOPHASE_KEEP_SERVICES=1``.

On several workers (pytest-xdist, ``-n 2``: scripts/test.sh) each worker has its own Spark
session and all share the servers: every test holds a lock shared, and a test marked
``alone`` (it kills or reconfigures something the others use, or reads a server's whole
state) holds it exclusive, so it runs while no other test does (:func:`_turn`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests import services


def pytest_sessionstart(session):
    # The drivers the tests start (every kill test's, and the session's own Spark) start in
    # about half the time: tests/fastjvm.py (TWOPHASE_FAST_JVM=0 turns it off).  Under xdist
    # this runs in the controller before it starts the workers, which inherit the options.
    from tests import fastjvm

    fastjvm.apply()
    if not hasattr(session.config, "workerinput"):  # the controller (or the one process)
        os.environ["TWOPHASE_TEST_RUN"] = os.urandom(8).hex()  # the workers inherit it
        _START.append(time.monotonic())


def _run_file(suffix: str) -> Path:
    """A file of this test run's, the same for all its workers."""
    return Path(tempfile.gettempdir()) / f"twophase-test-run-{os.environ['TWOPHASE_TEST_RUN']}{suffix}"


def _several_workers(config) -> bool:
    return int(getattr(config, "workerinput", {}).get("workercount", 1)) > 1


def _service(name: str) -> dict:
    svc = services.get(name)
    was_up = svc.ready()
    try:
        info = svc.start()  # locked across processes (two workers start a server once)
    except services.ServiceError as e:  # a missing server is a failure, never a silent skip
        pytest.fail(f"could not start {name}: {e}", pytrace=False)
    if not was_up:
        with open(_run_file(".started"), "a") as f:  # the controller stops it at the end
            f.write(name + "\n")
    return info


#: Rough minutes of a test by its markers, to hand the workers the longest files first (the
#: tail of a run is then short files); a guess that only orders files, never skips a test.
_WEIGHT = {"mutation": 60, "nemesis": 60, "chaos": 40, "packaging": 30, "cluster": 20,
           "connect": 20, "hosts": 10, "spark": 3}


def pytest_collection_modifyitems(config, items):
    for item in items:
        for mark in item.iter_markers("alone"):
            if not (mark.args and isinstance(mark.args[0], str) and mark.args[0].strip()):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.alone needs its reason, "
                                        "e.g. alone(\"SIGKILLs a Spark cluster worker\")")
        for mark in item.iter_markers("one_at_a_time"):
            if not mark.args or not all(isinstance(a, str) and a.isidentifier() for a in mark.args):
                raise pytest.UsageError(f"{item.nodeid}: @pytest.mark.one_at_a_time names what it "
                                        "holds, e.g. one_at_a_time(\"connect_port_15002\")")
    if _several_workers(config):  # xdist --dist loadfile hands out files in this order
        weight: dict[str, float] = {}
        for item in items:
            w = max((_WEIGHT.get(m.name, 0) for m in item.iter_markers()), default=0) or 0.5
            weight[item.location[0]] = weight.get(item.location[0], 0) + w
        items.sort(key=lambda item: -weight[item.location[0]])  # stable: a file keeps its order


#: Shared things that take one test at a time, by the fixtures that reach them: the Spark
#: standalone cluster has two 1-core workers and a driver of the tests asks for both, so a second
#: application waits for the first one's cores (and a test's executor wait may run out); YARN's
#: NodeManagers the same.  A test holding one runs beside tests that do not need it.
_ONE_AT_A_TIME = {"spark_cluster": ("spark_cluster_service",), "yarn": ("yarn_service",)}


def _one_at_a_time(item) -> list[str]:
    """The things ``item`` holds alone, sorted (every test takes them in one order): those of
    :data:`_ONE_AT_A_TIME` its fixtures reach, and those its ``one_at_a_time`` markers name."""
    names = {n for n, fixtures in _ONE_AT_A_TIME.items() if any(f in item.fixturenames for f in fixtures)}
    names.update(a for m in item.iter_markers("one_at_a_time") for a in m.args)
    return sorted(names)


def _skipped_by_mark(item) -> bool:
    try:
        from _pytest.skipping import evaluate_skip_marks

        return evaluate_skip_marks(item) is not None
    except Exception:  # pytest's internals moved, or a condition failed: the test will say so
        return False


@contextlib.contextmanager
def _turn(item):
    """The worker's turn to run ``item``: the lock shared, or exclusive for an ``alone`` test.

    A writer-first lock from two files: a test first takes the turnstile, then the lock shared
    (released the turnstile at once) or exclusive (the turnstile kept until it ends), so an
    ``alone`` test waits for the tests running now and no new one starts before it.  A test that
    reaches a thing of :data:`_ONE_AT_A_TIME` holds that thing's lock too (taken first: a test
    waiting for it holds nothing else)."""
    if not _several_workers(item.config) or _skipped_by_mark(item):
        yield
        return
    alone = item.get_closest_marker("alone") is not None
    t0 = time.monotonic()
    with contextlib.ExitStack() as held:
        for name in _one_at_a_time(item):
            one = held.enter_context(open(_run_file(f".one.{name}"), "a+"))
            fcntl.flock(one, fcntl.LOCK_EX)
        turnstile = held.enter_context(open(_run_file(".turnstile"), "a+"))
        lock = held.enter_context(open(_run_file(".lock"), "a+"))
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        fcntl.flock(lock, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        waited = time.monotonic() - t0
        if waited >= 1:  # what the run's summary adds up (pytest_terminal_summary)
            with open(_run_file(".waits"), "a") as f:
                f.write(f"{waited:.1f} {os.environ.get('PYTEST_XDIST_WORKER', '-')} {int(alone)} {item.nodeid}\n")
        yield  # closing the files at the end releases every lock still held


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item):
        yield


@pytest.fixture(scope="session")
def kafka_service() -> dict:
    return _service("kafka")


@pytest.fixture(scope="session")
def postgres_service() -> dict:
    return _service("postgres")


@pytest.fixture
def db(postgres_service):
    """An autocommit psycopg2 connection to the test database (PostgreSQL tests)."""
    import psycopg2

    c = psycopg2.connect(postgres_service["dsn"])
    c.autocommit = True
    yield c
    c.close()


@pytest.fixture(scope="session")
def mariadb_service() -> dict:
    """MariaDB from Debian's package (tests/services/mariadb.py): host, port, database, user, password."""
    return _service("mariadb")


@pytest.fixture
def mdb(mariadb_service):
    """An autocommit PyMySQL connection to the test database as the ``twophase`` user (MySQL tests)."""
    import pymysql

    s = mariadb_service
    c = pymysql.connect(host=s["host"], port=s["port"], user=s["user"], password=s["password"],
                        database=s["database"], autocommit=True)
    yield c
    c.close()


@pytest.fixture(scope="session")
def hdfs_service() -> dict:
    return _service("hdfs")


@pytest.fixture(scope="session", params=["s3", "minio"], ids=["moto", "minio"])
def s3_service(request) -> dict:
    """Every S3 test runs against two real endpoints: moto's server and MinIO (tests/services)."""
    return _service(request.param)


@pytest.fixture(scope="session")
def spark_cluster_service() -> dict:
    """The Spark standalone cluster (tests/services/spark_cluster.py): master + two workers."""
    return _service("spark_cluster")


@pytest.fixture(scope="session")
def spark_connect_service() -> dict:
    """A Spark Connect server of its own (tests/services/spark_connect.py), local[2], port 7190."""
    return _service("spark_connect")


@pytest.fixture(scope="session")
def yarn_service() -> dict:
    """YARN (tests/services/yarn.py): a ResourceManager and two NodeManagers on 127.0.0.1, started
    here on demand (``start all`` leaves it out)."""
    return _service("yarn")


@pytest.fixture
def cluster_driver(spark_cluster_service, tmp_path):
    """Start driver subprocesses on the cluster: ``cluster_driver(module, *args, **kw)`` is
    :func:`tests.cluster.start_driver` with logs in the test's tmp_path.  At teardown every driver
    still running is killed and a worker a test killed is started again, so the next test finds
    the whole cluster."""
    from tests import cluster

    drivers: list = []

    def start(module: str, *args: str, **kw):
        kw.setdefault("log_dir", tmp_path)
        drv = cluster.start_driver(module, *args, **kw)
        drivers.append(drv)
        return drv

    yield start
    for drv in drivers:
        drv.kill()
    try:
        services.get("spark_cluster").start()
    except services.ServiceError as e:
        pytest.fail(f"could not bring the Spark cluster back to two workers: {e}", pytrace=False)


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark session for the whole test session."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from tests import fastjvm
    from twophase.spark import local_session

    with fastjvm.long_lived():
        session = local_session("local[2]", app_name="twophase-tests")
    yield session
    session.stop()


#: The controller's account of where a run's minutes went: seconds of test per worker and per
#: file (setup, call and teardown), and what each test waited for its turn (pytest_terminal_summary).
_BUSY: dict[str, float] = {}
_FILES: dict[str, float] = {}
_WAITS: list[tuple[float, str, bool, str]] = []
_START: list[float] = []


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # xdist: the worker that ran it (on the controller)
    worker = getattr(getattr(node, "gateway", None), "id", None)
    if worker is None:
        return
    _BUSY[worker] = _BUSY.get(worker, 0.0) + report.duration
    path = report.nodeid.split("::", 1)[0]
    _FILES[path] = _FILES.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _BUSY:
        return
    tr = terminalreporter
    tr.section("where the minutes went (two workers: tests/conftest.py)")
    tr.write_line(f"run {(time.monotonic() - _START[0]) / 60:.1f} min; in tests per worker: "
                  + ", ".join(f"{w} {s / 60:.1f} min" for w, s in sorted(_BUSY.items())))
    for worker in sorted({w for _, w, _, _ in _WAITS}):
        mine = [x for x in _WAITS if x[1] == worker]
        tr.write_line(f"{worker} waited for its turn {sum(x[0] for x in mine) / 60:.1f} min over {len(mine)} tests "
                      f"({sum(x[0] for x in mine if x[2]) / 60:.1f} min of it before alone tests)")
    for waited, worker, alone, nodeid in sorted(_WAITS, reverse=True)[:8]:
        tr.write_line(f"  {waited:6.1f}s {worker} {'alone ' if alone else ''}{nodeid}")
    tr.write_line("longest files: " + ", ".join(f"{p.removeprefix('tests/')} {s:.0f}s"
                                                for p, s in sorted(_FILES.items(), key=lambda x: -x[1])[:15]))


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput"):
        return  # a worker: the controller stops what the workers started, once all have ended
    with contextlib.suppress(OSError, ValueError):
        for line in _run_file(".waits").read_text().splitlines():
            waited, worker, alone, nodeid = line.split(" ", 3)
            _WAITS.append((float(waited), worker, alone == "1", nodeid))
    started = _run_file(".started")
    names = list(dict.fromkeys(started.read_text().split())) if started.exists() else []
    for path in _run_file("").parent.glob(_run_file("").name + ".*"):
        with contextlib.suppress(OSError):
            path.unlink()
    if os.environ.get("TWOPHASE_KEEP_SERVICES") == "1":
        return
    for name in reversed(names):
        try:
            services.get(name).stop()
        except Exception as e:  # pragma: no cover - best effort teardown
            print(f"warning: stopping {name} failed: {e}", file=sys.stderr)
