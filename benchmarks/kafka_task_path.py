"""``python -m benchmarks.kafka_task_path``: KafkaSink's task path timed in one process, without Spark.

Per transaction: ``begin_transaction`` (the transactional-id claim), ``write`` of ``--rows``
rows (key and a 100-byte value, in Arrow batches of 10,000), ``pre_commit`` and the driver's
``commit``, on the project's Kafka broker (``python -m tests.services start kafka``).  Prints
the median of each phase in ms over ``--transactions`` transactions (the first two dropped) as
one JSON line.  To time another commit's sink, run this file from its checkout with
``PYTHONPATH`` at it (``cd CHECKOUT && PYTHONPATH=$PWD python /this/checkout/benchmarks/kafka_task_path.py``;
``python -m benchmarks.ab`` says how such a checkout is laid out).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

if not __package__:  # run as a file: its folder (benchmarks/, with a kafka.py) must not shadow kafka-python
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kafka_task_path", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", default=None, help="bootstrap servers (default: the test broker's)")
    ap.add_argument("--rows", type=int, default=100_000, help="rows per transaction (default 100000)")
    ap.add_argument("--transactions", type=int, default=12, help="transactions timed, 2 more first (default 12)")
    opts = ap.parse_args(argv)
    import pyarrow as pa

    from benchmarks.kafka import _create_topic
    from twophase.context import TransactionContext
    from twophase.sinks.kafka import KafkaSink

    if opts.bootstrap is None:
        from tests.services.kafka import BOOTSTRAP
        opts.bootstrap = BOOTSTRAP
    topic = f"bench-taskpath-{uuid.uuid4().hex[:8]}"
    _create_topic(opts.bootstrap, topic, 2)
    n = opts.rows
    table = pa.table({"key": pa.array([str(i) for i in range(n)]),
                      "value": pa.array([(b"%0100d" % i) for i in range(n)])})
    sink = KafkaSink(opts.bootstrap, topic=topic, transactional_id_prefix=f"bench-tp-{uuid.uuid4().hex[:6]}")
    sink.open()
    name = f"tp{uuid.uuid4().hex[:6]}"
    phases: dict[str, list[float]] = {"begin": [], "write": [], "pre_commit": [], "commit": [], "total": []}
    for b in range(opts.transactions + 2):
        intent = sink.plan_batch(name, b, 1)
        t0 = time.perf_counter()
        txn = sink.begin_transaction(TransactionContext(name, b, 0, 0, intent, run=f"r{b}"))
        t1 = time.perf_counter()
        for rb in table.to_batches(max_chunksize=10_000):
            sink.write(txn, rb)
        t2 = time.perf_counter()
        handle = sink.pre_commit(txn)
        t3 = time.perf_counter()
        result = sink.commit(sink.decode_handle(sink.encode_handle(handle)))
        t4 = time.perf_counter()
        if not result.done:
            raise SystemExit(f"transaction {b} did not commit: {result}")
        if b >= 2:
            for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                phases[k].append(v * 1000)
    print(json.dumps({k: round(statistics.median(v), 1) for k, v in phases.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
