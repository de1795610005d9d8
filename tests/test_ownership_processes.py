"""Ownership with real processes (issue 25, "Done when: Real processes" and "late task attempts").

tests/test_ownership.py plays these scenarios with two coordinators in one process; here each
coordinator is a real driver process (tests/drivers/ownership_pipeline.py: Spark, a Coordinator,
a few batches of unique ids) on the real servers, and the faults are real ones:

- **a driver paused past its lease**: driver A stops itself (``SIGSTOP``, the pause point
  ``TWOPHASE_PAUSE_AT=before_prepared_logged:2``) with batch 2 pre-committed and undecided.
  Driver B, started under ``unshare --uts`` with a hostname of its own (another host as far as
  the lease can tell), waits out A's lease (its refused starts are reported in b.out), takes
  the log over, closes A's ballot, re-runs batch 2 and stops itself once it decided it (pause point
  ``after_prepared_logged:2``).  Then A is resumed, between B's decision and B's commits: its
  late decision finds its slot taken and A stops with a TwoPhaseError, having aborted only its
  own transactions; B is resumed and finishes the pipeline.
- **a decision held on the wire**: the log is on S3 (MinIO) and A reaches it through a TCP
  proxy (tests/netproxy.py) that holds A's PUT of batch 2's decision; A is stopped while it
  waits for the answer; B (direct to MinIO, another hostname) takes over as above, closes A's
  ballot, aborts its transactions, prepares its own and stops before its decision (pause point
  ``before_prepared_logged:2``); then the proxy delivers A's PUT, which arrives after B closed
  the ballot: MinIO refuses the exclusive create (412) and A stops with a TwoPhaseError.  B is
  resumed, decides and finishes.
- **a late task attempt of a killed driver**: each of A's writer tasks of batch 1 stops its
  Python worker just before the sink's ``begin_transaction`` (pause point ``before_begin:1``;
  A runs without pyspark's daemon, ``--no-python-daemon``, so that its workers are children of
  its JVM in its own process group).  Then A's driver and JVM are SIGKILLed, the stopped workers
  are not.  B (same host: A's pid is gone, so its lease is free at once) closes A's ballot of
  batch 1, re-runs the batch and stops once it decided it (``after_prepared_logged:1``).  Now
  the workers are resumed: late attempts of A's closed ballot, beginning after B's decision and
  before B's commits.  PostgreSQL: each prepares a transaction under the closed ballot's gid
  prefix; files (local and S3): each stages a file / opens an upload under the closed ballot's
  staging folder / token; Kafka: each reads the plan fence, finds a newer plan and claims no
  transactional id (the pool's producer ids and epochs are unchanged).  Each then fails on the
  dead JVM and its process ends.  Then B is resumed: it commits the batch and runs one more,
  whose cleanup must find what the late attempts left.

After each: every id exactly once in the target (Kafka: read_committed), B exited 0, no
DataLossError anywhere (A, in the first two, stops with a TwoPhaseError naming the closed
ballot, exit 3), A's ballot closed as aborted and B's decided in the log, and nothing is left:
no prepared transaction with the test's gid prefix, no staged file, no open multipart upload, no
open Kafka transaction (neither on the test topic's partitions, DescribeProducers, nor on the
test's transactional ids, DescribeTransactions).  Each sink is a parameter: PostgreSQL, Kafka
and FileSink, which writes local files in the first scenario, S3 (MinIO, direct) in the second,
and both in the third, so that open uploads are checked too.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from twophase import crash

pytestmark = [pytest.mark.chaos, pytest.mark.spark, pytest.mark.timeout(300)]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(REPO, "tests", "drivers", "ownership_pipeline.py")
#: A's lease: short, so that B's wait for it to expire costs seconds (A beats every LEASE / 4).
LEASE = 6.0
BATCHES, ROWS, PARTITIONS = 4, 40, 2
#: The batch whose decision A is kept from writing in time.
HELD = 2
B_HOST = "twophase-b"


# --------------------------------------------------------------------------------- processes
def _unshare_refusal() -> str | None:
    """Why ``unshare --uts`` cannot give a process a hostname of its own here (None: it can)."""
    try:
        r = subprocess.run(["unshare", "--uts", "sh", "-c", "hostname twophase-probe && hostname"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare --uts cannot run here: {e}"
    if r.returncode != 0 or r.stdout.strip() != "twophase-probe":
        return (f"the kernel refuses a UTS namespace (unshare --uts exit {r.returncode}: "
                f"{(r.stderr or r.stdout).strip()[:200]}); these tests need root or CAP_SYS_ADMIN")
    return None


class Driver:
    """One driver process (its own session: the JVM and Python workers die with it at teardown)."""

    def __init__(self, label: str, tmp: Path, args: list[str], env: dict[str, str], *,
                 hostname: str | None = None):
        self.label = label
        self.out, self.err = tmp / f"{label}.out", tmp / f"{label}.log"
        cmd = [sys.executable, DRIVER, *args]
        if hostname is not None:
            # Another host for the lease: a UTS namespace of its own, same boot and pid namespace.
            cmd = ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$0" "$@"', *cmd]
        full = dict(os.environ, **env)
        full["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
        full.setdefault("PYSPARK_PYTHON", sys.executable)
        full["TWOPHASE_SPARK_DRIVER_MEMORY"] = "512m"
        for k in (crash.ENV, crash.LOG_ENV, crash.PAUSE_ENV, crash.PAUSE_LOG_ENV):
            if k not in env:
                full.pop(k, None)
        with open(self.out, "wb") as o, open(self.err, "wb") as e:
            self.proc = subprocess.Popen(cmd, env=full, stdin=subprocess.DEVNULL, stdout=o, stderr=e,
                                         start_new_session=True, cwd=str(tmp))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def events(self) -> list[dict]:
        lines = self.out.read_text(errors="replace").splitlines()
        return [json.loads(line[len("OWNERSHIP "):]) for line in lines if line.startswith("OWNERSHIP ")]

    def tail(self, n: int = 40) -> str:
        text = self.err.read_text(errors="replace").splitlines()[-n:]
        return f"--- {self.label} ({self.err}) ---\n" + "\n".join(text) + "\n" + self.out.read_text(errors="replace")

    def state(self) -> str | None:
        """The kernel's state letter of the driver process (``T``: stopped), None once it exited."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        return stat.rsplit(")", 1)[1].split()[0]

    def wait_until(self, what: str, cond, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.label} exited ({self.proc.returncode}) before {what}\n{self.tail()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{self.label}: no {what} after {timeout:.0f}s\n{self.tail()}")
            time.sleep(0.1)

    def wait_stopped(self) -> None:
        self.wait_until("it stopped (SIGSTOP)", lambda: self.state() == "T")

    def finish(self, timeout: float = 240.0) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{self.label} still runs after {timeout:.0f}s\n{self.tail()}")

    def kill(self) -> None:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


@pytest.fixture
def drivers():
    started: list[Driver] = []
    yield started
    for d in started:
        d.kill()


def _state(pid: int) -> str | None:
    """The kernel's state letter of a process (``T`` stopped, ``Z`` exited, unreaped), None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.append(int(entry))
    return out


def _paused(log: Path, point: str, batch: int) -> list[int]:
    """Pids that stopped themselves at ``point`` of ``batch`` (the pause log) and are stopped now."""
    lines = log.read_text().splitlines() if log.exists() else []
    pids = [int(f[2]) for f in (line.split() for line in lines) if f[:2] == [point, str(batch)]]
    return [p for p in pids if _state(p) == "T"]


# ----------------------------------------------------------------------------------- targets
def _minio() -> dict:
    from tests.conftest import _service

    return _service("minio")


class PostgresTarget:
    """PostgresSink into a table of the test's own; leftovers: prepared transactions of its gid prefix."""

    marks = [pytest.mark.postgres]
    shape = "rows"
    #: What a late task attempt of a closed ballot leaves until a later batch's cleanup: a
    #: prepared transaction under the closed ballot's gid prefix.
    late_attempt_leaves = True

    def __init__(self, request, tmp_path: Path | None, info: dict | None = None, *, mode: str = "insert"):
        self.info = info if info is not None else request.getfixturevalue("postgres_service")
        self.table = f"ownp_{uuid.uuid4().hex[:8]}"
        self.gid_prefix = f"op{uuid.uuid4().hex[:6]}"
        #: insert, or upsert on ``id`` (a replayed row updates it: duplicates cannot show, but a
        #: late prepared transaction holding a row's lock stalls the next writer of that row).
        self.mode = mode
        key = "PRIMARY KEY" if mode == "upsert" else "NOT NULL"
        with self._conn() as c, c.cursor() as cur:
            cur.execute(f'CREATE TABLE "{self.table}" (id bigint {key}, v text)')

    @contextlib.contextmanager
    def _conn(self):
        import psycopg2

        c = psycopg2.connect(self.info["dsn"])
        c.autocommit = True
        try:
            yield c
        finally:
            c.close()

    def sink_config(self, address: tuple[str, int] | None = None) -> dict:
        """``address``: the server's (host, port) to connect to instead (a proxy in front of it)."""
        from twophase.sinks.postgres import PostgresSink

        i = self.info
        host, port = address if address is not None else (i["host"], i["port"])
        dsn = f"host={host} port={port} dbname={i['dbname']} user={i['user']}"
        keys = ["id"] if self.mode == "upsert" else None
        return PostgresSink(dsn, self.table, gid_prefix=self.gid_prefix, password={"env": "PGPASSWORD"},
                            lock_timeout="20s", mode=self.mode, key_columns=keys).to_config()

    def env(self) -> dict[str, str]:
        return {"PGPASSWORD": self.info["password"]}

    def ids(self) -> Counter:
        with self._conn() as c, c.cursor() as cur:
            cur.execute(f'SELECT id FROM "{self.table}"')
            return Counter(r[0] for r in cur.fetchall())

    def leftovers(self) -> list[str]:
        prefix = self.gid_prefix + ":"
        with self._conn() as c, c.cursor() as cur:
            cur.execute("SELECT gid FROM pg_prepared_xacts WHERE left(gid, length(%s)) = %s", (prefix, prefix))
            return [r[0] for r in cur.fetchall()]

    def cleanup(self) -> None:
        # A failed test may leave prepared transactions (a driver killed after its decision): they
        # hold locks on the table, and the DROP would wait for them for good.
        with self._conn() as c, c.cursor() as cur:
            for gid in self.leftovers():
                cur.execute("ROLLBACK PREPARED %s", (gid,))
            cur.execute("SET lock_timeout = '30s'")
            cur.execute(f'DROP TABLE IF EXISTS "{self.table}"')


class LocalFilesTarget:
    """FileSink (arrow writer) into a local folder; leftovers: any file staged under ``_twophase``."""

    marks: list = []
    shape = "rows"
    late_attempt_leaves = True  # a file staged in the closed ballot's staging folder

    def __init__(self, request, tmp_path: Path):
        self.out = tmp_path / "out"

    def sink_config(self) -> dict:
        from twophase.sinks.files import FileSink

        return FileSink(str(self.out), writer="arrow").to_config()

    def env(self) -> dict[str, str]:
        return {}

    def ids(self) -> Counter:
        import pyarrow.parquet as pq

        return Counter(i for p in sorted(self.out.glob("*.parquet"))
                       for i in pq.read_table(p).column("id").to_pylist())

    def leftovers(self) -> list[str]:
        staging = self.out / "_twophase"
        return [str(p) for p in staging.rglob("*") if p.is_file()] if staging.exists() else []

    def cleanup(self) -> None:
        pass


class S3FilesTarget:
    """FileSink on S3 (MinIO, reached directly); leftovers: open multipart uploads (pre-committed
    files) and any object under ``_twophase``."""

    marks = [pytest.mark.s3]
    shape = "rows"
    late_attempt_leaves = True  # an open multipart upload under the closed ballot's token

    def __init__(self, request, tmp_path: Path | None, info: dict | None = None):
        from tests.services.s3 import client

        self.info = info if info is not None else _minio()
        self.s3 = client(self.info)
        self.bucket = self.info["bucket"]
        self.prefix = f"twophase-test/own-{uuid.uuid4().hex[:10]}/out"

    def sink_config(self) -> dict:
        from twophase.sinks.files import FileSink

        return FileSink(f"s3://{self.bucket}/{self.prefix}", writer="arrow",
                        storage_options=_s3_options(self.info, self.info["endpoint_url"])).to_config()

    def env(self) -> dict[str, str]:
        return _s3_env(self.info)

    def _keys(self) -> list[str]:
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.prefix + "/")
        return [o["Key"] for page in pages for o in page.get("Contents", [])]

    def _uploads(self) -> list[tuple[str, str]]:
        # The bucket's whole listing, filtered here: MinIO matches the Prefix of ListMultipartUploads
        # only against whole keys.
        ups = self.s3.list_multipart_uploads(Bucket=self.bucket).get("Uploads", [])
        return [(u["Key"], u["UploadId"]) for u in ups if u["Key"].startswith(self.prefix + "/")]

    def ids(self) -> Counter:
        import pyarrow.parquet as pq

        out: Counter = Counter()
        for key in self._keys():
            rel = key[len(self.prefix) + 1:]
            if "/" not in rel and rel.endswith(".parquet"):
                data = self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read()
                out.update(pq.read_table(io.BytesIO(data)).column("id").to_pylist())
        return out

    def leftovers(self) -> list[str]:
        staged = [k for k in self._keys() if "/_twophase/" in k]
        return staged + [f"open upload {k}" for k, _ in self._uploads()]

    def cleanup(self) -> None:
        for key, upload in self._uploads():
            self.s3.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
        for key in self._keys():
            self.s3.delete_object(Bucket=self.bucket, Key=key)


