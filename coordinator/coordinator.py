"""Driver-side two-phase-commit coordinator hooked to Spark micro-batch completion.

For batch N (DESIGN §2): COMMITTED in the log -> skip; PREPARED -> commit the logged
handles again (idempotent) and mark COMMITTED; otherwise log INTENT, abort what an
earlier attempt of N left open, run the executors (each partition begins, writes
Arrow batches, pre-commits and returns its handle), log PREPARED (the decision),
commit every handle in parallel with retry, log COMMITTED.  Spark writes
``commits/N`` only after this returns, and replays N with the same rows after a
crash anywhere before that.
"""

from __future__ import annotations

import json
import logging
import random
import time
import uuid
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from typing import Any

from twophase import crash
from twophase.errors import CommitError, ConfigurationError, DataLossError, TwoPhaseError
from twophase.log import COMMITTED, INTENT, PREPARED, LogStore, TransactionLog, open_store
from twophase.sink import CommitOutcome, CommitResult, TwoPhaseCommitSink

log = logging.getLogger("twophase.coordinator")

_RESULT_SCHEMA = "partition INT, attempt INT, rows LONG, handle STRING"
# Physical operators that keep state across micro-batches (their state stores must commit each batch).
_STATEFUL_MARKERS = ("StateStore", "WithState", "StreamingDeduplicate", "StreamingSymmetricHashJoin",
                     "StreamingGlobalLimit")


