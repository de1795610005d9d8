"""The ``twophase`` command: inspect a transaction log, recover without Spark, run the demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from typing import Any

from twophase import __version__
from twophase.errors import ConfigurationError, TwoPhaseError


def _storage_options(args) -> dict[str, Any] | None:
    if not getattr(args, "storage_options", None):
        return None
    try:
        opts = json.loads(args.storage_options)
    except ValueError as e:
        raise ConfigurationError(f"--storage-options is not JSON: {e}") from None
    if not isinstance(opts, dict):
        raise ConfigurationError("--storage-options must be a JSON object")
    return opts


def _sink(args):
    from twophase.config import sink_from_config

    return sink_from_config(args.sink_config)


def cmd_status(args) -> int:
    from twophase.recovery import describe, dumps

    sink = _sink(args) if args.sink_config else None
    info = describe(args.log, _storage_options(args), sink)
    if args.json:
        print(dumps(info))
        return 0
    print(f"log: {info['log']}")
    for g in info["generations"]:
        print(f"generation {g['generation']}: query {g['query_id']} (coordinator {g.get('name')!r}), "
              f"created {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(g['created_at']))}")
    owner = info["owner"]
    if owner:
        state = "released" if owner.get("released") else f"last heartbeat {owner['heartbeat_age_s']}s ago"
        print(f"owner: epoch {owner['epoch']} on {owner['host']} pid {owner['pid']}, {state}")
    if info.get("low_water") is not None:
        spans = ", ".join(f"{a}-{b}" if a != b else str(a) for a, b in info.get("pruned") or [])
        print(f"pruned: batches {spans} were committed and their records deleted (refused if written again)")
    if not info["batches"]:
        print("no batch records")
        return 0
    decided = any(b["state"] == "prepared" for b in info["batches"])
    print(f"{'gen':>4} {'batch':>8}  {'state':<10} {'handles':>7} {'rows':>10} {'age':>10}")
    for b in info["batches"]:
        rows = "" if b["rows"] is None else str(b["rows"])
        print(f"{b['generation']:>4} {b['batch_id']:>8}  {b['state']:<10} {b['handles']:>7} {rows:>10} "
              f"{_age(b['age_s']):>10}")
        if b["state"] != "committed":
            what = ("decided, NOT yet fully committed: 'twophase recover' or restarting the query commits it"
                    if b["state"] == "prepared" else
                    "undecided: the query replays it; 'twophase recover' aborts its leftovers now" if decided
                    else "undecided: the query replays it; 'twophase abort-lingering' aborts its leftovers now")
            print(f"{'':>10}{what}")
            for h in b.get("pending_handles", []):
                print(f"{'':>12}{json.dumps(h, sort_keys=True)[:200]}")
            for w in b.get("warnings", []):
                print(f"{'':>12}WARNING: {w}")
    return 0


def _age(s: float) -> str:
    if s < 120:
        return f"{s:.0f}s"
    if s < 7200:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


def cmd_recover(args) -> int:
    from twophase.recovery import dumps, recover

    report = recover(args.log, _sink(args), storage_options=_storage_options(args), takeover=args.takeover,
                     abort_only=args.command == "abort-lingering", ignore_lost=args.ignore_lost)
    if args.json:
        print(dumps(report.to_dict()))
    else:
        if args.command == "recover":
            print(f"committed batches: {report.committed_batches or 'none pending'} "
                  f"({report.handles_committed} handles committed now, "
                  f"{report.handles_already_committed} were already committed)")
        aborted = ", ".join(f"batch {b}: {n}" for b, n in report.aborted.items()) or "none"
        print(f"aborted lingering transactions: {aborted}")
        for b in report.voided:
            print(f"VOID: batch {b}: every transaction of its decision is gone and none of it was ever visible; "
                  "the query runs it again when it restarts")
        for lost in report.lost:
            print(f"LOST: batch {lost['batch_id']}: {lost['handle']}: {lost['reason']}")
    return 1 if report.lost else 0


def cmd_offsets(args) -> int:
    from twophase.log import TransactionLog

    tlog = TransactionLog(args.log, storage_options=_storage_options(args), readonly=True)
    gens = tlog.generations()
    if not gens:
        print(f"twophase: {args.log} holds no log generation", file=sys.stderr)
        return 1
    g = args.generation or int(gens[-1]["generation"])
    if _pending_refusal(tlog, args.log):
        return 1
    last = tlog.last_committed(generation=g)
    if last is None:
        print(f"twophase: generation {g} has no committed batch", file=sys.stderr)
        return 1
    source = last.body.get("source")
    if not source:
        print(f"twophase: batch {last.batch_id} has no source offsets (give the Coordinator "
              "checkpoint_location=... to record them)", file=sys.stderr)
        return 1
    sources = source.get("sources", [])
    if args.source >= len(sources):
        print(f"twophase: the query has {len(sources)} source(s); --source {args.source} does not exist",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"generation": g, "batch_id": last.batch_id, "sources": sources}, indent=2))
    else:
        # The end offsets of the last committed batch, as Spark's Kafka source takes them for startingOffsets.
        print(json.dumps(sources[args.source], separators=(",", ":")))
    return 0


def _pending_refusal(tlog, log_url: str) -> bool:
    """Print why ``offsets`` refuses (a decided batch is pending) and warn of undecided ones.

    A decided batch not yet committed is part of the results: the position after the last
    *committed* batch would have a new query write it again, and a later ``twophase recover``
    of this log would commit it too (a duplicate).  Undecided batches are not results: a new
    query writes them again and recovery of this log aborts what they left.
    """
    from twophase.recovery import pending_batches

    pending = [p for p in pending_batches(tlog) if not p.pruned]
    decided = [p for p in pending if p.decided]
    if decided:
        which = ", ".join(p.label for p in decided)
        verb = "is" if len(decided) == 1 else "are"
        print(f"twophase: {which} {verb} decided but not yet committed: its records are part of the results, "
              f"and a new query started at the last committed batch's offsets would write them again. "
              f"Finish it first: twophase recover {log_url} --sink-config CFG; then run offsets again",
              file=sys.stderr)
        return True
    for p in pending:
        if p.ballots and all(b.outcome is not None for b in p.ballots):
            continue  # every ballot closed: nothing of it is left open
        print(f"twophase: warning: {p.label} is undecided: it is not part of the results (a new query "
              f"writes it again); 'twophase abort-lingering {log_url} --sink-config CFG' aborts what it "
              "left open", file=sys.stderr)
    return False


def cmd_demo(args) -> int:
    from twophase import demo

    return demo.main_from_args(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twophase", description="Exactly-once sinks for PySpark: operator tools.")
    p.add_argument("--version", action="version", version=f"twophase {__version__}")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def common(sp, sink_required: bool):
        sp.add_argument("log", metavar="LOG_LOCATION", help="the transaction log URL (e.g. CHECKPOINT/twophase)")
        sp.add_argument("--storage-options", help="JSON fsspec storage options for the log URL")
        sp.add_argument("--sink-config", required=sink_required, metavar="CONFIG",
                        help="the sink as JSON config (file path or inline JSON), e.g. "
                             '\'{"sink": "files", "url": "/data/out"}\'; secrets as {"env": "VAR"}')
        sp.add_argument("--json", action="store_true", help="machine-readable output")

    sp = sub.add_parser("status", help="list batches with their state, handles and ages",
                        description="List the log's generations, owner and batches (read-only).")
    common(sp, sink_required=False)
    sp.set_defaults(func=cmd_status)

    for name, helptext in (("recover", "commit decided batches and abort leftovers, without Spark"),
                           ("abort-lingering", "abort transactions left open by undecided batches")):
        sp = sub.add_parser(name, help=helptext, description=helptext.capitalize() + ". Takes ownership "
                            "of the log: refused while a live coordinator owns it.")
        common(sp, sink_required=True)
        sp.add_argument("--takeover", action="store_true",
                        help="take the log over even if its lease looks alive (only if that owner is dead)")
        sp.add_argument("--ignore-lost", action="store_true",
                        help="report transactions that can no longer be committed instead of failing")
        sp.set_defaults(func=cmd_recover)

    sp = sub.add_parser("offsets", help="print the source offsets of the last committed batch",
                        description="Print where the last committed batch's input ends, in the form Spark's "
                                    "Kafka source takes as startingOffsets (for a restart from a new checkpoint). "
                                    "Refused (exit 1) while a decided batch is not yet committed: run "
                                    "'twophase recover' first.")
    sp.add_argument("log", metavar="LOG_LOCATION")
    sp.add_argument("--storage-options", help="JSON fsspec storage options for the log URL")
    sp.add_argument("--generation", type=int, help="log generation (default: the latest)")
    sp.add_argument("--source", type=int, default=0, help="index of the query's source (default 0)")
    sp.add_argument("--json", action="store_true", help="print every source with batch and generation")
    sp.set_defaults(func=cmd_offsets)

    from twophase import demo

    sp = sub.add_parser("demo", help="run an exactly-once pipeline, kill its driver many times, verify",
                        description=demo.DESCRIPTION)
    demo.add_arguments(sp)
    sp.set_defaults(func=cmd_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return args.func(args)
    except TwoPhaseError as e:
        print(f"twophase: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
