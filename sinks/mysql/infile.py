"""Both sides: the PyMySQL connection class of every connection the sink makes
(:func:`_load_connection_class`).  Only an executor task's connection of insert mode offers the
server LOAD DATA LOCAL, and it sends only the in-memory batch armed for the running statement."""

from __future__ import annotations

from typing import Any

from twophase.sinks.mysql.common import _my

#: LOAD DATA's data packets (below any server's max_allowed_packet).
_LOAD_CHUNK = 256 * 1024


_LOAD_CLASS: Any = None


def _load_connection_class() -> Any:
    """PyMySQL's Connection whose LOAD DATA LOCAL handler sends only the in-memory buffer armed for the
    running statement (``conn._twophase_infile = (name, buffer)``), and only to a request for exactly
    that name.  PyMySQL's own handler opens whatever file name the server asks for: a server (or
    anyone in between) could read any file the executor can.  A request for any other name, or while
    nothing is armed, is answered with no data (the server loads nothing) and fails the statement."""
    global _LOAD_CLASS
    if _LOAD_CLASS is not None:
        return _LOAD_CLASS
    my = _my()
    from pymysql import connections as pmc

    class _Result(pmc.MySQLResult):  # type: ignore[misc]
        def _read_load_local_packet(self, first_packet: Any) -> None:
            conn = self.connection
            asked = pmc.LoadLocalPacketWrapper(first_packet).filename
            armed = conn._twophase_infile
            ok = conn._local_infile and armed is not None and asked == armed[0]
            try:
                if ok:
                    data = memoryview(armed[1])
                    for i in range(0, len(data), _LOAD_CHUNK):
                        conn.write_packet(data[i:i + _LOAD_CHUNK])
            finally:
                conn.write_packet(b"")  # end of data (nothing at all for a refused request)
                reply = conn._read_packet()  # raises the server's error
            if not ok:
                raise my.err.OperationalError(
                    f"refused the server's LOAD DATA LOCAL request for {asked[:100]!r}: only the sink's own "
                    "in-memory batch is sent, to a request for its name")
            if not reply.is_ok_packet():
                raise my.err.OperationalError(2014, "Commands out of sync after LOAD DATA LOCAL")
            self._read_ok_packet(reply)

    class _Connection(pmc.Connection):  # type: ignore[misc]
        _twophase_infile: tuple[bytes, Any] | None = None
        _result_class = _Result

        def _read_query_result(self, unbuffered: bool = False) -> Any:
            self._result = None
            result = self._result_class(self)
            if unbuffered:
                result.init_unbuffered_query()
            else:
                result.read()
            self._result = result
            if result.server_status is not None:
                self.server_status = result.server_status
            return result.affected_rows

    _LOAD_CLASS = _Connection
    return _LOAD_CLASS
