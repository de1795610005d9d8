"""Driver-side two-phase-commit coordinator hooked to Spark micro-batch completion.

The Spark glue around the protocol (``twophase/protocol.py``, which imports no Spark):
environment checks (speculation, checkpoint, Spark Connect), executor probes, how many
transactions a batch gets, running each partition's transaction on the executors (begin,
write Arrow batches, pre-commit, return the handle), Spark's source offsets, and a
replayed batch's state stores.  Spark writes ``commits/N`` only after a batch returns,
and replays N with the same rows after a crash anywhere before that.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any, Literal
from urllib.parse import urlsplit

from twophase import crash
from twophase.coordinator.task_input import (
    CONVERSION_FAILED,
    INPUTS,
    arrow_settings,
    record_batches,
    rows_schema,
)
from twophase.errors import ConfigurationError, LogOwnershipError, TwoPhaseError
from twophase.log import LogStore, TransactionLog, batch_query_id, open_store
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink
from twophase.spark import default_parallelism, is_connect  # noqa: F401 - is_connect: also imported from here

log = logging.getLogger("twophase.coordinator")

_RESULT_SCHEMA = "partition INT, attempt INT, rows LONG, handle STRING"
#: Coordinator names: they become part of directory names, gids and marker rows.
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# Physical operators that keep state across micro-batches (their state stores must commit each batch).
#: ``driver_batch_rows``' default, the driver path's bound in rows (docs/benchmarks.md, "Latency per
#: micro-batch": 10,000-row batches gain on it; 200,000 rows stay on tasks).  ``task_input="auto"``
#: takes the driver path after a batch of at most this many rows; ``driver_batch_rows=0`` keeps it
#: on the task paths.
DRIVER_BATCH_ROWS = 10000
#: How the driver path's log line and progress note begin for a batch over its bound, and for a
#: batch whose collect failed (spark.driver.maxResultSize, a type toArrow() refuses): both then take
#: the Arrow task path.
_OVER_BOUND = "more rows than driver_batch_rows ="
_COLLECT_FAILED = "the driver's collect failed"
#: After a failed collect, ``task_input="auto"`` keeps to the tasks for this many batches, then tries
#: the driver path again; each further failure in a row doubles the wait, up to
#: :data:`_COLLECT_RETRY_MAX`.  A failure that recurs (a type toArrow() refuses, rows past
#: maxResultSize) then costs one failed collect in 1,000 batches; one that does not (an executor lost
#: mid-collect, a fetch failure) no longer keeps a long-running query off the driver path for good.
_COLLECT_RETRY_FIRST = 10
_COLLECT_RETRY_MAX = 1000
_STATEFUL_MARKERS = ("StateStore", "WithState", "StreamingDeduplicate", "StreamingSymmetricHashJoin",
                     "StreamingGlobalLimit")


def _cancelled(e: BaseException) -> bool:
    """Whether a Spark action failed because its job was cancelled (a stopping query's, a cancelled
    job group's), not because of the batch."""
    text = str(e)
    return "SPARK_JOB_CANCELLED" in text or "cancelled because SparkContext was shut down" in text


_PY_ERROR_LINE = re.compile(r"^((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?)$")


def _python_worker_error(text: str) -> str | None:
    """The error a Python worker raised (its traceback's last line, ``RuntimeError: ...``) if a
    Python worker failed the job, else None: Spark's own first line says only "An exception was
    thrown from the Python worker"."""
    if "Traceback (most recent call last)" not in text:
        return None
    found = None
    for line in text.split("JVM stacktrace:", 1)[0].splitlines():
        m = _PY_ERROR_LINE.match(line.strip())
        if m:
            found = m.group(1)
    return found[:300] if found else None


def _job_failure(e: BaseException) -> str:
    """The cause of a failed Spark job in one line: py4j's first line only names the call
    (``An error occurred while calling ...collectAndServe``); the task's failure is below."""
    text = str(e)
    m = re.search(r"Cannot run program \"[^\"]*\"[^\n)]*", text)
    if m:
        return m.group(0).strip()
    python = _python_worker_error(text)
    if python:
        return python
    for line in text.splitlines():
        line = line.strip().lstrip(": ")
        if "Exception:" in line and "An error occurred while calling" not in line:
            return line[:300]
    return text.splitlines()[0][:300] if text else type(e).__name__


def _executor_python_hint(python: str | None, archives: str | None) -> str:
    """What to check when the executors could not start their Python ``python``."""
    if python and not os.path.isabs(python) and os.sep in python:
        shipped = f"spark.archives is {archives!r}" if archives else "spark.archives is not set"
        return (f"The executors' Python, spark.pyspark.python={python}, is a path in each executor's "
                f"working directory, where Spark unpacks spark.archives ({shipped}): ship the packed "
                "environment it names with the job (--archives env.tar.gz#env, a virtualenv packed by "
                "venv-pack or conda-pack).")
    return (f"The executors' Python is {python or 'python3'}: install it on every host, or ship a packed "
            "environment (--archives env.tar.gz#env with spark.pyspark.python=./env/bin/python).")


def _find_query(spark, query_id: str):
    """The running streaming query ``query_id``.  Inside ``foreachBatch`` the batch's DataFrame
    has a cloned session whose query manager does not list it; the session that started the
    query (the active one in this thread) does."""
    q = spark.streams.get(query_id)
    if q is None:
        from pyspark.sql import SparkSession

        active = SparkSession.getActiveSession()
        if active is not None and active is not spark:
            q = active.streams.get(query_id)
    return q


def _batch_partitions(df, slots: int) -> tuple[int, bool]:
    """(transactions to plan, whether to coalesce the batch to ``slots``) for a batch written with
    at most ``slots`` writer tasks.

    ``df.rdd`` counts a batch's partitions without a job, except under adaptive query execution,
    where it runs the plan's shuffle stages to settle the final plan (and the write then runs
    them again).  Such a plan is coalesced to the slots uncounted, unless it ends in the user's
    own coalesce or repartition to at most ``slots`` partitions: Spark's optimizer would merge
    a coalesce of ours into that one and could raise its count, so its count is planned.  Spark
    Connect has no RDDs: a batch is coalesced uncounted unless its plan ends in such a coalesce
    or repartition of the user's.
    """
    if is_connect(df.sparkSession):
        plan = getattr(df, "_plan", None)
        n = getattr(plan, "_num_partitions", getattr(plan, "num_partitions", None))
        if type(plan).__name__ in ("Repartition", "RepartitionByExpression") and isinstance(n, int) and n <= slots:
            return n, False
        return slots, True
    qe = None
    try:
        qe = df._jdf.queryExecution()
        adaptive = qe.executedPlan().getClass().getSimpleName() == "AdaptiveSparkPlanExec"
        root = qe.optimizedPlan() if adaptive else None
    except Exception:  # noqa: BLE001 - an unusual plan: count the RDD's partitions
        qe, adaptive, root = None, False, None
    if not adaptive:
        # The plan just made, executed into its RDD (no job): what df.rdd counts, without planning
        # the batch again and wrapping it for Python (8 ms of 20 per batch, measured on local[2]).
        n = qe.toRdd().getNumPartitions() if qe is not None else df.rdd.getNumPartitions()
        return (slots, True) if n > slots else (n, False)
    if root is not None and root.nodeName() in ("Repartition", "RepartitionByExpression"):
        n = int(root.numPartitions())
        if n <= slots:
            return n, False
    return slots, True


def _local_or_url(location: str) -> str:
    """Hadoop's qualified ``file:/x`` as a plain local path; other URLs unchanged."""
    if location.startswith("file:"):
        path = location[len("file:"):]
        return "/" + path.lstrip("/") if path.startswith("/") else path
    return location


def _location_key(location: str) -> tuple[str, str, str]:
    """(scheme, authority, path) to compare two spellings of one checkpoint location."""
    loc = _local_or_url(location)
    if "://" not in loc:
        return ("file", "", os.path.realpath(os.path.abspath(loc)))
    u = urlsplit(loc)
    scheme = "s3" if u.scheme in ("s3", "s3a", "s3n") else u.scheme
    return (scheme, u.netloc, u.path.rstrip("/") or "/")


def _same_location(given: str, resolved: str) -> bool:
    """Does ``given`` (as a user wrote it) name Spark's qualified ``resolved`` checkpoint root?

    A path without scheme or authority (``/chk``, ``hdfs:///chk``) is resolved by Spark against
    the default filesystem (HDFS on most clusters): then only the paths are compared.
    """
    g, r = _location_key(given), _location_key(resolved)
    if g == r:
        return True
    loc = _local_or_url(given)
    if "://" not in loc or not urlsplit(loc).netloc:
        return g[2] == r[2] or urlsplit(loc).path.rstrip("/") == r[2]
    return False


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000.0


class Coordinator:
    """Pass an instance to ``DataStreamWriter.foreachBatch``; or call :meth:`write` for a batch DataFrame.

    Runs on the driver.  ``log_location`` is the transaction log's URL: a local
    path, ``hdfs://`` (WebHDFS) or ``s3://`` with conditional writes (default
    ``<checkpoint_location>/twophase``).  Giving ``checkpoint_location``
    also records each batch's source offsets (Spark's ``offsets/N``) in its
    commit decision, for ``twophase offsets``, and clears the temp files a kill
    during the query's first batch leaves there (see
    :func:`twophase.spark.clear_interrupted_start`).

    ``parallelism`` bounds the writer tasks, and so the transactions, of a batch
    (Flink's sink parallelism): a batch with more Spark partitions is coalesced (no
    shuffle) to that many before the sink's tasks run, so a batch's cost does not grow
    with how its data happens to be partitioned.  Default: Spark's
    ``defaultParallelism`` (the cores the application has), capped by what the sink's
    target allows (:meth:`~twophase.TwoPhaseCommitSink.max_parallelism`).

    ``commit_parallelism`` handles are committed at once; a commit that fails is
    retried ``commit_retries`` times with exponential backoff from
    ``retry_backoff`` seconds.  A commit that can never succeed after the
    decision was logged raises :class:`~twophase.errors.DataLossError` (naming
    batch, handle, reason) unless ``ignore_failures_after_transaction_timeout``.

    ``name`` (letters, digits, ``_ . -``; 1-64) labels the pipeline in logs and in
    the target (staging directories, gids, marker rows); the coordinator adds the
    log's identity to it, so two pipelines with the same name never share anything.
    The log's lease is refreshed from a background thread while the coordinator
    lives; :meth:`close` (or ``with Coordinator(...)``) releases it, so that a driver
    restarted on another host need not wait ``lease_timeout``.

    On a cluster master (not ``local[...]``) the first batch first checks that the
    executors can import twophase (same version) and the sink's modules
    (:meth:`~twophase.TwoPhaseCommitSink.executor_modules`), and refuses a sink that
    writes to local paths unless ``shared_storage=True`` says every host mounts them.

    ``task_input`` is how the tasks hand rows to the sink, as the same Arrow record batches
    either way (:mod:`twophase.coordinator.task_input`): ``"arrow"`` (``mapInArrow``,
    columnar, the fast path for large batches), ``"rows"`` (the RDD API, rows turned into
    record batches in the task: a cheaper Spark job, for small batches) or ``"auto"``
    (default): rows when the previous batch this coordinator wrote had at most
    ``small_batch_rows`` rows, else Arrow. Spark Connect has no RDDs: always Arrow there.

    ``task_input="driver"`` runs no task at all: the batch's rows are collected to the driver as
    Arrow record batches (one JVM action, ``df.limit(bound + 1).toArrow()``) and the sink writes
    them there, in one transaction (partition 0, attempt 0, the ballot planned for one partition),
    which the driver pre-commits and decides like a task's.  The bound is ``driver_batch_rows``
    (default :data:`DRIVER_BATCH_ROWS`, 10,000 rows; None means the default), checked by that very
    collect: a batch with more rows takes the Arrow task path (the plan runs again; the log line
    and progress say so), as does a batch whose collect fails (after which ``"auto"`` keeps to the
    tasks for 10 batches, doubled at each failure in a row up to 1,000, then collects again;
    never after an ``OutOfMemoryError``).  ``"auto"`` takes the driver path when the previous
    batch this coordinator wrote had at most ``driver_batch_rows`` rows (so never for its first batch), the
    rows or Arrow path otherwise as above; ``driver_batch_rows=0`` keeps ``"auto"`` on the task
    paths (and sends ``"driver"`` to the Arrow tasks).  Never on the driver path: a streaming
    query with state (over Spark Connect every streaming query counts as one; see
    :meth:`_driver_rows`), and a sink that prepares whole batches with a Spark job of its own
    (``FileSink(writer="spark")``): they take the task paths.  See docs/usage.md.
    """

    def __init__(
        self,
        sink: TwoPhaseCommitSink[Any, Any],
        *,
        log_location: str | None = None,
        checkpoint_location: str | None = None,
        name: str = "twophase",
        storage_options: dict[str, Any] | None = None,
        parallelism: int | None = None,
        commit_parallelism: int = 8,
        commit_retries: int = 5,
        retry_backoff: float = 0.2,
        max_backoff: float = 10.0,
        ignore_failures_after_transaction_timeout: bool = False,
        retain_batches: int = 100,
        new_generation: bool = False,
        takeover: bool = False,
        lease_timeout: float = 120.0,
        shared_storage: bool = False,
        task_input: str = "auto",
        small_batch_rows: int = 2000,
        driver_batch_rows: int | None = DRIVER_BATCH_ROWS,
    ):
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConfigurationError(f"sink must be a twophase.TwoPhaseCommitSink, got {type(sink).__name__}")
        if log_location is None:
            if checkpoint_location is None:
                raise ConfigurationError("give log_location=... (or checkpoint_location=..., the log then "
                                         "lives in <checkpoint_location>/twophase)")
            log_location = checkpoint_location.rstrip("/") + "/twophase"
        if not isinstance(name, str) or not _NAME_OK.match(name):
            raise ConfigurationError(
                f"name must be 1-64 letters, digits, '_', '.' or '-', starting with a letter or digit "
                f"(it becomes part of directory names and transaction ids), got {name!r}")
        if commit_parallelism < 1 or commit_retries < 0:
            raise ConfigurationError("commit_parallelism must be >= 1 and commit_retries >= 0")
        if task_input not in INPUTS:
            raise ConfigurationError(f"task_input must be one of {', '.join(INPUTS)}, got {task_input!r}")
        if not isinstance(small_batch_rows, int) or small_batch_rows < 0:
            raise ConfigurationError(f"small_batch_rows must be an integer >= 0, got {small_batch_rows!r}")
        if driver_batch_rows is not None and (not isinstance(driver_batch_rows, int)
                                              or isinstance(driver_batch_rows, bool) or driver_batch_rows < 0):
            raise ConfigurationError(f"driver_batch_rows must be an integer >= 0 or None, got {driver_batch_rows!r}")
        if parallelism is not None and (not isinstance(parallelism, int) or parallelism < 1):
            raise ConfigurationError(f"parallelism must be a positive integer or None, got {parallelism!r}")
        self.sink = sink
        self.name = name
        self.log_location = log_location
        self.checkpoint_location = checkpoint_location
        self.storage_options = storage_options
        self.parallelism = parallelism
        self.commit_parallelism = commit_parallelism
        self.commit_retries = commit_retries
        self.retry_backoff = retry_backoff
        self.max_backoff = max_backoff
        self.ignore_failures_after_transaction_timeout = ignore_failures_after_transaction_timeout
        self.new_generation = new_generation
        self.takeover = takeover
        self.shared_storage = shared_storage
        self.task_input = task_input
        self.small_batch_rows = small_batch_rows
        # 0: "auto" keeps to the task paths; None: the default bound.
        self.driver_batch_rows = DRIVER_BATCH_ROWS if driver_batch_rows is None else driver_batch_rows
        self._batch_query: tuple[str, bool] = ("", False)  # (query id, streaming) of the batch being run
        self._input_note = ""          # why the batch left the driver path (its log line says it)
        self._collect_ms = 0.0         # the driver path's collect
        self._last_rows: int | None = None  # rows of the last batch this coordinator's tasks wrote
        self._rows_refused = False     # a row did not convert: the Arrow path from then on
        self._collect_failures = 0     # failed driver collects in a row (reset by one that succeeds)
        self._collect_wait = 0         # batches "auto" still keeps to the tasks after a failed collect
        self._unsafe_collect: str | None = None  # why "auto" must not collect here (_collect_unsafe)
        self._batch_input = ""         # the path the current batch's tasks took
        self._probed = False           # executors checked (cluster masters, first batch)
        self._job: tuple[Any, str] | None = None  # (SparkContext, job group) of the batch's job while it runs
        self._connect_said = False     # what Spark Connect cannot offer was logged
        self._parallelism_seen: int | None = None  # Spark Connect: the default parallelism, measured
        self._log_args: dict[str, Any] = dict(storage_options=storage_options,
                                              retain_batches=retain_batches, lease_timeout=lease_timeout)
        self.log: TransactionLog | None = None
        self._checkpoint_store: LogStore | Literal[False] | None = None  # False: its scheme has no store
        self._query_id: str | None = None
        self._run_id: str | None = None  # the streaming query's run (sql.streaming.runId) the log was taken in
        self._stateful: bool | None = None
        self._scoped_name = name       # the name sinks see: name + the log's identity (set at start)
        self._protocol: TwoPhaseProtocol | None = None  # the protocol's steps, on the log we hold
        self._slots_capped = False
        self.last_progress: dict[str, Any] | None = None
        self.recent_progress: list[dict[str, Any]] = []
        if checkpoint_location is not None:
            self._clear_interrupted_start(checkpoint_location, storage_options)

    @staticmethod
    def _clear_interrupted_start(checkpoint_location: str, storage_options: dict[str, Any] | None) -> None:
        """A driver killed while Spark wrote ``offsets/0`` must not leave a query Spark refuses to start.

        Here, not at the first batch: Spark checks the checkpoint in ``start()``'s query thread
        before any batch runs, so a query it refuses never calls the coordinator.
        """
        from twophase.spark import clear_interrupted_start

        try:
            clear_interrupted_start(checkpoint_location, storage_options)
        except Exception as e:  # noqa: BLE001 - Spark's own start-up check then reports the state
            log.warning("could not check %s for temp files of an interrupted first start: %s. If the "
                        "query then fails with STATE_STORE_CHECKPOINT_LOCATION_NOT_EMPTY and no batch "
                        "was ever planned, remove the .0.<uuid>.tmp files (and their .crc) from its "
                        "offsets/ and commits/, or call twophase.spark.clear_interrupted_start(%r), "
                        "and start again; a new checkpoint location would start a different query.",
                        checkpoint_location, e, checkpoint_location)

    # ------------------------------------------------------------- entry points
    def __call__(self, df, batch_id: int) -> None:
        """The ``foreachBatch`` function: make batch ``batch_id`` of ``df`` visible exactly once."""
        spark = df.sparkSession
        if is_connect(spark):
            # One foreachBatch worker per query: the id read at the first batch stays the query's.
            query_id = self._query_id or self._connect_query_id()
        else:
            query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
        if not query_id:
            raise ConfigurationError(
                "Coordinator was called outside a streaming foreachBatch (no sql.streaming.queryId); "
                "use Coordinator.write(df, batch_id=...) for batch DataFrames")
        self._run(df, int(batch_id), query_id, streaming=True)

    @property
    def sink_query_name(self) -> str:
        """The name the sink sees (``TransactionContext.query_name``, PostgreSQL's marker rows,
        Kafka's transactional ids ...): ``name`` plus the log's identity and generation, so two
        logs or two generations never share transaction names.  Known once the first batch ran."""
        return self._scoped_name

    def write(self, df, *, batch_id: int) -> dict[str, Any]:
        """Write a batch (non-streaming) DataFrame exactly once under ``batch_id``; returns its progress.

        Calling it again with the same ``batch_id`` (e.g. a re-run job) does not write twice.
        """
        self._run(df, int(batch_id), batch_query_id(self.name, self.sink.target()), streaming=False)
        assert self.last_progress is not None
        return self.last_progress

    # ------------------------------------------------------------------ set-up
    def _start(self, spark, query_id: str, streaming: bool) -> TransactionLog:
        run_id = None
        if streaming and not is_connect(spark):
            run_id = spark.sparkContext.getLocalProperty("sql.streaming.runId")
        if self.log is not None and self._query_id == query_id:
            if not self.log.fenced or (streaming and run_id == self._run_id):
                # Fenced in this very run of the streaming query: its batches fail (a newer driver
                # took over; this one stops).  Over Connect there is no run id: the same.
                return self.log
        # A fenced log is not kept by a new run of the query (restarted in this process) or a batch
        # write: this object takes the log again (refused, naming the owner, while a newer
        # coordinator holds it; a new epoch once that one is gone).
        self._check_spark(spark, query_id, streaming)
        self.sink.open()
        tlog = TransactionLog(self.log_location, **self._log_args)
        tlog.acquire(query_id, self.name, new_generation=self.new_generation, takeover=self.takeover,
                     target=self.sink.target())
        self.new_generation = False  # only the first acquire starts a generation
        if self._protocol is not None:
            self._protocol.settle()  # the old log's last COMMITTED record, before that log closes
        if self.log is not None:
            self.log.close()
        self.log, self._query_id, self._run_id = tlog, query_id, run_id
        self._scoped_name = f"{self.name}.{tlog.scope()}"
        # A new protocol instance starts dirty: recovery runs before its first batch.
        self._protocol = TwoPhaseProtocol(self.sink, tlog, name=self.name, query_name=self._scoped_name,
                                          committer=self._committer)
        # A streaming batch's COMMITTED record is written while Spark logs its commit and plans the
        # next batch (TwoPhaseProtocol.settle); a batch write's before write() returns.
        self._protocol.committed_in_background = streaming
        tlog.on_fenced(self._stop_job)
        tlog.start_heartbeat()
        return tlog

    def _stop_job(self) -> None:
        """Fenced (a newer coordinator took the log over): cancel the batch's Spark job this one
        waits on.  A deposed driver then fails its batch at once, as its ballot's slot would refuse
        its decision anyway, instead of lingering in a job whose executors a partition took away
        (the master may have dropped its application: the job would wait for resources for ever)."""
        job = self._job
        if job is None:
            return
        sc, group = job
        log.warning("%s: fenced by a newer coordinator of %s: cancelling this batch's Spark job (group %s)",
                    self.name, self.log_location, group)
        sc.cancelJobGroup(group)

    def close(self) -> None:
        """Release the transaction log (stop the lease heartbeat, mark the lease released).

        Call it after the query stopped (or use ``with Coordinator(...) as c``).  A coordinator
        that is used again after ``close()`` takes the log again at its next batch.
        """
        if self._protocol is not None:
            self._protocol.settle()
        if self.log is not None:
            self.log.close()
            self.log, self._query_id = None, None
        close = getattr(self.sink, "close", None)
        if callable(close):
            close()

    def __enter__(self) -> Coordinator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _committer(self) -> Committer:
        return Committer(self.sink, parallelism=self.commit_parallelism, retries=self.commit_retries,
                         backoff=self.retry_backoff, max_backoff=self.max_backoff,
                         ignore_lost=self.ignore_failures_after_transaction_timeout,
                         where=self.log_location, name=self.name)

    @staticmethod
    def _conf(spark, key: str, default: str) -> str:
        """A Spark setting, static ones included, in a classic or a Spark Connect session."""
        if is_connect(spark):
            value = spark.conf.get(key, None)
        else:
            value = spark.sparkContext.getConf().get(key, None)
        return default if value is None else str(value)

    def _connect_query_id(self) -> str:
        """Spark Connect gives ``foreachBatch`` no local properties, so no ``sql.streaming.queryId``:
        read the query's id where Spark keeps it for restarts, the checkpoint's ``metadata`` file
        (written when the query starts, before its first batch)."""
        if self.checkpoint_location is None:
            raise ConfigurationError(
                "over Spark Connect the coordinator cannot ask Spark which streaming query calls it (a "
                "Connect session has no SparkContext or local properties): pass "
                "Coordinator(checkpoint_location=...) with the query's own .option('checkpointLocation', "
                "...); the coordinator reads the query's id (and each batch's source offsets) from there. "
                "Nothing was written.")
        store = open_store(self.checkpoint_location, self.storage_options, exclusive=False)
        raw = store.read("metadata")
        try:
            query_id = json.loads(raw.decode("utf-8"))["id"] if raw is not None else None
        except (ValueError, KeyError, TypeError, UnicodeDecodeError):
            query_id = None
        if not query_id:
            raise ConfigurationError(
                f"{store.location('metadata')} does not hold a streaming query id: is "
                f"checkpoint_location={self.checkpoint_location!r} the query's .option('checkpointLocation', "
                "...)? Over Spark Connect the coordinator learns the query's id from there. Nothing was "
                "written.")
        return str(query_id)

    def _check_spark(self, spark, query_id: str, streaming: bool) -> None:
        connect = is_connect(spark)
        master = self._conf(spark, "spark.master", "local")
        if not master.startswith("local"):
            paths = self.sink.local_paths()
            if paths and not self.shared_storage:
                raise ConfigurationError(
                    f"{type(self.sink).__name__} writes to local paths ({', '.join(paths)}) but the master is "
                    f"{master}: each executor would write to its own host's disk and the driver could not "
                    "commit what it cannot see. Use shared storage (hdfs://, s3://) or, if that path is a "
                    "mount every host shares (NFS), pass Coordinator(..., shared_storage=True).")
            if not self._probed:
                self._probe_executors(spark)
                self._probed = True
        if self._conf(spark, "spark.speculation", "false").lower() == "true" and not self.sink.supports_speculation:
            raise ConfigurationError(
                f"spark.speculation=true would let two attempts of one task pre-commit, and "
                f"{type(self.sink).__name__} cannot isolate attempts. Set spark.speculation=false.")
        if not streaming:
            return
        if connect:
            if not self._connect_said:
                log.warning("%s: over Spark Connect the coordinator cannot inspect the streaming query (no JVM "
                            "access): it does not check that asyncProgressTrackingEnabled is off or that "
                            "checkpoint_location is the query's own (both must hold), waits for no task of "
                            "a failed batch (the replay aborts their leftovers first), and recomputes a "
                            "replayed decided batch with the noop writer in case the query is stateful",
                            self.name)
                self._connect_said = True
            return
        jq = None
        try:
            q = _find_query(spark, query_id)
            jq = q._jsq.streamingQuery() if q is not None else None
        except Exception:  # pragma: no cover - Spark Connect or internals changed
            log.debug("could not inspect the streaming query %s", query_id, exc_info=True)
        if jq is not None:
            self._check_checkpoint(jq)
            cls = jq.getClass().getSimpleName()
            if "AsyncProgress" in cls:
                raise ConfigurationError(
                    "async progress tracking (asyncProgressTrackingEnabled) lets Spark run batch N+1 "
                    "before batch N's commit is recorded, which breaks the replay contract. Turn it off.")
            if "RealTime" in cls or "Continuous" in cls:
                raise ConfigurationError(f"{cls} does not run foreachBatch micro-batches; use a "
                                         "micro-batch trigger")

    def _check_checkpoint(self, jq) -> None:
        """The query's own checkpoint: adopt it when none was given (so offsets are recorded),
        refuse a ``checkpoint_location`` that names another one (offsets would silently be missing)."""
        try:
            root = str(jq.resolvedCheckpointRoot())
        except Exception:  # noqa: BLE001 - internals changed: keep what the user gave
            log.debug("could not read the query's checkpoint location", exc_info=True)
            return
        if self.checkpoint_location is None:
            self.checkpoint_location = _local_or_url(root)
            log.info("%s: the query's checkpoint is %s: source offsets are recorded from there",
                     self.name, self.checkpoint_location)
        elif not _same_location(self.checkpoint_location, root):
            raise ConfigurationError(
                f"Coordinator(checkpoint_location={self.checkpoint_location!r}) is not the query's checkpoint "
                f"({root}): the source offsets of each batch would not be recorded. Give the coordinator the "
                "same location as .option('checkpointLocation', ...), or give it only log_location=... (it "
                "then finds the query's checkpoint itself).")

    def _probe_executors(self, spark) -> None:
        """Before the first batch on a cluster: can the executors import what the sink needs?

        A missing package would otherwise fail every task of the first batch with an
        ImportError buried in a Python worker's traceback, after the INTENT was logged.
        """
        import twophase

        modules = ["twophase", *self.sink.executor_modules()]
        n = self._default_parallelism(spark)

        def probe(batches):
            import importlib
            import socket

            import pyarrow as pa

            for _ in batches:
                pass
            out: dict[str, list[str]] = {"host": [], "module": [], "version": [], "error": []}
            for m in modules:
                try:
                    mod = importlib.import_module(m)
                    row = (socket.gethostname(), m, str(getattr(mod, "__version__", "")), "")
                except Exception as e:  # noqa: BLE001 - reported to the driver
                    row = (socket.gethostname(), m, "", f"{type(e).__name__}: {e}")
                for k, v in zip(out, row, strict=True):
                    out[k].append(v)
            yield pa.RecordBatch.from_pydict(out)

        try:
            # mapInArrow rather than an RDD job: the same probe runs over Spark Connect.
            found = [tuple(r) for r in spark.range(0, n, 1, n).mapInArrow(
                probe, "host STRING, module STRING, version STRING, error STRING").collect()]
        except Exception as e:  # noqa: BLE001 - the job itself failed (e.g. no Python on the executors)
            python = self._conf(spark, "spark.pyspark.python", "") or (
                None if is_connect(spark) else getattr(spark.sparkContext, "pythonExec", None))
            archives = self._conf(spark, "spark.archives", "") or None
            raise ConfigurationError(
                f"could not run Python on the executors to check they can import {', '.join(modules)}: "
                f"{_job_failure(e)}. {_executor_python_hint(python, archives)} "
                "Nothing was written.") from e
        missing = sorted({(m, host, err) for host, m, _, err in found if err})
        if missing:
            what = "; ".join(f"{m} on {host} ({err[:160]})" for m, host, err in missing[:5])
            raise ConfigurationError(
                f"the executors cannot import what {type(self.sink).__name__} needs: {what}. Ship them with "
                "the job: spark-submit --py-files twophase.zip (or spark.submit.pyFiles / "
                "SparkContext.addPyFile) for twophase itself (its wheel copied to a .zip name: Spark "
                "puts no .whl on the executors' path), and a packed environment "
                "(--archives env.tar.gz#env with spark.pyspark.python=./env/bin/python, see venv-pack) or "
                "an install on every host for packages with native code (pyarrow, confluent_kafka, "
                "psycopg2). Nothing was written.")
        versions = {v for _, m, v, _ in found if m == "twophase" and v}
        if versions and versions != {twophase.__version__}:
            raise ConfigurationError(
                f"the executors run twophase {', '.join(sorted(versions))} and the driver "
                f"{twophase.__version__}: handles and logs are only promised between equal versions. "
                "Ship the driver's version (spark-submit --py-files) or upgrade the executors.")

    # ----------------------------------------------------------------- a batch
    def _run(self, df, batch_id: int, query_id: str, streaming: bool) -> None:
        t_start = time.perf_counter()
        self._batch_input, self._input_note, self._collect_ms = "", "", 0.0
        self._batch_query = (query_id, streaming)
        self._start(df.sparkSession, query_id, streaming)
        assert self._protocol is not None
        prog = BatchProgress(self.name, batch_id, query_id, "committed")
        self._protocol.run_batch(batch_id, _SparkBatch(self, df), prog)
        if prog.action != "committed":
            # Decided before (a replay): the batch is not written again, but a stateful query's
            # state stores must still commit this batch.
            self._commit_state(df, query_id, streaming)
        self._finish(prog, t_start)

    def _slots(self, spark) -> int:
        """Writer tasks (= transactions) per batch: ``parallelism``, else Spark's default parallelism,
        capped by what the sink's target allows."""
        slots = self.parallelism
        if slots is None:
            slots = self._default_parallelism(spark)
        cap = self.sink.max_parallelism()
        if cap is not None and slots > cap:
            if not self._slots_capped:
                log.warning("%s: %s allows at most %d transactions per batch; writing with %d tasks "
                            "instead of %d", self.name, type(self.sink).__name__, cap, cap, slots)
                self._slots_capped = True
            slots = cap
        return max(1, slots)

    def _default_parallelism(self, spark) -> int:
        """Spark's ``defaultParallelism`` (the cores the application has).  Spark Connect offers no
        SparkContext: there it is measured once, as the partitions of ``spark.range`` without a
        partition count (which Spark sizes by the default parallelism)."""
        if not is_connect(spark):
            return default_parallelism(spark)
        if self._parallelism_seen is None:
            self._parallelism_seen = default_parallelism(spark)
            log.info("%s: Spark Connect: the application's default parallelism is %d", self.name,
                     self._parallelism_seen)
        return self._parallelism_seen

    def _commit_state(self, df, query_id: str, streaming: bool) -> None:
        """Run a replayed batch's plan without output when the query is stateful.

        A batch that was decided before the crash is not written again, so its
        DataFrame would not run at all; but Spark 4 checks that every state store of
        a stateful query committed in each batch (STATE_STORE_COMMIT_VALIDATION_FAILED
        otherwise).  Running the plan with the ``noop`` writer recomputes the same
        state version and writes nothing.  Stateless queries skip this.
        """
        if not streaming:
            return
        if self._is_stateful(df, query_id):
            df.write.format("noop").mode("overwrite").save()

    def _is_stateful(self, df, query_id: str) -> bool:
        """Does the streaming query keep state across batches (state stores)?  Asked once per query;
        True when it cannot be told (Spark Connect shows no physical plan)."""
        if self._stateful is None and is_connect(df.sparkSession):
            self._stateful = True  # Connect shows no physical plan: recomputing is always safe
        if self._stateful is None:
            try:
                q = _find_query(df.sparkSession, query_id)
                plan = q._jsq.streamingQuery().lastExecution().executedPlan().toString()
                self._stateful = any(m in plan for m in _STATEFUL_MARKERS)
            except Exception:  # cannot tell: recomputing is always safe
                log.debug("could not inspect the plan of query %s; assuming it is stateful", query_id,
                          exc_info=True)
                self._stateful = True
        return bool(self._stateful)

    # ------------------------------------------------------------ the driver path
    def _driver_rows(self, df) -> Any | None:
        """The batch's rows as an Arrow table when it takes the driver path, else None (tasks).

        Checked before anything of the batch is planned: the path (``task_input``, the previous
        batch's rows under "auto"), then the bound, by the collect itself: at most
        ``driver_batch_rows + 1`` rows come to the driver, and that one more sends the batch to the
        Arrow task path (a burst after small batches), its plan run again there."""
        bound = self.driver_batch_rows
        if self.task_input == "auto":
            if self._collect_wait > 0:  # a collect failed lately: the tasks, for a while
                self._collect_wait -= 1
                return None
            if bound <= 0 or self._last_rows is None or self._last_rows > bound:
                # driver_batch_rows=0, the first batch, or after a large one
                return None
        elif self.task_input != "driver" or bound <= 0:
            return None
        if self.sink.prepares_batches():
            self._input_note = "the sink prepares batches with a Spark job of its own"
            return None
        if self.task_input == "auto":
            unsafe = self._collect_unsafe(df.sparkSession)
            if unsafe:
                self._input_note = unsafe
                return None
        query_id, streaming = self._batch_query
        if streaming and self._is_stateful(df, query_id):
            # The collect's limit may stop reading a partition before its end (past the bound), and a
            # state store commits when its partition is read to the end; the fallback would then run
            # the stateful plan a second time in the batch.  Not tried: such queries keep the tasks.
            self._input_note = "a stateful query keeps the task path"
            return None
        # The record batches the Arrow task path would hand the sink: the same schema (timestamps in
        # the session time zone: toArrow() gives UTC; nullability as Spark's), else tasks.
        tz, large = arrow_settings(df.sparkSession)
        try:
            from pyspark.sql.pandas.types import to_arrow_schema

            target = to_arrow_schema(df.schema, timezone=tz, prefers_large_types=large)
        except Exception as e:  # noqa: BLE001 - a type the driver's Arrow conversion lacks: tasks
            self._input_note = f"the driver cannot collect this schema as Arrow ({type(e).__name__}): the Arrow task path"
            return None
        t0 = time.perf_counter()
        try:
            if is_connect(df.sparkSession):  # no job groups to cancel by (as the Connect task path)
                table = df.limit(bound + 1).toArrow()
            else:
                with self._cancellable(df):  # a fence found while it runs cancels the collect
                    table = df.limit(bound + 1).toArrow()
            if table.num_rows <= bound:
                table = table.cast(target)
        except LogOwnershipError:
            raise
        except Exception as e:  # noqa: BLE001 - nothing of the batch was planned yet: the tasks write it
            if self.log is not None and self.log.fenced:
                raise LogOwnershipError(
                    f"{self.name}: this coordinator (epoch {self.log.epoch}) was fenced by a newer one while the "
                    "driver collected its batch; the collect was cancelled and the newer coordinator finishes "
                    "the batch") from e
            if _cancelled(e):
                # The query is being stopped (or its job group cancelled): no fallback job for it.
                raise
            # A type toArrow() refuses (the Arrow tasks convert it), rows past spark.driver.maxResultSize
            # (the bound counts rows, not bytes), ...: the batch takes the Arrow task path, which reads
            # it again.  A failure of the batch's own (its source) fails there too.  Under "auto" the
            # next batches keep to the tasks for a while (the same columns would fail the same collect;
            # a lost executor would not), for good after an OutOfMemoryError.
            # The cause, not py4j's "An error occurred while calling ..." nor a wrapper's "awaitResult".
            text = str(e)
            first = _python_worker_error(text) or next(
                (ln.strip()[:300] for ln in text.splitlines()
                 if "Exception:" in ln and "awaitResult" not in ln and "error occurred while" not in ln),
                _job_failure(e))
            self._input_note = f"{_COLLECT_FAILED} ({first}): the Arrow task path"
            if self.task_input == "auto" and "OutOfMemoryError" in text:
                # The driver's heap (or an executor's) ran out on this collect: the same rows would run
                # it out again, and the next time the driver's JVM may die of it.  Never again here.
                self._collect_wait = sys.maxsize
                self._input_note += (", for this batch and all the coordinator's next ones (out of memory: "
                                     "it does not collect again)")
            elif self.task_input == "auto":
                self._collect_failures += 1
                self._collect_wait = min(_COLLECT_RETRY_FIRST << min(self._collect_failures - 1, 20),
                                         _COLLECT_RETRY_MAX)
                self._input_note += (f", for this batch and the coordinator's next {self._collect_wait} "
                                     "(then it collects again)")
            log.warning("%s: %s", self.name, self._input_note)
            return None
        finally:
            self._collect_ms += _ms(t0)
        self._collect_failures = 0
        if table.num_rows > bound:
            self._input_note = f"{_OVER_BOUND} {bound} rows: the Arrow task path"
            log.info("%s: %s %d rows: this batch takes the Arrow task path", self.name, _OVER_BOUND, bound)
            return None
        return table

    def _collect_unsafe(self, spark) -> str:
        """Why "auto" must not collect batches into this driver ("" if it may), asked once.

        The collect's bytes are bounded by ``spark.driver.maxResultSize`` alone (the row bound counts
        rows: 6,000 rows of 100 KB are under both defaults): past it the collect fails and the batch
        takes the tasks.  A limit the driver's heap cannot hold (0, unlimited; or more than 1.25x
        the heap, e.g. the default 1g with ``spark.driver.memory=512m``) lets a batch of wide rows end
        the driver with OutOfMemoryError instead.  Spark's defaults (1g and a 1g driver) pass."""
        if self._unsafe_collect is None:
            self._unsafe_collect = ""
            if not is_connect(spark):
                try:
                    sc = spark.sparkContext
                    heap = int(sc._jvm.java.lang.Runtime.getRuntime().maxMemory())
                    text = sc.getConf().get("spark.driver.maxResultSize", "1g")
                    limit = int(sc._jvm.org.apache.spark.network.util.JavaUtils.byteStringAsBytes(text))
                except Exception:  # noqa: BLE001 - cannot tell: the task paths, which are always safe
                    log.debug("cannot read the driver's heap or maxResultSize", exc_info=True)
                    self._unsafe_collect = "the driver's heap and spark.driver.maxResultSize cannot be read"
                else:
                    if limit <= 0 or limit > 1.25 * heap:
                        self._unsafe_collect = (
                            f"spark.driver.maxResultSize={text} does not fit the driver's heap ({heap // 2**20} MiB): "
                            "a batch of wide rows collected here could end the driver, so auto keeps to the tasks "
                            "(set it under the heap, or task_input='driver')")
                        log.warning("%s: %s", self.name, self._unsafe_collect)
        return self._unsafe_collect

    @contextlib.contextmanager
    def _cancellable(self, df, tag: str = "") -> Iterator[tuple[Any, str]]:
        """Run the batch's Spark actions (the task job, the driver path's collect) in a job group that
        a fence found by the heartbeat cancels (:meth:`_stop_job`): a streaming query's own group
        (its run id: query.stop() cancels by it), else one of ours.  Yields (SparkContext, group);
        the fence is looked at once the group is set, so a fence found later cancels the job."""
        sc = df.sparkSession.sparkContext
        group = sc.getLocalProperty("spark.jobGroup.id")
        own_group = None
        if not group:
            own_group = group = f"twophase-{self.name}-{tag}{uuid.uuid4().hex[:8]}"
            sc.setLocalProperty("spark.jobGroup.id", group)
        self._job = (sc, group)
        try:
            if self.log is not None and self.log.fenced:
                self.log.check_fence()  # raises: fenced before the job started
            yield sc, group
        finally:
            self._job = None
            if own_group is not None:
                sc.setLocalProperty("spark.jobGroup.id", None)

    def _prepare_in_driver(self, table, name: str, batch_id: int, intent: dict[str, Any],
                           run: str) -> list[dict[str, Any]]:
        """The driver path: the batch's one transaction, run here (partition 0, attempt 0) over the
        collected rows.  The crash points ``before_begin`` and ``after_pre_commit`` fire in this
        process, the driver."""
        from twophase.context import TransactionContext, run_transaction

        self._batch_input = "driver"
        if self.log is not None and self.log.fenced:
            self.log.check_fence()  # raises: fenced before anything was begun
        # task_attempt_id -1: no Spark task; ``run`` is the ballot's own, and no task writes in a
        # ballot the driver writes, so (partition 0, attempt 0, run) names one transaction.
        ctx = TransactionContext(name, batch_id, 0, 0, intent, run, task_attempt_id=-1)
        # The record batches as the JVM cut them (maxRecordsPerBatch, per partition), as tasks get them.
        rows, envelope = run_transaction(self.sink, ctx, table.to_batches())
        self._last_rows = rows
        if envelope is None:
            return []
        return [{"partition": 0, "attempt": 0, "rows": rows, "handle": json.loads(envelope)}]

    # ---------------------------------------------------------------- executors
    def _prepare(self, df, name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        """Run every partition's transaction on the executors; return their handles (envelopes)."""
        from twophase.context import BatchContext

        # A sink that prepares the whole batch with a Spark job of its own (prepare_batch) does it here.
        whole = self.sink.prepare_batch(df, BatchContext(name, batch_id, intent, run))
        if whole is not None:
            self._batch_input = "batch"
            crash.crash_point("after_pre_commit", batch_id)  # the batch's pre-commit is its job
            return [{"partition": i, "attempt": 0, "rows": whole.rows if i == 0 else 0,
                     "handle": self.sink.encode_handle(h)} for i, h in enumerate(whole.handles)]
        import pyarrow as pa

        sink = self.sink
        out_schema = pa.schema([("partition", pa.int32()), ("attempt", pa.int32()),
                                ("rows", pa.int64()), ("handle", pa.string())])

        crash_env = crash.carried_env()  # fault-injection runs: executors on a cluster arm the same plan

        def run_task(batches):
            """The partition's transaction over ``batches``: (ctx, rows, envelope or None)."""
            from pyspark import TaskContext

            from twophase import crash as _crash
            from twophase.context import TransactionContext, run_transaction

            if crash_env:
                _crash.adopt(crash_env)

            tc = TaskContext.get()
            ctx = TransactionContext(name, batch_id, tc.partitionId(), tc.attemptNumber(), intent, run,
                                     task_attempt_id=tc.taskAttemptId())
            rows, envelope = run_transaction(sink, ctx, batches)
            return ctx, rows, envelope

        def run_partition(batches):
            ctx, rows, envelope = run_task(batches)
            if envelope is None:
                return
            yield pa.RecordBatch.from_pydict(
                {"partition": [ctx.partition_id], "attempt": [ctx.attempt], "rows": [rows],
                 "handle": [envelope]}, schema=out_schema)

        target = self._rows_target(df)
        if target is not None:
            schema, max_records = df.schema, self._max_records(df.sparkSession)

            def run_rows(_index, rows_in):
                ctx, rows, envelope = run_task(record_batches(rows_in, schema, target, max_records))
                if envelope is not None:
                    yield {"partition": ctx.partition_id, "attempt": ctx.attempt, "rows": rows, "handle": envelope}

            def job():
                return df.rdd.mapPartitionsWithIndex(run_rows).collect()
        else:
            def job():
                return df.mapInArrow(run_partition, _RESULT_SCHEMA).collect()
        self._batch_input = "arrow" if target is None else "rows"

        if is_connect(df.sparkSession):
            # Spark Connect has no status tracker to wait for a failed job's last tasks with: a task
            # that pre-commits after the abort below leaves a transaction that the batch's replay
            # aborts (by its INTENT) before it opens any of its own.
            return self._handles(batch_id, job())
        # Our job must be findable after a failure (see _wait_for_tasks), and cancelled by a fence.
        with self._cancellable(df, f"{batch_id}-") as (sc, group):
            try:
                rows = job()
            except BaseException as e:
                if target is not None and self.task_input == "auto" and CONVERSION_FAILED in str(e):
                    self._rows_refused = True
                    log.warning("%s: batch %d: a row did not convert to Arrow on the rows path; this "
                                "coordinator's batches take the Arrow path from now on, this one included",
                                self.name, batch_id)
                # collect() fails as soon as one task fails, while sibling tasks may still be finishing
                # and could pre-commit after the caller aborted leftovers. Let them end first.
                self._wait_for_tasks(sc, group)
                if self.log is not None and self.log.fenced and not isinstance(e, LogOwnershipError):
                    raise LogOwnershipError(
                        f"{self.name}: batch {batch_id}: this coordinator (epoch {self.log.epoch}) was fenced by a "
                        f"newer one while its Spark job ran; the job was cancelled and the newer coordinator "
                        "finishes the batch") from e
                raise
        return self._handles(batch_id, rows)

    def _handles(self, batch_id: int, rows) -> list[dict[str, Any]]:
        results = self._results(batch_id, rows)
        self._last_rows = sum(int(r["rows"]) for r in results)  # task_input="auto" picks the next path by it
        return results

    def _rows_target(self, df) -> Any | None:
        """The Arrow schema for the rows path (``task_input``) if this batch's tasks take it, else None."""
        if self.task_input in ("arrow", "driver") or is_connect(df.sparkSession):
            return None
        if self._input_note.startswith((_OVER_BOUND, _COLLECT_FAILED)):
            return None  # a burst the driver path's collect found, or a collect that failed: the columnar path
        if self.task_input == "auto" and (self._rows_refused or self._last_rows is None
                                          or self._last_rows > self.small_batch_rows):
            return None
        target = rows_schema(df.schema, *arrow_settings(df.sparkSession))
        if target is None and self.task_input == "rows":
            raise ConfigurationError(
                f"{self.name}: task_input='rows' cannot hand the sink the record batches the Arrow path "
                f"would for this schema ({df.schema.simpleString()[:300]}): it has an interval, variant or "
                "user-defined type, a struct with repeated field names, or useLargeVarTypes is on. "
                "Use task_input='arrow' or 'auto'")
        return target

    def _max_records(self, spark) -> int:
        """Rows per record batch, as the Arrow path cuts them (``maxRecordsPerBatch``; <= 0: no limit)."""
        try:
            n = int(spark.conf.get("spark.sql.execution.arrow.maxRecordsPerBatch", "10000"))
        except ValueError:
            n = 10000
        return n if n > 0 else 2**62

    @staticmethod
    def _results(batch_id: int, rows) -> list[dict[str, Any]]:
        """The tasks' result rows as handles by partition; two handles for one partition refused."""
        seen: dict[int, int] = {}
        results = []
        for r in rows:
            if r["partition"] in seen:
                # Two successful attempts of one partition: both pre-committed, only one may commit.
                raise TwoPhaseError(
                    f"batch {batch_id}: partition {r['partition']} returned two handles (attempts "
                    f"{seen[r['partition']]} and {r['attempt']}); is speculation on? Nothing was committed.")
            seen[r["partition"]] = r["attempt"]
            results.append({"partition": r["partition"], "attempt": r["attempt"], "rows": r["rows"],
                            "handle": json.loads(r["handle"])})
        results.sort(key=lambda r: r["partition"])
        return results

    def _wait_for_tasks(self, sc, group: str, timeout: float = 60.0) -> None:
        """Wait (bounded) until no task of the job group is running: a failed job's other tasks are
        killed by Spark, but one may still pre-commit before it notices."""
        try:
            tracker = sc.statusTracker()
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                active = 0
                for job_id in tracker.getJobIdsForGroup(group):
                    info = tracker.getJobInfo(job_id)
                    for stage_id in (info.stageIds if info is not None else []):
                        stage = tracker.getStageInfo(stage_id)
                        active += stage.numActiveTasks if stage is not None else 0
                if active == 0:
                    return
                time.sleep(0.1)
            log.warning("%s: tasks of a failed job still run after %.0fs; their leftovers are aborted "
                        "when the batch is replayed", self.name, timeout)
        except Exception:  # best effort: the replay aborts leftovers anyway
            log.debug("could not wait for the tasks of job group %s", group, exc_info=True)

    # -------------------------------------------------------------------- misc
    def _source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        """Spark's ``offsets/N`` for this batch, parsed, when the checkpoint location is known."""
        if self.checkpoint_location is None or self._checkpoint_store is False:
            return None
        if self._checkpoint_store is None:  # the log's stores: local, HDFS (WebHDFS), S3
            try:
                self._checkpoint_store = open_store(self.checkpoint_location, self.storage_options,
                                                    exclusive=False)
            except (ConfigurationError, ImportError, ValueError) as e:
                log.warning("%s: Spark's offsets will not be recorded in commit decisions: %s", self.name, e)
                self._checkpoint_store = False
                return None
        from twophase.spark import source_offsets

        return source_offsets(self._checkpoint_store, batch_id)

    def _finish(self, prog: BatchProgress, t_start: float) -> None:
        prog.total_ms = _ms(t_start)
        d = prog.to_dict()
        # "arrow", "rows", "driver" (no tasks: written by the driver), "batch" (the sink's own job)
        # or "" (nothing ran); why a batch left the driver path, and what its collect cost.
        d["task_input"] = self._batch_input
        d["input_note"] = self._input_note
        d["collect_ms"] = self._collect_ms
        self.last_progress = d
        self.recent_progress = (self.recent_progress + [d])[-100:]
        note = f" ({self._input_note})" if self._input_note and self._batch_input != "driver" else ""
        # "tasks' input driver": the driver path (no task); the wording is parsed by tests and docs.
        log.info("%s: batch %d %s: %d rows, %d handles, tasks' input %s%s, prepare %.0f ms, commit %.0f ms, "
                 "log %.0f ms, collect %.0f ms", prog.name, prog.batch_id, prog.action, prog.rows, prog.handles,
                 self._batch_input or "none", note, prog.prepare_ms, prog.commit_ms, prog.log_ms,
                 self._collect_ms)


class _SparkBatch:
    """One batch's work on Spark, for :class:`~twophase.protocol.TwoPhaseProtocol`: how many
    transactions (coalescing the DataFrame to them), the executors' tasks, Spark's offsets."""

    def __init__(self, coordinator: Coordinator, df):
        self.coordinator = coordinator
        self.df = df
        self.driver_rows: Any | None = None  # the driver path's rows (an Arrow table), once collected
        self._asked = False

    def partitions(self, planned: int | None) -> int:
        if not self._asked:  # a ballot run again keeps the path (and the rows) of the first
            self._asked = True
            self.driver_rows = self.coordinator._driver_rows(self.df)
        if self.driver_rows is not None:
            return 1  # the driver's one transaction (inside any earlier ballot's plan)
        df = self.df
        if planned and _batch_partitions(df, planned)[1]:
            # A re-run stays inside the transactions its first ballot planned (coalesce never adds
            # partitions), so that a sink's bounded pool of names keeps its size.
            self.df = df.coalesce(planned)
            return int(planned)
        slots = self.coordinator._slots(df.sparkSession)
        # Transactions per batch = writer slots, whatever the input partitioning (no shuffle);
        # a slot without rows opens none.
        num_partitions, coalesce = _batch_partitions(df, slots)
        if coalesce:
            self.df = df.coalesce(slots)
        return num_partitions

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        if self.driver_rows is not None:
            return self.coordinator._prepare_in_driver(self.driver_rows, query_name, batch_id, intent, run)
        return self.coordinator._prepare(self.df, query_name, batch_id, intent, run)

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        return self.coordinator._source_offsets(batch_id)

    def run_again(self, error: BaseException) -> str | None:
        """After a failed ballot: run the batch again when the rows path refused a row (under
        ``task_input="auto"``); the next ballot takes the Arrow path."""
        c = self.coordinator
        if c._batch_input == "rows" and c._rows_refused:
            return ("a row did not convert to Arrow on the rows path (task_input='auto'); the next "
                    "ballot takes the Arrow path")
        return None
