"""The nemesis: real faults injected while batches flow, on test hosts that really are apart.

    python -m tests.nemesis --sink postgres|postgres-upsert|mysql-upsert|files-s3|files-hdfs|kafka --minutes 2 --seed 7 [--cluster] [--out DIR]

The cluster (tests/services/hosts.py): drivers on the hosts ``driver-a`` and ``driver-b`` (each
its own network namespace, address, hostname and folder; Spark ``local[2]`` inside), the
transaction log on MinIO on the host ``s3``, reached through a fault proxy (tests/netproxy.py)
on the bridge's root address; the target a table on PostgreSQL on the host ``pg`` (``--sink
postgres``, inserts; ``postgres-upsert``, upserts on the id, the ids counted in a journal of every
committed write, which a trigger fills), a table on MariaDB on the same host (``mysql-upsert``:
MySqlSink's XA branches upserting on the id, counted through such a journal too), files on that
MinIO, reached directly
(``--sink files-s3``, FileSink's multipart uploads), files on HDFS on the host ``hdfs`` (``--sink
files-hdfs``, FileSink's Arrow writer through WebHDFS: staged files renamed), or a topic on Kafka on the host ``kafka``
(``--sink kafka``, read back ``read_committed``).  A
driver is ``tests/drivers/ownership_pipeline.py``: one Coordinator writing batches of unique ids,
one every ``--interval`` seconds, skipping the batches the log has committed; a short lease, so
that a successor takes a silent or paused driver's log over within seconds.

One driver is active; a standby on the other host has its Spark up and waits for its go.  Then,
until ``--minutes`` have passed, after a quiet spell of batches, one fault hits the active driver
and the standby takes over (it waits out the lease, then closes the old driver's open ballot):

- ``kill``: SIGKILL of the driver and its Spark (a crash);
- ``pause``: SIGSTOP of the driver's processes past its lease, then SIGCONT: a zombie that wakes
  up in the middle of its batch, deposed;
- ``delay``: the driver's next decision (its PUT of a batch's PREPARED record) is held in the
  proxy and the driver stopped while it waits; the PUT arrives late, while the successor
  recovers (up to 1 s after it took the log over: closing the driver's ballot, aborting its
  transactions, running the batch again, its own decision still to come), and the driver wakes
  after the successor committed;
- ``partition-log``: the log store stops answering the driver (a blackhole route where the
  proxy listens, towards the driver: its requests go unanswered, the target still works), then
  heals;
- ``isolate``: the driver's host leaves the bridge (nothing reaches it, nothing it sends
  arrives), then rejoins.

With ``--cluster`` the drivers run their batches on a Spark standalone cluster across the hosts
(tests/services/spark_hosts.py: the master on the bridge's root address, a worker on each of the
hosts ``worker-1`` and ``worker-2``; each driver holds one executor on each worker), with a
shuffle before the write, and three faults of one executor of the active driver join the
schedule.  Each waits until the batch's write tasks run on both workers (the tasks of that
batch wait a few seconds after marking their start, so that the fault finds them running), then
hits the executor of one of them; the driver is not deposed and must go on:

- ``executor-kill``: SIGKILL of the executor JVM and its Python workers.  Its shuffle output is
  lost with it, so its task's retry fails to fetch it and the write stage is retried while the
  other worker's task of the old stage attempt still runs (held, after its wait, until the
  retry's attempt of its partition has begun): two attempts of one partition at once;
- ``executor-pause``: SIGSTOP of the executor and its Python workers past the driver's network
  timeout (its tasks run again elsewhere), then SIGCONT: a zombie executor;
- ``executor-cut``: the worker's host loses the driver's address only (its heartbeats fail; its
  task runs on, reaches the target and pre-commits, and its result never arrives), healed after
  the network timeout.

The healed or resumed driver must stop without harm (fenced: exit 3, never a ``DataLossError``);
a new standby is started on its host.  At the end the pipeline is let run without faults to the
batch during which the stop file appeared.

The checker reads the history (faults with start and end, every driver's batches, exits) and
the target, and gives a verdict per property: every id exactly once (read back from the target),
no data loss reported, every takeover and every executor fault followed by a committed batch
within a bound, each executor fault's batch written by tasks (its driver's progress shows a task
path and no collect of the driver path: the drivers pin ``driver_batch_rows=0``), each
``executor-kill`` followed by two attempts of one partition that both passed their rows on at once, each ``delay``'s decision delivered after the takeover and before the
successor was done with its batch, progress resumed within a bound after the last heal, nothing left behind
(no prepared transaction of the run's gid prefix; no open upload or staged object of the run's
output), the pipeline finished.  It prints a verdict
table, writes ``history.json`` and a timeline picture (``timeline.png``: faults as bands,
batches committed over time, each driver's life) into ``--out``, and exits 0 only if every
verdict holds.  The same ``--seed`` plays the same schedule (timings vary with the machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DRIVER = REPO / "tests" / "drivers" / "ownership_pipeline.py"
FAULTS = ("kill", "pause", "delay", "partition-log", "isolate")
#: Faults of one executor of the active driver (``--cluster`` only): the driver is not deposed.
EXECUTOR_FAULTS = ("executor-kill", "executor-pause", "executor-cut")
ALL_FAULTS = FAULTS + EXECUTOR_FAULTS
#: With ``--cluster``: seconds an executor may be silent before its driver declares it lost, and
#: seconds every write task waits after its mark (so that an executor fault finds one running).
NETWORK_TIMEOUT, TASK_DELAY = 10.0, 4.0
#: ``executor-kill``: seconds the surviving write task of the old stage attempt waits at most for
#: the stage retry's attempt of its partition to start (see ``inject_executor``).
RIVAL_WAIT = 30.0
#: A slow write task's mark file (tests/drivers/ownership_pipeline.py ``--mark-dir``).
MARK = re.compile(r"b(?P<batch>\d+)-p(?P<partition>\d+)-s\d+-t(?P<task>\d+)-a(?P<attempt>\d+)-(?P<host>.+)")
DRIVER_HOSTS = ("driver-a", "driver-b")
#: Rows per batch and writer tasks (one transaction each) per batch.
ROWS, PARTITIONS = 20, 2


def _log(msg: str) -> None:
    print(f"[nemesis {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ history
@dataclass
class Fault:
    kind: str
    driver: str
    start: float
    end: float | None = None
    note: str = ""
    #: An executor fault: the mark of the write task whose executor it hit (None: not injected).
    mark: str | None = None
    #: ``delay``: the batch whose decision was held, when the successor's epoch appeared in the
    #: log store, and when the held PUT was let go (None: never held, or let go at the heal).
    held_batch: int | None = None
    took_over: float | None = None
    delivered: float | None = None


@dataclass
class DriverLife:
    label: str
    host: str
    started: float
    went: float | None = None
    ended: float | None = None
    exit: int | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    killed_at_end: bool = False


@dataclass
class History:
    sink: str
    seed: int
    started: float
    lease: float
    faults: list[Fault] = field(default_factory=list)
    drivers: list[DriverLife] = field(default_factory=list)
    stop_requested: float | None = None
    finished: float | None = None
    #: Set when the pipeline stopped making progress (no batch without a fault): what stalled.
    stalled: str | None = None
    #: The slow write tasks' marks (``--cluster``): batch, partition, task id, attempt, host, start
    #: (``at``) and end (``end``: None for an attempt that died, or failed to fetch its input).
    tasks: list[dict[str, Any]] = field(default_factory=list)

    def overlaps(self, batch: int | None = None) -> list[tuple[int, int]]:
        """(batch, partition) run by two task attempts at once (of ``batch`` only, if given): two
        attempts that both passed all their rows on (an end in their marks) and whose times from
        start to end intersect, so both were alive together.  A killed attempt, or one that failed
        to fetch its shuffle input, has no end and never counts."""
        by: dict[tuple[int, int], list[tuple[float, float]]] = {}
        for t in self.tasks:
            if t.get("end") is not None and (batch is None or t["batch"] == batch):
                by.setdefault((t["batch"], t["partition"]), []).append((t["at"], t["end"]))
        return sorted(k for k, spans in by.items()
                      if any(a[0] < b[1] and b[0] < a[1] for i, a in enumerate(spans) for b in spans[i + 1:]))

    def batches(self) -> list[tuple[float, str, int, str]]:
        """(time, driver, batch, action) of every batch a driver reported, by time."""
        out = [(e["at"], d.label, e["batch"], e["action"]) for d in self.drivers for e in d.events
               if e.get("event") == "batch"]
        return sorted(out)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ target
def _postgres_target(info: dict[str, Any]) -> Any:
    """PostgresSink into a table of the run's own on the ``pg`` host; leftovers: prepared
    transactions of the run's gid prefix (the real-process ownership tests' target)."""
    from tests.test_ownership_processes import PostgresTarget

    return PostgresTarget(None, None, info=info["postgres_host"])


def _postgres_upsert_target(info: dict[str, Any]) -> Any:
    """The same, upserting on ``id`` (a primary key): a zombie's prepared transaction that holds a
    row's lock stalls the successor's upsert of it.  A duplicate cannot show in the table (a second
    commit of a row updates it), so the ids are read from a journal a trigger fills: one row per
    row written, committed or rolled back with the transaction that wrote it."""
    return journaled_upsert_target(info["postgres_host"])


def journaled_upsert_target(info: dict[str, Any]) -> Any:
    """A PostgreSQL upsert target (``PostgresTarget``, ``mode="upsert"``) on the server ``info``
    whose ``ids()`` counts every committed write of an id, not the rows the table holds: an
    ``AFTER INSERT OR UPDATE`` row trigger on the table appends the id to a journal table in the
    writing transaction, so each prepared transaction that is committed adds its ids once, and
    one committed twice, or two attempts' transactions of one partition both committed, count
    twice where the upserted table shows one row."""
    from tests.test_ownership_processes import PostgresTarget

    class JournaledUpsertTarget(PostgresTarget):
        def __init__(self) -> None:
            super().__init__(None, None, info=info, mode="upsert")
            self.journal = f"{self.table}_w"
            with self._conn() as c, c.cursor() as cur:
                cur.execute(f'CREATE TABLE "{self.journal}" (id bigint NOT NULL, xid bigint DEFAULT txid_current())')
                cur.execute(f'CREATE FUNCTION "{self.journal}"() RETURNS trigger LANGUAGE plpgsql AS $$ '
                            f'BEGIN INSERT INTO "{self.journal}" (id) VALUES (NEW.id); RETURN NULL; END $$')
                cur.execute(f'CREATE TRIGGER "{self.journal}" AFTER INSERT OR UPDATE ON "{self.table}" '
                            f'FOR EACH ROW EXECUTE FUNCTION "{self.journal}"()')

        def ids(self) -> Counter:
            with self._conn() as c, c.cursor() as cur:
                cur.execute(f'SELECT id FROM "{self.journal}"')
                return Counter(r[0] for r in cur.fetchall())

        def cleanup(self) -> None:
            super().cleanup()  # rolls the run's prepared transactions back, drops the table (its trigger)
            with self._conn() as c, c.cursor() as cur:
                cur.execute(f'DROP TABLE IF EXISTS "{self.journal}"')
                cur.execute(f'DROP FUNCTION IF EXISTS "{self.journal}"()')

    return JournaledUpsertTarget()


def _mysql_upsert_target(info: dict[str, Any]) -> Any:
    """MySqlSink upserting on ``id`` into a table of the run's own on MariaDB on the ``pg`` host
    (tests/services/mariadb_host.py): each partition's rows in an XA branch, so a zombie's prepared
    branch holds the row locks the successor's upsert waits for.  Ids counted through a journal of
    committed writes, as for ``postgres-upsert``; leftovers: prepared XA branches of the run's
    gtrid prefix."""
    return journaled_mysql_upsert_target(info["mariadb_host"])


def journaled_mysql_upsert_target(info: dict[str, Any]) -> Any:
    """A MariaDB upsert target on the server ``info`` (``mode="upsert"`` on the primary key ``id``,
    a marker table of its own) whose ``ids()`` counts every committed write of an id: ``AFTER
    INSERT`` and ``AFTER UPDATE`` row triggers append the id to a journal table in the writing XA
    branch (``INSERT ... ON DUPLICATE KEY UPDATE`` of a key already there fires the update
    trigger, changed or not), so a branch committed adds its ids once, a branch rolled back none,
    and two branches of one partition both committed count twice where the table shows one row."""
    import pymysql

    class JournaledMySqlUpsertTarget:
        shape = "rows"

        def __init__(self) -> None:
            self.info = info
            self.table = f"nemm_{uuid.uuid4().hex[:8]}"
            self.journal, self.markers = f"{self.table}_w", f"{self.table}_m"
            self.gid_prefix = f"nm{uuid.uuid4().hex[:6]}"
            with self._conn() as cur:
                cur.execute(f"CREATE TABLE `{self.table}` (id BIGINT PRIMARY KEY, v VARCHAR(64)) ENGINE=InnoDB")
                cur.execute(f"CREATE TABLE `{self.journal}` (id BIGINT NOT NULL) ENGINE=InnoDB")
                for event in ("INSERT", "UPDATE"):
                    cur.execute(f"CREATE TRIGGER `{self.table}_{event[0].lower()}` AFTER {event} ON `{self.table}` "
                                f"FOR EACH ROW INSERT INTO `{self.journal}` (id) VALUES (NEW.id)")

        @contextlib.contextmanager
        def _conn(self) -> Any:
            c = pymysql.connect(host=info["host"], port=info["port"], user=info["user"], password=info["password"],
                                database=info["database"], autocommit=True, connect_timeout=10)
            try:
                with c.cursor() as cur:
                    yield cur
            finally:
                c.close()

        def sink_config(self) -> dict[str, Any]:
            from twophase.sinks.mysql import MySqlSink

            i = self.info
            return MySqlSink(i["host"], i["port"], i["database"], self.table, user=i["user"],
                             password={"env": "TP_MYSQL_PASSWORD"}, mode="upsert", key_columns=["id"],
                             marker_table=self.markers, gid_prefix=self.gid_prefix,
                             lock_wait_timeout=20).to_config()

        def env(self) -> dict[str, str]:
            return {"TP_MYSQL_PASSWORD": self.info["password"]}

        def ids(self) -> Counter:
            with self._conn() as cur:
                cur.execute(f"SELECT id FROM `{self.journal}`")
                return Counter(r[0] for r in cur.fetchall())

        def _branches(self, cur: Any) -> list[tuple[str, str]]:
            cur.execute("XA RECOVER")
            out = []
            for _fmt, glen, blen, data in cur.fetchall():
                data = data if isinstance(data, bytes) else data.encode()
                out.append((data[:glen].decode(errors="replace"), data[glen:glen + blen].decode(errors="replace")))
            return [(g, b) for g, b in out if g.startswith(self.gid_prefix + ":")]

        def leftovers(self) -> list[str]:
            with self._conn() as cur:
                return [f"{g}/{b}" for g, b in self._branches(cur)]

        def cleanup(self) -> None:
            # A prepared branch left by a failed run holds its rows' locks: the DROP would wait for it.
            with self._conn() as cur:
                for g, b in self._branches(cur):
                    with contextlib.suppress(pymysql.err.OperationalError):  # gone meanwhile (1397)
                        cur.execute("XA ROLLBACK %s, %s", (g, b))
                # The table, its journal, the marker table and whatever else the sink made beside it
                # under the marker table's name: every table named after the run's.
                cur.execute("SELECT table_name FROM information_schema.tables WHERE table_schema = DATABASE() "
                            "AND LEFT(table_name, %s) = %s", (len(self.table), self.table))
                tables = [r[0] for r in cur.fetchall()]
                if tables:
                    cur.execute("DROP TABLE IF EXISTS " + ", ".join(f"`{t}`" for t in tables))

    return JournaledMySqlUpsertTarget()


def _files_s3_target(info: dict[str, Any]) -> Any:
    """FileSink into a prefix of the run's own on MinIO on the ``s3`` host (reached directly, not
    through the log's proxy); leftovers: open multipart uploads and staged objects."""
    from tests.test_ownership_processes import S3FilesTarget

    return S3FilesTarget(None, None, info=info["minio_host"])


