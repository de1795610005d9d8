#!/usr/bin/env bash
# The main job: set up (Java, venv, pyspark) and run the self-killing exactly-once demo on local files.
# Usage: bash scripts/demo.sh [twophase demo options...]   (see: twophase demo --help)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
source scripts/setup.sh all
exec twophase demo "$@"
