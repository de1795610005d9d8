"""Run the YARN ApplicationMaster re-attempt scenario several times in a row (issue 50).

    python -m tests.yarn_runs [--runs 5] [--sink hdfs|files|kafka|postgres]

Each run is one pytest run of
``tests/test_yarn.py::test_the_application_master_sigkilled_mid_batch_is_restarted_by_yarn_and_every_id_lands_once[<sink>]``
(an executor container killed mid-task, then the AM SIGKILLed mid-batch; YARN starts attempt 2
by itself; every id once, nothing left staged / prepared / open).  YARN is started by the test's
fixture if it is not running.  Prints one verdict line per run (PASS or FAIL, its duration, where
the kills landed or the failure's last lines) and a summary ``k/N passed``; exits 0 only if
every run passed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST = ("tests/test_yarn.py::"
        "test_the_application_master_sigkilled_mid_batch_is_restarted_by_yarn_and_every_id_lands_once")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--sink", default="hdfs", choices=("hdfs", "files", "kafka", "postgres"))
    args = ap.parse_args(argv)
    env = dict(os.environ, TWOPHASE_KEEP_SERVICES="1")
    if args.sink != "hdfs":
        env["TWOPHASE_FULL_CHAOS"] = "1"  # the other targets' variants are skipped in CI
    print(f"{dt.datetime.now(dt.UTC):%Y-%m-%d %H:%M} UTC: {args.runs} runs of {TEST}[{args.sink}]", flush=True)
    passed = 0
    for i in range(1, args.runs + 1):
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-s",
                            f"{TEST}[{args.sink}]"], cwd=REPO, env=env, capture_output=True, text=True)
        took = time.monotonic() - t0
        out = r.stdout + r.stderr
        where = [line for line in out.splitlines() if line.startswith("AM SIGKILLed")]
        ok = r.returncode == 0 and len(where) == 1
        passed += ok
        detail = where[0] if ok else "\n    ".join(out.splitlines()[-15:])
        print(f"run {i}: {'PASS' if ok else 'FAIL'} in {took:.0f}s: {detail}", flush=True)
    print(f"{passed}/{args.runs} passed", flush=True)
    return 0 if passed == args.runs else 1


if __name__ == "__main__":
    sys.exit(main())