class HdfsFilesTarget:
    """FileSink (arrow writer, WebHDFS) into a folder of the test's own on HDFS; leftovers: any
    file staged under ``_twophase``."""

    marks = [pytest.mark.hdfs]
    shape = "rows"
    late_attempt_leaves = True  # a file staged in the closed ballot's staging folder

    def __init__(self, request, tmp_path: Path | None, info: dict | None = None):
        from hdfs import InsecureClient

        self.info = info if info is not None else request.getfixturevalue("hdfs_service")
        self.client = InsecureClient(self.info["webhdfs_url"], user=self.info["user"])
        self.path = f"/twophase-test/own-{uuid.uuid4().hex[:10]}/out"

    def sink_config(self) -> dict:
        from twophase.sinks.files import FileSink

        opts = {"webhdfs_url": self.info["webhdfs_url"], "user": self.info["user"]}
        return FileSink(f"{self.info['namenode']}{self.path}", writer="arrow", storage_options=opts).to_config()

    def env(self) -> dict[str, str]:
        return {}

    def _files(self) -> list[str]:
        if self.client.status(self.path, strict=False) is None:
            return []
        return [f"{d}/{f}" for d, _, files in self.client.walk(self.path) for f in files]

    def ids(self) -> Counter:
        import pyarrow.parquet as pq

        out: Counter = Counter()
        for f in self._files():
            if f.rsplit("/", 1)[0] == self.path and f.endswith(".parquet"):
                with self.client.read(f) as r:
                    out.update(pq.read_table(io.BytesIO(r.read())).column("id").to_pylist())
        return out

    def leftovers(self) -> list[str]:
        return [f for f in self._files() if "/_twophase/" in f]

    def cleanup(self) -> None:
        self.client.delete(self.path.rsplit("/", 1)[0], recursive=True)


