"""The twophase command: status, recover, abort-lingering, offsets (no Spark needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pyarrow as pa

from twophase import TransactionContext
from twophase.log import COMMITTED, INTENT, PREPARED, TransactionLog
from twophase.sinks.files import FileSink


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "twophase.cli", *args], capture_output=True, text=True)


def pending_log(tmp_path, log_dir=None):
    """A log as a crashed driver leaves it: batch 0 committed, 1 decided, 2 undecided with a leftover.
    ``log_dir``: where the log goes (default ``tmp_path / "log"``)."""
    out = tmp_path / "out"
    log_dir = log_dir or tmp_path / "log"
    sink = FileSink(str(out))
    tlog = TransactionLog(str(log_dir))
    tlog.acquire("query-1", "app")

    intents = {b: sink.plan_batch("app", b, 2) for b in (0, 1, 2)}  # one execution (ballot) each

    def prep(b, p):  # a task of batch b's execution: it stages where that INTENT says
        txn = sink.begin_transaction(TransactionContext("app", b, p, 0, intents[b]))
        sink.write(txn, pa.RecordBatch.from_pydict({"id": [b * 10 + p]}))
        return sink.encode_handle(sink.pre_commit(txn))

    for b in (0, 1, 2):
        tlog.write(b, INTENT, {"intent": intents[b], "name": "app"})
    h0 = [prep(0, 0)]
    tlog.write(0, PREPARED, {"handles": h0, "rows": 1, "source": {"sources": [{"events": {"0": 10}}]}})
    sink.commit(sink.decode_handle(h0[0]))
    tlog.write(0, COMMITTED, {})
    tlog.write(1, PREPARED, {"handles": [prep(1, 0), prep(1, 1)], "rows": 2,
                             "source": {"sources": [{"events": {"0": 20}}]}})
    prep(2, 0)  # pre-committed, never decided: a leftover
    # Simulate the dead owner: a lease from a pid that does not exist on this host.
    lease = tlog.store.read("lease.json")
    os.unlink(log_dir / "lease.json")
    body = json.loads(lease)["body"]
    body["pid"] = 2 ** 22 + 12345
    from twophase.log import encode_record

    tlog.store.create("lease.json", encode_record(body))
    return out, sink


def test_help_everywhere():
    for args in ([], ["status"], ["recover"], ["abort-lingering"], ["offsets"], ["demo"]):
        r = run_cli(*args, "--help")
        assert r.returncode == 0 and "usage: twophase" in r.stdout


def test_status_shows_states_handles_and_ages(tmp_path):
    pending_log(tmp_path)
    r = run_cli("status", str(tmp_path / "log"))
    assert r.returncode == 0, r.stderr
    lines = r.stdout
    assert "generation 1: query query-1" in lines
    assert "decided, NOT yet fully committed" in lines and "undecided" in lines
    js = json.loads(run_cli("status", str(tmp_path / "log"), "--json").stdout)
    states = {b["batch_id"]: b["state"] for b in js["batches"]}
    assert states == {0: "committed", 1: "prepared", 2: "intent"}
    b1 = next(b for b in js["batches"] if b["batch_id"] == 1)
    assert len(b1["pending_handles"]) == 2 and b1["decided_age_s"] >= 0


def test_recover_commits_decided_and_aborts_undecided(tmp_path):
    out, sink = pending_log(tmp_path)
    cfg = json.dumps(sink.to_config())
    # Batch 1 is decided: aborting leftovers before committing it could abort it. Refused, nothing done.
    r = run_cli("abort-lingering", str(tmp_path / "log"), "--sink-config", cfg)
    assert r.returncode == 2 and "batch 1 (generation 1)" in r.stderr and "twophase recover" in r.stderr
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("_"))
    assert visible == ["part-00000000-00000-app.parquet"]  # abort-lingering commits nothing
    assert len([p for p in (out / "_twophase").rglob("*") if p.is_file()]) == 3  # nor aborts anything
    r = run_cli("recover", str(tmp_path / "log"), "--sink-config", cfg, "--json")
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["committed_batches"] == [1] and rep["handles_committed"] == 2
    assert rep["aborted"] == {"2": 1}
    visible = sorted(p.name for p in out.iterdir() if not p.name.startswith("_"))
    assert visible == ["part-00000000-00000-app.parquet", "part-00000001-00000-app.parquet",
                       "part-00000001-00001-app.parquet"]
    # Idempotent: a second recover finds nothing pending.
    rep2 = json.loads(run_cli("recover", str(tmp_path / "log"), "--sink-config", cfg, "--json").stdout)
    assert rep2["committed_batches"] == [] and rep2["handles_committed"] == 0
    assert not [p for p in (out / "_twophase").rglob("*") if p.is_file()]


def test_offsets_is_refused_while_a_decided_batch_is_pending(tmp_path):
    """Issue 46: offsets printed the last COMMITTED batch's end (batch 0) while batch 1 was decided;
    a new query started there wrote batch 1's records again, and a later recover of the old log
    committed them too."""
    _, sink = pending_log(tmp_path)
    log = str(tmp_path / "log")
    r = run_cli("offsets", log)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert "batch 1 (generation 1) is decided but not yet committed" in r.stderr
    assert f"twophase recover {log} --sink-config CFG" in r.stderr
    r = run_cli("recover", log, "--sink-config", json.dumps(sink.to_config()))
    assert r.returncode == 0, r.stderr
    r = run_cli("offsets", log)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"events": {"0": 20}}  # where batch 1, now committed, ends
    assert "warning" not in r.stderr  # batch 2's leftover was aborted too


def test_offsets_warns_of_an_undecided_batch_and_prints_the_committed_end(tmp_path):
    _, sink = pending_log(tmp_path)
    log = str(tmp_path / "log")
    # Batch 1 committed and batch 2's leftover aborted by recover; then a new execution opens batch 3.
    assert run_cli("recover", log, "--sink-config", json.dumps(sink.to_config())).returncode == 0
    w = TransactionLog(log)
    w.acquire("query-1", "app", takeover=True)
    w.write(3, INTENT, {"intent": sink.plan_batch("app", 3, 1), "name": "app"})
    w.close()
    r = run_cli("offsets", log)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == {"events": {"0": 20}}
    assert "batch 3 (generation 1) is undecided" in r.stderr and "abort-lingering" in r.stderr


def test_recover_is_refused_while_a_live_coordinator_owns_the_log(tmp_path):
    out = tmp_path / "out"
    tlog = TransactionLog(str(tmp_path / "log"))
    holder = subprocess.Popen([sys.executable, "-c",
                               "import sys,time; from twophase.log import TransactionLog; "
                               f"TransactionLog({str(tmp_path / 'log')!r}).acquire('q', 'x'); "
                               "print('ok', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ok"
        r = run_cli("recover", str(tmp_path / "log"), "--sink-config",
                    json.dumps({"sink": "files", "url": str(out)}))
        assert r.returncode == 2 and "owned by a live coordinator" in r.stderr
    finally:
        holder.kill()
        holder.wait()
    del tlog


def test_errors_are_clear(tmp_path):
    r = run_cli("recover", str(tmp_path / "nolog"), "--sink-config", '{"sink": "files", "url": "/tmp/x"}')
    assert r.returncode == 2 and "no transaction log at" in r.stderr
    r = run_cli("recover", str(tmp_path / "nolog"), "--sink-config", '{"url": 1}')
    assert r.returncode == 2 and '"sink" field' in r.stderr
    r = run_cli("offsets", str(tmp_path / "nolog"))
    assert r.returncode == 2 and "no transaction log at" in r.stderr
    r = run_cli("status", str(tmp_path / "log"), "--storage-options", "{nope")
    assert r.returncode == 2 and "--storage-options is not JSON" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "nolog").exists() and not (tmp_path / "log").exists()
