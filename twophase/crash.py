"""Named crash points for fault-injection tests: the process dies by ``os._exit`` where
``TWOPHASE_CRASH_AT`` names the point (optionally ``point:batch_id``, several comma-separated).

Unset, a crash point costs two attribute checks.  Points used by the coordinator:
``after_intent``, ``before_begin`` (on an executor's Python worker, just before the sink's
``begin_transaction`` for its partition: nothing of the task is open yet; not reached by a sink
that prepares whole batches on the driver), ``after_pre_commit`` (on an executor's Python worker),
``before_prepared_logged``, ``after_prepared_logged``, ``mid_commit`` (after the first handle
committed), ``after_commit`` (all handles committed, COMMITTED not yet logged) and
``after_committed_logged``.

Pause points: the same names in ``TWOPHASE_PAUSE_AT`` (same syntax, e.g.
``before_prepared_logged:2``) make the process stop itself there with ``SIGSTOP``, as a
driver stopped by a long GC pause or a VM migration: every thread stops (the lease
heartbeat too) and nothing is torn down; ``SIGCONT`` from outside resumes it on the next
line.  Each named point of each batch pauses a process at most once (a process resumed
there goes on, and a replay of the batch in the same process does not stop again); in a
Spark task, once per task attempt (a retry of the task stops again, even in a reused
Python worker).  Where both plans name a point, the crash wins.  ``TWOPHASE_PAUSE_LOG``
names a file each process appends ``"<point> <batch> <pid>"`` to just before it stops, and
in a Spark task ``"<point> <batch> <pid> <partition> <attempt> <task attempt id>"`` (the
task's partition id, attempt number and application-wide task attempt id), so a test learns
which process to resume and which task stopped (an executor's Python worker at
``before_begin`` or ``after_pre_commit``; the coordinator ships the pause plan to its tasks
like the crash plan).
A test waits for the stop itself (``/proc/<pid>/stat`` state ``T``), never for a time.  A
worker paused at ``before_begin`` is a *late task attempt* on demand: resumed after its
driver was killed and another driver took the batch over, it begins its transaction under
its closed ballot's INTENT.  Such a process may find its stderr gone (a pipe to the dead
JVM): what this module writes there is best effort and never fails the caller.
"""

from __future__ import annotations

import os
import signal
import sys

ENV = "TWOPHASE_CRASH_AT"
#: A file each process appends "<point> <batch> <pid>" to when it dies at a crash point, so that a
#: chaos runner can tell a point that fired from one that was armed but never reached.
LOG_ENV = "TWOPHASE_CRASH_LOG"
EXIT_CODE = 137
#: Pause points (see the module docstring): ``point[:batch]``, comma-separated, like ``ENV``.
PAUSE_ENV = "TWOPHASE_PAUSE_AT"
#: A file each process appends "<point> <batch> <pid>" to just before it stops at a pause point.
PAUSE_LOG_ENV = "TWOPHASE_PAUSE_LOG"

POINTS = (
    "after_intent",
    "before_begin",
    "after_pre_commit",
    "before_prepared_logged",
    "after_prepared_logged",
    "mid_commit",
    "after_commit",
    "after_committed_logged",
)

_plan: dict[str, set[int] | None] | None = None
_pause_plan: dict[str, set[int] | None] = {}
#: (point, batch, the Spark task's (partition, attempt, task attempt id) or None) this process
#: already stopped at
_paused: set[tuple[str, int | None, tuple[int, int, int] | None]] = set()


def _parse(value: str, env: str = ENV) -> dict[str, set[int] | None]:
    plan: dict[str, set[int] | None] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        name, _, batch = item.partition(":")
        if name not in POINTS:
            what = "crash" if env == ENV else "pause"
            raise ValueError(f"{env}: unknown {what} point {name!r}; known: {', '.join(POINTS)}")
        if batch:
            prev = plan.get(name, set())
            if prev is not None:
                plan[name] = prev | {int(batch)}
        else:
            plan[name] = None  # every batch
    return plan


def reload() -> None:
    """Re-read the environment variables (tests that change them in-process call this)."""
    global _plan, _pause_plan
    _plan = _parse(os.environ.get(ENV, ""))
    _pause_plan = _parse(os.environ.get(PAUSE_ENV, ""), PAUSE_ENV)


