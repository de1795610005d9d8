"""Named crash points for fault-injection tests: the process dies by ``os._exit`` where
``TWOPHASE_CRASH_AT`` names the point (optionally ``point:batch_id``, several comma-separated).

Unset, a crash point costs one attribute check.  Points used by the coordinator:
``after_intent``, ``after_pre_commit`` (on an executor's Python worker), ``before_prepared_logged``,
``after_prepared_logged``, ``mid_commit`` (after the first handle committed), ``after_commit``
(all handles committed, COMMITTED not yet logged) and ``after_committed_logged``.
"""

from __future__ import annotations

import os
import sys

ENV = "TWOPHASE_CRASH_AT"
#: A file each process appends "<point> <batch> <pid>" to when it dies at a crash point, so that a
#: chaos runner can tell a point that fired from one that was armed but never reached.
LOG_ENV = "TWOPHASE_CRASH_LOG"
EXIT_CODE = 137

POINTS = (
    "after_intent",
    "after_pre_commit",
    "before_prepared_logged",
    "after_prepared_logged",
    "mid_commit",
    "after_commit",
    "after_committed_logged",
)

_plan: dict[str, set[int] | None] | None = None


def _parse(value: str) -> dict[str, set[int] | None]:
    plan: dict[str, set[int] | None] = {}
    for item in filter(None, (s.strip() for s in value.split(","))):
        name, _, batch = item.partition(":")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown crash point {name!r}; known: {', '.join(POINTS)}")
        if batch:
            prev = plan.get(name, set())
            if prev is not None:
                plan[name] = prev | {int(batch)}
        else:
            plan[name] = None  # every batch
    return plan


def reload() -> None:
    """Re-read the environment variable (tests that change it in-process call this)."""
    global _plan
    _plan = _parse(os.environ.get(ENV, ""))


def carried_env() -> dict[str, str]:
    """This process' crash plan (``TWOPHASE_CRASH_AT``, ``TWOPHASE_CRASH_LOG``), for its executors.

    Executors on a cluster do not inherit the driver's environment; the coordinator ships
    this dict with its tasks and they :func:`adopt` it.
    """
    return {k: os.environ[k] for k in (ENV, LOG_ENV) if os.environ.get(k)}


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
    if _plan is None:
        reload()
    return bool(_plan)


def crash_point(name: str, batch_id: int | None = None) -> None:
    """Die here, at once and without cleanup, if ``TWOPHASE_CRASH_AT`` names this point."""
    if _plan is None:
        reload()
    if not _plan or name not in _plan:
        return
    batches = _plan[name]
    if batches is None or (batch_id is not None and batch_id in batches):
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
