"""The command line, ``python -m twophase.testing.explorer`` (:func:`main`)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from twophase.testing.explorer._base import Violation, parse_schedule
from twophase.testing.explorer.scenarios import SCENARIOS
from twophase.testing.explorer.search import explore, replay
from twophase.testing.explorer.sinks import SINKS


# ============================================================================ CLI
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m twophase.testing.explorer",
        description="Explore every interleaving of a scenario's actors (the protocol core on an in-memory log "
                    "and sink) up to a preemption bound; print the trace of the first broken invariant, or "
                    "the coverage. Exit status 1 on a finding.",
        epilog="scenarios: " + "; ".join(f"{k}: {v[0]} (default --batches {v[2]})" for k, v in SCENARIOS.items()))
    parser.add_argument("--scenario", default="datasource", choices=sorted(SCENARIOS))
    parser.add_argument("--preemptions", type=int, default=2, metavar="N",
                        help="preemption bound (default 2)")
    parser.add_argument("--batches", type=int, default=None, metavar="N",
                        help="batches the scenario covers (default: the scenario's own)")
    parser.add_argument("--max-schedules", type=int, default=None, metavar="N",
                        help="stop after N schedules (default: all within the bound)")
    parser.add_argument("--retain-batches", type=int, default=1, metavar="N",
                        help="the logs' retain_batches (default 1: pruning happens within 3 batches)")
    parser.add_argument("--all", action="store_true",
                        help="go on after a finding; report each kind once (with its first trace)")
    parser.add_argument("--replay", metavar="SCHEDULE",
                        help="run one schedule, as a finding prints it (e.g. '0*17 1*17 0*11 1*15'), and print "
                             "its trace")
    parser.add_argument("--sink", choices=sorted(SINKS), default=None,
                        help="the sink: 'memory' (the model), 'files' (the shipped FileSink on a local folder, "
                             "each storage call a scheduling point) or 'kafka' (the shipped KafkaSink on an "
                             "in-memory broker, each broker request a scheduling point, two tasks a batch); "
                             "default: the scenario's own (batch-jobs: files; the others: memory)")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args = parser.parse_args(argv)
    sut = SINKS[args.sink]() if args.sink else None
    if args.replay is not None:
        trace, broken = replay(args.scenario, parse_schedule(args.replay), batches=args.batches,
                               retain_batches=args.retain_batches, sut=sut)
        print("\n".join(trace))
        print(f"invariant broken ({broken})" if broken else "no invariant broken")
        return 1 if broken else 0
    progress = None if args.quiet else (lambda s: print(s, file=sys.stderr, flush=True))
    common: dict[str, Any] = {"preemptions": args.preemptions, "batches": args.batches,
                              "max_schedules": args.max_schedules, "retain_batches": args.retain_batches,
                              "progress": progress, "sut": sut}
    if not args.all:
        try:
            explore(args.scenario, out=print, **common)
        except Violation:
            return 1
        return 0
    report = explore(args.scenario, collect=True, **common)
    for f in report.findings:
        print(f.render())
        print()
    print(report.summary())
    return 1 if report.findings else 0
