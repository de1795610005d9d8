"""The crash machine's model of the coordinator and its log (part of :mod:`twophase.testing.conformance`).

What the harness knows of each batch as the coordinator and the log see it
(:class:`BatchModel`), of each task attempt it ran (:class:`Attempt`), the driver's death inside
a commit (:class:`_DriverDied`), the DataFrame stand-in that tells whether a sink's
``prepare_batch`` writes from the driver (:class:`_NoFrame`), and :class:`ConformanceWarning`.
Plain data: it imports no other part of the machine, every part imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from twophase.sink import TwoPhaseCommitSink

SinkFactory = Callable[[], TwoPhaseCommitSink]

#: Batch ids of example n are n * BATCH_SPAN + k.
BATCH_SPAN = 1_000


class _DriverDied(BaseException):
    """Raised inside a commit to stop the driver there (a crash point); never caught as an error."""


class ConformanceWarning(UserWarning):
    """The run passed but did not drive the path the sink takes in a query (e.g. its ``prepare_batch``
    wants a Spark DataFrame and no ``make_frame`` was given): what was proven is named in the message."""


class _FrameNeeded(Exception):
    """Raised by :class:`_NoFrame` when the sink's ``prepare_batch`` uses the DataFrame it was given."""


class _NoFrame:
    """What the harness hands ``prepare_batch`` when it has no ``make_frame``: any use of it raises
    :class:`_FrameNeeded`, which tells the harness that the sink writes batches from the driver."""

    def _used(self, *_: Any, **__: Any) -> Any:
        raise _FrameNeeded("prepare_batch used the DataFrame")

    __getattr__ = __iter__ = __len__ = __bool__ = __getitem__ = _used


@dataclass
class Attempt:
    """One task attempt of one partition, as the harness ran it."""

    partition: int
    attempt: int
    outcome: str
    ids: list[int]
    handle_desc: str = ""
    life: int = 0
    run: str = ""

    def label(self, batch_id: int) -> str:
        return f"batch {batch_id} partition {self.partition} attempt {self.attempt}"


@dataclass
class BatchModel:
    """The coordinator's and the log's view of one batch."""

    batch_id: int
    ids: list[int]
    intent_json: str
    num_partitions: int               # as planned in the INTENT
    attempts: list[Attempt] = field(default_factory=list)
    runs: int = 0
    prepared_json: str | None = None  # the PREPARED record: the decision
    handle_ids: list[list[int]] = field(default_factory=list)      # rows of each decided handle
    committed_handles: set[int] = field(default_factory=set)       # indexes into the decision
    committed_logged: bool = False

    @property
    def decided(self) -> bool:
        return self.prepared_json is not None
