"""A deterministic schedule explorer for the protocol core (issue 45): every interleaving of a few
actors, up to a preemption bound, over an in-memory log store and an in-memory sink.

In the style of CHESS (Musuvathi and Qadeer, "Iterative context bounding for systematic testing
of multithreaded programs", PLDI 2007) and of FoundationDB's simulation: the
actors are real threads running the real protocol (:mod:`twophase.protocol`, :mod:`twophase.log`,
:mod:`twophase.recovery`), but only one runs at a time.  Every call to the log's store and every
method of the sink is a *scheduling point*: the actor stops there until the scheduler picks it.
A schedule is the sequence of those picks; the explorer enumerates every schedule with at most
``preemptions`` preemptions (a switch away from an actor that could have gone on; switching when
an actor ends is free), depth first, by stateless re-execution: each schedule runs from the start
on a fresh store and sink, its prefix replayed pick by pick (a replay that diverges is reported:
the explorer's determinism is checked, not assumed).

After every step it checks, from the store and the sink's target as they are:

- ``two-decisions``: at most one ballot of a batch ever holds a commit decision (a PREPARED record
  with outcome "commit" and no VOID record; the history is kept, since pruning deletes records).
  A record that lands in a batch the log says it pruned (a deposed coordinator's late write into
  a batch committed, whose records were deleted) is not a decision: it is noted in the trace, and
  committing it is ``visible-undecided``;
- ``visible-undecided``: no row (no transaction, for the memory sink) is visible unless a commit
  decision named it; ``duplicate-row``: no row is visible twice;
- ``decided-aborted``: no transaction a commit decision names is aborted (memory sink), no part
  file a commit decision names is gone, neither staged nor published (the shipped FileSink:
  :func:`file_sink`, whose storage calls are scheduling points too);
- ``decided-fenced``: no transaction a commit decision names is aborted by an InitProducerId on its
  transactional id (the shipped KafkaSink on an in-memory broker: :func:`kafka_sink`,
  :mod:`twophase.testing.kafka_model`, every broker request a scheduling point);
- ``data-loss``: a batch job's run (:func:`batch_job`) never stops with
  :class:`~twophase.errors.DataLossError`;
- ``pruned-forgotten``: the log never forgets a batch it said was pruned (its low-water mark
  never moves back; asked through the log's own reader, whatever the layout of its marks);
- ``older-closed-newer``: no ballot is closed by a coordinator of an older epoch than the one that
  opened it (a deposed coordinator interfering with its successor: the owner's batch fails).

At the end of a schedule (every actor finished, or stopped by a :class:`~twophase.errors.TwoPhaseError`;
any other exception is ``unexpected-error``), a final owner takes the log over, runs recovery,
replays every batch Spark's commit log does not hold (a batch is in it once a run of it returned)
and one batch more (whose cleanup sweeps late leftovers), alone.  Then: ``final-owner-failed`` if
it raised; ``rows-not-exactly-once`` unless every batch's rows are visible exactly once;
``leftovers`` if a transaction is still open or pre-committed (memory sink).  An actor that stops
outside a scheduling point for ``step_timeout`` seconds (a real lock, a join, a sleep) is
``blocked``; a schedule longer than ``max_steps`` is ``livelock``.

What it proves: for the actors modelled, every interleaving of their store and sink calls within
the bound keeps those invariants.  What it does not: the storage is linearizable here (one dict;
no lost, torn or reordered writes, no partial listings, no eventual consistency, no write whose
outcome is unknown), Spark is not there (the data source form's plan and commit steps are mirrored
from twophase/datasource_plan.py and twophase/datasource_writer.py; the coordinator's Spark glue is
not run), the memory sink is a model of the real sinks' contract (their own races, timeouts and
fences are theirs to test: :mod:`twophase.testing.conformance`), a process never crashes (an actor
that stops early is the same as one paused for ever; a crash that loses in-flight work is the
conformance harness's), time does not pass (leases never expire; only takeovers depose), schedules
beyond the bound are not explored, and what the protocol runs in background threads runs inline
where it is started.

``python -m twophase.testing.explorer --help``; docs/explorer.md.

Its files: ``_base.py`` (the bottom module: names, the state shared by the others, the scheduling
point, findings and their rendering), ``sinks.py`` (the sinks under test: the memory model, the
shipped FileSink and KafkaSink), ``points.py`` (the scheduling points: the traced sink wrapper, the
in-memory log store), ``actors.py`` (the actors), ``scenarios.py`` (the named scenarios),
``determinism.py`` (:func:`deterministic`), ``world.py`` (one schedule and its checks),
``search.py`` (the depth-first search: :func:`explore`, :func:`replay`, :class:`Report`), ``cli.py``
(the command line; ``__main__.py`` runs it).  This module re-exports the names importable from
``twophase.testing.explorer`` before.
"""

from __future__ import annotations

# Every name of the old module's __all__, and the names the tests reach through the module object
# besides (``ex.TransactionLog``, ``ex.SCHEME``, ``ex.LOG_URL``, ``ex._ScheduledStorage``) with the
# other public constants: ``X as X``, re-exported.
from twophase.log import TransactionLog as TransactionLog
from twophase.testing.explorer._base import LOG_URL as LOG_URL
from twophase.testing.explorer._base import NAME as NAME
from twophase.testing.explorer._base import QUERY_ID as QUERY_ID
from twophase.testing.explorer._base import SCHEME as SCHEME
from twophase.testing.explorer._base import (
    Finding,
    TaskFailed,
    Violation,
    parse_schedule,
    schedule_text,
)
from twophase.testing.explorer.actors import (
    Actor,
    ActorContext,
    batch_job,
    datasource_run,
    deposed,
    late_attempt,
    operator_recover,
    owner,
    rows_of,
)
from twophase.testing.explorer.cli import main
from twophase.testing.explorer.determinism import deterministic
from twophase.testing.explorer.points import MemoryLogStore
from twophase.testing.explorer.scenarios import BATCH_JOB_IDS, SCENARIOS, Scenario
from twophase.testing.explorer.search import Report, explore, replay
from twophase.testing.explorer.sinks import KAFKA_MODEL_BOOTSTRAP as KAFKA_MODEL_BOOTSTRAP
from twophase.testing.explorer.sinks import KAFKA_TOPIC as KAFKA_TOPIC
from twophase.testing.explorer.sinks import (
    SINKS,
    MemorySink,
    MemoryTarget,
    MemTxn,
    SinkUnderTest,
    file_sink,
    kafka_sink,
    memory_sink,
)
from twophase.testing.explorer.sinks import _ScheduledStorage as _ScheduledStorage

__all__ = [
    "BATCH_JOB_IDS",
    "SCENARIOS",
    "SINKS",
    "Actor",
    "ActorContext",
    "Finding",
    "MemTxn",
    "MemoryLogStore",
    "MemorySink",
    "MemoryTarget",
    "Report",
    "Scenario",
    "SinkUnderTest",
    "TaskFailed",
    "Violation",
    "batch_job",
    "datasource_run",
    "deposed",
    "deterministic",
    "explore",
    "file_sink",
    "kafka_sink",
    "late_attempt",
    "main",
    "memory_sink",
    "operator_recover",
    "owner",
    "parse_schedule",
    "replay",
    "rows_of",
    "schedule_text",
]
