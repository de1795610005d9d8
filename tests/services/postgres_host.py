"""PostgreSQL on a test host of its own (tests/services/hosts.py): ``pg`` at its address.

The same server as ``tests/services/postgres.py`` (Debian's binaries, a private cluster,
``max_prepared_transactions``, role and database ``twophase``), but started in the ``pg`` host's
network and UTS namespaces, listening on that host's address only, with its data in the host's
folder; clients on the other test hosts (and the test runner, on the bridge) log in by password.
"""

from __future__ import annotations

from typing import Any

from tests.services import hosts
from tests.services.postgres import PORT, PostgresService


class PostgresOnHostService(hosts.OnHost, PostgresService):
    name = "postgres_host"
    on_host = hosts.host("pg")
    host = on_host.address
    port = PORT
    clients = f"{hosts.SUBNET}.0/{hosts.PREFIX}"

    def command(self, argv: list[str]) -> list[str]:
        # Entering the namespaces needs root; the server then drops to its OS user (setpriv).
        if self._as_user():
            u = self.os_user()
            argv = ["setpriv", f"--reuid={u.pw_uid}", f"--regid={u.pw_gid}", "--clear-groups", *argv]
        return super().command(argv)

    def _launch_as(self) -> dict[str, Any]:
        return {}


SERVICE = PostgresOnHostService()
