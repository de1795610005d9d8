"""End-to-end tests of the five classic exactly-once examples under examples/ (issue 9).

Each example's streaming driver is run as a real process by ``twophase.chaos.run_with_faults``:
once with a crash point between the commit decision and the commits, twice SIGKILLed (whole process
group) at random moments, then until it completes.  The output is then checked record by record
with ``twophase.chaos.verify`` (0 lost, 0 duplicated, 0 unexpected), using the example's own
``verify``/``check`` code, which the fast tests at the top prove can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from twophase import chaos

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
# Kills must land while input is left: each is timed from the run's first move of its Spark
# checkpoint (a batch planned or completed, not the JVM's start-up), and small batches
# (--max-offsets 60: 20+ batches) keep a run busy for longer than the window.
KILL_WINDOW = (1.0, 5.0)


def _env(pg: dict | None = None) -> dict[str, str]:
    env = {"PYTHONPATH": str(REPO), "TWOPHASE_SPARK_DRIVER_MEMORY": "512m"}
    if pg:
        env["PGPASSWORD"] = pg["password"]
    return env


def _dsn(pg: dict) -> str:
    return f"host={pg['host']} port={pg['port']} dbname={pg['dbname']} user={pg['user']}"


def _faults(cmd: list[str], tmp_path: Path, env: dict, *, seed: int, kills: int | None = None,
            crash_points: tuple[str, ...] = ("after_prepared_logged",)) -> list[chaos.Run]:
    """Run the example's driver under faults: ``crash_points``, then ``kills`` random SIGKILLs
    (default: one after a crash point, two without one, so that a fault surely hits a running
    driver; every sink's own kill test covers its crash points, an example needs few)."""
    from tests.cluster import checkpoint_batches

    if kills is None:
        kills = 1 if crash_points else 2
    checkpoint = cmd[cmd.index("--checkpoint") + 1]
    log_path = tmp_path / f"driver-{seed}.log"
    t0 = time.time()
    try:
        runs = chaos.run_with_faults(cmd, crash_points=list(crash_points), random_kills=kills,
                                     kill_window=KILL_WINDOW, seed=seed, env=env, log_path=str(log_path),
                                     timeout=300, progress_probe=lambda: checkpoint_batches(checkpoint))
    except BaseException:
        if log_path.exists():
            sys.stderr.write("".join(log_path.read_text(errors="replace").splitlines(True)[-80:]))
        raise
    print(f"{len(runs)} runs in {time.time() - t0:.0f}s: "
          f"{[(r.fault, r.exit_code, r.seconds, r.outcome, r.progress) for r in runs]}")
    assert [r.fault for r in runs[:len(crash_points)]] == [f"crash:{p}" for p in crash_points], runs
    assert sum(r.fault.startswith("sigkill") for r in runs) == kills, runs
    # Each crash point fired in the driver (the crash log names it, exit 137) and each SIGKILL
    # ended a run that still had batches to do (its checkpoint below the completing run's); no
    # run failed otherwise (a JVM that did not start, a lost connection); the last completed.
    chaos.check_runs(runs)
    return runs


def _topic(bootstrap: str, partitions: int = 2) -> str:
    from tests.test_kafka_sink import _topic as make

    return make(bootstrap, partitions, f"ex-{uuid.uuid4().hex[:10]}")


def _sql(pg: dict, q: str, params=()):
    import psycopg2

    c = psycopg2.connect(pg["dsn"])
    c.autocommit = True
    try:
        with c.cursor() as cur:
            cur.execute(q, params)
            return cur.fetchall() if cur.description else None
    finally:
        c.close()


def _no_prepared_left(pg: dict, name: str) -> None:
    left = _sql(pg, "SELECT gid FROM pg_prepared_xacts WHERE gid LIKE %s", (f"tp:{name}%",))
    assert left == [], left


# --------------------------------------------------------------------------- fast: the checks can fail

def test_wordcount_occurrence_check_detects_double_count_and_loss():
    from examples import wordcount_jdbc as wc

    exp = wc.expected_counts(wc.make_records(50))
    doubled = Counter(exp)
    k = next(iter(doubled))
    doubled[k] += 1
    v = chaos.verify(wc.occurrences(exp), wc.occurrences(doubled))
    # An occurrence counted twice shows up as an id the input never had.
    assert not v.exactly_once and (v.unexpected, v.lost) == (1, 0)
    short = Counter(exp)
    short[k] -= 1
    assert chaos.verify(wc.occurrences(exp), wc.occurrences(short)).lost == 1


def test_window_check_detects_a_window_emitted_twice_and_a_wrong_sum():
    from examples import windowed_kafka_to_kafka as win

    events = win.make_events(400)
    real = [e for e in events if e["id"] != win.FLUSH_ID]
    by_w: dict[int, list] = {}
    for e in real:
        by_w.setdefault(int(e["ts"] // 10 * 10), []).append(e)
    good = [{"window_start": w, "window_end": w + 10, "count": len(es), "sum": sum(e["value"] for e in es),
             "ids": [e["id"] for e in es]} for w, es in by_w.items()]
    assert win.check(events, good)["ok"]
    assert not win.check(events, good + good[:1])["ok"]
    wrong = [dict(good[0], sum=good[0]["sum"] + 1)] + good[1:]
    assert not win.check(events, wrong)["ok"]


def test_payments_check_detects_duplicate_payment_and_wrong_balance():
    from examples import payments_ledger as pay

    exp = pay.make_payments(100)
    rows = [(p["payment_id"], p["account"], p["amount_cents"]) for p in exp]
    assert pay.check(exp, rows)["ok"]
    res = pay.check(exp, rows + rows[:1])
    assert not res["ok"] and res["duplicated"] == 1 and res["wrong_balances"] == 1


def test_examples_have_help():
    for mod in ("wordcount_jdbc", "file_copy", "kafka_offsets_postgres", "windowed_kafka_to_kafka",
                "payments_ledger"):
        out = subprocess.run([PY, "-m", f"examples.{mod}", "--help"], cwd=REPO, capture_output=True, text=True,
                             env=dict(os.environ, **_env()), timeout=60)
        assert out.returncode == 0 and "exactly" in out.stdout.lower(), (mod, out.stderr)


# --------------------------------------------------------------------------- 1. Apex Kafka -> JDBC

@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_wordcount_jdbc_counts_equal_input_after_kills(tmp_path, kafka_service, postgres_service):
    from examples import wordcount_jdbc as wc

    bs, pg = kafka_service["bootstrap_servers"], postgres_service
    topic, table, name = _topic(bs), f"wc_{uuid.uuid4().hex[:8]}", f"wc-{uuid.uuid4().hex[:6]}"
    records = wc.make_records(1500)
    wc.produce(bs, topic, records)
    cmd = [PY, "-m", "examples.wordcount_jdbc", "run", "--bootstrap", bs, "--topic", topic, "--dsn", _dsn(pg),
           "--table", table, "--checkpoint", str(tmp_path / "ck"), "--name", name, "--max-offsets", "60"]
    _faults(cmd, tmp_path, _env(pg), seed=101)
    got = wc.table_counts(_dsn(pg) + f" password={pg['password']}", table)
    v = chaos.verify(wc.occurrences(wc.expected_counts(records)), wc.occurrences(got))
    print("word occurrences:", v.to_dict())
    assert v.exactly_once, v.to_dict()
    assert got == wc.expected_counts(records)
    _no_prepared_left(pg, name)


# --------------------------------------------------------------------------- 2. Apex file operators

@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.timeout(600)
def test_file_copy_every_line_once_across_kills_and_new_files(tmp_path):
    from examples import file_copy as fc

    inp, out, ck = tmp_path / "in", tmp_path / "out", tmp_path / "ck"
    # 16 small batches: the SIGKILL after the crash point's run lands while batches still flow
    # (5 batches were done 3 s after the first one, before the kill window's 4.1 s).
    ids = fc.generate(str(inp), files=16, lines=100)
    cmd = [PY, "-m", "examples.file_copy", "run", "--input", str(inp), "--output", str(out),
           "--checkpoint", str(ck)]
    _faults(cmd, tmp_path, _env(), seed=202)
    # Files appearing after a restart are picked up, and only they.
    ids += fc.generate(str(inp), files=2, lines=400, first_file=16)
    code, _ = chaos.run_once(cmd, env=_env(), timeout=300)
    assert code == 0
    v = chaos.verify(ids, fc.output_ids(str(out)))
    print("lines:", v.to_dict())
    assert v.exactly_once, v.to_dict()
    assert v.records_in == 2400


# --------------------------------------------------------------------------- 3. Spark direct stream

@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_offsets_with_results_and_restart_from_new_checkpoint(tmp_path, kafka_service, postgres_service):
    from confluent_kafka import Consumer, TopicPartition

    from examples import kafka_offsets_postgres as ko

    bs, pg = kafka_service["bootstrap_servers"], postgres_service
    dsn = _dsn(pg)
    topic, name = _topic(bs), f"ko-{uuid.uuid4().hex[:6]}"
    table, otable = f"ev_{uuid.uuid4().hex[:8]}", f"off_{uuid.uuid4().hex[:8]}"
    ko.produce(bs, topic, ko.make_records(0, 900))
    old_ck, new_ck = tmp_path / "ck-old", tmp_path / "ck-new"
    base = [PY, "-m", "examples.kafka_offsets_postgres", "run", "--bootstrap", bs, "--topic", topic, "--dsn", dsn,
            "--table", table, "--offsets-table", otable, "--name", name, "--max-offsets", "60"]
    _faults(base + ["--checkpoint", str(old_ck)], tmp_path, _env(pg), seed=303)

    # The committed position, three ways: the twophase log, the offsets table, the topic's end.
    cli = subprocess.run([PY, "-m", "twophase.cli", "offsets", str(old_ck / "twophase")], cwd=REPO,
                         capture_output=True, text=True, env=dict(os.environ, **_env(pg)), timeout=60)
    assert cli.returncode == 0, cli.stderr
    from_log = json.loads(cli.stdout)
    from_table = ko.offsets_from_table(dsn + f" password={pg['password']}", otable, topic)
    c = Consumer({"bootstrap.servers": bs, "group.id": f"t-{uuid.uuid4().hex}"})
    ends = {str(p): c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in (0, 1)}
    c.close()
    assert from_log == from_table == {topic: ends}, (from_log, from_table, ends)
    assert sum(ends.values()) == 900

    # A restart that ignores the committed position is refused, not double-counted.
    bad = subprocess.run(base + ["--checkpoint", str(tmp_path / "ck-bad"), "--starting-offsets", "earliest"],
                         cwd=REPO, capture_output=True, text=True, env=dict(os.environ, **_env(pg)), timeout=300)
    assert bad.returncode != 0 and "committed up to offset" in bad.stdout + bad.stderr
    assert len(ko.table_ids(dsn + f" password={pg['password']}", table)) == 900

    # "Code change": a NEW checkpoint, started exactly where the committed results end.
    ko.produce(bs, topic, ko.make_records(900, 600))
    _faults(base + ["--checkpoint", str(new_ck), "--starting-offsets", cli.stdout.strip()], tmp_path, _env(pg),
            seed=304, kills=0, crash_points=("mid_commit",))  # the first phase had the SIGKILL
    got = ko.table_ids(dsn + f" password={pg['password']}", table)
    v = chaos.verify(range(1500), got)
    print("events:", v.to_dict())
    assert v.exactly_once, v.to_dict()
    _no_prepared_left(pg, name)


@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.timeout(600)
def test_offsets_idempotent_variant_after_kills(tmp_path, kafka_service, postgres_service):
    from examples import kafka_offsets_postgres as ko

    bs, pg = kafka_service["bootstrap_servers"], postgres_service
    topic, table = _topic(bs), f"evi_{uuid.uuid4().hex[:8]}"
    ko.produce(bs, topic, ko.make_records(0, 1200))
    cmd = [PY, "-m", "examples.kafka_offsets_postgres", "run", "--variant", "idempotent", "--bootstrap", bs,
           "--topic", topic, "--dsn", _dsn(pg), "--table", table, "--checkpoint", str(tmp_path / "ck"),
           "--max-offsets", "60"]
    _faults(cmd, tmp_path, _env(pg), seed=305, crash_points=())
    v = chaos.verify(range(1200), ko.table_ids(_dsn(pg) + f" password={pg['password']}", table))
    print("events (idempotent):", v.to_dict())
    assert v.exactly_once, v.to_dict()


# --------------------------------------------------------------------------- 4. Flink Kafka -> window -> Kafka

@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_windowed_kafka_to_kafka_each_window_once(tmp_path, kafka_service):
    from examples import windowed_kafka_to_kafka as win

    bs = kafka_service["bootstrap_servers"]
    src, dst = _topic(bs, 1), _topic(bs, 2)
    events = win.make_events(1500)
    win.produce(bs, src, events)
    cmd = [PY, "-m", "examples.windowed_kafka_to_kafka", "run", "--bootstrap", bs, "--topic", src,
           "--output-topic", dst, "--checkpoint", str(tmp_path / "ck"), "--max-offsets", "60",
           "--name", f"win-{uuid.uuid4().hex[:6]}"]
    _faults(cmd, tmp_path, _env(), seed=404)
    res = win.check(events, win.results_from_topic(bs, dst))
    print("windows (kafka):", res)
    assert res["ok"], res
    assert res["windows"] == 8


@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.timeout(600)
def test_windowed_to_files_each_window_once(tmp_path, kafka_service):
    from examples import windowed_kafka_to_kafka as win

    bs = kafka_service["bootstrap_servers"]
    src = _topic(bs, 1)
    events = win.make_events(1000)
    win.produce(bs, src, events)
    out = tmp_path / "final"
    cmd = [PY, "-m", "examples.windowed_kafka_to_kafka", "run", "--bootstrap", bs, "--topic", src,
           "--sink", "files", "--output", str(out), "--checkpoint", str(tmp_path / "ck"), "--max-offsets", "60"]
    # mid_commit first fires when windows are emitted, at the end of the input (batch 17 of 18):
    # a SIGKILL after it finds no batch left to land in, so this test arms none (the windowed
    # query's SIGKILL while batches flow is the Kafka twin's above).
    _faults(cmd, tmp_path, _env(), seed=405, crash_points=("mid_commit",), kills=0)
    res = win.check(events, win.results_from_dir(str(out)))
    print("windows (files):", res)
    assert res["ok"], res


# --------------------------------------------------------------------------- 5. Hazelcast payments

@pytest.mark.chaos
@pytest.mark.spark
@pytest.mark.kafka
@pytest.mark.postgres
@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", ["exactly-once", "at-least-once"])
def test_payments_no_duplicate_after_failover(tmp_path, kafka_service, postgres_service, variant):
    from examples import payments_ledger as pay

    bs, pg = kafka_service["bootstrap_servers"], postgres_service
    topic, table, name = _topic(bs), f"ledger_{uuid.uuid4().hex[:8]}", f"pay-{uuid.uuid4().hex[:6]}"
    payments = pay.make_payments(1200)
    pay.produce(bs, topic, payments)
    cmd = [PY, "-m", "examples.payments_ledger", "run", "--variant", variant, "--bootstrap", bs, "--topic", topic,
           "--dsn", _dsn(pg), "--table", table, "--checkpoint", str(tmp_path / "ck"), "--name", name,
           "--max-offsets", "60"]
    _faults(cmd, tmp_path, _env(pg), seed=505,
            crash_points=("after_prepared_logged",) if variant == "exactly-once" else ())
    res = pay.check(payments, pay.ledger(_dsn(pg) + f" password={pg['password']}", table))
    print(f"payments ({variant}):", res)
    assert res["ok"], res
    if variant == "exactly-once":
        _no_prepared_left(pg, name)
        # Nothing in the table itself prevents a duplicate: the guarantee is the protocol's.
        assert _sql(pg, "SELECT count(*) FROM pg_indexes WHERE tablename = %s", (table,)) == [(0,)]