def _files_hdfs_target(info: dict[str, Any]) -> Any:
    """FileSink (Arrow writer, WebHDFS) into a folder of the run's own on HDFS on the ``hdfs`` host
    (reached directly); leftovers: staged files."""
    from tests.test_ownership_processes import HdfsFilesTarget

    return HdfsFilesTarget(None, None, info=info["hdfs_host"])


def _kafka_target(info: dict[str, Any]) -> Any:
    """KafkaSink into a topic of the run's own (two partitions) on the broker on the ``kafka``
    host; ids read back read_committed; leftovers: open transactions of the run's transactional
    ids and producers with a transaction open on the topic's partitions."""
    from tests.test_ownership_processes import KafkaTarget

    return KafkaTarget(None, None, info=info["kafka_host"])


TARGETS = {"postgres": _postgres_target, "postgres-upsert": _postgres_upsert_target,
           "mysql-upsert": _mysql_upsert_target, "files-s3": _files_s3_target,
           "files-hdfs": _files_hdfs_target, "kafka": _kafka_target}
#: The servers on hosts each sink's run needs besides the log's MinIO.
SERVERS = {"postgres": ("postgres_host",), "postgres-upsert": ("postgres_host",), "mysql-upsert": ("mariadb_host",),
           "files-s3": (), "files-hdfs": ("hdfs_host",), "kafka": ("kafka_host",)}
