"""benchmarks/report.py describes the machine a run measured on, not a fixed one."""

from __future__ import annotations

import os

from benchmarks import report


def _res(**extra) -> dict:
    params = {"quick": True, "rows": 10, "row_size": 100, "partitions": 2, "reps": 1, "warmup": 0,
              "trigger_interval": 1.0}
    return dict({"params": params, "started_at": "2026-11-28 00:00", "duration_s": 1.0, "machine": "x86_64",
                 "load_average": {"start_1min": 0.5, "end_1min": 0.7}, "sections": {}, "goals": []},
                **extra)


def test_the_report_names_the_machines_cpus_and_memory():
    md = report.markdown(_res(hardware={"cpus": 48, "memory_bytes": 64 * 2**30}))
    assert "The machine has 48 CPUs and 64.0 GiB of memory (load average 0.5 at the start, 0.7 at the end" in md
    assert "2-core" not in md
    # Results without the record (older runs): this machine, as os.cpu_count() reports it.
    assert f"The machine has {os.cpu_count()} CPUs and " in report.markdown(_res())
    hw = report.hardware()
    assert hw["cpus"] == os.cpu_count() and (hw["memory_bytes"] is None or hw["memory_bytes"] > 2**20)
