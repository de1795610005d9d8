"""The sink conformance harness: a hypothesis state machine that plays coordinator, executors and crashes.

Runs in the test process, without Spark: it calls the sink's methods directly,
in the orders the coordinator (coordinator/coordinator.py) and Spark produce, and
checks what a reader sees through the user's ``read_committed``.  What Spark does
to a sink is reproduced where it matters: executor-side methods run on a pickled
copy of the sink (one per task attempt), driver-side methods on the driver's
object; a batch's handles are committed concurrently, as the coordinator's commit
pool does; recovery after a crash goes through the very routine the coordinator
and ``twophase recover`` use (:func:`twophase.recovery.recover_pending`).

The public path of the harness: :func:`run_sink_conformance`, :func:`make_state_machine` and
the pytest mixin :class:`SinkConformanceTests` live here; the machine's parts live beside it:
the model (:mod:`twophase.testing._conformance_model`), the oracle
(:mod:`twophase.testing._conformance_checks`), the driver's decisions, commits and recovery
(:mod:`twophase.testing._conformance_commits`), a run of a batch's job
(:mod:`twophase.testing._conformance_tasks`) and the state machine with its rules
(:mod:`twophase.testing._conformance_machine`).  Every name is re-exported here.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import random
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._conformance_commits import _HarnessCommitter as _HarnessCommitter
from twophase.testing._conformance_machine import SinkConformanceMachine
from twophase.testing._conformance_model import BATCH_SPAN as BATCH_SPAN
from twophase.testing._conformance_model import Attempt as Attempt
from twophase.testing._conformance_model import BatchModel as BatchModel
from twophase.testing._conformance_model import ConformanceWarning, SinkFactory
from twophase.testing._conformance_model import _DriverDied as _DriverDied
from twophase.testing._conformance_model import _FrameNeeded as _FrameNeeded
from twophase.testing._conformance_model import _NoFrame as _NoFrame
from twophase.testing._conformance_tasks import _CRASH_MIX as _CRASH_MIX
from twophase.testing._conformance_tasks import _FIRST_CRASH_MIX as _FIRST_CRASH_MIX
from twophase.testing._conformance_tasks import _OUTCOME_MIX as _OUTCOME_MIX
from twophase.testing._conformance_tasks import CRASH_POINTS as CRASH_POINTS
from twophase.testing._conformance_tasks import TASK_OUTCOMES as TASK_OUTCOMES

# The names both state machines use (twophase/testing/_shared.py): re-exported here.
from twophase.testing._shared import ABORT as ABORT
from twophase.testing._shared import DIE_AFTER_PRE_COMMIT as DIE_AFTER_PRE_COMMIT
from twophase.testing._shared import DIE_MID_WRITE as DIE_MID_WRITE
from twophase.testing._shared import ID_SPAN as ID_SPAN
from twophase.testing._shared import MAX_TASK_ATTEMPTS as MAX_TASK_ATTEMPTS
from twophase.testing._shared import PRE_COMMIT as PRE_COMMIT
from twophase.testing._shared import (
    ConformanceError,
    _format_stats,
    check_reach,
    default_id_of,
    default_make_batch,
    default_settings,
)
from twophase.testing._shared import _close as _close
from twophase.testing._shared import _dumps_sink as _dumps_sink
from twophase.testing._shared import _span as _span
from twophase.testing._shared import _split as _split
from twophase.testing._shared import _story as _story
from twophase.testing._shared import example_id_base as example_id_base
from twophase.testing._shared import note as note

if TYPE_CHECKING:
    import hypothesis
    from hypothesis import stateful
else:  # the install hint when the "testing" extra is missing
    hypothesis = require("hypothesis", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

_log = logging.getLogger("twophase.testing")


def make_state_machine(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    make_frame: Callable[[list[int], int], Any] | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    commit_parallelism: int = 8,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
) -> type[SinkConformanceMachine]:
    """The configured state machine class (for ``run_state_machine_as_test`` or its ``TestCase``).

    Arguments as for :func:`run_sink_conformance`.
    """
    if max_rows < 0 or max_partitions < 1 or commit_parallelism < 1:
        raise ValueError("max_rows must be >= 0, max_partitions and commit_parallelism >= 1")
    attrs: dict[str, Any] = {
        "sink_factory": staticmethod(sink_factory),
        "read_committed": staticmethod(read_committed),
        "make_batch": staticmethod(make_batch or default_make_batch),
        "make_frame": staticmethod(make_frame) if make_frame is not None else None,
        "id_of": staticmethod(id_of or default_id_of),
        "reset": staticmethod(reset) if reset is not None else None,
        "pending": staticmethod(pending) if pending is not None else None,
        "max_rows": max_rows,
        "max_partitions": max_partitions,
        "check_every_step": check_every_step,
        "settle_timeout": settle_timeout,
        "commit_retries": commit_retries,
        "commit_parallelism": commit_parallelism,
        "query_prefix": query_prefix,
        "rebuild_from_config": rebuild_from_config,
        "_run_token": f"{random.getrandbits(24):06x}",
        "_examples": itertools.count(1),
        "_id_floor": None,
        "_frame_probed": False,
        "stats": Counter(),
        "failures": [],
        "first_story": [],
    }
    return type("SinkConformance", (SinkConformanceMachine,), attrs)


def run_sink_conformance(
    sink_factory: SinkFactory,
    read_committed: Callable[[], Iterable[Any]],
    *,
    make_batch: Callable[[list[int]], Any] | None = None,
    id_of: Callable[[Any], int] | None = None,
    reset: Callable[[], None] | None = None,
    pending: Callable[[], Iterable[Any]] | None = None,
    make_frame: Callable[[list[int], int], Any] | None = None,
    settings: Any = None,
    max_examples: int | None = None,
    steps: int | None = None,
    max_rows: int = 12,
    max_partitions: int = 3,
    check_every_step: bool = True,
    settle_timeout: float = 0.0,
    commit_retries: int = 5,
    commit_parallelism: int = 8,
    query_prefix: str = "conformance",
    rebuild_from_config: bool = True,
    min_useful_share: float = 0.3,
    seed: int | None = None,
    ownership: bool = True,
    protocol_factory: Callable[..., Any] | None = None,
    ownership_examples: int | None = None,
) -> dict[str, int]:
    """Prove (by search) that a sink is exactly-once under the twophase coordinator; raise if not.

    Runs in the calling process, without Spark.  Hypothesis generates sequences of
    micro-batches: task attempts that pre-commit, abort or die and are retried,
    commit decisions, commits (``commit_parallelism`` at once, like the
    coordinator), repeated commits, driver crashes at the coordinator's crash
    points and recoveries through the coordinator's own recovery routine; and
    checks what ``read_committed`` returns against a model.  Executor-side methods
    run on a pickled copy of the sink per task attempt, as Spark ships it.  A
    failure raises :class:`ConformanceError` (an ``AssertionError``) after
    shrinking; hypothesis prints the steps and the notes, which read as the story
    of the failure.

    Returns the run's statistics (examples, batches, task failures and retries,
    crashes by point, recoveries, concurrent commits ...), also logged on
    ``twophase.testing``.  Every example's first step runs a batch with rows in which the
    driver dies (or, if a task fails 4 times first, whose job fails); the ownership machine's
    first step is a takeover.  At any number of examples, the run fails as degenerate if fewer
    than ``ceil(min_useful_share * examples)`` of its examples committed a batch with rows of
    their own (directly, by recovery or by the replay that finishes the example) before the
    closing batch every example ends with, or fewer went through a driver crash and recovery or a
    failed job and its replay (the ownership machine: committed rows, a takeover); by
    construction a run whose sink works reaches both in every example, so this fails runs
    that cannot exercise the sink (``max_rows=0``; a harness change that loses the guarantee).

    A sink whose ``prepare_batch`` takes batches over (``FileSink(writer="spark")``, the default on
    ``hdfs://``) is written by one Spark job per batch in a query; without ``make_frame`` the
    harness drives its per-task transactions instead, and says so with a
    :class:`ConformanceWarning` (and ``prepare_batch not driven`` in the statistics).  With
    ``make_frame``, a run in which ``prepare_batch`` never took a batch over warns too.

    ``sink_factory()`` returns a new sink on the same storage (called at the start
    of each example and after crashes; recovery also rebuilds sinks through
    ``to_config()``/``from_config()`` unless ``rebuild_from_config=False``).

    ``read_committed()`` returns what a reader sees now (rows, records, or ids);
    ``id_of(record)`` extracts the integer id (default: ``record["id"]`` for
    mappings, else ``int(record)``).  Ids outside the current example's range are
    ignored, so the storage may hold other data.

    ``make_batch(ids)`` builds the ``pyarrow.RecordBatch`` written for a list of ids
    (default: columns ``id`` int64 and ``payload`` string).

    ``reset()`` (optional) empties the storage before each example (keeps reads fast).

    ``pending()`` (optional) returns names of the sink's transactions that are still
    open (staged files, prepared gids, ongoing transactional ids).  With it the
    harness also checks that ``abort`` and ``abort_lingering`` leave nothing open.

    ``make_frame(ids, partitions)`` (optional) builds a Spark DataFrame of those rows over that
    many partitions.  With it the harness first offers each batch run to the sink's
    :meth:`~twophase.TwoPhaseCommitSink.prepare_batch` (the driver-side way to write a sink,
    e.g. ``FileSink(writer="spark")``); when that returns handles, they take the place of the
    task attempts, and the decision, commits, crashes and recovery follow as for any sink.

    ``settings`` is a ``hypothesis.settings`` (default: :func:`default_settings`);
    ``max_examples`` and ``steps`` (steps per example) override it; the ownership machine
    below runs under the same settings (phases, database, deadline), with its own steps.
    Each example uses its own query name, ids and batch ids ``example * 1000 + k``.
    ``settle_timeout`` re-reads for that many seconds while decided rows are
    missing (for stores whose committed data becomes readable with a lag).

    ``ownership`` (default on; off for ``make_frame`` sinks) then runs the ownership machine
    (:mod:`twophase.testing.ownership`): the real protocol (``protocol_factory``, default
    :class:`twophase.protocol.TwoPhaseProtocol`) on a real transaction log, a coordinator deposed
    mid-batch whose held actions land after a new owner's, late and duplicate task attempts, and a
    second pipeline or generation on the same target.  ``ownership_examples`` sets its examples
    (default: ``max_examples``, else 25).

    ``seed`` fixes hypothesis' random seed (``hypothesis.seed``): the same seed, sink and
    arguments run the same examples again.  Every choice the harness makes is a hypothesis
    draw, commits run concurrently but which of them land before a crash is drawn too, so
    an example replays exactly as long as the sink answers the same calls the same way.
    """
    machine = make_state_machine(
        sink_factory, read_committed, make_batch=make_batch, id_of=id_of, reset=reset, pending=pending,
        make_frame=make_frame, max_rows=max_rows, max_partitions=max_partitions, check_every_step=check_every_step,
        settle_timeout=settle_timeout, commit_retries=commit_retries, commit_parallelism=commit_parallelism,
        query_prefix=query_prefix, rebuild_from_config=rebuild_from_config)
    s = settings if settings is not None else default_settings()
    overrides: dict[str, Any] = {}
    if max_examples is not None:
        overrides["max_examples"] = max_examples
    if steps is not None:
        overrides["stateful_step_count"] = steps
    if overrides:
        s = hypothesis.settings(s, **overrides)
    if seed is not None:
        machine = hypothesis.seed(seed)(machine)
    try:
        stateful.run_state_machine_as_test(machine, settings=s)
    except hypothesis.errors.Flaky as e:
        if not machine.failures:
            raise
        err = ConformanceError(
            f"{machine.failures[0]}\n(This failure did not happen again when hypothesis replayed the same "
            "steps: the sink answers the same calls differently from run to run, the mark of a race "
            "(e.g. between concurrent commits) or of state kept outside the sink's storage. The notes "
            "below are the failing run's story.)")
        for line in machine.first_story:
            err.add_note(line)
        raise err from e
    stats = dict(machine.stats)
    _log.info("conformance run of %s: %s", machine.query_prefix, _format_stats(stats))
    check_reach(stats, min_useful_share, {
        "examples_with_committed_rows": "committed a batch with rows of their own",
        "examples_with_crash_or_job_failure": "went through a driver crash and a new driver's recovery, "
                                              "or a failed job and its replay",
    }, "Raise max_rows=... (every example's first batch has 1 to max_rows rows), or check that the "
       "sink's batches are not failing (see the run's notes).")
    if make_frame is not None and not stats.get("whole-batch jobs"):
        msg = ("make_frame was given, but the sink's prepare_batch never took a batch over (it returned "
               "None every time): this run drove the per-task transactions only")
        _log.warning("%s", msg)
        warnings.warn(ConformanceWarning(msg), stacklevel=2)
    if ownership and make_frame is None:
        # The second half: the real protocol (protocol_factory) with two coordinators on one log,
        # late and duplicate task attempts and a second pipeline on the same target.
        from twophase.testing.ownership import (
            DEFAULT_EXAMPLES,
            DEFAULT_STEPS,
            run_ownership_conformance,
        )

        # The caller's settings (phases, database, deadline ...) hold for this half too, with its
        # own steps per example (CI once spent 5 minutes here shrinking a failure that the
        # caller's settings had told hypothesis not to shrink).
        own = run_ownership_conformance(
            sink_factory, read_committed, protocol_factory=protocol_factory,
            settings=None if settings is None else hypothesis.settings(settings, stateful_step_count=DEFAULT_STEPS),
            max_examples=ownership_examples if ownership_examples is not None else
            (DEFAULT_EXAMPLES if settings is None and max_examples is None else s.max_examples),
            seed=seed, make_batch=make_batch, id_of=id_of, reset=reset, pending=pending, max_rows=max_rows,
            max_partitions=max_partitions, settle_timeout=settle_timeout, commit_retries=commit_retries,
            commit_parallelism=commit_parallelism, query_prefix=f"{query_prefix}-own",
            rebuild_from_config=rebuild_from_config, min_useful_share=min_useful_share)
        stats.update({f"ownership: {k}": v for k, v in own.items()})
    return stats


class SinkConformanceTests:
    """Pytest mixin: inherit it in a ``Test...`` class and implement ``make_sink`` and ``read_committed``.

    ::

        class TestMySink(SinkConformanceTests):
            max_examples = 20

            @pytest.fixture(autouse=True)
            def _where(self, tmp_path):
                self.path = tmp_path / "db.sqlite"

            def make_sink(self):
                return MySink(self.path)

            def read_committed(self):
                return read_ids(self.path)

    Optional overrides: ``make_batch``, ``id_of``, ``reset``, ``pending``, and the
    class attributes below.  Needs no pytest import itself.
    """

    max_examples: int = 25
    steps: int = 8
    conformance_settings: Any = None
    max_rows: int = 12
    max_partitions: int = 3
    check_every_step: bool = True
    settle_timeout: float = 0.0
    conformance_seed: int | None = None
    ownership: bool = True            # also run the ownership machine (twophase.testing.ownership)
    ownership_examples: int | None = None

    def make_sink(self) -> TwoPhaseCommitSink:
        raise NotImplementedError("override make_sink() to return a new sink on the test's storage")

    def read_committed(self) -> Iterable[Any]:
        raise NotImplementedError("override read_committed() to return what a reader sees (rows or ids)")

    def make_batch(self, ids: list[int]) -> Any:
        return default_make_batch(ids)

    def id_of(self, record: Any) -> int:
        return default_id_of(record)

    def reset(self) -> None:
        """Empty the storage before each example (optional)."""

    def pending(self) -> Iterable[Any]:
        """Names of still-open transactions (optional; override to enable the leftover checks)."""
        return ()

    def test_sink_conformance(self) -> None:
        overridden = _overrides(type(self), "pending")
        run_sink_conformance(
            self.make_sink, self.read_committed, make_batch=self.make_batch, id_of=self.id_of,
            reset=self.reset if _overrides(type(self), "reset") else None,
            pending=self.pending if overridden else None,
            settings=self.conformance_settings, max_examples=self.max_examples, steps=self.steps,
            max_rows=self.max_rows, max_partitions=self.max_partitions,
            check_every_step=self.check_every_step, settle_timeout=self.settle_timeout,
            seed=self.conformance_seed, ownership=self.ownership, ownership_examples=self.ownership_examples)


def _overrides(cls: type, name: str) -> bool:
    return inspect.getattr_static(cls, name) is not inspect.getattr_static(SinkConformanceTests, name)
