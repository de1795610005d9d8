"""PostgreSQL from Debian's ``postgresql`` package: a private cluster on 127.0.0.1:15432.

``initdb`` creates ``<service dir>/pgdata``; the postmaster runs in the foreground
(its pid is the recorded one) with its unix socket in ``<service dir>/run``.
PostgreSQL refuses to run as root, so as root the server runs as the ``postgres`` OS
user (the service dir's ancestors get o+x so that user can reach it).
``max_prepared_transactions=128`` for two-phase commit; role and database ``twophase``.
"""

from __future__ import annotations

import glob
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

PORT = 15432
HOST = "127.0.0.1"
DBNAME = USER = PASSWORD = "twophase"
DSN = f"host={HOST} port={PORT} dbname={DBNAME} user={USER} password={PASSWORD}"
SUPERUSER = "postgres"  # the bootstrap superuser name given to initdb (not necessarily the OS user)

SETTINGS = {
    "listen_addresses": f"'{HOST}'",
    "port": PORT,
    "max_connections": 200,
    "max_prepared_transactions": 128,
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    "shared_buffers": "'64MB'",
    "logging_collector": "off",
    "log_min_messages": "warning",
    "log_line_prefix": "'%m [%p] '",
    "timezone": "'UTC'",
}


def _version_key(binpath: str) -> float:
    try:
        return float(Path(binpath).parent.parent.name)
    except ValueError:
        return 0.0


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def find_bindir() -> Path | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=_version_key)
    return Path(found[-1]).parent if found else None


