"""The search: the depth-first exploration of every schedule within the preemption bound
(:class:`_Explorer`, :func:`explore`), one schedule run again (:func:`replay`), and what an
exploration covered and found (:class:`Report`)."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from twophase.log import TransactionLog
from twophase.protocol import TwoPhaseProtocol
from twophase.testing.explorer._base import (
    _WORLD,
    LOG_URL,
    NAME,
    Finding,
    Violation,
    _Abandon,
    _Entry,
    _local,
    query_id_of,
)
from twophase.testing.explorer.actors import ActorContext, _final_owner
from twophase.testing.explorer.determinism import _one_cpu, deterministic
from twophase.testing.explorer.scenarios import SCENARIOS, Scenario
from twophase.testing.explorer.sinks import SinkUnderTest, memory_sink
from twophase.testing.explorer.world import _Run, _World


# ============================================================================ the explorer
@dataclass
class Report:
    """What one exploration covered, and what it found."""

    scenario: str
    preemptions: int
    batches: int
    actors: list[str]
    schedules: int = 0
    steps: int = 0
    longest: int = 0
    seconds: float = 0.0
    complete: bool = False  # every schedule within the bound was run (no max_schedules cut)
    stopped: bool = False   # stopped at a finding
    late_writes: int = 0    # records that landed in batches the log had pruned (deposed actors' late writes)
    findings: list[Finding] = field(default_factory=list)
    outcomes: dict[str, Counter[str]] = field(default_factory=dict)

    def kinds(self) -> set[str]:
        return {f.kind for f in self.findings}

    def summary(self) -> str:
        how = "all" if self.complete else "stopped at a finding" if self.stopped else "cut at max-schedules"
        lines = [f"explored {self.schedules} schedules ({how}) of "
                 f"scenario {self.scenario!r}: preemption bound {self.preemptions}, actors "
                 f"{', '.join(self.actors)}, {self.batches} batch{'es' if self.batches != 1 else ''}; "
                 f"{self.steps} steps (longest schedule {self.longest}) in {self.seconds:.1f} s"
                 + (f"; {self.late_writes} late writes into pruned batches" if self.late_writes else "")]
        for actor, outcomes in self.outcomes.items():
            lines.append(f"  {actor}: " + ", ".join(f"{k} x{n}" for k, n in outcomes.most_common()))
        if self.findings:
            lines.append("findings: " + ", ".join(f"{f.kind} ({f.count} schedules)" for f in self.findings))
        else:
            lines.append("findings: none")
        return "\n".join(lines)


@dataclass
class _Node:
    """A step of the depth-first search: who could run, who ran, the preemptions before it."""

    enabled: tuple[int, ...]
    options: list[int]
    idx: int
    preemptions: int
    did: tuple[tuple[str, str], ...] | None = None  # what the step did when first run
    done_idx: int = -1                               # ... with which option


class _Explorer:
    def __init__(self, scenario: Scenario, *, preemptions: int, sut: SinkUnderTest,
                 protocol_factory: Callable[..., TwoPhaseProtocol], retain_batches: int, step_timeout: float,
                 max_steps: int):
        self.scenario, self.bound, self.sut = scenario, preemptions, sut
        self.protocol_factory, self.retain_batches = protocol_factory, retain_batches
        self.step_timeout, self.max_steps = step_timeout, max_steps
        self._template: tuple[dict[str, bytes], int, float] | None = None

    def run(self, prefix: list[_Node], number: int, forced: Sequence[int] = ()) -> tuple[list[_Node], _World, int]:
        """Run one schedule: replay ``prefix``, then go on by default choices, recording new nodes
        (after a broken invariant, nodes without alternatives: a broken schedule is not branched).
        ``forced``: the actor to pick at each step while it can run (:func:`replay`)."""
        world = _World(self)
        _WORLD[0] = world
        nodes = list(prefix)
        preemptions = 0
        try:
            self._setup(world)
            runs = world.runs = [_Run(world, i, a) for i, a in enumerate(self.scenario.actors)]
            for r in runs:  # prologues, in order: none of them branches
                r.thread.start()
                self._step(world, r, prologue=True)
            current: _Run | None = None
            step = 0
            while not world.stopped:
                enabled = tuple(r.index for r in runs if self._enabled(world, r))
                if not enabled:
                    break
                if step >= self.max_steps:
                    world.fail("livelock", f"the schedule ran {step} steps without ending", fatal=True)
                    break
                if step < len(nodes):
                    node = nodes[step]
                    if node.enabled != enabled:
                        raise RuntimeError(f"explorer: schedule #{number} is not deterministic: at step {step + 1} "
                                           f"actors {enabled} could run, {node.enabled} on an earlier run")
                else:
                    if current is not None and current.index in enabled:
                        others = [i for i in enabled if i != current.index]
                        options = [current.index] + (others if preemptions < self.bound else [])
                    else:
                        options = list(enabled)
                    if step < len(forced) and forced[step] in enabled:
                        options = [forced[step]]
                    elif world.broken is not None:
                        options = options[:1]
                    node = _Node(enabled, options, 0, preemptions)
                    nodes.append(node)
                choice = node.options[node.idx]
                chosen = runs[choice]
                if current is not None and current.index in enabled and choice != current.index:
                    preemptions += 1
                    world.trace.append(_Entry("--", f"preempted {current.label}, {chosen.label} runs", ""))
                if not chosen.started:
                    chosen.started = True
                    chosen.captured = self._guard(world, chosen)
                world.step_ops = []
                self._step(world, chosen)
                did = tuple(world.step_ops)
                if node.did is None or node.idx != node.done_idx:
                    node.did, node.done_idx = did, node.idx
                elif node.did != did:
                    raise RuntimeError(f"explorer: schedule #{number} is not deterministic: step {step + 1} "
                                       f"({chosen.label}) did {list(did)}, on an earlier run {list(node.did)}")
                current = chosen
                step += 1
                world.check()
            if not world.stopped:
                self._finish(world)
            if world.broken is not None:
                world.trace.append(_Entry("--", "end:", world.state_text()))
        finally:
            self._abandon(world)
            _WORLD[0] = None
        return nodes, world, preemptions

    def _setup(self, world: _World) -> None:
        """The log exists and its generation is bound (no epoch taken) before any actor runs: made
        once, then copied into every schedule (with the uuid count and clock it leaves)."""
        if self._template is None:
            tlog = TransactionLog(LOG_URL, retain_batches=world.retain_batches)
            tlog.acquire(query_id_of(world.batch_ids), NAME)
            for name in [n for n in world.files if n.startswith("epochs/") or n == "lease.json"]:
                del world.files[name]
            self._template = (dict(world.files), world.uuids, world.clock)
        files, world.uuids, world.clock = self._template
        world.files = dict(files)
        world.trace.clear()
        world.step_ops.clear()

    @staticmethod
    def _guard(world: _World, r: _Run) -> Any:
        return True if r.actor.guard is None else r.actor.guard(world)

    def _enabled(self, world: _World, r: _Run) -> bool:
        if r.state != "waiting":
            return False
        return r.started or bool(self._guard(world, r))

    def _step(self, world: _World, r: _Run, *, prologue: bool = False) -> None:
        r.state = "prologue" if prologue else "running"
        r.sem.release()
        if not world.main_sem.acquire(timeout=self.step_timeout):
            world.fail("blocked", f"{r.label} did not reach its next scheduling point within {self.step_timeout:.0f} s "
                       "(it waits outside the explorer: a lock, a join, a sleep)", fatal=True)
            return
        if r.state == "done":
            self._ended(world, r)

    def _ended(self, world: _World, r: _Run) -> None:
        e = r.error
        if e is None:
            world.trace.append(_Entry(r.label, "ends", ""))
        elif isinstance(e, _Abandon):
            return
        elif isinstance(e, r.actor.expected):
            world.trace.append(_Entry(r.label, "stops:", f"{type(e).__name__}: {str(e)[:300]}"))
            if isinstance(e, r.actor.forbidden):
                world.fail("data-loss", f"{r.label} stopped with {type(e).__name__}: {str(e)[:300]}")
        else:
            world.trace.append(_Entry(r.label, "CRASHES:", f"{type(e).__name__}: {e}"))
            world.fail("unexpected-error", f"{r.label} raised {type(e).__name__} (not a TwoPhaseError): {e}")

    def _finish(self, world: _World) -> None:
        """The final owner, alone, then the end-of-schedule checks."""
        final = _Run(world, len(world.runs), _final_owner(world))
        world.runs.append(final)
        # Alone, it runs in this thread: its scheduling points only check the invariants.
        final.inline, final.started, final.in_prologue = True, True, False
        _local.run = final
        try:
            final.actor.run(ActorContext(world, final))
        except _Abandon:
            return
        except BaseException as e:  # noqa: BLE001 - judged below
            final.error = e
        finally:
            _local.run = None
            final.state = "done"
        world.check()
        if world.sut.expire is not None:
            world.sut.expire(world.target_obj)
            world.check()
        self._ended(world, final)
        if final.error is not None:
            world.fail("final-owner-failed", f"the final owner (recovery, then the batches Spark replays) "
                       f"raised {type(final.error).__name__}: {final.error}")
        world.final_check()

    def _abandon(self, world: _World) -> None:
        world.abandoned = True
        for r in world.runs:
            if r.thread.is_alive() and r.sem.locked():
                r.sem.release()
        for r in world.runs:
            if r.thread.ident is not None:
                r.thread.join(timeout=self.step_timeout)
        if world.sut.close_target is not None:
            world.sut.close_target(world.target_obj)


def explore(scenario: Scenario | str, *, preemptions: int = 2, max_schedules: int | None = None,
            sut: SinkUnderTest | None = None, protocol_factory: Callable[..., TwoPhaseProtocol] | None = None,
            collect: bool = False, retain_batches: int = 1, batches: int | None = None,
            step_timeout: float = 30.0, max_steps: int = 2000,
            progress: Callable[[str], None] | None = None, progress_every: float = 5.0,
            out: Callable[[str], None] | None = None, pin_cpu: bool = True) -> Report:
    """Run every schedule of ``scenario`` with at most ``preemptions`` preemptions (depth first).

    ``scenario``: a :class:`Scenario` or the name of one of :data:`SCENARIOS` (``batches``: how many
    batches a named one covers).  ``sut``: the sink (default: the scenario's own, else
    :func:`memory_sink`; :func:`file_sink` runs the shipped FileSink).
    ``protocol_factory(sink, tlog, *, name, query_name, committer)``: the protocol every actor runs
    (default :class:`~twophase.protocol.TwoPhaseProtocol`; a subclass to test).  On the first
    finding raises :class:`Violation` (its message is the trace), unless ``collect``: then every
    schedule runs and the report lists each kind of finding once, with its first trace.
    ``out`` gets the trace of each finding and the coverage summary (e.g. ``print``).
    ``pin_cpu``: run the calling thread and the actors' threads on one CPU while exploring (Linux;
    restored after): one runs at a time, and a hand-off between threads on one CPU costs about a
    quarter of one between two.
    """
    scenario = _scenario(scenario, batches)
    explorer = _Explorer(scenario, preemptions=preemptions, sut=sut or _default_sut(scenario),
                         protocol_factory=protocol_factory or TwoPhaseProtocol, retain_batches=retain_batches,
                         step_timeout=step_timeout, max_steps=max_steps)
    report = Report(scenario.name, preemptions, scenario.batches, [a.name for a in scenario.actors])
    t0 = last = time.monotonic()
    found: dict[str, Finding] = {}
    stack: list[_Node] = []
    with deterministic(), _sut_patches(explorer.sut), _one_cpu(pin_cpu):
        while True:
            number = report.schedules + 1
            stack, world, used = explorer.run(stack, number)
            report.schedules = number
            report.steps += len(stack)
            report.longest = max(report.longest, len(stack))
            report.late_writes += world.late_writes
            for r in world.runs[:len(scenario.actors)]:
                outcome = ("never ran" if not r.started else "ended" if r.error is None
                           else type(r.error).__name__ if not isinstance(r.error, _Abandon) else "cut off")
                report.outcomes.setdefault(r.actor.name, Counter())[outcome] += 1
            if world.broken is not None:
                kind, message = world.broken
                if kind in found:
                    found[kind].count += 1
                else:
                    finding = Finding(kind, message, scenario.name, number,
                                      [n.options[n.idx] for n in stack], used,
                                      [f"{i:4d}. {e.text()}" for i, e in enumerate(world.trace, 1)],
                                      list(world.also))
                    found[kind] = finding
                    report.findings.append(finding)
                    if out is not None:
                        out(finding.render())
                    if not collect or kind == "blocked":  # (a thread left blocked: nothing after is sure)
                        report.seconds, report.stopped = time.monotonic() - t0, True
                        if out is not None:
                            out(report.summary())
                        if collect:
                            return report
                        raise Violation(finding)
            # backtrack: the deepest step with a choice not tried yet
            while stack:
                node = stack[-1]
                node.idx += 1
                if node.idx < len(node.options):
                    break
                stack.pop()
            if not stack:
                report.complete = True
                break
            if max_schedules is not None and report.schedules >= max_schedules:
                break
            now = time.monotonic()
            if progress is not None and now - last >= progress_every:
                last = now
                progress(f"explorer: {report.schedules} schedules of {scenario.name!r} in {now - t0:.0f} s, "
                         f"backtracking at step {len(stack)}, findings: {', '.join(found) or 'none'}")
    report.seconds = time.monotonic() - t0
    if out is not None:
        out(report.summary())
    return report


def replay(scenario: Scenario | str, choices: Sequence[int], *, batches: int | None = None,
           sut: SinkUnderTest | None = None, protocol_factory: Callable[..., TwoPhaseProtocol] | None = None,
           retain_batches: int = 1, step_timeout: float = 30.0, max_steps: int = 2000) -> tuple[list[str], str | None]:
    """Run one schedule: at each step the actor ``choices`` names (an index into the scenario's
    actors; a :class:`Finding`'s ``choices``) while it can run, else the default one.  Returns the
    numbered trace and the finding's message (or None)."""
    scenario = _scenario(scenario, batches)
    explorer = _Explorer(scenario, preemptions=len(choices), sut=sut or _default_sut(scenario),
                         protocol_factory=protocol_factory or TwoPhaseProtocol, retain_batches=retain_batches,
                         step_timeout=step_timeout, max_steps=max_steps)
    with deterministic(), _sut_patches(explorer.sut):
        _, world, _ = explorer.run([], 1, forced=choices)
        trace = [f"{i:4d}. {e.text()}" for i, e in enumerate(world.trace, 1)]
    return trace, None if world.broken is None else f"{world.broken[0]}: {world.broken[1]}"


def _sut_patches(sut: SinkUnderTest) -> contextlib.AbstractContextManager[Any]:
    return sut.patches() if sut.patches is not None else contextlib.nullcontext()


def _default_sut(scenario: Scenario) -> SinkUnderTest:
    return scenario.sut() if scenario.sut is not None else memory_sink()


def _scenario(scenario: Scenario | str, batches: int | None) -> Scenario:
    if not isinstance(scenario, str):
        return scenario
    try:
        _, build, default = SCENARIOS[scenario]
    except KeyError:
        raise ValueError(f"no scenario {scenario!r}; known: {', '.join(SCENARIOS)}") from None
    return build(batches if batches is not None else default)
