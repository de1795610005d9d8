"""The base of the crash machine (part of :mod:`twophase.testing.conformance`): the oracle.

:class:`_ConformanceChecks` compares what a reader sees (``read_committed``) with the model:
after every step no row twice and none that no committed handle carries, at quiescent points
also every row of every decided batch and no transaction left open; it names each bad row's
provenance, and checks that a handle survives its JSON round trip.  With it, the few helpers
every part of the machine uses: the driver's sink object and hypothesis draws.  Runs in the test
process (the driver's side of the harness).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from twophase.errors import HandleError
from twophase.sink import TwoPhaseCommitSink
from twophase.testing._conformance_model import Attempt, BatchModel, SinkFactory
from twophase.testing._shared import ID_SPAN, ConformanceError, note


class _ConformanceChecks:
    """The oracle of :class:`~twophase.testing.conformance.SinkConformanceMachine` (its base), with
    the driver's sink object and the hypothesis draw that its parts share."""

    # The machine's configuration and state that its parts read: set by SinkConformanceMachine
    # (class attributes, __init__, start_query) and make_state_machine; declared here for the
    # type checker only.
    sink_factory: SinkFactory
    read_committed: Callable[[], Iterable[Any]]
    make_batch: Callable[[list[int]], Any]
    make_frame: Callable[[list[int], int], Any] | None
    id_of: Callable[[Any], int]
    pending: Callable[[], Iterable[Any]] | None
    check_every_step: bool
    settle_timeout: float
    commit_retries: int
    commit_parallelism: int
    rebuild_from_config: bool
    driver_path: bool
    _frame_probed: bool
    stats: Counter
    _sink: TwoPhaseCommitSink | None
    batches: dict[int, BatchModel]
    current: BatchModel | None
    crashed: bool
    crash_point: str
    life: int
    crashes_left: int
    committed_rows: bool
    faulted: bool
    first_batch: bool
    query_name: str
    id_base: int
    pending_baseline: set[str] | None

    # ================================================================ the driver's sink, draws
    @property
    def sink(self) -> TwoPhaseCommitSink:
        """The driver's sink object: made by the first rule, dropped when the example ends."""
        if self._sink is None:
            raise RuntimeError("the conformance machine has no sink outside an example")
        return self._sink

    @sink.setter
    def sink(self, sink: TwoPhaseCommitSink) -> None:
        self._sink = sink

    def _new_sink(self, how: str) -> TwoPhaseCommitSink:
        if how == "config" and self._sink is not None:
            cls = type(self.sink)
            config = json.loads(json.dumps(self.sink.to_config()))
            return cls.from_config(config)
        sink = self.sink_factory()
        if not isinstance(sink, TwoPhaseCommitSink):
            raise ConformanceError(f"sink_factory returned {type(sink).__name__}, not a TwoPhaseCommitSink")
        return sink

    def _sink_name(self) -> str:
        return f"{type(self.sink).__name__}(kind={self.sink.kind!r})"

    @staticmethod
    def _draw(data: Any, strategy: Any, label: str, default: Any) -> Any:
        """A hypothesis draw, or ``default`` when the teardown finishes an example without drawing."""
        return default if data is None else data.draw(strategy, label=label)

    # ================================================================ checks
    def _decided_handles(self, b: BatchModel) -> list[Any]:
        """The decision's handles as a driver reads them back from the log (fresh objects from JSON)."""
        if b.prepared_json is None:
            raise ConformanceError(f"batch {b.batch_id} has no decision yet")  # the harness' own bug
        return [self.sink.decode_handle(env) for env in json.loads(b.prepared_json)]

    def _round_trip(self, executor: TwoPhaseCommitSink, handle: Any, label: str) -> str:
        """The handle as it travels: encoded on the executor, JSON text, decoded on the driver.
        Also: unknown handle versions are refused."""
        envelope = executor.encode_handle(handle)
        try:
            text = json.dumps(envelope, allow_nan=False, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise ConformanceError(f"{label}: encode_handle() is not plain JSON: {e}") from None
        back = json.loads(text)
        decoded = self.sink.decode_handle(back)
        if back.get("v") == self.sink.handle_version:
            again = json.dumps(self.sink.encode_handle(decoded), allow_nan=False, sort_keys=True)
            if again != text:
                raise ConformanceError(f"{label}: a handle does not survive a JSON round trip:\n"
                                       f"  logged:   {text}\n  re-encoded: {again}")
        bogus = dict(back, v=999)
        try:
            self.sink.decode_handle(bogus)
        except HandleError:
            pass
        else:
            raise ConformanceError(f"{label}: decode_handle accepted handle version 999, which "
                                   f"{type(self.sink).__name__} does not know; it must raise HandleError")
        return text


    def _quiescent(self) -> bool:
        return not self.crashed and self.current is None

    def _pending(self) -> set[str] | None:
        if self.pending is None:
            return None
        return {str(x) for x in self.pending()}

    def _check_aborted(self, before: set[str] | None, rec: Attempt, b: BatchModel) -> None:
        if before is None:
            return
        now = self._pending()
        assert now is not None  # ``before`` came from the same pending()
        left = now - before
        if left:
            raise ConformanceError(
                f"{rec.label(b.batch_id)} was aborted, but it left {len(left)} transaction(s) open: "
                f"{sorted(left)[:5]}. abort() must discard what the transaction wrote.")

    def _read(self) -> Counter:
        records = list(self.read_committed())
        lo, hi = self.id_base, self.id_base + ID_SPAN
        return Counter(i for i in map(self.id_of, records) if lo <= i < hi)

    def _check(self, where: str, exact: bool = False) -> None:
        """Compare what a reader sees with the model.

        Always: no row twice, no row that no committed handle carries.  At quiescent
        moments (``exact``): every row of every decided batch is there, and no
        transaction of this query is still open.
        """
        if not (exact or self.check_every_step):
            return
        allowed: dict[int, tuple[int, int]] = {}  # id -> (batch, handle index) of committed handles
        expected: set[int] = set()
        for b in self.batches.values():
            for i in b.committed_handles:
                for row in b.handle_ids[i]:
                    allowed[row] = (b.batch_id, i)
            if b.decided:
                expected.update(b.ids)
        deadline = time.monotonic() + self.settle_timeout
        while True:
            seen = self._read()
            dup = {i: c for i, c in seen.items() if c > 1}
            unexpected = sorted(set(seen) - set(allowed))
            missing = sorted(expected - set(seen)) if exact else []
            if dup or unexpected or not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.2)  # missing rows may be a visibility lag (settle_timeout); dup/unexpected never are
        problems = []
        for i in sorted(dup)[:5]:
            problems.append(f"row {i} appears {dup[i]} times ({self._provenance(i)})")
        for i in unexpected[:5]:
            owner = self._batch_of(i)
            why = ("its batch was never decided" if owner and not owner.decided else
                   "no committed handle carries it yet" if owner else "no batch of this example wrote it")
            problems.append(f"row {i} is visible but {why} ({self._provenance(i)})")
        for i in missing[:5]:
            problems.append(f"row {i} is missing although its batch was decided ({self._provenance(i)})")
        if problems:
            counts = (f"{len(dup)} duplicated, {len(unexpected)} visible too early or never decided, "
                      f"{len(missing)} missing")
            hint = ("" if not missing or dup or unexpected else
                    " If the sink's reads lag behind commits, pass settle_timeout=seconds.")
            msg = (f"{where}: exactly-once violated for {type(self.sink).__name__}: {counts}.\n  "
                   + "\n  ".join(problems) + f"\n  (last crash point: {self.crash_point or 'none'})" + hint)
            note(msg)
            raise ConformanceError(msg)
        if exact and self.pending is not None:
            now, baseline = self._pending(), self.pending_baseline
            assert now is not None and baseline is not None  # both from pending(), which is set
            left = now - baseline
            if left:
                msg = (f"{where}: {len(left)} transaction(s) are still open although every batch is committed "
                       f"or aborted: {sorted(left)[:5]}. abort_lingering must abort what failed attempts and "
                       "crashed runs left behind (open transactions hold locks or block readers).")
                note(msg)
                raise ConformanceError(msg)
        note(f"  check {'(exact) ' if exact else ''}{where}: {sum(seen.values())} rows visible, as expected")

    def _batch_of(self, row: int) -> BatchModel | None:
        for b in self.batches.values():
            if b.ids and b.ids[0] <= row <= b.ids[-1]:
                return b
        return None

    def _provenance(self, row: int) -> str:
        b = self._batch_of(row)
        if b is None:
            return "unknown row"
        wrote = [a for a in b.attempts if row in a.ids]
        state = ("decided" if b.decided else "undecided") + (", COMMITTED logged" if b.committed_logged else "")
        parts = [f"batch {b.batch_id} ({state})"]
        for a in wrote:
            parts.append(f"p{a.partition} attempt {a.attempt} run {a.life} {a.outcome}"
                         + (f" [{a.handle_desc}]" if a.handle_desc else ""))
        return "; ".join(parts)
