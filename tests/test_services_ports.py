"""The test services listen below Linux's ephemeral port range (issue 19).

A client retrying a port inside the range while its server is down can connect to
itself (source port = destination port) and then hold the port, so the server cannot
bind again; seen with Kafka right after CI stopped the services.  Below the range no
outgoing connection, readiness probes included, can take a service's port.
"""

from __future__ import annotations

import importlib
from pathlib import Path

SERVICES = {
    "kafka": ("PORT", "CONTROLLER_PORT", "SASL_PORT", "SSL_PORT"),
    "postgres": ("PORT",),
    "hdfs": ("NN_PORT", "NN_HTTP_PORT"),
    "s3": ("PORT",),
    "minio": ("PORT", "CONSOLE_PORT"),
    "spark_cluster": ("MASTER_PORT", "MASTER_UI_PORT"),
    "spark_connect": ("PORT", "KILL_TEST_PORT"),
    "yarn": ("RM_PORT", "RM_SCHEDULER_PORT", "RM_TRACKER_PORT", "RM_ADMIN_PORT", "RM_WEB_PORT"),
}


def _ephemeral_low() -> int:
    p = Path("/proc/sys/net/ipv4/ip_local_port_range")
    return int(p.read_text().split()[0]) if p.exists() else 32768


def test_service_ports_are_below_the_ephemeral_range_and_distinct():
    low = _ephemeral_low()
    ports = []
    for name, attrs in SERVICES.items():
        mod = importlib.import_module(f"tests.services.{name}")
        for a in attrs:
            port = getattr(mod, a)
            assert 1024 < port < low, f"{name}.{a} = {port} is inside the ephemeral range (from {low})"
            ports.append(port)
    from tests.services.spark_cluster import WORKERS

    for w in WORKERS:
        ports += [w.port, w.ui_port]
        assert w.port < low and w.ui_port < low, w
    from tests.services.yarn import NODEMANAGERS

    for d in NODEMANAGERS:
        ports += d.ports
        assert all(1024 < p < low for p in d.ports), d
    assert len(ports) == len(set(ports)), sorted(ports)
