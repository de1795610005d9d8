"""Kill a real driver process again and again, restart it, and count records by id afterwards.

Used by ``twophase demo``, by the project's crash tests, and by users who want to
see their own pipeline survive crashes.  The driver is a command (normally a
Python script running a streaming query with ``trigger(availableNow=True)``) that
exits 0 once all its input is committed.  Each run either arms a named crash
point (``TWOPHASE_CRASH_AT``: the driver dies by ``os._exit`` there) or is
SIGKILLed, with its whole process group (Python driver, Spark JVM, Python
workers: a machine dying), after a random delay.  Finally the driver runs
without faults until it completes.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from twophase import crash

#: The crash points where a sink's state differs, for kill tests that cannot afford every point:
#: ``after_pre_commit`` (an executor dies with its transaction pre-committed: the task is retried),
#: ``before_prepared_logged`` (every transaction pre-committed, the batch undecided: recovery
#: aborts them), ``after_prepared_logged`` (decided, nothing committed: recovery commits every
#: handle) and ``mid_commit`` (decided, some handles committed: recovery commits again what is
#: already committed, and the rest).  The other points are the protocol's alone (the sink is in
#: one of these states there, or idle), so one pipeline that gets every point (``twophase demo``,
#: tests/test_files_chaos.py) covers them for all sinks.
SINK_POINTS = ("after_pre_commit", "before_prepared_logged", "after_prepared_logged", "mid_commit")


@dataclass
class Run:
    """One start of the driver and how it ended."""

    number: int
    fault: str  # "crash:<point>", "sigkill@<s>s" or "none"
    exit_code: int | None
    seconds: float
    completed: bool
    #: "completed", "crash point fired", "killed", "finished before the fault" or "failed": a
    #: crash point counts as fired only if the process that reached it wrote the crash log,
    #: so an exit 137 from anything else (the OOM killer, a stray kill) is a failure.
    outcome: str = ""
    fired: list[str] = field(default_factory=list)  # "<point> <batch> <pid>" lines of the crash log
    #: The ``progress_probe`` counter when the run ended (None without a probe): a SIGKILL that
    #: landed mid-work ended its run below the count the completing run reached.
    progress: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Verdict:
    """Records in vs records out, by unique id."""

    records_in: int
    records_out: int
    lost: int
    duplicated: int
    unexpected: int
    lost_sample: list[Any]
    duplicated_sample: list[Any]

    @property
    def exactly_once(self) -> bool:
        return self.lost == 0 and self.duplicated == 0 and self.unexpected == 0

    def to_dict(self) -> dict[str, Any]:
        return dict(asdict(self), exactly_once=self.exactly_once)


def verify(expected_ids: Iterable[Any], actual_ids: Iterable[Any]) -> Verdict:
    """Compare ids written by the source with ids found in the committed output."""
    exp = Counter(expected_ids)
    act = Counter(actual_ids)
    if any(c > 1 for c in exp.values()):
        raise ValueError("expected ids must be unique")
    lost = [i for i in exp if i not in act]
    dup = [i for i, c in act.items() if c > 1 and i in exp]
    unexpected = [i for i in act if i not in exp]
    return Verdict(
        records_in=sum(exp.values()), records_out=sum(act.values()), lost=len(lost),
        duplicated=sum(act[i] - 1 for i in dup), unexpected=sum(act[i] for i in unexpected),
        lost_sample=sorted(lost, key=str)[:10], duplicated_sample=sorted(dup, key=str)[:10])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_once(cmd: Sequence[str], *, env: dict[str, str] | None = None, crash_at: str | None = None,
             kill_after: float | None = None, timeout: float = 600.0, log_file=None,
             crash_log: str | None = None,
             progress_probe: Callable[[], int] | None = None) -> tuple[int | None, float]:
    """Start the driver once; arm ``crash_at`` or SIGKILL its process group after ``kill_after`` s.

    With ``progress_probe`` (a counter of work done, e.g. records in the transaction log)
    the ``kill_after`` clock starts only once the counter moves: the kill lands while
    batches flow, not while the JVM starts.  ``crash_log``: the file crash points append
    to (``TWOPHASE_CRASH_LOG``), in the driver and its executors.

    Returns (exit code, seconds).  The process group is always killed at the end,
    so no JVM or worker of a dead driver outlives it.
    """
    full_env = dict(os.environ, **(env or {}))
    full_env.pop(crash.ENV, None)
    full_env.pop(crash.LOG_ENV, None)
    # A stray pause plan would stop a kill test's driver for good: only the run's own faults apply.
    full_env.pop(crash.PAUSE_ENV, None)
    full_env.pop(crash.PAUSE_LOG_ENV, None)
    if crash_at:
        full_env[crash.ENV] = crash_at
    if crash_log:
        full_env[crash.LOG_ENV] = crash_log
    t0 = time.monotonic()
    proc = subprocess.Popen(list(cmd), env=full_env, start_new_session=True, stdin=subprocess.DEVNULL,
                            stdout=log_file or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        if kill_after is not None and progress_probe is not None:
            base = progress_probe()
            while proc.poll() is None and progress_probe() <= base and time.monotonic() - t0 < timeout:
                time.sleep(0.1)
        code = proc.wait(timeout=kill_after if kill_after is not None else timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        code = proc.wait()
        if kill_after is None:
            raise TimeoutError(f"driver did not finish within {timeout:.0f}s: {' '.join(cmd)}") from None
    finally:
        _kill_group(proc)
    return code, time.monotonic() - t0


def _outcome(label: str, code: int | None, fired: list[str]) -> str:
    if label.startswith("crash:"):
        point = label.split(":", 2)[1]
        if any(line.split(" ", 1)[0] == point for line in fired):
            return "crash point fired"
        return "finished before the fault" if code == 0 else "failed"
    if label.startswith("sigkill"):
        if code == -signal.SIGKILL:
            return "killed"
        return "finished before the fault" if code == 0 else "failed"
    return "completed" if code == 0 else "failed"


def check_runs(runs: Sequence[Run], *, executor_points: Iterable[str] = ("before_begin", "after_pre_commit"),
               kills_mid_work: bool = True) -> None:
    """Raise ``AssertionError`` unless every fault of ``runs`` (:func:`run_with_faults`) landed.

    - A ``crash:POINT`` or ``crash:POINT:N`` run: its crash log names POINT (and batch N when
      given), and nothing else made it exit: a crash point armed but never reached, or a run
      that died of something else (a JVM that failed to start, a lost connection), is not a
      fired crash, and the recovery a test names would never have run.  A point that fires in
      executors (``executor_points``) does not kill the driver: its exit is then not the
      crash point's 137.  (The data source form runs every point in a Python worker, the
      planner's, a task's or the commit step's: its kill tests name all their points here.)
    - A ``sigkill@...`` run: the SIGKILL ended it (not an exit before the kill), and, with a
      ``progress_probe``, before the work was done: its progress is below the completing run's.
    - No run failed; the last one completed (so exactly one fault-free run: a restart that
      failed, then another that completed, fails this).
    """
    runs = list(runs)
    show = [r.to_dict() for r in runs]
    assert runs and runs[-1].completed, f"the driver never completed: {show}"
    final = runs[-1].progress
    for r in runs:
        assert r.outcome != "failed", f"run {r.number} ({r.fault}) failed: {show}"
        if r.fault.startswith("crash:"):
            spec = r.fault.split(":", 1)[1]
            for item in spec.split(","):
                point, _, batch = item.partition(":")
                assert r.outcome == "crash point fired", f"run {r.number}: {r.fault} did not fire: {show}"
                hits = [line for line in r.fired if line.split(" ", 1)[0] == point]
                assert hits, f"run {r.number}: {point} is not in its crash log {r.fired}: {show}"
                if batch:
                    assert all(line.split(" ")[1] == batch for line in hits), \
                        f"run {r.number}: {point} fired at another batch than {batch}: {r.fired}"
                if point in executor_points:
                    assert r.exit_code != crash.EXIT_CODE or any(
                        line.split(" ", 1)[0] not in executor_points for line in r.fired), \
                        f"run {r.number}: the driver itself exited 137 at an executor point: {show}"
                else:
                    assert r.exit_code == crash.EXIT_CODE, \
                        f"run {r.number}: {point} fired but the driver exited {r.exit_code}: {show}"
        elif r.fault.startswith("sigkill"):
            assert r.outcome == "killed", f"run {r.number} ({r.fault}) was not killed: {show}"
            if kills_mid_work and r.progress is not None and final is not None:
                assert r.progress < final, \
                    f"run {r.number} ({r.fault}) was killed after the work was done " \
                    f"(progress {r.progress} of {final}): {show}"


def run_with_faults(cmd: Sequence[str], *, crash_points: Sequence[str] = (), random_kills: int = 0,
                    kill_window: tuple[float, float] = (5.0, 30.0), seed: int | None = None,
                    env: dict[str, str] | None = None, max_final_runs: int = 5, timeout: float = 600.0,
                    log_path: str | None = None,
                    progress: Callable[[str], None] | None = None,
                    progress_probe: Callable[[], int] | None = None) -> list[Run]:
    """Run the driver once per crash point, then ``random_kills`` times with a random SIGKILL,
    then without faults until it exits 0.  Returns every run; raises if it never completes.

    Each run's :attr:`Run.outcome` says what happened: a crash point counts as fired only
    if the crash log shows it (so an exit 137 from elsewhere is a ``failed`` run), a SIGKILL
    only if it ended the run.  ``progress_probe``: see :func:`run_once`.
    """
    rng = random.Random(seed)
    say = progress or (lambda s: print(s, file=sys.stderr, flush=True))
    plan: list[tuple[str, str | None, float | None]] = [(f"crash:{p}", p, None) for p in crash_points]
    for _ in range(random_kills):
        after = rng.uniform(*kill_window)
        plan.append((f"sigkill@{after:.1f}s", None, after))
    runs: list[Run] = []
    total = len(plan) + 1
    log_file = open(log_path, "ab") if log_path else None
    try:
        for i, (label, point, delay) in enumerate(plan, 1):
            say(f"[run {i}/{total}+] {label} ...")
            with tempfile.NamedTemporaryFile(prefix="twophase-crash-", suffix=".log", delete=False) as t:
                crash_log = t.name
            try:
                code, secs = run_once(cmd, env=env, crash_at=point, kill_after=delay, timeout=timeout,
                                      log_file=log_file, crash_log=crash_log,
                                      progress_probe=progress_probe if delay is not None else None)
                with open(crash_log) as f:
                    fired = [line.strip() for line in f if line.strip()]
            finally:
                os.unlink(crash_log)
            outcome = _outcome(label, code, fired)
            runs.append(Run(i, label, code, round(secs, 1), code == 0, outcome, fired,
                            progress_probe() if progress_probe else None))
            say(f"[run {i}/{total}+] {label}: exit {code} after {secs:.1f}s: {outcome}"
                + (f" ({'; '.join(fired)})" if fired else ""))
        for _ in range(max_final_runs):
            n = len(runs) + 1
            say(f"[run {n}] no fault, until done ...")
            code, secs = run_once(cmd, env=env, timeout=timeout, log_file=log_file)
            runs.append(Run(n, "none", code, round(secs, 1), code == 0, _outcome("none", code, []), [],
                            progress_probe() if progress_probe else None))
            say(f"[run {n}] no fault: exit {code} after {secs:.1f}s")
            if code == 0:
                return runs
        raise RuntimeError(f"the driver did not complete in {max_final_runs} fault-free runs"
                           + (f"; see {log_path}" if log_path else ""))
    finally:
        if log_file:
            log_file.close()