#: What "nothing left behind" looked for, per sink.
NOTHING_LEFT = {"postgres": "no prepared transaction", "postgres-upsert": "no prepared transaction",
                "mysql-upsert": "no prepared XA branch",
                "files-s3": "no open upload, no staged object", "files-hdfs": "no staged file",
                "kafka": "no open transaction"}


# ------------------------------------------------------------------------------------ drivers
class Driver:
    """One driver process on a test host (its own process group: its Spark dies with it)."""

    def __init__(self, label: str, host: str, folder: Path, args: list[str], env: dict[str, str],
                 package: Path | None = None):
        from tests.services import hosts

        self.label, self.host, self.folder = label, host, folder
        self.go_file = folder / f"{label}.go"
        self.out, self.err = folder / f"{label}.out", folder / f"{label}.log"
        self.address = hosts.host(host).address
        full = dict(os.environ, **env)
        path = (str(package) if package else None, str(REPO), os.environ.get("PYTHONPATH"))
        full["PYTHONPATH"] = os.pathsep.join(p for p in path if p)
        full.setdefault("PYSPARK_PYTHON", sys.executable)
        full["SPARK_LOCAL_IP"] = self.address
        full["TWOPHASE_SPARK_DRIVER_MEMORY"] = "512m"
        for k in ("TWOPHASE_CRASH_AT", "TWOPHASE_PAUSE_AT"):
            full.pop(k, None)
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = hosts.popen(host, [sys.executable, str(DRIVER), *args, "--go-file", str(self.go_file),
                                           "--ready-file", str(folder / f"{label}.ready")],
                                    env=full, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                    start_new_session=True, cwd=str(folder))
        self.life = DriverLife(label, host, time.time())
        self.ready_file = folder / f"{label}.ready"

    def go(self) -> None:
        self.go_file.touch()
        self.life.went = time.time()

    def events(self) -> list[dict[str, Any]]:
        lines = self.out.read_text(errors="replace").splitlines() if self.out.exists() else []
        out = []
        for line in lines:
            if line.startswith("OWNERSHIP "):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(line[len("OWNERSHIP "):]))
        return out

    def done(self) -> bool:
        return any(e.get("event") == "done" for e in self.events())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def close(self, *, kill: bool) -> None:
        if kill and self.alive():
            self.signal(signal.SIGCONT)
            self.signal(signal.SIGKILL)
            self.life.killed_at_end = True
        self.wait(30)
        self.life.ended = self.life.ended or time.time()
        self.life.exit = self.proc.returncode
        self.life.events = self.events()

    def tail(self, n: int = 30) -> str:
        text = self.err.read_text(errors="replace").splitlines()[-n:] if self.err.exists() else []
        return f"--- {self.label} on {self.host} ({self.err}) ---\n" + "\n".join(text)


