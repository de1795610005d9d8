"""Kill tests: Kafka source -> Spark -> Coordinator(KafkaSink) -> Kafka, driver killed at every named
crash point and at random moments; a read_committed consumer then finds every input id exactly once."""

from __future__ import annotations

import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.test_kafka_sink import _topic, read_committed
from twophase import crash
from twophase.chaos import run_with_faults, verify

REPO = Path(__file__).resolve().parents[1]
N = 1500


@pytest.mark.kafka
@pytest.mark.spark
@pytest.mark.chaos
@pytest.mark.timeout(2400)
def test_driver_killed_at_every_crash_point_and_randomly(kafka_service, tmp_path):
    from confluent_kafka import Producer

    bs = kafka_service["bootstrap_servers"]
    src, dst = _topic(bs, 2), _topic(bs, 2)
    ids = [f"id-{i:06d}" for i in range(N)]
    p = Producer({"bootstrap.servers": bs, "linger.ms": 5})
    for i, v in enumerate(ids):
        p.produce(src, v.encode(), key=str(i).encode())
    assert p.flush(30) == 0
    cmd = [sys.executable, "-m", "tests.drivers.kafka_pipeline", bs, src, dst,
           str(tmp_path / "checkpoint"), f"chaos-{uuid.uuid4().hex[:8]}", "150"]  # 10 batches
    log_path = tmp_path / "driver.log"
    t0 = time.time()
    # Crash point i at batch i: every restart gets one batch further, so each point hits its own batch.
    points = [f"{p}:{i}" for i, p in enumerate(crash.POINTS)]
    runs = run_with_faults(cmd, crash_points=points, random_kills=2, kill_window=(12.0, 30.0),
                           seed=7, env={"PYTHONPATH": str(REPO)}, log_path=str(log_path), timeout=600)
    assert runs[-1].completed
    # Every crash point really fired: the driver died (137), or the executor's worker did (task fails: 1).
    for run, point in zip(runs, crash.POINTS):
        assert run.exit_code == (1 if point == "after_pre_commit" else crash.EXIT_CODE), [r.to_dict() for r in runs]
    out = [v.decode() for v in read_committed(bs, dst, timeout=60, idle=3)]
    verdict = verify(ids, out)
    print(f"{len(runs)} runs in {time.time() - t0:.0f}s; verdict {verdict.to_dict()}")
    assert verdict.exactly_once, (verdict.to_dict(), log_path.read_text()[-5000:])
