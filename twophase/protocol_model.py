"""What the protocol and the engine that runs it exchange, without Spark.

:class:`BatchWork` is what an engine supplies for one batch (the coordinator's Spark glue in
``twophase.coordinator``, the data source's plan step, or a test harness that runs tasks
in-process); :class:`BatchProgress` the figures of one batch it gets back; :class:`OpenedBallot`
a ballot a coordinator opened, what its tasks write under.  Also ``_InBackground``, the thread in
which :class:`~twophase.protocol.TwoPhaseProtocol` runs work beside a batch's tasks (the
explorer's ``deterministic()`` replaces it where it is called: ``twophase.protocol``).  All run
on the driver; :mod:`twophase.protocol` re-exports them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol


@dataclass
class BatchProgress:
    """Figures of one batch, as logged and kept in ``Coordinator.last_progress``."""

    name: str
    batch_id: int
    query_id: str | None
    action: str  # "committed" | "recommitted" | "skipped"
    rows: int = 0
    handles: int = 0
    aborted_lingering: int = 0
    intent_ms: float = 0.0
    prepare_ms: float = 0.0
    log_ms: float = 0.0
    commit_ms: float = 0.0
    total_ms: float = 0.0
    timestamp: float = field(default_factory=time.time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class BatchWork(Protocol):
    """What the engine does for one batch; the protocol decides when.

    Optionally ``run_again(error) -> str | None``: after a ballot whose tasks failed (nothing
    decided; the ballot is closed and its leftovers aborted), a reason why a new ballot would
    not fail the same way (the coordinator's: the rows path refused a row, and the next ballot
    takes the Arrow path), or None.  The batch then runs again, at most ``_MAX_REPLANS`` times.
    """

    def partitions(self, planned: int | None) -> int:
        """How many transactions (partitions) this ballot writes.  ``planned``: what the batch's
        last ballot planned (a re-run stays inside it, so a sink's bounded pool of transaction
        names keeps its size), or ``None`` for a batch's first ballot."""

    def prepare(self, query_name: str, batch_id: int, intent: dict[str, Any], run: str) -> list[dict[str, Any]]:
        """Run every partition's transaction; return one result per pre-committed partition:
        ``{"partition", "attempt", "rows", "handle"}`` (the handle as the sink encoded it)."""

    def source_offsets(self, batch_id: int) -> dict[str, Any] | None:
        """The source offsets to record in the decision (``None``: none known)."""


@dataclass
class OpenedBallot:
    """A ballot this coordinator opened for a batch (its INTENT logged): what its tasks need
    (``query_name``, ``intent``, ``run``) and what its decision names."""

    batch_id: int
    number: int
    intent: dict[str, Any]
    run: str
    query_name: str


class _InBackground:
    """Run ``fn`` in a thread now (a daemon unless ``daemon=False``: then the interpreter waits for
    it at exit); :meth:`result` waits for it and raises what it raised."""

    def __init__(self, fn: Callable[[], Any], *, name: str = "twophase-fence", daemon: bool = True):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=daemon)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result()
            self._error = e

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