# ------------------------------------------------------------------------------------ the run
class Nemesis:
    def __init__(self, sink: str, seed: int, minutes: float, out: Path, *, lease: float = 6.0,
                 interval: float = 0.5, faults: tuple[str, ...] = FAULTS, package: Path | None = None,
                 cluster: bool = False, quiet: tuple[int, int] = (2, 6)):
        self.rng = random.Random(seed)
        self.minutes, self.out, self.lease, self.interval = minutes, out, lease, interval
        self.fault_kinds = faults
        #: A folder holding another ``twophase`` package for the drivers (an older commit's).
        self.package = package
        self._package_config: dict[str, Any] | None = None
        self.run_id = uuid.uuid4().hex[:10]
        self.history = History(sink, seed, time.time(), lease)
        self.drivers: list[Driver] = []
        self.next_label = 0
        self.sink = sink
        #: The fault kinds to play, in order, instead of drawing them for ``minutes`` (a CI schedule).
        self.schedule: list[str] | None = None
        #: Drivers run their batches on the standalone cluster across the worker hosts
        #: (tests/services/spark_hosts.py), with a shuffle and slow write tasks, instead of local[2].
        self.cluster = cluster
        #: Batches committed between two faults: drawn from this range (inclusive).
        self.quiet = quiet
        self.marks = out / "marks"
        #: While this file exists, the drivers' write tasks are slow (an executor fault is coming).
        self.slow_file = out / "slow"
        #: ``executor-kill`` writes the killed task's mark here: the slow write tasks of its batch wait,
        #: after their wait, for their rivals (tests/drivers/ownership_pipeline.py ``--rival-file``).
        self.rival_file = out / "rival"
        bad = [k for k in faults if k in EXECUTOR_FAULTS] if not cluster else []
        if bad:
            raise ValueError(f"executor faults {bad} need the cluster (cluster=True, --cluster)")

    # ---------------------------------------------------------------- set-up
    def setup(self) -> None:
        from tests.netproxy import Proxy
        from tests.services import ensure, hosts

        info = ensure("hosts", "minio_host", *SERVERS[self.sink], *(("spark_hosts",) if self.cluster else ()))
        if self.cluster:
            self.marks.mkdir(parents=True, exist_ok=True)
            self.master_url = info["spark_hosts"]["master_url"]
            self._wait_for_a_free_cluster()
        self.minio = info["minio_host"]
        self.target = TARGETS[self.sink](info)
        self.log_prefix = f"nemesis-{self.run_id}/log"
        self.log_url = f"s3://{self.minio['bucket']}/{self.log_prefix}"
        # Every driver reaches the log through a fault proxy on the bridge's root address: the
        # ``delay`` fault holds one driver's request there.
        up_host, up_port = self.minio["endpoint_url"].split("://", 1)[1].rsplit(":", 1)
        self.proxy = Proxy(up_host, int(up_port), listen_host=hosts.ROOT_ADDRESS).start()
        self.log_options = {"key": self.minio["key"], "secret": {"env": "TP_NEMESIS_S3_SECRET"},
                            "endpoint_url": self.proxy.url(), "region_name": self.minio["region"],
                            # a request the partition leaves unanswered fails within seconds, not minutes
                            "config_kwargs": {"connect_timeout": 3, "read_timeout": 10,
                                              "retries": {"max_attempts": 2, "mode": "standard"}}}
        self.stop_file = self.out / "stop"
        self.env = dict(self.target.env(), TP_NEMESIS_S3_SECRET=self.minio["secret"])

    def _wait_for_a_free_cluster(self, timeout: float = 60.0) -> None:
        """Wait until no other application runs on the cluster, or say which ones do.  The drivers
        need both workers' executors; one left by an interrupted run (its pytest killed) keeps
        them, and every batch of this run would stall with no hint why."""
        from tests.services.spark_cluster import master_status
        from tests.services.spark_hosts import MASTER_JSON

        deadline = time.monotonic() + timeout
        while True:
            apps = (master_status(url=MASTER_JSON) or {}).get("activeapps") or []
            if not apps:
                return
            if time.monotonic() > deadline:
                names = "; ".join(f"{a.get('name')} ({a.get('id')}, {a.get('cores')} cores)" for a in apps)
                _log(f"WARNING: the cluster still runs {len(apps)} other application(s) after {timeout:.0f} s: "
                     f"{names}. This run's drivers may get no executors. A driver left by an interrupted "
                     "run? Stop it: pkill -f ownership_pipeline.py")
                return
            time.sleep(0.5)

    def sink_config(self) -> dict[str, Any]:
        """The target's sink config; for an older ``--package``, without the parameters its sink
        does not know (they keep that package's defaults)."""
        config = self.target.sink_config()
        if self.package is None:
            return config
        if self._package_config is not None:
            return self._package_config
        code = ("import inspect, json, sys\n"
                "from twophase.config import sink_class\n"
                "config = json.loads(sys.argv[1])\n"
                "params = inspect.signature(sink_class(config['sink']).__init__).parameters\n"
                "print(json.dumps({k: v for k, v in config.items() if k == 'sink' or k in params}))\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join((str(self.package), str(REPO))))
        out = subprocess.run([sys.executable, "-c", code, json.dumps(config)], env=env, capture_output=True,
                             cwd=str(self.package),  # not the checkout: "-c" puts the cwd first on the path
                             text=True, check=True, timeout=120).stdout
        known = json.loads(out)
        if set(known) != set(config):
            _log(f"--package: parameters its sink does not know, left out: {sorted(set(config) - set(known))}")
        self._package_config = known  # one look per run, not one per driver
        return known

    def start_driver(self, host: str) -> Driver:
        self.next_label += 1
        label = f"d{self.next_label}"
        args = ["--sink-config", json.dumps(self.sink_config()), "--log", self.log_url,
                "--log-options", json.dumps(self.log_options), "--name", f"nemesis-{self.run_id}",
                "--lease-timeout", str(self.lease), "--batches", "100000", "--rows", str(ROWS),
                "--partitions", str(PARTITIONS), "--interval", str(self.interval), "--shape", self.target.shape,
                "--wait-for-lease", "600", "--stop-file", str(self.stop_file)]
        if self.cluster:
            from tests.services import hosts

            args += ["--master", self.master_url, "--driver-host", hosts.host(host).address, "--shuffle",
                     "--network-timeout", str(NETWORK_TIMEOUT), "--task-delay", str(TASK_DELAY),
                     "--mark-dir", str(self.marks), "--slow-file", str(self.slow_file),
                     "--rival-file", str(self.rival_file), "--rival-wait", str(RIVAL_WAIT)]
            for name in self.target.env():  # the sink's secrets: executors on the worker hosts need them
                args += ["--executor-env", name]
        d = Driver(label, host, self.out, args, self.env, self.package)
        self.drivers.append(d)
        self.history.drivers.append(d.life)
        _log(f"{label}: started on {host} ({d.address})")
        return d

    def other_host(self, host: str) -> str:
        return DRIVER_HOSTS[1 - DRIVER_HOSTS.index(host)]

    def wait_ready(self, d: Driver, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not d.ready_file.exists():
            if not d.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{d.label} never got Spark up (exit {d.proc.poll()})\n{d.tail()}")
            time.sleep(0.2)

    @staticmethod
    def _written(d: Driver) -> int:
        """Batches ``d`` wrote (committed or recommitted; a batch it skipped was an earlier driver's)."""
        return sum(1 for e in d.events() if e.get("event") == "batch" and e.get("action") != "skipped")

    def wait_batches(self, d: Driver, n: int, timeout: float) -> bool:
        """Wait until ``d`` wrote ``n`` more batches than now (False after ``timeout`` or if it died)."""
        have = self._written(d)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._written(d) >= have + n or not d.alive():
                return d.alive()
            time.sleep(0.2)
        return False

    # ---------------------------------------------------------------- faults
    def inject(self, kind: str, victim: Driver) -> tuple[Fault, Any]:
        from tests.services import hosts

        f = Fault(kind, victim.label, time.time())
        _log(f"FAULT {kind} on {victim.label} ({victim.host})")
        if kind == "kill":
            victim.signal(signal.SIGKILL)
            f.end = f.start
            return f, None
        if kind == "pause":
            # The zombie wakes while its successor recovers: a drawn lag (up to 1.5 s) after the
            # successor took the log over, when it is closing the victim's ballot, aborting its
            # transactions, running its batch again or committing it.
            victim.signal(signal.SIGSTOP)
            lag = self.rng.uniform(0.0, 1.5)
            watch = self._after_takeover(lag, lambda: victim.signal(signal.SIGCONT))

            def undo() -> None:
                f.note = f"woke {lag:.2f} s after the successor took over" if watch() else "woke at the heal"
                victim.signal(signal.SIGCONT)
            return f, undo
        if kind == "delay":
            return f, self._delay(f, victim)
        if kind == "partition-log":
            # The log store's proxy stops answering the victim (a blackhole route where it listens,
            # towards the victim); the victim still reaches PostgreSQL and the target's own S3.
            hosts.cut(hosts.ROOT, victim.address)
            return f, lambda: hosts.uncut(hosts.ROOT, victim.address)
        if kind == "isolate":
            hosts.isolate(victim.host)
            return f, lambda: hosts.rejoin(victim.host)
        raise ValueError(f"unknown fault {kind!r}; known: {', '.join(FAULTS)}")

    def _executor(self, driver: Driver, worker: str) -> list[int]:
        """The pids of ``driver``'s executor on host ``worker``: its JVM, then its Python daemon and
        workers (empty if it has none)."""
        from tests.services import hosts
        from tests.services.spark_cluster import _cmdline, descendants

        for pid in hosts.pids(worker):
            cmd = _cmdline(pid)
            if b"CoarseGrainedExecutorBackend" in cmd and f"@{driver.address}:".encode() in cmd:
                return [pid, *descendants(pid)]
        return []

    def _running_task(self, driver: Driver, timeout: float = 60.0) -> tuple[str, str] | None:
        """Wait for a slow write task of ``driver`` to start on each worker host (a mark made after now);
        return one drawn (its worker host, its mark), or None after ``timeout``."""
        since = time.time()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            fresh: dict[str, str] = {}
            for m in self.marks.iterdir():
                with contextlib.suppress(OSError):
                    if m.stat().st_mtime >= since:
                        mark = MARK.fullmatch(m.name)
                        if mark:
                            fresh.setdefault(mark["host"], m.name)
            if len(fresh) >= 2:
                worker = self.rng.choice(sorted(fresh))
                return worker, fresh[worker]
            if not driver.alive():
                return None
            time.sleep(0.05)
        return None

    def inject_executor(self, kind: str, driver: Driver) -> tuple[Fault, Any]:
        """An executor fault on the worker host of one of ``driver``'s running write tasks, once a
        task of the batch runs on each worker: ``executor-kill`` SIGKILLs that executor (JVM,
        Python daemon and workers: its shuffle output is lost, so the write stage fails to fetch
        it and is retried while the other worker's task of the old attempt runs on, held until the
        retry's attempt of its partition started: two attempts of it write at once);
        ``executor-pause`` stops it past the network timeout (its driver declares it lost and runs
        its tasks again) and resumes it: a zombie; ``executor-cut`` cuts its host from the driver
        only (its heartbeats fail, its task runs on and reaches the target) past the network
        timeout, then heals."""
        from tests.services import hosts

        self.rival_file.unlink(missing_ok=True)  # an earlier executor-kill's
        self.slow_file.touch()
        try:
            found = self._running_task(driver)
        finally:
            self.slow_file.unlink(missing_ok=True)
        f = Fault(kind, driver.label, time.time())
        if found is None:
            f.end, f.note = f.start, "no write task running on both workers in 60 s: not injected"
            _log(f"FAULT {kind} on {driver.label}: {f.note}")
            return f, None
        worker, mark = found
        pids = self._executor(driver, worker)
        f.note, f.mark = f"{worker}, during {mark}", mark
        _log(f"FAULT {kind} on {driver.label}'s executor on {worker} (pids {pids[:1]}...; {mark})")
        if not pids:
            f.end, f.note, f.mark = f.start, f"{worker}: no executor of {driver.label} found: not injected", None
            return f, None
        if kind == "executor-kill":
            # The task of the other worker waits, once its own wait is over, until the stage
            # retry's attempt of its partition has started, and the retry's attempt of the killed
            # task's partition until both have passed their rows on (at most RIVAL_WAIT s each):
            # two attempts of one partition write at once however long the loss of the executor
            # takes to become a stage retry, and the job does not end (killing one) before.
            self.rival_file.write_text(mark)
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGKILL)
            f.end = f.start
            return f, None
        if kind == "executor-pause":
            for p in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGSTOP)

            def resume() -> None:
                for p in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGCONT)
            return f, resume
        if kind == "executor-cut":
            hosts.cut(worker, driver.address)
            return f, lambda: hosts.uncut(worker, driver.address)
        raise ValueError(f"unknown executor fault {kind!r}; known: {', '.join(EXECUTOR_FAULTS)}")

    def _delay(self, f: Fault, victim: Driver) -> Any:
        """The victim's next decision (its PUT of a batch's PREPARED record) is held on the wire,
        and the victim stopped while it waits for the answer (its lease's heartbeat stops too).
        The PUT is delivered while the successor recovers: a drawn lag (up to 1 s) after it took
        the log over, when it is closing or aborting the victim's attempt and running the batch
        again, its own decision still to come (else at the heal).  The victim wakes at the heal,
        after the successor committed."""
        bucket = self.minio["bucket"]
        held = self.proxy.hold(rf"PUT /{bucket}/{self.log_prefix}/[^ ]*\.prepared(\.\d+)?\.json ",
                               client=victim.address)
        ok = held.wait(60)
        if ok:
            # botocore sends a PUT's headers with "Expect: 100-continue" and its body after 1 s
            # without an answer: the body goes out too (into the held connection) before the
            # victim stops, so that the late request arrives whole (headers alone would make
            # MinIO lock the key until it gave up waiting for the body: no real delay does that).
            time.sleep(1.5)
        victim.signal(signal.SIGSTOP)
        f.start = time.time()  # the fault is on from here: the victim is silent
        if not ok:
            held.drop()  # disarmed: no decision of the victim's in 60 s; it is stopped all the same
            f.note = "no decision to hold in 60 s"
            return lambda: victim.signal(signal.SIGCONT)
        f.note = held.first_line.decode(errors="replace").split(" ")[1].rsplit("/", 1)[-1] + " held"
        batch = re.search(r"batch-0*(\d+)\.prepared", f.note)
        f.held_batch = int(batch.group(1)) if batch else None
        lag = self.rng.uniform(0.0, 1.0)

        def deliver() -> None:
            f.delivered = time.time()
            held.release()
        watch = self._after_takeover(lag, deliver, seen=lambda at: setattr(f, "took_over", at))

        def undo() -> None:
            if watch():
                f.note += f"; delivered {lag:.2f} s after the successor took over"
            else:
                held.release()
                f.note += "; delivered at the heal"
            time.sleep(0.5)  # the late PUT is answered before the victim reads the answer
            victim.signal(signal.SIGCONT)
        return undo

    def _after_takeover(self, lag: float, action: Any, seen: Any = None) -> Any:
        """Run ``action`` ``lag`` seconds after a successor takes the log over (a new epoch record
        appears in the log store, read directly from the nemesis; ``seen(time)`` is told when);
        returns ``watch()``, which stops the watcher and tells whether ``action`` ran."""
        from tests.services.s3 import client

        s3, bucket, prefix = client(self.minio), self.minio["bucket"], f"{self.log_prefix}/epochs/"

        def epochs() -> set[str]:
            return {o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])}

        before = epochs()
        done, ran = threading.Event(), threading.Event()

        def watcher() -> None:
            while not done.wait(0.05):
                with contextlib.suppress(Exception):
                    if epochs() - before:
                        if seen is not None:
                            seen(time.time())
                        if not done.wait(lag):
                            action()
                            ran.set()
                        return

        t = threading.Thread(target=watcher, daemon=True)
        t.start()

        def watch() -> bool:
            done.set()
            t.join()
            return ran.is_set()
        return watch

    # ---------------------------------------------------------------- the schedule
    def run(self) -> History:
        self.setup()
        try:
            self._schedule()
        finally:
            self._teardown()
        return self.history

    def _schedule(self) -> None:
        budget_end = time.monotonic() + self.minutes * 60
        active = self.start_driver(DRIVER_HOSTS[0])
        standby = self.start_driver(DRIVER_HOSTS[1])
        self.wait_ready(active)
        active.go()
        played = 0
        while (time.monotonic() < budget_end) if self.schedule is None else played < len(self.schedule):
            # A quiet spell: some batches commit before the next fault.
            quiet = self.rng.randint(*self.quiet)
            if not self.wait_batches(active, quiet, timeout=120):
                self._stalled(active, f"{active.label} (on {active.host}) wrote no {quiet} batches in 120 s "
                                      "without a fault")
                return
            kind = self.rng.choice(self.fault_kinds) if self.schedule is None else self.schedule[played]
            played += 1
            if kind in EXECUTOR_FAULTS:
                # The driver stays; its batch is held up until Spark runs the task elsewhere.
                fault, undo = self.inject_executor(kind, active)
                self.history.faults.append(fault)
                if undo is not None:
                    time.sleep(NETWORK_TIMEOUT + self.rng.uniform(2.0, 6.0))
                    undo()
                    fault.end = time.time()
                    _log(f"HEAL {kind} on {active.label}'s executor")
                continue
            self.wait_ready(standby)
            fault, undo = self.inject(kind, active)
            self.history.faults.append(fault)
            standby.go()  # takes the log over once the victim's lease expired
            old, active = active, standby
            if undo is not None:
                # Long enough for the successor to take over and commit: the victim is deposed.
                took_over = self.wait_batches(active, 1, timeout=self.lease * 4 + 60)
                time.sleep(self.rng.uniform(0.0, 2.0))
                undo()
                fault.end = time.time()
                fault.note = "; ".join(x for x in (fault.note, "successor committed during the fault" if took_over
                                                    else "no batch during the fault") if x)
                _log(f"HEAL {kind} on {old.label} ({fault.note})")
            code = old.wait(self.lease * 3 + 60)
            if code is None:
                _log(f"{old.label} still runs {self.lease * 3 + 60:.0f}s after the fault: killed")
                old.close(kill=True)
            else:
                old.close(kill=False)
                _log(f"{old.label} exited {code}")
            standby = self.start_driver(old.host)
        # No more faults: the active driver ends the pipeline after the batch running now.
        if not self.wait_batches(active, 2, timeout=self.lease * 4 + 120):
            self._stalled(active, f"{active.label} (on {active.host}) wrote no 2 batches in "
                                  f"{self.lease * 4 + 120:.0f} s after the last fault")
            return
        self.stop_file.touch()
        self.history.stop_requested = time.time()
        _log("stop requested")
        code = active.wait(240)
        if code is None:
            _log(f"{active.label} did not finish in 240 s")
        self.history.finished = time.time()

    def _stalled(self, d: Driver, what: str) -> None:
        """The pipeline stopped making progress: no more faults, the checker says what it finds."""
        code = d.proc.poll()
        self.history.stalled = what + (f" (it exited {code})" if code is not None else " (it still runs)")
        _log(f"STALL: {self.history.stalled}\n{d.tail(12)}")
        self.history.finished = time.time()

    def _teardown(self) -> None:
        from tests.services import hosts

        if self.cluster and self.marks.is_dir():
            for m in sorted(self.marks.iterdir()):
                g = MARK.fullmatch(m.name)
                if g:
                    times: list[float] = []  # its start, then its end
                    with contextlib.suppress(OSError, ValueError):
                        times = [float(x) for x in m.read_text().split()]
                    self.history.tasks.append({**{k: int(g[k]) for k in ("batch", "partition", "task", "attempt")},
                                               "host": g["host"], "mark": m.name,
                                               "at": times[0] if times else m.stat().st_mtime,
                                               "end": times[1] if len(times) > 1 else None})
        with contextlib.suppress(Exception):
            hosts.heal()
        for d in self.drivers:
            d.close(kill=True)
        if hasattr(self, "proxy"):
            self.proxy.close()


