"""Conformance harness for exactly-once sinks: ``run_sink_conformance(sink_factory, read_committed)``.

Hypothesis drives any :class:`~twophase.TwoPhaseCommitSink` through batches, task
failures, driver crashes and recoveries, and checks every row is visible exactly
once.  Needs ``pip install 'twophase[testing]'`` (hypothesis); pytest is optional.
Every interleaving of the protocol's actors up to a preemption bound: :mod:`twophase.testing.explorer`.
"""

from twophase.testing.conformance import (
    ConformanceError,
    SinkConformanceMachine,
    SinkConformanceTests,
    default_id_of,
    default_make_batch,
    default_settings,
    make_state_machine,
    run_sink_conformance,
)

__all__ = [
    "ConformanceError",
    "SinkConformanceMachine",
    "SinkConformanceTests",
    "default_id_of",
    "default_make_batch",
    "default_settings",
    "make_state_machine",
    "run_sink_conformance",
]
