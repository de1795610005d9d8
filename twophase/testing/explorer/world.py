"""One schedule: an actor's thread (:class:`_Run`, stopping at every scheduling point until the
scheduler picks it) and the schedule's world (:class:`_World`: the store's files, the sink's target,
the trace, and the checks of every invariant, after each step and at the end)."""

from __future__ import annotations

import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from twophase.log import TransactionLog, parse_batch_name
from twophase.testing.explorer._base import _QUIET_URL, _TARGET_PREFIX, _Abandon, _Entry, _local
from twophase.testing.explorer.actors import Actor, ActorContext, _batch_of, rows_of
from twophase.testing.explorer.points import _body, _short
from twophase.testing.explorer.sinks import MemoryTarget

if TYPE_CHECKING:
    from twophase.protocol import TwoPhaseProtocol
    from twophase.testing.explorer.scenarios import Scenario
    from twophase.testing.explorer.sinks import SinkUnderTest


class _ExplorerView(Protocol):
    """What a schedule reads of its explorer (search.py's
    :class:`~twophase.testing.explorer.search._Explorer`, which imports this module)."""

    @property
    def scenario(self) -> Scenario: ...
    @property
    def sut(self) -> SinkUnderTest: ...
    @property
    def protocol_factory(self) -> Callable[..., TwoPhaseProtocol]: ...
    @property
    def retain_batches(self) -> int: ...
    @property
    def max_steps(self) -> int: ...

# ============================================================================ one schedule
class _Run:
    """One actor's thread in one schedule."""

    def __init__(self, world: _World, index: int, actor: Actor):
        self.world, self.index, self.actor = world, index, actor
        self.label = actor.name
        self.sem = threading.Lock()  # a binary semaphore, held while the actor must wait (C-level: fast)
        self.sem.acquire()
        self.state = "new"          # new | prologue | waiting | running | done
        self.started = False        # past ready(), picked at least once
        self.in_prologue = True
        self.free_point = False     # its first step runs through its first scheduling point
        self.inline = False         # runs in the explorer's own thread (the final owner, alone)
        self.steps = 0
        self.captured: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name=f"explorer-{actor.name}", daemon=True)

    def _main(self) -> None:
        _local.run = self
        self.sem.acquire()
        try:
            if self.world.abandoned:
                raise _Abandon()
            if not self.actor.prologue:
                self.ready()
            self.actor.run(ActorContext(self.world, self))
        except BaseException as e:  # noqa: BLE001 - judged by the explorer
            self.error = e
        finally:
            self.state = "done"
            if not self.world.abandoned:
                self.world.main_sem.release()

    def ready(self) -> None:
        if not self.in_prologue:
            return
        self.in_prologue = False
        self.state = "waiting"
        self.world.main_sem.release()
        self.sem.acquire()
        if self.world.abandoned:
            raise _Abandon()
        self.free_point = True

    def point(self) -> None:
        if self.inline:  # alone: nothing to schedule; the last call's effects are checked
            self.world.check()
            self.steps += 1
            if self.steps > self.world.explorer.max_steps:
                self.world.fail("livelock", f"{self.label} ran {self.steps} steps without ending", fatal=True)
                raise _Abandon()
            return
        if self.world.abandoned:
            raise _Abandon()
        if self.in_prologue:
            return
        if self.free_point:
            self.free_point = False
            return
        self.state = "waiting"
        self.world.main_sem.release()
        self.sem.acquire()
        if self.world.abandoned:
            raise _Abandon()


