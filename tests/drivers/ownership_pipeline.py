"""Driver for the ownership tests with real processes (tests/test_ownership_processes.py).

Writes ``--batches`` deterministic batches through one ``Coordinator`` with
``Coordinator.write(df, batch_id=N)``: batch N is ids ``N*rows .. N*rows+rows-1`` of
``spark.range`` (unique across batches), in ``--partitions`` partitions, so that every process
that runs batch N writes the same rows.  A batch already committed in the log is skipped, so a
second driver on the same log carries the pipeline on from where the first one stopped.

The sink is ``--sink-config`` (``sink_from_config`` JSON; secrets as ``{"env": ...}``), the log
is ``--log`` with ``--log-options`` (storage options as JSON), and ``--lease-timeout`` is the
coordinator's.  ``--ready-file`` is created once Spark is up; ``--go-file`` makes the driver wait
for that file before its first batch (so a test can start a second driver's JVM early and let it
go at the moment of its choosing); ``--wait-for-lease S`` retries, for up to S seconds, a start
refused because a live coordinator holds the log's lease (the refusals are reported).
``--interval`` paces the batches it writes; ``--stop-file`` ends the pipeline early, after the
first batch this driver wrote once the file appeared (``done`` names that batch).  ``--shape`` picks the columns (``SHAPES``: ``rows`` for tables and files, ``kafka`` for a
KafkaSink).  Once Spark is up (after the ready file, before waiting for the go file) the driver
runs one small job whose Python workers import the sink's executor modules, so that the first
batch does not pay for starting them (pyspark's daemon reuses those workers).
``--no-python-daemon`` sets ``spark.python.use.daemon=false`` (and skips that warm-up, whose
workers would not be reused): each task's Python worker is then a child of the JVM in the
driver's own process group, instead of a fork of pyspark's daemon, which puts its workers in a
process group of its own and sends SIGHUP to that group once its JVM is gone (pyspark/daemon.py):
a worker stopped at a pause point dies of that when it is resumed.  A test that kills the
driver and its JVM and resumes a stopped worker as a late task attempt needs this.

Pause points (``TWOPHASE_PAUSE_AT``) and crash points (``TWOPHASE_CRASH_AT``) come from the
environment (twophase/crash.py).  What happened is printed on stdout as lines
``OWNERSHIP {json}``: ``{"event": "refused", ...}`` per refused start, ``{"event": "batch", ...}``
per batch, then ``{"event": "done"}`` or ``{"event": "error", "type": ..., "message": ...}``.
Exit codes: 0 every batch committed; 3 a TwoPhaseError (not DataLossError); 4 DataLossError;
1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

#: The columns each kind of sink is given (a ``selectExpr`` over ``spark.range``'s ``id``).
#: A KafkaSink takes Spark's Kafka sink's key/value columns (strings here); the test reads the
#: ids back from the topic, read_committed.
SHAPES: dict[str, list[str]] = {
    "rows": ["id", "concat('row-', CAST(id AS STRING)) AS v"],
    "kafka": ["CAST(id AS STRING) AS key", "CAST(id AS STRING) AS value"],
}


def _say(event: str, **fields) -> None:
    sys.stdout.write("OWNERSHIP " + json.dumps(dict(fields, event=event, at=time.time()), default=str) + "\n")
    sys.stdout.flush()


def _warm_up(spark, sink, partitions: int) -> None:
    """Start the Python workers and import the sink's executor modules in them (one small job)."""
    modules = [type(sink).__module__, *sink.executor_modules()]

    def imports(batches):
        import importlib

        for m in modules:
            importlib.import_module(m)
        yield from batches

    spark.range(0, partitions, numPartitions=partitions).mapInArrow(imports, "id long").collect()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sink-config", required=True, help="the sink as JSON (sink_from_config)")
    ap.add_argument("--log", required=True, help="the transaction log's URL")
    ap.add_argument("--log-options", default=None, help="storage options of the log URL as JSON")
    ap.add_argument("--name", required=True)
    ap.add_argument("--lease-timeout", type=float, default=120.0)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--partitions", type=int, default=2)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="rows")
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--go-file", default=None)
    ap.add_argument("--wait-for-lease", type=float, default=0.0)
    ap.add_argument("--no-python-daemon", action="store_true")
    ap.add_argument("--interval", type=float, default=0.0, help="seconds between batches")
    ap.add_argument("--stop-file", default=None,
                    help="end (done) after the batch during which this file appeared, before --batches")
    args = ap.parse_args(argv)

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for noisy in ("py4j", "py4j.clientserver", "py4j.java_gateway", "botocore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from twophase.config import sink_from_config
    from twophase.coordinator import Coordinator
    from twophase.errors import DataLossError, LogOwnershipError, TwoPhaseError
    from twophase.spark import local_session

    # Short-lived JVMs under load: C1 only and the serial GC start faster and use less CPU.
    conf = {"spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"}
    if args.no_python_daemon:
        conf["spark.python.use.daemon"] = "false"
    spark = local_session("local[2]", app_name=f"twophase-{args.name}", conf=conf)
    options = json.loads(args.log_options) if args.log_options else None
    if args.ready_file:
        open(args.ready_file, "w").close()
    if not args.no_python_daemon:
        _warm_up(spark, sink_from_config(json.loads(args.sink_config)), args.partitions)
    if args.go_file:
        while not os.path.exists(args.go_file):
            time.sleep(0.1)

    def coordinator() -> Coordinator:
        return Coordinator(sink_from_config(json.loads(args.sink_config)), log_location=args.log,
                           storage_options=options, name=args.name, parallelism=args.partitions,
                           lease_timeout=args.lease_timeout, retry_backoff=0.1)

    c = coordinator()
    code = 0
    try:
        for n in range(args.batches):
            df = spark.range(n * args.rows, (n + 1) * args.rows, numPartitions=args.partitions)
            df = df.selectExpr(*SHAPES[args.shape])
            deadline = time.monotonic() + args.wait_for_lease
            while True:
                try:
                    progress = c.write(df, batch_id=n)
                    break
                except LogOwnershipError as e:
                    # Only a refused start (a live holder's lease) is waited out; a coordinator that
                    # was fenced mid-run stops like any other failure.
                    if c.log is not None or "live coordinator" not in str(e) or time.monotonic() > deadline:
                        raise
                    _say("refused", batch=n, message=str(e))
                    c.close()
                    c = coordinator()
                    time.sleep(0.5)
            _say("batch", batch=n, action=progress["action"], rows=progress["rows"],
                 epoch=c.log.epoch if c.log is not None else None)
            if progress["action"] == "skipped":
                continue  # a batch an earlier driver committed: catch up at once
            if args.stop_file and os.path.exists(args.stop_file):
                break
            if args.interval:
                time.sleep(args.interval)
        _say("done", epoch=c.log.epoch if c.log is not None else None, last=n)
    except DataLossError as e:
        _say("error", type=type(e).__name__, message=str(e), data_loss=True)
        code = 4
    except TwoPhaseError as e:
        _say("error", type=type(e).__name__, message=str(e), data_loss=False)
        code = 3
    except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
        _say("error", type=type(e).__name__, message=str(e)[:2000], data_loss=False)
        code = 1
    finally:
        c.close()
        spark.stop()
    return code


if __name__ == "__main__":
    sys.exit(main())
