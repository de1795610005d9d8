"""The ownership machine's checks (part of :mod:`twophase.testing.ownership`).

The truth is the log itself: a reader must see exactly the rows of the handles of its commit
decisions, each once (a batch decided twice, or a ballot decided by a coordinator that did not
open it, is reported as such), and at quiescent points no transaction may stay open (a late task
attempt's leftovers: within two batches of its generation).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from twophase.log import TransactionLog
from twophase.testing._ownership_common import note
from twophase.testing._ownership_processes import _Coord
from twophase.testing._shared import ID_SPAN, ConformanceError


class _OwnershipChecks:
    """Part of :class:`~twophase.testing.ownership.OwnershipMachine`: what a reader sees, checked
    against the log's commit decisions."""

    # The machine's configuration and state read here: set by OwnershipMachine (class attributes,
    # start) and make_ownership_machine; declared here for the type checker only.
    read_committed: Callable[[], Iterable[Any]]
    id_of: Callable[[Any], int]
    pending: Callable[[], Iterable[Any]] | None
    protocol_factory: Callable[..., Any]
    settle_timeout: float
    id_base: int
    urls: list[str]
    rows: dict[tuple[str, int, int], list[int]]
    handle_rows: dict[str, list[int]]
    late: dict[tuple[str, int], int]
    owner: _Coord | None
    pending_baseline: set[str] | None

    # ------------------------------------------------------------------ checks
    def _pending(self) -> set[str] | None:
        return None if self.pending is None else {str(x) for x in self.pending()}

    def _truth(self) -> tuple[dict[int, tuple[str, int, int]], list[str]]:
        """Rows the log's commit decisions carry (row -> (log, generation, batch)); problems."""
        allowed: dict[int, tuple[str, int, int]] = {}
        problems: list[str] = []
        for url in self.urls:
            tl = TransactionLog(url, readonly=True)
            for g in tl.generations():
                gen = int(g["generation"])
                for bid, view in tl.views(gen).items():
                    commits = [b for b in view.ballots if b.decision is not None and not b.decision.aborted]
                    if len(commits) > 1:
                        problems.append(f"batch {bid} (log {url} generation {gen}) has {len(commits)} commit "
                                        f"decisions (ballots {[b.ballot for b in commits]}): a decision was "
                                        "written twice")
                    for b in commits:
                        opener = None if b.intent is None else b.intent.body.get("writer")
                        if opener != b.decision.body.get("writer"):  # type: ignore[union-attr]
                            problems.append(
                                f"batch {bid} ballot {b.ballot} (log {url} generation {gen}) holds a commit "
                                f"decision by epoch {b.decision.body.get('epoch')}, but "  # type: ignore[union-attr]
                                + ("no INTENT" if b.intent is None else
                                   f"its INTENT is epoch {b.intent.body.get('epoch')}'s")
                                + ": a ballot is decided only by the coordinator that opened it (its "
                                "decision names transactions its INTENT did not plan)")
                        for env in b.decision.handles:  # type: ignore[union-attr]
                            for row in self.handle_rows.get(json.dumps(env, sort_keys=True), []):
                                allowed[row] = (url, gen, bid)
        return allowed, problems

    def _read(self) -> Counter:
        lo, hi = self.id_base, self.id_base + ID_SPAN
        return Counter(i for i in map(self.id_of, self.read_committed()) if lo <= i < hi)

    def _check(self, where: str, exact: bool = False, final: bool = False) -> None:
        allowed, problems = self._truth()
        deadline = time.monotonic() + self.settle_timeout
        while True:
            seen = self._read()
            dup = sorted(i for i, c in seen.items() if c > 1)
            unexpected = sorted(set(seen) - set(allowed))
            missing = sorted(set(allowed) - set(seen)) if exact else []
            if dup or unexpected or not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.2)
        for i in dup[:5]:
            problems.append(f"row {i} appears {seen[i]} times ({self._whose(i)})")
        for i in unexpected[:5]:
            problems.append(f"row {i} is visible but no commit decision in the log carries it ({self._whose(i)})")
        for i in missing[:5]:
            problems.append(f"row {i} is missing although the log decided its batch ({self._whose(i)}): "
                            "decided data was destroyed or never committed")
        # Late leftovers are due two batches after the late attempt (a new generation's: after its
        # first batch); at the end of an example every late attempt is that far behind.
        unsettled = [] if final else [k for k, n in self.late.items() if n < 2]
        if not problems and exact and self.pending is not None and not unsettled:
            left = (self._pending() or set()) - (self.pending_baseline or set())
            if left:
                problems.append(f"{len(left)} transaction(s) still open at a quiescent point: {sorted(left)[:5]}"
                                + (" (after a late task attempt: its leftovers must be found within two "
                                   "batches of its generation, or by the first batch of a generation that "
                                   "replaced it)" if self.late else
                                   " (abort_lingering must abort what failed attempts and crashed runs left)"))
        if problems:
            msg = (f"{where}: exactly-once violated for {type(self.owner.sink).__name__ if self.owner else '?'} "
                   f"under the protocol {getattr(self.protocol_factory, '__name__', self.protocol_factory)}:\n  "
                   + "\n  ".join(problems))
            note(msg)
            raise ConformanceError(msg)
        note(f"  check {'(exact) ' if exact else ''}{where}: {sum(seen.values())} rows visible, as expected")

    def _whose(self, row: int) -> str:
        for (url, gen, bid), ids in self.rows.items():
            if row in ids:
                return f"batch {bid} of log {url.rsplit('/', 1)[-1]} generation {gen}"
        return "no batch of this example"
