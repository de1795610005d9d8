"""The ownership part of the conformance harness: the real protocol, two coordinators, late actors.

Where :mod:`twophase.testing.conformance` models the coordinator's steps, this state machine runs
the protocol itself (:class:`twophase.protocol.TwoPhaseProtocol`, or the ``protocol_factory`` a
coordinator author passes) on a real :class:`~twophase.log.TransactionLog` in a temporary folder,
with the sink's executor methods run in-process on pickled copies of the sink (one per task
attempt).  On top of task failures and driver crashes it plays what issue 25 lists:

- **takeover**: coordinator A is deposed in the middle of a batch (with its INTENT held on the
  wire, after its INTENT, after its tasks pre-committed, or with its decision held on the wire);
  coordinator B (a new log object, ``takeover=True``) runs the batch; A's held actions land at a
  drawn point of B's run: its INTENT (which then finds B's record: A must stop there), its
  decision, its failure cleanup, optionally a late recovery of its own;
- **late task attempts**: an attempt of a decided ballot's partition run again (the same attempt
  number, or the next one: a stage retry, whose attempt numbers start again) between the decision
  and the commits, after the commits, or batches later; its leftovers must be gone within two
  batches and it must never destroy decided data;
- **a second pipeline on one target**: another log (another pipeline) or a new generation of the
  same log writes the same batch ids to the same target.

The truth is the log itself: a reader must see exactly the rows of the handles of commit
decisions (a batch decided twice is reported as such), each once.

The public path: :func:`run_ownership_conformance`, :func:`make_ownership_machine` and the
defaults live here; the machine's parts beside it: what they share
(:mod:`twophase.testing._ownership_common`), the coordinators and tasks
(:mod:`twophase.testing._ownership_processes`), the checks (:mod:`twophase.testing._ownership_checks`),
a batch run (:mod:`twophase.testing._ownership_batches`) and the state machine with its rules
(:mod:`twophase.testing._ownership_machine`).  Every name is re-exported here.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from twophase.sink import TwoPhaseCommitSink
from twophase.testing._ownership_common import _EXPECTED as _EXPECTED
from twophase.testing._ownership_common import _OUTCOMES as _OUTCOMES
from twophase.testing._ownership_common import BATCH_SPAN as BATCH_SPAN
from twophase.testing._ownership_common import CRASH_POINTS as CRASH_POINTS
from twophase.testing._ownership_common import LATE_WHEN as LATE_WHEN
from twophase.testing._ownership_common import PAUSES as PAUSES
from twophase.testing._ownership_common import RELEASES as RELEASES
from twophase.testing._ownership_common import _deferred as _deferred
from twophase.testing._ownership_common import _Died as _Died
from twophase.testing._ownership_common import _Plan as _Plan
from twophase.testing._ownership_common import _test_thread as _test_thread
from twophase.testing._ownership_common import flush_notes as flush_notes
from twophase.testing._ownership_common import note as note
from twophase.testing._ownership_machine import OwnershipMachine
from twophase.testing._ownership_processes import _Coord as _Coord
from twophase.testing._ownership_processes import _DyingCommitter as _DyingCommitter
from twophase.testing._ownership_processes import _FaultyStore as _FaultyStore
from twophase.testing._ownership_processes import _Work as _Work

# The names both state machines use (twophase/testing/_shared.py): re-exported here.
from twophase.testing._shared import ABORT as ABORT
from twophase.testing._shared import DIE_AFTER_PRE_COMMIT as DIE_AFTER_PRE_COMMIT
from twophase.testing._shared import DIE_MID_WRITE as DIE_MID_WRITE
from twophase.testing._shared import ID_SPAN as ID_SPAN
from twophase.testing._shared import MAX_TASK_ATTEMPTS as MAX_TASK_ATTEMPTS
from twophase.testing._shared import PRE_COMMIT as PRE_COMMIT
from twophase.testing._shared import ConformanceError, _format_stats, check_reach, default_settings
from twophase.testing._shared import _close as _close
from twophase.testing._shared import _dumps_sink as _dumps_sink
from twophase.testing._shared import _span as _span
from twophase.testing._shared import _split as _split
from twophase.testing._shared import _story as _story
from twophase.testing._shared import default_id_of as default_id_of
from twophase.testing._shared import default_make_batch as default_make_batch
from twophase.testing._shared import example_id_base as example_id_base

if TYPE_CHECKING:
    import hypothesis
    from hypothesis import stateful
else:
    from twophase._deps import require

    hypothesis = require("hypothesis", "twophase.testing")
    stateful = require("hypothesis.stateful", "twophase.testing")

_log = logging.getLogger("twophase.testing")


def make_ownership_machine(sink_factory: Callable[[], TwoPhaseCommitSink], read_committed: Callable[[], Iterable[Any]],
                           *, protocol_factory: Callable[..., Any] | None = None, **options: Any
                           ) -> type[OwnershipMachine]:
    """The configured ownership state machine class (options as for ``run_sink_conformance``)."""
    import itertools
    import random

    from twophase.protocol import TwoPhaseProtocol

    attrs: dict[str, Any] = {
        "sink_factory": staticmethod(sink_factory),
        "read_committed": staticmethod(read_committed),
        "protocol_factory": staticmethod(protocol_factory or TwoPhaseProtocol),
        "_run_token": f"{random.getrandbits(24):06x}",
        "_examples": itertools.count(1),
        "_id_floor": None,
        "stats": Counter(),
        "failures": [],
        "first_story": [],
    }
    for k, v in options.items():
        if v is None:
            continue
        attrs[k] = staticmethod(v) if callable(v) and k in ("make_batch", "id_of", "reset", "pending") else v
    return type("SinkOwnershipConformance", (OwnershipMachine,), attrs)


def run_ownership_conformance(sink_factory: Callable[[], TwoPhaseCommitSink],
                              read_committed: Callable[[], Iterable[Any]], *, settings: Any = None,
                              max_examples: int | None = None, steps: int | None = None, seed: int | None = None,
                              protocol_factory: Callable[..., Any] | None = None, min_useful_share: float = 0.3,
                              **options: Any) -> dict[str, int]:
    """Run the ownership machine alone (``run_sink_conformance`` runs it after the crash machine).

    Fails as degenerate (at any number of examples) if fewer than ``ceil(min_useful_share *
    examples)`` examples committed rows of their own before their closing batches, or played a
    takeover: every example's first step is a takeover, so a working run has both in every example."""
    machine = make_ownership_machine(sink_factory, read_committed, protocol_factory=protocol_factory, **options)
    s = settings if settings is not None else default_settings(max_examples=DEFAULT_EXAMPLES, steps=DEFAULT_STEPS)
    overrides: dict[str, Any] = {k: v for k, v in (("max_examples", max_examples), ("stateful_step_count", steps))
                                 if v is not None}
    if overrides:
        s = hypothesis.settings(s, **overrides)
    if seed is not None:
        machine = hypothesis.seed(seed)(machine)
    try:
        stateful.run_state_machine_as_test(machine, settings=s)
    except hypothesis.errors.Flaky as e:
        if not machine.failures:
            raise
        err = ConformanceError(f"{machine.failures[0]}\n(This failure did not happen again when hypothesis "
                               "replayed the same steps: the sink or the protocol answered differently, the mark "
                               "of a race. The notes below are the failing run's story.)")
        for line in machine.first_story:
            err.add_note(line)
        raise err from e
    except ConformanceError as e:
        if seed is not None:
            e.add_note(f"reproduce: the same call with seed={seed}")
        raise
    stats = dict(machine.stats)
    _log.info("ownership conformance run of %s: %s", machine.query_prefix, _format_stats(stats))
    check_reach(stats, min_useful_share, {
        "examples_with_committed_rows": "committed a batch with rows of their own",
        "examples_with_takeover": "played a takeover of a deposed coordinator's batch",
    }, "Check that the protocol's batches and takeovers are not failing (see the run's notes).", half="ownership")
    return stats


#: The ownership machine's defaults (examples, steps per example).
DEFAULT_EXAMPLES = 25
DEFAULT_STEPS = 6
