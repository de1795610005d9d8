"""``python -m benchmarks.ab``: pooling of the runs, the base commit's worktree, its arguments."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import ab


def _results(**variants_by_target) -> dict:
    """A results.json of two sections: one flat (kafka), one by target (files)."""
    return {"sections": {
        "kafka": {"variants": {k: {"seconds": v} for k, v in variants_by_target.pop("kafka").items()}},
        "files": {"targets": {t: {"variants": {k: {"seconds": v} for k, v in vs.items()}}
                              for t, vs in variants_by_target.items()}},
    }}


def test_every_repetition_of_every_run_is_pooled_per_commit():
    runs = {
        "new": [_results(kafka={"ours": [1.0, 3.0], "spark": [2.0]}, local={"FileSink": [0.5]}),
                _results(kafka={"ours": [2.0], "spark": [2.0]}, local={"FileSink": [0.7, 0.9]})],
        "base": [_results(kafka={"ours": [1.0], "spark": [4.0]}, local={"FileSink": [1.0]}),
                 _results(kafka={"ours": [1.0, 1.0], "spark": [2.0]}, local={"FileSink": [2.0]})],
    }
    rows = {(r["target"], r["variant"]): r for r in ab.summarize(runs)}
    assert set(rows) == {("kafka", "ours"), ("kafka", "spark"), ("local", "FileSink")}
    assert rows[("kafka", "ours")] == {"target": "kafka", "variant": "ours", "new_median_s": 2.0, "new_n": 3,
                                       "base_median_s": 1.0, "base_n": 3, "new_over_base": 2.0}
    assert rows[("kafka", "spark")]["new_over_base"] == pytest.approx(2.0 / 3.0, abs=1e-3)
    assert rows[("local", "FileSink")]["new_median_s"] == 0.7
    assert rows[("local", "FileSink")]["base_median_s"] == 1.5
    md = ab.markdown(ab.summarize(runs), "abc123", ["--only", "kafka"], 2)
    assert "| kafka | ours | 2.000 (3) | 1.000 (3) | 2.000 |" in md


def test_each_runs_ratio_against_its_own_baseline_is_kept_per_run_with_its_median():
    def run(ours: float, files: float) -> dict:
        return {"sections": {"kafka": {"ratios": {"ours / spark": ours, "note": "n/a"}},
                             "files": {"ratios": {"FileSink / parquet": files}}}}

    runs = {"new": [run(1.2, 1.0), run(0.8, 1.1), run(1.0, 0.9)], "base": [run(0.9, 1.0), run(0.7, 1.0)]}
    rows = {r["ratio"]: r for r in ab.run_ratios(runs)}
    assert set(rows) == {"ours / spark", "FileSink / parquet"}  # a value that is not a number is left out
    assert rows["ours / spark"]["new"] == [1.2, 0.8, 1.0] and rows["ours / spark"]["new_median"] == 1.0
    assert rows["ours / spark"]["base_median"] == pytest.approx(0.8)
    md = ab.markdown([], "abc123", [], 3, ab.run_ratios(runs))
    assert "| ours / spark | 1.20, 0.80, 1.00 | 1.00 | 0.90, 0.70 | 0.80 |" in md


def test_a_variant_measured_on_one_side_only_is_left_out():
    runs = {"new": [_results(kafka={"ours": [1.0], "only-new": [1.0]})],
            "base": [_results(kafka={"ours": [1.0]})]}
    assert [r["variant"] for r in ab.summarize(runs)] == ["ours"]


def test_the_base_worktree_imports_the_packages_under_their_installed_names(tmp_path):
    head = subprocess.run(["git", "-C", str(ab.REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()
    wt = ab._worktree(head, tmp_path / "base")
    try:
        ab._check_imports(wt, str(wt))
        code = ("import twophase, twophase.sinks.files as f, twophase.coordinator as c; "
                "print(twophase.__file__); print(f.__file__); print(c.__file__)")
        out = subprocess.run([sys.executable, "-c", code], cwd=wt, env={"PYTHONPATH": str(wt), "PATH": "/usr/bin"},
                             capture_output=True, text=True, check=True).stdout.split()
        assert [p.startswith(str(wt)) for p in out] == [True, True, True], out
        # Without the worktree on the path, the editable install's modules answer: refused.
        (wt / "twophase" / "sinks").unlink()
        with pytest.raises(SystemExit, match="does not import as twophase"):
            ab._check_imports(wt, str(wt))
    finally:
        subprocess.run(["git", "-C", str(ab.REPO), "worktree", "remove", "--force", str(wt)], check=True)


def test_out_after_the_separator_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        ab.main(["--base", "HEAD", "--out", str(tmp_path), "--", "--only", "kafka", "--out", "x"])
    assert e.value.code == 2
    assert "give --out before '--'" in capsys.readouterr().err


def test_kafka_spark_tasks_summary_pools_runs_and_measures_lead_and_tail_per_batch():
    from benchmarks import kafka_spark_tasks as kst

    def task(run, batch, begin, t0, t1):
        return {"run": run, "batch": batch, "begin_ms": begin, "write_ms": 100.0, "pre_commit_ms": 5.0,
                "t_begin": t0, "t_end": t1}

    def job(run, batch, t0, t1, intent=None):
        return {"run": run, "batch": batch, "t_job0": t0, "t_job1": t1, "intent_ms": intent, "prepare_ms": 300.0,
                "commit_ms": 9.0, "total_ms": 320.0}

    tasks = [task(1, 0, 99.0, 0.0, 9.0),  # a batch below skip: left out
             task(1, 2, 10.0, 10.10, 10.40), task(1, 2, 20.0, 10.12, 10.45),
             task(2, 2, 30.0, 20.20, 20.50)]
    tasks[1]["begin_requests"] = [["describe_transactions", 4.0], ["describe_transactions", 2.0],
                                  ["init_producer_id", 5.0]]
    tasks[2]["begin_requests"] = [["describe_transactions", 6.0], ["init_producer_id", 7.0]]
    jobs = [job(1, 0, 0.0, 9.9), job(1, 2, 10.0, 10.5, 4.0), job(2, 2, 20.0, 20.6)]
    s = kst.summarize(tasks, jobs)
    assert (s["tasks"], s["batches"]) == (3, 2)
    assert s["begin_ms"] == 20.0
    assert s["lead_ms"] == pytest.approx(150.0, abs=0.2)  # 100 ms (run 1) and 200 ms (run 2)
    assert s["tail_ms"] == pytest.approx(75.0, abs=0.2)   # 50 ms and 100 ms
    assert s["intent_ms"] == 4.0  # a commit that does not report it counts as missing, not as 0
    assert s["requests"] == {"begin: describe_transactions": {"per_task": 1.0, "median_ms": 4.0},
                             "begin: init_producer_id": {"per_task": 0.67, "median_ms": 6.0}}


def test_a_benchmarks_scratch_folders_are_removed_when_it_exits(tmp_path):
    code = ("from benchmarks.common import tmpdir; import pathlib; p = pathlib.Path(tmpdir('t')); "
            "(p / 'f').write_bytes(b'x' * 1000); print(p)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ab.REPO, capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    assert path and "twophase-bench-t-" in path
    assert not os.path.exists(path)
