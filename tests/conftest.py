"""Session-wide fixtures: one Spark session and one set of real servers per test session.

Servers are started on demand by the fixtures (so ``pytest`` alone brings up what the
selected tests need) and stopped at the end of the session if this session started
them, unless ``TWOPHASE_KEEP_SERVICES=1``.
"""

from __future__ import annotations

import os
import sys

import pytest

from tests import services

_started: list[str] = []


def pytest_sessionstart(session):
    # The drivers the tests start (every kill test's, and the session's own Spark) start in
    # about half the time: tests/fastjvm.py (TWOPHASE_FAST_JVM=0 turns it off).
    from tests import fastjvm

    fastjvm.apply()


def _service(name: str) -> dict:
    svc = services.get(name)
    was_up = svc.ready()
    try:
        info = svc.start()
    except services.ServiceError as e:  # a missing server is a failure, never a silent skip
        pytest.fail(f"could not start {name}: {e}", pytrace=False)
    if not was_up:
        _started.append(name)
    return info


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


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("TWOPHASE_KEEP_SERVICES") == "1":
        return
    for name in reversed(_started):
        try:
            services.get(name).stop()
        except Exception as e:  # pragma: no cover - best effort teardown
            print(f"warning: stopping {name} failed: {e}", file=sys.stderr)
