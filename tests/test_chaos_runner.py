"""twophase.chaos tells an injected fault from any other failure (issue 19), without Spark."""

from __future__ import annotations

import sys
import textwrap

from twophase import chaos

# A fake driver: a batch of work per run, recorded in a progress file; it reaches the crash
# point 'after_intent' (batch 0) and, with FAKE_EXIT=137, dies with 137 on its own.
DRIVER = textwrap.dedent("""
    import os, sys, time
    from twophase import crash
    progress = sys.argv[1]
    time.sleep(0.3)
    with open(progress, "a") as f:
        f.write("x")
    if os.environ.get("FAKE_EXIT"):
        os._exit(int(os.environ["FAKE_EXIT"]))
    crash.crash_point("after_intent", 0)
    time.sleep(float(os.environ.get("FAKE_WORK", "0")))
""")


def _cmd(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return [sys.executable, str(script), str(tmp_path / "progress")]


def _probe(tmp_path):
    p = tmp_path / "progress"
    return lambda: p.stat().st_size if p.exists() else 0


def test_a_crash_point_counts_as_fired_only_when_its_process_logged_it(tmp_path):
    runs = chaos.run_with_faults(_cmd(tmp_path), crash_points=["after_intent:0"], progress=lambda s: None)
    assert runs[0].outcome == "crash point fired" and runs[0].exit_code == 137
    assert runs[0].fired and runs[0].fired[0].startswith("after_intent 0 ")
    assert runs[-1].outcome == "completed"


def test_an_exit_137_that_no_crash_point_wrote_is_a_failure(tmp_path):
    crash_log = tmp_path / "crash.log"
    code, _ = chaos.run_once(_cmd(tmp_path), env={"FAKE_EXIT": "137"}, crash_at="after_intent:0",
                             crash_log=str(crash_log))
    assert code == 137 and not crash_log.exists()  # died with 137 before reaching its crash point
    assert chaos._outcome("crash:after_intent:0", code, []) == "failed"
    # run_with_faults reports it so, and a driver that never completes is an error.
    seen: list[str] = []
    try:
        chaos.run_with_faults(_cmd(tmp_path), crash_points=["after_intent:0"], env={"FAKE_EXIT": "137"},
                              max_final_runs=1, progress=seen.append)
    except RuntimeError as e:
        assert "did not complete" in str(e)
    else:
        raise AssertionError("a driver that never completes must raise")
    assert any("crash:after_intent:0: exit 137" in line and line.endswith(": failed") for line in seen), seen


def test_a_sigkill_is_timed_from_progress_and_reported_as_landed(tmp_path):
    code, secs = chaos.run_once(_cmd(tmp_path), env={"FAKE_WORK": "30"}, kill_after=0.5,
                                progress_probe=_probe(tmp_path))
    # Killed 0.5 s after the first progress (at ~0.3 s plus interpreter start), long before 30 s.
    assert code == -9 and 0.7 < secs < 10
    assert chaos._outcome("sigkill@0.5s", code, []) == "killed"
    code, _ = chaos.run_once(_cmd(tmp_path), kill_after=20.0, progress_probe=_probe(tmp_path))
    assert code == 0 and chaos._outcome("sigkill@20.0s", code, []) == "finished before the fault"
    runs = chaos.run_with_faults(_cmd(tmp_path), random_kills=1, kill_window=(0.5, 0.5), seed=1,
                                 env={"FAKE_WORK": "2"}, progress=lambda s: None,
                                 progress_probe=_probe(tmp_path))
    assert [r.outcome for r in runs] == ["killed", "completed"]
