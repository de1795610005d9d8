"""Driver jobs for tests/test_services_cluster.py, each run in its own process on the cluster.

``python -m tests.drivers.cluster_jobs JOB ARGS``, started with :func:`tests.cluster.start_driver`;
talks back in JSON lines (:func:`tests.cluster.emit`):

- ``where N SLEEP``: N tasks sleeping SLEEP s each; result: where each task ran.
- ``chaos MARKERS N SLEEP [again]``: the same, each task first writes ``MARKERS/p<i>-a<attempt>``
  (JSON: where it runs) so the test can kill an executor or worker mid-job; with ``again``, after
  the first job it waits for the test's go (:func:`tests.cluster.wait_for_go`), waits for two
  executors and runs a second job.
- ``ship ZIP N``: N tasks import twophase (expected to fail), then ``addPyFile(ZIP)`` and N tasks
  import twophase, twophase.sinks.kafka and twophase.coordinator from it.
- ``probe ZIP ROOT LOG``: a Coordinator with a local-path FileSink, refused twice (local paths
  on a cluster; then, with ``shared_storage=True``, executors that cannot import twophase),
  then ``addPyFile(ZIP)`` and the same batch written.
"""

from __future__ import annotations

import os
import sys
import time

from tests.cluster import cluster_session, emit, task_identity, wait_for_go


def _run(sc, n: int, sleep: float, markers: str | None = None) -> list[dict]:
    def task(i: int, rows):
        import json
        import os as _os
        import sys as _sys
        import time as _time

        from pyspark import TaskContext

        ctx = TaskContext.get()
        where = dict(task_identity(), partition=i, attempt=ctx.attemptNumber(),
                     python=_sys.executable)
        if markers:
            tmp = _os.path.join(markers, f".p{i}-a{ctx.attemptNumber()}.tmp")
            with open(tmp, "w") as f:
                json.dump(where, f)
            _os.replace(tmp, _os.path.join(markers, f"p{i}-a{ctx.attemptNumber()}"))
        _time.sleep(sleep)
        yield dict(where, rows=sum(1 for _ in rows))

    return sc.parallelize(range(n * 10), n).mapPartitionsWithIndex(task).collect()


def _wait_executors(sc, n: int, timeout: float = 60.0) -> None:
    """Driver side: wait until ``n`` executors (besides the driver) are registered."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        # getExecutorInfos lists the driver too
        if len(sc.statusTracker()._jtracker.getExecutorInfos()) - 1 >= n:
            return
        time.sleep(0.2)
    raise TimeoutError(f"fewer than {n} executors registered after {timeout:.0f}s")


def main(job: str, *args: str) -> None:
    t0 = time.time()
    spark = cluster_session(f"cluster-{job}")
    sc = spark.sparkContext
    emit("started", app_id=sc.applicationId, driver_pid=os.getpid(), session_s=time.time() - t0)
    if job == "where":
        n, sleep = int(args[0]), float(args[1])
        emit("result", tasks=_run(sc, n, sleep))
    elif job == "chaos":
        markers, n, sleep = args[0], int(args[1]), float(args[2])
        first = _run(sc, n, sleep, markers)
        if len(args) > 3 and args[3] == "again":
            emit("first", tasks=first)
            wait_for_go()
            _wait_executors(sc, 2)
            emit("result", tasks=first, second=_run(sc, n, sleep))
        else:
            emit("result", tasks=first)
    elif job == "ship":
        zip_path, n = args[0], int(args[1])

        def try_import(i: int, rows):
            import sys as _sys

            try:
                import twophase
            except ImportError as e:
                yield {"partition": i, "error": f"{type(e).__name__}: {e}",
                       "python": _sys.executable}
            else:
                yield {"partition": i, "file": twophase.__file__}

        before = sc.parallelize(range(n), n).mapPartitionsWithIndex(try_import).collect()
        sc.addPyFile(zip_path)

        def use(i: int, rows):
            import sys as _sys

            import twophase.coordinator  # binds `twophase` too
            import twophase.sinks.kafka

            yield dict(task_identity(), partition=i, python=_sys.executable,
                       files=[m.__file__ for m in
                              (twophase, twophase.sinks.kafka, twophase.coordinator)],
                       sink=twophase.sinks.kafka.KafkaSink.__name__)

        after = sc.parallelize(range(n), n).mapPartitionsWithIndex(use).collect()
        emit("result", before=before, after=after)
    elif job == "probe":
        zip_path, root, log = args[0], args[1], args[2]
        from twophase.coordinator import Coordinator
        from twophase.errors import ConfigurationError
        from twophase.sinks.files import FileSink

        df = spark.range(0, 100, numPartitions=2)
        refused = []
        for shared in (False, True):
            try:
                # The executors' import check is the point: tasks, never the driver path.
                Coordinator(FileSink(root), log_location=log, name="probe",
                            shared_storage=shared, driver_batch_rows=0).write(df, batch_id=0)
            except ConfigurationError as e:
                refused.append(str(e))
        sc.addPyFile(zip_path)
        with Coordinator(FileSink(root), log_location=log, name="probe", shared_storage=True,
                         driver_batch_rows=0) as c:  # written by the executors that import the zip
            progress = c.write(df, batch_id=0)
        emit("result", refused=refused, progress=progress)
    else:
        raise SystemExit(f"unknown job {job!r}")
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
