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


def _run(n, fault, code, outcome, fired=(), progress=None):
    return chaos.Run(n, fault, code, 1.0, code == 0, outcome, list(fired), progress)


def _fails(runs, **kw) -> str:
    try:
        chaos.check_runs(runs, **kw)
    except AssertionError as e:
        return str(e)
    raise AssertionError(f"check_runs passed {runs}")


def test_check_runs_passes_only_faults_that_landed_where_and_when_they_were_aimed():
    done = _run(9, "none", 0, "completed", progress=10)
    good = [_run(1, "crash:mid_commit:2", 137, "crash point fired", ["mid_commit 2 11"], 4),
            _run(2, "crash:after_pre_commit", 1, "crash point fired", ["after_pre_commit 0 12"] * 4, 1),
            _run(3, "sigkill@3.0s", -9, "killed", progress=6), done]
    chaos.check_runs(good)
    # Each way a fault can miss is refused, with the run named.
    assert "failed" in _fails([_run(1, "crash:mid_commit", 1, "failed"), done])
    assert "did not fire" in _fails([_run(1, "crash:mid_commit", 0, "finished before the fault"), done])
    assert "another batch" in _fails([_run(1, "crash:mid_commit:2", 137, "crash point fired",
                                           ["mid_commit 3 11"]), done])
    assert "exited 1" in _fails([_run(1, "crash:mid_commit", 1, "crash point fired", ["mid_commit 0 1"]), done])
    assert "exited 137 at an executor point" in _fails(
        [_run(1, "crash:after_pre_commit", 137, "crash point fired", ["after_pre_commit 0 1"]), done])
    assert "was not killed" in _fails([_run(1, "sigkill@3.0s", 0, "finished before the fault"), done])
    assert "after the work was done" in _fails([_run(1, "sigkill@3.0s", -9, "killed", progress=10), done])
    chaos.check_runs([_run(1, "sigkill@3.0s", -9, "killed", progress=10), done], kills_mid_work=False)
    assert "never completed" in _fails([_run(1, "none", 1, "failed")])


def test_run_with_faults_records_progress_for_check_runs(tmp_path):
    runs = chaos.run_with_faults(_cmd(tmp_path), crash_points=["after_intent:0"], random_kills=1,
                                 kill_window=(0.5, 0.5), seed=1, env={"FAKE_WORK": "2"},
                                 progress=lambda s: None, progress_probe=_probe(tmp_path))
    assert [r.progress for r in runs] == [1, 2, 3]
    chaos.check_runs(runs)
