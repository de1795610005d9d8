"""How long a dead driver holds back ``read_committed`` readers (issue 48): the last-stable-offset lag.

A driver killed after its batch's decision leaves the batch's Kafka transactions open.  Every
``read_committed`` consumer of those partitions then stops at the transaction's first record (the
partition's last stable offset, LSO), also for records other producers write after it, until the
transactions end: committed by the restarted driver (or ``twophase recover``), or aborted by the
broker at the transaction timeout (since issue 48 that abort no longer loses the batch: it runs
again).  This measures that stall on the real broker, by scenario, against a baseline measured in
the same run:

- ``baseline``: the driver commits its batch (nothing held back);
- ``killed, no restart``: the driver is SIGKILLed after its decision and nobody restarts it: the
  readers wait for the broker's timeout (``--timeouts``, each a run) plus its abort sweep
  (``transaction.abort.timed.out.transaction.cleanup.interval.ms``, 10 s by default);
- ``killed, restart after R s``: ``twophase recover`` (what a restarted driver does first) runs R s
  after the kill (``--restart-after``).

How: one topic partition per run.  A *driver* process (this module, ``--driver``) opens one
``KafkaSink`` transaction, writes 100 records, pre-commits, logs the decision in a transaction log
and signals; the parent then SIGKILLs it.  Meanwhile an independent, non-transactional producer
(another pipeline sharing the topic) writes a stamped record every 100 ms, and a ``read_committed``
consumer reads them: the lag of a record is the time from its write to its read.  Reported per
scenario: the largest lag of the window and its ratio to the baseline's.

    python -m benchmarks.lso                       # timeouts 10 s and 30 s, restart after 5 s
    python -m benchmarks.lso --timeouts 10000 --restart-after 2,5 --out benchmarks/results/lso

Needs only Kafka (started if it is not running: ``python -m tests.services start kafka``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, progress, tmpdir, uid

TICK_S = 0.1  # the other producer's write interval


def _driver(bootstrap: str, topic: str, prefix: str, log_url: str, timeout_ms: int, ready: str) -> int:
    """The killed driver: one pre-committed transaction, decided in the log; then waits to be killed."""
    import pyarrow as pa

    from twophase.context import TransactionContext
    from twophase.log import INTENT, PREPARED, TransactionLog
    from twophase.sinks.kafka import KafkaSink

    sink = KafkaSink(bootstrap, topic, prefix, transaction_timeout_ms=timeout_ms, commit_margin_ms=0)
    sink.open()
    tlog = TransactionLog(log_url)
    tlog.acquire(f"bench-lso-{prefix}", "lso")
    intent = sink.plan_batch("lso", 0, 1)
    tlog.write(0, INTENT, {"intent": intent, "sink": sink.kind, "name": "lso", "num_partitions": 1})
    txn = sink.begin_transaction(TransactionContext("lso", 0, 0, 0, intent))
    sink.write(txn, pa.RecordBatch.from_pydict({"value": [f"batch-{i}".encode() for i in range(100)]}))
    handle = sink.encode_handle(sink.pre_commit(txn))
    tlog.write(0, PREPARED, {"handles": [handle], "rows": 100})
    Path(ready).write_text("decided")
    time.sleep(3600)  # SIGKILLed here, its transaction open
    return 0


class _Stamps:
    """The other pipeline: a stamped record every TICK_S; and a read_committed reader of them."""

    def __init__(self, bootstrap: str, topic: str):
        from confluent_kafka import Consumer, Producer

        self.bootstrap, self.topic = bootstrap, topic
        self.producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0})
        self.consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"lso-{uid()}",
                                  "isolation.level": "read_committed", "auto.offset.reset": "earliest",
                                  "enable.auto.commit": False, "fetch.wait.max.ms": 50})
        self.consumer.subscribe([topic])
        self.written: dict[int, float] = {}
        self.read: dict[int, float] = {}
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._write, daemon=True),
                        threading.Thread(target=self._read, daemon=True)]

    def _write(self) -> None:
        n = 0
        while not self.stop.is_set():
            self.written[n] = time.monotonic()
            self.producer.produce(self.topic, f"stamp-{n}".encode(), partition=0)
            self.producer.poll(0)
            n += 1
            time.sleep(TICK_S)
        self.producer.flush(10)

    def _read(self) -> None:
        while not self.stop.is_set():
            m = self.consumer.poll(0.05)
            if m is None or m.error() is not None:
                continue
            v = m.value() or b""
            if v.startswith(b"stamp-"):
                self.read.setdefault(int(v[6:]), time.monotonic())

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self, settle_s: float) -> float:
        """Stop writing, wait ``settle_s`` for the reader, and return the largest lag (s)."""
        time.sleep(settle_s)
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.consumer.close()
        unread = [n for n in self.written if n not in self.read]
        if unread:
            raise RuntimeError(f"{len(unread)} stamped records were never read (first {unread[:5]})")
        return max(self.read[n] - self.written[n] for n in self.written)


def _topic(bootstrap: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"bench-lso-{uid()}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, 1, 1)])[name].result(30)
    deadline = time.time() + 30
    while admin.list_topics(name, timeout=10).topics[name].partitions.get(0) is None:
        if time.time() > deadline:
            raise RuntimeError(f"topic {name} has no partition 0")
        time.sleep(0.2)
    return name


def scenario(bootstrap: str, *, timeout_ms: int, kill: bool, restart_after: float | None) -> dict[str, Any]:
    """One run; see the module docstring.  Returns the largest read_committed lag of the window."""
    from twophase.recovery import recover
    from twophase.sinks.kafka import KafkaSink

    topic, prefix, log_url = _topic(bootstrap), f"lso-{uid()}", tmpdir("lso-log")
    ready = os.path.join(tmpdir("lso-ready"), "ready")
    stamps = _Stamps(bootstrap, topic)
    stamps.start()
    time.sleep(1.0)  # the reader is at the end, reading stamps as they come
    proc = subprocess.Popen([sys.executable, "-m", "benchmarks.lso", "--driver", bootstrap, topic, prefix, log_url,
                             str(timeout_ms), ready], start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the driver exited {proc.returncode} before its decision")
            time.sleep(0.05)
        killed_at = time.monotonic()
        sink = KafkaSink(bootstrap, topic, prefix, transaction_timeout_ms=timeout_ms, commit_margin_ms=0)
        if kill:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if restart_after is not None:
                time.sleep(max(0.0, restart_after - (time.monotonic() - killed_at)))
                report = recover(log_url, sink, takeover=True)
                assert report.committed_batches == [0], report.to_dict()
                settle = 3.0
            else:
                settle = timeout_ms / 1000 + 15.0  # the timeout plus the broker's abort sweep (10 s)
        else:
            report = recover(log_url, sink, takeover=True)  # the driver's own commit, at once
            assert report.committed_batches == [0], report.to_dict()
            settle = 3.0
        lag = stamps.finish(settle)
        sink.close()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"timeout_ms": timeout_ms, "killed": kill, "restart_after_s": restart_after, "max_lag_s": round(lag, 2)}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--driver"]:
        return _driver(argv[1], argv[2], argv[3], argv[4], int(argv[5]), argv[6])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.lso", description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeouts", default="10000,30000", help="transaction timeouts (ms), comma list")
    ap.add_argument("--restart-after", default="5", help="seconds from the kill to the restart, comma list")
    ap.add_argument("--out", type=Path, default=RESULTS / "lso", help="folder for lso.json and lso.md")
    a = ap.parse_args(argv)
    from tests import services

    bootstrap = services.ensure("kafka")["kafka"]["bootstrap_servers"]
    timeouts = [int(t) for t in a.timeouts.split(",") if t]
    restarts = [float(r) for r in a.restart_after.split(",") if r]
    runs: list[dict[str, Any]] = []
    progress("lso: baseline (the driver commits)")
    runs.append(dict(scenario(bootstrap, timeout_ms=timeouts[0], kill=False, restart_after=None), scenario="baseline"))
    for r in restarts:
        progress(f"lso: killed after its decision, restarted after {r:g} s")
        runs.append(dict(scenario(bootstrap, timeout_ms=max(timeouts), kill=True, restart_after=r),
                         scenario=f"killed, restart after {r:g} s"))
    for t in timeouts:
        progress(f"lso: killed after its decision, no restart, timeout {t / 1000:g} s")
        runs.append(dict(scenario(bootstrap, timeout_ms=t, kill=True, restart_after=None),
                         scenario=f"killed, no restart, timeout {t / 1000:g} s"))
    base = max(runs[0]["max_lag_s"], TICK_S)
    for run in runs:
        run["x_baseline"] = round(run["max_lag_s"] / base, 1)
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "lso.json").write_text(json.dumps({"tick_s": TICK_S, "runs": runs}, indent=2) + "\n")
    lines = ["| scenario | transaction timeout | largest read_committed lag | x baseline |", "|---|---|---|---|"]
    lines += [f"| {r['scenario']} | {r['timeout_ms'] / 1000:g} s | {r['max_lag_s']:.2f} s | {r['x_baseline']:g} |"
              for r in runs]
    (a.out / "lso.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