class KafkaTarget:
    """KafkaSink into a topic (two partitions) and a transactional id prefix of the test's own;
    ids read back read_committed; leftovers: open transactions, both as the test topic's
    partitions report them (DescribeProducers: producers with a transaction open there) and as
    the prefix's ids do (DescribeTransactions of the slot pool and the plan fence)."""

    marks = [pytest.mark.kafka]
    shape = "kafka"
    #: A late task attempt reads the plan fence, finds a newer plan and claims no id at all.
    late_attempt_leaves = False
    #: Partitions the drivers write with (their --partitions), and more: the pool ids looked at.
    POOL_PARTITIONS = 4

    def __init__(self, request, tmp_path: Path | None, info: dict | None = None):
        from tests.test_kafka_sink import _topic

        self.bootstrap = (info if info is not None else request.getfixturevalue("kafka_service"))["bootstrap_servers"]
        self.topic = _topic(self.bootstrap, partitions=2, name=f"ownk-{uuid.uuid4().hex[:10]}")
        self.prefix = f"ownk-{uuid.uuid4().hex[:8]}"
        self._client = None

    def sink_config(self) -> dict:
        from twophase.sinks.kafka import KafkaSink

        return KafkaSink(self.bootstrap, self.topic, self.prefix,
                         transaction_timeout_ms=300_000).to_config()

    def env(self) -> dict[str, str]:
        return {}

    def _txn_client(self):
        from twophase.sinks.kafka import protocol as kp

        if self._client is None:
            self._client = kp.TxnClient(kp.kafka_python_config({"bootstrap.servers": self.bootstrap}))
        return self._client

    def ids(self) -> Counter:
        """The ids a read_committed consumer sees (from the start, until 3 s pass without records)."""
        from confluent_kafka import Consumer, TopicPartition

        c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": f"ownk-{uuid.uuid4().hex}",
                      "isolation.level": "read_committed", "enable.auto.commit": False,
                      "auto.offset.reset": "earliest"})
        try:
            parts = c.list_topics(self.topic, timeout=30).topics[self.topic].partitions
            c.assign([TopicPartition(self.topic, p, 0) for p in parts])
            out: Counter = Counter()
            deadline, last = time.monotonic() + 30, None
            while time.monotonic() < deadline:
                msgs = c.consume(1000, 0.2)
                for m in msgs:
                    if m.error() is None:
                        out[int(m.value())] += 1
                if msgs:
                    last = time.monotonic()
                elif last is not None and time.monotonic() - last > 3:
                    break
            return out
        finally:
            c.close()

    def pool(self) -> list[str]:
        """The prefix's transactional ids: the slot pool of every partition looked at, the plan fence."""
        from twophase.sinks.kafka import DEFAULT_SLOTS_PER_PARTITION

        return [f"{self.prefix}-{p}.{s}" for p in range(self.POOL_PARTITIONS)
                for s in range(DEFAULT_SLOTS_PER_PARTITION)] + [f"{self.prefix}-plans"]

    def pool_epochs(self) -> dict[str, tuple[int, int, int]]:
        """Each pool id's (error code, producer id, epoch): an initialisation of an id changes it."""
        states = self._txn_client().describe_transactions(self.pool())
        return {t: (d.error_code, d.producer_id, d.producer_epoch) for t, d in sorted(states.items())}

    def leftovers(self) -> list[str]:
        """Open transactions (while one of the pool is still being completed, its markers being
        written, everything is asked again, for up to 10 s)."""
        from twophase.sinks.kafka import protocol as kp

        client = self._txn_client()
        deadline = time.monotonic() + 10
        while True:
            found, settling = [], False
            for tid, d in sorted(client.describe_transactions(self.pool()).items()):
                if d.error_code == kp.NONE and d.state in ("PrepareCommit", "PrepareAbort"):
                    settling = True
                elif d.error_code == kp.NONE and d.state == "Ongoing":
                    found.append(f"open transaction of {tid} (producer id {d.producer_id}, epoch "
                                 f"{d.producer_epoch})")
            producers = client.describe_producers([f"{self.topic}:{p}" for p in range(2)])
            for tp, entries in sorted(producers.items()):
                found += [f"{tp}: producer id {e.producer_id} has a transaction open from offset "
                          f"{e.txn_start_offset}" for e in entries if e.txn_start_offset >= 0]
            if not settling or time.monotonic() > deadline:
                return found
            time.sleep(0.5)

    def cleanup(self) -> None:
        from confluent_kafka.admin import AdminClient

        if self._client is not None:
            self._client.close()
        with contextlib.suppress(Exception):
            admin = AdminClient({"bootstrap.servers": self.bootstrap})
            admin.delete_topics([self.topic])[self.topic].result(30)