# ------------------------------------------------------------------------------------ checker
@dataclass
class Verdict:
    name: str
    ok: bool
    detail: str


def check(history: History, target: Any, *, progress_bound: float) -> list[Verdict]:
    out: list[Verdict] = []
    done = [e for d in history.drivers for e in d.events if e.get("event") == "done"]
    last = max((int(e.get("last", -1)) for e in done), default=None)
    out.append(Verdict("the pipeline finished", last is not None and history.stalled is None,
                       f"done after batch {last}" if last is not None else
                       f"no driver reached the stop: {history.stalled or 'the run ended'}"))
    seen = target.ids()
    # A run that ended early: the batches some driver reported written, or reported lost, must
    # all be there.
    written = [b for _, _, b, action in history.batches() if action in ("committed", "recommitted", "skipped")]
    written += [int(m.group(1)) for d in history.drivers for e in d.events if e.get("data_loss")
                for m in [re.search(r"batch (\d+)", e.get("message", ""))] if m]
    end = last if last is not None else max(written, default=-1)
    expected = set(range((end + 1) * ROWS))
    lost = sorted(expected - set(seen))
    dup = sorted(i for i, n in seen.items() if n > 1)
    # (unexpected ids only of a finished run: one that ended early may have committed a batch it
    # did not live to report)
    extra = sorted(set(seen) - expected) if last is not None else []
    out.append(Verdict("every id exactly once", not lost and not dup and not extra,
                       f"{len(expected)} expected, {sum(seen.values())} rows read; lost {len(lost)} "
                       f"{lost[:5]}, duplicated {len(dup)} {dup[:5]}, unexpected {len(extra)} {extra[:5]}"))
    losses = [d.label for d in history.drivers
              if d.exit == 4 or any(e.get("data_loss") for e in d.events)]
    out.append(Verdict("no data loss reported", not losses, f"DataLossError in {losses}" if losses else
                       f"{len(history.drivers)} drivers, exits {[d.exit for d in history.drivers]}"))
    # Each takeover: from the fault to the first batch committed by another driver.
    takeovers = []
    for f in (f for f in history.faults if f.kind in FAULTS):
        later = [t for t, who, _, action in history.batches()
                 if t > f.start and who != f.driver and action in ("committed", "recommitted")]
        takeovers.append(later[0] - f.start if later else None)
    if takeovers:
        known = sorted(x for x in takeovers if x is not None)
        worst = None if len(known) < len(takeovers) else known[-1]
        out.append(Verdict(f"every takeover within {progress_bound:.0f} s", worst is not None and worst <= progress_bound,
                           (f"median {known[len(known) // 2]:.1f} s, max {worst:.1f} s" if worst is not None
                            else f"{len(takeovers) - len(known)} fault(s) never followed by another driver's batch")))
    # Each executor fault: from its heal (a kill's moment) to the driver's next batch committed.
    recoveries = []
    for f in (f for f in history.faults if f.kind in EXECUTOR_FAULTS):
        later = [t for t, _, _, action in history.batches()
                 if t > (f.end or f.start) and action in ("committed", "recommitted")]
        recoveries.append(later[0] - (f.end or f.start) if later else None)
    if recoveries:
        known = sorted(x for x in recoveries if x is not None)
        worst = None if len(known) < len(recoveries) else known[-1]
        retried = [e for d in history.drivers for e in d.events if e.get("event") == "batch"]
        out.append(Verdict(f"progress within {progress_bound:.0f} s of each executor fault",
                           worst is not None and worst <= progress_bound,
                           (f"max {worst:.1f} s; Spark: {sum(e.get('stage_retries', 0) for e in retried)} stage "
                            f"retries, {sum(e.get('failed_tasks', 0) for e in retried)} failed tasks, "
                            f"{len(history.overlaps())} partitions run by two attempts at once"
                            if worst is not None else
                            f"{len(recoveries) - len(known)} executor fault(s) never followed by a batch")))
    out += exercised(history)
    heals = [f.end for f in history.faults if f.end is not None]
    if heals:
        last_heal = max(heals)
        after = [t for t, _, _, action in history.batches() if t > last_heal and action == "committed"]
        delay = (after[0] - last_heal) if after else None
        ok = delay is not None and delay <= progress_bound
        out.append(Verdict(f"progress within {progress_bound:.0f} s of the last heal", ok,
                           f"first batch committed {delay:.1f} s after it" if delay is not None
                           else "no batch committed after it"))
    left = target.leftovers()
    out.append(Verdict("nothing left behind", not left, f"{len(left)} left: {left[:3]}" if left
                       else f"nothing of the run's ({NOTHING_LEFT[history.sink]})"))
    return out


