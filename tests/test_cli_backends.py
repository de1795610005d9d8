"""``twophase status / recover / abort-lingering`` from a sink config, without Spark, against the real
Kafka broker and PostgreSQL server: what an operator does after a driver died for good."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pytest

from tests.test_kafka_sink import _child_transaction, _topic, read_committed
from twophase import TransactionContext
from twophase.log import INTENT, PREPARED

REPO = Path(__file__).resolve().parents[1]


def write_log(log: Path, records: list[tuple[int, str, dict]]) -> None:
    """Write log records from a process that then exits, as a dead driver leaves them."""
    code = ("import json, sys; from twophase.log import TransactionLog\n"
            "t = TransactionLog(sys.argv[1]); t.acquire('query-x', 'q')\n"
            "for b, st, body in json.loads(sys.argv[2]): t.write(b, st, body)\n")
    subprocess.run([sys.executable, "-c", code, str(log), json.dumps(records)], check=True, cwd=REPO)


def cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env={**os.environ, **(env or {})}, timeout=300)


@pytest.mark.kafka
def test_kafka_recover_and_abort_lingering_from_config(kafka_service, tmp_path):
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    topic = _topic(bs, partitions=1)
    # Batch 0 decided: a pre-committed transaction whose producer process was SIGKILLed.
    decided_prefix = f"cli-{uuid.uuid4().hex[:8]}"
    sink = KafkaSink(bs, topic, decided_prefix)
    handle = _child_transaction(bs, topic, decided_prefix, n=40)
    log = tmp_path / "log"
    write_log(log, [(0, INTENT, {"intent": sink.plan_batch("q", 0, 1), "name": "q"}),
                    (0, PREPARED, {"handles": [sink.encode_handle(handle)], "rows": 40})])
    cfg = json.dumps(sink.to_config())
    st = cli("status", str(log), "--sink-config", cfg)
    assert st.returncode == 0, st.stderr
    assert "decided, NOT yet fully committed" in st.stdout and decided_prefix in st.stdout
    assert read_committed(bs, topic, idle=1.0) == []
    r = cli("recover", str(log), "--sink-config", cfg, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["committed_batches"] == [0]
    values = read_committed(bs, topic)
    assert Counter(values) == Counter(f"{decided_prefix}-{i}".encode() for i in range(40))
    r2 = cli("recover", str(log), "--sink-config", cfg, "--json")
    assert json.loads(r2.stdout)["committed_batches"] == []  # idempotent

    # Another query's batch 0 undecided, with an open leftover that holds back read_committed readers.
    other_prefix = f"cli-{uuid.uuid4().hex[:8]}"
    other = KafkaSink(bs, topic, other_prefix)
    # The log holds the crashed ballot's own INTENT (the one its task wrote under): that is what lets
    # abort-lingering abort the leftover (issue 59: a plan made afterwards could not say whose it is).
    _, intent = _child_transaction(bs, topic, other_prefix, n=25, with_intent=True)
    log2 = tmp_path / "log2"
    write_log(log2, [(0, INTENT, {"intent": intent, "name": "q"})])
    r = cli("abort-lingering", str(log2), "--sink-config", json.dumps(other.to_config()))
    assert r.returncode == 0, r.stderr
    assert "batch 0: 1" in r.stdout
    after = read_committed(bs, topic)
    assert Counter(after) == Counter(values)  # the leftover never becomes visible


@pytest.mark.postgres
def test_postgres_recover_and_abort_lingering_from_config(postgres_service, tmp_path):
    import psycopg2

    from twophase.sinks.postgres import PostgresSink

    db = psycopg2.connect(postgres_service["dsn"])
    db.autocommit = True
    name = f"cli_{uuid.uuid4().hex[:8]}"
    with db.cursor() as cur:
        cur.execute(f'CREATE TABLE "{name}" (id bigint primary key)')
    env = {"PGPASSWORD_TWOPHASE_TEST": postgres_service["password"]}
    os.environ.update(env)
    dsn = "host={host} port={port} dbname={dbname} user={user}".format(**postgres_service)
    sink = PostgresSink(dsn, name, password={"env": "PGPASSWORD_TWOPHASE_TEST"}, gid_prefix=f"c{name[-6:]}")
    sink.open()

    def prepare(batch, ids):
        intent = sink.plan_batch("q", batch, 1)
        txn = sink.begin_transaction(TransactionContext("q", batch, 0, 0, intent))
        sink.write(txn, pa.RecordBatch.from_pydict({"id": pa.array(ids, pa.int64())}))
        return intent, sink.pre_commit(txn)

    intent0, h0 = prepare(0, list(range(10)))
    intent1, _ = prepare(1, list(range(100, 105)))  # undecided leftover: a prepared transaction
    log = tmp_path / "log"
    write_log(log, [(0, INTENT, {"intent": intent0, "name": "q"}),
                    (0, PREPARED, {"handles": [sink.encode_handle(h0)], "rows": 10}),
                    (1, INTENT, {"intent": intent1, "name": "q"})])
    cfg = json.dumps(sink.to_config())
    # (The test password equals the user name, so look for how a password would appear.)
    assert "password=" not in cfg and json.loads(cfg)["password"] == {"env": "PGPASSWORD_TWOPHASE_TEST"}

    def prepared():
        with db.cursor() as cur:
            cur.execute("SELECT count(*) FROM pg_prepared_xacts WHERE gid LIKE %s", (sink.gid_prefix + ":%",))
            return cur.fetchone()[0]

    def ids():
        with db.cursor() as cur:
            cur.execute(f'SELECT id FROM "{name}" ORDER BY id')
            return [r[0] for r in cur.fetchall()]

    assert prepared() == 2 and ids() == []
    # Batch 0 is decided: abort-lingering refuses (it could abort a decided batch), touching nothing.
    r = cli("abort-lingering", str(log), "--sink-config", cfg, env=env)
    assert r.returncode == 2 and "twophase recover" in r.stderr
    assert prepared() == 2 and ids() == []
    r = cli("recover", str(log), "--sink-config", cfg, "--json", env=env)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["committed_batches"] == [0] and rep["aborted"] == {"1": 1}
    assert prepared() == 0 and ids() == list(range(10))
    assert "password=" not in r.stdout + r.stderr
    db.close()
