"""The ownership harness (twophase.testing.ownership) finds issue 25's scenarios on a406f01's code.

Each test runs the harness as a sink author would, against a406f01's protocol behaviour (a protocol
subclass, scenarios 1 and 2) or a406f01's sinks (loaded from git, scenarios 4, 5 and 6), and
asserts that it FAILS, naming the problem; and that today's protocol and sinks pass.  Seeds are
pinned so that each run is the same; ``python -m tests.harness_reach --runs 20`` measures how
often an unpinned run at the defaults catches each one.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import hypothesis
import pytest

from tests.harness_reach import (
    CheckThenWriteProtocol,
    PostgresTarget,
    WholeIntentCleanupProtocol,
    files_target,
    load_old_sink,
)
from twophase.testing import ConformanceError
from twophase.testing.conformance import default_settings
from twophase.testing.ownership import DEFAULT_EXAMPLES, DEFAULT_STEPS, run_ownership_conformance

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.timeout(600)]
# The defaults, without shrinking: a shrunk story is what a sink author wants, but here it only
# costs minutes; the failure is the point.
FIND = hypothesis.settings(default_settings(DEFAULT_EXAMPLES, DEFAULT_STEPS),
                           phases=[hypothesis.Phase.explicit, hypothesis.Phase.generate])


def _has_old() -> bool:
    return subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", "a406f01:sinks/files.py"],
                          capture_output=True).returncode == 0


needs_old = pytest.mark.skipif(not _has_old(), reason="a406f01 is not in this checkout's git history")


@pytest.fixture
def out_dir(tmp_path):
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        d = tempfile.mkdtemp(prefix="twophase-own-", dir="/dev/shm")
        yield Path(d)
        shutil.rmtree(d, ignore_errors=True)
    else:
        yield tmp_path


def test_todays_protocol_and_filesink_pass(out_dir):
    stats = run_ownership_conformance(**files_target(str(out_dir / "out")), max_examples=10, seed=7)
    assert stats["examples"] == 10 and stats["takeovers"] > 0


def test_scenario_1_a_deposed_owners_whole_intent_cleanup_is_caught(out_dir):
    with pytest.raises(ConformanceError) as e:
        run_ownership_conformance(**files_target(str(out_dir / "out")), protocol_factory=WholeIntentCleanupProtocol,
                                  settings=FIND, seed=1)
    assert "DATA LOSS" in str(e.value) or "missing although the log decided" in str(e.value)



def test_scenario_2_a_decision_delayed_past_a_takeover_is_caught(out_dir):
    with pytest.raises(ConformanceError) as e:
        run_ownership_conformance(**files_target(str(out_dir / "out")), protocol_factory=CheckThenWriteProtocol,
                                  settings=FIND, seed=1)
    msg = str(e.value)
    assert "deposed coordinator" in msg or "commit decisions" in msg or "DATA LOSS" in msg, msg


@needs_old
def test_scenario_5_old_filesink_unscoped_names_are_caught(out_dir):
    old = load_old_sink("sinks/files.py").FileSink
    with pytest.raises(ConformanceError) as e:
        run_ownership_conformance(**files_target(str(out_dir / "out"), old), settings=FIND, seed=1)
    msg = str(e.value)
    assert "second pipeline" in msg or "missing although" in msg or "appears" in msg, msg


@pytest.mark.postgres
def test_a_late_stage_retry_cannot_roll_back_a_decided_postgres_attempt(postgres_service):
    """Was a FINDING on the PostgresSink (seed 7, its first example): a late attempt of a decided
    partition with the next attempt number of the same run (a stage retry's task, SPARK-24589,
    beginning after the decision) rolled back the decided gid by the sink's retry rule (lower
    attempt of the same run), and the commit found it gone: DATA LOSS.  Now the driver claims
    every gid as decided before the decision, and a retry rolls back only what it could claim
    as doomed (the claims table, docs/postgres.md): the same run passes."""
    t = PostgresTarget(postgres_service["dsn"])
    try:
        stats = run_ownership_conformance(**t.kwargs(), settings=FIND, max_examples=10, seed=7)
    finally:
        with t.admin.cursor() as cur:  # the claims table open() made beside the target's marker table
            cur.execute(f'DROP TABLE IF EXISTS "{t.markers}_claims"')
        t.close()
    assert stats["examples"] == 10, stats
    assert stats.get("late task between_decision_and_commit", 0) > 0, stats  # the finding's timing was played


@pytest.mark.postgres
@needs_old
def test_scenarios_4_and_6_old_postgres_sink_is_caught(postgres_service):
    old = load_old_sink("sinks/postgres.py").PostgresSink
    t = PostgresTarget(postgres_service["dsn"], old)
    try:
        with pytest.raises(ConformanceError) as e:
            run_ownership_conformance(**t.kwargs(), settings=FIND, seed=1)
    finally:
        t.close()
    msg = str(e.value)
    assert "still open" in msg or "DATA LOSS" in msg or "missing although" in msg, msg