#: The sinks of each scenario: in CI the paused driver on PostgreSQL and local files, the decision
#: held on the wire on PostgreSQL.  Kafka's (both scenarios) and FileSink on S3's (the held decision)
#: are collected only with TWOPHASE_FULL_CHAOS=1, and CI's nemesis does not play these faults on them
#: either: it plays ``pause`` on MariaDB only and ``delay`` on PostgreSQL only (tests/test_nemesis.py,
#: CI_SINKS); ``python -m tests.nemesis --cluster --minutes N`` draws every kind on every sink.
_FULL = bool(os.environ.get("TWOPHASE_FULL_CHAOS"))
TARGETS_PAUSED = {"postgres": PostgresTarget, "files": LocalFilesTarget, **({"kafka": KafkaTarget} if _FULL else {})}
TARGETS_ON_THE_WIRE = {"postgres": PostgresTarget,
                       **({"files-s3": S3FilesTarget, "kafka": KafkaTarget} if _FULL else {})}


def _params(targets: dict) -> list:
    return [pytest.param(cls, marks=cls.marks, id=name) for name, cls in targets.items()]


@pytest.fixture
def target(request, tmp_path):
    t = request.param(request, tmp_path)
    yield t
    t.cleanup()


def _s3_env(info: dict) -> dict[str, str]:
    return {"TP_OWN_S3_KEY": info["key"], "TP_OWN_S3_SECRET": info["secret"]}


