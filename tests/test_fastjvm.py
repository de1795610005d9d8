"""The class-data archives of tests/fastjvm.py are bounded: each fresh venv (each CI run on a
clean clone) makes one of about 190 MB, and only the three last used are kept."""

from __future__ import annotations

import os

from tests import fastjvm


def test_only_the_three_archives_last_used_are_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(fastjvm, "CACHE", tmp_path)
    made = []
    for i in range(6):
        p = tmp_path / f"spark-driver-{i:016x}.jsa"
        p.write_bytes(b"x")
        os.utime(p, (1000 + i, 1000 + i))
        made.append(p)
    other = tmp_path / "unrelated.txt"
    other.write_text("kept")
    os.utime(made[0], (5000, 5000))  # the oldest made, but used last: kept
    fastjvm._evict(keep=made[1])      # the one just made: kept whatever its time
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [made[0].name, made[1].name, made[5].name, other.name])


def test_eviction_keeps_all_when_there_are_three_or_fewer(tmp_path, monkeypatch):
    monkeypatch.setattr(fastjvm, "CACHE", tmp_path)
    for i in range(3):
        (tmp_path / f"spark-driver-{i:016x}.jsa").write_bytes(b"x")
    fastjvm._evict(keep=tmp_path / "spark-driver-0000000000000000.jsa")
    assert len(list(tmp_path.glob("*.jsa"))) == 3