def exercised(history: History) -> list[Verdict]:
    """Whether the faults made what they are there for (a run that did not is reported as such,
    not passed): each ``executor-kill`` two attempts of one partition running at once in its batch
    (its stage retry beside the old stage attempt's task); each ``delay`` its held decision
    delivered after the successor took the log over and before the successor was done with that
    batch (closing the victim's ballot, or running the batch again, its own decision to come)."""
    out = []
    kills = [f for f in history.faults if f.kind == "executor-kill"]
    if kills:
        seen, ok = [], True
        for f in kills:
            g = MARK.fullmatch(f.mark or "")
            both = history.overlaps(int(g["batch"])) if g else []
            ok = ok and bool(both)
            seen.append(f"batch {g['batch']}: {f'partitions {[p for _, p in both]}' if both else 'none'}"
                        if g else "not injected")
        out.append(Verdict("executor-kill: 2 attempts of a partition at once", ok, "; ".join(seen)))
    out += _executor_faults_hit_tasks(history)
    delays = [f for f in history.faults if f.kind == "delay"]
    if delays:
        seen, ok = [], True
        for f in delays:
            if f.held_batch is None:
                seen.append(f"no decision held ({f.note})")
                ok = False
                continue
            later = [(t, who, action) for t, who, b, action in history.batches()
                     if b == f.held_batch and who != f.driver and t > f.start]
            if f.delivered is None or f.took_over is None:
                seen.append(f"batch {f.held_batch}: delivered at the heal, not during the takeover")
                ok = False
            elif not later or later[0][0] <= f.delivered:
                seen.append(f"batch {f.held_batch}: delivered after the successor was done with it"
                            if later else f"batch {f.held_batch}: no successor wrote it")
                ok = False
            else:
                t, who, action = later[0]
                seen.append(f"batch {f.held_batch}: delivered {f.delivered - f.took_over:.2f} s after the takeover, "
                            f"{t - f.delivered:.2f} s before {who} {action} it "
                            f"({'the late decision won' if action == 'recommitted' else 'it lost'})")
        out.append(Verdict("delay: decision delivered in the takeover", ok, "; ".join(seen)))
    return out