def _s3_options(info: dict, endpoint: str, **extra) -> dict:
    return dict({"key": {"env": "TP_OWN_S3_KEY"}, "secret": {"env": "TP_OWN_S3_SECRET"},
                 "endpoint_url": endpoint, "region_name": info["region"]}, **extra)


# ---------------------------------------------------------------------------------- checks
def _args(target, log: str, name: str, tmp: Path, label: str, *, log_options: dict | None = None,
          wait_for_lease: float = 0.0, batches: int = BATCHES, sink_config: dict | None = None) -> list[str]:
    config = sink_config if sink_config is not None else target.sink_config()
    args = ["--sink-config", json.dumps(config), "--log", log, "--name", name,
            "--lease-timeout", str(LEASE), "--batches", str(batches), "--rows", str(ROWS),
            "--partitions", str(PARTITIONS), "--shape", target.shape,
            "--ready-file", str(tmp / f"{label}.ready"), "--go-file", str(tmp / f"{label}.go")]
    if log_options is not None:
        args += ["--log-options", json.dumps(log_options)]
    if wait_for_lease:
        args += ["--wait-for-lease", str(wait_for_lease)]
    return args


def _go(tmp: Path, label: str) -> None:
    (tmp / f"{label}.go").touch()


def _ready(tmp: Path, label: str) -> bool:
    return (tmp / f"{label}.ready").exists()


def _check_outcome(a: Driver, b: Driver, a_code: int, b_code: int, target, log_view) -> None:
    b_events, a_events = b.events(), a.events()
    assert b_code == 0, b.tail()
    assert b_events[-1]["event"] == "done", b.tail()
    assert [e["batch"] for e in b_events if e["event"] == "batch"] == list(range(BATCHES))
    assert [e["action"] for e in b_events if e["event"] == "batch" and e["batch"] >= HELD] == \
        ["committed"] * (BATCHES - HELD)
    # A committed the batches before the held one, then stopped on the closed ballot.
    assert [e["batch"] for e in a_events if e["event"] == "batch"] == list(range(HELD)), a.tail()
    err = a_events[-1]
    assert err["event"] == "error" and not err["data_loss"], a.tail()
    assert err["type"] != "DataLossError", err  # exit 3 below: a TwoPhaseError, never data loss
    assert f"batch {HELD}: ballot 0 was closed by another coordinator" in err["message"], err
    assert a_code == 3, a.tail()
    assert "DataLossError" not in a.err.read_text(errors="replace") + b.err.read_text(errors="replace")
    # Every id once, nothing left behind.
    assert target.ids() == Counter(range(BATCHES * ROWS))
    assert target.leftovers() == []
    # The log: A's ballot of the held batch closed as aborted (by B), B's ballot decided.
    log_view.generation = 1
    ballots = log_view.view(HELD).ballots
    assert [(bl.ballot, bl.decision is not None and bl.decision.aborted) for bl in ballots] == \
        [(0, True), (1, False)]
    assert ballots[1].decision is not None and ballots[1].decision.body["epoch"] > ballots[0].intent.body["epoch"]
    assert "by coordinator epoch" in ballots[0].decision.body.get("reason", "")


# ----------------------------------------------------------------------------------- tests
def test_a_pause_point_stops_the_process_there_once_until_it_is_continued(tmp_path):
    """TWOPHASE_PAUSE_AT: the process stops itself at the named point of the named batch only,
    logs its pid, and goes on from the next line when continued (a second pass does not stop)."""
    script = ("from twophase import crash\n"
              "for b in (1, 2, 2): crash.crash_point('before_prepared_logged', b); print('after', b, flush=True)\n")
    log = tmp_path / "paused"
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, **{crash.PAUSE_ENV: "before_prepared_logged:2",
                                                    crash.PAUSE_LOG_ENV: str(log)}))
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "after 1\n"
        deadline = time.monotonic() + 60
        while not (log.exists() and log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        assert log.read_text() == f"before_prepared_logged 2 {proc.pid}\n"
        while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout.read() == "after 2\nafter 2\n"
        assert proc.wait(60) == 0
    finally:
        proc.kill()


def test_the_proxy_forwards_unchanged_and_holds_drops_and_cuts_connections():
    """tests/netproxy.py against an echo server: what it holds the server has not seen; a release
    delivers it unchanged, a drop loses it with the connection; cut_all and refuse_new close."""
    import socket
    import threading

    from tests.netproxy import Proxy

    seen: list[bytes] = []
    server = socket.create_server(("127.0.0.1", 0))

    def echo() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return

            def serve(conn=conn) -> None:
                with conn:
                    while data := conn.recv(4096):
                        seen.append(data)
                        conn.sendall(data)

            threading.Thread(target=serve, daemon=True).start()

    threading.Thread(target=echo, daemon=True).start()
    with server, Proxy("127.0.0.1", server.getsockname()[1]) as proxy:
        def connect() -> socket.socket:
            return socket.create_connection(("127.0.0.1", proxy.port), timeout=30)

        with connect() as c:
            c.sendall(b"plain")
            assert c.recv(100) == b"plain"
            hold = proxy.hold(rb"PUT /b/batch-2\.prepared")
            c.sendall(b"PUT /b/batch-2.prepared HTTP/1.1\r\n")
            assert hold.wait(30) and hold.first_line == b"PUT /b/batch-2.prepared HTTP/1.1"
            assert seen == [b"plain"]  # held: the server has not seen it
            hold.release()
            assert c.recv(100) == b"PUT /b/batch-2.prepared HTTP/1.1\r\n"
        with connect() as c:
            hold = proxy.hold(b"lost")
            c.sendall(b"lost request")
            assert hold.wait(30)
            hold.drop()
            assert c.recv(100) == b""  # the connection is cut, the bytes never arrive
        assert b"lost request" not in b"".join(seen)
        with connect() as c:
            c.sendall(b"x")
            assert c.recv(100) == b"x"
            assert proxy.cut_all() == 1
            assert c.recv(100) == b""
        # A hold for one client's address: another client's matching bytes pass; its own are held.
        hold = proxy.hold(b"mine", client="127.0.0.2")
        with connect() as c:
            c.sendall(b"mine, from 127.0.0.1")
            assert c.recv(100) == b"mine, from 127.0.0.1" and not hold.matched.is_set()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=30,
                                      source_address=("127.0.0.2", 0)) as c:
            c.sendall(b"mine, from 127.0.0.2")
            assert hold.wait(30)
            assert b"mine, from 127.0.0.2" not in b"".join(seen)
            hold.release()
            assert c.recv(100) == b"mine, from 127.0.0.2"
        proxy.refuse_new()
        with connect() as c:
            assert c.recv(100) == b""


