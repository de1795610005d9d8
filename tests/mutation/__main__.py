"""The mutation gate: every mutant of ``tests/mutation/mutants.toml`` must be killed by its tests.

    python -m tests.mutation                 # every mutant, 2 at a time
    python -m tests.mutation --only log-prune-span kafka-read-committed-offset
    python -m tests.mutation --list          # the mutants, and whether each text is still found
    python -m tests.mutation --baseline      # first check that the named tests pass unmutated

Each mutant runs its tests in a fresh pytest with ``-p tests.mutation.plugin`` and
``TWOPHASE_MUTANT=<id>`` (the module compiled with the one replacement, in memory: no file
changes).  Killed means pytest reported failed tests (exit 1); a mutant whose tests pass
SURVIVED; one whose text is no longer found once in its file is STALE.  Both fail the gate
(exit 1), naming the line and the tests.  Real servers the tests need must be up
(``python -m tests.services start all``; scripts/test.sh runs the gate inside the suite).
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.mutation.mutants import Mutant, load

REPO = Path(__file__).resolve().parents[2]


def _line_of(m: Mutant) -> int | None:
    text = (REPO / m.file).read_text()
    if text.count(m.find) != 1:
        return None
    return text[: text.index(m.find)].count("\n") + 1


def _pytest(args: list[str], env: dict[str, str], timeout: float) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "-p", "tests.mutation.plugin", "-p", "no:cacheprovider", "-q", "-x",
           "--no-header", "-p", "no:hypothesispytest", "--timeout", "240", *args]
    try:
        p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return 124, f"timed out after {timeout:.0f} s"
    return p.returncode, p.stdout + p.stderr


def _args(m: Mutant) -> list[str]:
    return [a for t in m.tests for a in shlex.split(t)]


def run_one(m: Mutant, timeout: float) -> tuple[Mutant, str, float, str]:
    t0 = time.monotonic()
    if _line_of(m) is None:
        return m, "STALE", 0.0, "its text is not found exactly once in the file"
    env = dict(os.environ, TWOPHASE_MUTANT=m.id, TWOPHASE_KEEP_SERVICES="1")
    code, out = _pytest(_args(m), env, timeout)
    took = time.monotonic() - t0
    # pytest's summary lines (-q): "FAILED node - reason" first, "ERROR node" (a fixture's error) after;
    # a log line that happens to start with "ERROR " is neither (it has no "::").
    summary = [ln for ln in out.splitlines() if ln.startswith(("FAILED ", "ERROR ")) and "::" in ln.split(" ")[1]]
    failed = sorted(summary, key=lambda ln: not ln.startswith("FAILED "))
    if "StaleMutant" in out:
        return m, "STALE", took, next((ln for ln in out.splitlines() if "StaleMutant" in ln), "")
    if code == 1 and failed:
        return m, "killed", took, failed[0][:160]
    if code == 124:
        return m, "killed", took, "its tests hung past the gate's timeout (a stall)"
    tail = "\n".join(out.strip().splitlines()[-3:])
    return m, "SURVIVED", took, f"pytest exit {code}: {tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.mutation", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    ap.add_argument("--list", action="store_true", help="list the mutants and where each is, run nothing")
    ap.add_argument("--baseline", action="store_true", help="first run every named test unmutated: must pass")
    ap.add_argument("--jobs", type=int, default=2, help="mutants run at once (default 2)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one mutant's tests may take (default 600)")
    a = ap.parse_args(argv)
    mutants = load()
    if a.only:
        unknown = set(a.only) - {m.id for m in mutants}
        if unknown:
            ap.error(f"no such mutant: {', '.join(sorted(unknown))}")
        mutants = [m for m in mutants if m.id in a.only]
    if a.list:
        for m in mutants:
            line = _line_of(m)
            where = f"{m.file}:{line}" if line else f"{m.file}: STALE (text not found once)"
            print(f"{m.id:40s} {where}\n    {m.why}\n    killed by: {' '.join(m.tests)}")
        return 0
    if a.baseline:
        args = sorted({x for m in mutants for x in _args(m)})
        code, out = _pytest(args, dict(os.environ, TWOPHASE_KEEP_SERVICES="1"), a.timeout * 4)
        if code != 0:
            print(out[-4000:])
            print(f"baseline: the named tests do not pass unmutated (pytest exit {code})")
            return 1
        print("baseline: the named tests pass unmutated")
    print(f"mutation gate: {len(mutants)} mutants, {a.jobs} at a time", flush=True)
    t0 = time.monotonic()
    bad = 0
    with ThreadPoolExecutor(max(1, a.jobs)) as pool:
        for m, verdict, took, detail in pool.map(lambda x: run_one(x, a.timeout), mutants):
            line = _line_of(m)
            where = f"{m.file}:{line}" if line else m.file
            print(f"{verdict:8s} {m.id:40s} {where:34s} {took:5.1f}s  {detail}", flush=True)
            if verdict != "killed":
                bad += 1
                print(f"         {m.why}\n         tests: {' '.join(m.tests)}", flush=True)
    print(f"mutation gate: {len(mutants) - bad} of {len(mutants)} killed, {bad} not, "
          f"{time.monotonic() - t0:.0f} s")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
