#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set up, start the real servers, pytest, stop them.
# Usage: bash scripts/test.sh [PYTEST ARGS...]   e.g. -m "not chaos"   or   tests/test_log.py
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source scripts/setup.sh test,bench
echo "[test] ruff check" >&2
ruff check .   # lint first: seconds, and a failure here needs no servers
python -m tests.services stop >/dev/null 2>&1 || true
# The suite SIGKILLs a few hundred drivers, and a killed JVM leaves its spark-*/blockmgr-* folders
# behind: Spark's local dirs go to one folder of this run's, removed when it ends.
export SPARK_LOCAL_DIRS
SPARK_LOCAL_DIRS="$(mktemp -d "${TMPDIR:-/tmp}/twophase-test-spark.XXXXXX")"
trap 'python -m tests.services stop || true; rm -rf "$SPARK_LOCAL_DIRS"' EXIT
free_gb=$(( $(df -Pk "${TMPDIR:-/tmp}" | awk 'NR==2 {print $4}') / 1048576 ))
echo "[test] ${free_gb} GB free in ${TMPDIR:-/tmp}" >&2
if [ "$free_gb" -lt 10 ]; then
  echo "[test] WARNING: the suite needs about 10 GB of scratch space (fresh venvs, servers' data);" \
       "with ${free_gb} GB tests may fail with 'No space left on device'" >&2
fi
# mypy (config in pyproject.toml; ~20 s of one core) checks while the servers start, mostly JVMs
# waiting on their ports; its verdict is read before any test runs.
echo "[test] mypy, while the services start" >&2
mypy_out="$(mktemp)"
mypy >"$mypy_out" 2>&1 &
mypy_pid=$!
t0=$(date +%s)
python -m tests.services start all
echo "[test] services up in $(( $(date +%s) - t0 ))s" >&2
if ! wait "$mypy_pid"; then cat "$mypy_out" >&2; echo "[test] mypy failed" >&2; exit 1; fi
tail -1 "$mypy_out" >&2
rm -f "$mypy_out"
export TWOPHASE_KEEP_SERVICES=1   # this script stops them itself
# Two workers (pytest-xdist): a test waits on servers, Spark and its drivers' start-up about a third
# of its time, which the other worker's test uses; each file runs on one worker, and a test marked
# alone runs while no other does (tests/conftest.py).  TWOPHASE_TEST_WORKERS=0 runs one process.
python -m pytest -p no:cacheprovider --timeout=1800 --durations=30 \
  -n "${TWOPHASE_TEST_WORKERS:-2}" --dist loadfile "$@"