@dataclass
class BatchProgress:
    """Figures of one batch, as logged and kept in :attr:`Coordinator.last_progress`."""

    name: str
    batch_id: int
    query_id: str | None
    action: str  # "committed" | "recommitted" | "skipped"
    rows: int = 0
    handles: int = 0
    aborted_lingering: int = 0
    intent_ms: float = 0.0
    prepare_ms: float = 0.0
    log_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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

    ``commit_parallelism`` handles are committed at once; a commit that fails is
    retried ``commit_retries`` times with exponential backoff from
    ``retry_backoff`` seconds.  A commit that can never succeed after the
    decision was logged raises :class:`~twophase.errors.DataLossError` (naming
    batch, handle, reason) unless ``ignore_failures_after_transaction_timeout``.
    """

    def __init__(
        self,
        sink: TwoPhaseCommitSink[Any, Any],
        *,
        log_location: str | None = None,
        checkpoint_location: str | None = None,
        name: str = "twophase",
        storage_options: dict[str, Any] | None = None,
        commit_parallelism: int = 8,
        commit_retries: int = 5,
        retry_backoff: float = 0.2,
        max_backoff: float = 10.0,
        ignore_failures_after_transaction_timeout: bool = False,
        retain_batches: int = 100,
        new_generation: bool = False,
        takeover: bool = False,
        lease_timeout: float = 120.0,
    ):
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConfigurationError(f"sink must be a twophase.TwoPhaseCommitSink, got {type(sink).__name__}")
        if log_location is None:
            if checkpoint_location is None:
                raise ConfigurationError("give log_location=... (or checkpoint_location=..., the log then "
                                         "lives in <checkpoint_location>/twophase)")
            log_location = checkpoint_location.rstrip("/") + "/twophase"
        if not name or any(c in name for c in "/\\\0") or len(name) > 64:
            raise ConfigurationError(f"name must be 1-64 characters without slashes, got {name!r}")
        if commit_parallelism < 1 or commit_retries < 0:
            raise ConfigurationError("commit_parallelism must be >= 1 and commit_retries >= 0")
        self.sink = sink
        self.name = name
        self.log_location = log_location
        self.checkpoint_location = checkpoint_location
        self.storage_options = storage_options
        self.commit_parallelism = commit_parallelism
        self.commit_retries = commit_retries
        self.retry_backoff = retry_backoff
        self.max_backoff = max_backoff
        self.ignore_failures_after_transaction_timeout = ignore_failures_after_transaction_timeout
        self.new_generation = new_generation
        self.takeover = takeover
        self._log_args = dict(storage_options=storage_options, retain_batches=retain_batches,
                              lease_timeout=lease_timeout)
        self.log: TransactionLog | None = None
        self._checkpoint_store: LogStore | bool | None = None  # False: its scheme has no store
        self._query_id: str | None = None
        self._stateful: bool | None = None
        self.last_progress: dict[str, Any] | None = None
        self.recent_progress: list[dict[str, Any]] = []
        if checkpoint_location is not None:
            self._clear_interrupted_start(checkpoint_location, storage_options)

    @staticmethod
    def _clear_interrupted_start(checkpoint_location: str, storage_options: dict[str, Any] | None) -> None:
        """A driver killed while Spark wrote ``offsets/0`` must not leave a query Spark refuses to start."""
        from twophase.spark import clear_interrupted_start

        try:
            clear_interrupted_start(checkpoint_location, storage_options)
        except Exception as e:  # noqa: BLE001 - Spark's own start-up check then reports the state
            log.warning("could not check %s for temp files of an interrupted first batch: %s",
                        checkpoint_location, e)

    # ------------------------------------------------------------- entry points
    def __call__(self, df, batch_id: int) -> None:
        """The ``foreachBatch`` function: make batch ``batch_id`` of ``df`` visible exactly once."""
        spark = df.sparkSession
        query_id = spark.sparkContext.getLocalProperty("sql.streaming.queryId")
        if not query_id:
            raise ConfigurationError(
                "Coordinator was called outside a streaming foreachBatch (no sql.streaming.queryId); "
                "use Coordinator.write(df, batch_id=...) for batch DataFrames")
        self._run(df, int(batch_id), query_id, streaming=True)

    def write(self, df, *, batch_id: int) -> dict[str, Any]:
        """Write a batch (non-streaming) DataFrame exactly once under ``batch_id``; returns its progress.

        Calling it again with the same ``batch_id`` (e.g. a re-run job) does not write twice.
        """
        self._run(df, int(batch_id), f"batch:{self.name}", streaming=False)
        assert self.last_progress is not None
        return self.last_progress

    # ------------------------------------------------------------------ set-up
    def _start(self, spark, query_id: str, streaming: bool) -> TransactionLog:
        if self.log is not None and self._query_id == query_id:
            return self.log
        self._check_spark(spark, query_id, streaming)
        self.sink.open()
        tlog = TransactionLog(self.log_location, **self._log_args)
        tlog.acquire(query_id, self.name, new_generation=self.new_generation, takeover=self.takeover)
        self.new_generation = False  # only the first acquire starts a generation
        self.log, self._query_id = tlog, query_id
        self._recover_older(tlog)
        return tlog

    def _check_spark(self, spark, query_id: str, streaming: bool) -> None:
        conf = spark.sparkContext.getConf()
        if conf.get("spark.speculation", "false").lower() == "true" and not self.sink.supports_speculation:
            raise ConfigurationError(
                f"spark.speculation=true would let two attempts of one task pre-commit, and "
                f"{type(self.sink).__name__} cannot isolate attempts. Set spark.speculation=false.")
        if not streaming:
            return
        jq = None
        try:
            q = spark.streams.get(query_id)
            jq = q._jsq.streamingQuery() if q is not None else None
        except Exception:  # pragma: no cover - Spark Connect or internals changed
            log.debug("could not inspect the streaming query %s", query_id, exc_info=True)
        if jq is not None:
            cls = jq.getClass().getSimpleName()
            if "AsyncProgress" in cls:
                raise ConfigurationError(
                    "async progress tracking (asyncProgressTrackingEnabled) lets Spark run batch N+1 "
                    "before batch N's commit is recorded, which breaks the replay contract. Turn it off.")
            if "RealTime" in cls or "Continuous" in cls:
                raise ConfigurationError(f"{cls} does not run foreachBatch micro-batches; use a "
                                         "micro-batch trigger")

    def _recover_older(self, tlog: TransactionLog) -> None:
        """At start: finish decided batches, abort leftovers of undecided ones (never skip a decision).

        Decided batches go first: sinks reuse transaction ids across batches (Kafka's
        pool), so fencing an older undecided batch's ids before committing a later
        decided batch on the same ids would abort that decided batch.
        """
        batches = tlog.batches()
        latest = max(batches) if batches else None
        for bid in sorted(batches):
            states = batches[bid]
            if COMMITTED not in states and PREPARED in states:
                log.warning("%s: batch %d was decided but not fully committed before a crash: "
                            "committing its %d handles again", self.name, bid, len(states[PREPARED].handles))
                intent = states[INTENT].body.get("intent", {}) if INTENT in states else {}
                self._commit_all(tlog, bid, states[PREPARED].handles, intent, recovering=True)
                tlog.write(bid, COMMITTED, {"recovered": True})
        for bid in sorted(batches):
            states = batches[bid]
            if COMMITTED in states or PREPARED in states or bid == latest:
                continue
            # Undecided and superseded (its query failed, then moved on): abort what it left open.
            n = self.sink.abort_lingering(self.name, bid, states[INTENT].body.get("intent", {}), [])
            if n:
                log.warning("%s: aborted %d transactions left by undecided batch %d", self.name, n, bid)

    # ----------------------------------------------------------------- a batch
    def _run(self, df, batch_id: int, query_id: str, streaming: bool) -> None:
        t_start = time.perf_counter()
        tlog = self._start(df.sparkSession, query_id, streaming)
        prog = BatchProgress(self.name, batch_id, query_id, "committed")
        t0 = time.perf_counter()
        tlog.heartbeat(force=False)
        state = tlog.state(batch_id)
        prog.log_ms += _ms(t0)

        if state is not None and state.state == COMMITTED:                       # step 1
            prog.action = "skipped"
            self._commit_state(df, query_id, streaming)
            return self._finish(prog, t_start)

        if state is not None and state.state == PREPARED:                         # step 2
            prog.action = "recommitted"
            intent_rec = tlog.record(batch_id, INTENT)
            intent = intent_rec.body.get("intent", {}) if intent_rec else {}
            prog.handles = len(state.handles)
            prog.rows = int(state.body.get("rows", 0))
            self._decided(tlog, prog, batch_id, state.handles, intent, recovering=True)
            self._commit_state(df, query_id, streaming)
            return self._finish(prog, t_start)

        # step 3: INTENT, then abort what a crashed attempt of this batch left open
        t0 = time.perf_counter()
        if state is not None:  # an INTENT from a crashed attempt: reuse it, so recovery fences exactly it
            intent = state.body.get("intent", {})
            planned = state.body.get("num_partitions")
            if planned and df.rdd.getNumPartitions() > planned:
                # The INTENT names the transactions of partitions 0..planned-1 only; stay inside it.
                df = df.coalesce(planned)
            prog.aborted_lingering = self.sink.abort_lingering(self.name, batch_id, intent, [])
            if prog.aborted_lingering:
                log.info("%s: batch %d: aborted %d transactions left by a crashed attempt",
                         self.name, batch_id, prog.aborted_lingering)
        else:
            num_partitions = df.rdd.getNumPartitions()
            intent = self.sink.plan_batch(self.name, batch_id, num_partitions)
            tlog.write(batch_id, INTENT, {"intent": intent, "sink": self.sink.kind, "name": self.name,
                                          "num_partitions": num_partitions})
        prog.intent_ms = _ms(t0)
        crash.crash_point("after_intent", batch_id)

        t0 = time.perf_counter()
        try:
            results = self._prepare(df, batch_id, intent)
        except BaseException:
            # Nothing is decided: abort what the partitions that did pre-commit left open now,
            # rather than at the replay (prepared transactions hold locks, open Kafka
            # transactions hold back read_committed consumers).
            try:
                self.sink.abort_lingering(self.name, batch_id, intent, [])
            except Exception:
                log.warning("%s: batch %d: aborting leftovers after failed executors failed too; the "
                            "replay aborts them", self.name, batch_id, exc_info=True)
            raise
        prog.prepare_ms = _ms(t0)
        handles = [r["handle"] for r in results]
        prog.rows = sum(r["rows"] for r in results)
        prog.handles = len(handles)
        crash.crash_point("before_prepared_logged", batch_id)

        t0 = time.perf_counter()                                                   # step 4: the decision
        payload: dict[str, Any] = {"handles": handles, "rows": prog.rows,
                                   "partitions": [r["partition"] for r in results]}
        source = self._source_offsets(batch_id)
        if source is not None:
            payload["source"] = source
        decided = tlog.write(batch_id, PREPARED, payload)
        if decided.body.get("epoch") != tlog.epoch:
            # Another coordinator decided this batch first; ours are leftovers.
            raise TwoPhaseError(f"batch {batch_id} was decided by coordinator epoch {decided.body.get('epoch')} "
                                f"while this one (epoch {tlog.epoch}) was preparing it")
        prog.log_ms += _ms(t0)
        crash.crash_point("after_prepared_logged", batch_id)

        self._decided(tlog, prog, batch_id, handles, intent, recovering=False)    # steps 5-6
        return self._finish(prog, t_start)

    def _decided(self, tlog: TransactionLog, prog: BatchProgress, batch_id: int,
                 handles: list[dict[str, Any]], intent: dict[str, Any], recovering: bool) -> None:
        t0 = time.perf_counter()
        self._commit_all(tlog, batch_id, handles, intent, recovering)
        prog.commit_ms = _ms(t0)
        crash.crash_point("after_commit", batch_id)
        t0 = time.perf_counter()
        tlog.write(batch_id, COMMITTED, {"rows": prog.rows, "handles_committed": len(handles)})
        prog.log_ms += _ms(t0)
        crash.crash_point("after_committed_logged", batch_id)
        tlog.prune(batch_id)

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
        if self._stateful is None:
            try:
                q = df.sparkSession.streams.get(query_id)
                plan = q._jsq.streamingQuery().lastExecution().executedPlan().toString()
                self._stateful = any(m in plan for m in _STATEFUL_MARKERS)
            except Exception:  # cannot tell: recomputing is always safe
                log.debug("could not inspect the plan of query %s; assuming it is stateful", query_id,
                          exc_info=True)
                self._stateful = True
        if self._stateful:
            df.write.format("noop").mode("overwrite").save()

    # ---------------------------------------------------------------- executors
    def _prepare(self, df, batch_id: int, intent: dict[str, Any]) -> list[dict[str, Any]]:
        """Run every partition's transaction on the executors; return their handles (envelopes)."""
        import pyarrow as pa

        sink, name = self.sink, self.name
        out_schema = pa.schema([("partition", pa.int32()), ("attempt", pa.int32()),
                                ("rows", pa.int64()), ("handle", pa.string())])

        def run_partition(batches):
            from pyspark import TaskContext

            from twophase import crash as _crash
            from twophase.context import TransactionContext

            tc = TaskContext.get()
            ctx = TransactionContext(name, batch_id, tc.partitionId(), tc.attemptNumber(), intent)
            txn, rows = None, 0
            try:
                for rb in batches:
                    if rb.num_rows == 0:
                        continue
                    if txn is None:
                        txn = sink.begin_transaction(ctx)
                    sink.write(txn, rb)
                    rows += rb.num_rows
                if txn is None:
                    return
                handle = sink.pre_commit(txn)
            except BaseException:
                if txn is not None:
                    try:
                        sink.abort(txn)
                    except Exception:  # the original error matters more
                        logging.getLogger("twophase.executor").exception("abort failed: %s", ctx.label)
                raise
            envelope = json.dumps(sink.encode_handle(handle))
            _crash.crash_point("after_pre_commit", batch_id)
            yield pa.RecordBatch.from_pydict(
                {"partition": [ctx.partition_id], "attempt": [ctx.attempt], "rows": [rows],
                 "handle": [envelope]}, schema=out_schema)

        sc = df.sparkSession.sparkContext
        # Our job must be findable after a failure (see _wait_for_tasks). A streaming query's jobs
        # already carry its run id as job group (query.stop() cancels by it): keep that one.
        group = sc.getLocalProperty("spark.jobGroup.id")
        own_group = None
        if not group:
            own_group = group = f"twophase-{name}-{batch_id}-{uuid.uuid4().hex[:8]}"
            sc.setLocalProperty("spark.jobGroup.id", group)
        try:
            rows = df.mapInArrow(run_partition, _RESULT_SCHEMA).collect()
        except BaseException:
            # collect() fails as soon as one task fails, while sibling tasks may still be finishing
            # and could pre-commit after the caller aborted leftovers. Let them end first.
            self._wait_for_tasks(sc, group)
            raise
        finally:
            if own_group is not None:
                sc.setLocalProperty("spark.jobGroup.id", None)
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

    # ------------------------------------------------------------------ commits
    def _commit_all(self, tlog: TransactionLog, batch_id: int, envelopes: list[dict[str, Any]],
                    intent: dict[str, Any], recovering: bool) -> None:
        handles = [self.sink.decode_handle(e) for e in envelopes]
        if handles:
            # Armed crash points commit one at a time, so mid_commit really leaves some uncommitted.
            workers = 1 if crash.armed() else min(self.commit_parallelism, len(handles))
            done = 0
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="twophase-commit") as pool:
                futures = [pool.submit(self._commit_one, batch_id, h, recovering) for h in handles]
                try:
                    for fut in as_completed(futures):
                        fut.result()
                        done += 1
                        if done < len(handles):
                            crash.crash_point("mid_commit", batch_id)
                except BaseException:
                    for f in futures:
                        f.cancel()
                    raise
        # Leftovers of failed task attempts of this batch (they pre-committed but lost the race).
        aborted = self.sink.abort_lingering(self.name, batch_id, intent, handles)
        if aborted:
            log.info("%s: batch %d: aborted %d transactions of failed task attempts", self.name, batch_id, aborted)

    def _commit_one(self, batch_id: int, handle: Any, recovering: bool) -> CommitResult:
        attempt = 0
        while True:
            reason: str
            try:
                res = self.sink.recover_and_commit(handle) if recovering else self.sink.commit(handle)
            except DataLossError:
                raise
            except Exception as e:  # unexpected: retried, then the batch fails and its replay retries
                res, reason = None, f"{type(e).__name__}: {e}"
            else:
                if res.done:
                    return res
                reason = res.reason
                if res.outcome is CommitOutcome.LOST:
                    what = self.sink.describe_handle(handle)
                    msg = (f"DATA LOSS: batch {batch_id} was decided (its PREPARED record is in "
                           f"{self.log_location}) but transaction {what} can no longer be committed: {reason}")
                    if self.ignore_failures_after_transaction_timeout:
                        log.error("%s (ignored: ignore_failures_after_transaction_timeout=True)", msg)
                        return res
                    raise DataLossError(msg, batch_id=batch_id, handle=what, reason=reason)
            attempt += 1
            if attempt > self.commit_retries:
                raise CommitError(
                    f"batch {batch_id}: committing {self.sink.describe_handle(handle)} failed "
                    f"{attempt} times, last: {reason}. The decision is logged: restarting the query "
                    "(or 'twophase recover') commits it again.")
            delay = min(self.max_backoff, self.retry_backoff * (2 ** (attempt - 1))) * (0.5 + random.random())
            log.warning("%s: batch %d: commit of %s failed (%s); retry %d/%d in %.2fs", self.name, batch_id,
                        self.sink.describe_handle(handle), reason, attempt, self.commit_retries, delay)
            time.sleep(delay)

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
        data = self._checkpoint_store.read(f"offsets/{batch_id}")
        if data is None:
            return None
        url = self._checkpoint_store.location(f"offsets/{batch_id}")
        lines = data.decode("utf-8").splitlines()
        # Line 0 is the version ("v1"), line 1 the batch metadata, then one line per source.
        parsed = []
        for line in lines[2:]:
            try:
                parsed.append(json.loads(line) if line != "-" else None)
            except ValueError:
                parsed.append(line)
        return {"offsets_file": url, "sources": parsed}

    def _finish(self, prog: BatchProgress, t_start: float) -> None:
        prog.total_ms = _ms(t_start)
        d = prog.to_dict()
        self.last_progress = d
        self.recent_progress = (self.recent_progress + [d])[-100:]
        log.info("%s: batch %d %s: %d rows, %d handles, prepare %.0f ms, commit %.0f ms, log %.0f ms",
                 prog.name, prog.batch_id, prog.action, prog.rows, prog.handles, prog.prepare_ms,
                 prog.commit_ms, prog.log_ms)