@pytest.mark.parametrize("target", _params(TARGETS_PAUSED), indirect=True)
def test_a_driver_paused_past_its_lease_is_taken_over_from_another_hostname_and_its_late_decision_refused(
        target, drivers, tmp_path):
    refusal = _unshare_refusal()
    if refusal:
        pytest.skip(refusal)
    from twophase.log import TransactionLog

    log, name = str(tmp_path / "log"), f"ownp{uuid.uuid4().hex[:6]}"
    env = target.env()
    a = Driver("a", tmp_path, _args(target, log, name, tmp_path, "a"),
               dict(env, **{crash.PAUSE_ENV: f"before_prepared_logged:{HELD}"}))
    drivers.append(a)
    # B stops once it decided the batch, before it commits: A's late actions land there.
    b = Driver("b", tmp_path, _args(target, log, name, tmp_path, "b", wait_for_lease=180),
               dict(env, **{crash.PAUSE_ENV: f"after_prepared_logged:{HELD}"}), hostname=B_HOST)
    drivers.append(b)
    # Both JVMs start side by side; A runs once B is ready, so B asks for the log right after A stops.
    b.wait_until("Spark started", lambda: _ready(tmp_path, "b"))
    _go(tmp_path, "a")
    a.wait_stopped()  # batches 0 and 1 committed, batch 2's transactions pre-committed, undecided
    lease = TransactionLog(log, readonly=True).lease()
    assert lease is not None and lease.host != B_HOST and not lease.released
    _go(tmp_path, "b")
    b.wait_stopped()  # B waited out A's lease, took over, closed A's ballot and decided batch 2
    assert TransactionLog(log, readonly=True).lease().host == B_HOST, b.tail()
    assert a.state() == "T"
    os.kill(a.pid, signal.SIGCONT)  # A wakes up between B's decision and B's commits
    a_code = a.finish()
    os.kill(b.pid, signal.SIGCONT)
    b_code = b.finish()
    _check_outcome(a, b, a_code, b_code, target, TransactionLog(log, readonly=True))


@pytest.mark.s3  # the log is on S3 (MinIO) whatever the target
@pytest.mark.parametrize("target", _params(TARGETS_ON_THE_WIRE), indirect=True)
def test_a_decision_held_on_the_wire_past_a_takeover_from_another_hostname_is_refused(
        target, drivers, tmp_path, monkeypatch):
    refusal = _unshare_refusal()
    if refusal:
        pytest.skip(refusal)
    from tests.netproxy import Proxy
    from twophase.log import TransactionLog

    minio = _minio()
    for k, v in _s3_env(minio).items():  # the test's own reads of the log resolve the same references
        monkeypatch.setenv(k, v)
    bucket, root = minio["bucket"], f"twophase-test/own-{uuid.uuid4().hex[:10]}"
    log, name = f"s3://{bucket}/{root}/log", f"ownw{uuid.uuid4().hex[:6]}"
    env = dict(target.env(), **_s3_env(minio))
    direct = _s3_options(minio, minio["endpoint_url"])
    host, port = minio["endpoint_url"].split("://", 1)[1].split(":")
    with Proxy(host, int(port)) as proxy:
        # A reaches the log through the proxy; a long read timeout, so that botocore waits for the
        # held answer rather than sending its request again.
        via_proxy = _s3_options(minio, proxy.url(), config_kwargs={"read_timeout": 600})
        held = proxy.hold(rf"PUT /{bucket}/{root}/log/g0001/batch-{HELD:012d}\.prepared\.json ")
        a = Driver("a", tmp_path, _args(target, log, name, tmp_path, "a", log_options=via_proxy), env)
        drivers.append(a)
        # B stops after it closed A's ballot and aborted its transactions, before its own decision:
        # A's decision is delivered there.
        b = Driver("b", tmp_path, _args(target, log, name, tmp_path, "b", log_options=direct,
                                        wait_for_lease=180),
                   dict(env, **{crash.PAUSE_ENV: f"before_prepared_logged:{HELD}"}), hostname=B_HOST)
        drivers.append(b)
        b.wait_until("Spark started", lambda: _ready(tmp_path, "b"))
        _go(tmp_path, "a")
        a.wait_until("its decision of batch 2 was held by the proxy", held.matched.is_set)
        os.kill(a.pid, signal.SIGSTOP)  # A waits for the answer; stopped, it also stops beating its lease
        a.wait_stopped()
        _go(tmp_path, "b")
        b.wait_stopped()  # B took over, closed A's ballot, aborted A's transactions, prepared its own
        assert a.state() == "T"
        held.release()  # A's PUT of the decision arrives now: after B closed the ballot, before B decides
        os.kill(a.pid, signal.SIGCONT)
        a_code = a.finish()
        os.kill(b.pid, signal.SIGCONT)
        b_code = b.finish()
        try:
            _check_outcome(a, b, a_code, b_code, target, TransactionLog(log, storage_options=direct,
                                                                          readonly=True))
        finally:
            from tests.services.s3 import client

            s3 = client(minio)
            for o in s3.list_objects_v2(Bucket=bucket, Prefix=root + "/log/").get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=o["Key"])


