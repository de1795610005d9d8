"""The options every twophase data source shares, and the plan step of each batch (issue 28;
docs/datasource.md): what Spark's planner worker runs when it plans a micro-batch (``streamWriter``
/ ``writer`` of :class:`~twophase.datasource_writer.TwoPhaseDataSource`): recovery of earlier
batches, then a ballot of the batch opened.  Also what the plan hands on: the :class:`Plan` (in the
pickled writer, to every task) and each task's :class:`TaskMessage` (back to the commit step).
The data source classes, their registration and the streaming writer's wrapping:
:mod:`twophase.datasource`; the writers (tasks, commit, abort): :mod:`twophase.datasource_writer`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from twophase._deps import require
from twophase.config import local_location
from twophase.errors import ConfigurationError
from twophase.log import TransactionLog, batch_query_id, open_store
from twophase.protocol import BatchProgress, OpenedBallot, TwoPhaseProtocol
from twophase.recovery import Committer
from twophase.sink import TwoPhaseCommitSink

require("pyspark.sql.datasource", "the twophase data sources (format('twophase-...'))", "spark")
from pyspark.sql.datasource import WriterCommitMessage  # noqa: E402 - after the line that names the extra to install

log = logging.getLogger("twophase.datasource")

#: Options every twophase data source reads (lower case: Spark hands options over lower-cased).
#: ``queryname``: Spark hands a streaming query's ``.queryName(...)`` to its sink as an option; it
#: names the query in Spark's UI and metrics and changes nothing here.
_COMMON = {"checkpointlocation", "path", "twophase.name", "twophase.loglocation", "twophase.maxpartitions",
           "twophase.batchid", "queryname", "twophase.partitionby", "twophase.coalesce"}


@dataclass
class Plan:
    """What the plan of one micro-batch decided, carried to every task (in the pickled writer) and
    back to the commit step (in every task's message)."""

    batch_id: int
    action: str  # "write": a ballot of ours is open; "skipped" / "recommitted": decided before
    query_id: str
    log_location: str
    name: str
    query_name: str = ""
    number: int = 0
    intent: dict[str, Any] = field(default_factory=dict)
    run: str = ""
    epoch: int | None = None
    owner: str = ""
    generation: int | None = None
    partitions: int = 0
    planned_at: float = 0.0

    def opened(self) -> OpenedBallot:
        return OpenedBallot(self.batch_id, self.number, self.intent, self.run, self.query_name)


@dataclass
class TaskMessage(WriterCommitMessage):
    """One task's result: its transaction's handle (the sink's envelope, JSON), or None when it
    wrote nothing (an empty partition, or a batch decided before)."""

    plan: dict[str, Any]
    partition: int
    attempt: int
    rows: int
    handle: str | None


class _Settings:
    """The options every twophase data source shares, checked once.  A streaming write keeps its
    log in ``<checkpointLocation>/twophase`` and learns each batch's id from Spark; a batch write
    (``df.write``) names both: ``twophase.logLocation`` and ``twophase.batchId``."""

    def __init__(self, options: Any, kind: str, default_max_partitions: int = 200, *, streaming: bool = True):
        self.streaming = streaming
        #: These options' fingerprint (a hash: they may hold secrets), for _open.
        self.fingerprint = hashlib.sha256(json.dumps([kind, sorted((str(k), str(v)) for k, v in options.items())])
                                          .encode()).hexdigest()
        self.checkpoint = local_location(options["checkpointlocation"]) if options.get("checkpointlocation") else None
        log_location = options.get("twophase.loglocation")
        self.batch_id: int | None = None
        if streaming:
            if not self.checkpoint:
                raise ConfigurationError(
                    f"twophase-{kind} needs .option('checkpointLocation', ...): its transaction log lives "
                    "there (<checkpointLocation>/twophase) and it reads each micro-batch's id from Spark's "
                    "offsets log there")
            log_location = log_location or self.checkpoint.rstrip("/") + "/twophase"
        else:
            raw_id = options.get("twophase.batchid")
            if not log_location or raw_id is None:
                raise ConfigurationError(
                    f"a batch write to twophase-{kind} needs .option('twophase.logLocation', ...) (its "
                    "transaction log) and .option('twophase.batchId', N): a write repeated with the same "
                    "batch id is written once")
            try:
                self.batch_id = int(raw_id)
            except ValueError:
                raise ConfigurationError(f"twophase.batchId must be an integer >= 0, got {raw_id!r}") from None
            if self.batch_id < 0:
                raise ConfigurationError(f"twophase.batchId must be an integer >= 0, got {raw_id!r}")
        self.log_location = local_location(str(log_location))
        self.name = options.get("twophase.name") or "twophase"
        raw = options.get("twophase.maxpartitions") or str(default_max_partitions)
        try:
            self.max_partitions = int(raw)
        except ValueError:
            raise ConfigurationError(f"twophase.maxPartitions must be a positive integer, got {raw!r}") from None
        if self.max_partitions < 1:
            raise ConfigurationError(f"twophase.maxPartitions must be a positive integer, got {raw!r}")


def _committer(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> Committer:
    return Committer(sink, parallelism=8, retries=5, backoff=0.2, max_backoff=10.0, ignore_lost=False,
                     where=settings.log_location, name=settings.name)


def _current_batch(checkpoint: str) -> tuple[int, str]:
    """(the micro-batch Spark is planning, the query's id), from its checkpoint: Spark writes
    ``metadata`` when the query first starts and ``offsets/N`` before it plans batch N."""
    store = open_store(checkpoint, None, exclusive=False)
    raw = store.read("metadata")
    try:
        query_id = json.loads(raw.decode("utf-8"))["id"] if raw is not None else None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        query_id = None
    batches = [int(n) for n in (store.list("offsets") or []) if n.isdigit()]
    if not query_id or not batches:
        raise ConfigurationError(
            f"{store.location('offsets')}: no micro-batch there while Spark plans one. twophase data sources "
            "write micro-batches only (a continuous trigger is not supported: use processingTime or "
            "availableNow), and checkpointLocation must be the query's own. Nothing was written.")
    return max(batches), str(query_id)


#: Configurations whose sink passed open() in this (planner) process: Spark reuses planner workers
#: across micro-batches, so later plans only get the sink ready (open_for_commit).
_CHECKED: set[str] = set()


def _open(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> None:
    if settings.fingerprint in _CHECKED:
        sink.open_for_commit()
        return
    sink.open()
    _CHECKED.add(settings.fingerprint)


def _plan(sink: TwoPhaseCommitSink[Any, Any], settings: _Settings) -> Plan:
    """The planner's part of micro-batch N: recovery, then a ballot of ours for N (or nothing to
    write: N was decided before, and is committed now if it was not)."""
    t0 = time.perf_counter()
    if settings.streaming:
        assert settings.checkpoint is not None
        batch_id, query_id = _current_batch(settings.checkpoint)
    else:
        assert settings.batch_id is not None
        batch_id, query_id = settings.batch_id, batch_query_id(settings.name, sink.target())
    _open(sink, settings)
    tlog = TransactionLog(settings.log_location)
    # No process outlives a batch: each plan is a new epoch; the ballots' slots are the fence.
    tlog.acquire(query_id, settings.name, takeover=True, target=sink.target())
    protocol = TwoPhaseProtocol(sink, tlog, name=settings.name, query_name=f"{settings.name}.{tlog.scope()}",
                                committer=lambda: _committer(sink, settings))
    prog = BatchProgress(settings.name, batch_id, query_id, "committed")
    sized: list[int] = []

    cap = sink.max_parallelism()  # e.g. PostgreSQL's max_prepared_transactions // 2

    def partitions(planned: int | None) -> int:  # the task count is unknown while Spark plans
        # What this run allows, and at least what the batch's earlier ballot planned: a replay runs
        # with as many tasks as this run's query makes (another core count, twophase.coalesce, or
        # no register() at all), which the plan cannot change.  Sinks' pools follow the widest
        # plan (Kafka's plan fence records it); PostgreSQL's gids are named per ballot.
        wanted = max(planned or 0, settings.max_partitions)
        sized.append(wanted if cap is None else min(cap, wanted))
        return sized[-1]

    opened = protocol.open_ballot(batch_id, partitions, prog)
    plan = Plan(batch_id, "write", query_id, settings.log_location,
                settings.name, epoch=tlog.epoch, owner=tlog.owner, generation=tlog.generation,
                planned_at=time.time())
    if opened is None:
        plan.action = prog.action
    else:
        plan.query_name, plan.number, plan.intent, plan.run = (opened.query_name, opened.number, opened.intent,
                                                               opened.run)
        plan.partitions = sized[-1]
    log.info("%s: batch %d planned (%s) in %.0f ms", settings.name, batch_id, plan.action,
             (time.perf_counter() - t0) * 1000)
    return plan
