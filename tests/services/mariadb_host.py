"""MariaDB on a test host (tests/services/hosts.py): the ``pg`` host, at its address, port 13306.

The same server as ``tests/services/mariadb.py`` (Debian's ``mariadbd``, no option file, a small
buffer pool, user and database ``twophase``), but started in the ``pg`` host's network and UTS
namespaces (beside PostgreSQL's ``postgres_host``, on another port), listening on that host's
address only, with its data in the host's folder; clients on the other test hosts (and the test
runner, on the bridge) log in by password from the bridge's subnet.  The nemesis's
``mysql-upsert`` sink writes here (tests/nemesis.py).
"""

from __future__ import annotations

import subprocess

from tests.services import ServiceError, hosts, mariadb, port_open
from tests.services.mariadb import DBNAME, OS_USER, PASSWORD, PORT, SETTINGS, USER, MariaDbService


class MariaDbOnHostService(hosts.OnHost, MariaDbService):
    name = "mariadb_host"
    on_host = hosts.host("pg")
    host = on_host.address
    port = PORT
    #: Who may log in by password (MariaDB's host pattern): any address of the bridge's subnet.
    clients = f"{hosts.SUBNET}.%"

    def launch(self, log) -> subprocess.Popen | None:
        pid = self.pid()
        if pid is not None and b"mariadbd" not in mariadb._cmdline(pid):
            self.pid_path.unlink(missing_ok=True)  # stale pid file, pid reused by something else
            pid = None
        if pid is not None or self._server_pid() is not None:
            return None  # our server is already starting: wait for it, never start a second one
        if port_open(self.port, self.host):
            raise ServiceError(f"{self.host}:{self.port} is taken by a server this module did not start; stop it first")
        mariadbd = mariadb.find_mariadbd()
        assert mariadbd is not None
        cmd = [mariadbd, "--no-defaults", f"--datadir={self.data_dir}", f"--socket={self.socket}",
               f"--pid-file={self.server_pid_file}", f"--port={self.port}", f"--bind-address={self.host}"]
        cmd += [f"--{k}" if v is None else f"--{k}={v}" for k, v in SETTINGS.items()]
        if self._as_root():
            cmd.append(f"--user={OS_USER}")  # entering the namespaces needs root; mariadbd then drops to it
        # ``ip netns exec``, ``unshare`` and ``sh`` each exec the next: the recorded pid is mariadbd's.
        self._proc = subprocess.Popen(self.command(cmd), stdout=log, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=self._env(), cwd=str(self.dir),
                                      start_new_session=True)
        return self._proc

    def after_ready(self) -> None:
        import pymysql

        conn = self._root_conn(timeout=10)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{DBNAME}`")
                cur.execute("CREATE USER IF NOT EXISTS %s@%s IDENTIFIED BY %s", (USER, self.clients, PASSWORD))
                cur.execute("ALTER USER %s@%s IDENTIFIED BY %s", (USER, self.clients, PASSWORD))
                cur.execute(f"GRANT ALL PRIVILEGES ON `{DBNAME}`.* TO %s@%s", (USER, self.clients))
        finally:
            conn.close()
        try:  # the real client path: TCP from the bridge + password
            pymysql.connect(host=self.host, port=self.port, user=USER, password=PASSWORD, database=DBNAME,
                            connect_timeout=10).close()
        except pymysql.Error as e:
            raise ServiceError(f"mariadb_host is up but {USER}@{self.host}:{self.port} cannot log in: {e}") from None


SERVICE = MariaDbOnHostService()
