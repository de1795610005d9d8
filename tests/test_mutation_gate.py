"""The mutation gate (issue 60; docs/testing.md, "The mutation gate"): every mutant of a safety line in
tests/mutation/mutants.toml is killed by the fast tests it names; and the gate itself can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mutation.mutants import load

REPO = Path(__file__).resolve().parent.parent


def _gate(*args: str, mutants: Path | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    env = dict(os.environ, TWOPHASE_KEEP_SERVICES="1")
    if mutants is not None:
        env["TWOPHASE_MUTANTS"] = str(mutants)
    return subprocess.run([sys.executable, "-m", "tests.mutation", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_list_holds_at_least_forty_mutants_each_found_once_in_its_file():
    mutants = load()
    assert len(mutants) >= 40
    for m in mutants:
        text = (REPO / m.file).read_text()
        assert text.count(m.find) == 1, f"mutant {m.id}: its text occurs {text.count(m.find)} times in {m.file}"


def test_a_mutant_its_tests_do_not_kill_and_a_stale_one_fail_the_gate(tmp_path):
    listing = tmp_path / "mutants.toml"
    listing.write_text('''
[[mutant]]
id = "survives"
file = "twophase/evidence.py"
find = "        return int(m.group(1)) if m else None"
replace = "        return (int(m.group(1)) if m else None) or None"
why = "changes nothing a test can see"
tests = ["tests/test_log.py::test_checksum_catches_an_edited_record"]

[[mutant]]
id = "stale"
file = "twophase/evidence.py"
find = "this text is in no file"
replace = "x"
why = "its line is gone"
tests = ["tests/test_log.py::test_checksum_catches_an_edited_record"]

[[mutant]]
id = "killed"
file = "twophase/log_records.py"
find = "if not isinstance(body, dict) or hashlib.sha256(_canonical(body)).hexdigest() != obj.get(\\"sha256\\"):"
replace = "if not isinstance(body, dict):"
why = "the checksum ignored"
tests = ["tests/test_log.py::test_checksum_catches_an_edited_record"]
''')
    p = _gate(mutants=listing, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    lines = {ln.split()[1]: ln.split()[0] for ln in p.stdout.splitlines() if ln[:8].strip() in
             ("killed", "SURVIVED", "STALE")}
    assert lines == {"survives": "SURVIVED", "stale": "STALE", "killed": "killed"}, p.stdout
    assert "2 not" in p.stdout


@pytest.mark.mutation
@pytest.mark.timeout(1800)
def test_every_mutant_of_a_safety_line_is_killed_by_its_tests():
    p = _gate()
    sys.stdout.write(p.stdout)
    assert p.returncode == 0, f"the mutation gate failed:\n{p.stdout[-6000:]}\n{p.stderr[-2000:]}"