def carried_env() -> dict[str, str]:
    """This process' crash plan (``TWOPHASE_CRASH_AT``, ``TWOPHASE_CRASH_LOG``) and pause plan
    (``TWOPHASE_PAUSE_AT``, ``TWOPHASE_PAUSE_LOG``), for its executors.

    Executors on a cluster do not inherit the driver's environment; the coordinator ships
    this dict with its tasks and they :func:`adopt` it.
    """
    return {k: os.environ[k] for k in (ENV, LOG_ENV, PAUSE_ENV, PAUSE_LOG_ENV) if os.environ.get(k)}


def adopt(env: dict[str, str]) -> None:
    """Arm the crash plan a driver shipped (executor side); a plan set here already wins."""
    changed = False
    for k, v in env.items():
        if not os.environ.get(k):
            os.environ[k] = v
            changed = True
    if changed:
        reload()


def armed() -> bool:
    """Is a crash plan armed (``TWOPHASE_CRASH_AT``)?  A pause plan alone does not count."""
    if _plan is None:
        reload()
    return bool(_plan)


def planned(name: str, batch_id: int | None = None) -> bool:
    """Does the crash plan name point ``name`` (of batch ``batch_id``)?"""
    if _plan is None:
        reload()
    return bool(_plan) and _names(_plan or {}, name, batch_id)


def _names(plan: dict[str, set[int] | None], name: str, batch_id: int | None) -> bool:
    if name not in plan:
        return False
    batches = plan[name]
    return batches is None or (batch_id is not None and batch_id in batches)


def crash_point(name: str, batch_id: int | None = None) -> None:
    """Die here, at once and without cleanup, if ``TWOPHASE_CRASH_AT`` names this point; stop
    here (``SIGSTOP``, once) if ``TWOPHASE_PAUSE_AT`` does."""
    if _plan is None:
        reload()
    if _pause_plan and _names(_pause_plan, name, batch_id) and not _names(_plan or {}, name, batch_id):
        _pause(name, batch_id)
        return
    if not _plan or not _names(_plan, name, batch_id):
        return
    sys.stderr.write(f"twophase: crash point {name} reached (batch {batch_id}): exiting\n")
    sys.stderr.flush()
    where = os.environ.get(LOG_ENV)
    if where:
        try:
            with open(where, "a") as f:
                f.write(f"{name} {batch_id} {os.getpid()}\n")
        except OSError:
            pass
    os._exit(EXIT_CODE)


def _pause(name: str, batch_id: int | None) -> None:
    """Stop this whole process (every thread) until someone sends it SIGCONT; once per point and batch."""
    task = _task()
    key = (name, batch_id, task)
    if key in _paused:
        return
    _paused.add(key)
    pid = os.getpid()
    _say(f"twophase: pause point {name} reached (batch {batch_id}): process {pid} stops "
         "(SIGSTOP) until it is sent SIGCONT\n")
    where = os.environ.get(PAUSE_LOG_ENV)
    if where:
        try:
            with open(where, "a") as f:
                f.write(f"{name} {batch_id} {pid}" + "".join(f" {n}" for n in task or ()) + "\n")
        except OSError:
            pass
    os.kill(pid, signal.SIGSTOP)
    _say(f"twophase: pause point {name} (batch {batch_id}): process {pid} resumed\n")


def _task() -> tuple[int, int, int] | None:
    """(partition id, attempt number, task attempt id) of the Spark task this process runs now, or
    None (a driver, or no pyspark loaded: nothing is imported here for it).  The attempt number
    starts again at 0 when Spark runs the stage again (a new stage attempt); the task attempt id is
    unique in the application and grows, so a retry always has a higher one."""
    pyspark = sys.modules.get("pyspark")
    try:
        tc = pyspark.TaskContext.get() if pyspark is not None else None
        return None if tc is None else (int(tc.partitionId()), int(tc.attemptNumber()), int(tc.taskAttemptId()))
    except Exception:  # a pause point must never fail its caller
        return None


def _say(text: str) -> None:
    """Write to stderr, best effort: a Python worker resumed after its JVM died has a stderr
    whose reader is gone (BrokenPipeError), and the point must still return normally."""
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (OSError, ValueError):
        pass
