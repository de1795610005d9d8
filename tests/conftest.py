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


@pytest.fixture(scope="session")
def hdfs_service() -> dict:
    return _service("hdfs")


@pytest.fixture(scope="session", params=["s3", "minio"], ids=["moto", "minio"])
def s3_service(request) -> dict:
    """Every S3 test runs against two real endpoints: moto's server and MinIO (tests/services)."""
    return _service(request.param)


@pytest.fixture(scope="session")
def spark():
    """One local[2] Spark session for the whole test session."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from twophase.spark import local_session

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
