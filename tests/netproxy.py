"""A TCP proxy for fault tests: forwards bytes unchanged, and can hold, drop or cut them.

It listens on ``127.0.0.1:0`` (or another local address: the test hosts' bridge) and forwards
every connection to one upstream ``host:port``.
Being a pure byte forwarder it changes nothing in what passes, so signed requests stay
valid (S3 SigV4 signs the ``Host`` header the client sent, which the server reads back
unchanged).  The faults it plays:

- :meth:`Proxy.hold`: the client->server bytes of a connection that match a pattern (a
  request line such as ``PUT /bucket/log/g0001/batch-000000000002.prepared.json``) are held,
  with everything that connection sends after them, until :meth:`Hold.release` delivers
  them (a request delayed on the wire) or :meth:`Hold.drop` cuts that connection without
  delivering them (a request lost with its connection).  The client sees a request that
  is slow to be answered, nothing else.
- :meth:`Proxy.refuse_new`: new connections are accepted and closed at once (a partition
  as the client sees it).
- :meth:`Proxy.cut_all`: every open connection is closed, both sides.

Threads (two per connection), no dependency.  Meant for tests, on loopback.
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass, field

_CHUNK = 65536


@dataclass
class Hold:
    """One armed hold: the bytes of the first connection whose client->server stream matches."""

    pattern: re.Pattern[bytes]
    #: Only a connection from this client address matches (None: any client).
    client: str | None = None
    matched: threading.Event = field(default_factory=threading.Event)
    #: What the match saw: the connection number and the held chunk's first line.
    connection: int | None = None
    first_line: bytes = b""
    _released: threading.Event = field(default_factory=threading.Event)
    _dropped: bool = False

    def wait(self, timeout: float | None = None) -> bool:
        """Block until a connection's bytes matched (and are held); False after ``timeout``."""
        return self.matched.wait(timeout)

    @property
    def released(self) -> bool:
        """Released or dropped already."""
        return self._released.is_set()

    def release(self) -> None:
        """Deliver the held bytes (and let the connection go on)."""
        self._released.set()

    def drop(self) -> None:
        """Cut the held connection without delivering what it held (before a match: disarm)."""
        self._dropped = True
        self._released.set()


class Proxy:
    """``Proxy(upstream_host, upstream_port).start()``; clients connect to :attr:`port`."""

    def __init__(self, upstream_host: str, upstream_port: int, *, listen_host: str = "127.0.0.1"):
        self.upstream = (upstream_host, int(upstream_port))
        self._listener = socket.create_server((listen_host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._holds: list[Hold] = []
        self._conns: dict[int, tuple[socket.socket, socket.socket]] = {}
        self._clients: dict[int, str] = {}  # each open connection's client address
        self._next = 0
        self._refuse = False
        self._closed = False
        self.connections = 0  # accepted so far

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def url(self, scheme: str = "http") -> str:
        return f"{scheme}://{self.address}"

    def start(self) -> Proxy:
        threading.Thread(target=self._accept, name=f"netproxy-{self.port}", daemon=True).start()
        return self

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- faults
    def hold(self, pattern: bytes | str, *, client: str | None = None) -> Hold:
        """Arm a hold: the next connection whose client->server bytes match ``pattern`` (a regular
        expression) stops forwarding at the chunk that matched until the hold is released or
        dropped.  One hold catches one connection; arm another for the next.  With ``client``
        (an IP address), only a connection from that address is caught: one of several clients
        of the proxy, each on its own test host."""
        if isinstance(pattern, str):
            pattern = pattern.encode()
        h = Hold(re.compile(pattern), client)
        with self._lock:
            self._holds.append(h)
        return h

    def refuse_new(self, refuse: bool = True) -> None:
        """Close new connections as soon as they are accepted (until ``refuse_new(False)``)."""
        self._refuse = refuse

    def cut_all(self) -> int:
        """Close every open connection, both sides; returns how many were cut."""
        with self._lock:
            conns = list(self._conns.values())
            self._conns.clear()
        for pair in conns:
            for s in pair:
                _close(s)
        return len(conns)

    def close(self) -> None:
        """Stop listening, cut every connection and drop every hold (no held byte is delivered)."""
        self._closed = True
        _close(self._listener)
        with self._lock:
            holds = list(self._holds)
        for h in holds:
            h.drop()
        self.cut_all()

    # ------------------------------------------------------------- forwarding
    def _accept(self) -> None:
        while not self._closed:
            try:
                client, peer = self._listener.accept()
            except OSError:
                return
            self.connections += 1
            if self._refuse:
                _close(client)
                continue
            try:
                server = socket.create_connection(self.upstream, timeout=10)
                server.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                n = self._next
                self._next += 1
                self._conns[n] = (client, server)
                self._clients[n] = peer[0]
            threading.Thread(target=self._pump, args=(n, client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(n, server, client, False), daemon=True).start()

    def _claim(self, n: int, tail: bytes, data: bytes) -> Hold | None:
        """The first armed hold whose pattern matches in ``data`` (a match may begin in ``tail``,
        the bytes already forwarded, but must end in ``data``)."""
        buf = tail + data
        with self._lock:
            for h in self._holds:
                if h.client is not None and self._clients.get(n) != h.client:
                    continue
                if h.connection is not None or h.released:
                    continue
                if any(m.end() > len(tail) for m in h.pattern.finditer(buf)):
                    h.connection = n
                    return h
        return None

    def _pump(self, n: int, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        tail = b""  # the end of the previous chunk: a pattern split across two reads still matches
        try:
            while True:
                data = src.recv(_CHUNK)
                if not data:
                    break
                if upstream and self._holds:
                    h = self._claim(n, tail, data)
                    if h is not None:
                        h.first_line = data.split(b"\r\n", 1)[0][:300]
                        h.matched.set()
                        h._released.wait()
                        if h._dropped:
                            break
                    tail = (tail + data)[-256:]
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                pair = self._conns.pop(n, None)
                self._clients.pop(n, None)
            for s in pair or (src, dst):
                _close(s)


def _close(s: socket.socket) -> None:
    try:
        s.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
