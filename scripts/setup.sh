#!/usr/bin/env bash
# Set up everything twophase needs on a fresh Debian machine: Java, a venv, the Python packages.
# Usage: source scripts/setup.sh [EXTRAS]   (EXTRAS default: "test,bench")
# Idempotent; the venv lives in $TWOPHASE_VENV (default: .venv in the repo).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="${1:-test,bench}"
VENV="${TWOPHASE_VENV:-$REPO/.venv}"
PY="${TWOPHASE_PYTHON:-python3.11}"

log() { printf '[setup %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }

apt_updated=0
need_apt() {  # need_apt BINARY PACKAGE...
  if ! command -v "$1" >/dev/null 2>&1; then
    if [ "$apt_updated" = 0 ]; then log "apt-get update"; apt-get update -qq; apt_updated=1; fi
    log "installing ${*:2}"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${@:2}" >/dev/null
  fi
}
need_apt java openjdk-17-jre-headless
need_apt mvn maven
command -v "$PY" >/dev/null 2>&1 || need_apt python3 python3 python3-venv
command -v "$PY" >/dev/null 2>&1 || PY=python3

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
fi
# uv (from PyPI, into the venv) installs the same pins as pip in less time; pip if uv cannot be
# had.  --compile-bytecode as pip does: where PYTHONDONTWRITEBYTECODE is set (it is on the CI
# machine) nothing else writes the .pyc files, and every Python process (each test's driver,
# each Spark Python worker) would compile its imports again: a full CI run took 71 min, not 60.
pip_install() {
  if "$VENV/bin/python" -m uv --version >/dev/null 2>&1; then
    "$VENV/bin/python" -m uv pip install -q --compile-bytecode --python "$VENV/bin/python" "$@"
  else
    "$VENV/bin/python" -m pip install -q "$@"
  fi
}
"$VENV/bin/python" -m pip install -q uv || log "uv not installed: pip installs the packages"
log "installing -e .[$EXTRAS] and its dependencies"
pip_install -e "$REPO[$EXTRAS]"
if [[ ",$EXTRAS," == *",test,"* ]]; then
  # moto's server needs boto3; pin it to the botocore that s3fs/aiobotocore chose, or pip backtracks.
  BOTOCORE=$("$VENV/bin/python" -c 'import botocore; print(botocore.__version__)')
  pip_install "moto[server]" "boto3==$BOTOCORE"
  # A real mount without hard links (vfat through FUSE) for tests/test_files_commit_edge_cases.py;
  # best effort: the tests skip, saying why, where FUSE is not available.
  need_apt mkfs.vfat dosfstools || log "dosfstools not installed: the vfat tests will skip"
  need_apt fusefat fusefat || log "fusefat not installed: the vfat tests will skip"
fi
# uv keeps every revision of a source distribution it built: pyspark, about 1.4 GB a fresh
# venv, so a machine that runs CI on clean clones filled its disk (39 GB after two days).
# prune drops what no revision in use points to, in seconds.
if "$VENV/bin/python" -m uv --version >/dev/null 2>&1; then
  "$VENV/bin/python" -m uv cache prune -q || log "uv cache prune failed: the cache keeps old builds"
fi
export PATH="$VENV/bin:$PATH"
export PYSPARK_PYTHON="$VENV/bin/python" PYSPARK_DRIVER_PYTHON="$VENV/bin/python"
log "ready: $("$VENV/bin/python" --version), $(java -version 2>&1 | head -1)"
