"""The test hosts (tests/services/hosts.py) and the servers on them: each host has its own address
and hostname, the faults really cut what they say (a request times out, no error comes back) and
heal, and PostgreSQL, MinIO and Kafka on their hosts answer at their hosts' addresses only."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.services import hosts

pytestmark = [pytest.mark.hosts, pytest.mark.timeout(300),
              pytest.mark.skipif(hosts.available() is not None, reason=f"test hosts: {hosts.available()}")]

PROBE = ("import socket, sys, time\n"
         "t0 = time.monotonic()\n"
         "try:\n"
         "    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()\n"
         "    print('connected')\n"
         "except OSError as e:\n"
         "    print(type(e).__name__, round(time.monotonic() - t0, 1))\n")


def probe(host: str, address: str, port: int, timeout: float = 2.0) -> str:
    r = hosts.run(host, [sys.executable, "-c", PROBE, address, str(port), str(timeout)],
                  capture_output=True, text=True, timeout=60)
    return r.stdout.strip()


@pytest.fixture(scope="module")
def servers():
    from tests.services import ensure

    info = ensure("hosts", "minio_host", "postgres_host", "kafka_host")
    yield info
    hosts.heal()


def test_each_host_has_its_own_hostname_address_and_folder(servers):
    for name, h in hosts.HOSTS.items():
        r = hosts.run(name, ["sh", "-c", "hostname; ip -4 -o addr show dev eth0"], capture_output=True, text=True)
        lines = r.stdout.split("\n")
        assert lines[0] == name, r.stdout + r.stderr
        assert f"{h.address}/{hosts.PREFIX}" in lines[1], r.stdout
    assert len({h.folder for h in hosts.HOSTS.values()}) == len(hosts.HOSTS)


def test_servers_answer_at_their_hosts_address_only(servers):
    pg, minio = servers["postgres_host"], servers["minio_host"]
    assert pg["host"] == hosts.host("pg").address and minio["endpoint_url"].startswith(
        f"http://{hosts.host('s3').address}:")
    assert probe("driver-a", pg["host"], pg["port"]) == "connected"
    # Not on the root namespace's loopback: the host's own server is apart from the loopback one.
    # The pg host also runs MariaDB (tests/services/mariadb_host.py), on that address only too.
    from tests.services.mariadb_host import SERVICE as mariadb_host

    r = hosts.run("pg", ["ss", "-ltnH"], capture_output=True, text=True)
    listening = sorted(line.split()[3] for line in r.stdout.splitlines() if line.strip())
    assert f"{pg['host']}:{pg['port']}" in listening, r.stdout
    assert set(listening) <= {f"{pg['host']}:{pg['port']}", f"{pg['host']}:{mariadb_host.port}"}, r.stdout


def test_kafka_on_its_host_advertises_that_hosts_address(servers):
    """A client on another host gets the broker's metadata with the kafka host's address (what
    it then connects to), and the broker listens there only."""
    from confluent_kafka.admin import AdminClient

    bootstrap = servers["kafka_host"]["bootstrap_servers"]
    address = hosts.host("kafka").address
    assert bootstrap == f"{address}:19092"
    md = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30)
    assert [f"{b.host}:{b.port}" for b in md.brokers.values()] == [bootstrap]
    assert probe("driver-a", address, 19092) == "connected"
    r = hosts.run("kafka", ["ss", "-ltnH"], capture_output=True, text=True)
    listening = sorted(line.split()[3] for line in r.stdout.splitlines() if line.strip())
    assert listening == [f"{address}:19092", f"{address}:19093"], r.stdout


@pytest.mark.alone("detaches test host driver-a from the bridge (hosts.isolate)")
def test_isolate_makes_requests_time_out_and_rejoin_heals(servers):
    pg = servers["postgres_host"]
    try:
        hosts.isolate("driver-a")
        out = probe("driver-a", pg["host"], pg["port"])
        assert out.startswith(("TimeoutError", "timeout")), out  # silence, not a refusal
        assert probe("driver-b", pg["host"], pg["port"]) == "connected"
    finally:
        hosts.rejoin("driver-a")
    assert probe("driver-a", pg["host"], pg["port"]) == "connected"


@pytest.mark.alone("cuts driver-a off the s3 host's MinIO (hosts.cut) and heals every test host")
def test_cut_on_the_servers_host_silences_one_client_only(servers):
    minio = servers["minio_host"]
    port = int(minio["endpoint_url"].rsplit(":", 1)[1])
    s3 = hosts.host("s3").address
    a = hosts.host("driver-a").address
    try:
        hosts.cut("s3", a)
        out = probe("driver-a", s3, port)
        assert out.startswith(("TimeoutError", "timeout")), out
        assert probe("driver-b", s3, port) == "connected"
        pg = servers["postgres_host"]
        assert probe("driver-a", pg["host"], pg["port"]) == "connected"  # the log store only
    finally:
        hosts.heal()
    t0 = time.monotonic()
    assert probe("driver-a", s3, port) == "connected" and time.monotonic() - t0 < 30


@pytest.mark.alone("cuts driver-a off the root namespace (hosts.cut) and heals every test host")
def test_cut_on_the_root_namespace_silences_one_host_from_what_listens_there(servers):
    """The nemesis's fault proxy listens on the bridge's root address: a cut there (hosts.ROOT)
    silences one host's requests to it, and heal() takes that route away too."""
    import socket

    listener = socket.create_server((hosts.ROOT_ADDRESS, 0))
    port = listener.getsockname()[1]
    with listener:
        try:
            hosts.cut(hosts.ROOT, hosts.host("driver-a").address)
            out = probe("driver-a", hosts.ROOT_ADDRESS, port)
            assert out.startswith(("TimeoutError", "timeout")), out
            assert probe("driver-b", hosts.ROOT_ADDRESS, port) == "connected"
        finally:
            hosts.heal()
        assert probe("driver-a", hosts.ROOT_ADDRESS, port) == "connected"
    with pytest.raises(hosts.ServiceError, match="not a test host"):
        hosts.cut(hosts.ROOT, "127.0.0.1")  # never a route away from anything but the test hosts


def test_start_is_idempotent_and_status_reports_the_hosts(servers):
    from tests.services import get

    svc = get("hosts")
    assert svc.ready()
    info = svc.start()
    assert set(info["hosts"]) == set(hosts.HOSTS)
    out = subprocess.run([sys.executable, "-m", "tests.services", "status", "hosts"], capture_output=True,
                         text=True, timeout=60)
    assert '"ready": true' in out.stdout, out.stdout + out.stderr