@pytest.mark.postgres
def test_a_commit_held_on_the_wire_past_a_takeover_lands_late_and_harms_nothing(request, drivers, tmp_path):
    """The fault model's commit decision delayed on the network past its lease, on PostgreSQL:
    A decides a batch, and its ``COMMIT PREPARED`` is held in a proxy in front of the server
    while A stops (its lease lapses).  B, on another hostname, takes the log over, commits A's
    decided batch itself (recovery) and runs the rest.  Then the held ``COMMIT PREPARED``
    arrives, after B's, and A wakes: the server answers that the transaction does not exist,
    which the sink resolves by its marker row as committed before (A's decision is committed:
    A says so); A's next batch, B gone, finds it committed by B.  No data loss is reported, every id
    is in the table once, nothing is left prepared."""
    refusal = _unshare_refusal()
    if refusal:
        pytest.skip(refusal)
    from tests.netproxy import Proxy
    from twophase.log import TransactionLog

    target = PostgresTarget(request, tmp_path)
    try:
        log, name = str(tmp_path / "log"), f"ownc{uuid.uuid4().hex[:6]}"
        env = target.env()
        with Proxy(target.info["host"], int(target.info["port"])) as proxy:
            a_args = _args(target, log, name, tmp_path, "a", sink_config=target.sink_config((proxy.host, proxy.port)))
            a = Driver("a", tmp_path, a_args, dict(env, **{crash.PAUSE_ENV: f"after_prepared_logged:{HELD}"}))
            drivers.append(a)
            b = Driver("b", tmp_path, _args(target, log, name, tmp_path, "b", wait_for_lease=180), env,
                       hostname=B_HOST)
            drivers.append(b)
            b.wait_until("Spark started", lambda: _ready(tmp_path, "b"))
            _go(tmp_path, "a")
            a.wait_stopped()  # batches 0 and 1 committed; batch 2 decided, not committed
            held = proxy.hold(rb"COMMIT PREPARED")
            os.kill(a.pid, signal.SIGCONT)
            a.wait_until("its commit of batch 2 was held by the proxy", held.matched.is_set)
            os.kill(a.pid, signal.SIGSTOP)  # A waits for the answer, its lease's heartbeat stopped too
            _go(tmp_path, "b")
            b_code = b.finish()  # B waited out A's lease, committed batch 2 (A's decision), ran batch 3
            assert a.state() == "T"
            assert target.leftovers() == [], "B left A's decided transactions prepared"
            held.release()  # A's COMMIT PREPARED arrives now, after B's
            time.sleep(1.0)
            os.kill(a.pid, signal.SIGCONT)
            a_code = a.finish()
        b_events, a_events = b.events(), a.events()
        assert b_code == 0, b.tail()
        # B's recovery, when it took the log, committed A's decided batch; its query then skips it.
        assert f"batch {HELD} (generation 1) was decided but not fully committed: committing its " \
            f"{PARTITIONS} handles" in b.err.read_text(errors="replace"), b.tail()
        assert [(e["batch"], e["action"]) for e in b_events if e["event"] == "batch"] == \
            [(0, "skipped"), (1, "skipped"), (HELD, "skipped"), (3, "committed")], b.tail()
        # A's late commit found its transactions committed (by B): batch 2, its own decision, is
        # committed, which A reports.  A was fenced; its next batch write takes the log anew, since B
        # is done and released it (issue 45: a fenced Coordinator is not fenced for ever), and finds
        # batch 3 committed by B: skipped, nothing written twice.
        assert [(e["batch"], e["action"]) for e in a_events if e["event"] == "batch"] == \
            [(0, "committed"), (1, "committed"), (HELD, "committed"), (3, "skipped")], a.tail()
        assert not any(e["event"] == "error" for e in a_events), a.tail()
        assert a_code == 0, a.tail()
        assert "DataLossError" not in a.err.read_text(errors="replace") + b.err.read_text(errors="replace")
        assert target.ids() == Counter(range(BATCHES * ROWS))
        assert target.leftovers() == []
        view = TransactionLog(log, readonly=True)
        view.generation = 1
        assert view.view(HELD).committed is not None
    finally:
        target.cleanup()


