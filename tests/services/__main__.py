"""``python -m tests.services start|stop|status [NAME ... | all]`` (NAME: any of ``NAMES``)."""

from __future__ import annotations

import argparse
import sys
import time

from tests.services import NAMES, ON_DEMAND, ServiceError, dumps, get


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.services",
        description="Start, stop or inspect the real servers (on 127.0.0.1) used by tests, demo and benchmarks.",
    )
    p.add_argument("action", choices=["start", "stop", "status", "install"])
    p.add_argument("names", nargs="*", default=["all"], help=f"any of {', '.join(NAMES)} or all (default)")
    args = p.parse_args(argv)
    names = list(NAMES) if "all" in args.names or not args.names else args.names
    if args.action in ("start", "install") and "all" in args.names:
        names = [n for n in names if n not in ON_DEMAND or n in args.names]  # by name only
    if args.action == "stop":
        names.reverse()  # servers on test hosts before the hosts themselves
    rc = 0
    for n in names:
        svc = get(n)
        t0 = time.monotonic()
        try:
            if args.action == "start":
                print(f"starting {n} ...", file=sys.stderr, flush=True)
                info = svc.start()
                print(f"{n} ready in {time.monotonic() - t0:.1f}s: {dumps(info)}", flush=True)
            elif args.action == "install":
                svc.install()
                print(f"{n} installed in {time.monotonic() - t0:.1f}s", flush=True)
            elif args.action == "stop":
                svc.stop()
                print(f"{n} stopped", flush=True)
            else:
                print(dumps(svc.status()), flush=True)
        except ServiceError as e:
            print(f"{n}: {e}", file=sys.stderr)
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
