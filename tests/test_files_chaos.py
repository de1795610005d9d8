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

from twophase import crash

pytestmark = [pytest.mark.chaos, pytest.mark.spark]


@pytest.mark.parametrize("fmt", ["parquet"])
def test_every_crash_point_and_random_sigkills_lose_and_duplicate_nothing(tmp_path, fmt):
    workdir = tmp_path / "demo"
    r = subprocess.run(
        [sys.executable, "-m", "twophase.cli", "demo", "--workdir", str(workdir), "--files",
         str(len(crash.POINTS) + 2), "--records", "200", "--kills", "1", "--seed", "20261122",
         "--format", fmt, "--task-input", "rows", "--json"],
        capture_output=True, text=True, timeout=1500)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    verdict = json.loads(r.stdout)
    faults = [run["fault"] for run in verdict["runs"]]
    # Every named crash point was armed for its own batch, and the driver really died there.
    for i, point in enumerate(crash.POINTS):
        run = verdict["runs"][i]
        assert run["fault"] == f"crash:{point}:{i}"
        # An executor's Python worker dies at these two: the job, then the driver, fails (exit 1).
        expected_exit = 1 if point in ("before_begin", "after_pre_commit") else crash.EXIT_CODE
        assert run["exit_code"] == expected_exit, (point, run)
    assert sum(1 for f in faults if f.startswith("sigkill")) == 1
    assert verdict["runs"][-1]["completed"]
    assert verdict["records_in"] == (len(crash.POINTS) + 2) * 200
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
