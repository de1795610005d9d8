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
trap 'python -m tests.services stop || true' EXIT
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
python -m pytest -p no:cacheprovider --timeout=1800 --durations=30 "$@"
