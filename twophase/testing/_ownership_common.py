"""What the parts of the ownership machine share (part of :mod:`twophase.testing.ownership`).

The draw tables (crash points, where coordinator A is deposed and where its held actions land,
when a late task attempt runs), the notes that a deposed coordinator's thread keeps until the
test's thread takes them, the driver's death (:class:`_Died`) and a batch run's drawn plan
(:class:`_Plan`).  It imports no other part of the machine.
"""

from __future__ import annotations

import threading

from twophase.errors import TwoPhaseError
from twophase.testing._shared import ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE, PRE_COMMIT
from twophase.testing._shared import note as _note_here

#: Batch ids of example n are n * BATCH_SPAN + k (examples share the sink's target).
BATCH_SPAN = 1_000
_OUTCOMES = (PRE_COMMIT,) * 5 + (ABORT, ABORT, DIE_AFTER_PRE_COMMIT, DIE_MID_WRITE)
#: Where the driver dies inside a batch (the names of twophase/crash.py).
CRASH_POINTS = ("after_intent", "after_pre_commit", "before_prepared_logged", "after_prepared_logged",
                "mid_commit", "after_commit")
#: Where coordinator A is deposed (paused) in the middle of its batch (``intent_on_wire``: its
#: INTENT's create is held, and lands after B opened the same ballot).
PAUSES = ("after_intent", "tasks_pre_committed", "decision_on_wire", "intent_on_wire")
#: Where in B's run A's held actions land.
RELEASES = ("after_b_intent", "after_b_decision", "after_b_commit", "after_b_finished")
#: When a late task attempt of a batch runs.
LATE_WHEN = ("between_decision_and_commit", "after_commit")
#: Exceptions a deposed or failed coordinator may end with (anything else is reported).
_EXPECTED = (TwoPhaseError,)


_test_thread: list[int] = [0]
_deferred: list[str] = []


def note(msg: str) -> None:
    """A hypothesis note from the test's thread; from a deposed coordinator's thread, kept until
    the test's thread takes it (hypothesis notes belong to the test's thread)."""
    if threading.get_ident() == _test_thread[0]:
        flush_notes()
        _note_here(msg)
    else:
        _deferred.append(msg)


def flush_notes() -> None:
    while _deferred:
        _note_here(_deferred.pop(0))


class _Died(BaseException):
    """The driver dies here: raised through the protocol, never handled by it."""


class _Plan:
    """Every choice of one batch run, drawn in the test's thread before the run starts (a paused
    coordinator's tasks run in another thread, which must not draw)."""

    def __init__(self, parts: int, outcomes: list[list[str]], chunks: int):
        self.parts, self.outcomes, self.chunks = parts, outcomes, chunks
