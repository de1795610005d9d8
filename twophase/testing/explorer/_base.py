"""The explorer's bottom module, imported by every other one and importing none of them: the URLs and
names every schedule uses, the state shared across modules (the current schedule, ``_WORLD``; the
calling actor's run, ``_local``; the lock of :func:`~twophase.testing.explorer.deterministic`), a
scheduling point (``_point``), and the findings: :class:`Finding` and its rendering, the schedule's
text form, :class:`Violation`, :class:`TaskFailed`, the trace's lines.  Also the schedule as the
modules below world.py see it (:class:`_WorldView`, :class:`_RunView`, :class:`_SutView`:
protocols, which world.py's ``_World`` and ``_Run`` and sinks.py's ``SinkUnderTest`` meet), so
that no module imports world.py, which imports them."""

from __future__ import annotations

import itertools
import re
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from twophase.errors import TwoPhaseError

if TYPE_CHECKING:
    from twophase.protocol import TwoPhaseProtocol
    from twophase.sink import TwoPhaseCommitSink

#: The URL scheme of the explorer's in-memory log store (registered only inside :func:`deterministic`).
SCHEME = "explorer"
LOG_URL = f"{SCHEME}://log"
_QUIET_URL = f"{SCHEME}://checks"  # the same store, as the explorer's checks read it
QUERY_ID = "explorer-query"
#: A batch job's query id (the form of twophase.log.batch_query_id): the batch-jobs scenarios' log,
#: whose protocol plans with the sink's plan_batch_job, as Coordinator.write's does.
BATCH_QUERY_ID = "batch:pipe@0000000000000000"


def query_id_of(batch_ids: list[int] | None) -> str:
    """The query id of a scenario's log: a batch job's when its runs pick their batch ids."""
    return QUERY_ID if batch_ids is None else BATCH_QUERY_ID
NAME = "pipe"

_local = threading.local()


_WORLD: list[_WorldView | None] = [None]
_PATCH_LOCK = threading.Lock()


#: A folder :func:`file_sink` made for one schedule, as it appears in paths (left out of the trace).
_TARGET_PREFIX = re.compile(r"/\S*?/twophase-explorer-[^/\s]+/")


def _point() -> None:
    """A scheduling point: the calling actor stops here until the scheduler picks it again."""
    run: _RunView | None = getattr(_local, "run", None)
    if run is not None:
        run.point()


# ============================================================================ findings
@dataclass
class Finding:
    """One broken invariant (or liveness failure) in one schedule, with the steps that led there."""

    kind: str
    message: str
    scenario: str
    schedule: int
    choices: list[int]
    preemptions: int
    trace: list[str]
    also: list[str] = field(default_factory=list)  # what else broke later in the same schedule
    count: int = 1  # schedules that broke the same invariant (collect mode)

    @property
    def schedule_text(self) -> str:
        """The schedule as ``--replay`` takes it: the actor index per step, run-length encoded."""
        return schedule_text(self.choices)

    def render(self) -> str:
        head = (f"explorer: scenario {self.scenario!r}, schedule #{self.schedule} "
                f"({self.preemptions} preemption{'s' if self.preemptions != 1 else ''}): {self.kind}")
        return "\n".join([head, *self.trace, f"invariant broken ({self.kind}): {self.message}",
                          *(f"and later: {a}" for a in self.also),
                          f"schedule (actor index per step; --replay): {self.schedule_text}"])


def schedule_text(choices: Sequence[int]) -> str:
    """``[0, 0, 1]`` -> ``"0*2 1"``."""
    items = []
    for actor, group in itertools.groupby(choices):
        n = len(list(group))
        items.append(f"{actor}*{n}" if n > 1 else str(actor))
    return " ".join(items)


def parse_schedule(text: str) -> list[int]:
    """Inverse of :func:`schedule_text` (commas or spaces between items)."""
    out: list[int] = []
    for item in text.replace(",", " ").split():
        actor, _, times = item.partition("*")
        out += [int(actor)] * (int(times) if times else 1)
    return out


class Violation(AssertionError):
    """Raised by :func:`explore` on the first finding (unless it collects them): carries it."""

    def __init__(self, finding: Finding):
        super().__init__(finding.render())
        self.finding = finding


class TaskFailed(TwoPhaseError):
    """A task attempt failed on its executor with the sink's own error (an ``OSError``, a driver
    library's): what the driver gets is a failed Spark job."""


class _Abandon(BaseException):
    """Unwinds an actor's thread once its schedule is over (a finding stopped it)."""


@dataclass
class _Entry:
    """One line of a schedule's trace, formatted only if it is printed."""

    label: str
    op: str
    detail: Callable[[], str] | str
    preempted: str | None = None

    def text(self) -> str:
        d = self.detail() if callable(self.detail) else self.detail
        return f"{self.label}: {self.op}{(' ' + _TARGET_PREFIX.sub('', d)) if d else ''}"


# ============================================================================ the schedule, as seen from below
class _SutView(Protocol):
    """What the actors and the scheduled sink read of the sink under test (sinks.py's
    :class:`~twophase.testing.explorer.sinks.SinkUnderTest`)."""

    @property
    def sink(self) -> Callable[[Any], TwoPhaseCommitSink[Any, Any]]: ...
    @property
    def make_batch(self) -> Callable[[list[int]], Any]: ...
    @property
    def partitions(self) -> int: ...
    @property
    def sink_points(self) -> bool: ...


class _WorldView(Protocol):
    """One schedule's world as the modules below world.py use it (world.py's
    :class:`~twophase.testing.explorer.world._World`): its store's files and their checks, the trace,
    the sink under test and its target, the actors' bookkeeping."""

    uuids: int
    clock: float
    task_ids: int

    @property
    def files(self) -> dict[str, bytes]: ...
    @property
    def quiet(self) -> bool: ...
    @property
    def batches(self) -> int: ...
    @property
    def batch_ids(self) -> list[int] | None: ...
    @property
    def expected(self) -> list[int]: ...
    @property
    def retain_batches(self) -> int: ...
    @property
    def protocol_factory(self) -> Callable[..., TwoPhaseProtocol]: ...
    @property
    def sut(self) -> _SutView: ...
    @property
    def target_obj(self) -> Any: ...
    @property
    def spark_committed(self) -> set[int]: ...

    def log(self, op: str, detail: Callable[[], str] | str, key: str = "") -> None: ...
    def on_write(self, name: str, data: bytes) -> None: ...
    def on_change(self, name: str) -> None: ...


class _RunView(Protocol):
    """One actor's thread in one schedule as the modules below world.py use it (world.py's
    :class:`~twophase.testing.explorer.world._Run`)."""

    label: str

    @property
    def captured(self) -> Any: ...
    @property
    def actor(self) -> Any: ...  # its Actor (actors.py, which imports this module)

    def ready(self) -> None: ...
    def point(self) -> None: ...
