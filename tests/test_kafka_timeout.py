"""Issue 48: a Kafka driver down longer than the transaction timeout loses no decided batch, nor
does one whose first transaction a zombie's claim aborted before the commit.

The scenario of the issue, on the real broker: JSON files -> Spark -> Kafka (8 batches of 100 ids),
the driver killed at ``after_prepared_logged`` of batch 2 (decided, nothing committed), then down
until the broker's transaction timeout has aborted every transaction of that batch, then restarted.
Before, every restart stopped with ``DataLossError ... PRODUCER_FENCED ... it outlived
transaction.timeout.ms`` and 600 of 800 ids were never written.  Nothing of batch 2 was ever
visible (its first records are still in the topic, which is not compacted, and read as aborted):
its decision is recorded void and the batch runs again from Spark's replay, in both forms.  Then a
read_committed reader finds every id once, and no transaction of the query is left open.

The ``zombie`` case: while the driver is down (the default timeout, so nothing times out), another
actor's claim from a stale look (``InitProducerId`` on the transactional id) aborts the first
transaction of the decided batch.  Before, the restart committed the other one and stopped with
``DataLossError`` (half the batch visible).  Now the committer commits the first transaction
alone; found aborted and never visible (its abort marker, read uncommitted: the other transaction,
still open, holds the partitions' last stable offset back), it aborts the others, and the batch is
void and runs again.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_datasource import _inputs, _log_records, _path
from tests.test_kafka_sink import _topic, read_committed
from twophase import chaos, crash
from twophase.sinks.kafka import protocol as kp

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.chaos, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_MS = 20_000


def _handles(log_dir: Path, batch: int) -> list[dict]:
    """The decided handles of ``batch`` (its PREPARED records' envelopes' data)."""
    return [h["data"] for f in log_dir.rglob(f"batch-{batch:012d}.prepared*.json")
            for h in json.loads(f.read_text())["body"]["handles"]]


# The coordinator form of the timeout case is tests/test_kafka_sink.py's
# test_a_decided_batch_the_broker_timed_out_runs_again (in process, a third of the time): only the
# data source form, whose decided batch is replayed by Spark, runs through the driver here.
@pytest.mark.parametrize("fault", ["timeout", "zombie"])
def test_a_decided_batch_whose_transactions_the_broker_aborted_runs_again(kafka_service, tmp_path, fault):
    from twophase.sinks.kafka import KafkaSink

    bs = kafka_service["bootstrap_servers"]
    dst = _topic(bs, 2)
    expected = _inputs(tmp_path / "in", files=8, rows=100)
    ck = tmp_path / "ck"
    prefix = f"to-{uuid.uuid4().hex[:8]}"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(ck), "twophase-kafka",
           "--select", "id AS key", "--select", "id AS value",
           "--option", f"kafka.bootstrap.servers={bs}", "--option", f"topic={dst}",
           "--option", f"twophase.transactionalIdPrefix={prefix}"]
    if fault == "timeout":
        cmd += ["--option", f"twophase.transactionTimeoutMs={TIMEOUT_MS}"]
    env = {"PYTHONPATH": _path(REPO)}
    crash_log = tmp_path / "crash.log"
    with open(tmp_path / "driver.log", "ab") as log_file:
        code, _ = chaos.run_once(cmd, env=env, crash_at="after_prepared_logged:2", crash_log=str(crash_log),
                                 log_file=log_file, timeout=400)
        fired = crash_log.read_text().split() if crash_log.exists() else []
        # The point fires in the process that decides: the Python worker of Spark's commit step (the
        # query then fails, exit 1; a coordinator's driver would exit with crash.EXIT_CODE).
        assert fired[:2] == ["after_prepared_logged", "2"], (code, fired)
        assert code == 1 and code != crash.EXIT_CODE, (code, fired)
        handles = _handles(ck / "twophase", 2)
        assert handles and all(h.get("txn_start_offsets") for h in handles), handles
        # Down until the broker aborted every transaction of the decided batch (its timeout, plus
        # up to the broker's 10 s abort sweep), or the zombie's claim aborted the first one.
        sink = KafkaSink(bs, dst, prefix)
        try:
            client = sink._txn_client()
            if fault == "zombie":
                assert len(handles) == 2, handles
                deadline = time.time() + 30
                while client.init_producer_id(handles[0]["transactional_id"], 60_000)[0] != kp.NONE:
                    assert time.time() < deadline
                    time.sleep(0.2)
                second = handles[1]["transactional_id"]
                assert client.describe_transactions([second])[second].state == "Ongoing"
                handles = handles[:1]  # the one to see aborted before the restart
            tids = [h["transactional_id"] for h in handles]
            deadline = time.time() + TIMEOUT_MS / 1000 + 60
            while True:
                states = client.describe_transactions(tids)
                # CompleteAbort after a timeout; Empty after a claim's InitProducerId (its abort done).
                if all(states[t].state in ("CompleteAbort", "Empty") and states[t].producer_epoch > h["producer_epoch"]
                       for t, h in zip(tids, handles)):
                    break
                assert time.time() < deadline, {t: states[t].state for t in tids}
                time.sleep(1)
            before = _log_records(ck / "twophase")
            for _ in range(3):  # restarted: batch 2 is void and runs again; then the rest
                code, _ = chaos.run_once(cmd, env=env, log_file=log_file, timeout=400)
                if code == 0:
                    break
            tail = (tmp_path / "driver.log").read_text(errors="replace")[-4000:]
            assert code == 0, tail
            assert "DataLossError" not in tail and "DATA LOSS" not in tail, tail
            assert _log_records(ck / "twophase") > before
            verdict = chaos.verify(expected, [v.decode() for v in read_committed(bs, dst, timeout=60, idle=3)])
            assert verdict.exactly_once, verdict.to_dict()
            assert verdict.records_out == 800
            voids = [f.name for f in (ck / "twophase").rglob(f"batch-{2:012d}.void*.json")]
            assert voids, sorted(f.name for f in (ck / "twophase").rglob("batch-000000000002*"))
            states = client.describe_transactions(sink.pool_ids(2))
            assert [t for t, d in states.items() if d.state in ("Ongoing", "PrepareAbort", "PrepareCommit")] == []
        finally:
            sink.close()
