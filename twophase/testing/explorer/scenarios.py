"""Scenarios: :class:`Scenario` (a named list of actors over some batches, and its sink) and the named
ones the command line and the tests run (:data:`SCENARIOS`, :data:`BATCH_JOB_IDS`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from twophase.testing.explorer.actors import (
    Actor,
    batch_job,
    datasource_run,
    deposed,
    late_attempt,
    operator_recover,
    owner,
)
from twophase.testing.explorer.sinks import SinkUnderTest, file_sink


# ============================================================================ scenarios
@dataclass
class Scenario:
    """A named list of actors over ``batches`` batches (their rows: :func:`rows_of`).

    ``batch_ids``: the batch ids of batch jobs, which their runs pick themselves (out of order: a
    backfill of an older id beside a run of a newer one); the final owner then re-runs each of
    them (a re-run of each job) and one id more above them, instead of the batches Spark lacks.
    ``sut``: the sink the scenario runs on unless :func:`explore` is given one (default: the
    memory sink)."""

    name: str
    description: str
    actors: list[Actor]
    batches: int
    batch_ids: list[int] | None = None
    sut: Callable[[], SinkUnderTest] | None = None

    def expected_batches(self) -> list[int]:
        """The batches whose rows must be visible, each once, after the final owner."""
        if self.batch_ids is not None:
            return sorted({*self.batch_ids, max(self.batch_ids, default=-1) + 1})
        return list(range(self.batches + 1))


def _datasource(batches: int) -> Scenario:
    return Scenario("datasource", "two runs of one checkpoint written with the data source form: the first "
                    "run, on batch 0 (paused anywhere), and a restarted run, from the first batch Spark has not "
                    "committed to the last", [datasource_run(name="ds1"), datasource_run(name="ds2", until_last=True)],
                    batches)


def _deposed(batches: int) -> Scenario:
    return Scenario("deposed", "a deposed coordinator (an older epoch) committed the batches before the last two "
                    "itself and runs the next one; the owner takes the log over and runs from there to the last",
                    [deposed(history=max(0, batches - 2)), owner()], batches)


def _deposed_recovery(batches: int) -> Scenario:
    return Scenario("deposed-recovery", "a deposed coordinator (an older epoch, just started: its first batch "
                    "runs recovery) runs batch 0; the owner takes the log over and runs every batch",
                    [deposed(), owner()], batches)


def _late(batches: int) -> Scenario:
    return Scenario("late-attempt", "the owner runs every batch; a late task attempt of batch 0 pre-commits "
                    "under the latest ballot's INTENT at any point after it exists",
                    [owner(), late_attempt(0)], batches)


def _recover(batches: int) -> Scenario:
    return Scenario("recover", "the owner runs every batch; an operator's 'twophase recover --takeover' runs "
                    "at any point", [owner(), operator_recover()], batches)


def _owner_and_datasource(batches: int) -> Scenario:
    return Scenario("owner-datasource", "a data source run (every plan a new epoch: older or newer than the "
                    "owner's, as the schedule has it) plans and commits batch 0; a coordinator takes the log "
                    "over and runs from the first batch Spark has not committed to the last",
                    [datasource_run(name="ds"), owner()], batches)


#: The ids the runs of ``batch-jobs`` write, in the order the runs are listed (first: the newer run).
BATCH_JOB_IDS = (11, 5, 8, 3)


def _batch_jobs(batches: int) -> Scenario:
    ids = list(BATCH_JOB_IDS[:max(1, min(batches, len(BATCH_JOB_IDS)))])
    return Scenario("batch-jobs", "two runs of one batch job (same name, target and log; each takes the log "
                    f"over): a run of batch {ids[0]} and a backfill of batch "
                    f"{', '.join(map(str, ids[1:])) or '-'} (older ids), overlapping, either paused anywhere; "
                    "then a re-run of each; on the shipped FileSink (issue 59, scenario 1)",
                    [batch_job(b) for b in ids], len(ids), batch_ids=ids, sut=file_sink)


#: name -> (description, builder(batches), default batches)
SCENARIOS: dict[str, tuple[str, Callable[[int], Scenario], int]] = {
    "datasource": ("two data source runs of one checkpoint (scenario 3)", _datasource, 2),
    "deposed": ("a deposed coordinator on its fast path beside the owner", _deposed, 3),
    "deposed-recovery": ("a deposed coordinator's first batch beside the owner", _deposed_recovery, 2),
    "late-attempt": ("the owner and a late task attempt of batch 0", _late, 2),
    "recover": ("the owner and an operator's recover", _recover, 2),
    "owner-datasource": ("the owner and a data source run", _owner_and_datasource, 2),
    "batch-jobs": ("two runs of one batch job, ids 11 and 5, on the shipped FileSink (--batches: how many runs)",
                   _batch_jobs, 2),
}