#: The late task attempt's batch, and the batches of that test: one more after it, whose
#: cleanup must find what the late attempt left.
LATE, LATE_BATCHES = 1, 3
TARGETS_LATE = {"postgres": PostgresTarget, "files": LocalFilesTarget, "kafka": KafkaTarget,
                "files-s3": S3FilesTarget}


@pytest.mark.parametrize("target", _params(TARGETS_LATE), indirect=True)
def test_a_late_task_attempt_of_a_killed_driver_runs_after_the_takeover_and_harms_nothing(
        target, drivers, tmp_path):
    """A's writer tasks of batch LATE are stopped before they begin, A is killed, B takes the batch
    over and decides it; the stopped workers then begin their transactions under A's closed ballot
    (PostgreSQL, files: they prepare; Kafka: the plan fence refuses them) before B commits.  B
    commits the batch, and the batch after it cleans up what the late attempts left: every id
    once, no DataLossError, nothing left."""
    from twophase.log import TransactionLog

    log, name = str(tmp_path / "log"), f"ownl{uuid.uuid4().hex[:6]}"
    pauses = tmp_path / "pauses"
    env = target.env()
    # Each of A's writer tasks of batch LATE stops its Python worker before it begins its
    # transaction.  No pyspark daemon: its workers are in a process group of its own, which it
    # SIGHUPs once its JVM is gone (pyspark/daemon.py), and a stopped worker dies of that when
    # resumed; without it, each worker is a child of the JVM in A's own process group.
    a = Driver("a", tmp_path,
               _args(target, log, name, tmp_path, "a", batches=LATE_BATCHES) + ["--no-python-daemon"],
               dict(env, **{crash.PAUSE_ENV: f"before_begin:{LATE}", crash.PAUSE_LOG_ENV: str(pauses)}))
    drivers.append(a)
    # B (same host: A's pid, once gone, frees the lease at once) stops once it decided batch LATE.
    b = Driver("b", tmp_path,
               _args(target, log, name, tmp_path, "b", batches=LATE_BATCHES, wait_for_lease=120),
               dict(env, **{crash.PAUSE_ENV: f"after_prepared_logged:{LATE}"}))
    drivers.append(b)
    b.wait_until("Spark started", lambda: _ready(tmp_path, "b"))
    _go(tmp_path, "a")
    a.wait_until(f"its {PARTITIONS} writer tasks of batch {LATE} stopped before they began",
                 lambda: len(_paused(pauses, "before_begin", LATE)) == PARTITIONS)
    late = _paused(pauses, "before_begin", LATE)
    # A dies: its driver, its JVM and whatever else is in its process group, but not the stopped workers.
    for pid in _group(a.pid):
        if pid not in late:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    a.proc.wait(30)  # reaped: its pid names no process, so B's lease check finds A dead at once
    assert [_state(p) for p in late] == ["T"] * PARTITIONS, "the late attempts did not outlive their JVM"
    _go(tmp_path, "b")
    b.wait_stopped()  # B took over, closed A's ballot of batch LATE, ran its own and decided it
    decided = target.leftovers()  # B's decided, uncommitted transactions
    epochs = target.pool_epochs() if isinstance(target, KafkaTarget) else None
    for pid in late:  # the late attempts begin their transactions now, under A's closed ballot
        os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 120
    while any(_state(p) not in (None, "Z") for p in late):  # each fails once it meets the dead JVM
        assert time.monotonic() < deadline, f"late attempts still run: {[(p, _state(p)) for p in late]}"
        time.sleep(0.1)
    late_left = [x for x in target.leftovers() if x not in decided]
    if target.late_attempt_leaves:
        assert len(late_left) == PARTITIONS, (decided, late_left)  # they did begin, write and pre-commit
    else:
        assert late_left == [], late_left
    if epochs is not None:  # Kafka: the plan fence showed them a newer plan; they initialised no id
        assert target.pool_epochs() == epochs
    os.kill(b.pid, signal.SIGCONT)  # B commits batch LATE and goes on
    b_code = b.finish()
    # B finished the pipeline; every id once; nothing left: the batch after the late one cleaned up.
    b_events, a_events = b.events(), a.events()
    assert b_code == 0, b.tail()
    assert b_events[-1]["event"] == "done", b.tail()
    assert [e["batch"] for e in b_events if e["event"] == "batch"] == list(range(LATE_BATCHES))
    assert [e["action"] for e in b_events if e["event"] == "batch" and e["batch"] >= LATE] == \
        ["committed"] * (LATE_BATCHES - LATE), b.tail()
    assert [e["batch"] for e in a_events if e["event"] == "batch"] == list(range(LATE)), a.tail()
    assert "DataLossError" not in a.err.read_text(errors="replace") + b.err.read_text(errors="replace")
    assert target.ids() == Counter(range(LATE_BATCHES * ROWS))
    assert target.leftovers() == []
    log_view = TransactionLog(log, readonly=True)
    log_view.generation = 1
    ballots = log_view.view(LATE).ballots
    assert [(bl.ballot, bl.decision is not None and bl.decision.aborted) for bl in ballots] == \
        [(0, True), (1, False)]
