#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: set up, start the real servers, pytest, stop them.
# Usage: bash scripts/test.sh [PYTEST ARGS...]   e.g. -m "not chaos"   or   tests/test_log.py
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source scripts/setup.sh test,bench
echo "[test] ruff check" >&2
ruff check .   # lint first: seconds, and a failure here needs no servers
echo "[test] mypy" >&2
mypy           # type check (config in pyproject.toml): seconds too
python -m tests.services stop >/dev/null 2>&1 || true
trap 'python -m tests.services stop || true' EXIT
t0=$(date +%s)
python -m tests.services start all
echo "[test] services up in $(( $(date +%s) - t0 ))s" >&2
export TWOPHASE_KEEP_SERVICES=1   # this script stops them itself
python -m pytest -p no:cacheprovider --timeout=1800 --durations=30 "$@"
