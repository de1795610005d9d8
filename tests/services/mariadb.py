"""MariaDB from Debian's ``mariadb-server`` package: a private server on 127.0.0.1:13306.

``mariadb-install-db`` creates ``<service dir>/data``; ``mariadbd`` runs in the foreground (its
pid is the recorded one) with its unix socket and pid file in ``<service dir>/run``, no option
file read (``--no-defaults``: Debian's /etc/mysql is not ours), and a small buffer pool (it shares
a 2-core box with Kafka, HDFS and Spark).  As root the server switches to the ``mysql`` OS user
(the service dir's ancestors get o+x so that user can reach it).  User and database ``twophase``
(password ``twophase``, from 127.0.0.1 only); ``root`` logs in by the socket without a password.
Prepared XA transactions survive a disconnect and a restart (MariaDB >= 10.5.2, MDEV-742).
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.services import Service, ServiceError, pid_alive, port_open, wait_until

PORT = 13306
HOST = "127.0.0.1"
DBNAME = USER = PASSWORD = "twophase"
OS_USER = "mysql"

SETTINGS = {
    "innodb-buffer-pool-size": "64M",
    "innodb-log-file-size": "48M",
    "innodb-flush-log-at-trx-commit": "1",  # durable commits, as the guarantee is tested against
    "sync-binlog": "0",
    "max-connections": "200",
    "performance-schema": "OFF",
    "skip-name-resolve": None,
    "character-set-server": "utf8mb4",
    "collation-server": "utf8mb4_bin",
    "default-time-zone": "+00:00",
    "table-open-cache": "400",
    "key-buffer-size": "8M",
    "aria-pagecache-buffer-size": "8M",
    "thread-stack": "512K",
}


def find_mariadbd() -> str | None:
    return shutil.which("mariadbd") or (
        "/usr/sbin/mariadbd" if os.access("/usr/sbin/mariadbd", os.X_OK) else None)


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


class MariaDbService(Service):
    name = "mariadb"
    start_timeout = 90.0
    host = HOST
    port = PORT

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def run_dir(self) -> Path:
        return self.dir / "run"

    @property
    def socket(self) -> Path:
        return self.run_dir / "mariadbd.sock"

    @property
    def server_pid_file(self) -> Path:
        return self.run_dir / "mariadbd.pid"

    # -- helpers ----------------------------------------------------------------
    def _as_root(self) -> bool:
        return os.geteuid() == 0

    def os_user(self) -> pwd.struct_passwd:
        """The account that owns the data: ``mysql`` as root, else ourselves."""
        if not self._as_root():
            return pwd.getpwuid(os.geteuid())
        try:
            return pwd.getpwnam(OS_USER)
        except KeyError:
            raise ServiceError("running as root but there is no `mysql` OS user "
                               "(apt-get install mariadb-server)") from None

    def _make_reachable(self) -> None:
        """Let the server's user traverse to the service dir: o+x on our own ancestors (as root)."""
        if not self._as_root():
            return
        for d in [self.dir, *self.dir.parents]:
            st = d.stat()
            if st.st_uid == 0 and not st.st_mode & stat.S_IXOTH:
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_IXOTH)

    def _owned_dir(self, d: Path, mode: int = 0o700) -> None:
        d.mkdir(parents=True, exist_ok=True)
        u = self.os_user()
        os.chown(d, u.pw_uid, u.pw_gid)
        os.chmod(d, mode)

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MYSQL")}
        env.update(LC_ALL="C.UTF-8", LANG="C.UTF-8", TZ="UTC")
        return env

    # -- Service API ----------------------------------------------------------------
    def install(self) -> None:
        if find_mariadbd() is None or shutil.which("mariadb-install-db") is None:
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise ServiceError("MariaDB not installed; install Debian's `mariadb-server` package")
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            for cmd in (["apt-get", "update"],
                        ["apt-get", "install", "-y", "--no-install-recommends", "mariadb-server"]):
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if r.returncode != 0:
                    tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                    raise ServiceError(f"`{' '.join(cmd)}` failed:\n{tail}")
            if find_mariadbd() is None:
                raise ServiceError("apt-get installed mariadb-server but there is no mariadbd")
        self.os_user()
        self._make_reachable()
        if len(str(self.socket)) > 100:
            raise ServiceError(f"unix socket path {self.socket} is too long; set a shorter TWOPHASE_SERVICES_DIR")
        self._owned_dir(self.run_dir, 0o755)
        if not (self.data_dir / "mysql" / "user.frm").exists() and not (self.data_dir / "mysql" / "global_priv.frm").exists():
            if self.data_dir.exists():
                shutil.rmtree(self.data_dir)  # a half-done install-db
            self._owned_dir(self.data_dir)
            cmd = ["mariadb-install-db", "--no-defaults", f"--datadir={self.data_dir}",
                   "--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve",
                   "--innodb-buffer-pool-size=64M", "--innodb-log-file-size=48M"]
            if self._as_root():
                cmd.append(f"--user={OS_USER}")
            r = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env=self._env(),
                               cwd="/", timeout=300)
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                raise ServiceError(f"mariadb-install-db failed (exit {r.returncode}):\n{tail}")

    def _server_pid(self) -> int | None:
        """The pid in the server's own pid file, if that process is alive and a mariadbd."""
        try:
            pid = int(self.server_pid_file.read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) and b"mariadbd" in _cmdline(pid) else None

    def launch(self, log) -> subprocess.Popen | None:
        pid = self.pid()
        if pid is not None and b"mariadbd" not in _cmdline(pid):
            self.pid_path.unlink(missing_ok=True)  # stale pid file, pid reused by something else
            pid = None
        if pid is not None or self._server_pid() is not None:
            return None  # our server is already starting: wait for it, never start a second one
        if port_open(self.port, self.host):
            raise ServiceError(f"port {self.port} is taken by a server this module did not start; stop it first")
        mariadbd = find_mariadbd()
        assert mariadbd is not None
        cmd = [mariadbd, "--no-defaults", f"--datadir={self.data_dir}", f"--socket={self.socket}",
               f"--pid-file={self.server_pid_file}", f"--port={self.port}", f"--bind-address={self.host}"]
        cmd += [f"--{k}" if v is None else f"--{k}={v}" for k, v in SETTINGS.items()]
        if self._as_root():
            cmd.append(f"--user={OS_USER}")
        self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self._env(), cwd=str(self.dir), start_new_session=True)
        return self._proc

    def _root_conn(self, timeout: int = 2):
        import pymysql

        return pymysql.connect(unix_socket=str(self.socket), user="root", connect_timeout=timeout,
                               autocommit=True)

    def ready(self) -> bool:
        if not port_open(self.port, self.host):
            return False
        try:
            conn = self._root_conn()
        except Exception:
            return False
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1")
                return cur.fetchone() == (1,)
        except Exception:
            return False
        finally:
            conn.close()

    def after_ready(self) -> None:
        import pymysql

        conn = self._root_conn(timeout=10)
        try:
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE IF NOT EXISTS `{DBNAME}`")
                for host in (HOST, "localhost"):
                    cur.execute("CREATE USER IF NOT EXISTS %s@%s IDENTIFIED BY %s", (USER, host, PASSWORD))
                    cur.execute("ALTER USER %s@%s IDENTIFIED BY %s", (USER, host, PASSWORD))
                    cur.execute(f"GRANT ALL PRIVILEGES ON `{DBNAME}`.* TO %s@%s", (USER, host))
        finally:
            conn.close()
        try:  # the real client path: TCP + password
            pymysql.connect(host=self.host, port=self.port, user=USER, password=PASSWORD, database=DBNAME,
                            connect_timeout=10).close()
        except pymysql.Error as e:
            raise ServiceError(f"mariadb is up but {USER}@{self.host}:{self.port} cannot log in: {e}") from None

    def info(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "database": DBNAME, "user": USER, "password": PASSWORD,
                "socket": str(self.socket), "url": f"jdbc:mysql://{self.host}:{self.port}/{DBNAME}"}

    def terminate(self) -> None:
        # SIGTERM = normal shutdown (prepared XA branches stay, in InnoDB's undo logs).
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 60
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        super().terminate()

    def stop_extra(self) -> None:
        # A mariadbd on *our* data dir whose pid was not recorded (e.g. pid file lost).
        pid = self._server_pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                return
            deadline = time.monotonic() + 60
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)

    def restart(self) -> dict[str, Any]:
        """Stop the server and start it again on the same data dir (prepared XA branches survive)."""
        self.stop()
        wait_until(lambda: not port_open(self.port, self.host), 30, "mariadb port to close")
        return self.start()


SERVICE = MariaDbService()
