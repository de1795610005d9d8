"""Kill the real driver of a file-source -> Spark -> FileSink pipeline at every crash point and at
random moments (SIGKILL of its whole process group); count the committed output by record id.

Its tasks take the rows path (``task_input="rows"``) on every batch: each restart's first batch is
the one its crash point hits, and ``"auto"`` sends a coordinator's first batch down the Arrow path,
which the PostgreSQL and Kafka kill tests' crash points meet."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from twophase import chaos, crash

pytestmark = [pytest.mark.chaos, pytest.mark.spark]


@pytest.mark.parametrize("fmt", ["parquet"])
def test_every_crash_point_and_random_sigkills_lose_and_duplicate_nothing(tmp_path, fmt):
    workdir = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "demo", "--workdir", str(workdir), "--files",
         str(len(crash.POINTS) + 8), "--records", "200", "--kills", "1", "--seed", "20261122",
         "--format", fmt, "--task-input", "rows", "--json"],
        capture_output=True, text=True, timeout=1500)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    verdict = json.loads(r.stdout)
    runs = [chaos.Run(**run) for run in verdict["runs"]]
    # Every named crash point was armed for its own batch...
    assert [r.fault for r in runs[:len(crash.POINTS)]] == [f"crash:{p}:{i}" for i, p in enumerate(crash.POINTS)]
    assert sum(r.fault.startswith("sigkill") for r in runs) == 1, verdict["runs"]
    # ...and fired there, in the process it is aimed at (the crash log names point and batch):
    # before_begin and after_pre_commit in an executor's Python worker (the job, then the driver,
    # fails), the others in the driver, which exits 137.  The SIGKILL ended a run (timed from the
    # demo's progress probe, the transaction log's records) below the completing run's count:
    # mid-work.  No run failed otherwise; the last one completed.
    chaos.check_runs(runs)
    assert verdict["records_in"] == (len(crash.POINTS) + 8) * 200
    assert verdict["lost"] == 0, verdict["lost_sample"]
    assert verdict["duplicated"] == 0, verdict["duplicated_sample"]
    assert verdict["unexpected"] == 0
    assert verdict["records_out"] == verdict["records_in"]
    assert verdict["staging_files_left"] == 0
    assert r.returncode == 0
    # Every batch was written on the rows path (the driver's log names each batch's path).
    paths = re.findall(r"batch \d+ \w+: \d+ rows, \d+ handles, tasks' input (\w+)",
                       (workdir / "driver.log").read_text())
    assert len(paths) >= len(crash.POINTS) and set(paths) <= {"rows", "none"} and "rows" in paths, paths
