"""The README's commands in the order a new user meets them (issue 26, item 2): after
``bash scripts/demo.sh`` (a venv with the ``all`` extras only) ``python -m tests.services start all``
must not stop at ``No module named 'cryptography'``: the Kafka service installs what it needs, as
the S3 service installs moto's server."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_kafka_service_installs_the_python_packages_it_needs(monkeypatch):
    from tests.services import kafka

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "cryptography" else real_find_spec(name, *a))
    ran: list[list[str]] = []
    monkeypatch.setattr(subprocess, "run",
                        lambda cmd, **kw: ran.append(cmd) or subprocess.CompletedProcess(cmd, 0, "", ""))
    monkeypatch.setattr(kafka.KafkaService, "jars", lambda self: [])
    kafka.KafkaService().install()
    assert ran == [[sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "cryptography>=42"]]


def test_the_readme_sets_up_the_venv_before_the_services_and_benchmarks_commands():
    # The benchmarks' commands moved from the README to docs/benchmarks.md (issue 47).
    page = (REPO / "docs" / "benchmarks.md").read_text()
    bench = page.split("\n## How to run\n", 1)[1]
    first = next(line for line in bench.split("```bash", 1)[1].splitlines() if line.strip())
    assert re.match(r"bash scripts/setup\.sh( test,bench)? && (source|\.) \.venv/bin/activate", first), first
    demo = (REPO / "scripts" / "demo.sh").read_text()
    assert "source scripts/setup.sh" in demo
