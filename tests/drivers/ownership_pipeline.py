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

``--master spark://...`` runs the batches on a standalone cluster instead of ``local[2]`` (the
nemesis's cluster across test hosts, tests/services/spark_hosts.py): the driver advertises
``--driver-host``, holds two executors of ``--executor-cores`` each (one per worker), and an
executor silent for ``--network-timeout`` seconds is lost and its tasks run again elsewhere.
``--shuffle`` puts a shuffle before the write (so that an executor lost during the write stage
takes map output with it: a fetch failure, and a stage retry whose new attempts overlap the old
attempt's tasks still running), ``--task-delay S`` makes every write task wait S seconds before
its first row (so that a fault finds it running; with ``--slow-file``, only the tasks of the
batches that start while that file exists), after creating a mark file
``<--mark-dir>/b<batch>-p<partition>-s<stage>-t<task id>-a<attempt>-<hostname>`` holding the
time it started; once the task passed its last row on, the time it ended is added as a second
line (an attempt that died or failed to fetch its input has none).  If ``--rival-file`` exists
when a slow task's wait is over and names the mark of a killed attempt of its batch, the task
waits on (up to ``--rival-wait`` seconds, ``_wait_for_rivals``): the nemesis's ``executor-kill``
makes the surviving task of the old stage attempt still run when the stage retry's attempt of
its partition begins, and both pass their rows on before the job ends.  Each batch
event then carries the Spark jobs' stage retries and failed tasks.

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
import re
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


def _wait_for_rivals(mark_dir: str, own: str, batch: int, partition: int, rival_file: str, wait: float) -> None:
    """``rival_file`` names the mark of a killed task attempt (``b<batch>-p<partition>-...``).  A
    task of that batch waits (up to ``wait`` seconds): of another partition, until another attempt
    of its own partition has left its mark; of the killed one's partition, until every other
    partition has two attempts that passed their rows on.  So the old stage attempt's task that
    survived runs on until the stage retry's attempt of its partition begins, and the job ends
    (Spark then kills the attempts still running) only after both passed their rows on."""
    try:
        with open(rival_file) as f:
            killed = re.fullmatch(r"b(\d+)-p(\d+)-.*", f.read().strip())
    except OSError:
        return
    if killed is None or int(killed[1]) != batch:
        return

    def ended(name: str) -> bool:
        try:
            with open(os.path.join(mark_dir, name)) as f:
                return len(f.read().split()) > 1
        except OSError:
            return False

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        others: dict[int, list[str]] = {}
        for n in os.listdir(mark_dir):
            m = re.fullmatch(r"b(\d+)-p(\d+)-.*", n)
            if m and int(m[1]) == batch and n != own:
                others.setdefault(int(m[2]), []).append(n)
        if partition != int(killed[2]):
            if others.get(partition):
                return
        elif [p for p in others if p != partition] and all(
                sum(map(ended, names)) >= 2 for p, names in others.items() if p != partition):
            return
        time.sleep(0.1)


def _slow(batch: int, delay: float, mark_dir: str | None, rival_file: str | None = None, rival_wait: float = 0.0):
    """A ``mapInArrow`` function: mark the task, wait ``delay`` seconds, pass the rows on.  If
    ``rival_file`` exists once the wait is over, wait on for a rival attempt (``_wait_for_rivals``)."""
    def slow(batches):
        import socket

        from pyspark import TaskContext

        mark = None
        if mark_dir:
            tc = TaskContext.get()
            mark = os.path.join(mark_dir, f"b{batch}-p{tc.partitionId()}-s{tc.stageId()}-t{tc.taskAttemptId()}-"
                                          f"a{tc.attemptNumber()}-{socket.gethostname()}")
            with open(mark, "w") as f:
                f.write(f"{time.time()}\n")
        time.sleep(delay)
        if mark_dir and mark and rival_file:
            _wait_for_rivals(mark_dir, os.path.basename(mark), batch, TaskContext.get().partitionId(), rival_file,
                             rival_wait)
        yield from batches
        if mark:
            # This attempt lived through its wait and passed every row of its input on (its
            # shuffle fetch did not fail): its end, the second line.
            with open(mark, "a") as f:
                f.write(f"{time.time()}\n")
    return slow


def _stage_stats(spark, group: str) -> dict[str, int]:
    """Stage retries and failed tasks of the jobs of job group ``group`` (Spark's status tracker)."""
    tracker = spark.sparkContext.statusTracker()
    retries = failed = 0
    for job in tracker.getJobIdsForGroup(group):
        info = tracker.getJobInfo(job)
        for stage in (info.stageIds if info else ()):
            st = tracker.getStageInfo(stage)
            if st is not None:
                retries += st.currentAttemptId
                failed += st.numFailedTasks
    return {"stage_retries": retries, "failed_tasks": failed}


def _cluster_conf(args) -> dict[str, str]:
    """A driver on a test host, its executors on the worker hosts (tests/services/spark_hosts.py)."""
    timeout = int(args.network_timeout)
    return {
        "spark.driver.host": args.driver_host, "spark.driver.bindAddress": args.driver_host,
        "spark.executor.cores": str(args.executor_cores), "spark.cores.max": str(2 * args.executor_cores),
        "spark.executor.memory": "512m",
        "spark.executor.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        # an executor silent this long is lost (heartbeats every second)
        "spark.network.timeout": f"{timeout}s", "spark.executor.heartbeatInterval": "1s",
        "spark.storage.blockManagerHeartbeatTimeoutMs": str(timeout * 1000),
        "spark.network.timeoutInterval": "1s",  # how often the driver looks for silent executors
        # the write tasks spread over both executors; the shuffle keeps its partitions
        "spark.locality.wait": "0", "spark.shuffle.reduceLocality.enabled": "false",
        "spark.sql.adaptive.coalescePartitions.enabled": "false",
        "spark.task.maxFailures": "8",
    }


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
    ap.add_argument("--master", default="local[2]", help="local[2] (default) or a standalone master's URL")
    ap.add_argument("--driver-host", default=None, help="the address the driver advertises (with --master spark://)")
    ap.add_argument("--executor-cores", type=int, default=2)
    ap.add_argument("--network-timeout", type=float, default=10.0)
    ap.add_argument("--executor-env", action="append", default=[], metavar="NAME",
                    help="give the executors this variable of the driver's environment (a sink's secret: "
                         "executors on other hosts do not inherit it)")
    ap.add_argument("--shuffle", action="store_true", help="a shuffle before the write")
    ap.add_argument("--task-delay", type=float, default=0.0, help="seconds each write task waits")
    ap.add_argument("--slow-file", default=None, help="--task-delay only for batches started while this file exists")
    ap.add_argument("--mark-dir", default=None, help="where write tasks leave a mark file as they start")
    ap.add_argument("--rival-file", default=None,
                    help="a file naming a killed task attempt's mark: the slow write tasks of its batch wait, "
                         "after their --task-delay, for a rival attempt (up to --rival-wait seconds)")
    ap.add_argument("--rival-wait", type=float, default=30.0)
    args = ap.parse_args(argv)
    if args.master.startswith("spark://") and not args.driver_host:
        ap.error("--master spark://... needs --driver-host (the address executors reach the driver at)")

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
    if args.master.startswith("spark://"):
        conf.update(_cluster_conf(args))
    for name in args.executor_env:
        conf[f"spark.executorEnv.{name}"] = os.environ[name]
    spark = local_session(args.master, app_name=f"twophase-{args.name}", conf=conf)
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
                           lease_timeout=args.lease_timeout, retry_backoff=0.1,
                           # Executor faults (pauses at before_begin: late task attempts, kills) are the
                           # point: "auto" stays on the task paths, never the driver path.
                           driver_batch_rows=0)

    c = coordinator()
    code = 0
    try:
        for n in range(args.batches):
            df = spark.range(n * args.rows, (n + 1) * args.rows, numPartitions=args.partitions)
            if args.shuffle:
                df = df.repartition(args.partitions)
            if args.task_delay and (args.slow_file is None or os.path.exists(args.slow_file)):
                df = df.mapInArrow(_slow(n, args.task_delay, args.mark_dir, args.rival_file, args.rival_wait),
                                   df.schema)
            df = df.selectExpr(*SHAPES[args.shape])
            group = f"twophase-batch-{n}"
            spark.sparkContext.setJobGroup(group, f"batch {n}")
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
            # task_input/collect_ms: the path that wrote the batch ("arrow"/"rows": tasks; "driver": no
            # task) and the driver's collect (0: none ran), for the nemesis's check that executor faults
            # hit writing tasks.
            _say("batch", batch=n, action=progress["action"], rows=progress["rows"],
                 task_input=progress.get("task_input", ""), collect_ms=progress.get("collect_ms", 0.0),
                 epoch=c.log.epoch if c.log is not None else None, **_stage_stats(spark, group))
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
