"""``writeStream.format("twophase-files")`` (issue 28): the data source form of the protocol."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from twophase import chaos

pytestmark = [pytest.mark.spark]

REPO = Path(__file__).resolve().parent.parent


def _inputs(folder: Path, files: int, rows: int) -> list[str]:
    folder.mkdir()
    expected = []
    for f in range(files):
        ids = [f"f{f}-{i:04d}" for i in range(rows)]
        expected += ids
        (folder / f"f{f:03d}.json").write_text("".join(json.dumps({"id": i, "n": n}) + "\n" for n, i in enumerate(ids)))
    return expected


def _read(out: Path) -> list[str]:
    import pyarrow.parquet as pq

    return [i for p in sorted(out.glob("*.parquet")) for i in pq.read_table(p).column("id").to_pylist()]


@pytest.mark.chaos
@pytest.mark.timeout(900)
def test_files_data_source_every_id_once_across_driver_kills_and_worker_crash_points(tmp_path):
    expected = _inputs(tmp_path / "in", files=8, rows=100)
    out, ck = tmp_path / "out", tmp_path / "ck"
    cmd = [sys.executable, "-m", "tests.drivers.datasource_pipeline", str(tmp_path / "in"), str(out), str(ck)]
    # after_intent fires in the planner worker, the others in the commit worker: each kills a Python
    # worker of the driver JVM, which fails the query; the SIGKILLs end the whole driver.
    points = ["after_intent:1", "after_prepared_logged:3", "mid_commit:5"]
    runs = chaos.run_with_faults(cmd, crash_points=points, random_kills=2, kill_window=(8.0, 20.0), seed=28,
                                 env={"PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))},
                                 log_path=str(tmp_path / "driver.log"), timeout=400)
    assert runs[-1].completed
    verdict = chaos.verify(expected, _read(out))
    assert verdict.exactly_once, (verdict.to_dict(), [r.to_dict() for r in runs])
    staged = [p for p in (out / "_twophase").rglob("*") if p.is_file()] if (out / "_twophase").exists() else []
    assert staged == []