class _World:
    """One schedule: the store's files, the sink's target, the actors' threads, the checks."""

    def __init__(self, explorer: _ExplorerView):
        self.explorer = explorer
        self.batches = explorer.scenario.batches
        self.batch_ids = explorer.scenario.batch_ids
        self.expected = explorer.scenario.expected_batches()
        self.retain_batches = explorer.retain_batches
        self.protocol_factory = explorer.protocol_factory
        self.files: dict[str, bytes] = {}
        sut = explorer.sut
        self.sut = sut
        self.target_obj = sut.new_target()
        self.target = self.target_obj if isinstance(self.target_obj, MemoryTarget) else None
        self.main_sem = threading.Lock()  # held while an actor runs; released when it stops
        self.main_sem.acquire()
        self.abandoned = False
        self.trace: list[_Entry] = []
        self.step_ops: list[tuple[str, str]] = []  # what the current step did (replays must do the same)
        self.uuids = 0
        self.clock = 1_700_000_000.0
        self.task_ids = 0
        self.spark_committed: set[int] = set()
        self.runs: list[_Run] = []
        self.broken: tuple[str, str] | None = None
        self.also: list[str] = []   # later failures of the same schedule (after the first)
        self.stopped = False        # a failure the schedule cannot go on after (blocked, livelock)
        # the checks' memory: (generation, batch) -> {decision key: [ballot, epoch, handle keys, void]}
        self.decisions: dict[tuple[int, int], dict[str, list[Any]]] = {}
        self.pruned: dict[int, set[int]] = {}  # generation -> batches the log said were pruned
        self.late_writes = 0                    # records that landed in pruned batches
        self.envelopes: dict[str, Any] = {}     # handle key -> the handle as a decision holds it
        self.lost_seen: set[Any] = set()        # decided files (transactions) found gone (reported once each)
        self.quiet = False                      # the checks read the log (no uuid, no clock)
        self._target_events = 0

    # -- trace and checks
    def log(self, op: str, detail: Callable[[], str] | str, key: str = "") -> None:
        run: _Run | None = getattr(_local, "run", None)
        label = run.label if run is not None and run.world is self else "setup"
        self.trace.append(_Entry(label, op, detail))
        self.step_ops.append((op, key))

    def fail(self, kind: str, message: str, *, fatal: bool = False) -> None:
        """Record a broken invariant.  The schedule still runs to its end (without branching any
        more), so that the trace shows what the break leads to; later ones are kept as ``also``."""
        self.stopped = self.stopped or fatal
        message = _TARGET_PREFIX.sub("", message)
        if self.broken is None:
            self.broken = (kind, message)
        elif len(self.also) < 5 and (kind, message) != self.broken and f"{kind}: {message}" not in self.also:
            self.also.append(f"{kind}: {message}")

    def decided_handles(self) -> set[str]:
        out: set[str] = set()
        for entries in self.decisions.values():
            for _ballot, _epoch, keys, void in entries.values():
                if not void:
                    out.update(keys)
        return out

    def decided_batches(self) -> set[int]:
        return {b for (g, b), entries in self.decisions.items() if any(not e[3] for e in entries.values())}

    def log_pruned(self, generation: int) -> set[int]:
        """The batches the log itself says were committed and pruned, as any log object reads them
        now (``TransactionLog.pruned``, or the single low-water mark of older versions)."""
        self.quiet = True
        try:
            reader = TransactionLog(_QUIET_URL, readonly=True)
            pruned = getattr(reader, "pruned", None)
            if pruned is not None:
                return {b for first, last in pruned(generation, fresh=True) for b in range(int(first), int(last) + 1)}
            low = reader.low_water(generation)
            return set(range(int(low) + 1)) if low is not None else set()
        finally:
            self.quiet = False

    def on_change(self, name: str) -> None:
        """After a write or delete of a generation's file other than a batch record (the log's
        pruned marks, whatever their layout): the log never forgets a batch it said was pruned."""
        folder, _, leaf = name.partition("/")
        if not (folder.startswith("g") and folder[1:].isdigit()) or parse_batch_name(leaf) is not None:
            return
        generation = int(folder[1:])
        now, before = self.log_pruned(generation), self.pruned.get(generation, set())
        forgotten = sorted(before - now)
        if forgotten:
            self.fail("pruned-forgotten", f"the log no longer says batches {forgotten} of generation {generation} were "
                      f"pruned ({name}): a late write there is no longer refused (its low-water mark moved back)")
        self.pruned[generation] = before | now

    def on_write(self, name: str, data: bytes) -> None:
        """Checks of the log's records, as they land."""
        self.on_change(name)
        folder, _, leaf = name.rpartition("/")
        parsed = parse_batch_name(leaf)
        if parsed is None or not folder.startswith("g") or not folder[1:].isdigit():
            return
        bid, state, ballot = parsed
        generation = int(folder[1:])
        body = _body(data)
        if bid in self.pruned.get(generation, ()):
            # A late write of a deposed coordinator into a batch committed and pruned: garbage, never
            # a decision (committing it would be "visible-undecided"; its rows twice "duplicate-row").
            self.late_writes += 1
            self.log("note", f"{_short(name)} landed in a batch the log pruned: a late write, not a decision")
            return
        entries = self.decisions.setdefault((generation, bid), {})
        if state == "prepared" and body.get("outcome") == "commit":
            keys = [_handle_key(h) for h in body.get("handles") or []]
            for h in body.get("handles") or []:
                self.envelopes.setdefault(_handle_key(h), h)
            entries[f"{name}#{body.get('writer')}"] = [ballot, body.get("epoch"), keys, False]
            live = sorted((e[0], e[1]) for e in entries.values() if not e[3])
            if len(live) > 1:
                self.fail("two-decisions", f"batch {bid} (generation {generation}) holds commit decisions in "
                          + " and ".join(f"ballot {b} (epoch {e})" for b, e in live)
                          + ("" if len({b for b, _ in live}) == len(live) else
                             ": one slot decided twice, its first decision pruned"))
        elif state == "void":
            for e in entries.values():
                if e[0] == ballot:
                    e[3] = True
        elif state == "prepared":  # an abort: who closes whose ballot
            intent = self.files.get(f"{folder}/batch-{bid:012d}.intent{f'.{ballot}' if ballot else ''}.json")
            opener, closer = _body(intent).get("epoch"), body.get("epoch")
            if opener is not None and closer is not None and int(closer) < int(opener):
                self.fail("older-closed-newer", f"ballot {ballot} of batch {bid}, opened by epoch {opener}, was "
                          f"closed by epoch {closer} (an older coordinator, deposed): "
                          f"{str(body.get('reason'))[:120]}")

    def check(self) -> None:
        """The invariants that hold after every step."""
        if self.target is not None:
            events = self.target.events
            decided = None
            while self._target_events < len(events):
                ev, key, before = events[self._target_events]
                self._target_events += 1
                decided = self.decided_handles() if decided is None else decided
                if ev == "commit" and key not in decided:
                    self.fail("visible-undecided", f"transaction {key} was made visible, but no commit decision "
                              "names it")
                elif ev == "abort" and key in decided:
                    self.fail("decided-aborted", f"transaction {key} ({before}) was aborted, but a commit "
                              "decision names it")
        if self.sut.lost is not None and self.envelopes:
            decided = self.decided_handles()
            found = [x for x in self.sut.lost(self.target_obj, [self.envelopes[k] for k in sorted(decided)])
                     if x not in self.lost_seen]
            self.lost_seen.update(found)
            gone = [x for x in found if isinstance(x, str)]
            if gone:
                self.fail("decided-aborted", f"a commit decision names {', '.join(gone)}, which is neither staged "
                          "nor visible: deleted after the batch was decided")
            for kind, message in (x for x in found if isinstance(x, tuple)):  # a sink's own kind and words
                self.fail(kind, message)
        seen = Counter(self.sut.visible(self.target_obj))
        twice = sorted(i for i, n in seen.items() if n > 1)
        if twice:
            self.fail("duplicate-row", f"row ids {twice} are visible {', '.join(str(seen[i]) for i in twice)} times")
        undecided = sorted({_batch_of(i) for i in seen} - self.decided_batches())
        if undecided:
            self.fail("visible-undecided", f"rows of batches {undecided} are visible, and no commit decision of "
                      "theirs was ever written")

    def state_text(self) -> str:
        shown = sorted(self.sut.visible(self.target_obj))
        left = self.sut.leftovers(self.target_obj) if self.sut.leftovers is not None else []
        return f"visible rows {shown}" + (f"; open or pre-committed: {', '.join(left)}" if left else "")

    def final_check(self) -> None:
        seen = Counter(self.sut.visible(self.target_obj))
        want = Counter(i for b in self.expected for i in rows_of(b))
        if seen != want:
            missing = sorted((want - seen).elements())
            extra = sorted((seen - want).elements())
            self.fail("rows-not-exactly-once", "after the final recovery and replays"
                      + (f", rows {missing} are missing" if missing else "")
                      + (f", rows {extra} are visible once too often" if extra else "")
                      + f" (visible: {sorted(seen.elements())})")
        if self.sut.leftovers is not None:
            left = self.sut.leftovers(self.target_obj)
            if left:
                self.fail("leftovers", f"after the final recovery and one more batch, still open or pre-committed: "
                          f"{', '.join(left)}")


def _handle_key(envelope: Any) -> str:
    data = envelope.get("data") if isinstance(envelope, dict) else None
    if isinstance(data, dict) and "txn" in data:
        return str(data["txn"])
    return json.dumps(envelope, sort_keys=True)
