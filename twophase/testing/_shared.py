"""What the conformance harness's two state machines share (the crash machine of
:mod:`twophase.testing.conformance` and the ownership machine of :mod:`twophase.testing.ownership`):
the running example's story and ``note``, the task outcomes, the id spans, :class:`ConformanceError`,
the default row builder and id reader, how a sink is pickled and closed, the id helpers, the default
hypothesis settings and the degenerate-run check.  Both import it; neither imports the other at
import time.  :mod:`twophase.testing.conformance` re-exports every name, the public path.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from twophase._deps import require
from twophase.sink import TwoPhaseCommitSink

if TYPE_CHECKING:
    import hypothesis
    import pyarrow as pa
else:  # the install hint when the "testing" extra is missing
    hypothesis = require("hypothesis", "twophase.testing")
    pa = require("pyarrow", "twophase.testing")

#: The running example's notes, kept so that a failure hypothesis cannot replay (a race) still
#: comes with its story.
_story: list[str] = []


def note(msg: str) -> None:
    _story.append(msg)
    hypothesis.note(msg)


#: Ids of example n live in [floor + n * ID_SPAN, floor + (n + 1) * ID_SPAN); ``floor`` is above every id
#: the storage held when the run started, so earlier data (other runs, other tests) is ignored.
ID_SPAN = 100_000
#: Spark's default spark.task.maxFailures: a partition whose task fails this often fails the job.
MAX_TASK_ATTEMPTS = 4

# How a task attempt ends (Spark's view of one partition's task).
PRE_COMMIT = "pre_commit"            # begin, write, pre_commit, result reaches the driver
ABORT = "abort"                      # the task fails cleanly: the sink's abort() runs, Spark retries it
DIE_AFTER_PRE_COMMIT = "die_after_pre_commit"  # pre-committed, then the executor died before reporting
DIE_MID_WRITE = "die_mid_write"      # the executor died while writing: no abort, objects just vanish


class ConformanceError(AssertionError):
    """The sink broke the exactly-once contract; the message (and hypothesis' notes) tell the story."""


def default_make_batch(ids: list[int]) -> pa.RecordBatch:
    """Rows with a unique ``id`` (int64) and a ``payload`` string: the harness' default row builder."""
    return pa.RecordBatch.from_pydict({
        "id": pa.array(ids, pa.int64()),
        "payload": pa.array([f"row {i} · ünïcode" for i in ids], pa.string()),
    })


def default_id_of(record: Any) -> int:
    """The id of one record returned by ``read_committed``: a mapping's ``"id"``, or the record itself."""
    if isinstance(record, Mapping):
        return int(record["id"])
    return int(record)


def _dumps_sink(sink: TwoPhaseCommitSink) -> bytes:
    """Pickle a sink as Spark ships it to executors (cloudpickle when available, as PySpark does)."""
    try:
        import cloudpickle as cp  # type: ignore[import-not-found]
    except ImportError:
        try:
            from pyspark import cloudpickle as cp  # type: ignore[no-redef]
        except ImportError:
            cp = pickle  # type: ignore[assignment]
    try:
        return cp.dumps(sink)
    except Exception as e:  # noqa: BLE001 - any pickling failure is the same story for the user
        raise ConformanceError(
            f"{type(sink).__name__} cannot be pickled ({type(e).__name__}: {e}). Spark ships the sink to "
            "every executor by pickling it: hold only configuration in the sink object and open "
            "connections, clients and locks lazily on the executor (drop them in __getstate__).") from None


def example_id_base(machine: Any, n: int) -> int:
    """Reset the target (when the machine has ``reset``) and return the first record id of example
    ``n``: above every id the target held when the run started (``ID_SPAN`` per example), so
    earlier data (other runs, other tests) is ignored.  Shared by both state machines."""
    cls = type(machine)
    if machine.reset is not None:
        machine.reset()
    if cls._id_floor is None:
        seen = [machine.id_of(r) for r in machine.read_committed()]
        cls._id_floor = (max(seen) // ID_SPAN + 1) * ID_SPAN if seen else 0
    return int(cls._id_floor) + n * ID_SPAN


def _close(sink: Any) -> None:
    """Close a sink's connections if it has a ``close()`` (KafkaSink, PostgresSink do); errors ignored."""
    close = getattr(sink, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001 - best effort, like a dying process
            pass


def _split(ids: list[int], n: int) -> list[list[int]]:
    """Cut ``ids`` into at most ``n`` non-empty consecutive chunks (one Arrow batch each)."""
    n = max(1, min(n, len(ids)))
    size, extra = divmod(len(ids), n)
    out, start = [], 0
    for k in range(n):
        end = start + size + (1 if k < extra else 0)
        out.append(ids[start:end])
        start = end
    return [c for c in out if c]


def _span(ids: list[int]) -> str:
    """A compact view of a list of row ids: ``[1000003..1000007]`` or ``[1000001, 1000004]``."""
    if not ids:
        return "[]"
    if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 2:
        return f"[{ids[0]}..{ids[-1]}]"
    return "[" + ", ".join(map(str, ids)) + "]"


def default_settings(max_examples: int = 25, steps: int = 8) -> Any:
    """Settings for sinks that do I/O: no deadline, no too-slow health check."""
    return hypothesis.settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        report_multiple_bugs=False,
        suppress_health_check=[hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large,
                               hypothesis.HealthCheck.filter_too_much],
    )


def _format_stats(stats: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(stats.items()))


def check_reach(stats: dict[str, int], share: float, counts: dict[str, str], hint: str, half: str = "") -> None:
    """Fail a degenerate run: one with no valid example, or in which fewer than ``ceil(share *
    examples)`` examples reached each of ``counts`` (a statistic -> what it means), at any number of
    examples.  Both machines reach every one of them in every example by construction (the first
    step of an example does it), so a shortfall is a run that could not exercise the sink."""
    examples = stats.get("examples", 0)
    need = math.ceil(share * examples)
    short = [f"{stats.get(key, 0)} of {examples} examples {what}" for key, what in counts.items()
             if stats.get(key, 0) < need]
    if examples == 0 or short:
        raise ConformanceError(
            f"the {half + ' ' if half else ''}run was degenerate: "
            + ("no example ran to its end" if examples == 0 else
               "; ".join(short) + f" (at least {need} must: min_useful_share={share})")
            + f" ({_format_stats(stats)}). {hint}")
