"""Test hosts on one machine: Linux network namespaces on one bridge, each with its own address,
its own hostname (a UTS namespace for every process started on it) and its own local folder.

``python -m tests.services start hosts`` creates them (idempotent; root only), ``stop hosts``
removes them.  The root namespace is on the bridge too, at ``ROOT_ADDRESS``: the test runner and
the servers that are not moved onto a host of their own answer there.  Nothing routes beyond
the bridge's subnet: a host has no default route, so its traffic reaches only other test hosts.

Faults, each undone by its twin (tests/nemesis.py drives them while batches flow):

- :func:`isolate` / :func:`rejoin`: detach a host's veth from the bridge: every packet it sends
  or should receive is dropped silently, so requests time out (no error comes back);
- :func:`cut` / :func:`uncut`: a blackhole route on one host (or the root namespace,
  :data:`ROOT`) towards one address: that host
  loses that peer only (its own sends fail at once; the peer's replies to it are dropped, so
  the peer's side sees silence).  Cut on the *server's* host, towards a client's address, a
  client sees its requests time out while every other peer still works.

Checked on this kind of machine (no ``tc netem``, no iptables): namespaces, a bridge and veth
pairs work; a detached veth makes a request time out and reattaching heals it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.services import STATE_DIR, Service, ServiceError

BRIDGE = "tpbr0"
SUBNET = "10.231.0"
PREFIX = 24
ROOT_ADDRESS = f"{SUBNET}.1"


@dataclass(frozen=True)
class Host:
    name: str
    address: str

    @property
    def netns(self) -> str:
        return f"tp-{self.name}"

    @property
    def veth(self) -> str:
        """The root side of the host's veth pair (on the bridge)."""
        return f"tpv-{self.name}"

    @property
    def peer(self) -> str:
        """The host's side of its veth pair (renamed eth0 inside the namespace)."""
        return f"tpp-{self.name}"

    @property
    def folder(self) -> Path:
        """The host's local disk: no other host's process is given this path."""
        d = STATE_DIR / "hosts" / self.name
        d.mkdir(parents=True, exist_ok=True)
        return d


#: The hosts of the test cluster: two drivers (a paused owner and its successor), two Spark
#: workers, and hosts for servers that run on a host of their own.
HOSTS: dict[str, Host] = {h.name: h for h in (
    Host("driver-a", f"{SUBNET}.10"),
    Host("driver-b", f"{SUBNET}.11"),
    Host("worker-1", f"{SUBNET}.21"),
    Host("worker-2", f"{SUBNET}.22"),
    Host("s3", f"{SUBNET}.30"),
    Host("pg", f"{SUBNET}.31"),
    Host("kafka", f"{SUBNET}.32"),
    Host("hdfs", f"{SUBNET}.33"),
)}


def host(name: str) -> Host:
    try:
        return HOSTS[name]
    except KeyError:
        raise ServiceError(f"unknown test host {name!r}; known: {', '.join(HOSTS)}") from None


def _ip(*args: str, netns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *args] if netns is None else ["ip", "netns", "exec", netns, "ip", *args]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise ServiceError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


def _exists(kind: str, name: str) -> bool:
    if kind == "netns":
        return name in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    return subprocess.run(["ip", "link", "show", name], capture_output=True).returncode == 0


def available() -> str | None:
    """None if test hosts can be made here, else why not (one line)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is missing"
    if shutil.which("unshare") is None:
        return "the `unshare` command (util-linux) is missing"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def command(name: str, argv: list[str]) -> list[str]:
    """``argv`` as run on host ``name``: in its network namespace, in a UTS namespace of its own
    whose hostname is the host's name."""
    h = host(name)
    return ["ip", "netns", "exec", h.netns, "unshare", "--uts", "sh", "-c",
            'hostname "$0" && exec "$@"', h.name, *argv]


def run(name: str, argv: list[str], **kw: Any) -> subprocess.CompletedProcess:
    """Run ``argv`` on host ``name`` and wait (``subprocess.run`` keywords pass through)."""
    return subprocess.run(command(name, argv), **kw)


def popen(name: str, argv: list[str], **kw: Any) -> subprocess.Popen:
    """Start ``argv`` on host ``name`` (``subprocess.Popen`` keywords pass through)."""
    return subprocess.Popen(command(name, argv), **kw)