class PostgresService(Service):
    name = "postgres"
    start_timeout = 60.0
    _proc: subprocess.Popen | None = None
    #: Where clients reach it (``listen_addresses``, ``pg_hba``, ``info``).
    host = HOST
    port = PORT
    #: The addresses ``pg_hba.conf`` lets in by password (CIDR).
    clients = f"{HOST}/32"

    @property
    def dsn(self) -> str:
        return f"host={self.host} port={self.port} dbname={DBNAME} user={USER} password={PASSWORD}"

    def command(self, argv: list[str]) -> list[str]:
        """How the postmaster is started (a subclass runs it on a test host)."""
        return argv

    @property
    def data_dir(self) -> Path:
        return self.dir / "pgdata"

    @property
    def socket_dir(self) -> Path:
        return self.dir / "run"

    # -- helpers ----------------------------------------------------------------
    def bindir(self) -> Path:
        b = find_bindir()
        if b is None:
            raise ServiceError("PostgreSQL binaries not found under /usr/lib/postgresql/*/bin (run install)")
        return b

    def os_user(self) -> pwd.struct_passwd:
        """The non-root account that owns the cluster: ``postgres`` as root, else ourselves."""
        if os.geteuid() != 0:
            return pwd.getpwuid(os.geteuid())
        try:
            return pwd.getpwnam("postgres")
        except KeyError:
            raise ServiceError("running as root but there is no `postgres` OS user (apt-get install postgresql)") from None

    def _as_user(self) -> dict[str, Any]:
        if os.geteuid() != 0:
            return {}
        u = self.os_user()
        return {"user": u.pw_uid, "group": u.pw_gid, "extra_groups": []}

    def _env(self) -> dict[str, str]:
        u = self.os_user()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        env.update(HOME=u.pw_dir, USER=u.pw_name, LOGNAME=u.pw_name, LC_ALL="C.UTF-8", LANG="C.UTF-8")
        return env

    def _run(self, args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                              env=self._env(), cwd="/", timeout=timeout, **self._as_user())

    def _make_reachable(self) -> None:
        """Let the (non-root) server user traverse to the service dir: o+x on our own ancestors."""
        if os.geteuid() != 0:
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

    # -- Service API ----------------------------------------------------------------
    def install(self) -> None:
        if find_bindir() is None:
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise ServiceError("PostgreSQL not installed; install Debian's `postgresql` package")
            env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
            for cmd in (["apt-get", "update"],
                        ["apt-get", "install", "-y", "--no-install-recommends", "postgresql"]):
                r = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
                if r.returncode != 0:
                    tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                    raise ServiceError(f"`{' '.join(cmd)}` failed:\n{tail}")
            if find_bindir() is None:
                raise ServiceError("apt-get installed postgresql but no pg_ctl under /usr/lib/postgresql/*/bin")
        self.os_user()
        self._make_reachable()
        if len(str(self.socket_dir / f".s.PGSQL.{self.port}")) > 100:
            raise ServiceError(f"unix socket path under {self.socket_dir} is too long; set a shorter TWOPHASE_SERVICES_DIR")
        self._owned_dir(self.socket_dir, 0o755)
        if not (self.data_dir / "PG_VERSION").exists():
            if self.data_dir.exists():
                shutil.rmtree(self.data_dir)  # a half-done initdb
            self._owned_dir(self.data_dir)
            r = self._run([
                str(self.bindir() / "initdb"), "-D", str(self.data_dir), "-U", SUPERUSER,
                "-E", "UTF8", "--locale=C", "--auth-local=trust", "--auth-host=scram-sha-256",
            ])
            if r.returncode != 0:
                tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
                raise ServiceError(f"initdb failed (exit {r.returncode}):\n{tail}")
        self._configure()

    def _configure(self) -> None:
        u = self.os_user()
        conf = self.data_dir / "postgresql.conf"
        text = conf.read_text()
        if "include_if_exists = 'twophase.conf'" not in text:
            conf.write_text(text + "\n# twophase test service settings\ninclude_if_exists = 'twophase.conf'\n")
        settings = dict(SETTINGS, unix_socket_directories=f"'{self.socket_dir}'", port=self.port,
                        listen_addresses=f"'{self.host}'")
        extra = self.data_dir / "twophase.conf"
        extra.write_text("".join(f"{k} = {v}\n" for k, v in settings.items()))
        hba = self.data_dir / "pg_hba.conf"
        hba.write_text(
            "# written by tests/services/postgres.py\n"
            "local   all   all                  trust\n"
            f"host    all   all   {self.clients}    scram-sha-256\n"
        )
        for p in (extra, hba):
            os.chown(p, u.pw_uid, u.pw_gid)
            os.chmod(p, 0o600)

    def _postmaster_pid(self) -> int | None:
        """Pid in the data dir's postmaster.pid if that process is alive."""
        try:
            pid = int((self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0])
        except (OSError, ValueError):
            return None
        return pid if pid_alive(pid) else None

    def launch(self, log) -> subprocess.Popen | None:
        pid = self.pid()
        if pid is not None and b"postgres" not in _cmdline(pid):
            self.pid_path.unlink(missing_ok=True)  # stale pid file, pid reused by something else
            pid = None
        if pid is not None or self._postmaster_pid() is not None:
            return None  # our cluster is already starting: wait for it, never start a second one
        if port_open(self.port, self.host):
            raise ServiceError(f"port {self.port} is taken by a server this module did not start; stop it first")
        cmd = self.command([str(self.bindir() / "postgres"), "-D", str(self.data_dir)])
        self._proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self._env(),
            cwd=str(self.data_dir), start_new_session=True, **self._launch_as(),
        )
        return self._proc

    def _launch_as(self) -> dict[str, Any]:
        """Popen's user switch for the postmaster (a subclass that switches in ``command`` gives none)."""
        return self._as_user()

    def _superuser_conn(self, timeout: int = 2):
        import psycopg2

        return psycopg2.connect(host=str(self.socket_dir), port=self.port, dbname="postgres",
                                user=SUPERUSER, connect_timeout=timeout)

    def ready(self) -> bool:
        if not port_open(self.port, self.host):
            return False
        try:
            conn = self._superuser_conn()
        except Exception:
            return False
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT pg_is_in_recovery()")
                return cur.fetchone()[0] is False
        except Exception:
            return False
        finally:
            conn.close()

    def after_ready(self) -> None:
        import psycopg2
        from psycopg2 import sql

        conn = self._superuser_conn(timeout=10)
        conn.autocommit = True
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (USER,))
                verb = "ALTER" if cur.fetchone() else "CREATE"
                cur.execute(sql.SQL(verb + " ROLE {} WITH LOGIN PASSWORD %s").format(sql.Identifier(USER)),
                            (PASSWORD,))
                cur.execute("SELECT 1 FROM pg_database WHERE datname = %s", (DBNAME,))
                if not cur.fetchone():
                    cur.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(
                        sql.Identifier(DBNAME), sql.Identifier(USER)))
        finally:
            conn.close()
        try:  # the real client path: TCP + password
            psycopg2.connect(self.dsn, connect_timeout=10).close()
        except psycopg2.Error as e:
            raise ServiceError(f"postgres is up but `{self.dsn}` cannot log in: {e}") from None

    def info(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "dbname": DBNAME, "user": USER, "password": PASSWORD,
                "dsn": self.dsn}

    def terminate(self) -> None:
        # SIGINT = fast shutdown (abort sessions, checkpoint, exit). The base class's SIGTERM
        # would be a *smart* shutdown that waits for every client to disconnect.
        pid = self.pid()
        if pid is not None:
            try:
                os.kill(pid, signal.SIGINT)
            except ProcessLookupError:
                pass
            deadline = time.monotonic() + 30
            while pid_alive(pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        super().terminate()

    def stop_extra(self) -> None:
        # A postmaster on *our* data dir whose pid was not recorded (e.g. pid file lost).
        if self._postmaster_pid() is not None and find_bindir() is not None:
            self._run([str(self.bindir() / "pg_ctl"), "stop", "-D", str(self.data_dir), "-m", "fast", "-w"], timeout=60)

    def restart(self) -> dict[str, Any]:
        """Stop the server and start it again on the same data dir (prepared transactions survive)."""
        self.stop()
        wait_until(lambda: not port_open(self.port, self.host), 30, "postgres port to close")
        return self.start()


SERVICE = PostgresService()
