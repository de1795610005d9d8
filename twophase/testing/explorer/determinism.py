"""What makes the protocol core deterministic while exploring (:func:`deterministic`): its background
work inline, its thread pool synchronous, its uuids and clock counted per schedule, the
``explorer://`` store registered, its log lines in the trace; and the pinning of the explorer's
threads to one CPU."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import sys
import time
import uuid as _uuid
from collections.abc import Callable, Iterator
from typing import Any

import twophase.committer as _committer_mod
import twophase.log as _log_mod
import twophase.log_batches as _log_batches_mod
import twophase.log_generations as _log_generations_mod
import twophase.log_ownership as _log_ownership_mod
import twophase.log_pruning as _log_pruning_mod
import twophase.protocol as _protocol_mod
from twophase.errors import TwoPhaseError
from twophase.log import TransactionLog
from twophase.storage import registry as _registry
from twophase.storage._base import LogStore
from twophase.testing.explorer._base import _PATCH_LOCK, _QUIET_URL, _WORLD, SCHEME
from twophase.testing.explorer.points import MemoryLogStore, _QuietStore


# ============================================================================ determinism
class _SyncExecutor:
    """``ThreadPoolExecutor`` stand-in: runs each task at ``submit``, in the caller's thread."""

    def __init__(self, *args: Any, **kwargs: Any):
        pass

    def __enter__(self) -> _SyncExecutor:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        try:
            fut.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001 - raised by fut.result(), as a pool's would be
            fut.set_exception(e)
        return fut

    def shutdown(self, wait: bool = True, **kwargs: Any) -> None:
        pass


class _Inline:
    """``twophase.protocol._InBackground`` stand-in: runs ``fn`` where it is started; ``result()``
    raises what it raised.  (In production it runs in a thread, beside the batch's tasks.)"""

    def __init__(self, fn: Callable[[], Any], *, name: str = "", daemon: bool = True):
        self._error: BaseException | None = None
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - re-raised by result(), as the real one does
            self._error = e

    def result(self) -> None:
        if self._error is not None:
            raise self._error


class _Uuids:
    """``uuid`` for the log and the protocol: ``uuid4()`` counts per schedule, so every name (log
    ids, owners, runs) is the same on a replay."""

    UUID = _uuid.UUID

    def uuid4(self) -> _uuid.UUID:
        world = _WORLD[0]
        if world is None or world.quiet:
            return _uuid.uuid4()
        world.uuids += 1
        return _uuid.UUID(int=world.uuids << 104)

    def __getattr__(self, name: str) -> Any:
        return getattr(_uuid, name)


class _Clock:
    """``time`` for the log: ``time()`` is the schedule's clock (it moves 1 ms per call)."""

    def time(self) -> float:
        world = _WORLD[0]
        if world is None or world.quiet:
            return time.time()
        world.clock += 0.001
        return world.clock

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


class _TraceLog(logging.Handler):
    """The protocol's warnings, into the schedule's trace (and nowhere else while exploring)."""

    def emit(self, record: logging.LogRecord) -> None:
        world = _WORLD[0]
        if world is not None:
            msg = record.getMessage()
            world.log(f"({record.name.split('.')[-1]} {record.levelname.lower()})", msg[:300])


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """Make the protocol core deterministic for the explorer, and restore everything after.

    - ``twophase.protocol._InBackground`` (the fence check, the replaced generations' sweep, a
      background COMMITTED record) runs inline where it is started;
    - ``twophase.committer.ThreadPoolExecutor`` (the committer's pool) runs each commit at submit;
    - ``uuid4`` of the log and the protocol counts, ``time.time`` of the log is a clock per schedule
      (so the lease's heartbeat never comes due); ``TransactionLog.start_heartbeat`` starts nothing;
    - the ``explorer://`` scheme opens the schedule's in-memory store;
    - the ``twophase`` loggers write into the schedule's trace instead of the console.
    """
    with _PATCH_LOCK:
        saved: list[tuple[Any, str, Any]] = []
        _inherited = object()  # a class attribute found on a base: restored by deleting the own one

        def patch(obj: Any, attr: str, value: Any) -> None:
            if hasattr(obj, attr):
                own = not isinstance(obj, type) or attr in vars(obj)
                saved.append((obj, attr, getattr(obj, attr) if own else _inherited))
                setattr(obj, attr, value)

        patch(_protocol_mod, "_InBackground", _Inline)
        patch(_committer_mod, "ThreadPoolExecutor", _SyncExecutor)
        # The log's parts (twophase/log*.py): each module that reads uuid / time has its own name.
        log_mods = (_log_mod, _log_batches_mod, _log_generations_mod, _log_ownership_mod, _log_pruning_mod)
        for log_mod in log_mods:
            patch(log_mod, "uuid", _Uuids())
        patch(_protocol_mod, "uuid", _Uuids())
        for module in ("twophase.sinks.files.sink", "twophase.sinks.files.spark_writer",
                       "twophase.storage.parts"):  # FileSink's tokens and staged names
            if module in sys.modules:
                patch(sys.modules[module], "uuid", _Uuids())
        for log_mod in log_mods:
            patch(log_mod, "time", _Clock())
        patch(TransactionLog, "start_heartbeat", lambda self: None)
        factories = _registry._FACTORIES
        had = factories.get(SCHEME)
        factories[SCHEME] = _open_store
        logger = logging.getLogger("twophase")
        handler = _TraceLog(logging.WARNING)
        old_propagate, old_level = logger.propagate, logger.level
        logger.addHandler(handler)
        logger.propagate = False
        if logger.level == logging.NOTSET or logger.level > logging.WARNING:
            logger.setLevel(logging.WARNING)
        try:
            yield
        finally:
            logger.removeHandler(handler)
            logger.propagate, logger.level = old_propagate, old_level
            if had is None:
                factories.pop(SCHEME, None)
            else:
                factories[SCHEME] = had
            for obj, attr, value in reversed(saved):
                if value is _inherited:
                    delattr(obj, attr)
                else:
                    setattr(obj, attr, value)


@contextlib.contextmanager
def _one_cpu(pin: bool) -> Iterator[None]:
    """Pin the calling thread (and so the threads it starts) to one of its CPUs, then restore."""
    getaff = getattr(os, "sched_getaffinity", None)
    setaff = getattr(os, "sched_setaffinity", None)
    if not pin or getaff is None or setaff is None:
        yield
        return
    before = getaff(0)
    try:
        setaff(0, {min(before)})
    except OSError:
        yield
        return
    try:
        yield
    finally:
        setaff(0, before)


def _open_store(url: str, storage_options: dict[str, Any] | None, exclusive: bool) -> LogStore:
    world = _WORLD[0]
    if world is None:
        raise TwoPhaseError(f"{url}: the explorer's store exists only while a schedule runs")
    return _QuietStore(world, url) if url == _QUIET_URL else MemoryLogStore(world, url)
