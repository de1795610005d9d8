"""Driver-side two-phase-commit coordinator hooked to Spark micro-batch completion.

The Spark glue around the protocol (``twophase/protocol.py``, which imports no Spark):
environment checks (speculation, checkpoint, Spark Connect), executor probes, how many
transactions a batch gets, running each partition's transaction on the executors (begin,
write Arrow batches, pre-commit, return the handle), Spark's source offsets, and a
replayed batch's state stores.  Spark writes ``commits/N`` only after a batch returns,
and replays N with the same rows after a crash anywhere before that.

This module holds :class:`Coordinator` itself (its options, the log it takes, a batch's run, its
progress) and the protocol's view of a batch; its parts live beside it, each a base class of
``Coordinator``: ``environment.py`` (the checks of the Spark environment, the executor probe),
``driver_path.py`` (a small batch collected and written by the driver), ``task_path.py`` (the
executors' tasks), ``base.py`` (what they share).  Their names are importable from here too.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from twophase.coordinator.base import (  # noqa: F401 - the parts' names, also imported from here
    _PY_ERROR_LINE,
    _STATEFUL_MARKERS,
    _find_query,
    _job_failure,
    _ms,
    _python_worker_error,
    log,
)
from twophase.coordinator.driver_path import (  # noqa: F401 - the parts' names, also imported from here
    _COLLECT_FAILED,
    _COLLECT_RETRY_FIRST,
    _COLLECT_RETRY_MAX,
    _OVER_BOUND,
    DRIVER_BATCH_ROWS,
    _cancelled,
    _DriverPath,
)
from twophase.coordinator.environment import (  # noqa: F401 - the parts' names, also imported from here
    _Environment,
    _executor_python_hint,
    _local_or_url,
    _location_key,
    _same_location,
)
from twophase.coordinator.task_input import (  # noqa: F401 - the parts' names, also imported from here
    CONVERSION_FAILED,
    INPUTS,
    arrow_settings,
    record_batches,
    rows_schema,
)
from twophase.coordinator.task_path import (  # noqa: F401 - the parts' names, also imported from here
    _RESULT_SCHEMA,
    _batch_partitions,
    _TaskPath,
)
from twophase.errors import ConfigurationError, LogOwnershipError, TwoPhaseError  # noqa: F401
from twophase.log import LogStore, TransactionLog, batch_query_id, open_store
from twophase.protocol import BatchProgress, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink
from twophase.spark import default_parallelism, is_connect  # noqa: F401 - is_connect: also imported from here

#: Coordinator names: they become part of directory names, gids and marker rows.
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class Coordinator(_Environment, _DriverPath, _TaskPath):
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
    Arrow record batches (one JVM action, ``df.limit(bound + 1).toArrow()``, by one task for a batch
    of at most two partitions) and the sink writes
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