#: The coordinator's paths (its progress's ``task_input``) on which Spark tasks write the batch.
TASK_PATHS = ("arrow", "rows", "batch")


def _executor_faults_hit_tasks(history: History) -> list[Verdict]:
    """Each executor fault's batch (its mark's) was written by tasks: the victim driver reported it
    with a task path (``task_input`` "arrow" or "rows", or the sink's own job) and no collect of the
    driver path (``collect_ms`` 0).  On the driver path the executor fault would hit the collect's
    job (which runs the same plan, marks included), or nothing, and never a writing task."""
    faults = [f for f in history.faults if f.kind in EXECUTOR_FAULTS]
    if not faults:
        return []
    seen, ok, injected = [], True, 0
    for f in faults:
        g = MARK.fullmatch(f.mark or "")
        if not g:
            seen.append(f"{f.kind}: not injected")
            continue
        injected += 1
        b = int(g["batch"])
        reports = [e for d in history.drivers if d.label == f.driver for e in d.events
                   if e.get("event") == "batch" and e.get("batch") == b and e.get("action") != "skipped"]
        good = bool(reports) and all(e.get("task_input") in TASK_PATHS and not e.get("collect_ms")
                                     for e in reports)
        ok = ok and good
        paths = ", ".join(f"{e.get('task_input')!r} (collect {e.get('collect_ms')} ms)" for e in reports)
        seen.append(f"{f.kind} batch {b}: {paths or f'no batch {b} reported by {f.driver}'}")
    return [Verdict("executor faults hit writing tasks", ok and injected > 0, "; ".join(seen))]