def pids(name: str) -> list[int]:
    """The processes running on host ``name`` (in its network namespace)."""
    out = subprocess.run(["ip", "netns", "pids", host(name).netns], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


# ------------------------------------------------------------------------------------ faults
def isolate(name: str) -> None:
    """Cut host ``name`` off from every other host: its veth leaves the bridge (silent drops)."""
    _ip("link", "set", host(name).veth, "nomaster")


def rejoin(name: str) -> None:
    """Undo :func:`isolate`."""
    _ip("link", "set", host(name).veth, "master", BRIDGE)


#: The root namespace as a host name for :func:`cut`: the test runner, and what it serves on the
#: bridge at ``ROOT_ADDRESS`` (a fault proxy in front of a server on a host).
ROOT = "root"


def _netns(name: str) -> str | None:
    return None if name == ROOT else host(name).netns


def cut(name: str, address: str) -> None:
    """Host ``name`` (or :data:`ROOT`) loses ``address`` only (a blackhole route there; idempotent)."""
    if not address.startswith(SUBNET + "."):
        raise ServiceError(f"cut: {address} is not a test host's address ({SUBNET}.0/{PREFIX})")
    _ip("route", "replace", "blackhole", f"{address}/32", netns=_netns(name))


def uncut(name: str, address: str) -> None:
    """Undo :func:`cut` (idempotent)."""
    _ip("route", "del", "blackhole", f"{address}/32", netns=_netns(name), check=False)


def heal() -> None:
    """Undo every fault: every host on the bridge, no blackhole route to a test host anywhere."""
    names = [ROOT]
    for h in HOSTS.values():
        if _exists("link", h.veth):
            rejoin(h.name)
            names.append(h.name)
    for name in names:
        routes = _ip("route", "show", "type", "blackhole", netns=_netns(name), check=False).stdout.split("\n")
        for line in routes:
            parts = line.split()
            if len(parts) >= 2 and parts[0] == "blackhole" and parts[1].startswith(SUBNET + "."):
                uncut(name, parts[1].split("/")[0])


# ------------------------------------------------------------------------------------ servers on hosts
class OnHost:
    """A mixin for a :class:`~tests.services.Service` run on a test host: its state in the host's
    folder, the hosts made before it installs, its command run on the host (``on_host``)."""

    on_host: Host
    name: str

    @property
    def dir(self) -> Path:
        d = self.on_host.folder / self.name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def install(self) -> None:
        SERVICE.start()  # the host must exist first (idempotent)
        super().install()  # type: ignore[misc]

    def command(self, argv: list[str]) -> list[str]:
        return command(self.on_host.name, argv)


# ------------------------------------------------------------------------------------ the service
class HostsService(Service):
    """The namespaces and the bridge: no process of their own (``launch`` returns None)."""

    name = "hosts"
    start_timeout = 30.0

    def install(self) -> None:
        why = available()
        if why:
            raise ServiceError(f"test hosts cannot be made here: {why}")

    def launch(self, log) -> None:
        if not _exists("link", BRIDGE):
            _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "replace", f"{ROOT_ADDRESS}/{PREFIX}", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        for h in HOSTS.values():
            if not _exists("netns", h.netns):
                _ip("netns", "add", h.netns)
            if not _exists("link", h.veth):
                _ip("link", "add", h.veth, "type", "veth", "peer", "name", h.peer)
                _ip("link", "set", h.peer, "netns", h.netns)
                _ip("link", "set", h.peer, "name", "eth0", netns=h.netns)
            _ip("link", "set", h.veth, "master", BRIDGE, "up")
            _ip("addr", "replace", f"{h.address}/{PREFIX}", "dev", "eth0", netns=h.netns)
            _ip("link", "set", "eth0", "up", netns=h.netns)
            _ip("link", "set", "lo", "up", netns=h.netns)
            h.folder  # noqa: B018 - made on first use
        log.write(f"hosts up: {', '.join(f'{h.name}={h.address}' for h in HOSTS.values())}\n".encode())
        return None

    def ready(self) -> bool:
        if available() is not None or not _exists("link", BRIDGE):
            return False
        return all(_exists("netns", h.netns) and _exists("link", h.veth) for h in HOSTS.values())

    def info(self) -> dict[str, Any]:
        return {"bridge": BRIDGE, "root_address": ROOT_ADDRESS,
                "hosts": {h.name: {"address": h.address, "folder": str(h.folder)} for h in HOSTS.values()}}

    def stop_extra(self) -> None:
        if available() is not None:
            return
        for h in HOSTS.values():
            if _exists("netns", h.netns):
                # Whatever still runs on the host goes with it (a test that did not stop its process).
                for pid in pids(h.name):
                    try:
                        os.kill(pid, 9)
                    except ProcessLookupError:
                        pass
                _ip("netns", "del", h.netns, check=False)
            if _exists("link", h.veth):
                _ip("link", "del", h.veth, check=False)
        if _exists("link", BRIDGE):
            _ip("link", "del", BRIDGE, check=False)


SERVICE = HostsService()