def table(verdicts: list[Verdict], history: History) -> str:
    kinds = Counter(f.kind for f in history.faults)
    lines = [f"  nemesis: {history.sink}, seed {history.seed}, {len(history.faults)} faults "
             f"({', '.join(f'{k} x{n}' for k, n in sorted(kinds.items())) or 'none'}), "
             f"{len(history.drivers)} drivers, {len(history.batches())} batches reported",
             "  " + "-" * 72]
    for v in verdicts:
        lines.append(f"  {'PASS' if v.ok else 'FAIL'}  {v.name:<40} {v.detail}")
    lines.append(f"  result: {'EXACTLY ONCE, NO STALL' if all(v.ok for v in verdicts) else 'VIOLATED'}")
    return "\n".join(lines)


def timeline(history: History, path: Path) -> None:
    """Faults as bands, batches committed over time, each driver's life as a bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = history.started
    fig, (ax, bars) = plt.subplots(2, 1, figsize=(10, 5.5), sharex=True, height_ratios=[3, 1.4])
    colours = {"kill": "#d62728", "pause": "#ff7f0e", "delay": "#e377c2", "partition-log": "#9467bd",
               "isolate": "#8c564b", "executor-kill": "#17becf", "executor-pause": "#bcbd22",
               "executor-cut": "#7f7f7f"}
    for f in history.faults:
        end = f.end if f.end is not None and f.end > f.start else f.start + 0.4
        for a in (ax, bars):
            a.axvspan(f.start - t0, end - t0, color=colours.get(f.kind, "grey"), alpha=0.25, lw=0)
        ax.text(f.start - t0, 0.98, f"{f.kind}\n{f.driver}", transform=ax.get_xaxis_transform(), va="top",
                fontsize=7, color=colours.get(f.kind, "grey"))
    committed = [(t, b) for t, _, b, a in history.batches() if a in ("committed", "recommitted")]
    if committed:
        xs = [t - t0 for t, _ in committed]
        ax.step(xs, range(1, len(xs) + 1), where="post", color="#1f77b4", label="batches committed")
    ax.set_ylabel("batches committed")
    ax.set_title(f"nemesis {history.sink}, seed {history.seed}: faults (bands) and batches committed")
    for i, d in enumerate(history.drivers):
        start = (d.went or d.started) - t0
        end = (d.ended or history.finished or time.time()) - t0
        bars.barh(i, end - start, left=start, color="#2ca02c" if d.exit == 0 else "#7f7f7f", height=0.6)
        bars.text(start, i, f" {d.label} {d.host} exit {d.exit}", va="center", fontsize=7)
    bars.set_yticks([])
    bars.set_xlabel("seconds since the start")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.nemesis", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--sink", choices=sorted(TARGETS), default="postgres")
    ap.add_argument("--minutes", type=float, default=2.0, help="how long faults are injected (default 2)")
    ap.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: random, printed)")
    ap.add_argument("--faults", default=None,
                    help=f"comma list of {', '.join(ALL_FAULTS)} (default: all; the executor faults "
                         "with --cluster only)")
    ap.add_argument("--cluster", action="store_true",
                    help="drivers run their batches on a Spark standalone cluster across two worker hosts "
                         "(a shuffle, slow write tasks), so that executor faults can be played")
    ap.add_argument("--lease", type=float, default=6.0, help="the drivers' lease timeout, seconds")
    ap.add_argument("--out", default=None, help="folder for history.json, timeline.png, driver logs")
    ap.add_argument("--schedule", default=None,
                    help="comma list of faults played once each, in order, instead of drawing them for "
                         "--minutes (CI's schedules: SCHEDULES in tests/test_nemesis.py)")
    ap.add_argument("--package", default=None,
                    help="a folder holding another `twophase` package, put first on the drivers' path "
                         "(an older commit's, laid out as installed: to show what the nemesis finds there)")
    args = ap.parse_args(argv)
    from tests.services import hosts

    why = hosts.available()
    if why:
        print(f"nemesis: test hosts cannot be made here: {why}", file=sys.stderr)
        return 2
    known = ALL_FAULTS if args.cluster else FAULTS
    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip()) if args.faults else known
    schedule = [f.strip() for f in args.schedule.split(",") if f.strip()] if args.schedule else None
    unknown = [f for f in (*faults, *(schedule or ())) if f not in ALL_FAULTS]
    if unknown:
        print(f"nemesis: unknown fault(s) {unknown}; known: {', '.join(ALL_FAULTS)}", file=sys.stderr)
        return 2
    if not args.cluster and any(f in EXECUTOR_FAULTS for f in (*faults, *(schedule or ()))):
        print(f"nemesis: {', '.join(EXECUTOR_FAULTS)} need --cluster (executors on hosts of their own)",
              file=sys.stderr)
        return 2
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    out = Path(args.out or f"/tmp/twophase-nemesis-{seed}-{uuid.uuid4().hex[:6]}")
    if out.is_dir() and any(out.iterdir()):
        # An earlier run's files would mislead this one: its stop file ends the new drivers after
        # their first batch, its driver logs and marks mix with the new ones.
        print(f"nemesis: --out {out} is not empty (an earlier run's?); give a new or empty folder",
              file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    _log(f"seed {seed}; output in {out}")
    package = Path(args.package).resolve() if args.package else None
    if package is not None and not (package / "twophase" / "__init__.py").is_file():
        print(f"nemesis: --package {package} holds no twophase/__init__.py", file=sys.stderr)
        return 2
    n = Nemesis(args.sink, seed, args.minutes, out, lease=args.lease, faults=faults, package=package,
                cluster=args.cluster)
    n.schedule = schedule
    try:
        history = n.run()
        verdicts = check(history, n.target, progress_bound=args.lease * 4 + 60)
    finally:
        if hasattr(n, "target"):
            (out / "history.json").write_text(json.dumps(n.history.to_json(), indent=1, default=str))
    with contextlib.suppress(Exception):
        timeline(history, out / "timeline.png")
    print(table(verdicts, history))
    print(f"  history: {out / 'history.json'}; timeline: {out / 'timeline.png'}; driver logs in {out}")
    if all(v.ok for v in verdicts):
        n.target.cleanup()
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
